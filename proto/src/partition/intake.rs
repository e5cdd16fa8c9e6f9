//! The partition rules a task worker (in `flotilla-actors`) follows, as plain data:
//! events in, verdicts out, tested without actors or a broker.
//!
//! The first rule here is the one an ack-all depends on. An ordered partition commits
//! by acknowledging its last completed delivery, and the broker takes that as an
//! acknowledgement of every earlier message of the partition. That is only true if
//! this worker saw every delivery the consumer made: a delivery lost in transit (a
//! connection cut mid-pull, a pull answered after its client gave up, a stale puller)
//! would be acknowledged unprocessed. The consumer numbers its deliveries
//! (redeliveries included) one after another, so a worker that knows the number
//! before its first delivery can tell, per delivery, that nothing went missing.
//!
//! The second decides which message ended the partition's previous owners
//! ([`Suspects`]), so that a message that kills every node that runs it is
//! dead-lettered instead of taking the cluster down node by node.

use super::AckKind;
use crate::backoff::RetryPolicy;
use std::collections::BTreeMap;
use std::time::Duration;
use std::time::Instant;

/// Ordered inputs: the consumer's delivery numbering as this worker has seen it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliverySequence {
    /// The consumer sequence of the last delivery seen, if known.
    last: Option<u64>,
}

/// How a delivery fits the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// It follows the previous delivery: nothing was missed.
    Next,
    /// Deliveries between the previous one and this one never arrived (or this one is
    /// from an earlier incarnation of the consumer). Acknowledging anything from here
    /// on could cover a message nobody processed.
    Gap {
        /// The consumer sequence that should have come.
        expected: u64,
        /// The one that came.
        got: u64,
    },
}

impl DeliverySequence {
    /// A sequence whose last delivery was `last` (`Some(0)` for a consumer that has
    /// delivered nothing yet, as after a reset). `None` when the caller does not know:
    /// the first delivery then sets it.
    pub fn after(last: Option<u64>) -> Self {
        Self { last }
    }

    /// A delivery with consumer sequence `consumer_seq` arrived. After a gap the
    /// sequence stays where it was: every later delivery is a gap too.
    pub fn arrive(&mut self, consumer_seq: u64) -> Arrival {
        match self.last {
            Some(last) if consumer_seq != last.saturating_add(1) => {
                Arrival::Gap { expected: last.saturating_add(1), got: consumer_seq }
            }
            _ => {
                self.last = Some(consumer_seq);
                Arrival::Next
            }
        }
    }
}

/// How an input's messages are finished: ordered partitions commit checkpoints (an
/// ack-all of the contiguous completed prefix) and keep their order through retries;
/// queue inputs acknowledge, nak and terminate each message on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Discipline {
    /// An ordered partition.
    Ordered,
    /// A queue input.
    Queue,
}

/// What follows a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterFailure {
    /// Try again here after this delay; the partition waits (its order is kept).
    RetryInPlace(Duration),
    /// Give it back with this delay; any node may take it then.
    Nak(Duration),
    /// That was the last attempt: to the dead-letter stream.
    DeadLetter,
}

impl Discipline {
    /// After attempt number `attempt` failed, under `policy`; `sample` (a uniform draw in
    /// `[0, 1)`) jitters the wait.
    pub fn after_failure(self, attempt: u32, policy: &RetryPolicy, sample: f64) -> AfterFailure {
        if policy.exhausted(attempt) {
            return AfterFailure::DeadLetter;
        }
        let delay = policy.backoff(attempt, sample);
        match self {
            Discipline::Ordered => AfterFailure::RetryInPlace(delay),
            Discipline::Queue => AfterFailure::Nak(delay),
        }
    }

    /// What hands back a claimed message that was not finished (a stop, a rebalance, a
    /// failed task): interrupted is not failed. A queue message is nak'd without delay,
    /// so any node gets it at once. An ordered one is left alone: whoever runs the
    /// partition next resets its consumer at the committed position and gets it as a
    /// first delivery (a nak would count a delivery, and a stale nak could reach the
    /// reset consumer).
    pub fn release(self) -> Option<AckKind> {
        match self {
            Discipline::Ordered => None,
            Discipline::Queue => Some(AckKind::Nak(None)),
        }
    }

    /// What finishes a message once its dead letter is stored: an ordered one is
    /// skipped (it completes, and the next commit covers it in order); a queue one is
    /// terminated (never redelivered).
    pub fn after_dead_letter(self) -> Option<AckKind> {
        match self {
            Discipline::Ordered => None,
            Discipline::Queue => Some(AckKind::Term),
        }
    }
}

