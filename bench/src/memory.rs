//! Memory per idle task, measured in a fresh child process (so earlier benchmarks'
//! allocations do not blur it): resident set before and after starting a job with
//! `partitions` ordered partitions on the embedded broker, next to the same number of
//! plain actix actors; then whether the idle node still works (CPU while idle, time to
//! process one message on every partition).

use crate::workload::{Blob, payload};
use actix::prelude::*;
use anyhow::{Context as _, bail};
use flotilla::prelude::*;
use flotilla::transport::embedded::EmbeddedBroker;
use flotilla::transport::wire::headers;
use std::cell::Cell;
use std::rc::Rc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Probe {
    pub what: String,
    pub count: u64,
    pub rss_before_kib: u64,
    pub rss_after_kib: u64,
    pub per_item_kib: f64,
    pub start_ms: u64,
    /// CPU used while idle, as a share of one core: over the first `idle` period, and
    /// over a second one right after (idle partitions' claims wait longer the longer
    /// they stay empty, so the second is the steady state).
    pub idle_cpu: f64,
    pub idle_cpu_later: f64,
    /// Time to process one message on every partition after idling (Flotilla only).
    pub one_each_ms: Option<u64>,
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// CPU time of this process (user + system).
fn cpu_time() -> Duration {
    Duration::from_secs_f64(crate::cpu::cpu_seconds("self").unwrap_or(0.0))
}

struct Idle {
    seen: Rc<Cell<u64>>,
}

impl Task for Idle {
    type Input = Blob;
    async fn process(&mut self, _blob: Blob, _ctx: &mut TaskContext) -> Result<(), TaskError> {
        self.seen.set(self.seen.get() + 1);
        Ok(())
    }
}

struct Plain {
    _state: u64,
}

impl Actor for Plain {
    type Context = Context<Self>;
}

/// Runs in the child: measures `what` ("flotilla" or "actix") with `count` items.
pub async fn probe(what: &str, count: u32, idle: Duration) -> anyhow::Result<Probe> {
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = rss_kib();
    let started = Instant::now();
    let mut one_each_ms = None;
    let (after, start_ms, idle_cpu, idle_cpu_later);
    match what {
        "actix" => {
            let addrs: Vec<Addr<Plain>> = (0..count).map(|i| Plain { _state: u64::from(i) }.start()).collect();
            tokio::task::yield_now().await;
            start_ms = started.elapsed().as_millis() as u64;
            let cpu = cpu_time();
            tokio::time::sleep(idle).await;
            idle_cpu = (cpu_time() - cpu).as_secs_f64() / idle.as_secs_f64();
            let cpu = cpu_time();
            tokio::time::sleep(idle).await;
            idle_cpu_later = (cpu_time() - cpu).as_secs_f64() / idle.as_secs_f64();
            after = rss_kib();
            drop(addrs);
        }
        "flotilla" => {
            let broker = EmbeddedBroker::new().shared();
            let seen = Rc::new(Cell::new(0u64));
            let s = seen.clone();
            let input = StreamDef::<Blob>::ordered("idle", count);
            let job = Job::new("mem").task(input, move |_| Idle { seen: s.clone() });
            let running = job.start(broker.clone()).await?;
            start_ms = started.elapsed().as_millis() as u64;
            // Let every worker start and every partition's first claim go out.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let cpu = cpu_time();
            tokio::time::sleep(idle).await;
            idle_cpu = (cpu_time() - cpu).as_secs_f64() / idle.as_secs_f64();
            let cpu = cpu_time();
            tokio::time::sleep(idle).await;
            idle_cpu_later = (cpu_time() - cpu).as_secs_f64() / idle.as_secs_f64();
            after = rss_kib();
            // Still responsive: one message on every partition.
            let body = payload(128)?;
            let t = Instant::now();
            let mut batch = Vec::new();
            for p in 0..count {
                batch.push(
                    OutboundMessage::new(format!("flotilla.mem.idle.{p}"), body.clone())
                        .with_id(format!("one-{p}"))
                        .with_header(headers::KEY, p.to_string()),
                );
            }
            for ack in broker.publish_batch(batch).await {
                ack?;
            }
            while seen.get() < u64::from(count) {
                if t.elapsed() > Duration::from_secs(120) {
                    bail!("only {} of {count} partitions processed their message in 120 s", seen.get());
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            one_each_ms = Some(t.elapsed().as_millis() as u64);
            running.stop();
            tokio::time::timeout(Duration::from_secs(60), running.wait()).await.context("job did not stop")??;
        }
        other => bail!("unknown probe {other:?}: use flotilla or actix"),
    }
    Ok(Probe {
        what: what.to_owned(),
        count: u64::from(count),
        rss_before_kib: before,
        rss_after_kib: after,
        per_item_kib: after.saturating_sub(before) as f64 / f64::from(count.max(1)),
        start_ms,
        idle_cpu,
        idle_cpu_later,
        one_each_ms,
    })
}

/// Runs the probes in child processes of this binary and returns their results.
pub fn run(count: u32, idle: Duration) -> anyhow::Result<Vec<Probe>> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let mut out = Vec::new();
    for what in ["actix", "flotilla"] {
        let output = std::process::Command::new(&exe)
            .args(["memory-probe", what, "--count", &count.to_string(), "--idle", &format!("{}ms", idle.as_millis())])
            .output()
            .context("running the memory probe")?;
        if !output.status.success() {
            bail!("memory probe {what} failed: {}", String::from_utf8_lossy(&output.stderr));
        }
        let text = String::from_utf8_lossy(&output.stdout);
        let line = text.lines().last().unwrap_or_default();
        out.push(serde_json::from_str(line).with_context(|| format!("memory probe printed {line:?}"))?);
    }
    Ok(out)
}
