//! Durable task state on the embedded broker, on tokio's paused clock: stores survive a
//! restart of their job, a failed attempt leaves no change, a value whose type changed
//! fails the task naming the store and key, and a restore that cannot read the
//! changelog holds the partition (docs/state.md).

use flotilla_actors::{Job, StoreDef, StreamDef, Task, TaskContext, TaskError};
use flotilla_tests::read_messages;
use flotilla_transport::EmbeddedBroker;
use flotilla_transport::broker::{OutboundMessage, SharedBroker};
use flotilla_transport::wire::{Codec, headers, partition_for};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
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

const VOTES: StreamDef<Vote> = StreamDef::ordered("votes", 4);
const TOTALS: StreamDef<Total> = StreamDef::ordered("totals", 4);
const COUNTS: StoreDef<String, u64> = StoreDef::new("counts");

/// Counts votes per choice; `flaky` votes fail their first attempt after writing, so a
/// failed attempt's write must be undone. Emits every total at end of stream... and on
/// every window.
struct Count {
    processed: Rc<RefCell<u64>>,
}

impl Task for Count {
    type Input = Vote;

    async fn process(&mut self, vote: Vote, ctx: &mut TaskContext) -> Result<(), TaskError> {
        let attempt = ctx.message().map_or(1, |m| m.attempt);
        ctx.store(&COUNTS)?.update(vote.choice.clone(), |n| Some(n.unwrap_or(0) + 1))?;
        if vote.choice.starts_with("flaky") && attempt == 1 {
            return Err(TaskError::failed("flaky: first attempt fails after its write"));
        }
        *self.processed.borrow_mut() += 1;
        Ok(())
    }

    async fn window(&mut self, ctx: &mut TaskContext) -> Result<(), TaskError> {
        for (choice, count) in ctx.store(&COUNTS)?.entries() {
            ctx.send(&TOTALS, &choice.clone(), Total { choice, count }).await?;
        }
        Ok(())
    }
}

fn job(processed: &Rc<RefCell<u64>>) -> Job {
    let p = processed.clone();
    Job::new("t")
        .task(VOTES, move |_| Count { processed: p.clone() })
        .store(COUNTS)
        .window_every(Duration::from_secs(1))
        .output(TOTALS)
}

async fn vote(b: &SharedBroker, voter: u64, choice: &str) {
    let payload = Codec::default().encode(&Vote { voter, choice: choice.into() }).expect("encode");
    let subject = format!("flotilla.t.votes.{}", partition_for(choice, 4));
    let msg = OutboundMessage::new(subject, payload).with_id(format!("vote-{voter}")).with_header(headers::KEY, choice);
    b.publish(msg).await.expect("publish");
}

/// The last total of each choice.
async fn last_totals(b: &SharedBroker) -> BTreeMap<String, u64> {
    let mut last = BTreeMap::new();
    for d in read_messages(b, "FLOTILLA_t_totals", None, Duration::from_millis(50)).await {
        let t: Total = Codec::default().decode(&d.payload).expect("total");
        last.insert(t.choice, t.count);
    }
    last
}

async fn wait_processed(processed: &Rc<RefCell<u64>>, n: u64) {
    for _ in 0..6000 {
        if *processed.borrow() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("processed {} of {n}", processed.borrow());
}

#[actix_rt::test]
async fn stores_survive_a_restart_of_their_job_and_failed_attempts_leave_no_change() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let processed = Rc::default();
    let running = job(&processed).start(b.clone()).await.expect("start");
    for voter in 0..30 {
        vote(&b, voter, ["red", "green", "flaky-blue"][(voter % 3) as usize]).await;
    }
    wait_processed(&processed, 30).await;
    running.stop();
    running.wait().await.expect("stop");

    // A new job on the same broker: the stores come back from the changelog.
    let again = Rc::default();
    let running = job(&again).start(b.clone()).await.expect("restart");
    for voter in 30..60 {
        vote(&b, voter, ["red", "green", "flaky-blue"][(voter % 3) as usize]).await;
    }
    wait_processed(&again, 30).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let want: BTreeMap<String, u64> =
        [("flaky-blue", 20), ("green", 20), ("red", 20)].into_iter().map(|(c, n)| (c.to_owned(), n)).collect();
    assert_eq!(last_totals(&b).await, want, "20 votes each: nothing lost on restart, no failed attempt counted");
    assert_eq!(*again.borrow(), 30, "the restarted job processed only the new votes");
    running.stop();
    running.wait().await.expect("stop");
}

