//! Claims: how much a partition's worker pulls from the broker, how long each claim
//! waits, and what a failed one costs.
//!
//! The worker pulls for itself, only what it has room for, so the backlog stays in the
//! broker: a claim asks for at most `capacity` less what is claimed and not finished
//! yet (an ordered partition's commit window, a queue input's concurrency). While the
//! partition is paused it claims only for the steps an operator allowed. One claim is
//! out at a time. A claim that comes back empty makes the next one wait longer, up to
//! the idle wait (a message ends a waiting claim at once, so the longer wait costs no
//! latency, and idle partitions renew their claims less often). A failed claim backs
//! off on [`CLAIM_FAILED`]; the first failure and every tenth are announced, and so is
//! the first claim the broker answers after them.

use super::event::{Event, sealed};
use super::{Delivered, Partition};
use crate::backoff::{Backoff, CLAIM_FAILED};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a worker claims (the same for all the slots of a container).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimRules {
    /// Messages the worker may hold at once (claimed, not yet finished).
    pub capacity: usize,
    /// How long one claim waits for messages.
    pub wait: Duration,
    /// How long a claim waits once claims keep coming back empty (at least `wait`).
    pub idle_wait: Duration,
}

impl ClaimRules {
    /// The wait of a claim after `empty` empty claims in a row: `wait`, doubling per
    /// empty claim, at most `idle_wait` (and never less than `wait`).
    pub fn wait_after(&self, empty: u32) -> Duration {
        Backoff::doubling(self.wait, self.idle_wait.max(self.wait), 0.0).base(empty.saturating_add(1))
    }
}

/// A claim to send ([`Partition::poll_claim`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimRequest {
    /// At most this many messages.
    pub max: usize,
    /// Waiting at most this long for them.
    pub wait: Duration,
}

/// The claims of one worker.
#[derive(Debug, Clone, Default)]
pub(super) struct Pull {
    /// `None` until the worker is given its rules: it claims nothing. (Shared: a node
    /// may hold thousands of partitions with the same rules.)
    rules: Option<Arc<ClaimRules>>,
    /// Claimed and not yet credited back (finished, dropped or handed back).
    pub(super) outstanding: usize,
    /// A claim is out.
    out: bool,
    /// Claims in a row that came back empty.
    empty: u32,
    /// Claims in a row that failed.
    failures: u32,
    /// After a failed claim: none is sent before this.
    resume_at: Option<Instant>,
    /// While paused: messages an operator let through that are not claimed yet.
    steps: u32,
}

/// The claim came back with `0` messages (none may be).
#[derive(Debug)]
pub struct ClaimReturned(pub usize);

/// The claim failed (the broker is unreachable or refused it); `sample` is uniform in
/// `[0, 1)` for the back-off's jitter.
#[derive(Debug)]
pub struct ClaimFailed {
    /// Uniform in `[0, 1)`.
    pub sample: f64,
}

/// What a failed claim costs ([`ClaimFailed`]'s answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimRetry {
    /// No claim is sent for this long.
    pub after: Duration,
    /// Failures in a row, this one included.
    pub failures: u32,
    /// Worth telling the operator (the first failure and every tenth).
    pub announce: bool,
}

impl sealed::Sealed for ClaimReturned {}
impl<M: Delivered> Event<M> for ClaimReturned {
    /// Whether the broker answered after claims that failed (worth announcing).
    type Reply = bool;
    fn apply(self, part: &mut Partition<M>, _: Instant) -> bool {
        let pull = &mut part.pull;
        pull.out = false;
        pull.outstanding += self.0;
        pull.empty = if self.0 == 0 { pull.empty.saturating_add(1) } else { 0 };
        pull.resume_at = None;
        std::mem::take(&mut pull.failures) > 0
    }
}

impl sealed::Sealed for ClaimFailed {}
impl<M: Delivered> Event<M> for ClaimFailed {
    type Reply = ClaimRetry;
    fn apply(self, part: &mut Partition<M>, now: Instant) -> ClaimRetry {
        let pull = &mut part.pull;
        pull.out = false;
        pull.failures = pull.failures.saturating_add(1);
        let after = CLAIM_FAILED.wait(pull.failures, self.sample);
        pull.resume_at = Some(now + after);
        ClaimRetry { after, failures: pull.failures, announce: pull.failures == 1 || pull.failures.is_multiple_of(10) }
    }
}

