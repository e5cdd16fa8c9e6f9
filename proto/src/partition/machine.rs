//! The per-partition machine: one worker's messages from claim to acknowledgement, and
//! what finishes them. Events come in through [`Partition::handle`] with the time (and,
//! where a wait is jittered, a uniform sample) passed in, one type per event in
//! [`event`], each with its typed answer; what the worker must do goes out as
//! [`Effect`]s through [`Partition::poll_effect`], what it runs next through
//! [`Partition::next`], and when to come back through [`Partition::poll_timeout`] and
//! [`Partition::handle_timeout`]. No I/O, no clock, no randomness of its own.
//!
//! It owns the facts the worker used to keep beside the readiness machine, so each has
//! one owner: which messages are held and in which attempt, which of them count as in
//! flight (the readiness machine's count moves only here), which wait out a retry
//! back-off, which are claimed and not committed yet (with when they were last kept
//! alive), which delivery made the last commit, and what was handed back mid-retry.
//!
//! Rules (DESIGN §6 and §7):
//!
//! * **attempts** — a message's attempt is its delivery count, at least one more than
//!   the restores it forced before; one whose restores spent its attempts is
//!   dead-lettered without running;
//! * **failure** — a failed attempt is retried in place after the policy's back-off
//!   (ordered: the partition waits), nak'd with it (queue), or dead-lettered on the
//!   last attempt; an unavailable dependency is retried without costing an attempt up
//!   to a ceiling, on the [`UNAVAILABLE`] back-off;
//! * **finishing** — a queue message is acked once its outputs are stored, terminated
//!   once its dead letter is; an ordered one completes in place and the commit covers
//!   it in order;
//! * **commits** — one ack-all of the last claimed delivery at the committable
//!   position; due once per window of completions or when the partition is idle;
//! * **hand-backs** — a stop hands back what has not started and what waits out a
//!   back-off (queue: nak without delay; ordered: nothing, the next owner resets);
//!   once something was handed back mid-retry, nothing after it may be committed;
//! * **keep-alive** — held messages get an in-progress ack every third of ack-wait;
//! * **time** — the machine keeps its own deadlines (retries, the commit interval,
//!   keep-alives, the callback-timeout check), armed only while needed so an idle
//!   partition has none: the worker asks [`Partition::poll_timeout`] for the earliest
//!   and calls [`Partition::handle_timeout`] when it comes.

use super::AckKind;
use super::intake::{AfterFailure, Discipline, Intake, Suspects, commit_due, progress_due};
use super::readiness::{EnvelopeKind, Op, Pending, TaskState};
use crate::backoff::{RetryPolicy, UNAVAILABLE};
use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the machine needs to know of a delivery the worker holds.
pub trait Delivered {
    /// The handle its acknowledgements go through.
    type Token: Clone;
    /// Its position in the stream.
    fn stream_seq(&self) -> u64;
    /// How often the broker delivered it (1 on the first delivery).
    fn delivered(&self) -> u64;
    /// Its acknowledgement handle.
    fn token(&self) -> &Self::Token;
}

/// How the machine finishes messages: a task's settings, the same for all its
/// partitions (each partition's machine shares them: an idle node may hold thousands).
#[derive(Debug, Clone)]
pub struct Config {
    /// Ordered partition or queue input.
    pub discipline: Discipline,
    /// Attempts and their back-off.
    pub retry: RetryPolicy,
    /// Retries of an unavailable dependency before they cost attempts.
    pub unavailable_retries: u32,
    /// Completions per commit at most (ordered inputs).
    pub window: u32,
    /// The partition's clocks.
    pub timing: Timing,
}

