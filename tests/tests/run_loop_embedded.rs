//! The run loop end to end on the embedded broker, on tokio's paused clock: ordered and
//! queue inputs, effect before ack, retries, dead letters, heartbeats, windows, and
//! jobs refused at start.

use bytes::Bytes;
use flotilla_actors::{FailurePolicy, Job, JobError, StreamDef, Task, TaskContext, TaskError};
use flotilla_node::cluster::JoinCluster;
use flotilla_tests::{Record, read_messages};
use flotilla_transport::EmbeddedBroker;
use flotilla_transport::broker::{OutboundMessage, SharedBroker};
use flotilla_transport::wire::{Codec, headers, partition_for};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::time::Duration;

const IN: StreamDef<Record> = StreamDef::ordered("in", 4);
const OUT: StreamDef<Record> = StreamDef::ordered("out", 4);
const JOBS: StreamDef<Record> = StreamDef::queue("jobs");
const DONE: StreamDef<Record> = StreamDef::queue("done");

thread_local! {
    /// How often `process` ran per record id (each test runs on its own thread).
    static CALLS: RefCell<HashMap<u64, u32>> = RefCell::new(HashMap::new());
}

fn calls(id: u64) -> u32 {
    CALLS.with(|c| c.borrow().get(&id).copied().unwrap_or(0))
}

/// Forwards records; `poison…` fails every attempt, `flaky:<n>` fails the first n
/// attempts, `panic` panics, `sleep:<ms>` waits, `fatal` fails the task, `badkey` sends
/// with a key NATS headers cannot carry.
struct Relay<const QUEUE: bool>;

impl<const QUEUE: bool> Task for Relay<QUEUE> {
    type Input = Record;

    async fn process(&mut self, r: Record, ctx: &mut TaskContext) -> Result<(), TaskError> {
        let attempt = ctx.message().map_or(1, |m| m.attempt);
        CALLS.with(|c| *c.borrow_mut().entry(r.id).or_default() += 1);
        if r.body.starts_with("poison") {
            return Err(TaskError::failed(format!("poison record {}", r.id)));
        }
        if let Some(n) = r.body.strip_prefix("flaky:") {
            let n: u32 = n.parse().map_err(|_| TaskError::failed("bad flaky count"))?;
            if attempt <= n {
                return Err(TaskError::failed(format!("flaky attempt {attempt}")));
            }
        }
        if r.body == "panic" {
            panic!("handler panic on record {}", r.id);
        }
        if r.body == "fatal" {
            return Err(TaskError::fatal("cannot continue"));
        }
        if let Some(ms) = r.body.strip_prefix("sleep:") {
            let ms: u64 = ms.parse().map_err(|_| TaskError::failed("bad sleep"))?;
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        if r.body == "unavailable" {
            return Err(TaskError::unavailable("the database is down"));
        }
        if let Some(n) = r.body.strip_prefix("big:") {
            let n: usize = n.parse().map_err(|_| TaskError::failed("bad size"))?;
            let big = Record { id: r.id, body: "x".repeat(n) };
            return if QUEUE {
                ctx.send(&DONE, &r.id.to_string(), &big).await
            } else {
                ctx.send(&OUT, &r.id.to_string(), &big).await
            };
        }
        let key = if r.body == "badkey" { format!("{}\nInjected: yes", r.id) } else { r.id.to_string() };
        if QUEUE { ctx.send(&DONE, &key, &r).await } else { ctx.send(&OUT, &key, &r).await }
    }
}

fn codec() -> Codec {
    Codec::default()
}

async fn publish(b: &SharedBroker, stream: &str, ordered: bool, id: u64, body: &str) {
    let key = id.to_string();
    let subject = if ordered {
        format!("flotilla.t.{stream}.{}", partition_for(&key, 4))
    } else {
        format!("flotilla.t.{stream}")
    };
    let payload = codec().encode(&Record { id, body: body.into() }).expect("encode");
    let msg = OutboundMessage::new(subject, payload).with_id(format!("{stream}-{id}")).with_header(headers::KEY, key);
    b.publish(msg).await.expect("publish");
}

/// Reads every message of a stream through a fresh consumer.
async fn read_all(
    b: &SharedBroker,
    js_stream: &str,
    filter: Option<String>,
) -> Vec<(String, Record, flotilla_transport::wire::Headers)> {
    let mut out = Vec::new();
    for d in read_messages(b, js_stream, filter, Duration::from_millis(50)).await {
        let rec = codec().decode::<Record>(&d.payload).unwrap_or(Record { id: u64::MAX, body: "undecodable".into() });
        out.push((d.subject.to_string(), rec, d.headers.clone()));
    }
    out
}

async fn wait_for(b: &SharedBroker, js_stream: &str, n: u64) {
    for _ in 0..2000 {
        if b.stream_state(js_stream).await.map(|s| s.messages).unwrap_or(0) >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let have = b.stream_state(js_stream).await.map(|s| s.messages).unwrap_or(0);
    panic!("{js_stream} has {have} messages, expected {n}");
}

#[actix_rt::test]
async fn ordered_input_end_to_end_with_order_poison_and_undecodable() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let job = Job::new("t").task(IN, |_| Relay::<false>).max_attempts(3).start(b.clone()).await.expect("start");
    for id in 0..200 {
        let body = if id == 17 { "poison" } else { "ok" };
        publish(&b, "in", true, id, body).await;
    }
    // Undecodable bytes in partition of key "500": dead-lettered on first delivery.
    let p = partition_for("500", 4);
    b.publish(
        OutboundMessage::new(format!("flotilla.t.in.{p}"), Bytes::from_static(&[0xff, 0x01]))
            .with_id("garbage")
            .with_header(headers::KEY, "500"),
    )
    .await
    .expect("publish garbage");
    for id in 200..210 {
        publish(&b, "in", true, id, "after garbage").await;
    }
    wait_for(&b, "FLOTILLA_t_out", 209).await;
    wait_for(&b, "FLOTILLA_t_DLQ", 2).await;

    let out = read_all(&b, "FLOTILLA_t_out", None).await;
    assert_eq!(out.len(), 209, "every record but the poison one");
    let mut last: BTreeMap<String, u64> = BTreeMap::new();
    for (subject, rec, h) in &out {
        assert_eq!(subject, &format!("flotilla.t.out.{}", partition_for(&rec.id.to_string(), 4)));
        if let Some(prev) = last.insert(subject.clone(), rec.id) {
            assert!(prev < rec.id, "partition {subject}: {} after {prev}", rec.id);
        }
        assert_eq!(h.get(headers::CAUSE), Some(format!("in-{}", rec.id).as_str()));
        assert_eq!(h.get(headers::TYPE), Some("Record"));
        assert_eq!(h.get(headers::EPOCH), Some("0"));
    }
    let dlq = read_all(&b, "FLOTILLA_t_DLQ", None).await;
    let mut reasons: Vec<(String, String)> =
        dlq.iter().map(|(s, _, h)| (s.clone(), h.get(headers::DLQ_REASON).unwrap_or("").to_owned())).collect();
    reasons.sort();
    assert_eq!(
        reasons,
        vec![("flotilla.t._dlq.in".into(), "malformed".into()), ("flotilla.t._dlq.in".into(), "max-attempts".into())]
    );
    let poison =
        dlq.iter().find(|(_, _, h)| h.get(headers::DLQ_REASON) == Some("max-attempts")).expect("poison letter");
    assert!(poison.2.get(headers::DLQ_DETAIL).is_some_and(|d| d.contains("attempt 3 of 3")), "{:?}", poison.2);
    assert_eq!(poison.1.id, 17);
    // Everything is committed: every partition consumer is fully acked.
    job.stop();
    job.wait().await.expect("clean stop");
    for p in 0..4 {
        let c = b.consumer_state("FLOTILLA_t_in", &format!("in-p{p}")).await.expect("consumer");
        assert_eq!((c.num_pending, c.num_ack_pending), (0, 0), "partition {p}: {c:?}");
    }
}

#[actix_rt::test]
async fn queue_input_retries_dead_letters_and_survives_panics() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let job = Job::new("t")
        .task(JOBS, |_| Relay::<true>)
        .max_concurrency(4)
        .max_attempts(3)
        .ack_wait(Duration::from_secs(2))
        .start(b.clone())
        .await
        .expect("start");
    publish(&b, "jobs", false, 1, "ok").await;
    publish(&b, "jobs", false, 2, "flaky:2").await;
    publish(&b, "jobs", false, 3, "poison").await;
    publish(&b, "jobs", false, 4, "panic").await;
    wait_for(&b, "FLOTILLA_t_done", 2).await;
    wait_for(&b, "FLOTILLA_t_DLQ", 2).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let done = read_all(&b, "FLOTILLA_t_done", None).await;
    let mut ids: Vec<u64> = done.iter().map(|(_, r, _)| r.id).collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![1, 2], "flaky succeeded on its third attempt");
    let dlq = read_all(&b, "FLOTILLA_t_DLQ", None).await;
    let mut dead: Vec<(u64, String)> =
        dlq.iter().map(|(_, r, h)| (r.id, h.get(headers::DLQ_DETAIL).unwrap_or("").to_owned())).collect();
    dead.sort();
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert_eq!(dead[0].0, 3);
    assert_eq!(dead[1].0, 4);
    assert!(dead[1].1.contains("panicked"), "{:?}", dead[1]);
    let s = b.stream_state("FLOTILLA_t_jobs").await.expect("stream");
    assert_eq!(s.messages, 0, "every job acked or terminated");
    assert_eq!((calls(1), calls(2), calls(3), calls(4)), (1, 3, 3, 3), "attempts per record");
    job.stop();
    job.wait().await.expect("clean stop");
}