impl Pull {
    pub(super) fn new(rules: Option<Arc<ClaimRules>>) -> Self {
        Self { rules, ..Self::default() }
    }

    /// A pause or a resume forgets the steps not claimed yet.
    pub(super) fn paused_or_resumed(&mut self) {
        self.steps = 0;
    }

    /// An operator let one more message through the pause.
    pub(super) fn stepped(&mut self) {
        self.steps = self.steps.saturating_add(1);
    }

    /// When a claim may be sent again after a failed one.
    pub(super) fn resume_at(&self) -> Option<Instant> {
        self.resume_at
    }

    /// Time passed to `now`: a failed claim's back-off that is over is forgotten (it is
    /// no deadline any more).
    pub(super) fn back_off_over(&mut self, now: Instant) {
        if self.resume_at.is_some_and(|at| at <= now) {
            self.resume_at = None;
        }
    }
}

impl<M: Delivered> Partition<M> {
    /// The claims' rules of this worker (before its first claim; without them it
    /// claims nothing).
    pub fn set_claims(&mut self, rules: Arc<ClaimRules>) {
        self.pull = Pull::new(Some(rules));
    }

    /// The claim to send now, if one is due: none while one is out, while a failed one
    /// backs off, once the worker stops or ended, or without room (while paused, room
    /// only for the steps allowed). The worker sends it and reports
    /// [`ClaimReturned`] or [`ClaimFailed`].
    pub fn poll_claim(&mut self, now: Instant) -> Option<ClaimRequest> {
        let paused = self.state.is_paused();
        if self.life != super::stop::Life::Running {
            return None;
        }
        let credit = self.credit;
        let pull = &mut self.pull;
        let (capacity, wait) = match pull.rules.as_deref() {
            Some(rules) => (rules.capacity, rules.wait_after(pull.empty)),
            None => return None,
        };
        pull.back_off_over(now);
        if pull.out || pull.resume_at.is_some() {
            return None;
        }
        let mut room = capacity.saturating_sub(pull.outstanding.saturating_sub(credit));
        if paused {
            room = room.min(pull.steps as usize);
            pull.steps = 0;
        }
        if room == 0 {
            return None;
        }
        pull.out = true;
        Some(ClaimRequest { max: room, wait })
    }

    /// A claim is out (the worker must not report its end before it is back when
    /// someone else may consume the partition next).
    pub fn claim_out(&self) -> bool {
        self.pull.out
    }

