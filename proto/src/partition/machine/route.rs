//! Where a message goes before its first attempt here ([`Partition::route`]), and what
//! the answers of those detours decide ([`ReleasesCounted`], [`SuspectJudged`]).
//!
//! * A queue message whose key an operator parked is set aside (no attempt).
//! * A queue message delivered before has its hand-backs counted first: its attempt is
//!   its deliveries less its hand-backs (interrupted is not failed), and one whose
//!   attempts are spent without a verdict (its owners died or hung) is dead-lettered
//!   without running again.
//! * An ordered message its previous owner left unfinished (a suspect) is counted in
//!   the job's record first, and dead-lettered as `crash-loop` once it ended
//!   `crash_limit` owners.

use super::event::{Event, sealed};
use super::{Delivered, Partition};
use crate::partition::intake::Discipline;
use std::time::Instant;

/// What comes before a message's first attempt here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Its key is parked: set it aside, then report [`Forgotten`](super::event::Forgotten)
    /// (or hand it back when it could not be stored).
    Park,
    /// It was delivered before: read its hand-backs and report [`ReleasesCounted`].
    CountReleases,
    /// Its previous owner left it unfinished: judge its record and report
    /// [`SuspectJudged`].
    CountSuspect,
    /// Start its attempt.
    Start,
}

/// The attempt of a queue delivery: its deliveries less the hand-backs that were not
/// attempts, at least the first.
pub fn attempt_after_releases(delivered: u64, released: u64) -> u32 {
    u32::try_from(delivered.saturating_sub(released).max(1)).unwrap_or(u32::MAX)
}

impl<M: Delivered> Partition<M> {
    /// Where the message at `order` (just begun, [`Next::Begin`](super::Next::Begin))
    /// goes first; `key_parked` says whether an operator parked its key (queue inputs;
    /// the worker knows the parked set).
    pub fn route(&self, order: u64, key_parked: bool) -> Route {
        let Some(h) = self.held.get(&order) else { return Route::Start };
        let queue = self.config.discipline == Discipline::Queue;
        if queue && key_parked {
            Route::Park
        } else if queue && h.msg.delivered() > 1 {
            Route::CountReleases
        } else if self.suspects.is_some_and(|s| s.covers(h.msg.stream_seq())) {
            Route::CountSuspect
        } else {
            Route::Start
        }
    }
}

/// A redelivered queue message's hand-backs were read: `Some(count)`, or `None` when
/// they could not be (then it runs, as its last attempt at most: it is never
/// dead-lettered unread). It is ready for its attempt, or dead-lettered when its
/// attempts are spent.
#[derive(Debug)]
pub struct ReleasesCounted {
    /// The message.
    pub order: u64,
    /// Its hand-backs, when known.
    pub released: Option<u64>,
}

impl sealed::Sealed for ReleasesCounted {}
impl<M: Delivered> Event<M> for ReleasesCounted {
    type Reply = ();
    fn apply(self, p: &mut Partition<M>, _now: Instant) {
        let order = self.order;
        let Some(h) = p.held.get_mut(&order) else { return };
        let delivered = h.msg.delivered();
        let max = p.config.retry.max_attempts;
        let attempt = match self.released {
            Some(released) => attempt_after_releases(delivered, released),
            None => attempt_after_releases(delivered, 0).min(max),
        };
        h.attempt = attempt;
        if attempt > max {
            let released = self.released.unwrap_or(0);
            p.dead_letter(
                order,
                "max-attempts",
                format!(
                    "delivered {delivered} times, {released} of them handed back unfinished (not counted): its {} attempts ended without a verdict, as when the node running it dies or hangs",
                    attempt - 1
                ),
            );
        } else {
            p.retry_due(order);
        }
    }
}

/// A suspect's record was judged: `Some(starts)` when it already ended `crash_limit`
/// owners (it is dead-lettered as `crash-loop`), `None` when it may start (counted, or
/// uncounted when its record could not be stored: a wedged partition would be worse).
#[derive(Debug)]
pub struct SuspectJudged {
    /// The message.
    pub order: u64,
    /// The owners it ended, when that is the limit.
    pub quarantined: Option<u32>,
}