#[actix_rt::test]
async fn a_long_job_is_kept_alive_by_heartbeats_while_another_node_pulls() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let node = || Job::new("t").task(JOBS, |_| Relay::<true>).ack_wait(Duration::from_secs(2));
    let a = node().start(b.clone()).await.expect("node a");
    publish(&b, "jobs", false, 5, "sleep:6000").await; // 3× ack-wait
    tokio::time::sleep(Duration::from_millis(100)).await;
    // A second node pulls the whole time: without heartbeats it would get the job
    // after 2 s and run it again.
    let second = node().start(b.clone()).await.expect("node b");
    wait_for(&b, "FLOTILLA_t_done", 1).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(calls(5), 1, "the 6 s job with a 2 s ack-wait ran once");
    assert_eq!(b.stream_state("FLOTILLA_t_jobs").await.expect("stream").messages, 0);
    for job in [a, second] {
        job.stop();
        job.wait().await.expect("stop");
    }
}

/// Counts windows and messages; sends the count on each window.
struct Counter {
    seen: u64,
    windows: Rc<RefCell<Vec<u64>>>,
}

impl Task for Counter {
    type Input = Record;
    async fn process(&mut self, _: Record, _: &mut TaskContext) -> Result<(), TaskError> {
        self.seen += 1;
        Ok(())
    }
    async fn window(&mut self, _: &mut TaskContext) -> Result<(), TaskError> {
        self.windows.borrow_mut().push(self.seen);
        Ok(())
    }
}

#[actix_rt::test]
async fn a_ten_minute_window_runs_on_paused_time() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let windows: Rc<RefCell<Vec<u64>>> = Rc::default();
    let w = windows.clone();
    const ONE: StreamDef<Record> = StreamDef::ordered("one", 1);
    let started = tokio::time::Instant::now();
    let job = Job::new("t")
        .task(ONE, move |_| Counter { seen: 0, windows: w.clone() })
        .window_every(Duration::from_secs(600))
        .start(b.clone())
        .await
        .expect("start");
    for id in 0..5 {
        b.publish(
            OutboundMessage::new("flotilla.t.one.0", codec().encode(&Record { id, body: String::new() }).expect("e"))
                .with_id(format!("w{id}")),
        )
        .await
        .expect("publish");
    }
    tokio::time::sleep(Duration::from_secs(1801)).await;
    assert_eq!(*windows.borrow(), vec![5, 5, 5], "three windows in 30 minutes of paused time");
    assert!(started.elapsed() >= Duration::from_secs(1800));
    job.stop();
    job.wait().await.expect("stop");
}

#[actix_rt::test]
async fn a_fatal_error_fails_the_container_by_default() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let job = Job::new("t").task(IN, |_| Relay::<false>).start(b.clone()).await.expect("start");
    publish(&b, "in", true, 1, "fatal").await;
    let err = tokio::time::timeout(Duration::from_secs(120), job.wait()).await.expect("exits").expect_err("failed");
    assert!(err.to_string().contains("cannot continue"), "{err}");
}

#[actix_rt::test]
async fn restart_task_policy_keeps_the_container_running() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let starts = Rc::new(RefCell::new(HashMap::<Option<u32>, u32>::new()));
    let s = starts.clone();
    let job = Job::new("t")
        .task(IN, move |p| {
            *s.borrow_mut().entry(p).or_default() += 1;
            Relay::<false>
        })
        .on_failure(FailurePolicy::RestartTask)
        .start(b.clone())
        .await
        .expect("start");
    publish(&b, "in", true, 1, "fatal").await;
    publish(&b, "in", true, 2, "ok").await;
    wait_for(&b, "FLOTILLA_t_out", 1).await;
    // The fatal record fails its task every time: restarts back off exponentially
    // (0.2, 0.4, 0.8, … s), so 15 s see a handful of restarts, not a tight loop.
    tokio::time::sleep(Duration::from_secs(15)).await;
    let p = partition_for("1", 4);
    let restarted = starts.borrow()[&Some(p)];
    assert!(
        (3..=12).contains(&restarted),
        "the failed partition's task started {restarted} times: {:?}",
        starts.borrow()
    );
    let other = partition_for("2", 4);
    assert_eq!(starts.borrow()[&Some(other)], 1, "other partitions are untouched");
    job.stop();
    job.wait().await.expect("stop");
}

#[actix_rt::test]
async fn misconfigured_jobs_are_refused_naming_the_setting() {
    let b = EmbeddedBroker::new().shared();
    const ZERO: StreamDef<Record> = StreamDef::ordered("zero", 0);
    let e = Job::new("t").task(ZERO, |_| Relay::<false>).start(b.clone()).await.expect_err("zero partitions");
    assert!(e.to_string().contains("0 partitions"), "{e}");
    let e = Job::new("t")
        .task(IN, |_| Relay::<false>)
        .window_every(Duration::ZERO)
        .start(b.clone())
        .await
        .expect_err("window 0");
    assert!(matches!(&e, JobError::Config(c) if c.setting == "window_every"), "{e}");
    let e = Job::new("Bad_Name").task(IN, |_| Relay::<false>).start(b.clone()).await.expect_err("bad name");
    assert!(e.to_string().contains("[a-z0-9-]"), "{e}");
    // Settings before any task are every task's defaults; after a task, that task's.
    let e = Job::new("t")
        .window_every(Duration::ZERO)
        .task(IN, |_| Relay::<false>)
        .window_every(Duration::from_secs(1))
        .task(JOBS, |_| Relay::<true>)
        .start(b.clone())
        .await
        .expect_err("the queue task keeps the default of 0");
    assert!(matches!(&e, JobError::Config(c) if c.setting == "window_every"), "{e}");
    let e = Job::new("t").start(b.clone()).await.expect_err("no tasks");
    assert!(e.to_string().contains("no tasks"), "{e}");
    const BAD: StreamDef<Record> = StreamDef::queue("Bad.Stream");
    let e = Job::new("t").task(BAD, |_| Relay::<true>).start(b).await.expect_err("bad stream");
    assert!(e.to_string().contains("invalid stream name"), "{e}");
}

/// Forwards to `out`, and acts on control bodies: `stop-all`, `stop-me`,
/// `timer:<secs>`, `defer:<ms>`; counts drain and end-of-stream hooks.
struct Probe {
    hooks: Rc<RefCell<Vec<String>>>,
}

const TWO: StreamDef<Record> = StreamDef::ordered("two", 2);
const PROBED: StreamDef<Record> = StreamDef::ordered("probed", 2);