/// A task whose store value type changed since it was written.
struct Retyped;

impl Task for Retyped {
    type Input = Vote;
    async fn process(&mut self, _vote: Vote, _ctx: &mut TaskContext) -> Result<(), TaskError> {
        Ok(())
    }
}

#[actix_rt::test]
async fn a_value_that_no_longer_decodes_fails_the_task_naming_the_store_and_key() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let processed = Rc::default();
    let running = job(&processed).start(b.clone()).await.expect("start");
    vote(&b, 1, "red").await;
    wait_processed(&processed, 1).await;
    running.stop();
    running.wait().await.expect("stop");

    const RETYPED: StoreDef<String, Vec<String>> = StoreDef::new("counts");
    let running = Job::new("t").task(VOTES, |_| Retyped).store(RETYPED).start(b.clone()).await.expect("start");
    let err = tokio::time::timeout(Duration::from_secs(60), running.wait()).await.expect("exits").expect_err("fails");
    let text = err.to_string();
    assert!(text.contains("store counts key") && text.contains("no longer decodes"), "{text}");
}

#[actix_rt::test]
async fn a_restore_that_cannot_read_the_changelog_holds_the_partition_and_reports_it() {
    tokio::time::pause();
    let embedded = EmbeddedBroker::new();
    let b = embedded.shared();
    let mut events = b.subscribe("flotilla.t._evt.>", None).await.expect("events");
    let processed = Rc::default();
    let running = job(&processed).start(b.clone()).await.expect("start");
    // The restores are on their way: make the broker unreachable before they read.
    embedded.set_unavailable(true);
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(*processed.borrow(), 0);
    embedded.set_unavailable(false);
    vote(&b, 1, "red").await;
    wait_processed(&processed, 1).await;
    // Every partition's next attempt (backed off up to 45 s) restores it.
    tokio::time::sleep(Duration::from_secs(60)).await;
    let mut kinds = Vec::new();
    while let Ok(Some(ev)) =
        tokio::time::timeout(Duration::from_millis(10), futures::StreamExt::next(&mut events)).await
    {
        let v: serde_json::Value = serde_json::from_slice(&ev.payload).expect("json");
        kinds.push(v["type"].as_str().unwrap_or_default().to_owned());
    }
    assert!(kinds.iter().any(|k| k == "state_restore_failed"), "{kinds:?}");
    assert_eq!(kinds.iter().filter(|k| *k == "state_restored").count(), 4, "each partition restored once: {kinds:?}");
    running.stop();
    running.wait().await.expect("stop");
}

const BALLOTS: StreamDef<Vote> = StreamDef::ordered("ballots", 1);
const CHANGED: StreamDef<Total> = StreamDef::ordered("changed", 1);
const UNREPORTED: StoreDef<String, ()> = StoreDef::new("unreported");

/// Counts votes and reports, each window, the totals changed since the last report
/// (`tally`'s rule): with every input applied once, a choice's totals only grow, so
/// each `(choice, count)` is reported once. Counts the windows that reported something.
struct Report {
    reports: Rc<RefCell<u64>>,
}

impl Task for Report {
    type Input = Vote;

    async fn process(&mut self, vote: Vote, ctx: &mut TaskContext) -> Result<(), TaskError> {
        ctx.store(&COUNTS)?.update(vote.choice.clone(), |n| Some(n.unwrap_or(0) + 1))?;
        ctx.store(&UNREPORTED)?.put(vote.choice, ())?;
        Ok(())
    }

    async fn window(&mut self, ctx: &mut TaskContext) -> Result<(), TaskError> {
        let changed: Vec<String> = ctx.store(&UNREPORTED)?.entries().into_iter().map(|(c, ())| c).collect();
        if !changed.is_empty() {
            *self.reports.borrow_mut() += 1;
        }
        for choice in changed {
            let count = ctx.store(&COUNTS)?.get(&choice).unwrap_or(0);
            ctx.send(&CHANGED, &choice.clone(), Total { choice: choice.clone(), count }).await?;
            ctx.store(&UNREPORTED)?.delete(&choice);
        }
        Ok(())
    }
}

