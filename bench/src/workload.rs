//! What both sides of a pair consume: the same messages, published the same way.

use anyhow::{Context as _, bail};
use async_nats::HeaderMap;
use async_nats::jetstream::{self, Context};
use bytes::Bytes;
use flotilla::prelude::*;
use flotilla::transport::wire::{headers, partition_for};
use std::time::{Duration, Instant};

/// The message both sides consume: its encoding is `--size` bytes. The body is
/// `serde_bytes`, as a user would declare a blob: without it serde decodes a `Vec<u8>`
/// byte by byte, which measured 12.7 % of the embedded pair's instructions.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Blob {
    #[serde(with = "serde_bytes")]
    pub body: Vec<u8>,
}

/// The header carrying the publish time (µs since the Unix epoch) for latency.
pub const SENT_US: &str = "Bench-Sent-Us";

/// A payload whose bincode encoding is exactly `size` bytes (for sizes up to 250 the
/// length prefix is one byte).
pub fn payload(size: usize) -> anyhow::Result<Bytes> {
    let len = size.saturating_sub(if size > 251 { 3 } else { 1 });
    let bytes = Codec::default().encode(&Blob { body: vec![b'x'; len] })?;
    Ok(bytes)
}

pub fn unix_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// A plain async-nats JetStream context with `window` publish acks outstanding at most
/// (Flotilla's JetStream backend uses the same builder and the same default, 4096).
pub async fn raw_context(url: &str, window: usize) -> anyhow::Result<(async_nats::Client, Context)> {
    let client = async_nats::ConnectOptions::new()
        .ping_interval(Duration::from_secs(3))
        .connect(url)
        .await
        .with_context(|| format!("connecting to {url}"))?;
    let js = jetstream::context::ContextBuilder::new().max_ack_inflight(window).build(client.clone());
    Ok((client, js))
}

/// Where message `i` of a run goes: (subject, key).
pub fn target(job: &str, stream: &str, partitions: Option<u32>, i: u64) -> (String, String) {
    let key = i.to_string();
    let subject = match partitions {
        Some(p) => format!("flotilla.{job}.{stream}.{}", partition_for(&key, p)),
        None => format!("flotilla.{job}.{stream}"),
    };
    (subject, key)
}

/// Publishes `n` messages into the job's `stream` (untimed set-up of a round), pipelined,
/// with the headers a Flotilla producer sets (`Nats-Msg-Id`, `Flotilla-Key`), and returns
/// how many went to each partition.
pub async fn prefill(
    js: &Context,
    job: &str,
    stream: &str,
    partitions: Option<u32>,
    n: u64,
    body: &Bytes,
) -> anyhow::Result<Vec<u64>> {
    let mut per_partition = vec![0u64; partitions.unwrap_or(1) as usize];
    let mut pending = Vec::with_capacity(4096);
    for i in 0..n {
        let (subject, key) = target(job, stream, partitions, i);
        if let Some(p) = partitions {
            per_partition[partition_for(&key, p) as usize] += 1;
        }
        let mut h = HeaderMap::new();
        h.insert(headers::KEY, key.as_str());
        h.insert("Nats-Msg-Id", format!("{job}-{i}").as_str());
        pending.push(js.publish_with_headers(subject, h, body.clone()).await?);
        if pending.len() == 4096 {
            for ack in pending.drain(..) {
                ack.await?;
            }
        }
    }
    for ack in pending {
        ack.await?;
    }
    if partitions.is_none() {
        per_partition[0] = n;
    }
    Ok(per_partition)
}

/// Waits until every listed consumer has nothing pending and nothing unacked: the run's
/// acks have all reached the server. Both sides of a pair end their clock here.
pub async fn wait_acked(js: &Context, stream: &str, consumers: &[String], within: Duration) -> anyhow::Result<()> {
    let started = Instant::now();
    let s = js.get_stream(stream).await?;
    'outer: loop {
        for name in consumers {
            let info = s.consumer_info(name).await?;
            if info.num_pending > 0 || info.num_ack_pending > 0 {
                if started.elapsed() > within {
                    bail!(
                        "consumer {name} of {stream} still has {} pending and {} unacked after {within:?}",
                        info.num_pending,
                        info.num_ack_pending
                    );
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                continue 'outer;
            }
        }
        return Ok(());
    }
}

/// Waits until `stream` holds `n` messages.
pub async fn wait_stored(js: &Context, stream: &str, n: u64, within: Duration) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut s = js.get_stream(stream).await?;
    loop {
        let have = s.info().await?.state.messages;
        if have >= n {
            return Ok(());
        }
        if started.elapsed() > within {
            bail!("{stream} holds {have} of {n} messages after {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
