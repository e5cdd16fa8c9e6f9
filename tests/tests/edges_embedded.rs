//! Holes at the edges of exactly-once, on the embedded broker on tokio's paused clock: a
//! parked key's message that cannot be set aside, an end of stream that cannot be
//! recorded, a message parked after `unpark` finished, and a long suspect message on a
//! node that dies of something else.

use flotilla_actors::cluster::ClusterConfig;
use flotilla_actors::{Job, RunningJob, StreamDef, Task, TaskContext, TaskError};
use flotilla_node::ControlClient;
use flotilla_transport::EmbeddedBroker;
use flotilla_transport::broker::{AckPolicy, ConsumerSpec, OutboundMessage, SharedBroker};
use flotilla_transport::wire::{Codec, headers};
use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Record {
    id: u64,
    body: String,
}

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

async fn publish_job(b: &SharedBroker, id: u64, key: &str) {
    let payload = Codec::default().encode(&Record { id, body: "job".into() }).expect("encode");
    let msg =
        OutboundMessage::new("flotilla.t.jobs", payload).with_id(format!("jobs-{id}")).with_header(headers::KEY, key);
    b.publish(msg).await.expect("publish");
}

async fn messages(b: &SharedBroker, js_stream: &str) -> u64 {
    b.stream_state(js_stream).await.map(|s| s.messages).unwrap_or(0)
}

/// Waits (on paused time) until `js_stream` holds `n` messages.
async fn wait_for(b: &SharedBroker, js_stream: &str, n: u64, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    while messages(b, js_stream).await < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "LIVENESS: {js_stream} has {} messages after {within:?}, expected {n}",
            messages(b, js_stream).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every message of a stream (payload decoded) through a fresh consumer.
async fn read_all(b: &SharedBroker, js_stream: &str) -> Vec<(Record, flotilla_transport::wire::Headers)> {
    let name = format!("reader-{}", flotilla_transport::wire::MessageId::new_v7().as_str().replace('-', ""));
    let spec =
        ConsumerSpec { ack_policy: AckPolicy::Explicit, max_ack_pending: None, ..ConsumerSpec::new(name.clone()) };
    b.ensure_consumer(js_stream, spec).await.expect("reader");
    let mut out = Vec::new();
    loop {
        let got = b.claim(js_stream, &name, 1000, Duration::from_millis(50)).await.expect("claim");
        if got.is_empty() {
            break;
        }
        for d in got {
            let r = Codec::default().decode::<Record>(&d.payload).expect("a record");
            out.push((r, d.headers.clone()));
        }
    }
    b.delete_consumer(js_stream, &name).await.expect("delete reader");
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
    assert_eq!(messages(&b, "FLOTILLA_t_done").await, 0, "SAFETY: a parked key's message ran");
    control.park("jobs", "k1", false).await.expect("unpark");
    wait_for(&b, "FLOTILLA_t_done", 1, Duration::from_secs(30)).await;
    let done = read_all(&b, "FLOTILLA_t_done").await;
    assert_eq!(done.len(), 1, "SAFETY: the message ran once");
    assert_eq!(done[0].0.body, "attempt 1", "SAFETY: the failed parks cost attempts");
    eprintln!("a minute of refused parks: {deliveries} deliveries");
    node.stop();
    node.wait().await.expect("clean stop");
}
