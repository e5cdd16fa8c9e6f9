use super::event as ev;
use super::*;
use crate::partition::readiness::TaskState;

/// A delivery as the machine's tests (and properties) hold it: its token is its sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Msg {
    pub(super) seq: u64,
    pub(super) delivered: u64,
}

impl Delivered for Msg {
    type Token = u64;
    fn stream_seq(&self) -> u64 {
        self.seq
    }
    fn delivered(&self) -> u64 {
        self.delivered
    }
    fn token(&self) -> &u64 {
        &self.seq
    }
}

pub(super) fn config(discipline: Discipline) -> Config {
    Config {
        discipline,
        retry: RetryPolicy { max_attempts: 3, ..RetryPolicy::default() },
        unavailable_retries: 2,
        window: 4,
        timing: Timing {
            commit_interval: Duration::from_secs(1),
            ack_wait: Duration::from_secs(30),
            callback_timeout: Some(Duration::from_secs(60)),
        },
    }
}

pub(super) fn partition(config: Config, max_concurrency: usize) -> Partition<Msg> {
    Partition::new(Arc::new(config), TaskState::new([0], max_concurrency, false, "run"), Intake::after(None))
}

pub(super) fn effects(p: &mut Partition<Msg>) -> Vec<Effect<Msg>> {
    std::iter::from_fn(|| p.poll_effect()).collect()
}

/// Acks among `effects`, as (token, kind).
pub(super) fn acks(effects: &[Effect<Msg>]) -> Vec<(u64, AckKind)> {
    effects
        .iter()
        .flat_map(|e| match e {
            Effect::Acks(batch) => batch.clone(),
            _ => Vec::new(),
        })
        .collect()
}

/// Hand-backs among `effects`, as (sequence, interrupted).
fn hand_backs(effects: &[Effect<Msg>]) -> Vec<(u64, bool)> {
    effects
        .iter()
        .filter_map(
            |e| if let Effect::HandBack { msg, interrupted } = e { Some((msg.seq, *interrupted)) } else { None },
        )
        .collect()
}

fn credit(effects: &[Effect<Msg>]) -> usize {
    effects.iter().map(|e| if let Effect::Credit(n) = e { *n } else { 0 }).sum()
}

/// The held message at `order` returns `Ok`, its callbacks end and its outputs are stored.
pub(super) fn complete(p: &mut Partition<Msg>, order: u64, now: Instant) {
    p.handle(ev::ReturnedOk(order), now);
    p.handle(ev::CallbacksDone(order), now);
    p.handle(ev::EffectsStored(order), now);
}

/// Delivers `seqs` (first deliveries) and begins them all; returns their orders.
pub(super) fn deliver_and_begin(p: &mut Partition<Msg>, seqs: &[u64], now: Instant) -> Vec<u64> {
    for &seq in seqs {
        p.handle(ev::Arrived { kind: EnvelopeKind::Data, msg: Msg { seq, delivered: 1 } }, now);
    }
    let mut orders = Vec::new();
    while let Next::Begin(order) = p.next(now) {
        assert!(p.handle(ev::Started(order), now));
        orders.push(order);
    }
    orders
}

#[test]
fn a_queue_message_is_acked_once_its_outputs_are_stored_and_credited_once() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Queue), 4);
    let orders = deliver_and_begin(&mut p, &[10, 11], now);
    assert_eq!(orders, vec![0, 1]);
    assert_eq!(p.readiness().in_flight(), 2);
    p.handle(ev::CallbacksDone(1), now);
    assert!(p.handle(ev::EffectsStored(1), now).is_some());
    let out = effects(&mut p);
    assert_eq!(acks(&out), vec![(11, AckKind::Ack)]);
    assert_eq!(credit(&out), 1);
    assert!(matches!(out.last(), Some(Effect::Credit(1))), "the credit comes last, as one");
    assert_eq!(p.readiness().in_flight(), 1);
    assert!(p.handle(ev::EffectsStored(1), now).is_none(), "finishing twice does nothing");
    assert!(effects(&mut p).is_empty());
}

