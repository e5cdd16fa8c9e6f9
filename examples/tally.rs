//! `tally`: counts votes per choice in a durable store. Acceptance tests rely on this
//! contract — keep it stable:
//!
//! * job `tally`; ordered input `tally-in` (`--partitions`, 8) of `Vote { voter: u64,
//!   choice: String }`, key = `choice`; the task counts votes per choice in a store
//!   (`counts`), and remembers which choices changed since the last window in another
//!   (`unreported`);
//! * every window (`--window`, 1s) and at end of stream it emits `Total { choice:
//!   String, count: u64 }` to the ordered stream `tally-out` (same partitions, key =
//!   choice) for each choice changed since the last window;
//! * a vote whose `choice` starts with `poison` fails every attempt: it goes to the DLQ
//!   after `--max-attempts` and is not counted;
//! * a vote whose `choice` starts with `flaky` fails its first attempt with a transient
//!   error and is counted once, on its retry;
//! * `--concurrency N` (1) runs up to N votes of a partition at once, each through
//!   `defer` (a short simulated I/O, where a flaky vote's first attempt fails);
//! * flags `--nats URL`, `--node-id ID`, `--partitions N` (8), `--max-attempts N` (3),
//!   `--ack-wait DURATION` (30s), `--lease-ttl DURATION` (6s), `--window DURATION`
//!   (1s), `--concurrency N` (1); `publish --count N [--choices K] [--poison P]
//!   [--flaky F] [--start S]` publishes N votes (voters S.., choices `choice-0` …
//!   `choice-<K-1>` in turn, P of them poison, F of them flaky: `flaky-<voter mod K>`)
//!   and exits;
//! * after any number of node kills, restarts and rebalances, the last `Total` of each
//!   choice in `tally-out` equals the number of non-poison votes published for it
//!   (the store is restored on every move, and inputs are applied exactly once);
//! * on exit a node prints `tally node <id>: counted N votes; F failed attempts`.
//!
//! Without `--nats` it runs on the embedded broker: it publishes a demo set itself,
//! counts it, checks the totals and exits.
//!
//! ```text
//! cargo run --example tally
//! cargo run --example tally -- --nats nats://127.0.0.1:4222 publish --count 10000 --choices 5
//! cargo run --example tally -- --nats nats://127.0.0.1:4222 --node-id a
//! ```

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use flotilla::prelude::*;
use flotilla::transport::broker::{ConsumerSpec, SharedBroker};
use flotilla::transport::clock::unix_millis;
use flotilla::transport::wire::{headers, partition_for};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::{Duration, Instant, SystemTime};

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

/// Votes per choice.
const COUNTS: StoreDef<String, u64> = StoreDef::new("counts");
/// Choices whose count changed since the last window: durable too, so a total that a
/// crash kept from being emitted is emitted by the next owner.
const UNREPORTED: StoreDef<String, ()> = StoreDef::new("unreported");

#[derive(Parser)]
#[command(about = "Count votes per choice from tally-in into tally-out, in a durable store")]
struct Args {
    #[command(flatten)]
    node: NodeArgs,
    /// Partitions of tally-in and tally-out.
    #[arg(long, default_value_t = 8, global = true, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    partitions: u32,
    /// Attempts per vote before it is dead-lettered.
    #[arg(long, default_value_t = 3, global = true, value_parser = clap::value_parser!(u32).range(1..=1000))]
    max_attempts: u32,
    /// How long the broker waits for an ack before redelivering (e.g. 30s, 500ms).
    #[arg(long, default_value = "30s", global = true, value_parser = parse_duration)]
    ack_wait: Duration,
    /// How often changed totals are emitted (e.g. 1s, 500ms).
    #[arg(long, default_value = "1s", global = true, value_parser = parse_duration)]
    window: Duration,
    /// Votes of a partition counted at once, each with a short simulated I/O (`defer`).
    #[arg(long, default_value_t = 1, global = true, value_parser = clap::value_parser!(u32).range(1..=1024))]
    concurrency: u32,
    /// Embedded broker only: how many votes the demo feeds itself.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(10..=10_000_000))]
    demo: u64,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Clone, Subcommand)]
enum Command {
    /// Publish votes into tally-in and exit.
    Publish {
        /// How many votes.
        #[arg(long, default_value_t = 100)]
        count: u64,
        /// How many choices they spread over (choice-0, choice-1, …).
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
        choices: u64,
        /// How many of them are poison (their choice is poison-<voter>).
        #[arg(long, default_value_t = 0)]
        poison: u64,
        /// How many of them are flaky (their choice is flaky-<voter mod choices>): each
        /// fails its first attempt and is counted on its retry.
        #[arg(long, default_value_t = 0)]
        flaky: u64,
        /// The first voter's number.
        #[arg(long, default_value_t = 0)]
        start: u64,
    },
    /// Control the running tally nodes (needs --nats).
    #[command(flatten)]
    Control(flotilla::node::ControlCommand),
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e}: write a duration like 30s, 500ms or 2m"))
}

#[derive(Default)]
struct Counts {
    counted: Cell<u64>,
    failed_attempts: Cell<u64>,
}

