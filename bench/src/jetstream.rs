//! The JetStream pairs: the same work done by a plain async-nats loop and by a Flotilla
//! job, on the same server, one right after the other.
//!
//! Every raw stream and consumer below is created with plain async-nats calls whose
//! settings are written out next to the Flotilla default they mirror, so a reader can
//! check the comparison is fair: file storage, one replica, the same retention, ack
//! policy, ack-wait, max deliveries, max ack-pending, max waiting, batch size and
//! publish window.

use crate::cpu::{Cpu, Measured};
use crate::report::{Pair, median, percentile, rate};
use crate::workload::{Blob, SENT_US, payload, prefill, raw_context, unix_us, wait_acked, wait_stored};
use anyhow::{Context as _, bail};
use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::stream::{Config as StreamConfig, RetentionPolicy, StorageType};
use async_nats::jetstream::{self, Context};
use bytes::Bytes;
use flotilla::prelude::*;
use futures::StreamExt;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::oneshot;

/// Settings shared by both sides of every JetStream pair.
#[derive(Debug, Clone)]
pub struct Settings {
    pub url: String,
    pub count: u64,
    pub size: usize,
    pub rounds: usize,
    pub partitions: u32,
    /// Queue claims / raw fetch batch, and the queue task's `max_concurrency`.
    pub batch: usize,
    /// Publish acks outstanding (Flotilla's JetStream default is 4096).
    pub window: usize,
    /// Outputs per trigger message in the publish pair.
    pub fanout: u64,
    pub latency_rate: u64,
    pub latency_secs: u64,
    /// The nats-server's pid, to read its CPU time.
    pub server_pid: Option<u32>,
    /// The state pair's distinct keys (0: every message its own key).
    pub state_keys: u64,
}

// Flotilla's defaults that the raw side copies (see `flotilla_actors::TaskConfig` and
// `flotilla_transport::topology`).
const ACK_WAIT: Duration = Duration::from_secs(30);
/// `RetryPolicy::default().max_attempts` (3) + 1: the queue consumer's backstop.
const QUEUE_MAX_DELIVER: i64 = 4;
const QUEUE_MAX_ACK_PENDING: i64 = 10_000;
/// `TaskConfig::default().window`: an ordered partition's uncommitted messages at most.
const PARTITION_WINDOW: i64 = 256;
const MAX_WAITING: i64 = 512;
/// How long one claim / fetch waits for its first message (the container's default).
const CLAIM_WAIT: Duration = Duration::from_secs(1);
const DONE_WITHIN: Duration = Duration::from_secs(120);

fn stream_config(name: String, subjects: Vec<String>, retention: RetentionPolicy) -> StreamConfig {
    StreamConfig {
        name,
        subjects,
        retention,
        storage: StorageType::File,
        num_replicas: 1,
        duplicate_window: Duration::from_secs(120),
        allow_direct: true,
        ..Default::default()
    }
}

async fn raw_queue_stream(js: &Context, job: &str, stream: &str) -> anyhow::Result<PullConsumer> {
    let s = js
        .create_stream(stream_config(
            format!("FLOTILLA_{job}_{stream}"),
            vec![format!("flotilla.{job}.{stream}")],
            RetentionPolicy::WorkQueue,
        ))
        .await?;
    let consumer = s
        .create_consumer(pull::Config {
            durable_name: Some(format!("{stream}-workers")),
            ack_policy: AckPolicy::Explicit,
            deliver_policy: DeliverPolicy::All,
            ack_wait: ACK_WAIT,
            max_deliver: QUEUE_MAX_DELIVER,
            max_ack_pending: QUEUE_MAX_ACK_PENDING,
            max_waiting: MAX_WAITING,
            ..Default::default()
        })
        .await?;
    Ok(consumer)
}

