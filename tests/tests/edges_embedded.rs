//! Holes at the edges of exactly-once, on the embedded broker on tokio's paused clock: a
//! parked key's message that cannot be set aside, an end of stream that cannot be
//! recorded, a message parked after `unpark` finished, and a long suspect message on a
//! node that dies of something else.

use flotilla_actors::cluster::ClusterConfig;
use flotilla_actors::{Job, RunningJob, StreamDef, Task, TaskContext, TaskError};
use flotilla_node::ControlClient;
use flotilla_node::cluster::JoinCluster;
use flotilla_tests::{Record, count, read_messages};
use flotilla_transport::EmbeddedBroker;
use flotilla_transport::broker::{CoreMessage, OutboundMessage, SharedBroker};
use flotilla_transport::wire::{Codec, headers};
use futures::StreamExt;
use std::time::Duration;

const IN: StreamDef<Record> = StreamDef::ordered("in", 4);
const OUT: StreamDef<Record> = StreamDef::ordered("out", 4);
const JOBS: StreamDef<Record> = StreamDef::queue("jobs");
const DONE: StreamDef<Record> = StreamDef::queue("done");

/// Forwards a record with the attempt it ran on as its body.
struct Forward;

impl Task for Forward {
    type Input = Record;

    async fn process(&mut self, r: Record, ctx: &mut TaskContext) -> Result<(), TaskError> {
        let attempt = ctx.message().map_or(0, |m| m.attempt);
        ctx.send(&DONE, &r.id.to_string(), Record { id: r.id, body: format!("attempt {attempt}") }).await
    }
}

/// Forwards a record of an ordered input; one with a body `sleep:<ms>` takes that long.
struct Relay;

impl Task for Relay {
    type Input = Record;