struct Tally {
    out: StreamDef<Total>,
    counts: Rc<Counts>,
    /// Votes run through `defer` (`--concurrency` over 1).
    deferred: bool,
}

impl Tally {
    /// Emits the total of every choice changed since the last report.
    async fn report(&self, ctx: &mut TaskContext) -> Result<(), TaskError> {
        let changed: Vec<String> = ctx.store(&UNREPORTED)?.entries().into_iter().map(|(c, ())| c).collect();
        for choice in changed {
            let count = ctx.store(&COUNTS)?.get(&choice).unwrap_or(0);
            ctx.send(&self.out, &choice, Total { choice: choice.clone(), count }).await?;
            ctx.store(&UNREPORTED)?.delete(&choice);
        }
        Ok(())
    }
}

impl Task for Tally {
    type Input = Vote;

    async fn process(&mut self, vote: Vote, ctx: &mut TaskContext) -> Result<(), TaskError> {
        if vote.choice.starts_with("poison") {
            self.counts.failed_attempts.set(self.counts.failed_attempts.get() + 1);
            return Err(TaskError::failed(format!("vote of voter {} is poison", vote.voter)));
        }
        let first_attempt = ctx.message().is_none_or(|m| m.attempt == 1);
        let flaky = vote.choice.starts_with("flaky") && first_attempt;
        let voter = vote.voter;
        if flaky && !self.deferred {
            self.counts.failed_attempts.set(self.counts.failed_attempts.get() + 1);
            return Err(TaskError::failed(format!("vote of voter {voter} is flaky: its first attempt fails")));
        }
        ctx.store(&COUNTS)?.update(vote.choice.clone(), |n| Some(n.unwrap_or(0) + 1))?;
        ctx.store(&UNREPORTED)?.put(vote.choice, ())?;
        if !self.deferred {
            self.counts.counted.set(self.counts.counted.get() + 1);
            return Ok(());
        }
        // The simulated I/O: the vote counts once it succeeds; a flaky vote's first
        // attempt fails there, after its writes (which the runtime undoes).
        let counts = self.counts.clone();
        ctx.defer(async move {
            tokio::time::sleep(Duration::from_millis(1 + voter % 3)).await;
            if flaky {
                counts.failed_attempts.set(counts.failed_attempts.get() + 1);
                return Err(TaskError::failed(format!("vote of voter {voter} is flaky: its first attempt fails")));
            }
            counts.counted.set(counts.counted.get() + 1);
            Ok(())
        });
        Ok(())
    }

    async fn window(&mut self, ctx: &mut TaskContext) -> Result<(), TaskError> {
        self.report(ctx).await
    }

    async fn end_of_stream(&mut self, ctx: &mut TaskContext) -> Result<(), TaskError> {
        self.report(ctx).await
    }
}

/// The job, as every tally process declares it.
fn job(args: &Args, counts: Rc<Counts>) -> Job {
    let input = StreamDef::<Vote>::ordered("tally-in", args.partitions);
    let out = StreamDef::<Total>::ordered("tally-out", args.partitions);
    let deferred = args.concurrency > 1;
    Job::new("tally")
        .task(input, move |_| Tally { out, counts: counts.clone(), deferred })
        .store(COUNTS)
        .store(UNREPORTED)
        .window_every(args.window)
        .max_concurrency(args.concurrency as usize)
        .max_attempts(args.max_attempts)
        .ack_wait(args.ack_wait)
        .retry(RetryPolicy {
            max_attempts: args.max_attempts,
            initial_backoff: Duration::from_millis(100),
            ..RetryPolicy::default()
        })
        // A partition whose changelog was written by someone else meanwhile restarts
        // from its last commit instead of ending the node.
        .on_failure(FailurePolicy::RestartTask)
        .output(out)
}

/// What `publish` sends: votes `start..start+count` over `choices` choices, `poison`
/// of them poison and `flaky` of them flaky.
#[derive(Debug, Clone, Copy)]
struct Votes {
    start: u64,
    count: u64,
    choices: u64,
    poison: u64,
    flaky: u64,
}

/// Publishes `votes`; returns the votes that count, per choice.
async fn publish(broker: &SharedBroker, partitions: u32, votes: Votes) -> anyhow::Result<BTreeMap<String, u64>> {
    let Votes { start, count, choices, poison, flaky } = votes;
    let codec = flotilla::transport::wire::Codec::default();
    let every = count.checked_div(poison).map_or(u64::MAX, |n| n.max(1));
    // Flaky votes sit a third of the way into each of their spans, away from poison.
    let every_flaky = count.checked_div(flaky).map_or(u64::MAX, |n| n.max(1));
    let mut expected = BTreeMap::new();
    let mut batch = Vec::new();
    let (mut poisoned, mut flaked) = (0, 0);
    for i in 0..count {
        let voter = start + i;
        let choice = if poison > poisoned && i % every == every / 2 {
            poisoned += 1;
            format!("poison-{voter}")
        } else {
            let c = if flaky > flaked && i % every_flaky == every_flaky / 3 {
                flaked += 1;
                format!("flaky-{}", voter % choices)
            } else {
                format!("choice-{}", voter % choices)
            };
            *expected.entry(c.clone()).or_insert(0) += 1;
            c
        };
        let subject = format!("flotilla.tally.tally-in.{}", partition_for(&choice, partitions));
        let msg = flotilla::transport::broker::OutboundMessage::new(
            subject,
            codec.encode(&Vote { voter, choice: choice.clone() })?,
        )
        .with_id(format!("tally-vote-{voter}"))
        .with_header(headers::KEY, choice)
        .with_header(headers::TYPE, "Vote")
        .with_header(headers::SENT, unix_millis(SystemTime::now()).to_string());
        batch.push(msg);
        if batch.len() == 1024 || i + 1 == count {
            for ack in broker.publish_batch(std::mem::take(&mut batch)).await {
                ack.context("publishing into tally-in")?;
            }
        }
    }
    Ok(expected)
}