impl Task for Probe {
    type Input = Record;
    async fn process(&mut self, r: Record, ctx: &mut TaskContext) -> Result<(), TaskError> {
        match r.body.as_str() {
            "stop-all" => ctx.shutdown(flotilla_actors::ShutdownScope::AllTasksInContainer),
            "stop-me" => ctx.shutdown(flotilla_actors::ShutdownScope::CurrentTask),
            b if b.starts_with("timer:") => {
                let secs: u64 = b[6..].parse().map_err(|_| TaskError::failed("bad timer"))?;
                ctx.schedule(format!("t{}", r.id), Duration::from_secs(secs))?;
            }
            b if b.starts_with("defer:") => {
                let ms: u64 = b[6..].parse().map_err(|_| TaskError::failed("bad defer"))?;
                let out = ctx.outputs();
                let rec = r.clone();
                ctx.defer(async move {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    out.send(&PROBED, &rec.id.to_string(), &rec).await
                });
                return Ok(());
            }
            b if b.starts_with("sleep:") => {
                tokio::time::sleep(Duration::from_millis(b[6..].parse().unwrap_or(0))).await;
            }
            b if b.starts_with("delay:") => {
                let secs: u64 = b[6..].parse().map_err(|_| TaskError::failed("bad delay"))?;
                return ctx.send_after(&PROBED, &r.id.to_string(), &r, Duration::from_secs(secs)).await;
            }
            _ => {}
        }
        ctx.send(&PROBED, &r.id.to_string(), &r).await
    }
    async fn timer(&mut self, name: String, ctx: &mut TaskContext) -> Result<(), TaskError> {
        self.hooks.borrow_mut().push(format!("timer {name}"));
        ctx.send(&PROBED, "timer", Record { id: 9999, body: name }).await
    }
    async fn drain(&mut self, ctx: &mut TaskContext) -> Result<(), TaskError> {
        self.hooks.borrow_mut().push(format!("drain p{:?}", ctx.partition()));
        Ok(())
    }
    async fn end_of_stream(&mut self, ctx: &mut TaskContext) -> Result<(), TaskError> {
        self.hooks.borrow_mut().push(format!("eos p{:?}", ctx.partition()));
        Ok(())
    }
}

async fn publish_two(b: &SharedBroker, partition: u32, id: u64, body: &str, kind: Option<(&str, &str)>) {
    let payload = codec().encode(&Record { id, body: body.into() }).expect("encode");
    let mut msg = OutboundMessage::new(format!("flotilla.t.two.{partition}"), payload)
        .with_id(format!("two-{partition}-{id}-{body}"));
    if let Some((kind, run)) = kind {
        msg.headers.insert(headers::KIND, kind);
        msg.headers.insert(headers::RUN, run);
    }
    b.publish(msg).await.expect("publish");
}

fn probe_job(hooks: &Rc<RefCell<Vec<String>>>) -> Job {
    let h = hooks.clone();
    Job::new("t").task(TWO, move |_| Probe { hooks: h.clone() })
}

#[actix_rt::test]
async fn a_current_drain_marker_drains_every_partition_and_the_job_completes() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let hooks: Rc<RefCell<Vec<String>>> = Rc::default();
    let job = probe_job(&hooks).run_id("run-1").start(b.clone()).await.expect("start");
    publish_two(&b, 0, 100, "", Some(("drain", "run-0"))).await; // a stale marker: dropped
    for p in 0..2 {
        for id in 0..5 {
            publish_two(&b, p, id, "before", None).await;
        }
        publish_two(&b, p, 50, "", Some(("drain", "run-1"))).await;
        for id in 10..13 {
            publish_two(&b, p, id, "after", None).await;
        }
    }
    tokio::time::timeout(Duration::from_secs(60), job.wait()).await.expect("drained in time").expect("completed");
    let mut h = hooks.borrow().clone();
    h.sort();
    assert_eq!(h, vec!["drain pSome(0)", "drain pSome(1)"]);
    let out = read_all(&b, "FLOTILLA_t_probed", None).await;
    assert!(out.iter().all(|(_, r, _)| r.body == "before"), "nothing after a marker was processed");
    assert_eq!(out.len(), 10, "everything before the markers was processed");
    // The next run picks up what followed the markers.
    let job = probe_job(&hooks).run_id("run-2").start(b.clone()).await.expect("next run");
    wait_for(&b, "FLOTILLA_t_probed", 16).await;
    job.stop();
    job.wait().await.expect("stop");
    let out = read_all(&b, "FLOTILLA_t_probed", None).await;
    assert_eq!(out.iter().filter(|(_, r, _)| r.body == "after").count(), 6);
}

#[actix_rt::test]
async fn end_of_stream_on_every_partition_completes_the_job() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let hooks: Rc<RefCell<Vec<String>>> = Rc::default();
    let job = probe_job(&hooks).start(b.clone()).await.expect("start");
    for p in 0..2 {
        publish_two(&b, p, 1, "x", None).await;
        publish_two(&b, p, 2, "", Some(("end-of-stream", ""))).await;
    }
    tokio::time::timeout(Duration::from_secs(60), job.wait()).await.expect("ended in time").expect("completed");
    let mut h = hooks.borrow().clone();
    h.sort();
    assert_eq!(h, vec!["eos pSome(0)", "eos pSome(1)"]);
    assert_eq!(read_all(&b, "FLOTILLA_t_probed", None).await.len(), 2);
}

#[actix_rt::test]
async fn shutdown_requests_follow_their_scope() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let hooks: Rc<RefCell<Vec<String>>> = Rc::default();
    let job = probe_job(&hooks).start(b.clone()).await.expect("start");
    publish_two(&b, 0, 1, "stop-me", None).await;
    // One task of two asked for itself: the container keeps running.
    let mut waiting = Box::pin(job.wait());
    assert!(
        tokio::time::timeout(Duration::from_secs(30), &mut waiting).await.is_err(),
        "stopped on a current-task request"
    );
    publish_two(&b, 1, 2, "stop-me", None).await;
    tokio::time::timeout(Duration::from_secs(30), waiting).await.expect("every task asked").expect("completed");

    let job = probe_job(&hooks).start(b.clone()).await.expect("start again");
    publish_two(&b, 1, 3, "stop-all", None).await;
    tokio::time::timeout(Duration::from_secs(30), job.wait())
        .await
        .expect("one all-tasks request stops it")
        .expect("completed");
}

#[actix_rt::test]
async fn a_callback_past_its_timeout_fails_the_task() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let hooks: Rc<RefCell<Vec<String>>> = Rc::default();
    let job = probe_job(&hooks).callback_timeout(Duration::from_secs(2)).start(b.clone()).await.expect("start");
    publish_two(&b, 0, 1, "sleep:10000", None).await;
    let err = tokio::time::timeout(Duration::from_secs(60), job.wait()).await.expect("exits").expect_err("failed");
    assert!(err.to_string().contains("did not complete within 2s"), "{err}");
}

#[actix_rt::test]
async fn user_timers_fire_on_paused_time() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let hooks: Rc<RefCell<Vec<String>>> = Rc::default();
    let job = probe_job(&hooks).start(b.clone()).await.expect("start");
    let started = tokio::time::Instant::now();
    publish_two(&b, 0, 7, "timer:3600", None).await;
    wait_for(&b, "FLOTILLA_t_probed", 1).await;
    assert!(hooks.borrow().is_empty(), "not before the hour");
    tokio::time::sleep(Duration::from_secs(3601)).await;
    wait_for(&b, "FLOTILLA_t_probed", 2).await;
    assert_eq!(*hooks.borrow(), vec!["timer t7"]);
    assert!(started.elapsed() >= Duration::from_secs(3600));
    job.stop();
    job.wait().await.expect("stop");
}

#[actix_rt::test]
async fn deferred_work_runs_up_to_max_concurrency_at_once() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let hooks: Rc<RefCell<Vec<String>>> = Rc::default();
    const ONE: StreamDef<Record> = StreamDef::ordered("two", 1);
    let h = hooks.clone();
    let job = Job::new("t")
        .task(ONE, move |_| Probe { hooks: h.clone() })
        .max_concurrency(4)
        .start(b.clone())
        .await
        .expect("start");
    let started = tokio::time::Instant::now();
    for id in 0..8 {
        publish_two(&b, 0, id, "defer:1000", None).await;
    }
    wait_for(&b, "FLOTILLA_t_probed", 8).await;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_millis(2500),
        "8 × 1 s with 4 at once took {took:?}"
    );
    job.stop();
    job.wait().await.expect("stop");
}