#[test]
fn an_ordered_partition_commits_once_a_window_completed_with_one_ack_all_of_the_last() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Ordered), 8);
    let orders = deliver_and_begin(&mut p, &[5, 6, 7, 8, 9], now);
    // Out of order: nothing is committable until the first is done.
    for &o in orders.iter().skip(1).take(3) {
        p.handle(ev::CallbacksDone(o), now);
        p.handle(ev::EffectsStored(o), now);
    }
    assert!(!p.readiness().commit_pending());
    p.handle(ev::CallbacksDone(orders[0]), now);
    p.handle(ev::EffectsStored(orders[0]), now);
    assert!(p.readiness().commit_pending(), "a window of four completed");
    assert_eq!(p.committable_seq(), Some(8));
    assert!(effects(&mut p).is_empty(), "no ack before the commit");
    assert_eq!(p.next(now), Next::Idle, "the commit waits for what runs");
    p.handle(ev::CallbacksDone(orders[4]), now);
    p.handle(ev::EffectsStored(orders[4]), now);
    assert_eq!(p.next(now), Next::Commit);
    let positions = p.readiness().committable().clone();
    p.handle(ev::Committed(positions), now);
    let out = effects(&mut p);
    assert_eq!(acks(&out), vec![(9, AckKind::Ack)], "one ack-all of the last in the prefix");
    assert_eq!(credit(&out), 5);
    assert_eq!(p.committed(), 9);
    assert_eq!(p.last_commit(), Some(&9));
}

#[test]
fn an_idle_partition_commits_what_completed_at_once() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Ordered), 8);
    let orders = deliver_and_begin(&mut p, &[1], now);
    p.handle(ev::CallbacksDone(orders[0]), now);
    p.handle(ev::EffectsStored(orders[0]), now);
    assert!(p.readiness().commit_pending());
}

#[test]
fn an_ordered_failure_is_retried_in_place_then_dead_lettered_and_skipped() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Ordered), 1);
    let order = deliver_and_begin(&mut p, &[3], now)[0];
    p.handle(ev::Running(order), now);
    let Some(AfterFailure::RetryInPlace(delay)) = p.handle(ev::Failed { order, reason: "boom", sample: 0.5 }, now)
    else {
        panic!("an ordered failure is retried in place")
    };
    assert!(effects(&mut p).is_empty());
    assert_eq!(p.held(order).map(|h| h.attempt), Some(2));
    assert_eq!(p.readiness().in_flight(), 1, "it still holds its place: the partition waits");
    assert_eq!(p.next(now), Next::Idle, "nothing else starts while it backs off");
    assert_eq!(p.poll_timeout(now), Some(now + delay), "its back-off is the first deadline");
    assert_eq!(p.handle_timeout(now + delay - Duration::from_millis(1)), None);
    assert_eq!(p.next(now), Next::Idle, "not before its back-off is over");
    p.handle_timeout(now + delay);
    assert_eq!(p.next(now), Next::Retry(order));
    assert!(p.handle(ev::Started(order), now));
    p.handle(ev::Running(order), now);
    p.handle(ev::Failed { order, reason: "boom", sample: 0.5 }, now);
    p.handle_timeout(now + Duration::from_secs(60));
    effects(&mut p);
    assert_eq!(p.next(now), Next::Retry(order));
    assert!(p.handle(ev::Started(order), now));
    p.handle(ev::Running(order), now);
    assert_eq!(p.handle(ev::Failed { order, reason: "boom", sample: 0.5 }, now), Some(AfterFailure::DeadLetter));
    match effects(&mut p).as_slice() {
        [Effect::DeadLetter { order: o, reason: "max-attempts", detail, attempts: 3 }] => {
            assert_eq!(*o, order);
            assert!(detail.contains("attempt 3 of 3 failed: boom"), "{detail}");
        }
        other => panic!("expected a dead letter, got {other:?}"),
    }
    assert!(p.handle(ev::DeadLettered(order), now).is_some());
    assert!(p.readiness().uncommitted(), "skipped: it completes in place");
    assert!(acks(&effects(&mut p)).is_empty(), "an ordered message is never term'd");
}