/// A message the worker holds from the start of its first attempt to its finish.
#[derive(Debug)]
pub struct Held<M> {
    /// The delivery.
    pub msg: M,
    /// This attempt's number.
    pub attempt: u32,
    /// When the current attempt started (`None` while it waits for one).
    pub started: Option<Instant>,
    /// Whether it counts as in flight in the readiness machine now.
    counted: bool,
    /// A dead letter that could not be stored yet: (reason, detail).
    dead_letter: Option<(&'static str, String)>,
    /// Retries because something was unavailable (not counted as attempts).
    unavailable: u32,
    /// Its `process` returned and its store changes are applied (tasks with stores):
    /// from here on it cannot be retried, only finished or restored from the changelog.
    applied: bool,
    /// It waits for its next attempt (a retry back-off): a stop hands it back at once.
    backing_off: bool,
    /// The task's `process` ran for its current attempt (it decoded).
    ran: bool,
}

impl<M> Held<M> {
    /// Its store changes are applied and not undone.
    pub fn applied(&self) -> bool {
        self.applied
    }
}

/// A message that finished (the answer to [`event::EffectsStored`] and [`event::DeadLettered`]):
/// what the worker needs to release what it kept for it (small, so that the hot path
/// does not move the delivery around again).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    /// Its stream sequence.
    pub seq: u64,
    /// Its store changes were applied (and are now part of what the next commit writes).
    pub applied: bool,
}

impl Finished {
    fn of<M: Delivered>(h: &Held<M>) -> Self {
        Self { seq: h.msg.stream_seq(), applied: h.applied }
    }
}

/// A claimed message's acknowledgement handle, kept until it is committed.
#[derive(Debug)]
struct Claim<T> {
    token: T,
    seq: u64,
    /// When it was claimed or last kept alive.
    at: Instant,
}

/// What the worker must do.
#[derive(Debug)]
pub enum Effect<M: Delivered> {
    /// Send these acknowledgements: all those decided since the last poll, in one batch
    /// (one broker operation per turn, not one per message).
    Acks(Vec<(M::Token, AckKind)>),
    /// Store the message at `order` in the dead-letter stream, then report
    /// [`event::DeadLettered`] (or [`event::DeadLetterRefused`]).
    DeadLetter {
        /// The message.
        order: u64,
        /// The machine-readable reason.
        reason: &'static str,
        /// What happened, for people.
        detail: String,
        /// Attempts it had (those before this one, and this one if `process` ran).
        attempts: u32,
    },
    /// Give an unfinished message back ([`Discipline::release`]); `interrupted` when it
    /// is not its fault (a queue message's release is counted first, so it costs no
    /// attempt).
    HandBack {
        /// The delivery (boxed: hand-backs are rare, and an effect is as large as its
        /// largest kind, which every acknowledgement would copy).
        msg: Box<M>,
        /// Not its fault.
        interrupted: bool,
    },
    /// Messages this worker is done with (the container's claim credit), all those of
    /// the effects before it in one number.
    Credit(usize),
}

/// What the worker runs next ([`Partition::next`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// A message to begin: it is held now, in its first attempt here. The worker asks
    /// [`Partition::route`] what comes first (parked key, hand-backs to count,
    /// suspect) or starts it.
    Begin(u64),
    /// A held message's next attempt is due: start it.
    Retry(u64),
    /// Run the commit.
    Commit,
    /// Run `window`.
    Window,
    /// Run the due timers.
    Timer,
    /// Every input saw a current drain marker: run `drain`, commit, complete.
    Drain,
    /// Every input ended: run `end_of_stream`, commit, complete.
    EndOfStream,
    /// Nothing to do now.
    Idle,
}

