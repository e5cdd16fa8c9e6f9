//! Properties of the partition machine under any order of outcomes: messages arrive,
//! start as the machine allows, and each attempt ends in any way a task's can (done,
//! failed, unavailable, dead-lettered, outputs refused); retries come due in any order,
//! commits run when asked for, and the worker may be stopped at any point. Whatever
//! happens:
//!
//! * the readiness machine's in-flight count is the number of held messages that count
//!   (one owner, two views that never disagree), and never above `max_concurrency`;
//! * every message ends exactly once — acked, nak'd, terminated, committed or handed
//!   back — and is credited to the container exactly once, except what a stop hands back
//!   mid-retry (it stays before the commit position);
//! * an ordered partition's ack-alls go up, and never cover a message that did not
//!   finish: the commit position stays before anything held, handed back or not started;
//! * messages arrive only as claims bring them, and what is claimed and not credited
//!   back is never more than the worker's room (`capacity`).

use super::event as ev;
use super::*;
use proptest::prelude::*;

use super::tests::Msg;

#[derive(Debug, Clone, Copy)]
enum Outcome {
    Done,
    Failed,
    Unavailable,
    DeadLetter,
    Refused,
}

#[derive(Debug, Clone)]
enum Step {
    Arrive,
    /// Run what the machine allows; an attempt that starts ends with the picked outcome.
    Run(Vec<Outcome>),
    /// One retry waiting out its back-off (picked) comes due.
    RetryDue(u16),
    /// A stop hands back what has not started and what backs off.
    Stop,
}

fn outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![
        6 => Just(Outcome::Done),
        2 => Just(Outcome::Failed),
        1 => Just(Outcome::Unavailable),
        1 => Just(Outcome::DeadLetter),
        1 => Just(Outcome::Refused),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        5 => Just(Step::Arrive),
        5 => proptest::collection::vec(outcome(), 1..6).prop_map(Step::Run),
        3 => any::<u16>().prop_map(Step::RetryDue),
        1 => Just(Step::Stop),
    ]
}

/// What the worker saw the machine decide.
#[derive(Default)]
struct Seen {
    credit: usize,
    /// Per message: how it ended (ack, nak, term, handed back).
    ended: BTreeMap<u64, Vec<&'static str>>,
    commits: Vec<u64>,
    /// How many a stop handed back while they waited out a back-off.
    handed_back_mid_retry: usize,
}

fn drain(p: &mut Partition<Msg>, seen: &mut Seen, ordered: bool, now: Instant) {
    while let Some(effect) = p.poll_effect() {
        match effect {
            Effect::Acks(batch) => {
                for (seq, kind) in batch {
                    match kind {
                        AckKind::Ack if ordered => seen.commits.push(seq),
                        AckKind::Ack => seen.ended.entry(seq).or_default().push("ack"),
                        AckKind::Nak(_) => seen.ended.entry(seq).or_default().push("nak"),
                        AckKind::Term => seen.ended.entry(seq).or_default().push("term"),
                        AckKind::InProgress => {}
                    }
                }
            }
            Effect::DeadLetter { order, .. } => {
                // The dead letter is stored at once.
                p.handle(ev::DeadLettered(order), now);
            }
            Effect::HandBack { msg, .. } => seen.ended.entry(msg.seq).or_default().push("back"),
            Effect::Credit(n) => seen.credit += n,
        }
    }
}

fn check_counts(p: &Partition<Msg>, max_concurrency: usize) -> Result<(), TestCaseError> {
    let counted = p.held.values().filter(|h| h.counted).count();
    prop_assert_eq!(p.readiness().in_flight(), counted, "in flight is the held messages that count");
    prop_assert!(counted <= max_concurrency);
    Ok(())
}

