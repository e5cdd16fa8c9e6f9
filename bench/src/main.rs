//! `flotilla-bench`: Flotilla against raw async-nats and raw actix, in the same run.
//!
//! It starts its own nats-server (through the test harness: a free loopback port, a
//! temporary store, killed by PID at the end), then runs each pair interleaved — raw,
//! Flotilla, raw, Flotilla, … for `--rounds` rounds — and prints per pair the median
//! rate of each side and the median of the per-round ratios, plus latency percentiles,
//! failover times and memory per idle task. `--quick` uses small counts so that CI can
//! run it in well under a minute; it asserts nothing about speed. See BENCHMARKS.md.
//!
//! ```text
//! cargo run --release -p flotilla-bench                 # the full run (a few minutes)
//! cargo run --release -p flotilla-bench -- --quick      # what CI runs
//! cargo run --release -p flotilla-bench -- --only queue,ordered --count 500000
//! ```
#![forbid(unsafe_code)]

mod cpu;
mod embedded;
mod failover;
mod jetstream;
mod memory;
mod metrics_pair;
mod report;
mod restore;
mod workload;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use flotilla::prelude::*;
use std::rc::Rc;
use std::time::{Duration, Instant};

const PAIRS: &[&str] =
    &["queue", "ordered", "state", "publish", "metrics", "latency", "embedded", "restore", "memory", "failover"];

#[derive(Parser)]
#[command(about = "Flotilla against raw async-nats and raw actix, side by side")]
struct Args {
    /// Small counts and short phases (CI runs this so the benchmark cannot rot).
    #[arg(long)]
    quick: bool,
    /// Rounds per pair (each round runs the raw side, then Flotilla); at least 5 by default.
    #[arg(long)]
    rounds: Option<usize>,
    /// Messages per round for the throughput pairs.
    #[arg(long)]
    count: Option<u64>,
    /// Message size in bytes (the encoded payload).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(8..=1_000_000))]
    size: u64,
    /// Partitions of the ordered pair.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    partitions: u32,
    /// Fetch batch of the raw queue loop = `max_concurrency` of the Flotilla queue task.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    batch: u64,
    /// Publish acks outstanding at once, both sides (Flotilla's default is 4096).
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    window: u64,
    /// Outputs per input in the publish pair.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    fanout: u64,
    /// Offered load of the latency pair (msgs/s).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1000..=1_000_000))]
    latency_rate: u64,
    /// How long each latency round offers load.
    #[arg(long, value_parser = parse_duration)]
    latency_time: Option<Duration>,
    /// Idle tasks (partitions) in the memory probe.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    idle_tasks: Option<u32>,
    /// Lease TTL of the failover nodes.
    #[arg(long, value_parser = parse_duration)]
    lease_ttl: Option<Duration>,
    /// Run only these pairs (comma-separated): queue, ordered, state, publish, metrics, latency, embedded,
    /// restore, memory, failover.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// The state pair's distinct keys: each message updates its key modulo this (0:
    /// every message its own key, the worst case).
    #[arg(long, default_value_t = 0)]
    state_keys: u64,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Option<Internal>,
}

/// Subcommands the benchmark runs itself in child processes.
#[derive(Subcommand)]
enum Internal {
    /// A failover node (the relay job `in` → `out`).
    #[command(hide = true)]
    Node {
        #[arg(long)]
        job: String,
        #[command(flatten)]
        node: Box<NodeArgs>,
    },
    /// Measures memory in a fresh process.
    #[command(hide = true)]
    MemoryProbe {
        what: String,
        #[arg(long)]
        count: u32,
        #[arg(long, value_parser = parse_duration)]
        idle: Duration,
    },
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e}: write a duration like 5s or 500ms"))
}

