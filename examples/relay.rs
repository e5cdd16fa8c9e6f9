//! `relay`: forwards records from one stream to another. Acceptance tests rely on this
//! contract — keep it stable:
//!
//! * job `relay`; ordered input `relay-in` of `Record { id: u64, body: String }`, key =
//!   `id` in decimal; ordered output `relay-out`, same type and key. `--queue` switches
//!   both to queue streams `relay-jobs` → `relay-done`;
//! * a body starting with `poison` fails every attempt (so it ends in the DLQ after
//!   `--max-attempts`); `sleep:<ms>` waits that long, then forwards; `later:<ms>`
//!   forwards it as a delayed output (`ctx.send_after`, through the job's timer
//!   stream) due `<ms>` after it was processed; a body starting with `crash` aborts
//!   the node process every time (so, with nodes restarted as a supervisor would, it
//!   ends in the DLQ as `crash-loop` after `--crash-limit` counted crashes); anything
//!   else is forwarded unchanged;
//! * flags `--nats URL`, `--partitions N` (8), `--max-attempts N` (3),
//!   `--ack-wait DURATION` (30s), `--node-id ID`, `--crash-limit N` (3), `--drain-timeout
//!   DURATION` (30s), `--max-sleep DURATION` (caps `sleep:` bodies; none);
//!   `publish --count N [--poison K]`
//!   publishes N records (K of them poison) and exits;
//! * with `--nats`, several relay processes form a cluster and share `relay-in`'s
//!   partitions; the control subcommands (`status`, `drain`, `stop --node ID`,
//!   `shutdown`, `pause`, `resume`, `step`) work as in the `flotilla` binary;
//! * on exit a node prints `relay node <id>: forwarded N records … ; F failed attempts;
//!   R redelivered records` (R counts records this node got with a delivery count
//!   above 1).
//!
//! Without `--nats` it runs on the embedded broker: it publishes a demo set itself,
//! relays it, prints a summary and exits. With `--nats` it is a node that runs until
//! SIGTERM/SIGINT, then prints its summary.
//!
//! ```text
//! cargo run --example relay
//! cargo run --example relay -- --nats nats://127.0.0.1:4222 publish --count 1000 --poison 2
//! cargo run --example relay -- --nats nats://127.0.0.1:4222 --node-id a
//! ```

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use flotilla::prelude::*;
use flotilla::transport::broker::{OutboundMessage, SharedBroker};
use flotilla::transport::clock::unix_millis;
use flotilla::transport::wire::{headers, partition_for};
use std::cell::Cell;
use std::rc::Rc;
use std::time::{Duration, Instant, SystemTime};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Record {
    id: u64,
    body: String,
}

#[derive(Parser)]
#[command(about = "Relay records from relay-in to relay-out (or relay-jobs to relay-done with --queue)")]
struct Args {
    #[command(flatten)]
    node: NodeArgs,
    /// Partitions of relay-in and relay-out.
    #[arg(long, default_value_t = 8, global = true, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    partitions: u32,
    /// Attempts per record before it is dead-lettered.
    #[arg(long, default_value_t = 3, global = true, value_parser = clap::value_parser!(u32).range(1..=1000))]
    max_attempts: u32,
    /// How long the broker waits for an ack before redelivering (e.g. 30s, 500ms).
    #[arg(long, default_value = "30s", global = true, value_parser = parse_duration)]
    ack_wait: Duration,
    /// Use the queue streams relay-jobs → relay-done instead of the ordered ones.
    #[arg(long, global = true)]
    queue: bool,
    /// Queue mode: records in flight at once per node (ordered mode is always 1, to keep order).
    #[arg(long, default_value_t = 64, global = true, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    concurrency: u64,
    /// Ordered mode: how many counted times a record may end its node before it is
    /// dead-lettered as crash-loop.
    #[arg(long, default_value_t = 3, global = true, value_parser = clap::value_parser!(u32).range(1..=1000))]
    crash_limit: u32,
    /// How long a graceful stop waits for in-flight records before handing them back.
    #[arg(long, default_value = "30s", global = true, value_parser = parse_duration)]
    drain_timeout: Duration,
    /// Caps the wait of `sleep:<ms>` bodies (a deployed fix for a hung handler, in
    /// tests); no cap by default.
    #[arg(long, global = true, value_parser = parse_duration)]
    max_sleep: Option<Duration>,
    /// Embedded broker only: how many records the demo feeds itself.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..=10_000_000))]
    demo: u64,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Clone, Subcommand)]