/// One partition's (or one queue input's) messages on this worker.
#[derive(Debug)]
pub struct Partition<M: Delivered> {
    config: Arc<Config>,
    /// The task keeps stores: a message whose `process` returned has its changes
    /// applied and can no longer be retried on its own.
    durable: bool,
    /// Messages (stream sequences) that forced restores of the partition before this
    /// worker, and how many each: each counts as one of its attempts.
    blamed: Vec<(u64, u32)>,
    /// After a take-over that found the previous owner's work unfinished: the messages
    /// it left (ordered inputs).
    suspects: Option<Suspects>,
    /// Tasks with stores: where their state and its commit stand.
    stores: commit::Stores,
    /// Running, stopping or ended.
    life: stop::Life,
    /// A delivery was lost: why the stop resets the partition.
    resync: Option<String>,
    state: TaskState<M>,
    intake: Intake,
    held: FxHashMap<u64, Held<M>>,
    /// Claimed messages by order until committed: every message of an ordered input,
    /// only the markers of a queue input (its data messages are acked one by one).
    claims: BTreeMap<u64, Claim<M::Token>>,
    /// Retries due to start, in the order they came due.
    retries: VecDeque<u64>,
    /// Retries waiting out their back-off: (when, order).
    backing_off: BTreeSet<(Instant, u64)>,
    /// When the completions uncommitted now are committed at the latest.
    commit_at: Option<Instant>,
    /// When held messages are next kept alive.
    keep_alive_at: Option<Instant>,
    /// When running callbacks are next checked against their timeout.
    check_at: Option<Instant>,
    last_commit: Option<M::Token>,
    /// Inputs up to this stream sequence are applied (with stores: to the restored
    /// state already, so they are skipped when they come again).
    applied_through: u64,
    /// A stop handed back a message waiting out a retry back-off: the first such order.
    handed_back_mid_retry: Option<u64>,
    effects: VecDeque<Effect<M>>,
    /// Acknowledgements decided since the last poll.
    acks: Vec<(M::Token, AckKind)>,
    /// Messages finished (or dropped, or handed back) since the last poll: the claim
    /// credit [`Effect::Credit`] reports.
    credit: usize,
    /// What the worker claims next.
    pull: pull::Pull,
}

impl<M: Delivered> Partition<M> {
    /// A partition whose readiness is `state` and whose intake is `intake`.
    pub fn new(config: Arc<Config>, state: TaskState<M>, intake: Intake) -> Self {
        Self {
            config,
            durable: false,
            blamed: Vec::new(),
            suspects: None,
            stores: commit::Stores::default(),
            life: stop::Life::Running,
            resync: None,
            state,
            intake,
            held: FxHashMap::default(),
            claims: BTreeMap::new(),
            retries: VecDeque::new(),
            backing_off: BTreeSet::new(),
            commit_at: None,
            keep_alive_at: None,
            check_at: None,
            last_commit: None,
            applied_through: 0,
            handed_back_mid_retry: None,
            effects: VecDeque::new(),
            acks: Vec::new(),
            credit: 0,
            pull: pull::Pull::default(),
        }
    }

    /// The task keeps stores (set before the first message).
    pub fn set_durable(&mut self, durable: bool) {
        self.durable = durable;
    }

    /// The messages (stream sequences) that forced restores of the partition before
    /// this worker, and how many each: each counts as one of its attempts (set before
    /// the first message).
    pub fn set_blamed(&mut self, blamed: Vec<(u64, u32)>) {
        self.blamed = blamed;
    }

    /// The messages the previous owner left unfinished (set before the first message).
    pub fn set_suspects(&mut self, suspects: Option<Suspects>) {
        self.suspects = suspects;
    }

    /// The messages the previous owner left unfinished, if it left any.
    pub fn suspects(&self) -> Option<Suspects> {
        self.suspects
    }

    /// The next effect to perform: dead letters and hand-backs in the order decided,
    /// then the acknowledgements decided so far as one batch, then their credit as one
    /// number. (A message is acknowledged, handed back or dead-lettered, never two of
    /// these at once, so their order between kinds does not matter.)
    pub fn poll_effect(&mut self) -> Option<Effect<M>> {
        if let Some(effect) = self.effects.pop_front() {
            return Some(effect);
        }
        if !self.acks.is_empty() {
            return Some(Effect::Acks(std::mem::take(&mut self.acks)));
        }
        (self.credit > 0).then(|| {
            let credit = std::mem::take(&mut self.credit);
            self.pull.outstanding = self.pull.outstanding.saturating_sub(credit);
            Effect::Credit(credit)
        })
    }

    /// The readiness machine, to read.
    pub fn readiness(&self) -> &TaskState<M> {
        &self.state
    }

    /// How messages are finished here.
    pub fn discipline(&self) -> Discipline {
        self.config.discipline
    }

    fn ordered(&self) -> bool {
        self.config.discipline == Discipline::Ordered
    }

    // ---- intake ----

    /// The highest stream sequence committed.
    pub fn committed(&self) -> u64 {
        self.intake.committed()
    }