async fn raw_ordered_stream(
    js: &Context,
    job: &str,
    stream: &str,
    partitions: u32,
) -> anyhow::Result<Vec<PullConsumer>> {
    let s = js
        .create_stream(stream_config(
            format!("FLOTILLA_{job}_{stream}"),
            vec![format!("flotilla.{job}.{stream}.*")],
            RetentionPolicy::Limits,
        ))
        .await?;
    let mut consumers = Vec::new();
    for p in 0..partitions {
        consumers.push(
            s.create_consumer(pull::Config {
                durable_name: Some(format!("{stream}-p{p}")),
                filter_subject: format!("flotilla.{job}.{stream}.{p}"),
                ack_policy: AckPolicy::All,
                deliver_policy: DeliverPolicy::All,
                ack_wait: ACK_WAIT,
                max_deliver: -1,
                max_ack_pending: PARTITION_WINDOW,
                max_waiting: MAX_WAITING,
                ..Default::default()
            })
            .await?,
        );
    }
    Ok(consumers)
}

/// The raw queue loop: fetch a batch, ack every message, repeat.
async fn raw_queue_round(s: &Settings, job: &str, body: &Bytes) -> anyhow::Result<Measured> {
    let (client, js) = raw_context(&s.url, s.window).await?;
    let consumer = raw_queue_stream(&js, job, "in").await?;
    prefill(&js, job, "in", None, s.count, body).await?;
    let started = Instant::now();
    let cpu = Cpu::start(s.server_pid);
    let mut got = 0;
    while got < s.count {
        let mut batch = consumer.fetch().max_messages(s.batch).expires(CLAIM_WAIT).messages().await?;
        while let Some(msg) = batch.next().await {
            let msg = msg.map_err(|e| anyhow::anyhow!("fetch: {e}"))?;
            msg.ack().await.map_err(|e| anyhow::anyhow!("ack: {e}"))?;
            got += 1;
        }
    }
    client.flush().await?;
    wait_acked(&js, &format!("FLOTILLA_{job}_in"), &["in-workers".into()], DONE_WITHIN).await?;
    let r = Measured::new(s.count, started.elapsed(), &cpu);
    js.delete_stream(format!("FLOTILLA_{job}_in")).await?;
    Ok(r)
}

/// The raw ordered loop: per partition, fetch up to the window, then ack the last
/// message (ack-all); all partitions concurrently on this one thread.
async fn raw_ordered_round(s: &Settings, job: &str, body: &Bytes) -> anyhow::Result<Measured> {
    let (client, js) = raw_context(&s.url, s.window).await?;
    let consumers = raw_ordered_stream(&js, job, "in", s.partitions).await?;
    let per_partition = prefill(&js, job, "in", Some(s.partitions), s.count, body).await?;
    let started = Instant::now();
    let cpu = Cpu::start(s.server_pid);
    let loops = consumers.iter().zip(per_partition).map(|(c, n)| async move {
        let mut got = 0;
        while got < n {
            let mut batch = c.fetch().max_messages(PARTITION_WINDOW as usize).expires(CLAIM_WAIT).messages().await?;
            let mut last = None;
            while let Some(msg) = batch.next().await {
                last = Some(msg.map_err(|e| anyhow::anyhow!("fetch: {e}"))?);
                got += 1;
            }
            if let Some(msg) = last {
                msg.ack().await.map_err(|e| anyhow::anyhow!("ack: {e}"))?;
            }
        }
        anyhow::Ok(())
    });
    for r in futures::future::join_all(loops).await {
        r?;
    }
    client.flush().await?;
    let names: Vec<String> = (0..s.partitions).map(|p| format!("in-p{p}")).collect();
    wait_acked(&js, &format!("FLOTILLA_{job}_in"), &names, DONE_WITHIN).await?;
    let r = Measured::new(s.count, started.elapsed(), &cpu);
    js.delete_stream(format!("FLOTILLA_{job}_in")).await?;
    Ok(r)
}

/// Which headers the raw publisher sends.
#[derive(Clone, Copy)]
enum RawHeaders {
    /// An id and a key, what a plain producer sends.
    Plain,
    /// The six headers a Flotilla output carries (wire format §3), with values of the
    /// same length: this separates the cost of the wire format from the runtime's.
    AsFlotilla,
}