enum Command {
    /// Publish records into the input stream and exit.
    Publish {
        /// How many records.
        #[arg(long, default_value_t = 100)]
        count: u64,
        /// How many of them are poison.
        #[arg(long, default_value_t = 0)]
        poison: u64,
        /// Id of the first record.
        #[arg(long, default_value_t = 0)]
        start: u64,
    },
    /// Control the running relay nodes (needs --nats).
    #[command(flatten)]
    Control(flotilla::node::ControlCommand),
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e}: write a duration like 30s, 500ms or 2m"))
}

#[derive(Default)]
struct Counts {
    forwarded: Cell<u64>,
    failed_attempts: Cell<u64>,
    redelivered: Cell<u64>,
}

struct Relay<T: 'static> {
    out: StreamDef<Record>,
    max_sleep: Option<Duration>,
    counts: Rc<Counts>,
    _input: std::marker::PhantomData<T>,
}

impl Task for Relay<Record> {
    type Input = Record;

    async fn process(&mut self, record: Record, ctx: &mut TaskContext) -> Result<(), TaskError> {
        if ctx.message().is_some_and(|m| m.delivered > 1 && u64::from(m.attempt) == m.delivered) {
            self.counts.redelivered.set(self.counts.redelivered.get() + 1);
        }
        if record.body.starts_with("crash") {
            // What a message that kills its node looks like (a segfault in a native
            // library, an out-of-memory kill): the process ends, nothing is caught.
            eprintln!("relay: record {} crashes this node", record.id);
            std::process::abort();
        }
        if record.body.starts_with("poison") {
            self.counts.failed_attempts.set(self.counts.failed_attempts.get() + 1);
            return Err(TaskError::failed(format!("record {} is poison", record.id)));
        }
        if let Some(ms) = record.body.strip_prefix("sleep:") {
            let ms: u64 =
                ms.trim().parse().map_err(|_| TaskError::failed(format!("bad sleep body {:?}", record.body)))?;
            let wait = Duration::from_millis(ms);
            tokio::time::sleep(self.max_sleep.map_or(wait, |cap| wait.min(cap))).await;
        }
        if let Some(ms) = record.body.strip_prefix("later:") {
            let ms: u64 =
                ms.trim().parse().map_err(|_| TaskError::failed(format!("bad later body {:?}", record.body)))?;
            ctx.send_after(&self.out, &record.id.to_string(), &record, Duration::from_millis(ms)).await?;
        } else {
            ctx.send(&self.out, &record.id.to_string(), &record).await?;
        }
        self.counts.forwarded.set(self.counts.forwarded.get() + 1);
        Ok(())
    }
}

struct Streams {
    input: StreamDef<Record>,
    output: StreamDef<Record>,
}

fn streams(args: &Args) -> Streams {
    if args.queue {
        Streams { input: StreamDef::queue("relay-jobs"), output: StreamDef::queue("relay-done") }
    } else {
        Streams {
            input: StreamDef::ordered("relay-in", args.partitions),
            output: StreamDef::ordered("relay-out", args.partitions),
        }
    }
}