    /// Queues a delivery taken at `now`; returns its order. Every message of an
    /// ordered input is claimed until committed, and so is a queue input's marker.
    pub(crate) fn arrive(&mut self, kind: EnvelopeKind, msg: M, now: Instant) -> u64 {
        let claim = (self.ordered() || !matches!(kind, EnvelopeKind::Data)).then(|| Claim {
            token: msg.token().clone(),
            seq: msg.stream_seq(),
            at: now,
        });
        let order = self.state.insert(0, kind, msg);
        if let Some(claim) = claim {
            self.claims.insert(order, claim);
        }
        order
    }

    /// Messages dropped on arrival (redeliveries, a stopping worker's hand-backs).
    pub(crate) fn dropped(&mut self, count: usize) {
        self.credit += count;
    }

    /// What runs next, at `now`. Retries come first; a message whose restores spent
    /// its attempts is dead-lettered, and one the restored state reflects already is
    /// finished, without running.
    pub fn next(&mut self, now: Instant) -> Next {
        if let Some(order) = self.retries.pop_front() {
            return Next::Retry(order);
        }
        loop {
            return match self.state.next_op(now) {
                Op::Process(p) => match self.begin(p) {
                    Some(order) => Next::Begin(order),
                    None => continue,
                },
                Op::Commit => Next::Commit,
                Op::Window => Next::Window,
                Op::Timer => Next::Timer,
                Op::Drain => Next::Drain,
                Op::EndOfStream => Next::EndOfStream,
                Op::NoOp => Next::Idle,
            };
        }
    }

    /// Holds a message the readiness machine started; `None` when it finished (or went
    /// to the dead-letter stream) without running.
    #[inline]
    fn begin(&mut self, p: Pending<M>) -> Option<u64> {
        let order = p.order;
        let seq = p.msg.stream_seq();
        let restores = self.restores_forced_by(seq);
        let delivered = u32::try_from(p.msg.delivered().max(1)).unwrap_or(u32::MAX);
        let attempt = delivered.max(restores.saturating_add(1));
        self.held.insert(
            order,
            Held {
                msg: p.msg,
                attempt,
                started: None,
                counted: true,
                dead_letter: None,
                unavailable: 0,
                applied: false,
                backing_off: false,
                ran: false,
            },
        );
        let max = self.config.retry.max_attempts;
        if restores > 0 && attempt > max {
            self.dead_letter(
                order,
                "max-attempts",
                format!(
                    "its {restores} attempts of {max} failed after changing the task's stores together with other messages, each forcing a restore of the partition"
                ),
            );
            return None;
        }
        if self.durable && seq <= self.applied_through {
            // The restored state reflects it already: it was processed, its outputs
            // stored and its changes committed; only its acknowledgement was lost.
            self.process_done(order);
            self.effects_stored(order);
            return None;
        }
        Some(order)
    }

    /// How many restores of the partition the message at `seq` forced before this worker.
    pub fn restores_forced_by(&self, seq: u64) -> u32 {
        self.blamed.iter().find(|(at, _)| *at == seq).map_or(0, |(_, n)| *n)
    }

    /// A routed message is ready for an attempt (its hand-backs counted, its suspect
    /// record stored), or a retry's back-off is over: it starts at the next
    /// [`next`](Self::next).
    pub(crate) fn retry_due(&mut self, order: u64) {
        self.retries.push_back(order);
    }

    /// Whether a retry is due to start (a stop lets it run before it finishes).
    pub fn retry_waiting(&self) -> bool {
        !self.retries.is_empty()
    }

    /// A held message.
    pub fn held(&self, order: u64) -> Option<&Held<M>> {
        self.held.get(&order)
    }

    /// A held message's delivery, to change what the worker keeps in it (its
    /// attempt's trace context; the machine reads only [`Delivered`] of it), with its
    /// attempt.
    pub fn msg_mut(&mut self, order: u64) -> Option<(&mut M, u32)> {
        self.held.get_mut(&order).map(|h| (&mut h.msg, h.attempt))
    }

    /// The held message at stream sequence `seq`.
    pub fn held_at(&self, seq: u64) -> Option<&Held<M>> {
        self.held.values().find(|h| h.msg.stream_seq() == seq)
    }