/// Every message of `js_stream`: (message id, total).
async fn all_totals(b: &SharedBroker, js_stream: &str) -> Vec<(String, Total)> {
    let mut out = Vec::new();
    for d in read_messages(b, js_stream, None, Duration::from_millis(50)).await {
        let id = d.headers.msg_id().unwrap_or_default().to_owned();
        out.push((id, Codec::default().decode(&d.payload).expect("a total")));
    }
    out
}

/// A window's outputs are stored, then the commit of its store changes fails, as a
/// crash between the two would leave it (here: someone else wrote the partition's
/// commit record meanwhile). The partition restarts from its last commit, at the same
/// position, and runs the window again on the same state: its outputs must carry the
/// same ids, so the output stream holds each total once, not twice. Counts every
/// message of the stream, not only the last total per choice.
#[actix_rt::test]
async fn a_window_run_again_at_the_same_position_after_a_restore_reports_each_total_once() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let mut events = b.subscribe("flotilla.w._evt.>", None).await.expect("events");
    let reports: Rc<RefCell<u64>> = Rc::default();
    let r = reports.clone();
    let running = Job::new("w")
        .task(BALLOTS, move |_| Report { reports: r.clone() })
        .store(COUNTS)
        .store(UNREPORTED)
        .window_every(Duration::from_secs(10))
        .on_failure(flotilla_actors::FailurePolicy::RestartTask)
        .output(CHANGED)
        .start(b.clone())
        .await
        .expect("start");
    for (voter, choice) in ["red", "green", "red", "blue", "red", "green"].into_iter().enumerate() {
        let payload = Codec::default().encode(&Vote { voter: voter as u64, choice: choice.into() }).expect("encode");
        let msg = OutboundMessage::new("flotilla.w.ballots.0", payload)
            .with_id(format!("ballot-{voter}"))
            .with_header(headers::KEY, choice);
        b.publish(msg).await.expect("publish");
    }
    // All six applied and committed (acknowledged) before the first window.
    for _ in 0..500 {
        let c = b.consumer_state("FLOTILLA_w_ballots", "ballots-p0").await.expect("consumer");
        if c.ack_floor == 6 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let c = b.consumer_state("FLOTILLA_w_ballots", "ballots-p0").await.expect("consumer");
    assert_eq!(c.ack_floor, 6, "the six votes are committed before the first window: {c:?}");
    assert_eq!(*reports.borrow(), 0, "no window ran yet");
    // Someone else writes the commit record (the same bytes, a new revision): the
    // commit after the window fails, after the window's outputs are stored.
    let bucket = "FLOTILLA_w_STATE";
    let commit = b.kv_get(bucket, "ballots.0._commit").await.expect("kv").expect("a commit record");
    b.kv_put(bucket, "ballots.0._commit", commit.value).await.expect("rewrite the commit record");
    tokio::time::sleep(Duration::from_secs(60)).await;
    let mut restored = 0;
    while let Ok(Some(ev)) =
        tokio::time::timeout(Duration::from_millis(10), futures::StreamExt::next(&mut events)).await
    {
        let v: serde_json::Value = serde_json::from_slice(&ev.payload).expect("json");
        restored += usize::from(v["type"] == "state_restored");
    }
    assert_eq!(restored, 2, "the partition was restored at start and again after the failed commit");
    assert_eq!(*reports.borrow(), 2, "the window reported the same changes before and after the restore");
    let totals = all_totals(&b, "FLOTILLA_w_changed").await;
    let mut seen: BTreeMap<(String, u64), Vec<String>> = BTreeMap::new();
    for (id, t) in &totals {
        seen.entry((t.choice.clone(), t.count)).or_default().push(id.clone());
    }
    let want: BTreeMap<(String, u64), usize> = [(("blue", 1), 1), (("green", 2), 1), (("red", 3), 1)]
        .into_iter()
        .map(|((c, n), k)| ((c.to_owned(), n), k))
        .collect();
    let got: BTreeMap<(String, u64), usize> = seen.iter().map(|(k, ids)| (k.clone(), ids.len())).collect();
    assert_eq!(got, want, "each total once in the output stream; ids: {seen:?}");
    running.stop();
    running.wait().await.expect("stop");
}
