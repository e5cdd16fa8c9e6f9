//! Quickstart: publish and consume through Flotilla's transport, on the embedded broker
//! (default) or on NATS JetStream (`--nats nats://127.0.0.1:4222`).
//!
//! It provisions a queue stream and an ordered stream the way a job does, publishes
//! `--count` orders into each with pipelined batches, claims and acks them (per message
//! on the queue, ack-all per partition on the ordered stream), checks that nothing is
//! lost and that every partition came out in order, shows what happens to a message
//! that cannot be decoded, and prints a summary with rates.
//!
//! ```text
//! cargo run --example quickstart
//! cargo run --release --example quickstart -- --count 200000 --nats nats://127.0.0.1:4222
//! ```

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use flotilla::prelude::*;
use flotilla::transport::broker::AckPolicy;
use flotilla::transport::clock::unix_millis;
use flotilla::transport::topology;
use flotilla::transport::wire::{headers, partition_for};
use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

#[derive(Parser)]
#[command(about = "Publish and consume through Flotilla's transport")]
struct Args {
    /// NATS URL(s); the embedded broker when absent.
    #[arg(long, env = "FLOTILLA_NATS")]
    nats: Option<String>,
    /// Messages per stream.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    count: u64,
    /// Partitions of the ordered stream.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    partitions: u32,
    /// Job name (streams are FLOTILLA_<job>_orders and FLOTILLA_<job>_events).
    #[arg(long, default_value = "quickstart")]
    job: String,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Order {
    id: u64,
    customer: String,
    cents: u64,
}

const ORDER_TYPE: &str = "Order";
const BATCH: usize = 1024;
const CLAIM: usize = 256;

fn order_message(subject: String, codec: &Codec, order: &Order) -> anyhow::Result<OutboundMessage> {
    let payload = codec.encode(order)?;
    Ok(OutboundMessage::new(subject, payload)
        .with_id(MessageId::new_v7().to_string())
        .with_header(headers::KEY, order.customer.clone())
        .with_header(headers::TYPE, ORDER_TYPE)
        .with_header(headers::SENT, unix_millis(SystemTime::now()).to_string()))
}

async fn publish_all(broker: &SharedBroker, msgs: Vec<OutboundMessage>) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let mut msgs = msgs.into_iter().peekable();
    while msgs.peek().is_some() {
        let chunk: Vec<_> = msgs.by_ref().take(BATCH).collect();
        for ack in broker.publish_batch(chunk).await {
            ack.context("publishing")?;
        }
    }
    Ok(started.elapsed())
}