#[actix_rt::test]
async fn a_lasting_backlog_is_reported_degraded_then_recovered() {
    tokio::time::pause();
    let embedded = EmbeddedBroker::new();
    let b = embedded.shared();
    let mut events = b.subscribe("flotilla.t._evt.>", None).await.expect("events");
    let hooks: Rc<RefCell<Vec<String>>> = Rc::default();
    let config = flotilla_actors::container::ContainerConfig {
        backlog_interval: Duration::from_secs(1),
        backlog_threshold: 10,
        backlog_strikes: 3,
        ..Default::default()
    };
    let job = probe_job(&hooks).container_config(config).start(b.clone()).await.expect("start");
    for id in 0..30 {
        publish_two(&b, 1, id, "sleep:500", None).await;
    }
    let mut seen = Vec::new();
    let found = tokio::time::timeout(Duration::from_secs(120), async {
        while let Some(ev) = futures::StreamExt::next(&mut events).await {
            let v: serde_json::Value = serde_json::from_slice(&ev.payload).expect("event json");
            seen.push((ev.subject.clone(), v.clone()));
            if v["type"] == "recovered" {
                return;
            }
        }
    })
    .await;
    assert!(found.is_ok(), "events: {seen:?}");
    let degraded = seen.iter().find(|(s, _)| s == "flotilla.t._evt.degraded").expect("degraded event");
    assert_eq!(degraded.1["stream"], "two");
    assert_eq!(degraded.1["partition"], 1, "names the partition holding the backlog");
    assert!(degraded.1["backlog"].as_u64().unwrap_or(0) > 10);
    job.stop();
    job.wait().await.expect("stop");
}

#[actix_rt::test]
async fn an_unavailable_broker_is_reported_backed_off_from_and_resumed() {
    tokio::time::pause();
    let embedded = EmbeddedBroker::new();
    let b = embedded.shared();
    let mut events = b.subscribe("flotilla.t._evt.>", None).await.expect("events");
    let hooks: Rc<RefCell<Vec<String>>> = Rc::default();
    let job = probe_job(&hooks).start(b.clone()).await.expect("start");
    for id in 0..5 {
        publish_two(&b, 0, id, "x", None).await;
    }
    wait_for(&b, "FLOTILLA_t_probed", 5).await;
    embedded.set_unavailable(true);
    tokio::time::sleep(Duration::from_secs(60)).await;
    embedded.set_unavailable(false);
    for id in 5..10 {
        publish_two(&b, 0, id, "x", None).await;
    }
    wait_for(&b, "FLOTILLA_t_probed", 10).await;
    let mut kinds = Vec::new();
    while let Ok(Some(ev)) =
        tokio::time::timeout(Duration::from_millis(10), futures::StreamExt::next(&mut events)).await
    {
        let v: serde_json::Value = serde_json::from_slice(&ev.payload).expect("json");
        kinds.push(v["type"].as_str().unwrap_or_default().to_owned());
    }
    let unavailable = kinds.iter().filter(|k| *k == "queue_unavailable").count();
    assert!(unavailable >= 2, "one per partition at least: {kinds:?}");
    assert!(
        unavailable <= 8,
        "reported once per outage per partition (plus every 10th retry), not per claim: {kinds:?}"
    );
    assert!(kinds.iter().any(|k| k == "queue_available"), "{kinds:?}");
    job.stop();
    job.wait().await.expect("stop");
}

/// Provisions `job` (2 attempts: max deliveries = attempts + 1 + the allowance for
/// hand-backs = 23) and plays nodes that each die holding record 42 of `jobs`: it is
/// stranded in the work queue.
async fn strand_record_42(b: &SharedBroker, job: Job) {
    job.provision(b.clone()).await.expect("provision");
    publish(b, "jobs", false, 42, "ok").await;
    for _ in 0..2 + 1 + flotilla_actors::task_worker::RELEASE_ALLOWANCE {
        let got = b.claim("FLOTILLA_t_jobs", "jobs-workers", 1, Duration::from_secs(5)).await.expect("claim");
        assert_eq!(got.len(), 1);
    }
}

#[actix_rt::test]
async fn the_reaper_sweeps_messages_stranded_at_max_deliveries() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let config =
        flotilla_actors::container::ContainerConfig { sweep_interval: Duration::from_secs(5), ..Default::default() };
    let job = || {
        Job::new("t")
            .task(JOBS, |_| Relay::<true>)
            .max_attempts(2)
            .ack_wait(Duration::from_secs(1))
            .container_config(config.clone())
    };
    strand_record_42(&b, job()).await;
    assert!(
        b.claim("FLOTILLA_t_jobs", "jobs-workers", 1, Duration::from_secs(3)).await.expect("claim").is_empty(),
        "stranded"
    );
    assert_eq!(b.stream_state("FLOTILLA_t_jobs").await.expect("stream").messages, 1, "still in the stream, invisible");
    let running = job().start(b.clone()).await.expect("start");
    wait_for(&b, "FLOTILLA_t_DLQ", 1).await;
    let dlq = read_all(&b, "FLOTILLA_t_DLQ", None).await;
    assert_eq!(dlq[0].1.id, 42);
    assert_eq!(dlq[0].2.get(headers::DLQ_REASON), Some("max-deliveries"));
    assert_eq!(dlq[0].2.msg_id(), Some("dlq-FLOTILLA_t_jobs-1"));
    assert_eq!(b.stream_state("FLOTILLA_t_jobs").await.expect("stream").messages, 0, "removed from the queue");
    running.stop();
    running.wait().await.expect("stop");
}

/// The same under load: the queue is never idle (the sweep of an idle queue never
/// runs), yet the stranded message is moved, from the `MAX_DELIVERIES` advisory the
/// job's capture stream kept.
#[actix_rt::test]
async fn a_message_stranded_while_the_queue_stays_busy_is_dead_lettered_from_its_advisory() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let config =
        flotilla_actors::container::ContainerConfig { sweep_interval: Duration::from_secs(5), ..Default::default() };
    let job = || {
        Job::new("t")
            .task(JOBS, |_| Relay::<true>)
            .max_concurrency(2)
            .max_attempts(2)
            .ack_wait(Duration::from_secs(1))
            .container_config(config.clone())
    };
    strand_record_42(&b, job()).await;
    // Busy for a minute and a half: two at a time, one second each.
    for id in 0..180 {
        publish(&b, "jobs", false, 1000 + id, "sleep:1000").await;
    }
    let running = job().start(b.clone()).await.expect("start");
    let mut waited = Duration::ZERO;
    while b.stream_state("FLOTILLA_t_DLQ").await.map(|s| s.messages).unwrap_or(0) == 0 {
        assert!(waited < Duration::from_secs(60), "liveness: the stranded message was not moved within 60 s");
        tokio::time::sleep(Duration::from_millis(500)).await;
        waited += Duration::from_millis(500);
    }
    let busy = b.consumer_state("FLOTILLA_t_jobs", "jobs-workers").await.expect("consumer");
    assert!(busy.num_pending + busy.num_ack_pending > 0, "the queue was busy all along: {busy:?}");
    let dlq = read_all(&b, "FLOTILLA_t_DLQ", None).await;
    assert_eq!(dlq.len(), 1);
    assert_eq!(dlq[0].1.id, 42);
    assert_eq!(dlq[0].2.get(headers::DLQ_REASON), Some("max-deliveries"));
    running.stop();
    running.wait().await.expect("stop");
}

#[actix_rt::test]
async fn a_delayed_output_arrives_when_due_and_survives_a_restart() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let hooks: Rc<RefCell<Vec<String>>> = Rc::default();
    let job = probe_job(&hooks).start(b.clone()).await.expect("start");
    let started = tokio::time::Instant::now();
    publish_two(&b, 0, 5, "delay:3600", None).await;
    tokio::time::sleep(Duration::from_secs(1800)).await;
    assert_eq!(b.stream_state("FLOTILLA_t_probed").await.expect("out").messages, 0, "not due yet");
    // The node goes away; the delayed message waits in the timer stream.
    job.stop();
    job.wait().await.expect("stop");
    tokio::time::sleep(Duration::from_secs(60)).await;
    let job = probe_job(&hooks).start(b.clone()).await.expect("restart");
    tokio::time::sleep(Duration::from_secs(1730)).await;
    assert_eq!(b.stream_state("FLOTILLA_t_probed").await.expect("out").messages, 0, "still not due at 59:50");
    wait_for(&b, "FLOTILLA_t_probed", 1).await;
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(3600) && took < Duration::from_secs(3610), "arrived after {took:?}");
    let out = read_all(&b, "FLOTILLA_t_probed", None).await;
    assert_eq!(out[0].1.id, 5);
    assert_eq!(out[0].2.get(headers::CAUSE), Some("two-0-5-delay:3600"), "it keeps its cause and id");
    assert_eq!(b.stream_state("FLOTILLA_t_TIMERS").await.expect("timers").messages, 0, "promoted and removed");
    job.stop();
    job.wait().await.expect("stop");
}

