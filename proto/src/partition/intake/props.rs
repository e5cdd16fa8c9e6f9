//! Properties of the partition core, against a simulated partition consumer: it
//! numbers every delivery (redeliveries too), delivers first deliveries in stream
//! order, redelivers what is not acknowledged, and acknowledges everything up to an
//! ack-all. Deliveries in transit may be lost, duplicated or overtaken. The worker is
//! the core alone: it admits every delivery that reaches it (even after a loss, when
//! the actor would already have stopped), takes and processes what it is told to take
//! at once, and commits its last taken message by ack-all.

use super::*;
use proptest::prelude::*;
use std::collections::BTreeSet;

/// Picks one of the candidates an event applies to (shrinks toward the first).
#[derive(Debug, Clone, Copy)]
struct Pick(u16);

impl Pick {
    fn of<T: Copy>(self, among: &[T]) -> Option<T> {
        (!among.is_empty()).then(|| among[usize::from(self.0) % among.len()])
    }
}

#[derive(Debug, Clone)]
enum Event {
    /// The consumer sends the next first delivery.
    Deliver,
    /// The consumer sends an unacknowledged message again (its ack wait ran out).
    Redeliver(Pick),
    /// A delivery in transit reaches the worker (not necessarily the oldest).
    Arrive(Pick),
    /// A delivery in transit never arrives.
    Lose(Pick),
    /// A delivery in transit arrives twice.
    Duplicate(Pick),
    /// The worker commits what it processed: an ack-all of its last taken message.
    Commit,
    /// The partition is reset at the acknowledged position: a new consumer, a new intake.
    Reset,
}

fn event(lossy: bool, in_order: bool) -> impl Strategy<Value = Event> {
    let pick = || any::<u16>().prop_map(Pick);
    let arrive = if in_order { Just(Event::Arrive(Pick(0))).boxed() } else { pick().prop_map(Event::Arrive).boxed() };
    let (lose, dup, reset) = if lossy { (2, 1, 1) } else { (0, 0, 0) };
    prop_oneof![
        6 => Just(Event::Deliver),
        2 => pick().prop_map(Event::Redeliver),
        8 => arrive,
        lose => pick().prop_map(Event::Lose),
        dup => pick().prop_map(Event::Duplicate),
        3 => Just(Event::Commit),
        reset => Just(Event::Reset),
    ]
}

/// Stream sequences of a partition's messages: ascending, with gaps (other partitions'
/// messages share the stream).
fn stream(max_len: usize) -> impl Strategy<Value = Vec<u64>> {
    proptest::collection::vec(1u64..4, 1..max_len).prop_map(|gaps| {
        gaps.iter()
            .scan(0u64, |seq, gap| {
                *seq += gap;
                Some(*seq)
            })
            .collect()
    })
}

struct Partition {
    msgs: Vec<u64>,
    /// The consumer's ack floor: every message at or below it is acknowledged.
    floor: u64,
    /// Index of the next first delivery.
    next: usize,
    /// Deliveries the consumer has numbered.
    delivered: u64,
    /// Delivered and not acknowledged.
    unacked: BTreeSet<u64>,
    /// In transit: (consumer sequence, stream sequence).
    transit: Vec<(u64, u64)>,
    intake: Intake,
    /// The last delivery number the worker accepted (took or dropped as a redelivery).
    accepted: u64,
    /// Taken (so processed) by the current intake, in order.
    taken: Vec<u64>,
    /// Taken by any intake.
    processed: BTreeSet<u64>,
    /// Highest ack-all sent.
    acked: u64,
    losses: usize,
}

impl Partition {
    fn new(msgs: Vec<u64>, delivered_before: u64) -> Self {
        Self {
            msgs,
            floor: 0,
            next: 0,
            delivered: delivered_before,
            unacked: BTreeSet::new(),
            transit: Vec::new(),
            intake: Intake::after(Some(delivered_before)),
            accepted: delivered_before,
            taken: Vec::new(),
            processed: BTreeSet::new(),
            acked: 0,
            losses: 0,
        }
    }