/// Hand-backs a queue message may have beyond its attempts before the server stops
/// delivering it (the consumer's max deliveries is attempts + 1 + this).
pub const RELEASE_ALLOWANCE: u32 = 20;

/// The longest a parked key's message that could not be set aside waits to come again.
pub const PARK_RETRY_CAP: Duration = crate::backoff::PARK.cap;

/// Queue inputs: how long a parked key's message that could not be set aside (the
/// PARKED stream refused it) waits before it comes again, after its `delivered`-th
/// delivery: 200 ms doubling to [`PARK_RETRY_CAP`], ±50 % by `sample` (a uniform draw in
/// `[0, 1)`; [`crate::backoff::PARK`]). Each
/// wait is a hand-back (no attempt), but one more delivery, and the consumer delivers a
/// message at most attempts + 1 + [`RELEASE_ALLOWANCE`] times:
/// handed back at once, a message spent them all in about a second of refused writes;
/// at this pace the hand-backs last half an hour at least. The key is parked, so the
/// message was not going to run meanwhile anyway.
pub fn park_retry_delay(delivered: u64, sample: f64) -> Duration {
    crate::backoff::PARK.wait(u32::try_from(delivered).unwrap_or(u32::MAX), sample)
}

/// Ordered inputs: whether completed messages are committed now. Once per claimed
/// window (`uncommitted` reaching `window`), or as soon as the partition is idle (nothing
/// pending or in flight), as a plain consumer acks the last message of each fetch; the
/// commit interval's tick covers the rest. Counting completed, not merely claimed,
/// messages matters: committing at half a window halved the claims too (the container
/// claims what commits free) and so doubled pull requests and ack-alls, 0.75x of the
/// raw loop's rate against 0.83x (BENCHMARKS.md).
pub fn commit_due(uncommitted: u64, idle: bool, window: u32) -> bool {
    uncommitted > 0 && (idle || uncommitted >= u64::from(window).max(1))
}

/// Whether a message held since `since` needs an in-progress ack (`+WPI`) at `now`, so
/// that the broker does not redeliver it: every third of `ack_wait`.
pub fn progress_due(since: Instant, now: Instant, ack_wait: Duration) -> bool {
    now.saturating_duration_since(since) >= ack_wait / 3
}

/// Ordered inputs: which of its partition's deliveries a worker takes, and how far it
/// has committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Intake {
    sequence: DeliverySequence,
    /// The highest stream sequence delivered to this worker. A partition delivers first
    /// deliveries in ascending order, so anything at or below it (or at or below the
    /// committed position) is a redelivery of a message this worker holds or committed.
    max_seen: u64,
    /// The highest stream sequence acknowledged by an ack-all.
    committed: u64,
}

/// What to do with one delivery of an ordered partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// A first delivery, in sequence: take it.
    Take,
    /// A redelivery of a message this worker holds or committed: drop it.
    Redelivered,
    /// A delivery went missing before this one: take nothing more, commit what came
    /// before, and have the partition reset ([`Arrival::Gap`]).
    Lost {
        /// The consumer sequence that should have come.
        expected: u64,
        /// The one that came.
        got: u64,
    },
}

impl Intake {
    /// A worker whose partition consumer's last delivery before it was
    /// `delivered_consumer_seq` (see [`DeliverySequence::after`]).
    pub fn after(delivered_consumer_seq: Option<u64>) -> Self {
        Self { sequence: DeliverySequence::after(delivered_consumer_seq), max_seen: 0, committed: 0 }
    }

    /// A delivery of the message at `stream_seq`, numbered `consumer_seq` by the consumer.
    pub fn admit(&mut self, stream_seq: u64, consumer_seq: u64) -> Admission {
        // Every delivery takes a number, redeliveries too: check the number first.
        if let Arrival::Gap { expected, got } = self.sequence.arrive(consumer_seq) {
            return Admission::Lost { expected, got };
        }
        if stream_seq <= self.committed.max(self.max_seen) {
            return Admission::Redelivered;
        }
        self.max_seen = stream_seq;
        Admission::Take
    }

    /// An ack-all of `stream_seq` was sent.
    pub fn committed_to(&mut self, stream_seq: u64) {
        self.committed = self.committed.max(stream_seq);
    }

    /// The highest stream sequence committed.
    pub fn committed(&self) -> u64 {
        self.committed
    }
}