#[test]
fn a_queue_failure_is_nakked_with_its_back_off_and_a_dead_letter_terminates() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Queue), 2);
    let orders = deliver_and_begin(&mut p, &[1, 2], now);
    match p.handle(ev::Failed { order: orders[0], reason: "no", sample: 0.5 }, now) {
        Some(AfterFailure::Nak(delay)) => {
            let out = effects(&mut p);
            assert_eq!(acks(&out), vec![(1, AckKind::Nak(Some(delay)))]);
            assert_eq!(credit(&out), 1);
        }
        other => panic!("expected a nak, got {other:?}"),
    }
    assert!(p.held(orders[0]).is_none());
    p.handle(ev::Poison { order: orders[1], reason: "malformed", detail: "bad bytes".into() }, now);
    assert!(matches!(effects(&mut p).as_slice(), [Effect::DeadLetter { attempts: 0, .. }]), "it never ran");
    p.handle(ev::DeadLettered(orders[1]), now);
    assert_eq!(acks(&effects(&mut p)), vec![(2, AckKind::Term)]);
    assert_eq!(p.readiness().in_flight(), 0);
}

#[test]
fn a_dead_letter_not_stored_is_tried_again_at_the_next_start() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Queue), 1);
    let order = deliver_and_begin(&mut p, &[1], now)[0];
    p.handle(ev::DeadLetterRefused { order, reason: "crash-loop", detail: "again".into() }, now);
    assert!(effects(&mut p).is_empty());
    p.handle_timeout(now + DEAD_LETTER_RETRY);
    assert_eq!(p.next(now), Next::Retry(order), "tried again a second later");
    assert!(!p.handle(ev::Started(order), now), "it does not run: its dead letter is due");
    assert!(matches!(effects(&mut p).as_slice(), [Effect::DeadLetter { reason: "crash-loop", .. }]));
}

#[test]
fn unavailable_costs_no_attempt_up_to_the_ceiling() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Ordered), 1);
    let order = deliver_and_begin(&mut p, &[1], now)[0];
    let first = p.handle(ev::Unavailable { order, reason: "down", sample: 0.5 }, now).expect("a wait");
    let second = p.handle(ev::Unavailable { order, reason: "down", sample: 0.5 }, now).expect("a wait");
    assert_eq!((first, second), (UNAVAILABLE.wait(1, 0.5), UNAVAILABLE.wait(2, 0.5)));
    assert_eq!(p.held(order).map(|h| h.attempt), Some(1));
    assert_eq!(
        p.handle(ev::Unavailable { order, reason: "down", sample: 0.5 }, now),
        None,
        "the third is past the ceiling of two"
    );
    assert_eq!(p.held(order).map(|h| h.attempt), Some(2), "and costs an attempt");
}

#[test]
fn a_message_whose_outputs_were_refused_counts_in_flight_again() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Queue), 1);
    let order = deliver_and_begin(&mut p, &[1], now)[0];
    p.handle(ev::CallbacksDone(order), now);
    assert_eq!(p.readiness().in_flight(), 0);
    p.handle(ev::OutputsRefused(order), now);
    p.handle(ev::OutputsRefused(order), now);
    assert_eq!(p.readiness().in_flight(), 1, "counted once however often");
}

#[test]
fn restores_forced_before_count_as_attempts_and_can_spend_them() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Ordered), 4);
    p.set_blamed(vec![(7, 1), (8, 3)]);
    p.handle(ev::Arrived { kind: EnvelopeKind::Data, msg: Msg { seq: 7, delivered: 1 } }, now);
    p.handle(ev::Arrived { kind: EnvelopeKind::Data, msg: Msg { seq: 8, delivered: 1 } }, now);
    let Next::Begin(first) = p.next(now) else { panic!("the first begins") };
    assert_eq!(p.held(first).map(|h| h.attempt), Some(2));
    assert_eq!(p.next(now), Next::Idle, "the second does not run");
    match effects(&mut p).as_slice() {
        [Effect::DeadLetter { reason: "max-attempts", detail, .. }] => assert!(detail.contains("forcing a restore")),
        other => panic!("expected a dead letter, got {other:?}"),
    }
}

#[test]
fn with_stores_an_input_the_restored_state_reflects_is_finished_without_running() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Ordered), 4);
    p.set_durable(true);
    p.handle(ev::Restored { position: 4, hooks: 0 }, now);
    // The input the restore reflects comes again (its ack was lost): skipped, yet
    // committable in order.
    p.handle(ev::Arrived { kind: EnvelopeKind::Data, msg: Msg { seq: 4, delivered: 2 } }, now);
    p.handle(ev::Arrived { kind: EnvelopeKind::Data, msg: Msg { seq: 5, delivered: 1 } }, now);
    let Next::Begin(next) = p.next(now) else { panic!("the new one begins") };
    assert_eq!(p.held(next).map(|h| h.msg.seq), Some(5));
    assert_eq!(p.committable_seq(), Some(4));
    p.handle(ev::ReturnedOk(next), now);
    assert!(p.any_applied());
    assert_eq!(p.applied_through(), 5);
}