fn run(ordered: bool, durable: bool, max_concurrency: usize, steps: Vec<Step>) -> Result<(), TestCaseError> {
    let now = Instant::now();
    let config = Config {
        discipline: if ordered { Discipline::Ordered } else { Discipline::Queue },
        retry: RetryPolicy { max_attempts: 3, ..RetryPolicy::default() },
        unavailable_retries: 1,
        window: 3,
        timing: Timing {
            commit_interval: Duration::from_secs(1),
            ack_wait: Duration::from_secs(30),
            callback_timeout: None,
        },
    };
    let mut p =
        Partition::new(Arc::new(config), TaskState::new([0], max_concurrency, false, "run"), Intake::after(None));
    p.set_durable(durable);
    let capacity = 5;
    p.set_claims(Arc::new(ClaimRules { capacity, wait: Duration::from_secs(1), idle_wait: Duration::from_secs(5) }));
    let mut seen = Seen::default();
    let mut arrived = 0u64;
    let mut stopped = false;
    for step in steps {
        match step {
            Step::Arrive => {
                // A claim for what there is room for brings one message (a stopping
                // worker claims nothing).
                if let Some(claim) = p.poll_claim(now) {
                    prop_assert!(!stopped, "a stopping worker claims");
                    prop_assert!(claim.max >= 1 && claim.max <= capacity);
                    p.handle(ev::ClaimReturned(1), now);
                    arrived += 1;
                    p.handle(ev::Arrived { kind: EnvelopeKind::Data, msg: Msg { seq: arrived, delivered: 1 } }, now);
                }
            }
            Step::Run(outcomes) => {
                for outcome in outcomes {
                    let order = match p.next(now) {
                        Next::Begin(order) | Next::Retry(order) => order,
                        Next::Commit => {
                            let positions = p.readiness().committable().clone();
                            p.handle(ev::Committed(positions), now);
                            drain(&mut p, &mut seen, ordered, now);
                            continue;
                        }
                        _ => break,
                    };
                    if !p.handle(ev::Started(order), now) {
                        drain(&mut p, &mut seen, ordered, now);
                        continue;
                    }
                    p.handle(ev::Running(order), now);
                    match outcome {
                        Outcome::Done => {
                            p.handle(ev::ReturnedOk(order), now);
                            p.handle(ev::CallbacksDone(order), now);
                            p.handle(ev::EffectsStored(order), now);
                        }
                        Outcome::Failed => {
                            p.handle(ev::Failed { order, reason: "failed", sample: 0.5 }, now);
                        }
                        Outcome::Unavailable => {
                            p.handle(ev::Unavailable { order, reason: "down", sample: 0.5 }, now);
                        }
                        Outcome::DeadLetter => {
                            p.handle(ev::Poison { order, reason: "poison", detail: "poison".into() }, now)
                        }
                        Outcome::Refused => {
                            p.handle(ev::CallbacksDone(order), now);
                            p.handle(ev::OutputsRefused(order), now);
                            p.handle(ev::Failed { order, reason: "refused", sample: 0.5 }, now);
                        }
                    }
                    drain(&mut p, &mut seen, ordered, now);
                    check_counts(&p, max_concurrency)?;
                }
            }
            Step::RetryDue(pick) => {
                // Back-offs end in any order (their waits are jittered).
                let waiting: Vec<(Instant, u64)> = p.backing_off.iter().copied().collect();
                if !waiting.is_empty() {
                    let due = waiting[usize::from(pick) % waiting.len()];
                    p.backing_off.remove(&due);
                    p.retry_due(due.1);
                }
            }
            Step::Stop if !stopped => {
                stopped = true;
                seen.handed_back_mid_retry = p.handle(ev::StopAsked, now).unwrap_or_default();
                drain(&mut p, &mut seen, ordered, now);
            }
            Step::Stop => {}
        }
        drain(&mut p, &mut seen, ordered, now);
        check_counts(&p, max_concurrency)?;
        prop_assert_eq!(p.outstanding() + seen.credit, arrived as usize, "claimed = outstanding + credited");
        prop_assert!(p.outstanding() <= capacity, "{} outstanding, room for {}", p.outstanding(), capacity);
        prop_assert!(seen.commits.windows(2).all(|w| w[0] < w[1]), "ack-alls go up: {:?}", seen.commits);
        if let Some(&last) = seen.commits.last() {
            for h in p.held.values() {
                prop_assert!(h.msg.seq > last, "the commit at {} covers {}, still held", last, h.msg.seq);
            }
            for (seq, ends) in &seen.ended {
                if ends.contains(&"back") {
                    prop_assert!(*seq > last, "the commit at {} covers {}, handed back", last, seq);
                }
            }
        }
    }
    // Let everything still running finish, retries come due, and the last commit run.
    for _ in 0..(4 * arrived + 8) {
        p.handle_timeout(now + Duration::from_secs(3600));
        match p.next(now) {
            Next::Begin(order) | Next::Retry(order) => {
                if p.handle(ev::Started(order), now) {
                    p.handle(ev::ReturnedOk(order), now);
                    p.handle(ev::CallbacksDone(order), now);
                    p.handle(ev::EffectsStored(order), now);
                }
            }
            Next::Commit => {
                let positions = p.readiness().committable().clone();
                p.handle(ev::Committed(positions), now);
            }
            _ => {
                p.handle(ev::CommitRequested, now);
                if p.next(now) == Next::Commit {
                    let positions = p.readiness().committable().clone();
                    p.handle(ev::Committed(positions), now);
                }
            }
        }
        drain(&mut p, &mut seen, ordered, now);
        check_counts(&p, max_concurrency)?;
    }
    prop_assert_eq!(p.held_count(), 0, "everything finished");
    let mid_retry = seen.handed_back_mid_retry;
    if ordered {
        // Each message is credited once, by the commit that covered it or its hand-back
        // unstarted; what a stop handed back mid-retry is not, nor what finished after
        // it (its claim stays: the commit position never passes the hand-back).
        prop_assert_eq!(seen.credit + p.claims.len() + mid_retry, arrived as usize, "credit");
        if mid_retry == 0 {
            prop_assert!(p.claims.is_empty(), "everything committed");
        }
        if !stopped && arrived > 0 {
            prop_assert_eq!(seen.commits.last().copied(), Some(arrived), "the last commit covers everything");
        }
    } else {
        for seq in 1..=arrived {
            let ends = seen.ended.get(&seq).map_or(&[][..], Vec::as_slice);
            prop_assert_eq!(ends.len(), 1, "message {} ended once: {:?}", seq, ends);
        }
        prop_assert_eq!(seen.credit + mid_retry, arrived as usize, "credited once, but for hand-backs mid-retry");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn an_ordered_partition_finishes_and_counts_every_message_once(
        durable in any::<bool>(),
        max_concurrency in 1usize..4,
        steps in proptest::collection::vec(step(), 1..60),
    ) {
        run(true, durable, max_concurrency, steps)?;
    }

    #[test]
    fn a_queue_input_ends_and_counts_every_message_once(
        max_concurrency in 1usize..4,
        steps in proptest::collection::vec(step(), 1..60),
    ) {
        run(false, false, max_concurrency, steps)?;
    }
}