#[actix_rt::test]
async fn an_outage_while_outputs_are_published_costs_no_attempt_and_no_rerun() {
    tokio::time::pause();
    let embedded = EmbeddedBroker::new();
    let b = embedded.shared();
    let job = Job::new("t").task(IN, |_| Relay::<false>).max_attempts(2).start(b.clone()).await.expect("start");
    publish(&b, "in", true, 61, "sleep:1000").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(calls(61), 1, "the handler is running");
    embedded.set_unavailable(true); // its outputs cannot be stored when it returns
    tokio::time::sleep(Duration::from_secs(20)).await;
    embedded.set_unavailable(false);
    // The publish's back-off may have grown to 25.6 s (±50 %) during the outage.
    tokio::time::sleep(Duration::from_secs(40)).await;
    wait_for(&b, "FLOTILLA_t_out", 1).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(calls(61), 1, "the same outputs were published again; the handler did not run again");
    assert_eq!(
        b.stream_state("FLOTILLA_t_DLQ").await.expect("dlq").messages,
        0,
        "an outage is not the message's fault"
    );
    job.stop();
    job.wait().await.expect("stop");
}

#[actix_rt::test]
async fn a_failed_attempt_publishes_nothing() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    struct Partial;
    impl Task for Partial {
        type Input = Record;
        async fn process(&mut self, r: Record, ctx: &mut TaskContext) -> Result<(), TaskError> {
            let attempt = ctx.message().map_or(1, |m| m.attempt);
            ctx.send(&OUT, &r.id.to_string(), Record { id: r.id, body: format!("attempt {attempt}") }).await?;
            if attempt < 2 { Err(TaskError::failed("after sending")) } else { Ok(()) }
        }
    }
    let job = Job::new("t").task(IN, |_| Partial).max_attempts(3).start(b.clone()).await.expect("start");
    publish(&b, "in", true, 1, "x").await;
    wait_for(&b, "FLOTILLA_t_out", 1).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let out = read_all(&b, "FLOTILLA_t_out", None).await;
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].1.body, "attempt 2", "the first attempt's output was never published");
    job.stop();
    job.wait().await.expect("stop");
}