/// The last total of each choice in tally-out.
async fn last_totals(broker: &SharedBroker, reader: &str) -> anyhow::Result<BTreeMap<String, u64>> {
    let stream = "FLOTILLA_tally_tally-out";
    let spec = ConsumerSpec { max_ack_pending: None, ..ConsumerSpec::new(reader) };
    broker.ensure_consumer(stream, spec).await?;
    let codec = flotilla::transport::wire::Codec::default();
    let mut last = BTreeMap::new();
    loop {
        let got = broker.claim(stream, reader, 1000, Duration::from_millis(300)).await?;
        if got.is_empty() {
            break;
        }
        for d in got {
            let total: Total = codec.decode(&d.payload)?;
            last.insert(total.choice, total.count);
        }
    }
    let _ = broker.delete_consumer(stream, reader).await;
    Ok(last)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(Command::Control(command)) = args.command.clone() {
        std::process::exit(flotilla::node::runner::control(&args.node, "tally", command));
    }
    if let Some(Command::Publish { count, choices, poison, flaky, start }) = args.command.clone() {
        let config = args.node.resolve()?;
        if config.urls().is_empty() {
            bail!(
                "publish needs --nats URL: the embedded broker lives inside one process, so votes published to it would vanish"
            );
        }
        if poison > count {
            bail!("--poison {poison} is more than --count {count}");
        }
        if poison + flaky > count {
            bail!("--poison {poison} and --flaky {flaky} together are more than --count {count}");
        }
        flotilla::node::runner::init_logging(&flotilla::node::config::NodeConfig {
            log: Some(config.log.clone().unwrap_or_else(|| "warn".into())),
            ..config.clone()
        })?;
        let system = actix::System::new();
        return system.block_on(async move {
            let broker = args.node.connect("tally-publisher").await?;
            job(&args, Rc::default()).replicas(config.replicas()?).provision(broker.clone()).await?;
            let started = Instant::now();
            publish(&broker, args.partitions, Votes { start, count, choices, poison, flaky }).await?;
            println!(
                "published {count} votes ({poison} poison, {flaky} flaky) into tally-in in {:?}",
                started.elapsed()
            );
            Ok(())
        });
    }

    let counts = Rc::new(Counts::default());
    let job = job(&args, counts.clone());
    let node_id = args.node.node_id();
    let (demo, partitions, window) = (args.demo, args.partitions, args.window);
    let verdict: Rc<Cell<Option<bool>>> = Rc::default();
    let v = verdict.clone();
    let counted = counts.clone();
    let result = flotilla::node::run(job, args.node.clone(), move |node| async move {
        if !node.embedded {
            return;
        }
        // Embedded: feed a demo set (3 poison votes, 3 flaky), wait until counted, compare.
        let votes = Votes { start: 0, count: demo, choices: 7, poison: 3, flaky: 3 };
        let expected = match publish(&node.broker, partitions, votes).await {
            Ok(e) => e,
            Err(e) => {
                eprintln!("tally: demo publish failed: {e}");
                node.stopper.stop();
                return;
            }
        };
        let want: u64 = expected.values().sum();
        let deadline = Instant::now() + Duration::from_secs(600);
        while counted.counted.get() < want && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The last window reports the last changes.
        tokio::time::sleep(window * 2 + Duration::from_millis(200)).await;
        match last_totals(&node.broker, "tally-demo-reader").await {
            Ok(last) => {
                for (choice, want) in &expected {
                    println!("  {choice:<10} {:>6} (published {want})", last.get(choice).copied().unwrap_or(0));
                }
                let ok = last == expected;
                println!(
                    "tally (embedded): published {demo} votes (3 poison, 3 flaky) over 7 choices; last totals {}",
                    if ok { "match the votes" } else { "DO NOT match the votes" }
                );
                v.set(Some(ok));
            }
            Err(e) => eprintln!("tally: reading tally-out failed: {e}"),
        }
        node.stopper.stop();
    });
    println!(
        "tally node {node_id}: counted {} votes; {} failed attempts",
        counts.counted.get(),
        counts.failed_attempts.get()
    );
    result?;
    if verdict.get() == Some(false) {
        bail!("the last totals do not match the votes published");
    }
    Ok(())
}
