//! Tasks with stores when a record fails, on the embedded broker and tokio's paused
//! clock: a record whose deferred work fails is retried in place and dead-lettered as
//! it would be without stores (its store changes undone, never applied twice); a record
//! whose changes cannot be undone alone forces counted, backed-off restores and is
//! quarantined; a stop during a retry back-off never commits a later record's changes
//! before the earlier one; a value too large for the changelog is refused at `put`.
//!
//! Every assertion here is a safety assertion (a count applied twice, a record lost or
//! never dead-lettered), except those that say "LIVENESS" (something did not happen in
//! time).

use flotilla_actors::{Job, RetryPolicy, StoreDef, StoreError, StreamDef, Task, TaskContext, TaskError};
use flotilla_transport::EmbeddedBroker;
use flotilla_transport::broker::{AckPolicy, ConsumerSpec, OutboundMessage, SharedBroker};
use flotilla_transport::wire::{Codec, Headers, headers, partition_for};
use serde::{Deserialize, Serialize};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Vote {
    voter: u64,
    choice: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Total {
    choice: String,
    count: u64,
}

const TOTALS: StreamDef<Total> = StreamDef::ordered("totals", 1);
const COUNTS: StoreDef<String, u64> = StoreDef::new("counts");
const BLOBS: StoreDef<String, Vec<u8>> = StoreDef::new("blobs");

fn votes(partitions: u32) -> StreamDef<Vote> {
    StreamDef::ordered("votes", partitions)
}

/// What the tasks of these tests saw.
#[derive(Default)]
struct Seen {
    /// Votes whose processing succeeded (deferred work included).
    counted: Cell<u64>,
    /// Attempts that failed.
    failed: Cell<u64>,
    /// Record 1 of the back-off test was unavailable once.
    unavailable_once: Cell<bool>,
}

/// Counts votes per choice and in `all`; a vote's deferred work (a short simulated I/O)
/// fails for `poison…` on every attempt and for `flaky…` on its first; `big…` sends an
/// output over the broker's limit; `blob…` stores a value over the changelog's limit;
/// `unavailable…` is unavailable on its first attempt (in `process`, before any write).
struct Counter {
    seen: Rc<Seen>,
    io: Duration,
}

impl Task for Counter {
    type Input = Vote;

    async fn process(&mut self, vote: Vote, ctx: &mut TaskContext) -> Result<(), TaskError> {
        let attempt = ctx.message().map_or(1, |m| m.attempt);
        if vote.choice.starts_with("unavailable") && !self.seen.unavailable_once.replace(true) {
            self.seen.failed.set(self.seen.failed.get() + 1);
            return Err(TaskError::unavailable("the simulated database is down"));
        }
        ctx.store(&COUNTS)?.update(vote.choice.clone(), |n| Some(n.unwrap_or(0) + 1))?;
        ctx.store(&COUNTS)?.update("all".into(), |n| Some(n.unwrap_or(0) + 1))?;
        if vote.choice.starts_with("blob") {
            ctx.store(&BLOBS)?.put("blob".into(), vec![vote.voter as u8; 700 * 1024])?;
        }
        if vote.choice.starts_with("big") {
            ctx.send(&TOTALS, "big", Total { choice: "x".repeat(2 << 20), count: 0 }).await?;
        }
        let fails = vote.choice.starts_with("poison") || (vote.choice.starts_with("flaky") && attempt == 1);
        let seen = self.seen.clone();
        let io = self.io;
        ctx.defer(async move {
            tokio::time::sleep(io).await;
            if fails {
                seen.failed.set(seen.failed.get() + 1);
                return Err(TaskError::failed(format!("the simulated I/O of vote {} failed", vote.voter)));
            }
            seen.counted.set(seen.counted.get() + 1);
            Ok(())
        });
        Ok(())
    }

    async fn window(&mut self, ctx: &mut TaskContext) -> Result<(), TaskError> {
        for (choice, count) in ctx.store(&COUNTS)?.entries() {
            ctx.send(&TOTALS, "totals", Total { choice, count }).await?;
        }
        Ok(())
    }
}

fn job(seen: &Rc<Seen>, partitions: u32, concurrency: usize, io: Duration) -> Job {
    let seen = seen.clone();
    Job::new("sf")
        .task(votes(partitions), move |_| Counter { seen: seen.clone(), io })
        .store(COUNTS)
        .store(BLOBS)
        .max_concurrency(concurrency)
        .retry(RetryPolicy { max_attempts: 3, initial_backoff: Duration::from_millis(100), ..RetryPolicy::default() })
        .window_every(Duration::from_millis(500))
        .output(TOTALS)
}

async fn vote(b: &SharedBroker, partitions: u32, voter: u64, choice: &str) {
    let payload = Codec::default().encode(&Vote { voter, choice: choice.into() }).expect("encode");
    let subject = format!("flotilla.sf.votes.{}", partition_for(choice, partitions));
    let msg = OutboundMessage::new(subject, payload).with_id(format!("vote-{voter}")).with_header(headers::KEY, choice);
    b.publish(msg).await.expect("publish");
}

/// Every message of `js_stream`, with its headers.
async fn read_all(b: &SharedBroker, js_stream: &str) -> Vec<(bytes::Bytes, Headers)> {
    let name = format!("reader-{}", flotilla_transport::wire::MessageId::new_v7().as_str().replace('-', ""));
    let spec =
        ConsumerSpec { ack_policy: AckPolicy::Explicit, max_ack_pending: None, ..ConsumerSpec::new(name.clone()) };
    if b.ensure_consumer(js_stream, spec).await.is_err() {
        return Vec::new();
    }
    let mut out = Vec::new();
    loop {
        let got = b.claim(js_stream, &name, 1000, Duration::from_millis(50)).await.expect("claim");
        if got.is_empty() {
            break;
        }
        out.extend(got.into_iter().map(|d| (d.payload.clone(), d.headers.clone())));
    }
    b.delete_consumer(js_stream, &name).await.expect("delete reader");
    out
}

/// The last total of each choice.
async fn last_totals(b: &SharedBroker) -> BTreeMap<String, u64> {
    let mut last = BTreeMap::new();
    for (payload, _) in read_all(b, "FLOTILLA_sf_totals").await {
        if let Ok(t) = Codec::default().decode::<Total>(&payload) {
            last.insert(t.choice, t.count);
        }
    }
    last
}

/// (reason, attempts) of each dead letter.
async fn dead_letters(b: &SharedBroker) -> Vec<(String, String)> {
    read_all(b, "FLOTILLA_sf_DLQ")
        .await
        .into_iter()
        .map(|(_, h)| {
            (
                h.get(headers::DLQ_REASON).unwrap_or_default().to_owned(),
                h.get(headers::DLQ_ATTEMPTS).unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// Waits (virtual time) until `done` holds; a liveness failure names what is missing.
async fn wait_until(what: &str, within: Duration, mut done: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if done().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("LIVENESS: {what} did not happen within {within:?}");
}

/// The `state_restored` events seen so far.
fn restores(events: &RefCell<Vec<String>>) -> usize {
    events.borrow().iter().filter(|k| *k == "state_restored").count()
}

/// Collects the job's event types.
async fn watch_events(b: &SharedBroker) -> Rc<RefCell<Vec<String>>> {
    let mut sub = b.subscribe("flotilla.sf._evt.>", None).await.expect("events");
    let seen: Rc<RefCell<Vec<String>>> = Rc::default();
    let s = seen.clone();
    actix_rt::spawn(async move {
        while let Some(ev) = futures::StreamExt::next(&mut sub).await {
            let v: serde_json::Value = serde_json::from_slice(&ev.payload).unwrap_or_default();
            s.borrow_mut().push(v["type"].as_str().unwrap_or_default().to_owned());
        }
    });
    seen
}

fn map(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(c, n)| ((*c).to_owned(), *n)).collect()
}

#[actix_rt::test]
async fn a_record_whose_deferred_work_fails_is_retried_in_place_and_dead_lettered_with_no_restore() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let events = watch_events(&b).await;
    let seen = Rc::new(Seen::default());
    let running = job(&seen, 1, 1, Duration::from_millis(2)).start(b.clone()).await.expect("start");
    for (voter, choice) in ["red", "flaky-x", "poison-1", "green", "red", "big-1", "blue"].iter().enumerate() {
        vote(&b, 1, voter as u64, choice).await;
    }
    wait_until("5 votes counted and 2 dead letters", Duration::from_secs(60), async || {
        seen.counted.get() >= 5 && dead_letters(&b).await.len() >= 2
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut dlq = dead_letters(&b).await;
    dlq.sort();
    assert_eq!(
        dlq,
        vec![("max-attempts".to_owned(), "3".to_owned()), ("too-large".to_owned(), "1".to_owned())],
        "SAFETY: the poison vote is dead-lettered after its 3 attempts, the vote with a too-large output at once"
    );
    assert_eq!(
        last_totals(&b).await,
        map(&[("all", 5), ("blue", 1), ("flaky-x", 1), ("green", 1), ("red", 2)]),
        "SAFETY: a failed attempt's store changes are undone; the flaky vote counts once, poison and big not at all"
    );
    assert_eq!(seen.failed.get(), 4, "the flaky vote failed once, the poison vote 3 times");
    assert_eq!(restores(&events), 1, "no record forced a restore of the partition (only its start restored)");
    running.stop();
    running.wait().await.expect("stop");
}

#[actix_rt::test]
async fn a_record_whose_changes_cannot_be_undone_alone_forces_counted_restores_then_the_dlq() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let events = watch_events(&b).await;
    let seen = Rc::new(Seen::default());
    // Four votes at once, all writing `all`: a failing one's changes are entangled with
    // the next ones', so only a restore of the last commit can take them back.
    let running = job(&seen, 1, 4, Duration::from_millis(20)).start(b.clone()).await.expect("start");
    let mut want = BTreeMap::new();
    for voter in 0..40u64 {
        let choice = match voter {
            10 => "poison-1".to_owned(),
            25 => "flaky-2".to_owned(),
            v => format!("c{}", v % 3),
        };
        if !choice.starts_with("poison") {
            *want.entry(choice.clone()).or_insert(0) += 1;
            *want.entry("all".to_owned()).or_insert(0) += 1;
        }
        vote(&b, 1, voter, &choice).await;
    }
    wait_until("the poison vote dead-lettered and the rest counted", Duration::from_secs(300), async || {
        !dead_letters(&b).await.is_empty() && last_totals(&b).await.get("all").is_some_and(|n| *n >= 39)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let dlq = dead_letters(&b).await;
    assert_eq!(dlq.len(), 1, "SAFETY: the poison vote is dead-lettered once: {dlq:?}");
    assert_eq!(dlq[0].0, "max-attempts", "SAFETY: its attempts are counted across restores: {dlq:?}");
    assert_eq!(last_totals(&b).await, want, "SAFETY: every other vote counted exactly once across the restores");
    let restored = restores(&events);
    assert!(
        (2..=6).contains(&restored),
        "the poison vote forced a bounded number of restores (its attempts), not a loop: {restored}"
    );
    running.stop();
    running.wait().await.expect("stop");
}

#[actix_rt::test]
async fn a_stop_during_a_retry_back_off_never_commits_a_later_records_changes_before_it() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let seen = Rc::new(Seen::default());
    let running = job(&seen, 1, 2, Duration::ZERO).start(b.clone()).await.expect("start");
    // Record 1 is unavailable once (a back-off of 100 ms or more); record 2 finishes
    // meanwhile, out of order.
    vote(&b, 1, 1, "unavailable-1").await;
    vote(&b, 1, 2, "second").await;
    wait_until("record 2 counted while record 1 backs off", Duration::from_secs(10), async || {
        seen.counted.get() == 1 && seen.unavailable_once.get()
    })
    .await;
    running.stop();
    running.wait().await.expect("stop");

    // The next owner restores what was committed and processes what was not.
    let again = Rc::new(Seen { unavailable_once: Cell::new(true), ..Seen::default() });
    let running = job(&again, 1, 2, Duration::ZERO).start(b.clone()).await.expect("restart");
    wait_until("both records counted by the restarted job", Duration::from_secs(30), async || {
        last_totals(&b).await.get("all").is_some_and(|n| *n >= 2)
    })
    .await;
    assert_eq!(
        last_totals(&b).await,
        map(&[("all", 2), ("second", 1), ("unavailable-1", 1)]),
        "SAFETY: each record applied once (record 2 was counted twice when its changes were committed before record 1)"
    );
    running.stop();
    running.wait().await.expect("stop");
}

#[actix_rt::test]
async fn a_value_too_large_for_the_changelog_is_refused_at_put_and_dead_lettered() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let seen = Rc::new(Seen::default());
    let running = job(&seen, 1, 1, Duration::ZERO).start(b.clone()).await.expect("start");
    // Each blob vote writes 700 KiB under one key: a changelog record holds the new and
    // the committed value, so the second could never commit (1.4 MB over 1 MiB).
    for (voter, choice) in ["red", "blob-1", "red", "blob-2"].iter().enumerate() {
        vote(&b, 1, voter as u64, choice).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    wait_until("two votes counted and the blobs dead-lettered", Duration::from_secs(30), async || {
        seen.counted.get() >= 2 && dead_letters(&b).await.len() >= 2
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        dead_letters(&b).await,
        vec![("too-large".to_owned(), "1".to_owned()); 2],
        "SAFETY: a vote whose value cannot be stored is dead-lettered at once"
    );
    assert_eq!(last_totals(&b).await, map(&[("all", 2), ("red", 2)]), "SAFETY: its other changes are undone");
    running.stop();
    running.wait().await.expect("the job stops cleanly: no commit failed");
}

#[test]
fn a_store_value_over_the_limit_is_a_typed_error_naming_key_size_and_limit() {
    let err = StoreError::ValueTooLarge { store: "blobs", key: "\"k\"".into(), size: 600_000, limit: 524_224 };
    let text = err.to_string();
    assert!(text.contains("blobs") && text.contains("600000") && text.contains("524224"), "{text}");
    let task: TaskError = err.into();
    assert!(matches!(task, TaskError::Permanent { reason: "too-large", .. }), "{task:?}");
}