#[actix_rt::test]
async fn a_partition_commits_once_per_window_not_once_per_message() {
    tokio::time::pause();
    const ONE: StreamDef<Record> = StreamDef::ordered("one", 1);
    struct Counting(Rc<RefCell<u32>>);
    impl Task for Counting {
        type Input = Record;
        async fn process(&mut self, _: Record, _: &mut TaskContext) -> Result<(), TaskError> {
            Ok(())
        }
        async fn commit(&mut self, _: &mut TaskContext) -> Result<(), TaskError> {
            *self.0.borrow_mut() += 1;
            Ok(())
        }
    }
    let b = EmbeddedBroker::new().shared();
    let commits: Rc<RefCell<u32>> = Rc::default();
    let c = commits.clone();
    let job_def = Job::new("t").task(ONE, move |_| Counting(c.clone()));
    job_def.provision(b.clone()).await.expect("provision");
    // A backlog of four windows (256 each), so every claim brings a whole window.
    let n = 1024u64;
    for id in 0..n {
        let payload = codec().encode(&Record { id, body: String::new() }).expect("encode");
        let msg = OutboundMessage::new("flotilla.t.one.0", payload).with_id(format!("one-{id}"));
        b.publish(msg).await.expect("publish");
    }
    let job = job_def.start(b.clone()).await.expect("start");
    let mut acked = false;
    for _ in 0..600 {
        let c = b.consumer_state("FLOTILLA_t_one", "one-p0").await.expect("consumer");
        if c.num_pending == 0 && c.num_ack_pending == 0 {
            acked = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(acked, "the partition was not fully committed in time");
    let commits = *commits.borrow();
    // One commit per claimed window (256) is 4, as a plain loop that acks the last
    // message of each fetch; half a window per commit was 8, one per message would be
    // about a thousand.
    assert!((4..=5).contains(&commits), "{commits} commits for {n} messages");
    job.stop();
    job.wait().await.expect("stop");
}

/// An output key with a line break cannot travel in `Flotilla-Key`: the attempt fails
/// with a message that says so (no panic in the publish path), and the input is
/// dead-lettered once its attempts are spent; nothing is published.
#[actix_rt::test]
async fn an_output_key_with_a_line_break_fails_the_attempt_and_is_dead_lettered() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let job =
        Job::new("t").task(JOBS, |_| Relay::<true>).max_attempts(2).output(DONE).start(b.clone()).await.expect("start");
    publish(&b, "jobs", false, 7, "badkey").await;
    publish(&b, "jobs", false, 8, "ok").await;
    wait_for(&b, "FLOTILLA_t_DLQ", 1).await;
    wait_for(&b, "FLOTILLA_t_done", 1).await;
    let dlq = read_all(&b, "FLOTILLA_t_DLQ", None).await;
    assert_eq!(dlq.len(), 1);
    assert_eq!(dlq[0].1.id, 7);
    let detail = dlq[0].2.get(headers::DLQ_DETAIL).unwrap_or("");
    assert!(detail.contains(headers::KEY) && detail.contains("line break"), "{detail}");
    let done: Vec<u64> = read_all(&b, "FLOTILLA_t_done", None).await.iter().map(|(_, r, _)| r.id).collect();
    assert_eq!(done, vec![8], "the bad record published nothing");
    assert_eq!(calls(7), 2, "both attempts ran");
    job.stop();
    job.wait().await.expect("clean stop");
}

/// A stopped job lets go of its broker: no actor of it (workers, container, timer
/// service with its delayed-message loop, reaper) outlives the job. A process that runs
/// jobs one after another (tests, benchmarks, a job restarted in place) must not pile
/// up old jobs' actors polling the broker, nor keep their brokers' memory.
#[actix_rt::test]
async fn a_stopped_job_leaves_no_actor_holding_the_broker() {
    tokio::time::pause();
    for cluster in [false, true] {
        let b = EmbeddedBroker::new().shared();
        let job = Job::new("t").task(IN, |_| Relay::<false>).task(JOBS, |_| Relay::<true>).output(DONE);
        let job = if cluster {
            job.start_node(b.clone(), "a", flotilla_actors::cluster::ClusterConfig::default()).await
        } else {
            job.start(b.clone()).await
        }
        .expect("start");
        publish(&b, "in", true, 1, "ok").await;
        publish(&b, "jobs", false, 2, "ok").await;
        wait_for(&b, "FLOTILLA_t_out", 1).await;
        wait_for(&b, "FLOTILLA_t_done", 1).await;
        job.stop();
        job.wait().await.expect("clean stop");
        let handle = std::sync::Arc::downgrade(&b);
        drop(b);
        // Claims in flight end within their wait (1 s), idle ones within 5 s.
        for _ in 0..100 {
            if handle.strong_count() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(handle.strong_count(), 0, "cluster mode {cluster}: actors of the stopped job still hold the broker");
    }
}

/// A callback with hundreds of outputs publishes them all, in send order, with the ids
/// derived from the input's id and each output's index, and the input is acknowledged
/// once they are stored.
#[actix_rt::test]
async fn a_callback_with_many_outputs_publishes_them_all_in_order() {
    tokio::time::pause();
    struct Fanout;
    impl Task for Fanout {
        type Input = Record;
        async fn process(&mut self, r: Record, ctx: &mut TaskContext) -> Result<(), TaskError> {
            for i in 0..r.id {
                ctx.send(&DONE, &i.to_string(), Record { id: i, body: String::new() }).await?;
            }
            Ok(())
        }
    }
    let b = EmbeddedBroker::new().shared();
    let job = Job::new("t").task(JOBS, |_| Fanout).output(DONE).start(b.clone()).await.expect("start");
    publish(&b, "jobs", false, 700, "fan").await;
    wait_for(&b, "FLOTILLA_t_done", 700).await;
    let done = read_all(&b, "FLOTILLA_t_done", None).await;
    let ids: Vec<u64> = done.iter().map(|(_, r, _)| r.id).collect();
    assert_eq!(ids, (0..700).collect::<Vec<u64>>(), "every output, in send order");
    let cause = done[0].2.get(headers::CAUSE).expect("cause").to_owned();
    let cause = flotilla_transport::wire::MessageId::from_wire(cause);
    for (i, (_, _, h)) in done.iter().enumerate() {
        assert_eq!(h.msg_id(), Some(cause.derive_output(i as u32).as_str()), "output {i}");
    }
    for _ in 0..100 {
        if b.stream_state("FLOTILLA_t_jobs").await.expect("state").messages == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(b.stream_state("FLOTILLA_t_jobs").await.expect("state").messages, 0, "the input is acked");
    job.stop();
    job.wait().await.expect("clean stop");
}

/// A delivery that never reaches the worker (a pull answered after its client gave up,
/// a connection cut mid-batch, a stale puller) must not be covered by a later ack-all.
/// Here the task itself plays the stale puller: on a `steal` record it publishes three
/// more records to its own partition and claims them from the partition's consumer
/// before the worker can, dropping them. The worker's next delivery then skips three
/// consumer sequence numbers; it commits what it has, the partition is reset at its
/// committed position, and the stolen records are processed after all.
#[actix_rt::test]
async fn a_delivery_lost_in_transit_is_processed_after_a_reset_never_acked_unprocessed() {
    tokio::time::pause();
    struct Thief {
        broker: SharedBroker,
    }
    impl Task for Thief {
        type Input = Record;
        async fn process(&mut self, r: Record, ctx: &mut TaskContext) -> Result<(), TaskError> {
            CALLS.with(|c| *c.borrow_mut().entry(r.id).or_default() += 1);
            if r.body == "steal" && ctx.message().is_some_and(|m| m.attempt == 1) {
                let p = ctx.partition().expect("ordered");
                for id in 1000..1003 {
                    let payload = codec().encode(&Record { id, body: "stolen".into() }).expect("encode");
                    let msg = OutboundMessage::new(format!("flotilla.t.in.{p}"), payload)
                        .with_id(format!("in-{id}"))
                        .with_header(headers::KEY, id.to_string());
                    self.broker.publish(msg).await.expect("publish");
                }
                let stolen = self.broker.claim("FLOTILLA_t_in", &format!("in-p{p}"), 3, Duration::from_millis(1)).await;
                assert_eq!(stolen.map(|d| d.len()).ok(), Some(3), "the thief got the three records");
            }
            ctx.send(&OUT, &r.id.to_string(), &r).await
        }
    }
    let b = EmbeddedBroker::new().shared();
    let thief = b.clone();
    let job = Job::new("t").task(IN, move |_| Thief { broker: thief.clone() }).start(b.clone()).await.expect("start");
    for id in 0..40 {
        publish(&b, "in", true, id, if id == 5 { "steal" } else { "ok" }).await;
    }
    wait_for(&b, "FLOTILLA_t_out", 40).await;
    // Later records of the same partition arrive after the gap.
    for id in 40..80 {
        publish(&b, "in", true, id, "ok").await;
    }
    wait_for(&b, "FLOTILLA_t_out", 83).await;
    let out = read_all(&b, "FLOTILLA_t_out", None).await;
    let mut ids: Vec<u64> = out.iter().map(|(_, r, _)| r.id).collect();
    ids.sort_unstable();
    let expected: Vec<u64> = (0..80).chain(1000..1003).collect();
    assert_eq!(ids, expected, "every record once, the stolen ones included");
    for id in 1000..1003 {
        assert!(calls(id) >= 1, "stolen record {id} was processed");
    }
    job.stop();
    job.wait().await.expect("clean stop");
    for p in 0..4 {
        let c = b.consumer_state("FLOTILLA_t_in", &format!("in-p{p}")).await.expect("consumer");
        assert_eq!((c.num_pending, c.num_ack_pending), (0, 0), "partition {p}: {c:?}");
    }
}

/// Only data enters a task. A drain or end-of-stream marker on a queue input would let
/// any producer end the job; it is dead-lettered, and the queue keeps flowing. A timer
/// in the timer stream whose target is not one of the job's data subjects (the control
/// plane, another job) or whose delay is unusable is dead-lettered with its reason;
/// a sound one is still promoted.
#[actix_rt::test]
async fn markers_on_a_queue_and_timers_aimed_outside_the_job_are_dead_lettered() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let job = Job::new("t").task(JOBS, |_| Relay::<true>).start(b.clone()).await.expect("start");
    for (i, kind) in [(1, "end-of-stream"), (2, "drain")] {
        let payload = codec().encode(&Record { id: 900 + i, body: "marker".into() }).expect("encode");
        let msg = OutboundMessage::new("flotilla.t.jobs", payload)
            .with_id(format!("marker-{i}"))
            .with_header(headers::KIND, kind)
            .with_header(headers::RUN, "whatever");
        b.publish(msg).await.expect("publish marker");
    }
    let timer = |id: &str, delay: &str, target: &str| {
        let payload = codec().encode(&Record { id: 77, body: id.into() }).expect("encode");
        OutboundMessage::new(format!("flotilla.t._timer.{id}"), payload)
            .with_id(format!("timer-{id}"))
            .with_header(headers::DELAY, delay)
            .with_header(headers::TARGET, target)
    };
    for msg in [
        timer("ctl", "0", "flotilla.t._ctl.all.shutdown"),
        timer("other-job", "0", "flotilla.other.jobs"),
        timer("forever", &u64::MAX.to_string(), "flotilla.t.done"),
        timer("good", "1000", "flotilla.t.done"),
    ] {
        b.publish(msg).await.expect("publish timer");
    }
    for id in 1..=3 {
        publish(&b, "jobs", false, id, "ok").await;
    }
    // The three records, and the sound timer's output.
    wait_for(&b, "FLOTILLA_t_done", 4).await;
    wait_for(&b, "FLOTILLA_t_DLQ", 5).await;
    let mut dlq: Vec<(String, String)> = read_all(&b, "FLOTILLA_t_DLQ", None)
        .await
        .into_iter()
        .map(|(subject, _, h)| (subject, h.get(headers::DLQ_REASON).unwrap_or_default().to_owned()))
        .collect();
    dlq.sort();
    assert_eq!(
        dlq,
        vec![
            ("flotilla.t._dlq._timers".to_owned(), "bad-timer".to_owned()),
            ("flotilla.t._dlq._timers".to_owned(), "bad-timer".to_owned()),
            ("flotilla.t._dlq._timers".to_owned(), "bad-timer".to_owned()),
            ("flotilla.t._dlq.jobs".to_owned(), "malformed".to_owned()),
            ("flotilla.t._dlq.jobs".to_owned(), "malformed".to_owned()),
        ]
    );
    let done: Vec<u64> = read_all(&b, "FLOTILLA_t_done", None).await.iter().map(|(_, r, _)| r.id).collect();
    assert_eq!(done.iter().filter(|id| **id == 77).count(), 1, "the sound timer was promoted: {done:?}");
    // The job is still running: a record published now is processed.
    publish(&b, "jobs", false, 4, "ok").await;
    wait_for(&b, "FLOTILLA_t_done", 5).await;
    job.stop();
    job.wait().await.expect("clean stop");
}

/// The input type's `Deserialize` is user code too: a panic there dead-letters that
/// message as malformed and the partition goes on.
#[actix_rt::test]
async fn a_panicking_deserialize_dead_letters_the_message_and_the_partition_goes_on() {
    tokio::time::pause();
    #[derive(Debug, Serialize)]
    struct Touchy(u64);
    impl<'de> Deserialize<'de> for Touchy {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            let v = u64::deserialize(d)?;
            assert!(v != 13, "unlucky number");
            Ok(Touchy(v))
        }
    }
    const TOUCHY: StreamDef<Touchy> = StreamDef::ordered("touchy", 1);
    struct Count(Rc<RefCell<Vec<u64>>>);
    impl Task for Count {
        type Input = Touchy;
        async fn process(&mut self, t: Touchy, _: &mut TaskContext) -> Result<(), TaskError> {
            self.0.borrow_mut().push(t.0);
            Ok(())
        }
    }
    let seen: Rc<RefCell<Vec<u64>>> = Rc::default();
    let s = seen.clone();
    let b = EmbeddedBroker::new().shared();
    let job = Job::new("t").task(TOUCHY, move |_| Count(s.clone())).start(b.clone()).await.expect("start");
    for v in [12u64, 13, 14] {
        let msg = OutboundMessage::new("flotilla.t.touchy.0", codec().encode(&v).expect("encode"))
            .with_id(format!("touchy-{v}"));
        b.publish(msg).await.expect("publish");
    }
    wait_for(&b, "FLOTILLA_t_DLQ", 1).await;
    for _ in 0..100 {
        if seen.borrow().len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(*seen.borrow(), vec![12, 14]);
    let dlq = read_all(&b, "FLOTILLA_t_DLQ", None).await;
    let h = &dlq[0].2;
    assert_eq!(h.get(headers::DLQ_REASON), Some("malformed"));
    assert!(h.get(headers::DLQ_DETAIL).is_some_and(|d| d.contains("Deserialize panicked: unlucky number")), "{h:?}");
    job.stop();
    job.wait().await.expect("clean stop");
}

/// A message that hangs its task every time, under `RestartTask`, would restart the
/// partition forever. Once the partition is taken over with unfinished work, each
/// message up to where the failed task had got is a suspect, counted in the job's KV;
/// the one that ends `crash_limit` (here 2) counted owners is dead-lettered as
/// `crash-loop`, and the partition goes on.
#[actix_rt::test]
async fn a_message_that_hangs_its_task_every_time_is_dead_lettered_as_a_crash_loop() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let starts = Rc::new(RefCell::new(0u32));
    let s = starts.clone();
    let job = Job::new("t")
        .task(IN, move |p| {
            if p == Some(partition_for("1", 4)) {
                *s.borrow_mut() += 1;
            }
            Relay::<false>
        })
        .on_failure(FailurePolicy::RestartTask)
        .callback_timeout(Duration::from_secs(1))
        .crash_limit(2)
        .start(b.clone())
        .await
        .expect("start");
    // Records 1 and 2 share a partition only by chance: use keys of the same partition.
    let p = partition_for("1", 4);
    let same: Vec<u64> = (2..200).filter(|id| partition_for(&id.to_string(), 4) == p).take(3).collect();
    publish(&b, "in", true, 1, "sleep:100000000").await;
    for id in &same {
        publish(&b, "in", true, *id, "ok").await;
    }
    wait_for(&b, "FLOTILLA_t_DLQ", 1).await;
    wait_for(&b, "FLOTILLA_t_out", same.len() as u64).await;
    let dlq = read_all(&b, "FLOTILLA_t_DLQ", None).await;
    assert_eq!(dlq.len(), 1);
    assert_eq!(dlq[0].1.id, 1);
    assert_eq!(dlq[0].2.get(headers::DLQ_REASON), Some("crash-loop"));
    assert!(dlq[0].2.get(headers::DLQ_DETAIL).is_some_and(|d| d.contains("started 2 times")), "{:?}", dlq[0].2);
    let out: Vec<u64> = read_all(&b, "FLOTILLA_t_out", None).await.iter().map(|(_, r, _)| r.id).collect();
    assert_eq!(out, same, "the others, in order");
    // The first owner's hang is not counted (nothing was suspect yet), then two counted.
    assert_eq!(calls(1), 3, "the hanging record ran three times");
    assert_eq!(*starts.borrow(), 4, "three tasks ended by it, then one that went on");
    // Once everything suspect is committed, the record goes.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let bucket = "FLOTILLA_t_SUSPECTS";
    assert_eq!(b.kv_get(bucket, &format!("in.{p}")).await.expect("read"), None, "suspect record left behind");
    job.stop();
    job.wait().await.expect("clean stop");
}

/// The callback timeout has a default (5 minutes): a handler that hangs for ever with
/// nothing set is not kept alive by in-progress acks for ever; it fails its task, and a
/// record that hangs every owner ends in the DLQ as a crash loop.
#[actix_rt::test]
async fn a_hung_handler_is_timed_out_by_default() {
    tokio::time::pause();
    assert_eq!(
        flotilla_actors::TaskConfig::default().callback_timeout,
        Some(Duration::from_secs(300)),
        "the documented default"
    );
    let b = EmbeddedBroker::new().shared();
    let job = Job::new("t")
        .task(IN, |_| Relay::<false>)
        .on_failure(FailurePolicy::RestartTask)
        .crash_limit(2)
        .start(b.clone())
        .await
        .expect("start");
    publish(&b, "in", true, 1, "sleep:100000000").await;
    // Three hangs of 5 minutes (the first uncounted), then the DLQ.
    let mut waited = Duration::ZERO;
    while b.stream_state("FLOTILLA_t_DLQ").await.map(|s| s.messages).unwrap_or(0) == 0 {
        assert!(waited < Duration::from_secs(3600), "the hung record was never timed out (an hour of virtual time)");
        tokio::time::sleep(Duration::from_secs(10)).await;
        waited += Duration::from_secs(10);
    }
    assert!(waited >= Duration::from_secs(600), "not before two timeouts: {waited:?}");
    let dlq = read_all(&b, "FLOTILLA_t_DLQ", None).await;
    assert_eq!(dlq[0].2.get(headers::DLQ_REASON), Some("crash-loop"));
    job.stop();
    job.wait().await.expect("clean stop");
}

/// Errors are classified once (docs/errors.md): an output that can never be stored
/// (over the codec's limit, or over the broker's max_payload once its headers are
/// counted) dead-letters its message at once as `too-large`, without retries; being
/// unavailable costs no attempt up to `unavailable_retries`, then each time does.
#[actix_rt::test]
async fn outputs_too_large_dead_letter_at_once_and_unavailable_retries_have_a_ceiling() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let job = Job::new("t")
        .task(JOBS, |_| Relay::<true>)
        .max_attempts(2)
        .unavailable_retries(3)
        .start(b.clone())
        .await
        .expect("start");
    let mib = flotilla_transport::wire::codec::DEFAULT_MAX_PAYLOAD;
    // Over the codec's limit by itself.
    publish(&b, "jobs", false, 1, &format!("big:{}", 2 * mib)).await;
    // Under the codec's limit, over the broker's once the output's headers count.
    publish(&b, "jobs", false, 2, &format!("big:{}", mib - 32)).await;
    publish(&b, "jobs", false, 3, "unavailable").await;
    publish(&b, "jobs", false, 4, "ok").await;
    wait_for(&b, "FLOTILLA_t_DLQ", 3).await;
    let mut dead: Vec<(u64, String, String)> = read_all(&b, "FLOTILLA_t_DLQ", None)
        .await
        .into_iter()
        .map(|(_, r, h)| {
            (
                r.id,
                h.get(headers::DLQ_REASON).unwrap_or("").to_owned(),
                h.get(headers::DLQ_DETAIL).unwrap_or("").to_owned(),
            )
        })
        .collect();
    dead.sort();
    let reasons: Vec<(u64, &str)> = dead.iter().map(|(id, r, _)| (*id, r.as_str())).collect();
    assert_eq!(reasons, vec![(1, "too-large"), (2, "too-large"), (3, "max-attempts")], "{dead:?}");
    assert!(dead[1].2.contains("payload and headers"), "{:?}", dead[1]);
    assert!(dead[2].2.contains("still unavailable after 3 retries"), "{:?}", dead[2]);
    assert_eq!((calls(1), calls(2)), (1, 1), "too-large is not retried");
    // Each of the 2 attempts: a run and 3 free retries, then it counts as failed.
    assert_eq!(calls(3), 8);
    wait_for(&b, "FLOTILLA_t_done", 1).await;
    job.stop();
    job.wait().await.expect("clean stop");
}

