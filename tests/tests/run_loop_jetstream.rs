//! The run loop against a real nats-server: both input kinds, dead letters,
//! heartbeats across two nodes, and a relay process killed mid-batch.

use bytes::Bytes;
use flotilla_actors::{Job, StreamDef, Task, TaskContext, TaskError};
use flotilla_tests::{NatsServer, ProcessGuard, Record, connect, count, example_bin, read_messages, wait_count};
use flotilla_transport::broker::{OutboundMessage, SharedBroker};
use flotilla_transport::wire::{Codec, headers, partition_for};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

thread_local! {
    static CALLS: RefCell<HashMap<u64, u32>> = RefCell::new(HashMap::new());
}

struct Forward {
    out: StreamDef<Record>,
}

impl Task for Forward {
    type Input = Record;
    async fn process(&mut self, r: Record, ctx: &mut TaskContext) -> Result<(), TaskError> {
        CALLS.with(|c| *c.borrow_mut().entry(r.id).or_default() += 1);
        if r.body.starts_with("poison") {
            return Err(TaskError::failed("poison"));
        }
        if let Some(ms) = r.body.strip_prefix("sleep:") {
            tokio::time::sleep(Duration::from_millis(ms.parse().unwrap_or(0))).await;
        }
        if let Some(ms) = r.body.strip_prefix("delay:") {
            return ctx
                .send_after(&self.out, &r.id.to_string(), &r, Duration::from_millis(ms.parse().unwrap_or(0)))
                .await;
        }
        ctx.send(&self.out, &r.id.to_string(), &r).await
    }
}

async fn publish(b: &SharedBroker, subject: String, id: u64, body: &str) {
    let payload = Codec::default().encode(&Record { id, body: body.into() }).expect("encode");
    b.publish(
        OutboundMessage::new(subject, payload).with_id(format!("in-{id}")).with_header(headers::KEY, id.to_string()),
    )
    .await
    .expect("publish");
}

/// Every record in a stream, read through a fresh consumer: (subject, record, headers).
async fn read_all(b: &SharedBroker, stream: &str) -> Vec<(String, Record, flotilla_transport::wire::Headers)> {
    let mut out = Vec::new();
    for d in read_messages(b, stream, None, Duration::from_millis(300)).await {
        let r = Codec::default()
            .decode::<Record>(&d.payload)
            .unwrap_or(Record { id: u64::MAX, body: "undecodable".into() });
        out.push((d.subject.to_string(), r, d.headers));
    }
    out
}

#[actix_rt::test]
async fn ordered_and_queue_inputs_end_to_end_on_jetstream() {
    let server = NatsServer::start();
    let b = connect(&server).await;
    const IN: StreamDef<Record> = StreamDef::ordered("in", 4);
    const OUT: StreamDef<Record> = StreamDef::ordered("out", 4);
    const JOBS: StreamDef<Record> = StreamDef::queue("jobs");
    const DONE: StreamDef<Record> = StreamDef::queue("done");
    let job = Job::new("t")
        .task(IN, |_| Forward { out: OUT })
        .max_attempts(2)
        .output(OUT)
        .task(JOBS, |_| Forward { out: DONE })
        .max_attempts(2)
        .output(DONE)
        .start(b.clone())
        .await
        .expect("start");
    for id in 0..300 {
        let body = if id == 7 { "poison" } else { "ok" };
        publish(&b, format!("flotilla.t.in.{}", partition_for(&id.to_string(), 4)), id, body).await;
        publish(&b, "flotilla.t.jobs".into(), 1000 + id, if id == 8 { "poison" } else { "ok" }).await;
    }
    b.publish(OutboundMessage::new("flotilla.t.jobs", Bytes::from_static(b"\xff\xff\xff")).with_id("garbage"))
        .await
        .expect("garbage");
    wait_count(&b, "FLOTILLA_t_out", 299, Duration::from_secs(30)).await;
    wait_count(&b, "FLOTILLA_t_done", 299, Duration::from_secs(30)).await;
    wait_count(&b, "FLOTILLA_t_DLQ", 3, Duration::from_secs(30)).await;

    let out = read_all(&b, "FLOTILLA_t_out").await;
    assert_eq!(out.len(), 299);
    let mut last: BTreeMap<String, u64> = BTreeMap::new();
    for (subject, r, _) in &out {
        if let Some(prev) = last.insert(subject.clone(), r.id) {
            assert!(prev < r.id, "{subject}: {} after {prev}", r.id);
        }
    }
    let dlq = read_all(&b, "FLOTILLA_t_DLQ").await;
    let mut reasons: Vec<(String, String)> =
        dlq.iter().map(|(s, _, h)| (s.clone(), h.get(headers::DLQ_REASON).unwrap_or_default().to_owned())).collect();
    reasons.sort();
    assert_eq!(
        reasons,
        vec![
            ("flotilla.t._dlq.in".into(), "max-attempts".into()),
            ("flotilla.t._dlq.jobs".into(), "malformed".into()),
            ("flotilla.t._dlq.jobs".into(), "max-attempts".into()),
        ]
    );
    job.stop();
    job.wait().await.expect("clean stop");
    assert_eq!(count(&b, "FLOTILLA_t_jobs").await, 0, "work queue empty: acked or terminated");
    for p in 0..4 {
        let c = b.consumer_state("FLOTILLA_t_in", &format!("in-p{p}")).await.expect("consumer");
        assert_eq!((c.num_pending, c.num_ack_pending), (0, 0), "partition {p} fully committed: {c:?}");
    }
}

