//! `jobs`: a work queue. A flaky job succeeds on its third attempt, a long job runs for
//! 2.5× the ack-wait and is kept alive by heartbeats (delivered once), a poison job
//! ends in the dead-letter stream after `--max-attempts`, and quick jobs just pass. It
//! feeds itself, waits until every job is done or dead-lettered, prints a summary.
//!
//! ```text
//! cargo run --example jobs
//! cargo run --example jobs -- --nats nats://127.0.0.1:4222
//! ```

use clap::Parser;
use flotilla::prelude::*;
use flotilla::transport::broker::{ConsumerSpec, OutboundMessage};
use flotilla::transport::wire::{Codec, headers};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Serialize, Deserialize)]
enum Work {
    Quick,
    /// Fails this many attempts, then succeeds.
    Flaky {
        failures: u32,
    },
    /// Takes this long.
    Long {
        ms: u64,
    },
    /// Fails every attempt.
    Poison,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct JobSpec {
    id: u64,
    work: Work,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Outcome {
    id: u64,
    attempts: u32,
}

const JOBS: StreamDef<JobSpec> = StreamDef::queue("jobs");
const RESULTS: StreamDef<Outcome> = StreamDef::queue("results");

#[derive(Parser)]
#[command(about = "A work queue with retries, heartbeats and a dead-letter stream")]
struct Args {
    #[command(flatten)]
    node: NodeArgs,
    /// Quick jobs besides the flaky, long and poison ones.
    #[arg(long, default_value_t = 20)]
    quick: u64,
    /// Attempts before a job is dead-lettered.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    max_attempts: u32,
}

/// What the driver saw: results, and dead letters with their reasons.
#[derive(Default)]
struct Report {
    done: Vec<Outcome>,
    dead: Vec<(u64, String)>,
}

#[derive(Default)]
struct Stats {
    runs: BTreeMap<u64, u32>,
}

struct Worker {
    stats: Rc<RefCell<Stats>>,
}

impl Task for Worker {
    type Input = JobSpec;
    async fn process(&mut self, job: JobSpec, ctx: &mut TaskContext) -> Result<(), TaskError> {
        let attempt = ctx.message().map_or(1, |m| m.attempt);
        *self.stats.borrow_mut().runs.entry(job.id).or_default() += 1;
        match job.work {
            Work::Quick => {}
            Work::Flaky { failures } if attempt <= failures => {
                return Err(TaskError::failed(format!("job {} flaked on attempt {attempt}", job.id)));
            }
            Work::Flaky { .. } => {}
            Work::Long { ms } => tokio::time::sleep(Duration::from_millis(ms)).await,
            Work::Poison => return Err(TaskError::failed(format!("job {} is poison", job.id))),
        }
        ctx.send(&RESULTS, &job.id.to_string(), Outcome { id: job.id, attempts: attempt }).await
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let ack_wait = Duration::from_secs(2);
    let stats = Rc::new(RefCell::new(Stats::default()));
    let st = stats.clone();
    let job = Job::new("jobs")
        .task(JOBS, move |_| Worker { stats: st.clone() })
        .max_concurrency(1)
        .max_attempts(args.max_attempts)
        .ack_wait(ack_wait)
        .retry(RetryPolicy {
            max_attempts: args.max_attempts,
            initial_backoff: Duration::from_millis(200),
            ..RetryPolicy::default()
        })
        .output(RESULTS);
    let mut work = vec![
        JobSpec { id: 1, work: Work::Flaky { failures: 2 } },
        JobSpec { id: 2, work: Work::Long { ms: 5_000 } },
        JobSpec { id: 3, work: Work::Poison },
    ];
    work.extend((0..args.quick).map(|i| JobSpec { id: 100 + i, work: Work::Quick }));
    let total = work.len() as u64;
    let started = Instant::now();
    let report: Rc<RefCell<Report>> = Rc::default();
    let rep = report.clone();
    let run_id = format!("{}", std::process::id());
    flotilla::node::run(job, args.node, move |node| async move {
        let codec = Codec::default();
        let mut batch = Vec::new();
        for spec in &work {
            let Ok(payload) = codec.encode(spec) else { return };
            batch.push(
                OutboundMessage::new("flotilla.jobs.jobs", payload)
                    .with_id(format!("jobs-{run_id}-{}", spec.id))
                    .with_header(headers::KEY, spec.id.to_string()),
            );
        }
        for ack in node.broker.publish_batch(batch).await {
            if let Err(e) = ack {
                eprintln!("jobs: feeding the queue failed: {e}");
                node.stopper.stop();
                return;
            }
        }
        // Read results and dead letters until every job is accounted for.
        let mk = |name: String| ConsumerSpec { max_ack_pending: None, ..ConsumerSpec::new(name) };
        let suffix = node.node_id.replace(['.', ' '], "-");
        let (results, dead) = (format!("results-{suffix}"), format!("dlq-{suffix}"));
        let ready = node.broker.ensure_consumer("FLOTILLA_jobs_results", mk(results.clone())).await.is_ok()
            && node.broker.ensure_consumer("FLOTILLA_jobs_DLQ", mk(dead.clone())).await.is_ok();
        let deadline = Instant::now() + Duration::from_secs(120);
        while ready && Instant::now() < deadline {
            let (done, letters) = (rep.borrow().done.len(), rep.borrow().dead.len());
            if (done + letters) as u64 >= total {
                break;
            }
            if let Ok(got) = node.broker.claim("FLOTILLA_jobs_results", &results, 100, Duration::from_millis(100)).await
            {
                for d in got {
                    if let Ok(o) = codec.decode::<Outcome>(&d.payload) {
                        rep.borrow_mut().done.push(o);
                    }
                    let _ = node.broker.ack(&d.token, AckKind::Ack).await;
                }
            }
            if let Ok(got) = node.broker.claim("FLOTILLA_jobs_DLQ", &dead, 100, Duration::from_millis(100)).await {
                for d in got {
                    let id = codec.decode::<JobSpec>(&d.payload).map(|j| j.id).unwrap_or(0);
                    let why = format!(
                        "{}: {}",
                        d.headers.get(headers::DLQ_REASON).unwrap_or("?"),
                        d.headers.get(headers::DLQ_DETAIL).unwrap_or("")
                    );
                    rep.borrow_mut().dead.push((id, why));
                    let _ = node.broker.ack(&d.token, AckKind::Ack).await;
                }
            }
        }
        let _ = node.broker.delete_consumer("FLOTILLA_jobs_results", &results).await;
        let _ = node.broker.delete_consumer("FLOTILLA_jobs_DLQ", &dead).await;
        node.stopper.stop();
    })?;
    let report = report.borrow();
    let (done, dead) = (&report.done, &report.dead);
    let runs = &stats.borrow().runs;
    println!("jobs: {total} submitted, {} done, {} dead-lettered in {:.2?}", done.len(), dead.len(), started.elapsed());
    for o in done.iter().filter(|o| o.id < 100) {
        println!(
            "  job {} done on attempt {} (ran {} times on this node)",
            o.id,
            o.attempts,
            runs.get(&o.id).copied().unwrap_or(0)
        );
    }
    println!("  {} quick jobs done", done.iter().filter(|o| o.id >= 100).count());
    for (id, why) in dead {
        println!("  job {id} dead-lettered after {} runs: {why}", runs.get(id).copied().unwrap_or(0));
    }
    Ok(())
}