fn rate(n: u64, d: Duration) -> String {
    format!("{:>9.0} msgs/s", n as f64 / d.as_secs_f64().max(1e-9))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let args = Args::parse();
    let job = JobName::new(args.job.clone()).context("--job")?;
    let choice = BrokerChoice::from_url(args.nats.as_deref());
    let broker = connect(&choice, "flotilla-quickstart").await?;
    let info = broker.server();
    println!("broker: {:?} ({} {})", info.kind, info.name, info.version);

    let subjects = Subjects::new(job);
    let orders = StreamName::new("orders")?;
    let events = StreamName::new("events")?;
    let ack_wait = Duration::from_secs(30);
    topology::provision_queue(&broker, &subjects, &orders, ack_wait, 5, CLAIM as u32, 1).await?;
    topology::provision_ordered(&broker, &subjects, &events, args.partitions, ack_wait, CLAIM as u32, 1).await?;
    let orders_stream = subjects.stream_name(&orders);
    let events_stream = subjects.stream_name(&events);
    let codec = Codec::default();
    let customers: Vec<String> = (0..64).map(|c| format!("customer-{c}")).collect();
    let order = |id: u64| Order { id, customer: customers[(id % 64) as usize].clone(), cents: id * 7 % 10_000 };

    // Queue: publish, then claim + ack per message.
    let msgs = (0..args.count)
        .map(|id| order_message(subjects.queue(&orders), &codec, &order(id)))
        .collect::<Result<Vec<_>, _>>()?;
    let q_pub = publish_all(&broker, msgs).await?;
    let started = Instant::now();
    let queue_consumer = Subjects::queue_consumer(&orders);
    let (mut consumed, mut cents) = (0u64, 0u64);
    while consumed < args.count {
        let batch = broker.claim(&orders_stream, &queue_consumer, CLAIM, Duration::from_secs(2)).await?;
        if batch.is_empty() {
            bail!("queue stalled after {consumed} of {} messages", args.count);
        }
        for d in batch {
            let o: Order = codec.decode_message(&d.headers, ORDER_TYPE, &d.payload)?;
            cents += o.cents;
            broker.ack(&d.token, AckKind::Ack).await?;
            consumed += 1;
        }
    }
    broker.flush().await?;
    let q_claim = started.elapsed();
    let expected_cents: u64 = (0..args.count).map(|id| order(id).cents).sum();
    if cents != expected_cents {
        bail!("queue sum {cents} != published sum {expected_cents}");
    }

    // Ordered: publish keyed by customer, then claim each partition and commit with ack-all.
    let msgs = (0..args.count)
        .map(|id| {
            let o = order(id);
            let p = partition_for(&o.customer, args.partitions);
            order_message(subjects.ordered_partition(&events, p), &codec, &o)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let o_pub = publish_all(&broker, msgs).await?;
    let started = Instant::now();
    let mut per_partition: BTreeMap<u32, u64> = BTreeMap::new();
    for p in 0..args.partitions {
        let consumer = Subjects::partition_consumer(&events, p);
        let mut last_id_per_customer: BTreeMap<String, u64> = BTreeMap::new();
        loop {
            let batch = broker.claim(&events_stream, &consumer, CLAIM, Duration::from_millis(50)).await?;
            let Some(last) = batch.last() else { break };
            for d in &batch {
                let o: Order = codec.decode_message(&d.headers, ORDER_TYPE, &d.payload)?;
                if let Some(prev) = last_id_per_customer.insert(o.customer.clone(), o.id)
                    && prev >= o.id
                {
                    bail!("partition {p} out of order: {} after {prev}", o.id);
                }
            }
            broker.ack(&last.token, AckKind::Ack).await?; // ack-all: commits the batch
            *per_partition.entry(p).or_default() += batch.len() as u64;
        }
    }
    broker.flush().await?;
    let o_claim = started.elapsed();
    let ordered_total: u64 = per_partition.values().sum();
    if ordered_total != args.count {
        bail!("ordered stream: consumed {ordered_total} of {}", args.count);
    }
    let c0 = broker.consumer_state(&events_stream, &Subjects::partition_consumer(&events, 0)).await?;
    debug_assert_eq!(c0.spec.ack_policy, AckPolicy::All);

    // A message that cannot be decoded: the run loop dead-letters it with this reason.
    broker
        .publish(
            OutboundMessage::new(subjects.queue(&orders), Bytes::from_static(&[0x2a, 0x09, b'x'])).with_id("garbage-1"),
        )
        .await?;
    let bad = broker.claim(&orders_stream, &queue_consumer, 1, Duration::from_secs(2)).await?;
    let reason = match bad.first().map(|d| codec.decode_message::<Order>(&d.headers, ORDER_TYPE, &d.payload)) {
        Some(Err(e)) => {
            broker.ack(&bad[0].token, AckKind::Term).await?;
            format!("{} ({e})", e.reason())
        }
        other => bail!("expected an undecodable message, got {other:?}"),
    };

    println!(
        "queue   {orders_stream}: published {} in {:?} ({}), claimed+acked in {:?} ({})",
        args.count,
        q_pub,
        rate(args.count, q_pub),
        q_claim,
        rate(args.count, q_claim)
    );
    println!(
        "ordered {events_stream}: published {} in {:?} ({}), claimed+committed in {:?} ({})",
        args.count,
        o_pub,
        rate(args.count, o_pub),
        o_claim,
        rate(args.count, o_claim)
    );
    println!("partitions: {}", per_partition.iter().map(|(p, n)| format!("p{p}={n}")).collect::<Vec<_>>().join(" "));
    println!("checks: sum of cents {cents} matches, every partition in order, nothing lost");
    println!("undecodable message refused: {reason}");
    if matches!(choice, BrokerChoice::Nats(_)) {
        println!("(streams stay on the server; run again to append, or remove them with `nats stream rm`)");
    }
    Ok(())
}