    /// Messages claimed and not finished yet (dropped and handed-back ones count as
    /// finished).
    pub fn outstanding(&self) -> usize {
        self.pull.outstanding.saturating_sub(self.credit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::intake::Discipline;
    use crate::partition::machine::event as ev;
    use crate::partition::machine::tests::{Msg, config, partition};

    fn ordered_part() -> Partition<Msg> {
        partition(config(Discipline::Ordered), 4)
    }

    /// A fixed origin plus `ms` milliseconds.
    fn at(ms: u64) -> Instant {
        thread_local!(static T0: Instant = Instant::now());
        T0.with(|t0| *t0 + Duration::from_millis(ms))
    }

    fn rules(capacity: usize) -> ClaimRules {
        ClaimRules { capacity, wait: Duration::from_secs(1), idle_wait: Duration::from_secs(5) }
    }

    #[test]
    fn idle_claims_wait_longer_up_to_the_idle_wait() {
        let r = rules(1);
        let waits: Vec<u64> = (0..6).map(|n| r.wait_after(n).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 5, 5, 5]);
        assert_eq!(r.wait_after(u32::MAX), r.idle_wait, "no overflow");
        // Cluster mode: the idle wait is the claim wait.
        let same = ClaimRules { idle_wait: r.wait, ..r };
        assert_eq!(same.wait_after(7), r.wait);
        // An idle wait below the claim wait never shortens it.
        let below = ClaimRules { idle_wait: Duration::from_millis(10), ..r };
        assert_eq!(below.wait_after(3), r.wait);
    }

    #[test]
    fn claims_only_what_there_is_room_for_one_at_a_time() {
        let mut p = ordered_part();
        assert_eq!(p.poll_claim(at(0)), None, "no rules, no claims");
        p.set_claims(Arc::new(rules(10)));
        let c = p.poll_claim(at(0)).expect("room for ten");
        assert_eq!(c, ClaimRequest { max: 10, wait: Duration::from_secs(1) });
        assert_eq!(p.poll_claim(at(0)), None, "one claim out at a time");
        assert!(!p.handle(ev::ClaimReturned(4), at(0)), "nothing failed before");
        assert_eq!(p.outstanding(), 4);
        assert_eq!(p.poll_claim(at(0)).map(|c| c.max), Some(6));
        p.handle(ev::ClaimReturned(6), at(0));
        assert_eq!(p.poll_claim(at(0)), None, "full");
        // Dropped deliveries give their room back, as soon as the machine decides it.
        p.handle(ev::Dropped(3), at(0));
        assert_eq!(p.outstanding(), 7);
        assert_eq!(p.poll_claim(at(0)).map(|c| c.max), Some(3));
        // The credit polled as an effect is the same room, not twice as much.
        while p.poll_effect().is_some() {}
        assert_eq!(p.outstanding(), 7);
    }

    #[test]
    fn empty_claims_wait_longer_and_a_message_resets_the_wait() {
        let mut p = ordered_part();
        p.set_claims(Arc::new(rules(10)));
        for expected in [1, 2, 4, 5] {
            assert_eq!(p.poll_claim(at(0)).map(|c| c.wait.as_secs()), Some(expected));
            p.handle(ev::ClaimReturned(0), at(0));
        }
        p.poll_claim(at(0)).expect("claim");
        p.handle(ev::ClaimReturned(1), at(0));
        assert_eq!(p.poll_claim(at(0)).map(|c| c.wait.as_secs()), Some(1));
    }

    #[test]
    fn a_failed_claim_backs_off_and_announces_the_first_and_every_tenth() {
        let mut p = ordered_part();
        p.set_claims(Arc::new(rules(10)));
        let mut announced = Vec::new();
        let mut now = at(0);
        for n in 1..=20u32 {
            p.poll_claim(now).expect("a claim is due after the back-off");
            let retry = p.handle(ev::ClaimFailed { sample: 0.5 }, now);
            assert_eq!(retry.failures, n);
            assert!(retry.after > Duration::ZERO);
            assert_eq!(p.poll_timeout(now), Some(now + retry.after), "the back-off is a deadline");
            assert_eq!(p.poll_claim(now + retry.after - Duration::from_millis(1)), None, "backing off");
            if retry.announce {
                announced.push(n);
            }
            now += retry.after;
        }
        assert_eq!(announced, [1, 10, 20]);
        p.poll_claim(now).expect("claim");
        assert!(p.handle(ev::ClaimReturned(0), now), "the broker is back: announce it");
        p.poll_claim(now).expect("claim");
        assert!(!p.handle(ev::ClaimReturned(0), now), "once");
    }

    #[test]
    fn paused_claims_only_for_steps_and_a_stop_claims_nothing() {
        let mut p = ordered_part();
        p.set_claims(Arc::new(rules(10)));
        p.handle(ev::Paused, at(0));
        assert_eq!(p.poll_claim(at(0)), None, "paused");
        assert!(p.handle(ev::Stepped, at(0)));
        assert!(p.handle(ev::Stepped, at(0)));
        assert_eq!(p.poll_claim(at(0)).map(|c| c.max), Some(2), "one per step");
        p.handle(ev::ClaimReturned(0), at(0));
        assert_eq!(p.poll_claim(at(0)), None, "the steps were claimed for");
        assert!(p.handle(ev::Stepped, at(0)));
        p.handle(ev::Resumed, at(0));
        assert_eq!(p.poll_claim(at(0)).map(|c| c.max), Some(10), "resumed: the whole room");
        p.handle(ev::ClaimReturned(0), at(0));
        p.handle(ev::StopAsked, at(0));
        assert_eq!(p.poll_claim(at(0)), None, "stopping");
    }
}