/// Raw pipelined publish: `count` messages, `window` acks outstanding at most.
async fn raw_publish_round(s: &Settings, job: &str, body: &Bytes, headers: RawHeaders) -> anyhow::Result<Measured> {
    let (_client, js) = raw_context(&s.url, s.window).await?;
    js.create_stream(stream_config(
        format!("FLOTILLA_{job}_out"),
        vec![format!("flotilla.{job}.out")],
        RetentionPolicy::WorkQueue,
    ))
    .await?;
    let n = s.count / s.fanout.max(1) * s.fanout.max(1);
    let subject = format!("flotilla.{job}.out");
    let started = Instant::now();
    let cpu = Cpu::start(s.server_pid);
    // At most `window` acks outstanding: await the oldest before queueing past it
    // (async-nats frees a publish permit only once its ack future is polled).
    let mut acks = std::collections::VecDeque::with_capacity(s.window);
    for i in 0..n {
        if acks.len() >= s.window
            && let Some(oldest) = acks.pop_front()
        {
            let oldest: jetstream::context::PublishAckFuture = oldest;
            oldest.await?;
        }
        let mut h = HeaderMap::new();
        match headers {
            RawHeaders::Plain => {
                h.insert("Nats-Msg-Id", format!("{job}-{i}").as_str());
                h.insert("Flotilla-Key", i.to_string().as_str());
            }
            RawHeaders::AsFlotilla => {
                // A UUID-long id and cause, as Flotilla's derived ids are.
                h.insert("Nats-Msg-Id", format!("00000000-0000-5000-8000-{i:012}").as_str());
                h.insert("Flotilla-Key", i.to_string().as_str());
                h.insert("Flotilla-Type", "Blob");
                h.insert(
                    "Flotilla-Sent",
                    flotilla::transport::clock::unix_millis(SystemTime::now()).to_string().as_str(),
                );
                h.insert("Flotilla-Epoch", "0");
                h.insert("Flotilla-Cause", format!("00000000-0000-7000-8000-{:012}", i / s.fanout.max(1)).as_str());
            }
        }
        acks.push_back(js.publish_with_headers(subject.clone(), h, body.clone()).await?);
    }
    for a in acks {
        a.await?;
    }
    let r = Measured::new(n, started.elapsed(), &cpu);
    js.delete_stream(format!("FLOTILLA_{job}_out")).await?;
    Ok(r)
}

/// Counts processed messages and says when `target` is reached; optionally records
/// publish→handler latency.
#[derive(Clone)]
struct Progress {
    seen: Rc<Cell<u64>>,
    target: u64,
    done: Rc<RefCell<Option<oneshot::Sender<()>>>>,
    latency_us: Option<Rc<RefCell<Vec<u64>>>>,
}

impl Progress {
    fn new(target: u64, latency: bool) -> (Self, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        let p = Self {
            seen: Rc::default(),
            target,
            done: Rc::new(RefCell::new(Some(tx))),
            latency_us: latency.then(Rc::default),
        };
        (p, rx)
    }

    fn tick(&self) {
        let n = self.seen.get() + 1;
        self.seen.set(n);
        if n >= self.target
            && let Some(tx) = self.done.borrow_mut().take()
        {
            let _ = tx.send(());
        }
    }
}

/// The no-op task: decodes the message (Flotilla does that before `process`), counts it.
struct Noop(Progress);

impl Task for Noop {
    type Input = Blob;
    async fn process(&mut self, _blob: Blob, ctx: &mut TaskContext) -> Result<(), TaskError> {
        if let Some(lat) = &self.0.latency_us
            && let Some(sent) = ctx.message().and_then(|m| m.headers.get(SENT_US)).and_then(|v| v.parse::<u64>().ok())
        {
            lat.borrow_mut().push(unix_us().saturating_sub(sent));
        }
        self.0.tick();
        Ok(())
    }
}

/// The state pair's store: a count per message key.
const PER_KEY: StoreDef<String, u64> = StoreDef::new("per-key");

/// Updates one key per message: the message's own key (every message writes one
/// changelog record at the next commit), or with `keys > 0` that key modulo `keys`
/// (changes of one key between commits make one record).
struct CountPerKey(Progress, u64);