/// Interrupted is not failed: a stop does not wait out a retry back-off. The message
/// waiting for its next attempt is handed back at once, the commit stops before it,
/// and the next run of the partition gets it again.
#[actix_rt::test]
async fn a_stop_hands_back_a_message_waiting_out_its_back_off_at_once() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let job = |b: &SharedBroker| {
        Job::new("t")
            .task(IN, |_| Relay::<false>)
            .retry(flotilla_actors::RetryPolicy {
                max_attempts: 3,
                initial_backoff: Duration::from_secs(600),
                jitter: 0.0,
                ..Default::default()
            })
            .drain_timeout(Duration::from_secs(300))
            .start(b.clone())
    };
    let running = job(&b).await.expect("start");
    publish(&b, "in", true, 1, "poison").await;
    for _ in 0..200 {
        if calls(1) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(calls(1), 1, "the first attempt failed and the record waits 10 minutes for its second");
    let stopping = tokio::time::Instant::now();
    running.stop();
    running.wait().await.expect("clean stop");
    let took = stopping.elapsed();
    assert!(took < Duration::from_secs(60), "the stop waited {took:?} (drain timeout 300 s, back-off 600 s)");
    let p = partition_for("1", 4);
    let c = b.consumer_state("FLOTILLA_t_in", &format!("in-p{p}")).await.expect("consumer");
    assert_eq!(c.ack_floor, 0, "nothing committed past the record handed back: {c:?}");

    let again = job(&b).await.expect("restart");
    for _ in 0..200 {
        if calls(1) == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(calls(1), 2, "the next run of the partition got it again");
    again.stop();
    again.wait().await.expect("clean stop");
}

/// A delayed message for a partition its stream does not have is dead-lettered as
/// `bad-timer`, not retried for ever (streams take only their partitions' subjects).
#[actix_rt::test]
async fn a_delayed_message_for_a_missing_partition_is_dead_lettered() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let running = Job::new("t").task(IN, |_| Relay::<false>).start(b.clone()).await.expect("start");
    let payload = codec().encode(&Record { id: 9, body: "late".into() }).expect("encode");
    b.publish(
        OutboundMessage::new("flotilla.t._timer.x", payload)
            .with_id("timer-x")
            .with_header(headers::DELAY, "0")
            .with_header(headers::TARGET, "flotilla.t.in.99"),
    )
    .await
    .expect("timer");
    wait_for(&b, "FLOTILLA_t_DLQ", 1).await;
    let dlq = read_all(&b, "FLOTILLA_t_DLQ", None).await;
    assert_eq!(dlq[0].2.get(headers::DLQ_REASON), Some("bad-timer"), "{:?}", dlq[0].2);
    assert!(dlq[0].2.get(headers::DLQ_DETAIL).is_some_and(|d| d.contains("flotilla.t.in.99")));
    running.stop();
    running.wait().await.expect("stop");
}