#[test]
fn a_stop_hands_back_what_backs_off_and_then_blocks_a_commit_past_it_with_stores() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Ordered), 2);
    p.set_durable(true);
    let orders = deliver_and_begin(&mut p, &[1, 2], now);
    p.handle(ev::Failed { order: orders[0], reason: "flaky", sample: 0.5 }, now);
    complete(&mut p, orders[1], now);
    effects(&mut p);
    assert_eq!(p.handle(ev::StopAsked, now), Some(1));
    match effects(&mut p).as_slice() {
        [Effect::HandBack { msg, interrupted: true }] => assert_eq!(msg.seq, 1),
        other => panic!("expected the first handed back, got {other:?}"),
    }
    assert_eq!(p.readiness().in_flight(), 0);
    assert!(p.commit_blocked_by_hand_back(), "the second's changes cannot be committed apart from the first");
    let idle = StopFacts { task_home: true, outputs_in_flight: false, stores_changed: false };
    assert_eq!(p.stop_step(idle), StopStep::EndWithoutCommit, "so the stop ends without a commit");
    assert!(!p.readiness().uncommitted(), "the commit position stays before the one handed back");
}

#[test]
fn without_stores_a_hand_back_blocks_no_commit() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Ordered), 2);
    let orders = deliver_and_begin(&mut p, &[1, 2], now);
    p.handle(ev::Failed { order: orders[0], reason: "flaky", sample: 0.5 }, now);
    p.handle(ev::CallbacksDone(orders[1]), now);
    p.handle(ev::EffectsStored(orders[1]), now);
    p.handle(ev::StopAsked, now);
    assert!(!p.commit_blocked_by_hand_back());
}

#[test]
fn unstarted_messages_are_handed_back_and_credited_and_their_claims_dropped() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Ordered), 1);
    let orders = deliver_and_begin(&mut p, &[1, 2, 3], now);
    assert_eq!(orders.len(), 1);
    p.handle(ev::HandBackUnstarted, now);
    let out = effects(&mut p);
    assert_eq!(hand_backs(&out), vec![(2, true), (3, true)]);
    assert_eq!(credit(&out), 2);
    p.handle(ev::CallbacksDone(orders[0]), now);
    p.handle(ev::EffectsStored(orders[0]), now);
    let positions = p.readiness().committable().clone();
    p.handle(ev::Committed(positions), now);
    assert_eq!(acks(&effects(&mut p)), vec![(1, AckKind::Ack)], "the commit covers only the one that ran");
}

#[test]
fn release_all_hands_back_everything_in_order_and_abandon_nothing() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Queue), 2);
    deliver_and_begin(&mut p, &[1, 2, 3], now);
    p.handle(ev::ReleaseAll { interrupted: false }, now);
    assert_eq!(
        hand_backs(&effects(&mut p)),
        vec![(3, false), (1, false), (2, false)],
        "the unstarted first, then what ran, in order"
    );
    let mut q = partition(config(Discipline::Queue), 2);
    deliver_and_begin(&mut q, &[1, 2, 3], now);
    q.abandon();
    assert!(effects(&mut q).is_empty(), "a fenced worker acknowledges and hands back nothing");
    assert!(!q.holds());
}

#[test]
fn keep_alive_sends_in_progress_acks_every_third_of_ack_wait() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Ordered), 1);
    deliver_and_begin(&mut p, &[1, 2], now);
    p.keep_alive(now + Duration::from_secs(5));
    assert!(effects(&mut p).is_empty());
    let later = now + Duration::from_secs(10);
    p.keep_alive(later);
    assert_eq!(acks(&effects(&mut p)), vec![(1, AckKind::InProgress), (2, AckKind::InProgress)]);
    p.keep_alive(later + Duration::from_secs(1));
    assert!(effects(&mut p).is_empty(), "kept alive just now");

    let mut q = partition(config(Discipline::Queue), 1);
    deliver_and_begin(&mut q, &[1, 2], now);
    q.keep_alive(later);
    assert_eq!(acks(&effects(&mut q)), vec![(1, AckKind::InProgress)], "only what runs; the queued one is not held");
}