impl Task for CountPerKey {
    type Input = Blob;
    async fn process(&mut self, _blob: Blob, ctx: &mut TaskContext) -> Result<(), TaskError> {
        let mut key = ctx.message().and_then(|m| m.key.clone()).unwrap_or_default();
        if self.1 > 0 {
            key = (key.parse::<u64>().unwrap_or(0) % self.1).to_string();
        }
        ctx.store(&PER_KEY)?.update(key, |n| Some(n.unwrap_or(0) + 1))?;
        self.0.tick();
        Ok(())
    }
}

const IN_QUEUE: StreamDef<Blob> = StreamDef::queue("in");
const OUT_QUEUE: StreamDef<Blob> = StreamDef::queue("out");
const TRIGGERS: StreamDef<u64> = StreamDef::queue("triggers");

/// A task that sends `fanout` outputs per trigger through `ctx.send`.
struct Fanout {
    fanout: u64,
    body: Blob,
}

impl Task for Fanout {
    type Input = u64;
    async fn process(&mut self, trigger: u64, ctx: &mut TaskContext) -> Result<(), TaskError> {
        for i in 0..self.fanout {
            ctx.send(&OUT_QUEUE, &(trigger * self.fanout + i).to_string(), &self.body).await?;
        }
        Ok(())
    }
}

async fn flotilla_broker(url: &str) -> anyhow::Result<SharedBroker> {
    Ok(connect(&BrokerChoice::Nats(url.to_owned()), "bench-flotilla").await?)
}

async fn finish(running: flotilla::actors::RunningJob) -> anyhow::Result<()> {
    running.stop();
    tokio::time::timeout(Duration::from_secs(60), running.wait()).await.context("job did not stop")??;
    Ok(())
}

async fn flotilla_queue_round(s: &Settings, job: &str, body: &Bytes) -> anyhow::Result<Measured> {
    let broker = flotilla_broker(&s.url).await?;
    let (_client, js) = raw_context(&s.url, s.window).await?;
    let (progress, done) = Progress::new(s.count, false);
    let p = progress.clone();
    let job_def = Job::new(job).task(IN_QUEUE, move |_| Noop(p.clone())).max_concurrency(s.batch);
    job_def.provision(broker.clone()).await?;
    prefill(&js, job, "in", None, s.count, body).await?;
    let running = job_def.start(broker).await?;
    let started = Instant::now();
    let cpu = Cpu::start(s.server_pid);
    tokio::time::timeout(DONE_WITHIN, done).await.context("flotilla queue round did not finish")??;
    wait_acked(&js, &format!("FLOTILLA_{job}_in"), &["in-workers".into()], DONE_WITHIN).await?;
    let r = Measured::new(s.count, started.elapsed(), &cpu);
    finish(running).await?;
    delete_job_streams(&js, job).await;
    Ok(r)
}

async fn flotilla_ordered_round(s: &Settings, job: &str, body: &Bytes) -> anyhow::Result<Measured> {
    ordered_round(s, job, body, false).await
}

async fn flotilla_state_round(s: &Settings, job: &str, body: &Bytes) -> anyhow::Result<Measured> {
    ordered_round(s, job, body, true).await
}

/// A round of the ordered input: the no-op task, or with `stored` the task updating a
/// key of its store per message.
async fn ordered_round(s: &Settings, job: &str, body: &Bytes, stored: bool) -> anyhow::Result<Measured> {
    let broker = flotilla_broker(&s.url).await?;
    let (_client, js) = raw_context(&s.url, s.window).await?;
    let (progress, done) = Progress::new(s.count, false);
    let p = progress.clone();
    let input = StreamDef::<Blob>::ordered("in", s.partitions);
    let job_def = if stored {
        let keys = s.state_keys;
        Job::new(job).task(input, move |_| CountPerKey(p.clone(), keys)).store(PER_KEY)
    } else {
        Job::new(job).task(input, move |_| Noop(p.clone()))
    };
    job_def.provision(broker.clone()).await?;
    prefill(&js, job, "in", Some(s.partitions), s.count, body).await?;
    let running = job_def.start(broker).await?;
    let started = Instant::now();
    let cpu = Cpu::start(s.server_pid);
    tokio::time::timeout(DONE_WITHIN, done).await.context("flotilla ordered round did not finish")??;
    let names: Vec<String> = (0..s.partitions).map(|p| format!("in-p{p}")).collect();
    wait_acked(&js, &format!("FLOTILLA_{job}_in"), &names, DONE_WITHIN).await?;
    let r = Measured::new(s.count, started.elapsed(), &cpu);
    finish(running).await?;
    delete_job_streams(&js, job).await;
    Ok(r)
}