    async fn process(&mut self, r: Record, ctx: &mut TaskContext) -> Result<(), TaskError> {
        if let Some(ms) = r.body.strip_prefix("sleep:") {
            let ms: u64 = ms.parse().map_err(|_| TaskError::failed("bad sleep"))?;
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        ctx.send(&OUT, &r.id.to_string(), &r).await
    }
}

async fn publish_job(b: &SharedBroker, id: u64, key: &str) {
    let payload = Codec::default().encode(&Record { id, body: "job".into() }).expect("encode");
    let msg =
        OutboundMessage::new("flotilla.t.jobs", payload).with_id(format!("jobs-{id}")).with_header(headers::KEY, key);
    b.publish(msg).await.expect("publish");
}

/// Waits (on paused time) until `js_stream` holds `n` messages.
async fn wait_for(b: &SharedBroker, js_stream: &str, n: u64, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    while count(b, js_stream).await < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "LIVENESS: {js_stream} has {} messages after {within:?}, expected {n}",
            count(b, js_stream).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every message of a stream (payload decoded) through a fresh consumer.
async fn read_all(b: &SharedBroker, js_stream: &str) -> Vec<(Record, flotilla_transport::wire::Headers)> {
    let mut out = Vec::new();
    for d in read_messages(b, js_stream, None, Duration::from_millis(50)).await {
        let r = Codec::default().decode::<Record>(&d.payload).expect("a record");
        out.push((r, d.headers.clone()));
    }
    out
}

/// A receiver of the job's runtime events from now on.
async fn collect_events(b: &SharedBroker) -> tokio::sync::mpsc::UnboundedReceiver<CoreMessage> {
    let mut sub = b.subscribe("flotilla.t._evt.>", None).await.expect("subscribe to events");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    actix::spawn(async move {
        while let Some(m) = sub.next().await {
            if tx.send(m).is_err() {
                break;
            }
        }
    });
    rx
}

/// The events received so far.
fn drain_events(rx: &mut tokio::sync::mpsc::UnboundedReceiver<CoreMessage>) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    while let Ok(m) = rx.try_recv() {
        out.push(serde_json::from_slice(&m.payload).expect("an event is JSON"));
    }
    out
}

async fn queue_node(b: &SharedBroker, id: &str) -> RunningJob {
    Job::new("t")
        .task(JOBS, |_| Forward)
        .output(DONE)
        .start_node(b.clone(), id, ClusterConfig::default())
        .await
        .expect("node")
}

/// A parked key's message that cannot be set aside (the PARKED stream refuses writes) is
/// handed back with a growing delay, not at once: before, it came back at once, was
/// refused again, and spent the consumer's max deliveries (attempts + 1 + 20 hand-backs)
/// in about a second, after which the server stopped delivering it and the reaper
/// dead-lettered it as `max-deliveries`. A minute of refused writes now costs a handful
/// of deliveries and no attempt: once PARKED takes writes it is set aside, and after
/// `unpark` it runs on its first attempt.
#[actix_rt::test]
async fn a_message_that_cannot_be_parked_comes_back_with_backoff_and_costs_no_attempt() {
    tokio::time::pause();
    let embedded = EmbeddedBroker::new();
    let b = embedded.shared();
    let node = queue_node(&b, "a").await;
    let control = ControlClient::new(b.clone(), "t").await.expect("control");
    control.park("jobs", "k1", true).await.expect("park");
    tokio::time::sleep(Duration::from_secs(3)).await; // the node's scans see it
    embedded.refuse_writes(Some("flotilla.t._parked.>"));
    publish_job(&b, 1, "k1").await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    let consumer = b.consumer_state("FLOTILLA_t_jobs", "jobs-workers").await.expect("consumer");
    let deliveries = consumer.delivered_consumer_seq;
    let dead: Vec<String> = read_all(&b, "FLOTILLA_t_DLQ")
        .await
        .iter()
        .map(|(_, h)| format!("{:?}: {:?}", h.get(headers::DLQ_REASON), h.get(headers::DLQ_DETAIL)))
        .collect();
    assert!(
        dead.is_empty(),
        "SAFETY: a parked key's message was dead-lettered after {deliveries} deliveries in a minute of failed parks: {dead:?}"
    );
    assert!(
        (2..=12).contains(&deliveries),
        "SAFETY: a minute of failed parks delivered the message {deliveries} times (max deliver {:?}): it must back off",
        consumer.spec.max_deliver
    );
    embedded.refuse_writes(None);
    wait_for(&b, "FLOTILLA_t_PARKED", 1, Duration::from_secs(120)).await;
    assert_eq!(count(&b, "FLOTILLA_t_done").await, 0, "SAFETY: a parked key's message ran");
    control.park("jobs", "k1", false).await.expect("unpark");
    wait_for(&b, "FLOTILLA_t_done", 1, Duration::from_secs(30)).await;
    let done = read_all(&b, "FLOTILLA_t_done").await;
    assert_eq!(done.len(), 1, "SAFETY: the message ran once");
    assert_eq!(done[0].0.body, "attempt 1", "SAFETY: the failed parks cost attempts");
    eprintln!("a minute of refused parks: {deliveries} deliveries");
    node.stop();
    node.wait().await.expect("clean stop");
}

async fn ordered_node(b: &SharedBroker, id: &str) -> RunningJob {
    Job::new("t")
        .task(IN, |_| Relay)
        .output(OUT)
        .start_node(b.clone(), id, ClusterConfig::default())
        .await
        .expect("node")
}

/// Who holds each partition of `in` (`-` for nobody).
async fn lease_holders(b: &SharedBroker) -> Vec<String> {
    let mut out = Vec::new();
    for p in 0..4 {
        let entry = b.kv_get("FLOTILLA_t_LEASES", &format!("in.{p}")).await.expect("read lease");
        let node = entry
            .and_then(|e| serde_json::from_slice::<serde_json::Value>(&e.value).ok())
            .and_then(|v| v.get("node").and_then(|n| n.as_str()).map(str::to_owned));
        out.push(node.unwrap_or_else(|| "-".into()));
    }
    out
}

async fn publish_to_partition(b: &SharedBroker, p: u32, id: u64) {
    publish_body(b, p, id, "ok").await;
}

async fn publish_body(b: &SharedBroker, p: u32, id: u64, body: &str) {
    let payload = Codec::default().encode(&Record { id, body: body.into() }).expect("encode");
    let msg = OutboundMessage::new(format!("flotilla.t.in.{p}"), payload)
        .with_id(format!("in-{id}"))
        .with_header(headers::KEY, id.to_string());
    b.publish(msg).await.expect("publish");
}

/// An end of stream whose `ended` record cannot be written (CONTROL refuses writes for
/// 90 s) keeps its partition's lease, with no worker running for it, until the record
/// is stored; then the run completes on both nodes. Before, the lease went after a
/// minute of retries: the other node took the partition up past its marker, ran what
/// followed it in the ended run, and the run never completed.
#[actix_rt::test]
async fn an_end_that_cannot_be_recorded_keeps_its_lease_until_it_is_and_the_run_completes() {
    tokio::time::pause();
    let embedded = EmbeddedBroker::new();
    let b = embedded.shared();
    let (a, c) = (ordered_node(&b, "a").await, ordered_node(&b, "c").await);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let holders = loop {
        let holders = lease_holders(&b).await;
        if ["a", "c"].iter().all(|n| holders.iter().filter(|h| h == n).count() == 2) {
            break holders;
        }
        assert!(tokio::time::Instant::now() < deadline, "LIVENESS: partitions not balanced: {holders:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut events = collect_events(&b).await;
    embedded.refuse_writes(Some("$KV.FLOTILLA_t_CONTROL.>"));
    for p in 0..4u32 {
        publish_to_partition(&b, p, u64::from(p)).await;
        let marker = OutboundMessage::new(format!("flotilla.t.in.{p}"), bytes::Bytes::new())
            .with_id(format!("eos-{p}"))
            .with_header(headers::KIND, "end-of-stream");
        b.publish(marker).await.expect("marker");
        // After the marker: not for this run.
        publish_to_partition(&b, p, 100 + u64::from(p)).await;
    }
    tokio::time::sleep(Duration::from_secs(90)).await;
    let during = lease_holders(&b).await;
    let out: Vec<u64> = read_all(&b, "FLOTILLA_t_out").await.iter().map(|(r, _)| r.id).collect();
    assert_eq!(
        during, holders,
        "SAFETY: an ended partition's lease went before its end was recorded (outputs {out:?})"
    );
    assert_eq!(out.len(), 4, "SAFETY: records after the end-of-stream markers ran in the ended run: {out:?}");
    let unrecorded: Vec<serde_json::Value> =
        drain_events(&mut events).into_iter().filter(|e| e["type"] == "done_not_recorded").collect();
    for p in 0..4 {
        let of_p = unrecorded.iter().filter(|e| e["partition"] == p && e["done"] == "ended").count();
        assert!(of_p >= 3, "each failed try is an event: partition {p} has {of_p} in 90 s: {unrecorded:?}");
    }
    embedded.refuse_writes(None);
    let ended = tokio::time::timeout(Duration::from_secs(120), async {
        a.wait().await.expect("a ends cleanly");
        c.wait().await.expect("c ends cleanly");
    })
    .await;
    assert!(ended.is_ok(), "LIVENESS: the run did not complete once the ended records could be written");
    let out: Vec<u64> = read_all(&b, "FLOTILLA_t_out").await.iter().map(|(r, _)| r.id).collect();
    assert_eq!(out.len(), 4, "SAFETY: records after the markers ran: {out:?}");
}

/// A node asked to stop while an ended partition's record cannot be written still stops
/// within its bound (drain timeout + about 9 s) and lets the lease go: the stop wins.
#[actix_rt::test]
async fn a_stop_ends_a_node_whose_end_is_not_recorded_yet() {
    tokio::time::pause();
    let embedded = EmbeddedBroker::new();
    let b = embedded.shared();
    let a = ordered_node(&b, "a").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while lease_holders(&b).await != ["a", "a", "a", "a"] {
        assert!(tokio::time::Instant::now() < deadline, "LIVENESS: a took not every partition");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    embedded.refuse_writes(Some("$KV.FLOTILLA_t_CONTROL.>"));
    for p in 0..4u32 {
        let marker = OutboundMessage::new(format!("flotilla.t.in.{p}"), bytes::Bytes::new())
            .with_id(format!("eos-{p}"))
            .with_header(headers::KIND, "end-of-stream");
        b.publish(marker).await.expect("marker");
    }
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(lease_holders(&b).await, ["a", "a", "a", "a"], "SAFETY: leases went before the ends were recorded");
    let bound = a.stop_deadline();
    a.stop();
    let stopped = tokio::time::timeout(bound, a.wait()).await;
    assert!(stopped.is_ok(), "LIVENESS: the node did not stop within {bound:?}");
    assert_eq!(lease_holders(&b).await, ["-", "-", "-", "-"], "the stop let the leases go");
}

/// A message parked after `unpark` finished its sweeps (here: by a node whose view of the
/// parked keys is stale, its scans failing) goes back to the queue by itself, with an
/// event. Before, it stayed in PARKED with no event: nothing would ever run it unless
/// someone looked at `status` and ran `unpark` again.
#[actix_rt::test]
async fn a_message_parked_after_unpark_is_sent_back_with_an_event() {
    tokio::time::pause();
    let embedded = EmbeddedBroker::new();
    let b = embedded.shared();
    let node = queue_node(&b, "a").await;
    let control = ControlClient::new(b.clone(), "t").await.expect("control");
    control.park("jobs", "k1", true).await.expect("park");
    tokio::time::sleep(Duration::from_secs(3)).await; // the node's scans see it
    let mut events = collect_events(&b).await;
    // The node's scans fail from here on: it goes on seeing k1 parked.
    embedded.refuse_reads(Some("$KV.FLOTILLA_t_CONTROL.stop.a"));
    assert_eq!(control.park("jobs", "k1", false).await.expect("unpark"), 0, "nothing was parked yet");
    publish_job(&b, 1, "k1").await;
    tokio::time::sleep(Duration::from_secs(20)).await;
    let parked = count(&b, "FLOTILLA_t_PARKED").await;
    let done = read_all(&b, "FLOTILLA_t_done").await;
    let events = drain_events(&mut events);
    assert_eq!(
        (parked, done.len()),
        (0, 1),
        "SAFETY: a message of an unparked key stays set aside (parked, done); events {events:?}"
    );
    assert_eq!(done[0].0.body, "attempt 1", "SAFETY: being parked cost an attempt");
    let sent_back: Vec<&serde_json::Value> = events.iter().filter(|e| e["type"] == "parked_after_unpark").collect();
    assert!(
        sent_back.len() == 1 && sent_back[0]["key"] == "k1" && sent_back[0]["sent_back"] == 1,
        "an event says what was sent back: {events:?}"
    );
    embedded.refuse_reads(None);
    node.stop();
    node.wait().await.expect("clean stop");
}

/// A long, healthy message that its owners keep losing for other reasons is not a crash
/// loop. A node holds partition 0 while a message that takes two minutes runs there, and
/// loses the partition 20 s into it, three times (its lease cannot be renewed: to the
/// cluster that is a node that died). The partition resumes each time with the message
/// unfinished, so it is a suspect, counted while it runs. Before, it was counted for as
/// long as it ran and was dead-lettered as `crash-loop` after the crash limit (2), a
/// healthy message thrown out; now a suspect that ran 10 s without ending its owner is
/// no longer to blame for what ends it, and the message completes.
#[actix_rt::test]
async fn a_long_suspect_is_not_blamed_for_owners_that_end_of_something_else() {
    tokio::time::pause();
    let embedded = EmbeddedBroker::new();
    let b = embedded.shared();
    let node = Job::new("t")
        .task(IN, |_| Relay)
        .output(OUT)
        .crash_limit(2)
        .start_node(b.clone(), "a", ClusterConfig::default())
        .await
        .expect("node");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while lease_holders(&b).await != ["a", "a", "a", "a"] {
        assert!(tokio::time::Instant::now() < deadline, "LIVENESS: a took not every partition");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    publish_body(&b, 0, 1, "sleep:120000").await;
    let mut epochs = Vec::new();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_secs(20)).await;
        // The node loses the partition (its renewals fail), then takes it again.
        embedded.refuse_writes(Some("$KV.FLOTILLA_t_LEASES.in.0"));
        tokio::time::sleep(Duration::from_secs(9)).await;
        embedded.refuse_writes(None);
        tokio::time::sleep(Duration::from_secs(3)).await;
        let lease = b.kv_get("FLOTILLA_t_LEASES", "in.0").await.expect("lease").map(|e| e.revision);
        epochs.push(lease);
    }
    let dead: Vec<String> = read_all(&b, "FLOTILLA_t_DLQ")
        .await
        .iter()
        .map(|(r, h)| format!("{}: {:?} {:?}", r.id, h.get(headers::DLQ_REASON), h.get(headers::DLQ_DETAIL)))
        .collect();
    assert!(dead.is_empty(), "SAFETY: a healthy message was dead-lettered for its owners' ends: {dead:?}");
    assert!(
        epochs.windows(2).all(|w| w[0].is_some() && w[0] < w[1]),
        "each round moved the partition to a new lease: {epochs:?}"
    );
    wait_for(&b, "FLOTILLA_t_out", 1, Duration::from_secs(180)).await;
    let out: Vec<u64> = read_all(&b, "FLOTILLA_t_out").await.iter().map(|(r, _)| r.id).collect();
    assert_eq!(out, [1], "SAFETY: the long message completed once");
    node.stop();
    node.wait().await.expect("clean stop");
}

/// What its owner sees a suspect do still counts after the window: a message whose
/// callback hangs past a `callback_timeout` longer than the window (30 s) fails its task
/// every time, and is dead-lettered as `crash-loop` after the crash limit (2 counted
/// ends; the first, before it is suspect, is not counted) rather than restarting the
/// partition forever.
#[actix_rt::test]
async fn a_suspect_that_hangs_past_its_window_is_still_a_crash_loop() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let job = Job::new("t")
        .task(IN, |_| Relay)
        .output(OUT)
        .on_failure(flotilla_actors::FailurePolicy::RestartTask)
        .callback_timeout(Duration::from_secs(30))
        .crash_limit(2)
        .start(b.clone())
        .await
        .expect("start");
    publish_body(&b, 0, 1, "sleep:100000000").await;
    publish_body(&b, 0, 2, "ok").await;
    wait_for(&b, "FLOTILLA_t_DLQ", 1, Duration::from_secs(600)).await;
    wait_for(&b, "FLOTILLA_t_out", 1, Duration::from_secs(60)).await;
    let dead = read_all(&b, "FLOTILLA_t_DLQ").await;
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].0.id, dead[0].1.get(headers::DLQ_REASON)), (1, Some("crash-loop")), "{:?}", dead[0].1);
    let out: Vec<u64> = read_all(&b, "FLOTILLA_t_out").await.iter().map(|(r, _)| r.id).collect();
    assert_eq!(out, [2], "the partition went on");
    job.stop();
    job.wait().await.expect("clean stop");
}
