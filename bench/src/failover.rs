//! Failover: real node processes (this binary's `node` subcommand, a relay from the
//! ordered stream `in` to `out`, 8 partitions) on a real nats-server, under a steady
//! publish load.
//!
//! * crash: `kill -9` one of 3 nodes; for each partition it held, the time from the
//!   kill to the first output of that partition under a newer lease epoch;
//! * join: a 4th node joins; how many partitions changed owner;
//! * graceful stop: SIGTERM one node (it leaves: hands over, commits, releases); time
//!   to the next owner's first output, and how many records any node saw redelivered.

use crate::workload::{Blob, payload};
use anyhow::{Context as _, bail};
use async_nats::HeaderMap;
use flotilla::actors::cluster::LeaseRecord;
use flotilla::prelude::*;
use flotilla::transport::wire::{headers, partition_for};
use flotilla_tests::{NatsServer, ProcessGuard};
use futures::StreamExt;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const PARTITIONS: u32 = 8;
const IN: StreamDef<Blob> = StreamDef::ordered("in", PARTITIONS);
const OUT: StreamDef<Blob> = StreamDef::ordered("out", PARTITIONS);

/// The job every bench node runs.
pub fn relay_job(job: &str, counts: Rc<NodeCounts>) -> Job {
    Job::new(job).task(IN, move |_| Relay { counts: counts.clone() }).output(OUT)
}

use std::cell::Cell;
use std::rc::Rc;

#[derive(Default)]
pub struct NodeCounts {
    pub forwarded: Cell<u64>,
    pub redelivered: Cell<u64>,
}

struct Relay {
    counts: Rc<NodeCounts>,
}

impl Task for Relay {
    type Input = Blob;
    async fn process(&mut self, blob: Blob, ctx: &mut TaskContext) -> Result<(), TaskError> {
        let key = ctx.message().and_then(|m| m.key.clone()).unwrap_or_default();
        if ctx.message().is_some_and(|m| m.delivered > 1) {
            self.counts.redelivered.set(self.counts.redelivered.get() + 1);
        }
        ctx.send(&OUT, &key, &blob).await?;
        self.counts.forwarded.set(self.counts.forwarded.get() + 1);
        Ok(())
    }
}

/// What the scenarios measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Failover {
    pub lease_ttl_ms: u64,
    /// Per moved partition: kill → first output under the new epoch (ms).
    pub crash_ms: BTreeMap<u32, u64>,
    pub crash_lost: u64,
    pub join_moved: usize,
    pub join_expected: usize,
    pub stop_ms: BTreeMap<u32, u64>,
    pub stop_redelivered: u64,
    pub stop_lost: u64,
    pub published: u64,
}

struct Cluster {
    exe: PathBuf,
    url: String,
    job: String,
    dir: PathBuf,
    ttl: Duration,
    nodes: BTreeMap<String, ProcessGuard>,
}