async fn flotilla_publish_round(s: &Settings, job: &str, body: &Bytes) -> anyhow::Result<Measured> {
    let broker = flotilla_broker(&s.url).await?;
    let (_client, js) = raw_context(&s.url, s.window).await?;
    let fanout = s.fanout.max(1);
    let triggers = (s.count / fanout).max(1);
    let blob: Blob = Codec::default().decode(body)?;
    let job_def = Job::new(job)
        .task(TRIGGERS, move |_| Fanout { fanout, body: blob.clone() })
        .max_concurrency(8)
        .output(OUT_QUEUE);
    job_def.provision(broker.clone()).await?;
    let codec = Codec::default();
    for t in 0..triggers {
        let mut h = HeaderMap::new();
        h.insert("Nats-Msg-Id", format!("{job}-t{t}").as_str());
        js.publish_with_headers(format!("flotilla.{job}.triggers"), h, codec.encode(&t)?).await?.await?;
    }
    let running = job_def.start(broker).await?;
    let started = Instant::now();
    let cpu = Cpu::start(s.server_pid);
    wait_stored(&js, &format!("FLOTILLA_{job}_out"), triggers * fanout, DONE_WITHIN).await?;
    let r = Measured::new(triggers * fanout, started.elapsed(), &cpu);
    finish(running).await?;
    delete_job_streams(&js, job).await;
    Ok(r)
}

async fn delete_job_streams(js: &Context, job: &str) {
    let prefix = format!("FLOTILLA_{job}_");
    let kv_prefix = format!("KV_FLOTILLA_{job}_");
    let names: Vec<String> = js.stream_names().filter_map(|n| async move { n.ok() }).collect().await;
    for n in names.into_iter().filter(|n| n.starts_with(&prefix) || n.starts_with(&kv_prefix)) {
        let _ = js.delete_stream(n).await;
    }
}

/// Publishes `rate` messages/s for `secs` seconds from its own thread and connection,
/// each stamped with its publish time.
fn offered_load(
    url: String,
    subject: String,
    rate: u64,
    secs: u64,
    body: Bytes,
) -> std::thread::JoinHandle<anyhow::Result<u64>> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(async move {
            let (_client, js) = raw_context(&url, 4096).await?;
            let per_tick = (rate / 1000).max(1);
            let ticks = secs * 1000;
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<jetstream::context::PublishAckFuture>();
            let acker = tokio::spawn(async move {
                while let Some(ack) = rx.recv().await {
                    ack.await?;
                }
                anyhow::Ok(())
            });
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            let mut sent = 0u64;
            for _ in 0..ticks {
                tick.tick().await;
                for _ in 0..per_tick {
                    let mut h = HeaderMap::new();
                    h.insert("Nats-Msg-Id", format!("lat-{sent}").as_str());
                    h.insert(SENT_US, unix_us().to_string().as_str());
                    let _ = tx.send(js.publish_with_headers(subject.clone(), h, body.clone()).await?);
                    sent += 1;
                }
            }
            drop(tx);
            acker.await??;
            Ok(sent)
        })
    })
}

fn expected_offered(s: &Settings) -> u64 {
    (s.latency_rate / 1000).max(1) * s.latency_secs * 1000
}