fn node(job: String, args: NodeArgs) -> anyhow::Result<()> {
    let counts = Rc::new(failover::NodeCounts::default());
    let id = args.node_id();
    let result = flotilla::node::run(failover::relay_job(&job, counts.clone()), args, |_| async {});
    println!("bench node {id}: forwarded {}; redelivered {}", counts.forwarded.get(), counts.redelivered.get());
    result?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    match args.command {
        Some(Internal::Node { job, node: n }) => return node(job, *n),
        Some(Internal::MemoryProbe { what, count, idle }) => {
            let probe = actix::System::new().block_on(memory::probe(&what, count, idle))?;
            println!("{}", serde_json::to_string(&probe)?);
            return Ok(());
        }
        None => {}
    }
    for o in &args.only {
        if !PAIRS.contains(&o.as_str()) {
            bail!("--only {o}: unknown pair; choose from {}", PAIRS.join(", "));
        }
    }
    let only = |name: &str| args.only.is_empty() || args.only.iter().any(|o| o == name);
    let quick = args.quick;
    let rounds = args.rounds.unwrap_or(5);
    if rounds == 0 {
        bail!("--rounds 0: give at least 1 (5 or more for a median worth reading)");
    }
    let count = args.count.unwrap_or(if quick { 2_000 } else { 100_000 });
    let settings = jetstream::Settings {
        url: String::new(),
        count,
        size: args.size as usize,
        rounds,
        partitions: args.partitions,
        batch: args.batch as usize,
        window: args.window as usize,
        fanout: args.fanout.min(count),
        latency_rate: args.latency_rate,
        latency_secs: args.latency_time.map_or(if quick { 1 } else { 5 }, |d| d.as_secs().max(1)),
        server_pid: None,
        state_keys: args.state_keys,
    };
    let started = Instant::now();
    println!(
        "flotilla-bench{}: {} rounds, {} messages of {} B per round, nats-server {}",
        if quick { " --quick" } else { "" },
        rounds,
        count,
        args.size,
        flotilla_tests::nats_server_bin().display()
    );
    let system = actix::System::new();
    let result = system.block_on(async move {
        let mut pairs = Vec::new();
        if ["queue", "ordered", "state", "publish", "metrics", "latency"].iter().any(|p| only(p)) {
            let server = flotilla_tests::NatsServer::start();
            let s = jetstream::Settings { url: server.url(), server_pid: server.pid(), ..settings.clone() };
            pairs.extend(jetstream::run(&s, &only).await?);
            drop(server);
        }
        if only("embedded") {
            let n = args.count.unwrap_or(if quick { 20_000 } else { 1_000_000 });
            pairs.extend(embedded::run(n, args.size as usize, rounds, args.batch as usize).await?);
        }
        let mut restores = Vec::new();
        if only("restore") {
            let keys = if quick { 10_000 } else { 1_000_000 };
            let embedded = flotilla::transport::EmbeddedBroker::new().shared();
            restores.push(restore::run(embedded, "embedded", "re", keys).await.context("restore, embedded")?);
            let server = flotilla_tests::NatsServer::start();
            let js = connect(&BrokerChoice::Nats(server.url()), "bench-restore").await?;
            restores.push(restore::run(js, "jetstream", "rj", keys).await.context("restore, jetstream")?);
            drop(server);
        }
        let memory = if only("memory") {
            let n = args.idle_tasks.unwrap_or(if quick { 1_000 } else { 10_000 });
            Some(memory::run(n, if quick { Duration::from_secs(1) } else { Duration::from_secs(5) })?)
        } else {
            None
        };
        let failover = if only("failover") {
            let ttl = args.lease_ttl.unwrap_or(if quick { Duration::from_secs(3) } else { Duration::from_secs(6) });
            Some(failover::run(ttl, if quick { 500 } else { 2_000 }).await.context("failover")?)
        } else {
            None
        };
        anyhow::Ok((pairs, restores, memory, failover))
    })?;
    let (pairs, restores, memory, failover) = result;
    println!();
    println!("== results (medians over {rounds} rounds; ratio = median of per-round flotilla/raw)");
    for p in &pairs {
        report::print_pair(p);
    }
    for r in &restores {
        restore::print(r);
    }
    if let Some(m) = &memory {
        for probe in m {
            println!(
                "memory, {:<8} {:>6} idle: {:>7.2} KiB each (RSS {} → {} KiB), started in {} ms, idle CPU {:.1}% of a core (then {:.1}%){}",
                probe.what,
                probe.count,
                probe.per_item_kib,
                probe.rss_before_kib,
                probe.rss_after_kib,
                probe.start_ms,
                probe.idle_cpu * 100.0,
                probe.idle_cpu_later * 100.0,
                probe.one_each_ms.map(|ms| format!(", one message on each partition in {ms} ms")).unwrap_or_default()
            );
        }
    }
    if let Some(f) = &failover {
        failover::print(f);
    }
    println!("total time {:.1?}", started.elapsed());
    if let Some(path) = args.json {
        let doc = serde_json::json!({ "pairs": pairs, "restores": restores, "memory": memory, "failover": failover });
        std::fs::write(&path, serde_json::to_vec_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