    fn apply(&mut self, event: &Event) -> Result<(), TestCaseError> {
        match event {
            Event::Deliver => {
                if let Some(&seq) = self.msgs.get(self.next) {
                    self.next += 1;
                    self.delivered += 1;
                    self.unacked.insert(seq);
                    self.transit.push((self.delivered, seq));
                }
            }
            Event::Redeliver(p) => {
                if let Some(seq) = p.of(&self.unacked.iter().copied().collect::<Vec<_>>()) {
                    self.delivered += 1;
                    self.transit.push((self.delivered, seq));
                }
            }
            Event::Arrive(p) => {
                if let Some(i) = p.of(&(0..self.transit.len()).collect::<Vec<_>>()) {
                    let (consumer_seq, seq) = self.transit.remove(i);
                    self.arrive(consumer_seq, seq)?;
                }
            }
            Event::Lose(p) => {
                if let Some(i) = p.of(&(0..self.transit.len()).collect::<Vec<_>>()) {
                    self.transit.remove(i);
                    self.losses += 1;
                }
            }
            Event::Duplicate(p) => {
                if let Some(d) = p.of(&self.transit) {
                    self.transit.push(d);
                }
            }
            Event::Commit => self.commit()?,
            Event::Reset => {
                // A new consumer starts after the ack floor; what the old one had in
                // transit is gone with it.
                self.next = self.msgs.partition_point(|&s| s <= self.floor);
                self.delivered = 0;
                self.unacked.clear();
                self.transit.clear();
                self.intake = Intake::after(Some(0));
                self.accepted = 0;
                self.taken.clear();
            }
        }
        Ok(())
    }

    fn arrive(&mut self, consumer_seq: u64, seq: u64) -> Result<(), TestCaseError> {
        let committed = self.intake.committed();
        let admission = self.intake.admit(seq, consumer_seq);
        if consumer_seq != self.accepted + 1 {
            prop_assert_eq!(
                admission,
                Admission::Lost { expected: self.accepted + 1, got: consumer_seq },
                "delivery {} arrived after {}",
                consumer_seq,
                self.accepted
            );
            return Ok(());
        }
        self.accepted = consumer_seq;
        match admission {
            Admission::Take => {
                prop_assert!(seq > committed, "took {}, at or below the committed {}", seq, committed);
                prop_assert!(self.taken.last().is_none_or(|&t| t < seq), "took {} after {:?}", seq, self.taken.last());
                // In order: every message between where this intake started and this
                // one was taken before it.
                let start = self.taken.first().copied().unwrap_or(seq);
                for &m in self.msgs.iter().filter(|&&m| m > self.floor.min(start) && m < seq) {
                    prop_assert!(
                        self.taken.contains(&m) || m <= self.floor,
                        "took {} but {} before it was never taken",
                        seq,
                        m
                    );
                }
                self.taken.push(seq);
                self.processed.insert(seq);
            }
            Admission::Redelivered => prop_assert!(
                seq <= committed || self.taken.contains(&seq),
                "dropped {} as a redelivery, but it was neither committed nor taken",
                seq
            ),
            Admission::Lost { expected, got } => {
                prop_assert!(
                    false,
                    "delivery {} follows {} yet was called lost ({}, {})",
                    consumer_seq,
                    self.accepted - 1,
                    expected,
                    got
                )
            }
        }
        Ok(())
    }