async fn raw_latency_round(s: &Settings, job: &str, body: &Bytes) -> anyhow::Result<(f64, Vec<u64>)> {
    let (client, js) = raw_context(&s.url, s.window).await?;
    let consumer = raw_queue_stream(&js, job, "in").await?;
    let n = expected_offered(s);
    let load = offered_load(s.url.clone(), format!("flotilla.{job}.in"), s.latency_rate, s.latency_secs, body.clone());
    let started = Instant::now();
    let mut samples = Vec::with_capacity(n as usize);
    while (samples.len() as u64) < n {
        let mut batch = consumer.fetch().max_messages(s.batch).expires(CLAIM_WAIT).messages().await?;
        while let Some(msg) = batch.next().await {
            let msg = msg.map_err(|e| anyhow::anyhow!("fetch: {e}"))?;
            if let Some(sent) =
                msg.headers.as_ref().and_then(|h| h.get(SENT_US)).and_then(|v| v.as_str().parse::<u64>().ok())
            {
                samples.push(unix_us().saturating_sub(sent));
            }
            msg.ack().await.map_err(|e| anyhow::anyhow!("ack: {e}"))?;
        }
        if started.elapsed() > DONE_WITHIN {
            bail!("raw latency round received {} of {n}", samples.len());
        }
    }
    let r = rate(n, started.elapsed());
    load.join().map_err(|_| anyhow::anyhow!("publisher thread panicked"))??;
    client.flush().await?;
    js.delete_stream(format!("FLOTILLA_{job}_in")).await?;
    Ok((r, samples))
}

async fn flotilla_latency_round(s: &Settings, job: &str, body: &Bytes) -> anyhow::Result<(f64, Vec<u64>)> {
    let broker = flotilla_broker(&s.url).await?;
    let (_client, js) = raw_context(&s.url, s.window).await?;
    let n = expected_offered(s);
    let (progress, done) = Progress::new(n, true);
    let p = progress.clone();
    let job_def = Job::new(job).task(IN_QUEUE, move |_| Noop(p.clone())).max_concurrency(s.batch);
    let running = job_def.start(broker).await?;
    // Let the container's first (empty) claim start before the load does.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let load = offered_load(s.url.clone(), format!("flotilla.{job}.in"), s.latency_rate, s.latency_secs, body.clone());
    let started = Instant::now();
    tokio::time::timeout(DONE_WITHIN, done).await.context("flotilla latency round did not finish")??;
    let r = rate(n, started.elapsed());
    load.join().map_err(|_| anyhow::anyhow!("publisher thread panicked"))??;
    finish(running).await?;
    delete_job_streams(&js, job).await;
    let samples = progress.latency_us.map(|l| l.take()).unwrap_or_default();
    Ok((r, samples))
}