/// A partition's suspects as the job's KV keeps them (bucket `SUSPECTS`, key
/// `<stream>.<partition>`): messages an owner started and was not seen to finish, with
/// how often. A message that ends its owner (the process dies, the callback hangs past
/// its timeout, the task fails) is never seen to finish, so its count grows with each
/// owner it ends; a message that finishes leaves the record at once.
///
/// A node runs one counted suspect at a time, across all its partitions, and each
/// suspect's start and its finish (or its start taken back, once it ran 10 s with its
/// owner alive) are stored before the next starts: when a node dies, at most one
/// counted suspect was running, and only it is blamed.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SuspectRecord {
    /// Stream sequence → times started without being seen to finish.
    pub started: BTreeMap<u64, u32>,
}

/// How long a started suspect answers for its owner's end. A message that kills its
/// process (an abort, a stack overflow, memory running out, a thread blocked so that the
/// node loses its leases) does so soon after it starts; one that ran this long with its
/// owner alive is not blamed for what ends the owner later (another partition's crash,
/// a kill, a lost lease): its owner stores that, and frees the node's suspect lane for
/// the next. What its owner sees it do itself (a callback past `callback_timeout`, a
/// fatal error) still counts, at any time.
pub const SUSPECT_WINDOW: Duration = Duration::from_secs(10);

/// Ordered inputs, after a take-over that found the previous owner's work unfinished:
/// which messages are suspects and what to do before and after each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Suspects {
    /// The last stream sequence delivered to the previous owner.
    up_to: u64,
    /// Starts without finishing after which a message is quarantined.
    limit: u32,
}

/// What to do before starting a suspect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SuspectVerdict {
    /// Store this record (the suspect counted once more), then start it.
    Start(SuspectRecord),
    /// It ended its owners this many times: dead-letter it as `crash-loop`.
    Quarantine {
        /// Times started without finishing.
        starts: u32,
    },
}

impl Suspects {
    /// Suspects up to stream sequence `up_to`, quarantined after `limit` starts.
    pub fn new(up_to: u64, limit: u32) -> Self {
        Self { up_to, limit: limit.max(1) }
    }

    /// Starts without finishing after which a message is quarantined.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Whether the message at `seq` is a suspect.
    pub fn covers(&self, seq: u64) -> bool {
        seq <= self.up_to
    }

    /// Before starting `seq`, with the record as stored and the committed position.
    pub fn judge(&self, mut record: SuspectRecord, seq: u64, committed: u64) -> SuspectVerdict {
        record.started.retain(|s, _| *s > committed);
        let starts = record.started.get(&seq).copied().unwrap_or(0);
        if starts >= self.limit {
            return SuspectVerdict::Quarantine { starts };
        }
        record.started.insert(seq, starts + 1);
        SuspectVerdict::Start(record)
    }

    /// After `seq` finished (processed, or dead-lettered): the record without it.
    pub fn finish(&self, mut record: SuspectRecord, seq: u64, committed: u64) -> SuspectRecord {
        record.started.retain(|s, _| *s > committed && *s != seq);
        record
    }