impl sealed::Sealed for SuspectJudged {}
impl<M: Delivered> Event<M> for SuspectJudged {
    type Reply = ();
    fn apply(self, p: &mut Partition<M>, _now: Instant) {
        match self.quarantined {
            Some(starts) => {
                let limit = p.suspects.map_or(starts, |s| s.limit());
                p.dead_letter(
                    self.order,
                    "crash-loop",
                    format!(
                        "started {starts} times by owners that crashed, hung or failed before finishing it (crash limit {limit})"
                    ),
                );
            }
            None => p.retry_due(self.order),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::event as ev;
    use super::super::tests::{Msg, config, partition};
    use super::super::{Effect, Next};
    use super::*;
    use crate::partition::intake::Suspects;
    use crate::partition::readiness::EnvelopeKind;

    fn begin(p: &mut Partition<Msg>, seq: u64, delivered: u64, now: Instant) -> u64 {
        p.handle(ev::Arrived { kind: EnvelopeKind::Data, msg: Msg { seq, delivered } }, now);
        let Next::Begin(order) = p.next(now) else { panic!("it begins") };
        order
    }

    #[test]
    fn releases_are_not_attempts() {
        assert_eq!(attempt_after_releases(1, 0), 1);
        assert_eq!(attempt_after_releases(3, 2), 1, "two hand-backs and this delivery: the first attempt");
        assert_eq!(attempt_after_releases(4, 1), 3);
        assert_eq!(attempt_after_releases(2, 5), 1, "never below 1");
    }

    #[test]
    fn a_queue_message_is_parked_then_counted_then_started() {
        let now = Instant::now();
        let mut p = partition(config(Discipline::Queue), 4);
        let first = begin(&mut p, 1, 1, now);
        assert_eq!(p.route(first, true), Route::Park, "a parked key is set aside");
        assert_eq!(p.route(first, false), Route::Start);
        let again = begin(&mut p, 2, 3, now);
        assert_eq!(p.route(again, true), Route::Park, "before its hand-backs are counted");
        assert_eq!(p.route(again, false), Route::CountReleases);
    }

    #[test]
    fn ordered_messages_are_never_parked_and_suspects_are_counted() {
        let now = Instant::now();
        let mut p = partition(config(Discipline::Ordered), 4);
        p.set_suspects(Some(Suspects::new(2, 3)));
        let first = begin(&mut p, 2, 2, now);
        assert_eq!(p.route(first, true), Route::CountSuspect, "parking is for queue inputs");
        let later = begin(&mut p, 3, 1, now);
        assert_eq!(p.route(later, false), Route::Start, "past what the last owner reached");
        let redelivered = begin(&mut p, 4, 3, now);
        assert_eq!(p.route(redelivered, false), Route::Start, "an ordered redelivery counts no hand-backs");
    }

    #[test]
    fn spent_hand_backs_dead_letter_and_unknown_ones_run_as_the_last_attempt() {
        let now = Instant::now();
        let mut p = partition(config(Discipline::Queue), 4);
        // Max attempts 3: 5 deliveries with 1 hand-back are 4 attempts.
        let spent = begin(&mut p, 1, 5, now);
        p.handle(ReleasesCounted { order: spent, released: Some(1) }, now);
        match p.poll_effect() {
            Some(Effect::DeadLetter { reason: "max-attempts", attempts: 3, .. }) => {}
            other => panic!("expected a dead letter, got {other:?}"),
        }
        let known = begin(&mut p, 3, 3, now);
        p.handle(ReleasesCounted { order: known, released: Some(2) }, now);
        assert_eq!(p.next(now), Next::Retry(known), "two hand-backs and this delivery: its first attempt");
        assert_eq!(p.held(known).map(|h| h.attempt), Some(1));
        let unknown = begin(&mut p, 2, 9, now);
        p.handle(ReleasesCounted { order: unknown, released: None }, now);
        assert_eq!(p.next(now), Next::Retry(unknown));
        assert_eq!(p.held(unknown).map(|h| h.attempt), Some(3), "its last attempt, never dead-lettered unread");
    }

    #[test]
    fn a_quarantined_suspect_is_dead_lettered_as_a_crash_loop() {
        let now = Instant::now();
        let mut p = partition(config(Discipline::Ordered), 4);
        p.set_suspects(Some(Suspects::new(5, 2)));
        let order = begin(&mut p, 4, 2, now);
        p.handle(SuspectJudged { order, quarantined: Some(2) }, now);
        match p.poll_effect() {
            Some(Effect::DeadLetter { reason: "crash-loop", detail, .. }) => assert!(detail.contains("crash limit 2")),
            other => panic!("expected a crash-loop dead letter, got {other:?}"),
        }
        let next = begin(&mut p, 5, 2, now);
        p.handle(SuspectJudged { order: next, quarantined: None }, now);
        assert_eq!(p.next(now), Next::Retry(next));
    }
}