/// Runs the JetStream pairs, interleaved round by round.
pub async fn run(s: &Settings, only: &dyn Fn(&str) -> bool) -> anyhow::Result<Vec<Pair>> {
    let body = payload(s.size)?;
    let mut pairs = Vec::new();
    let label = format!("{} × {} B", s.count, s.size);
    if only("queue") {
        let mut p = Pair::new(
            &format!("queue, no-op task ({label})"),
            &format!("fetch batch {} + ack each, WorkQueue, explicit ack", s.batch),
            ">= 0.8x",
        );
        for round in 0..s.rounds {
            let raw = raw_queue_round(s, &format!("rq{round}"), &body).await?;
            let flotilla = flotilla_queue_round(s, &format!("fq{round}"), &body).await?;
            p.push(raw, flotilla);
            progress_line(&p, round);
        }
        pairs.push(p);
    }
    if only("ordered") {
        let mut p = Pair::new(
            &format!("ordered, no-op task, {} partitions", s.partitions),
            &format!("per partition: fetch {PARTITION_WINDOW} + ack-all the last, Limits, AckAll"),
            ">= 0.8x",
        );
        for round in 0..s.rounds {
            let raw = raw_ordered_round(s, &format!("ro{round}"), &body).await?;
            let flotilla = flotilla_ordered_round(s, &format!("fo{round}"), &body).await?;
            p.push(raw, flotilla);
            progress_line(&p, round);
        }
        pairs.push(p);
    }
    if only("state") {
        let mut p = Pair::new(
            &match s.state_keys {
                0 => format!("state: one key per message in a store, {} partitions", s.partitions),
                k => format!("state: one of {k} keys per message in a store, {} partitions", s.partitions),
            },
            "the same Flotilla ordered no-op task, without a store",
            "none set: the cost of durable state",
        );
        for round in 0..s.rounds {
            let noop = flotilla_ordered_round(s, &format!("sn{round}"), &body).await?;
            let state = flotilla_state_round(s, &format!("ss{round}"), &body).await?;
            p.push(noop, state);
            progress_line(&p, round);
        }
        pairs.push(p);
    }
    if only("publish") {
        let mut p = Pair::new(
            &format!("publish via ctx.send ({} per input)", s.fanout),
            &format!("pipelined publish, {} acks outstanding", s.window),
            ">= 0.8x",
        );
        let mut same_headers = Pair::new(
            &format!("publish via ctx.send ({} per input), raw with Flotilla's 6 headers", s.fanout),
            &format!("pipelined publish, {} acks outstanding, the headers of a Flotilla output", s.window),
            "none: it shows the wire format's share of the gap",
        );
        for round in 0..s.rounds {
            let raw = raw_publish_round(s, &format!("rp{round}"), &body, RawHeaders::Plain).await?;
            let raw_same = raw_publish_round(s, &format!("rh{round}"), &body, RawHeaders::AsFlotilla).await?;
            let flotilla = flotilla_publish_round(s, &format!("fp{round}"), &body).await?;
            p.push(raw, flotilla);
            same_headers.push(raw_same, flotilla);
            progress_line(&p, round);
            progress_line(&same_headers, round);
        }
        pairs.push(p);
        pairs.push(same_headers);
    }
    if only("metrics") {
        crate::metrics_pair::install()?;
        for (kind, ordered) in [("queue", false), ("ordered", true)] {
            let mut p = Pair::new(
                &format!("{kind}, no-op task, with the Prometheus exporter scraped every second"),
                &format!("the same Flotilla {kind} round without a recorder (a node without --http)"),
                ">= 0.95x",
            );
            for round in 0..s.rounds {
                let (off, on) = if ordered {
                    let off = flotilla_ordered_round(s, &format!("mo{round}"), &body).await?;
                    let exporting = crate::metrics_pair::Exporting::start();
                    let on = flotilla_ordered_round(s, &format!("me{round}"), &body).await?;
                    exporting.stop();
                    (off, on)
                } else {
                    let off = flotilla_queue_round(s, &format!("mq{round}"), &body).await?;
                    let exporting = crate::metrics_pair::Exporting::start();
                    let on = flotilla_queue_round(s, &format!("mx{round}"), &body).await?;
                    exporting.stop();
                    (off, on)
                };
                p.push(off, on);
                progress_line(&p, round);
            }
            pairs.push(p);
        }
    }
    if only("latency") {
        let mut p = Pair::new(
            &format!("latency at {} msgs/s offered", s.latency_rate),
            "fetch + ack loop on the same queue stream; publisher on its own thread",
            "p99 <= raw p99 + 1 ms",
        );
        for round in 0..s.rounds {
            let (r, mut raw) = raw_latency_round(s, &format!("rl{round}"), &body).await?;
            let (f, mut flo) = flotilla_latency_round(s, &format!("fl{round}"), &body).await?;
            p.raw.push(r);
            p.flotilla.push(f);
            p.raw_p99_us.push(percentile(&mut raw, 0.99));
            p.flotilla_p99_us.push(percentile(&mut flo, 0.99));
            p.raw_latency_us.extend(raw);
            p.flotilla_latency_us.extend(flo);
            eprintln!(
                "  {} round {}: p99 raw {} µs, flotilla {} µs",
                p.name,
                round + 1,
                p.raw_p99_us[round],
                p.flotilla_p99_us[round]
            );
        }
        pairs.push(p);
    }
    Ok(pairs)
}

pub fn progress_line(p: &Pair, round: usize) {
    eprintln!(
        "  {} round {}: raw {:.0}/s, flotilla {:.0}/s (ratio so far {:.2})",
        p.name,
        round + 1,
        p.raw[round],
        p.flotilla[round],
        median(&p.raw.iter().zip(&p.flotilla).map(|(r, f)| f / r).collect::<Vec<_>>())
    );
}