    /// `seq` ran for [`SUSPECT_WINDOW`] and its owner lives: this start is taken back (the
    /// earlier owners' are kept), so an end of the owner from now on is not blamed on it.
    pub fn outlived(&self, mut record: SuspectRecord, seq: u64, committed: u64) -> SuspectRecord {
        record.started.retain(|s, _| *s > committed);
        if let Some(n) = record.started.get_mut(&seq) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                record.started.remove(&seq);
            }
        }
        record
    }

    /// `seq`, past its window, ended its owner in sight (its callback timed out, or it
    /// failed the task): counted again, as a start its owner did not survive.
    pub fn ended_owner(&self, mut record: SuspectRecord, seq: u64, committed: u64) -> SuspectRecord {
        record.started.retain(|s, _| *s > committed);
        *record.started.entry(seq).or_default() += 1;
        record
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deliveries_that_follow_each_other_are_in_sequence() {
        let mut seq = DeliverySequence::after(Some(0));
        assert_eq!((1..=5).map(|n| seq.arrive(n)).collect::<Vec<_>>(), vec![Arrival::Next; 5]);
        // Taking over a consumer that delivered 41 times: the next must be 42.
        let mut seq = DeliverySequence::after(Some(41));
        assert_eq!(seq.arrive(42), Arrival::Next);
    }

    #[test]
    fn a_missing_delivery_is_a_gap_and_the_sequence_stays_broken() {
        let mut seq = DeliverySequence::after(Some(10));
        assert_eq!(seq.arrive(11), Arrival::Next);
        assert_eq!(seq.arrive(14), Arrival::Gap { expected: 12, got: 14 });
        // The lost ones arriving late (redelivered) do not mend it: 15 is not 12.
        assert_eq!(seq.arrive(15), Arrival::Gap { expected: 12, got: 15 });
    }

    #[test]
    fn a_delivery_from_an_earlier_consumer_is_a_gap() {
        // Reset to a new consumer (0), then a stale pull of the old one answers with 77.
        let mut seq = DeliverySequence::after(Some(0));
        assert_eq!(seq.arrive(77), Arrival::Gap { expected: 1, got: 77 });
        // A repeated number (the same delivery twice) is not "next" either.
        let mut seq = DeliverySequence::after(Some(5));
        assert_eq!(seq.arrive(5), Arrival::Gap { expected: 6, got: 5 });
    }

    #[test]
    fn an_unknown_start_is_set_by_the_first_delivery() {
        let mut seq = DeliverySequence::after(None);
        assert_eq!(seq.arrive(300), Arrival::Next);
        assert_eq!(seq.arrive(301), Arrival::Next);
        assert_eq!(seq.arrive(303), Arrival::Gap { expected: 302, got: 303 });
    }

    #[test]
    fn a_message_that_never_finishes_is_quarantined_after_the_limit() {
        let s = Suspects::new(120, 3);
        let mut record = SuspectRecord::default();
        // Three owners start 105 and die with it.
        for n in 1..=3 {
            match s.judge(record.clone(), 105, 100) {
                SuspectVerdict::Start(r) => record = r,
                other => panic!("start {n}: {other:?}"),
            }
            assert_eq!(record.started.get(&105), Some(&n));
        }
        assert_eq!(s.judge(record, 105, 100), SuspectVerdict::Quarantine { starts: 3 });
    }

    #[test]
    fn a_message_that_finishes_leaves_the_record_and_so_does_what_is_committed() {
        // The crasher 110 ended an owner once; this owner re-runs 105 first.
        let s = Suspects::new(120, 3);
        let record = SuspectRecord { started: BTreeMap::from([(110, 1)]) };
        let SuspectVerdict::Start(running) = s.judge(record, 105, 100) else { panic!("quarantined") };
        assert_eq!(running.started, BTreeMap::from([(105, 1), (110, 1)]));
        let done = s.finish(running, 105, 100);
        assert_eq!(done.started, BTreeMap::from([(110, 1)]), "105 finished: only the crasher is left");
        let SuspectVerdict::Start(again) = s.judge(done, 110, 100) else { panic!("quarantined") };
        assert_eq!(again.started, BTreeMap::from([(110, 2)]));
        // What is committed leaves the record.
        assert_eq!(s.finish(again, 115, 112).started, BTreeMap::new());
    }

    #[test]
    fn a_suspect_that_outlives_its_window_is_not_blamed_unless_it_ends_its_owner_in_sight() {
        let s = Suspects::new(120, 3);
        let record = SuspectRecord { started: BTreeMap::from([(105, 1), (110, 2)]) };
        // 110 ended two owners, starts a third time, runs 10 s with its owner alive.
        let SuspectVerdict::Start(running) = s.judge(record, 110, 100) else { panic!("quarantined") };
        assert_eq!(running.started.get(&110), Some(&3));
        let outlived = s.outlived(running, 110, 100);
        assert_eq!(outlived.started, BTreeMap::from([(105, 1), (110, 2)]), "this start is taken back, not the earlier");
        // The node dies of something else now: the next owner finds 110 at 2, not 3.
        assert!(matches!(s.judge(outlived.clone(), 110, 100), SuspectVerdict::Start(_)));
        // Or its callback times out in sight: counted again.
        let ended = s.ended_owner(outlived, 110, 100);
        assert_eq!(s.judge(ended, 110, 100), SuspectVerdict::Quarantine { starts: 3 });
        // A first start taken back leaves the record; what is committed goes too.
        let once = SuspectRecord { started: BTreeMap::from([(104, 1), (105, 1)]) };
        assert_eq!(s.outlived(once, 105, 104).started, BTreeMap::new());
        assert_eq!(s.outlived(SuspectRecord::default(), 105, 100).started, BTreeMap::new(), "nothing to take back");
    }

    #[test]
    fn only_what_the_previous_owner_had_is_suspect() {
        let s = Suspects::new(50, 3);
        assert!(s.covers(50) && !s.covers(51));
        assert_eq!(Suspects::new(5, 0).limit, 1, "a limit of 0 would quarantine without a crash");
    }

    #[test]
    fn a_partition_takes_first_deliveries_drops_redeliveries_and_stops_at_a_loss() {
        let mut intake = Intake::after(Some(0));
        assert_eq!(intake.admit(10, 1), Admission::Take);
        assert_eq!(intake.admit(12, 2), Admission::Take);
        // Held past ack-wait, delivered again (a new number, an old message).
        assert_eq!(intake.admit(10, 3), Admission::Redelivered);
        intake.committed_to(12);
        assert_eq!(intake.committed(), 12);
        assert_eq!(intake.admit(12, 4), Admission::Redelivered, "committed");
        assert_eq!(intake.admit(15, 5), Admission::Take);
        // Deliveries 6 and 7 never arrived.
        assert_eq!(intake.admit(20, 8), Admission::Lost { expected: 6, got: 8 });
        assert_eq!(intake.admit(21, 9), Admission::Lost { expected: 6, got: 9 }, "and nothing after");
        intake.committed_to(11);
        assert_eq!(intake.committed(), 12, "the committed position never goes back");
    }

    #[test]
    fn failures_retry_in_place_on_partitions_and_by_nak_on_queues_then_dead_letter() {
        let policy = RetryPolicy { max_attempts: 3, jitter: 0.0, ..RetryPolicy::default() };
        let first = policy.backoff(1, 0.5);
        assert_eq!(Discipline::Ordered.after_failure(1, &policy, 0.5), AfterFailure::RetryInPlace(first));
        assert_eq!(Discipline::Queue.after_failure(1, &policy, 0.5), AfterFailure::Nak(first));
        assert!(policy.backoff(2, 0.5) > first, "backoff grows");
        assert_eq!(Discipline::Ordered.after_failure(3, &policy, 0.5), AfterFailure::DeadLetter);
        assert_eq!(Discipline::Queue.after_failure(3, &policy, 0.5), AfterFailure::DeadLetter);
    }

    #[test]
    fn interrupted_is_not_failed_and_dead_letters_finish_by_discipline() {
        assert_eq!(Discipline::Ordered.release(), None, "left for the next owner's reset");
        assert_eq!(Discipline::Queue.release(), Some(AckKind::Nak(None)), "back at once, no delay");
        assert_eq!(Discipline::Ordered.after_dead_letter(), None, "skipped, committed in order");
        assert_eq!(Discipline::Queue.after_dead_letter(), Some(AckKind::Term));
    }

    #[test]
    fn partitions_commit_once_per_window_or_when_idle() {
        assert!(!commit_due(0, true, 256), "nothing to commit");
        assert!(commit_due(1, true, 256), "idle: commit what is done");
        assert!(!commit_due(255, false, 256), "busy, less than a window");
        assert!(commit_due(256, false, 256), "a whole window");
        assert!(commit_due(1, false, 0), "a window of 0 counts as 1");
    }

    #[test]
    fn failed_parks_come_back_slower_and_slower_so_the_hand_backs_last() {
        assert_eq!(park_retry_delay(1, 0.5), Duration::from_millis(200));
        assert_eq!(park_retry_delay(0, 0.5), Duration::from_millis(200), "no delivery counts as the first");
        assert_eq!(park_retry_delay(3, 0.5), Duration::from_millis(800));
        assert_eq!(park_retry_delay(40, 1.0), PARK_RETRY_CAP.mul_f64(1.5), "capped");
        assert_eq!(park_retry_delay(u64::MAX, 9.0), PARK_RETRY_CAP.mul_f64(1.5), "jitter clamped");
        // The least a message's hand-backs last, every jitter at its lowest.
        let least: Duration = (1..=u64::from(RELEASE_ALLOWANCE)).map(|n| park_retry_delay(n, 0.0)).sum();
        assert!(least >= Duration::from_secs(25 * 60), "the allowance lasts only {least:?}");
    }

    #[test]
    fn held_messages_get_progress_every_third_of_ack_wait() {
        let t0 = Instant::now();
        let ack_wait = Duration::from_secs(30);
        assert!(!progress_due(t0, t0 + Duration::from_secs(9), ack_wait));
        assert!(progress_due(t0, t0 + Duration::from_secs(10), ack_wait));
        assert!(!progress_due(t0 + Duration::from_secs(5), t0, ack_wait), "a clock read before the start");
    }
}

#[cfg(test)]
mod props;