    /// Messages held (started and not finished).
    pub fn held_count(&self) -> usize {
        self.held.len()
    }

    /// Whether a held message's store changes are applied (a commit waits for them).
    pub fn any_applied(&self) -> bool {
        self.held.values().any(|h| h.applied)
    }

    /// Whether anything is held that needs keeping alive: claims of an ordered input,
    /// held messages of a queue input.
    pub fn holds(&self) -> bool {
        if self.ordered() { !self.claims.is_empty() } else { !self.held.is_empty() }
    }

    // ---- one attempt ----

    /// The next attempt of the message at `order` starts at `now`: `false` when it
    /// does not run (it is not held, or its dead letter is due again).
    pub(crate) fn start(&mut self, order: u64, now: Instant) -> bool {
        let Some(h) = self.held.get_mut(&order) else { return false };
        if let Some((reason, detail)) = h.dead_letter.take() {
            self.dead_letter(order, reason, detail);
            return false;
        }
        h.started = Some(now);
        h.backing_off = false;
        if h.counted {
            self.state.attempt_started(order, now);
        }
        true
    }

    /// The task's `process` runs for the current attempt (the message decoded).
    pub(crate) fn running(&mut self, order: u64) {
        if let Some(h) = self.held.get_mut(&order) {
            h.ran = true;
        }
    }

    /// `process` returned `Ok`: with stores, its changes are applied.
    pub(crate) fn returned_ok(&mut self, order: u64) {
        if let Some(h) = self.held.get_mut(&order) {
            h.applied = self.durable;
            self.applied_through = self.applied_through.max(h.msg.stream_seq());
        }
    }

    /// Inputs up to this stream sequence are applied to the stores (hooks derive their
    /// outputs' ids from it).
    pub fn applied_through(&self) -> u64 {
        self.applied_through
    }

    /// The applied changes of the message at `order` were undone.
    pub(crate) fn unapplied(&mut self, order: u64) {
        if let Some(h) = self.held.get_mut(&order) {
            h.applied = false;
        }
    }

    /// Its callbacks returned: it counts against concurrency no more (its outputs may
    /// still be on their way).
    pub(crate) fn process_done(&mut self, order: u64) {
        if let Some(h) = self.held.get_mut(&order)
            && h.counted
        {
            h.counted = false;
            self.state.process_done(order);
        }
    }

    /// A message that had returned must run again (its outputs were refused): it
    /// counts as in flight again.
    pub(crate) fn recount(&mut self, order: u64, now: Instant) {
        if let Some(h) = self.held.get_mut(&order)
            && !h.counted
        {
            h.counted = true;
            self.state.restart(order, now);
        }
    }

    /// One attempt failed: retry (in place or by a nak) after the policy's back-off,
    /// `sample` jittering it, or dead-letter it on its last attempt. What was decided,
    /// `None` when the message is not held.
    pub(crate) fn failed(&mut self, order: u64, reason: &str, now: Instant, sample: f64) -> Option<AfterFailure> {
        let attempt = self.held.get(&order)?.attempt;
        let after = self.config.discipline.after_failure(attempt, &self.config.retry, sample);
        match after {
            AfterFailure::DeadLetter => {
                let max = self.config.retry.max_attempts;
                self.dead_letter(order, "max-attempts", format!("attempt {attempt} of {max} failed: {reason}"));
            }
            AfterFailure::RetryInPlace(delay) => {
                let h = self.held.get_mut(&order)?;
                h.attempt += 1;
                h.started = None;
                h.backing_off = true;
                self.state.attempt_paused(order);
                self.backing_off.insert((now + delay, order));
            }
            AfterFailure::Nak(delay) => {
                let token = self.held.get(&order)?.msg.token().clone();
                self.acks.push((token, AckKind::Nak(Some(delay))));
                self.forget(order);
            }
        }
        Some(after)
    }