thread_local! {
    /// The attempt number of each run of `process`, per record id.
    static ATTEMPTS: RefCell<HashMap<u64, Vec<u32>>> = RefCell::new(HashMap::new());
    /// Whether `Slow` sleeps (for ten minutes) instead of forwarding.
    static SLOW: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
}

/// Records its attempts; sleeps ten minutes while `SLOW` is set.
struct Slow;

impl Task for Slow {
    type Input = Record;
    async fn process(&mut self, r: Record, ctx: &mut TaskContext) -> Result<(), TaskError> {
        let attempt = ctx.message().map_or(0, |m| m.attempt);
        ATTEMPTS.with(|a| a.borrow_mut().entry(r.id).or_default().push(attempt));
        if SLOW.with(|s| s.get()) {
            tokio::time::sleep(Duration::from_secs(600)).await;
        }
        ctx.send(&DONE, &r.id.to_string(), &r).await
    }
}

/// Interrupted is not failed, for queue inputs: a message handed back by a stop's
/// drain deadline (three times, with two attempts allowed) costs no attempt, and runs
/// as attempt 1 each time.
#[actix_rt::test]
async fn queue_messages_handed_back_by_a_stop_spend_no_attempt() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let job = || Job::new("t").task(JOBS, |_| Slow).max_attempts(2).drain_timeout(Duration::from_secs(1));
    job().provision(b.clone()).await.expect("provision");
    publish(&b, "jobs", false, 80, "slow").await;
    for run in 1..=3 {
        let running = job().start(b.clone()).await.expect("start");
        for _ in 0..500 {
            if ATTEMPTS.with(|a| a.borrow().get(&80).map_or(0, Vec::len)) == run {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        running.stop(); // the handler sleeps on: the drain deadline hands it back
        running.wait().await.expect("stop");
    }
    SLOW.with(|s| s.set(false));
    let running = job().start(b.clone()).await.expect("start");
    wait_for(&b, "FLOTILLA_t_done", 1).await;
    running.stop();
    running.wait().await.expect("stop");
    assert_eq!(ATTEMPTS.with(|a| a.borrow().get(&80).cloned()), Some(vec![1, 1, 1, 1]));
    assert_eq!(b.stream_state("FLOTILLA_t_DLQ").await.expect("dlq").messages, 0);
}

thread_local! {
    /// Durable timers that fired, by name, in order.
    static FIRED: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// Arms, re-arms and cancels durable timers as its records say: `arm:<name>:<secs>`,
/// `skip:<name>:<secs>:<allowance ms>`, `cancel:<name>`; a timer that fires sends
/// `fired <name>`.
struct Alarm;

impl Task for Alarm {
    type Input = Record;
    async fn process(&mut self, r: Record, ctx: &mut TaskContext) -> Result<(), TaskError> {
        let parts: Vec<&str> = r.body.split(':').collect();
        let secs = |s: &str| Duration::from_secs(s.parse().unwrap_or(0));
        match parts.as_slice() {
            ["arm", name, s] => ctx.schedule_durable(name, secs(s)),
            ["skip", name, s, ms] => ctx.schedule_durable_with(
                name,
                secs(s),
                flotilla_actors::Misfire::SkipIfLateBy(Duration::from_millis(ms.parse().unwrap_or(0))),
            ),
            ["cancel", name] => ctx.cancel_timer(name),
            _ => Err(TaskError::failed(format!("unknown command {}", r.body))),
        }
    }
    async fn timer(&mut self, name: String, ctx: &mut TaskContext) -> Result<(), TaskError> {
        FIRED.with(|f| f.borrow_mut().push(name.clone()));
        ctx.send(&OUT, "alarm", Record { id: 0, body: format!("fired {name}") }).await
    }
}

async fn publish_alarm(b: &SharedBroker, id: u64, body: &str) {
    // One key, one partition: the commands run in order.
    let payload = codec().encode(&Record { id, body: body.into() }).expect("encode");
    let subject = format!("flotilla.t.in.{}", partition_for("alarm", 4));
    let msg = OutboundMessage::new(subject, payload).with_id(format!("alarm-{id}")).with_header(headers::KEY, "alarm");
    b.publish(msg).await.expect("publish");
}

/// Durable timers: named, re-arming replaces, cancelling works, and each fires once,
/// through the partition's input, calling the `timer` hook.
#[actix_rt::test]
async fn durable_timers_fire_once_are_replaced_by_re_arming_and_can_be_cancelled() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let running = Job::new("t").task(IN, |_| Alarm).start(b.clone()).await.expect("start");
    let started = tokio::time::Instant::now();
    publish_alarm(&b, 1, "arm:a:10").await;
    publish_alarm(&b, 2, "arm:b:10").await;
    publish_alarm(&b, 3, "arm:a:20").await; // replaces a
    publish_alarm(&b, 4, "cancel:b").await;
    wait_for(&b, "FLOTILLA_t_out", 1).await;
    assert!(started.elapsed() >= Duration::from_secs(20), "a fired after {:?}, re-armed for 20 s", started.elapsed());
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(FIRED.with(|f| f.borrow().clone()), ["a"], "a once (re-armed), b never (cancelled)");
    assert_eq!(b.stream_state("FLOTILLA_t_DLQ").await.expect("dlq").messages, 0, "the tombstone is dropped quietly");
    running.stop();
    running.wait().await.expect("stop");
}

/// A durable timer that comes due while no node runs fires once when one starts, or
/// is skipped when its misfire policy says so.
#[actix_rt::test]
async fn a_durable_timer_due_while_the_job_was_down_fires_late_once_or_is_skipped() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let job = || Job::new("t").task(IN, |_| Alarm).start(b.clone());
    let running = job().await.expect("start");
    publish_alarm(&b, 1, "arm:late:5").await;
    publish_alarm(&b, 2, "skip:strict:5:1000").await;
    let p = partition_for("alarm", 4);
    for _ in 0..500 {
        let c = b.consumer_state("FLOTILLA_t_in", &format!("in-p{p}")).await.expect("consumer");
        if c.ack_floor >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    running.stop();
    running.wait().await.expect("stop");
    tokio::time::sleep(Duration::from_secs(60)).await; // both come due with no node up
    assert!(FIRED.with(|f| f.borrow().is_empty()));
    let running = job().await.expect("restart");
    wait_for(&b, "FLOTILLA_t_out", 1).await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(FIRED.with(|f| f.borrow().clone()), ["late"], "late fired once; strict was skipped");
    running.stop();
    running.wait().await.expect("stop");
}
