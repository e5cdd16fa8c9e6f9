//! The partition machine's clocks: its deadlines, armed only while needed, and what
//! happens when one comes.

use super::{AckKind, Delivered, Partition, progress_due};
use std::time::{Duration, Instant};

/// How long things may wait.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Completions wait at most this long for a commit.
    pub commit_interval: Duration,
    /// The broker redelivers what is not acknowledged (or kept alive) for this long.
    pub ack_wait: Duration,
    /// A callback running longer than this fails the task.
    pub callback_timeout: Option<Duration>,
}

impl Timing {
    /// Held messages are kept alive this often (a third of ack-wait).
    pub fn keep_alive_every(&self) -> Duration {
        (self.ack_wait / 3).max(Duration::from_millis(50))
    }

    /// Running callbacks are checked this often (a quarter of their timeout).
    pub fn check_every(&self) -> Option<Duration> {
        self.callback_timeout.map(|t| (t / 4).max(Duration::from_millis(10)))
    }
}

/// How long a dead letter that could not be stored waits before it is tried again.
pub const DEAD_LETTER_RETRY: Duration = Duration::from_secs(1);

impl<M: Delivered> Partition<M> {
    /// Arms the deadlines the partition needs as of `now` (the commit interval once
    /// completions wait, keep-alives while anything is held, the callback check while
    /// callbacks run; none for an idle partition) and returns the earliest of them and
    /// of the retries' and a failed claim's back-offs: when to call [`handle_timeout`](Self::handle_timeout).
    pub fn poll_timeout(&mut self, now: Instant) -> Option<Instant> {
        let timing = self.config.timing;
        if self.commit_at.is_none() && self.state.uncommitted() {
            self.commit_at = Some(now + timing.commit_interval);
        }
        if self.keep_alive_at.is_none() && self.holds() {
            self.keep_alive_at = Some(now + timing.keep_alive_every());
        }
        if let Some(every) = timing.check_every()
            && self.check_at.is_none()
            && self.state.in_flight() > 0
        {
            self.check_at = Some(now + every);
        }
        [
            self.commit_at,
            self.keep_alive_at,
            self.check_at,
            self.backing_off.first().map(|(at, _)| *at),
            self.pull.resume_at(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Time passed to `now`: what was due happens (retries become due, a commit is
    /// requested, held messages are kept alive). Returns the first message whose
    /// callback ran past its timeout, if one did: the task fails.
    pub fn handle_timeout(&mut self, now: Instant) -> Option<u64> {
        self.pull.back_off_over(now);
        while let Some(&(at, order)) = self.backing_off.first()
            && at <= now
        {
            self.backing_off.pop_first();
            self.retries.push_back(order);
        }
        if self.commit_at.is_some_and(|at| at <= now) {
            self.commit_at = None;
            if self.state.uncommitted() {
                self.state.request_commit();
            }
        }
        if self.keep_alive_at.is_some_and(|at| at <= now) {
            self.keep_alive_at = None;
            self.keep_alive(now);
        }
        if self.check_at.is_some_and(|at| at <= now) {
            self.check_at = None;
            if let Some(timeout) = self.config.timing.callback_timeout {
                return self.state.timed_out(now, timeout).first().copied();
            }
        }
        None
    }

    /// In-progress acks for what is held and was not kept alive for a third of
    /// ack-wait: claims of an ordered input, running messages of a queue input.
    pub(super) fn keep_alive(&mut self, now: Instant) {
        let ack_wait = self.config.timing.ack_wait;
        if self.ordered() {
            for c in self.claims.values_mut() {
                if progress_due(c.at, now, ack_wait) {
                    c.at = now;
                    self.acks.push((c.token.clone(), AckKind::InProgress));
                }
            }
        } else {
            for h in self.held.values() {
                if h.started.is_some_and(|s| progress_due(s, now, ack_wait)) {
                    self.acks.push((h.msg.token().clone(), AckKind::InProgress));
                }
            }
        }
    }
}