    /// Something the message needs was unreachable: try it again in place after the
    /// [`UNAVAILABLE`] back-off without counting an attempt, up to the ceiling, past
    /// which it is a failed attempt. The wait, `None` when it was a failed attempt (or
    /// the message is not held).
    pub(crate) fn unavailable(&mut self, order: u64, reason: &str, now: Instant, sample: f64) -> Option<Duration> {
        self.recount(order, now);
        let h = self.held.get_mut(&order)?;
        h.unavailable += 1;
        h.started = None;
        let n = h.unavailable;
        if n > self.config.unavailable_retries {
            let limit = self.config.unavailable_retries;
            self.failed(order, &format!("{reason} (still unavailable after {limit} retries)"), now, sample);
            return None;
        }
        let delay = UNAVAILABLE.wait(n, sample);
        h.backing_off = true;
        self.state.attempt_paused(order);
        self.backing_off.insert((now + delay, order));
        Some(delay)
    }

    // ---- finishing ----

    /// Sends the message at `order` to the dead-letter stream.
    pub(crate) fn dead_letter(&mut self, order: u64, reason: &'static str, detail: String) {
        let Some(h) = self.held.get(&order) else { return };
        let attempts = h.attempt.saturating_sub(1) + u32::from(h.ran);
        self.effects.push_back(Effect::DeadLetter { order, reason, detail, attempts });
    }

    /// Its dead letter is stored: an ordered message completes in place, a queue one is
    /// terminated. What finished, for the worker to release what it kept for it.
    pub(crate) fn dead_lettered(&mut self, order: u64) -> Option<Finished> {
        match self.config.discipline.after_dead_letter() {
            None => {
                self.process_done(order);
                self.effects_stored(order)
            }
            Some(kind) => {
                let token = self.held.get(&order)?.msg.token().clone();
                self.acks.push((token, kind));
                self.forget(order).map(|h| Finished::of(&h))
            }
        }
    }

    /// Its dead letter could not be stored at `now`: it is tried again
    /// [`DEAD_LETTER_RETRY`] later, at its next start.
    pub(crate) fn dead_letter_refused(&mut self, order: u64, reason: &'static str, detail: String, now: Instant) {
        if let Some(h) = self.held.get_mut(&order) {
            h.dead_letter = Some((reason, detail));
            self.backing_off.insert((now + DEAD_LETTER_RETRY, order));
        }
    }

    /// The message is processed and its outputs are stored: a queue message is acked,
    /// an ordered one becomes committable (and a commit is requested when one is due).
    /// What finished, for the worker to release what it kept for it.
    pub(crate) fn effects_stored(&mut self, order: u64) -> Option<Finished> {
        let h = self.held.remove(&order)?;
        if self.ordered() {
            self.state.effects_done(order);
            self.request_commit_if_due();
        } else {
            self.claims.remove(&order);
            self.acks.push((h.msg.token().clone(), AckKind::Ack));
            self.state.effects_done(order);
            self.credit += 1;
        }
        Some(Finished::of(&h))
    }

    /// Done with a held message without acknowledging it here (nak'd, terminated,
    /// parked). `None`, and nothing changes, when it is not held (any more: a stop or a
    /// failure handed it back meanwhile).
    pub(crate) fn forget(&mut self, order: u64) -> Option<Held<M>> {
        let h = self.held.remove(&order)?;
        if h.counted {
            self.state.process_done(order);
        }
        self.claims.remove(&order);
        self.state.effects_done(order);
        self.credit += 1;
        Some(h)
    }

    /// Requests a commit when one is due: a whole window completed, or the partition
    /// is idle with completions uncommitted.
    pub fn request_commit_if_due(&mut self) {
        if !self.state.uncommitted() || self.state.commit_pending() {
            return;
        }
        let idle = self.state.pending_len() == 0 && self.state.in_flight() == 0;
        if commit_due(self.state.uncommitted_count(0), idle, self.config.window) {
            self.state.request_commit();
        }
    }

    /// The stream sequence the committable position stands for (what a commit with
    /// stores records), `None` before any.
    pub fn committable_seq(&self) -> Option<u64> {
        let pos = *self.state.committable().get(&0)?;
        self.claims.range(..=pos).next_back().map(|(_, c)| c.seq)
    }