    fn commit(&mut self) -> Result<(), TestCaseError> {
        let before = self.intake.committed();
        let Some(&last) = self.taken.last() else { return Ok(()) };
        if last <= before {
            return Ok(());
        }
        for &m in self.msgs.iter().filter(|&&m| m > self.floor && m <= last) {
            prop_assert!(self.processed.contains(&m), "ack-all of {} covers {}, which nobody processed", last, m);
        }
        self.acked = self.acked.max(last);
        self.floor = self.floor.max(last);
        let floor = self.floor;
        self.unacked.retain(|&s| s > floor);
        self.intake.committed_to(last);
        prop_assert_eq!(self.intake.committed(), last);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn ack_all_never_covers_a_lost_delivery(
        msgs in stream(24),
        delivered_before in 0u64..1000,
        events in proptest::collection::vec(event(true, false), 0..120),
    ) {
        let mut p = Partition::new(msgs, delivered_before);
        for e in &events {
            let committed = p.intake.committed();
            p.apply(e)?;
            prop_assert!(
                p.intake.committed() >= committed || matches!(e, Event::Reset),
                "the committed position went back"
            );
        }
    }

    #[test]
    fn without_loss_every_message_is_taken_once_in_stream_order(
        msgs in stream(24),
        delivered_before in 0u64..1000,
        events in proptest::collection::vec(event(false, true), 0..120),
    ) {
        let mut p = Partition::new(msgs.clone(), delivered_before);
        for e in &events {
            p.apply(e)?;
        }
        // Deliver and hand over the rest, then commit.
        while p.next < p.msgs.len() || !p.transit.is_empty() {
            p.apply(&Event::Deliver)?;
            p.apply(&Event::Arrive(Pick(0)))?;
        }
        p.apply(&Event::Commit)?;
        prop_assert_eq!(&p.taken, &msgs, "every message taken once, in order");
        prop_assert_eq!(p.intake.committed(), *msgs.last().unwrap_or(&0));
    }

    #[test]
    fn intake_never_takes_a_message_twice_nor_one_at_or_below_the_commit(
        start in 0u64..100,
        steps in proptest::collection::vec((1u64..40, proptest::option::of(1u64..40)), 0..60),
    ) {
        // Any stream sequences, in sequence numbering, with commits of anything.
        let mut intake = Intake::after(Some(start));
        let mut taken = BTreeSet::new();
        let mut committed = 0;
        for (n, (seq, commit)) in steps.into_iter().enumerate() {
            if let Some(c) = commit {
                intake.committed_to(c);
                committed = committed.max(c);
                prop_assert_eq!(intake.committed(), committed, "the committed position is the highest commit");
            }
            match intake.admit(seq, start + 1 + n as u64) {
                Admission::Take => {
                    prop_assert!(seq > committed, "took {} at or below the committed {}", seq, committed);
                    prop_assert!(taken.iter().all(|&t| t < seq), "took {} after a later message", seq);
                    taken.insert(seq);
                }
                Admission::Redelivered => {
                    prop_assert!(seq <= committed || taken.iter().any(|&t| t >= seq), "dropped {} it never had", seq)
                }
                Admission::Lost { .. } => prop_assert!(false, "numbered in sequence, yet lost"),
            }
        }
    }

    #[test]
    fn a_gap_is_reported_exactly_when_a_delivery_number_is_skipped(
        start in proptest::option::of(0u64..100),
        arrivals in proptest::collection::vec(0u64..120, 0..40),
    ) {
        let mut seq = DeliverySequence::after(start);
        let mut last = start;
        for n in arrivals {
            let arrival = seq.arrive(n);
            match last {
                Some(l) if n != l + 1 => prop_assert_eq!(arrival, Arrival::Gap { expected: l + 1, got: n }),
                _ => {
                    prop_assert_eq!(arrival, Arrival::Next);
                    last = Some(n);
                }
            }
        }
    }

    #[test]
    fn a_suspect_is_started_at_most_limit_times_then_quarantined(
        up_to in 0u64..50,
        limit in 0u32..6,
        committed in 0u64..50,
        ahead in 1u64..20,
        others in proptest::collection::btree_map(0u64..60, 1u32..4, 0..6),
    ) {
        // Only what is above the committed position is ever started.
        let seq = committed + ahead;
        let suspects = Suspects::new(up_to, limit);
        let mut record = SuspectRecord { started: others.clone() };
        record.started.remove(&seq);
        let mut starts = 0;
        loop {
            match suspects.judge(record.clone(), seq, committed) {
                SuspectVerdict::Start(next) => {
                    starts += 1;
                    prop_assert!(starts <= limit.max(1), "started {} times past the limit {}", starts, limit);
                    prop_assert_eq!(next.started.get(&seq).copied(), Some(starts));
                    prop_assert!(next.started.keys().all(|&s| s > committed), "a committed message stays suspect");
                    record = next;
                }
                SuspectVerdict::Quarantine { starts: n } => {
                    prop_assert_eq!(n, limit.max(1));
                    prop_assert_eq!(starts, limit.max(1), "quarantined after exactly the limit");
                    break;
                }
            }
        }
        let finished = suspects.finish(record, seq, committed);
        prop_assert!(!finished.started.contains_key(&seq), "a finished message leaves the record");
        let kept: BTreeMap<u64, u32> = others.into_iter().filter(|&(s, _)| s > committed && s != seq).collect();
        prop_assert_eq!(finished.started, kept, "the others are kept as they were");
    }

    #[test]
    fn a_suspect_is_blamed_only_for_owners_it_ended_in_its_window_or_in_sight(
        limit in 1u32..5,
        committed in 0u64..50,
        ahead in 1u64..20,
        others in proptest::collection::btree_map(0u64..80, 1u32..4, 0..6),
        owners in proptest::collection::vec((0u8..3, 0u64..60), 1..40),
    ) {
        // Each owner starts the suspect (if it is not quarantined) and then: it finishes
        // (0); the owner dies unseen, of it or of anything else (1); or it ends its owner
        // in sight, a callback timeout or a fatal error (2); `secs` after the start. The
        // worker takes the start back at the window while its owner lives, and counts
        // an end in sight again.
        let seq = committed + ahead;
        let s = Suspects::new(seq, limit);
        let mut record = SuspectRecord { started: others.clone() };
        record.started.remove(&seq);
        let window = SUSPECT_WINDOW.as_secs();
        let mut blamed = 0u32;
        for (how, secs) in owners {
            let running = match s.judge(record.clone(), seq, committed) {
                SuspectVerdict::Start(r) => {
                    prop_assert!(blamed < limit, "started with {} blamed ends of {}", blamed, limit);
                    prop_assert_eq!(r.started.get(&seq).copied(), Some(blamed + 1));
                    r
                }
                SuspectVerdict::Quarantine { starts } => {
                    prop_assert_eq!((starts, blamed), (limit, limit), "quarantined at the limit of blamed ends");
                    break;
                }
            };
            let alive_at_window = secs >= window;
            let outlived = if alive_at_window { s.outlived(running.clone(), seq, committed) } else { running.clone() };
            record = match how {
                0 => {
                    blamed = 0;
                    s.finish(outlived, seq, committed)
                }
                1 => {
                    // Died unseen: blamed only inside the window.
                    if !alive_at_window {
                        blamed += 1;
                    }
                    outlived
                }
                _ => {
                    blamed += 1;
                    if alive_at_window { s.ended_owner(outlived, seq, committed) } else { outlived }
                }
            };
            prop_assert_eq!(record.started.get(&seq).copied().unwrap_or(0), blamed, "the record counts the blamed ends");
            let kept: BTreeMap<u64, u32> =
                others.iter().filter(|&(&o, _)| o > committed && o != seq).map(|(&o, &n)| (o, n)).collect();
            let rest: BTreeMap<u64, u32> = record.started.iter().filter(|&(&o, _)| o != seq).map(|(&o, &n)| (o, n)).collect();
            prop_assert_eq!(rest, kept, "the other suspects are kept as they were");
        }
    }

    #[test]
    fn a_busy_partition_commits_once_per_window_and_an_idle_one_at_once(
        window in 0u32..20,
        steps in proptest::collection::vec(any::<bool>(), 1..200),
    ) {
        // Completions arrive one by one; `idle` says whether the partition is idle after
        // each. A commit takes everything completed so far.
        let mut uncommitted = 0u64;
        for idle in steps {
            uncommitted += 1;
            let due = commit_due(uncommitted, idle, window);
            prop_assert!(due || (!idle && uncommitted < u64::from(window.max(1))), "{} completed, idle {}: no commit", uncommitted, idle);
            prop_assert!(!due || idle || uncommitted >= u64::from(window.max(1)), "a busy partition committed {} of a window of {}", uncommitted, window);
            if due {
                uncommitted = 0;
            }
        }
        prop_assert!(!commit_due(0, true, window) && !commit_due(0, false, window), "nothing to commit, no commit");
    }

    #[test]
    fn failures_retry_in_place_or_nak_until_the_last_attempt_then_dead_letter(
        max_attempts in 0u32..8,
        attempt in 1u32..10,
        ordered in any::<bool>(),
    ) {
        let policy = RetryPolicy { max_attempts, jitter: 0.0, ..RetryPolicy::default() };
        let discipline = if ordered { Discipline::Ordered } else { Discipline::Queue };
        let after = discipline.after_failure(attempt, &policy, 0.5);
        if attempt >= max_attempts.max(1) {
            prop_assert_eq!(after, AfterFailure::DeadLetter);
        } else if ordered {
            prop_assert_eq!(after, AfterFailure::RetryInPlace(policy.backoff(attempt, 0.5)), "a partition keeps its order");
        } else {
            prop_assert_eq!(after, AfterFailure::Nak(policy.backoff(attempt, 0.5)));
        }
    }
}