impl Cluster {
    fn add(&mut self, id: &str) -> anyhow::Result<()> {
        let log = std::fs::File::create(self.dir.join(format!("{id}.log")))?;
        let mut cmd = if Path::new("/usr/bin/setpriv").is_file() {
            let mut c = Command::new("/usr/bin/setpriv");
            c.args(["--pdeathsig", "KILL", "--"]).arg(&self.exe);
            c
        } else {
            Command::new(&self.exe)
        };
        cmd.args(["node", "--job", &self.job, "--nats", &self.url, "--node-id", id])
            .arg("--lease-ttl")
            .arg(format!("{}ms", self.ttl.as_millis()))
            .env("FLOTILLA_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        self.nodes.insert(id.to_owned(), ProcessGuard::spawn(format!("bench node {id}"), &mut cmd));
        Ok(())
    }

    fn log(&self, id: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{id}.log"))).unwrap_or_default()
    }

    /// Waits for node `id` to exit; returns the redelivered count it printed.
    fn stopped(&mut self, id: &str, within: Duration) -> anyhow::Result<u64> {
        let guard = self.nodes.get_mut(id).context("unknown node")?;
        let status = guard.wait_timeout(within).with_context(|| format!("node {id} did not exit in {within:?}"))?;
        if !status.success() {
            bail!("node {id} exited with {status}: {}", self.log(id));
        }
        let text = self.log(id);
        let line = text
            .lines()
            .find(|l| l.starts_with("bench node"))
            .with_context(|| format!("node {id} printed no summary: {text}"))?;
        let redelivered = line
            .split("redelivered ")
            .nth(1)
            .and_then(|n| n.trim().parse().ok())
            .with_context(|| format!("no redelivered count in {line:?}"))?;
        Ok(redelivered)
    }
}

/// The LEASES bucket, once the first node has created it.
async fn leases(js: &async_nats::jetstream::Context, job: &str) -> anyhow::Result<async_nats::jetstream::kv::Store> {
    let started = Instant::now();
    loop {
        match js.get_key_value(format!("FLOTILLA_{job}_LEASES")).await {
            Ok(kv) => return Ok(kv),
            Err(e) if started.elapsed() > Duration::from_secs(30) => bail!("no LEASES bucket after 30 s: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

async fn owners(kv: &async_nats::jetstream::kv::Store) -> BTreeMap<u32, (String, u64)> {
    let mut out = BTreeMap::new();
    for p in 0..PARTITIONS {
        if let Ok(Some(v)) = kv.get(format!("in.{p}")).await
            && let Ok(rec) = serde_json::from_slice::<LeaseRecord>(&v)
        {
            out.insert(p, (rec.node, rec.epoch));
        }
    }
    out
}

/// Waits until `nodes` hold every partition fairly, unchanged for two seconds.
async fn balanced(
    kv: &async_nats::jetstream::kv::Store,
    nodes: &[&str],
    within: Duration,
) -> anyhow::Result<BTreeMap<u32, (String, u64)>> {
    let started = Instant::now();
    let (mut last, mut since) = (BTreeMap::new(), Instant::now());
    loop {
        let now = owners(kv).await;
        let names: BTreeMap<u32, &str> = now.iter().map(|(p, (n, _))| (*p, n.as_str())).collect();
        let lo = PARTITIONS as usize / nodes.len();
        let hi = lo + usize::from(!(PARTITIONS as usize).is_multiple_of(nodes.len()));
        let fair = names.len() == PARTITIONS as usize
            && nodes.iter().all(|n| (lo..=hi).contains(&names.values().filter(|o| *o == n).count()));
        if names.values().map(|s| s.to_string()).collect::<Vec<_>>() != last.values().cloned().collect::<Vec<String>>()
        {
            last = names.iter().map(|(p, n)| (*p, n.to_string())).collect();
            since = Instant::now();
        }
        if fair && since.elapsed() >= Duration::from_secs(2) {
            return Ok(now);
        }
        if started.elapsed() > within {
            bail!("partitions not shared fairly by {nodes:?} within {within:?}: {now:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Outputs seen on `out`: (partition, epoch, when).
type Seen = Arc<Mutex<Vec<(u32, u64, Instant)>>>;

async fn watch_outputs(client: &async_nats::Client, job: &str) -> anyhow::Result<Seen> {
    let mut sub = client.subscribe(format!("flotilla.{job}.out.*")).await?;
    let seen: Seen = Arc::default();
    let s = seen.clone();
    tokio::task::spawn_local(async move {
        while let Some(msg) = sub.next().await {
            let p = msg.subject.rsplit('.').next().and_then(|p| p.parse().ok()).unwrap_or(u32::MAX);
            let epoch = msg.headers.as_ref().and_then(|h| h.get(headers::EPOCH)).and_then(|v| v.as_str().parse().ok());
            if let (Ok(mut v), Some(epoch)) = (s.lock(), epoch) {
                v.push((p, epoch, Instant::now()));
            }
        }
    });
    Ok(seen)
}

/// For each of `moved` (partition → epoch before), the time from `t0` to its first
/// output under a newer epoch, waiting up to `within`.
async fn first_new_outputs(
    seen: &Seen,
    moved: &BTreeMap<u32, u64>,
    t0: Instant,
    within: Duration,
) -> anyhow::Result<BTreeMap<u32, u64>> {
    loop {
        let mut out = BTreeMap::new();
        if let Ok(v) = seen.lock() {
            for (p, old) in moved {
                if let Some((_, _, at)) = v.iter().find(|(q, e, at)| q == p && e > old && *at >= t0) {
                    out.insert(*p, at.duration_since(t0).as_millis() as u64);
                }
            }
        }
        if out.len() == moved.len() {
            return Ok(out);
        }
        if t0.elapsed() > within {
            bail!("partitions {moved:?} produced under a new epoch only for {out:?} within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Publishes `rate` records/s into `in` until stopped; returns how many.
fn load(
    url: String,
    job: String,
    rate: u64,
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
) -> std::thread::JoinHandle<anyhow::Result<()>> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(async move {
            let (_c, js) = crate::workload::raw_context(&url, 4096).await?;
            let body = payload(128)?;
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            let per_tick = (rate / 100).max(1);
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let mut acks = Vec::new();
                for _ in 0..per_tick {
                    let key = i.to_string();
                    let mut h = HeaderMap::new();
                    h.insert(headers::KEY, key.as_str());
                    h.insert("Nats-Msg-Id", format!("{job}-{i}").as_str());
                    let subject = format!("flotilla.{job}.in.{}", partition_for(&key, PARTITIONS));
                    acks.push(js.publish_with_headers(subject, h, body.clone()).await?);
                    i += 1;
                }
                for a in acks {
                    // A publish that fails is retried by nobody: count only what is stored.
                    if a.await.is_ok() {
                        sent.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            anyhow::Ok(())
        })
    })
}

async fn stored(js: &async_nats::jetstream::Context, stream: &str) -> u64 {
    match js.get_stream(stream).await {
        Ok(mut s) => s.info().await.map(|i| i.state.messages).unwrap_or(0),
        Err(_) => 0,
    }
}

/// Waits until `out` holds as many records as were published (outputs have ids derived
/// from their inputs', so repeats are deduplicated): returns how many are missing.
async fn missing(js: &async_nats::jetstream::Context, job: &str, published: u64, within: Duration) -> u64 {
    let started = Instant::now();
    loop {
        let have = stored(js, &format!("FLOTILLA_{job}_out")).await;
        if have >= published || started.elapsed() > within {
            return published.saturating_sub(have);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What every scenario shares: the server, this binary, the clients.
struct Env {
    exe: PathBuf,
    url: String,
    dir: PathBuf,
    ttl: Duration,
    rate: u64,
    broker: SharedBroker,
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
}

/// A running scenario: nodes a, b and c of `job` under load, outputs watched.
struct Scenario {
    c: Cluster,
    kv: async_nats::jetstream::kv::Store,
    seen: Seen,
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    publisher: std::thread::JoinHandle<anyhow::Result<()>>,
}

impl Env {
    async fn start(&self, job: &str) -> anyhow::Result<Scenario> {
        relay_job(job, Rc::default()).provision(self.broker.clone()).await?;
        let seen = watch_outputs(&self.client, job).await?;
        let mut c = Cluster {
            exe: self.exe.clone(),
            url: self.url.clone(),
            job: job.to_owned(),
            dir: self.dir.clone(),
            ttl: self.ttl,
            nodes: BTreeMap::new(),
        };
        for id in ["a", "b", "c"] {
            c.add(id)?;
        }
        let kv = leases(&self.js, job).await?;
        let (stop, sent) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let publisher = load(self.url.clone(), job.to_owned(), self.rate, stop.clone(), sent.clone());
        Ok(Scenario { c, kv, seen, stop, sent, publisher })
    }
}

pub async fn run(ttl: Duration, rate: u64) -> anyhow::Result<Failover> {
    let server = NatsServer::start();
    let url = server.url();
    let exe = std::env::current_exe()?;
    let dir = std::env::temp_dir().join(format!("flotilla-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let broker = connect(&BrokerChoice::Nats(url.clone()), "bench-failover").await?;
    let (client, js) = crate::workload::raw_context(&url, 4096).await?;
    let mut result = Failover { lease_ttl_ms: ttl.as_millis() as u64, ..Failover::default() };
    let settle = ttl * 4 + Duration::from_secs(20);
    let env = Env { exe, url, dir: dir.clone(), ttl, rate, broker, client, js };

    // 1. Crash.
    {
        let job = "fx";
        let Scenario { mut c, kv, seen, stop, sent, publisher } = env.start(job).await?;
        let before = balanced(&kv, &["a", "b", "c"], settle).await?;
        let moved: BTreeMap<u32, u64> =
            before.iter().filter(|(_, (n, _))| n == "a").map(|(p, (_, e))| (*p, *e)).collect();
        let t0 = Instant::now();
        c.nodes.get_mut("a").context("node a")?.kill();
        result.crash_ms = first_new_outputs(&seen, &moved, t0, ttl * 4).await?;
        stop.store(true, Ordering::Relaxed);
        publisher.join().map_err(|_| anyhow::anyhow!("publisher panicked"))??;
        let published = sent.load(Ordering::Relaxed);
        result.crash_lost = missing(&env.js, job, published, Duration::from_secs(60)).await;
        result.published += published;
    }

    // 2. Join, then a graceful stop.
    {
        let job = "fg";
        let Scenario { mut c, kv, seen, stop, sent, publisher } = env.start(job).await?;
        let three = balanced(&kv, &["a", "b", "c"], settle).await?;
        c.add("d")?;
        let four = balanced(&kv, &["a", "b", "c", "d"], settle).await?;
        result.join_moved = (0..PARTITIONS).filter(|p| three.get(p).map(|o| &o.0) != four.get(p).map(|o| &o.0)).count();
        result.join_expected = (PARTITIONS / 4) as usize;
        let moved: BTreeMap<u32, u64> =
            four.iter().filter(|(_, (n, _))| n == "b").map(|(p, (_, e))| (*p, *e)).collect();
        let t0 = Instant::now();
        c.nodes.get("b").context("node b")?.signal("TERM");
        result.stop_ms = first_new_outputs(&seen, &moved, t0, ttl * 4).await?;
        let mut redelivered = c.stopped("b", Duration::from_secs(60))?;
        stop.store(true, Ordering::Relaxed);
        publisher.join().map_err(|_| anyhow::anyhow!("publisher panicked"))??;
        let published = sent.load(Ordering::Relaxed);
        result.stop_lost = missing(&env.js, job, published, Duration::from_secs(60)).await;
        result.published += published;
        for id in ["a", "c", "d"] {
            c.nodes.get(id).context("node")?.signal("TERM");
        }
        for id in ["a", "c", "d"] {
            redelivered += c.stopped(id, Duration::from_secs(60))?;
        }
        result.stop_redelivered = redelivered;
    }
    let _ = std::fs::remove_dir_all(&dir);
    drop(server);
    Ok(result)
}

pub fn print(f: &Failover) {
    let ttl = f.lease_ttl_ms;
    let worst = |m: &BTreeMap<u32, u64>| m.values().max().copied().unwrap_or(0);
    println!(
        "failover, kill -9 of 1 of 3 nodes     moved partitions produce again after {:?} ms (worst {} ms; lease TTL {} ms, target <= {} ms); {} of the published records missing",
        f.crash_ms.values().collect::<Vec<_>>(),
        worst(&f.crash_ms),
        ttl,
        2 * ttl,
        f.crash_lost
    );
    println!(
        "join of a 4th node                    {} partitions moved (fair share needs {})",
        f.join_moved, f.join_expected
    );
    println!(
        "graceful stop of 1 of 4 nodes         next owners produce after {:?} ms; {} redelivered records on all nodes (target 0); {} missing",
        f.stop_ms.values().collect::<Vec<_>>(),
        f.stop_redelivered,
        f.stop_lost
    );
}