    /// Acknowledges everything up to `positions` (the committable positions when the
    /// commit began): one ack-all of the last claimed delivery (ordered), the markers
    /// one by one (queue). How many claimed messages it covered.
    pub(crate) fn commit(&mut self, positions: BTreeMap<u32, u64>) -> usize {
        let mut covered = 0;
        if let Some(&pos) = positions.get(&0) {
            let rest = self.claims.split_off(&(pos + 1));
            let done = std::mem::replace(&mut self.claims, rest);
            if self.ordered() {
                if let Some((_, last)) = done.iter().next_back() {
                    self.acks.push((last.token.clone(), AckKind::Ack));
                    self.intake.committed_to(last.seq);
                    self.last_commit = Some(last.token.clone());
                }
            } else {
                for c in done.values() {
                    self.acks.push((c.token.clone(), AckKind::Ack));
                }
            }
            covered = done.len();
            self.credit += covered;
        }
        self.state.commit_done(positions);
        covered
    }

    /// The delivery whose ack-all made the last commit (a handover confirms it).
    pub fn last_commit(&self) -> Option<&M::Token> {
        self.last_commit.as_ref()
    }

    // ---- hand-backs and the end ----

    /// Hands back (interrupted) what was claimed and never started — for example what
    /// followed a drain marker — so the next run gets it at once.
    pub(crate) fn hand_back_unstarted(&mut self) {
        for p in self.state.take_unstarted() {
            self.claims.remove(&p.order);
            self.effects.push_back(Effect::HandBack { msg: Box::new(p.msg), interrupted: true });
            self.credit += 1;
        }
    }

    /// Hands back the messages waiting for a retry (a stop does not wait out their
    /// back-off); the commit position stays before them. How many.
    pub(crate) fn hand_back_backing_off(&mut self) -> usize {
        let mut waiting: Vec<u64> =
            self.held.iter().filter(|(_, h)| h.backing_off && !h.applied).map(|(&order, _)| order).collect();
        waiting.sort_unstable();
        if let Some(&first) = waiting.first() {
            self.handed_back_mid_retry = Some(self.handed_back_mid_retry.map_or(first, |h| h.min(first)));
        }
        self.backing_off.retain(|(_, order)| waiting.binary_search(order).is_err());
        for &order in &waiting {
            let Some(h) = self.held.remove(&order) else { continue };
            self.claims.remove(&order);
            if h.counted {
                self.state.release(order);
            }
            self.effects.push_back(Effect::HandBack { msg: Box::new(h.msg), interrupted: true });
        }
        waiting.len()
    }

    /// Whether a commit would write store changes of messages that finished after one
    /// handed back mid-retry (the next owner would apply them twice): then a stop
    /// commits nothing.
    pub fn commit_blocked_by_hand_back(&self) -> bool {
        self.durable && self.handed_back_mid_retry.is_some_and(|first| self.claims.range(first..).next().is_some())
    }

    /// Hands back everything held and not finished; `interrupted` when that is not
    /// their fault (a stop's deadline). After a task failure it is: the culprit is
    /// among them.
    pub(crate) fn release_all(&mut self, interrupted: bool) {
        for p in self.state.take_unstarted() {
            self.effects.push_back(Effect::HandBack { msg: Box::new(p.msg), interrupted });
        }
        let mut held: Vec<(u64, Held<M>)> = self.held.drain().collect();
        held.sort_unstable_by_key(|(order, _)| *order);
        for (_, h) in held {
            self.effects.push_back(Effect::HandBack { msg: Box::new(h.msg), interrupted });
        }
        self.claims.clear();
    }

    /// The partition's lease is lost: forget everything, acknowledge and hand back
    /// nothing (the new owner resumes at the committed position).
    pub(crate) fn abandon(&mut self) {
        let _ = self.state.take_unstarted();
        self.held.clear();
        self.claims.clear();
        self.retries.clear();
        self.backing_off.clear();
    }
}

mod commit;
pub mod event;
mod pull;
mod route;
mod stop;
mod time;

pub use commit::{AfterCommit, CommitPlan};
pub use event::Event;
pub use pull::{ClaimRequest, ClaimRetry, ClaimRules};
pub use route::{Route, attempt_after_releases};
pub use stop::{StopFacts, StopStep};
pub use time::{DEAD_LETTER_RETRY, Timing};

#[cfg(test)]
mod tests;

#[cfg(test)]
mod props;