#[actix_rt::test]
async fn a_handler_running_three_times_ack_wait_is_delivered_once() {
    let server = NatsServer::start();
    let b = connect(&server).await;
    const JOBS: StreamDef<Record> = StreamDef::queue("jobs");
    const DONE: StreamDef<Record> = StreamDef::queue("done");
    let node = || Job::new("t").task(JOBS, |_| Forward { out: DONE }).ack_wait(Duration::from_secs(1)).output(DONE);
    let a = node().start(b.clone()).await.expect("node a");
    publish(&b, "flotilla.t.jobs".into(), 1, "sleep:3000").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = node().start(b.clone()).await.expect("node b"); // pulls all along
    wait_count(&b, "FLOTILLA_t_done", 1, Duration::from_secs(20)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(CALLS.with(|c| c.borrow().get(&1).copied()), Some(1), "delivered once");
    for job in [a, second] {
        job.stop();
        job.wait().await.expect("stop");
    }
}

fn relay(bin: &std::path::Path, server: &NatsServer, args: &[&str], log: &std::path::Path) -> ProcessGuard {
    let log = std::fs::File::create(log).expect("log file");
    let mut cmd = Command::new(bin);
    cmd.args(["--nats", &server.url()]).args(args).stdout(Stdio::null()).stderr(log).env("FLOTILLA_LOG", "warn");
    ProcessGuard::spawn("relay", &mut cmd)
}

#[actix_rt::test]
async fn relay_killed_mid_batch_and_restarted_loses_nothing() {
    let bin = example_bin("relay");
    let server = NatsServer::start();
    let dir = tempfile::tempdir().expect("tmp");
    let publish = Command::new(&bin)
        .args(["--nats", &server.url(), "publish", "--count", "5000"]) // provisions with the default 30 s ack-wait
        .output()
        .expect("relay publish");
    assert!(publish.status.success(), "publish failed: {}", String::from_utf8_lossy(&publish.stderr));
    let b = connect(&server).await;
    let mut first = relay(&bin, &server, &["--ack-wait", "2s", "--node-id", "a"], &dir.path().join("a.log"));
    let start = Instant::now();
    while count(&b, "FLOTILLA_relay_relay-out").await < 500 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "relay made no progress: {}",
            std::fs::read_to_string(dir.path().join("a.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.signal("KILL");
    assert!(first.wait_timeout(Duration::from_secs(5)).is_some(), "killed");
    let at_kill = count(&b, "FLOTILLA_relay_relay-out").await;
    let mut second = relay(&bin, &server, &["--ack-wait", "2s", "--node-id", "b"], &dir.path().join("b.log"));
    let start = Instant::now();
    while count(&b, "FLOTILLA_relay_relay-out").await < 5000 {
        if start.elapsed() > Duration::from_secs(90) {
            let out = read_all(&b, "FLOTILLA_relay_relay-out").await;
            let ids: BTreeSet<u64> = out.iter().map(|(_, r, _)| r.id).collect();
            let missing: Vec<u64> = (0..5000).filter(|i| !ids.contains(i)).collect();
            let mut states = Vec::new();
            for p in 0..8 {
                states.push(format!(
                    "{:?}",
                    b.consumer_state("FLOTILLA_relay_relay-in", &format!("relay-in-p{p}")).await
                ));
            }
            panic!(
                "relay-out has {} of 5000 (killed at {at_kill}); missing {missing:?} (partitions {:?}); DLQ {}; consumers {states:#?}; log a: {}; log b: {}",
                out.len(),
                missing.iter().map(|i| partition_for(&i.to_string(), 8)).collect::<Vec<_>>(),
                count(&b, "FLOTILLA_relay_DLQ").await,
                std::fs::read_to_string(dir.path().join("a.log")).unwrap_or_default(),
                std::fs::read_to_string(dir.path().join("b.log")).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    second.signal("TERM");
    let status = second.wait_timeout(Duration::from_secs(30)).expect("graceful exit");
    assert!(
        status.success(),
        "exit status {status}: {}",
        std::fs::read_to_string(dir.path().join("b.log")).unwrap_or_default()
    );
    let out = read_all(&b, "FLOTILLA_relay_relay-out").await;
    let ids: BTreeSet<u64> = out.iter().map(|(_, r, _)| r.id).collect();
    assert_eq!(ids, (0..5000).collect::<BTreeSet<u64>>(), "every record is in relay-out (killed after {at_kill})");
    assert_eq!(out.len(), 5000, "redelivered inputs produced the same output ids, so no duplicates were stored");
}

#[actix_rt::test]
async fn nats_server_killed_and_restarted_under_load_loses_nothing() {
    let mut server = NatsServer::start();
    let b = connect(&server).await;
    const IN: StreamDef<Record> = StreamDef::ordered("in", 4);
    const OUT: StreamDef<Record> = StreamDef::ordered("out", 4);
    let job = Job::new("t")
        .task(IN, |_| Forward { out: OUT })
        .ack_wait(Duration::from_secs(5))
        .output(OUT)
        .start(b.clone())
        .await
        .expect("start");
    for id in 0..1000 {
        publish(&b, format!("flotilla.t.in.{}", partition_for(&id.to_string(), 4)), id, "ok").await;
    }
    wait_count(&b, "FLOTILLA_t_out", 100, Duration::from_secs(30)).await;
    server.kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.restart();
    // Publish more once the client has reconnected.
    let start = Instant::now();
    let mut id = 1000;
    while id < 1500 {
        let payload = Codec::default().encode(&Record { id, body: "ok".into() }).expect("encode");
        let msg = OutboundMessage::new(format!("flotilla.t.in.{}", partition_for(&id.to_string(), 4)), payload)
            .with_id(format!("in-{id}"))
            .with_header(headers::KEY, id.to_string());
        match b.publish(msg).await {
            Ok(_) => id += 1,
            Err(e) => {
                assert!(start.elapsed() < Duration::from_secs(30), "no reconnect after 30 s: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    wait_count(&b, "FLOTILLA_t_out", 1500, Duration::from_secs(60)).await;
    let out = read_all(&b, "FLOTILLA_t_out").await;
    let ids: BTreeSet<u64> = out.iter().map(|(_, r, _)| r.id).collect();
    assert_eq!(ids, (0..1500).collect::<BTreeSet<u64>>(), "every record made it through the restart");
    job.stop();
    job.wait().await.expect("clean stop");
}

#[actix_rt::test]
async fn a_delayed_output_survives_the_node_that_sent_it() {
    let server = NatsServer::start();
    let b = connect(&server).await;
    const IN: StreamDef<Record> = StreamDef::ordered("in", 2);
    const OUT: StreamDef<Record> = StreamDef::ordered("out", 2);
    let node = || Job::new("t").task(IN, |_| Forward { out: OUT }).output(OUT);
    let job = node().start(b.clone()).await.expect("start");
    let sent = Instant::now();
    publish(&b, format!("flotilla.t.in.{}", partition_for("1", 2)), 1, "delay:3000").await;
    wait_count(&b, "FLOTILLA_t_TIMERS", 1, Duration::from_secs(10)).await;
    job.stop();
    job.wait().await.expect("stop");
    assert_eq!(count(&b, "FLOTILLA_t_out").await, 0, "not due while the node is gone");
    let job = node().start(b.clone()).await.expect("restart");
    wait_count(&b, "FLOTILLA_t_out", 1, Duration::from_secs(20)).await;
    let took = sent.elapsed();
    assert!(took >= Duration::from_millis(2900), "arrived early: {took:?}");
    assert_eq!(count(&b, "FLOTILLA_t_TIMERS").await, 0);
    job.stop();
    job.wait().await.expect("stop");
}

/// Sets a durable timer on `arm:<secs>`; the `timer` hook forwards `fired <name>`.
struct Alarm {
    out: StreamDef<Record>,
}

impl Task for Alarm {
    type Input = Record;
    async fn process(&mut self, r: Record, ctx: &mut TaskContext) -> Result<(), TaskError> {
        let secs: u64 = r.body.strip_prefix("arm:").and_then(|s| s.parse().ok()).unwrap_or(0);
        ctx.schedule_durable(&format!("alarm-{}", r.id), Duration::from_secs(secs))
    }
    async fn timer(&mut self, name: String, ctx: &mut TaskContext) -> Result<(), TaskError> {
        ctx.send(&self.out, &name, Record { id: 0, body: format!("fired {name}") }).await
    }
}

/// A durable timer outlives both the node that set it and a restart of nats-server,
/// and fires once, on the partition's next owner.
#[actix_rt::test]
async fn a_durable_timer_survives_its_node_and_a_nats_server_restart() {
    let mut server = NatsServer::start();
    let b = connect(&server).await;
    const IN: StreamDef<Record> = StreamDef::ordered("in", 2);
    const OUT: StreamDef<Record> = StreamDef::ordered("out", 2);
    let node = |b: &SharedBroker| Job::new("t").task(IN, |_| Alarm { out: OUT }).output(OUT).start(b.clone());
    let job = node(&b).await.expect("start");
    let armed = Instant::now();
    publish(&b, format!("flotilla.t.in.{}", partition_for("7", 2)), 7, "arm:4").await;
    wait_count(&b, "FLOTILLA_t_TIMERS", 1, Duration::from_secs(10)).await;
    job.stop();
    job.wait().await.expect("stop");
    server.restart();
    let b = connect(&server).await;
    assert_eq!(count(&b, "FLOTILLA_t_TIMERS").await, 1, "the timer is stored, not in a node");
    let job = node(&b).await.expect("restart");
    wait_count(&b, "FLOTILLA_t_out", 1, Duration::from_secs(30)).await;
    assert!(armed.elapsed() >= Duration::from_millis(3900), "fired early: {:?}", armed.elapsed());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let out = read_all(&b, "FLOTILLA_t_out").await;
    assert_eq!(out.len(), 1, "fired once: {out:?}");
    assert_eq!(out[0].1.body, "fired alarm-7");
    job.stop();
    job.wait().await.expect("stop");
}

/// An operator's max age on the job's STATE bucket would expire changelog records that
/// a restore needs (their keys would resolve to older values: state rolled back without
/// a word): a job with a store refuses to start on it, naming the bucket, the setting
/// and the command that removes it, and starts once it is removed.
#[actix_rt::test]
async fn a_state_bucket_whose_records_expire_is_refused_naming_the_fix() {
    let server = NatsServer::start();
    let b = connect(&server).await;
    const IN: StreamDef<Record> = StreamDef::ordered("in", 2);
    const OUT: StreamDef<Record> = StreamDef::ordered("out", 2);
    const COUNTS: flotilla_actors::StoreDef<String, u64> = flotilla_actors::StoreDef::new("counts");
    let hour = Duration::from_secs(3600);
    b.ensure_kv(flotilla_transport::broker::KvSpec::new("FLOTILLA_t_STATE", Some(hour))).await.expect("aged bucket");
    let job = || Job::new("t").task(IN, |_| Forward { out: OUT }).store(COUNTS).output(OUT);
    let err = job().start(b.clone()).await.expect_err("a STATE bucket with a max age is refused");
    let text = err.to_string();
    for part in ["FLOTILLA_t_STATE", "max_age", "nats stream edit KV_FLOTILLA_t_STATE --max-age=0"] {
        assert!(text.contains(part), "the refusal names {part:?}: {text}");
    }
    // Nothing was changed: the operator's setting is still there.
    let js = async_nats::jetstream::new(async_nats::connect(server.url()).await.expect("connect"));
    let mut stream = js.get_stream("KV_FLOTILLA_t_STATE").await.expect("bucket stream");
    let mut config = stream.info().await.expect("info").config.clone();
    assert_eq!(config.max_age, hour, "the refusal changed nothing");
    // With the limit removed (what the message says to do), the job starts.
    config.max_age = Duration::ZERO;
    js.update_stream(config).await.expect("remove the max age");
    let running = job().start(b.clone()).await.expect("starts on a bucket that keeps every record");
    running.stop();
    running.wait().await.expect("stop");
}