/// Publishes records `start..start+count`, `poison` of them poison (spread evenly).
async fn publish(
    broker: &SharedBroker,
    input: &StreamDef<Record>,
    start: u64,
    count: u64,
    poison: u64,
    sleep_one: Option<u64>,
) -> anyhow::Result<()> {
    let codec = flotilla::transport::wire::Codec::default();
    let every = count.checked_div(poison).map_or(u64::MAX, |n| n.max(1));
    let mut batch = Vec::new();
    let mut poisoned = 0;
    for i in 0..count {
        let id = start + i;
        let body = if poison > poisoned && i % every == every / 2 {
            poisoned += 1;
            format!("poison-{id}")
        } else if sleep_one == Some(i) {
            "sleep:300".to_owned()
        } else {
            format!("record {id}")
        };
        let key = id.to_string();
        let subject = match input.kind() {
            flotilla::actors::StreamKind::Ordered { partitions } => {
                format!("flotilla.relay.{}.{}", input.name(), partition_for(&key, partitions))
            }
            flotilla::actors::StreamKind::Queue => format!("flotilla.relay.{}", input.name()),
        };
        let msg = OutboundMessage::new(subject, codec.encode(&Record { id, body })?)
            .with_id(MessageId::new_v7().to_string())
            .with_header(headers::KEY, key)
            .with_header(headers::TYPE, "Record")
            .with_header(headers::SENT, unix_millis(SystemTime::now()).to_string());
        batch.push(msg);
        if batch.len() == 1024 || i + 1 == count {
            for ack in broker.publish_batch(std::mem::take(&mut batch)).await {
                ack.context("publishing into the input stream")?;
            }
        }
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let Streams { input, output } = streams(&args);
    if let Some(Command::Control(command)) = args.command.clone() {
        std::process::exit(flotilla::node::runner::control(&args.node, "relay", command));
    }
    if let Some(Command::Publish { count, poison, start }) = args.command {
        let config = args.node.resolve()?;
        if config.urls().is_empty() {
            bail!(
                "publish needs --nats URL: the embedded broker lives inside one process, so records published to it would vanish"
            );
        }
        if poison > count {
            bail!("--poison {poison} is more than --count {count}");
        }
        // Notes on existing streams (kept settings, fewer replicas) go to the log.
        flotilla::node::runner::init_logging(&flotilla::node::config::NodeConfig {
            log: Some(config.log.clone().unwrap_or_else(|| "warn".into())),
            ..config.clone()
        })?;
        let system = actix::System::new();
        return system.block_on(async move {
            let broker = args.node.connect("relay-publisher").await?;
            // Provision the input the way the job does, so publishing works before any node ran.
            let job = Job::new("relay").task(input, move |_| Relay::<Record> {
                out: output,
                max_sleep: None,
                counts: Rc::default(),
                _input: std::marker::PhantomData,
            });
            let job =
                job.max_attempts(args.max_attempts).ack_wait(args.ack_wait).output(output).replicas(config.replicas()?);
            job.provision(broker.clone()).await?;
            let started = Instant::now();
            publish(&broker, &input, start, count, poison, None).await?;
            println!("published {count} records ({poison} poison) into {} in {:?}", input.name(), started.elapsed());
            Ok(())
        });
    }

    let counts = Rc::new(Counts::default());
    let c = counts.clone();
    let job = Job::new("relay")
        .task(input, move |_| Relay::<Record> {
            out: output,
            max_sleep: args.max_sleep,
            counts: c.clone(),
            _input: std::marker::PhantomData,
        })
        .max_attempts(args.max_attempts)
        .ack_wait(args.ack_wait)
        .max_concurrency(if args.queue { args.concurrency as usize } else { 1 })
        .crash_limit(args.crash_limit)
        .drain_timeout(args.drain_timeout)
        .retry(RetryPolicy {
            max_attempts: args.max_attempts,
            initial_backoff: Duration::from_millis(100),
            ..RetryPolicy::default()
        })
        .output(output);
    let started = Instant::now();
    let demo_count = args.demo;
    let node_id = args.node.node_id();
    let result = flotilla::node::run(job, args.node.clone(), move |node| async move {
        if !node.embedded {
            return;
        }
        // Embedded: feed a demo set (2 poison records, one slow one), wait, stop.
        if let Err(e) = publish(&node.broker, &input, 0, demo_count, 2, Some(10)).await {
            eprintln!("relay: demo publish failed: {e}");
            node.stopper.stop();
            return;
        }
        let out = format!("FLOTILLA_relay_{}", output.name());
        let deadline = Instant::now() + Duration::from_secs(600);
        while Instant::now() < deadline {
            let done = node.broker.stream_state(&out).await.map(|s| s.messages).unwrap_or(0);
            let dead = node.broker.stream_state("FLOTILLA_relay_DLQ").await.map(|s| s.messages).unwrap_or(0);
            if done + dead >= demo_count {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let done = node.broker.stream_state(&out).await.map(|s| s.messages).unwrap_or(0);
        let dead = node.broker.stream_state("FLOTILLA_relay_DLQ").await.map(|s| s.messages).unwrap_or(0);
        println!("relay (embedded): published {demo_count} records, {done} in {}, {dead} in the DLQ", output.name());
        node.stopper.stop();
    });
    let elapsed = started.elapsed();
    let forwarded = counts.forwarded.get();
    println!(
        "relay node {node_id}: forwarded {forwarded} records to {} in {elapsed:.2?} ({:.0} records/s); {} failed attempts; {} redelivered records",
        output.name(),
        forwarded as f64 / elapsed.as_secs_f64().max(1e-9),
        counts.failed_attempts.get(),
        counts.redelivered.get(),
    );
    result?;
    Ok(())
}