#[test]
fn an_idle_partition_has_no_deadline_and_a_busy_one_only_those_it_needs() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Ordered), 2);
    assert_eq!(p.poll_timeout(now), None, "an idle partition gets no ticks");
    let orders = deliver_and_begin(&mut p, &[1, 2], now);
    // Held and running: keep-alive (10 s) and the callback check (15 s).
    assert_eq!(p.poll_timeout(now), Some(now + Duration::from_secs(10)));
    let at = now + Duration::from_secs(10);
    assert_eq!(p.handle_timeout(at), None);
    assert_eq!(acks(&effects(&mut p)), vec![(1, AckKind::InProgress), (2, AckKind::InProgress)]);
    assert_eq!(p.poll_timeout(at), Some(now + Duration::from_secs(15)), "the check comes next");
    // One completes: a commit is due within the commit interval, not later.
    p.handle(ev::CallbacksDone(orders[1]), now);
    p.handle(ev::EffectsStored(orders[1]), now);
    p.handle(ev::CallbacksDone(orders[0]), now);
    p.handle(ev::EffectsStored(orders[0]), now);
    assert!(p.readiness().commit_pending(), "idle: the commit is requested at once");
    assert_eq!(p.next(at), Next::Commit);
    let positions = p.readiness().committable().clone();
    p.handle(ev::Committed(positions), now);
    effects(&mut p);
    // Nothing held, nothing uncommitted: the deadlines left run out without a tick more.
    let deadline = p.poll_timeout(at).expect("the check and keep-alive armed before");
    p.handle_timeout(deadline);
    let deadline = p.poll_timeout(deadline).expect("one more");
    p.handle_timeout(deadline);
    assert_eq!(p.poll_timeout(deadline), None, "idle again: no deadline");
}

#[test]
fn completions_wait_at_most_the_commit_interval() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Ordered), 2);
    let orders = deliver_and_begin(&mut p, &[1, 2], now);
    p.handle(ev::CallbacksDone(orders[0]), now);
    p.handle(ev::EffectsStored(orders[0]), now);
    assert!(!p.readiness().commit_pending(), "not idle, not a window: no commit yet");
    assert_eq!(p.poll_timeout(now), Some(now + Duration::from_secs(1)), "the commit interval");
    p.handle_timeout(now + Duration::from_secs(1));
    assert!(p.readiness().commit_pending());
}

#[test]
fn a_callback_past_its_timeout_is_reported() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Queue), 2);
    let orders = deliver_and_begin(&mut p, &[1, 2], now);
    assert_eq!(p.handle_timeout(now + Duration::from_secs(15)), None, "checked, none late");
    p.poll_timeout(now + Duration::from_secs(15));
    assert_eq!(p.handle_timeout(now + Duration::from_secs(60)), Some(orders[0]), "the first late one");
}

#[test]
fn a_queue_marker_is_claimed_and_acked_by_the_commit() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Queue), 1);
    p.handle(ev::Arrived { kind: EnvelopeKind::EndOfStream, msg: Msg { seq: 9, delivered: 1 } }, now);
    assert!(p.holds() || p.held_count() == 0);
    assert_eq!(p.next(now), Next::EndOfStream);
    let positions = p.readiness().committable().clone();
    p.handle(ev::Committed(positions), now);
    let out = effects(&mut p);
    assert_eq!(acks(&out), vec![(9, AckKind::Ack)]);
    assert_eq!(credit(&out), 1);
}

#[test]
fn forgetting_what_is_no_longer_held_changes_nothing() {
    let now = Instant::now();
    let mut p = partition(config(Discipline::Queue), 2);
    let orders = deliver_and_begin(&mut p, &[1], now);
    p.handle(ev::ReleaseAll { interrupted: true }, now);
    effects(&mut p);
    // A park that finished after a stop's deadline handed the message back.
    assert!(p.handle(ev::Forgotten(orders[0]), now).is_none());
    assert!(effects(&mut p).is_empty(), "no second credit for a message handed back already");
}
