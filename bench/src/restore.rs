//! Restore speed: how fast a partition's store comes back from its changelog.
//!
//! The changelog of one partition is written directly (one record per key, as a
//! complete flush would leave it, and its commit record), then a job declaring that
//! store starts and the time its worker reports in the `state_restored` event (read
//! every key, resolve, claim, decode into the typed store) is the figure.

use anyhow::{Context as _, bail};
use flotilla::actors::store::{self, CommitRecord, Record};
use flotilla::prelude::*;
use flotilla::transport::broker::OutboundMessage;
use futures::StreamExt;
use std::time::{Duration, Instant};

/// The restored store: u64 keys and values.
const BIG: StoreDef<u64, u64> = StoreDef::new("big");

struct Idle;

impl Task for Idle {
    type Input = u64;
    async fn process(&mut self, _n: u64, _ctx: &mut TaskContext) -> Result<(), TaskError> {
        Ok(())
    }
}

/// One restore of a partition holding `keys` keys.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Restore {
    /// Where: `embedded` or `jetstream`.
    pub broker: String,
    pub keys: u64,
    /// Time to write the changelog (set-up, not the figure).
    pub write_ms: u64,
    /// The restore, as the worker reports it.
    pub restore_ms: u64,
    pub keys_per_sec: f64,
}

/// Writes a changelog of `keys` keys for job `job`, then starts the job and waits for
/// its restore.
pub async fn run(broker: SharedBroker, label: &str, job: &str, keys: u64) -> anyhow::Result<Restore> {
    let input = StreamDef::<u64>::ordered("in", 1);
    let job_def = Job::new(job).task(input, |_| Idle).store(BIG);
    job_def.provision(broker.clone()).await?;
    let bucket = format!("FLOTILLA_{job}_STATE");
    let codec = Codec::default();
    let prefix = "in.0";
    let written = Instant::now();
    let mut batch = Vec::with_capacity(4096);
    for k in 0..keys {
        let key = store::hex(&codec.encode(&k)?);
        let record = Record { generation: 1, flush: 1, value: Some(codec.encode(&k)?), committed: None };
        batch.push(OutboundMessage::new(
            Subjects::kv_subject(&bucket, &store::record_key(prefix, BIG.name(), &key)),
            record.encode(),
        ));
        if batch.len() == 4096 || k + 1 == keys {
            for ack in broker.publish_batch(std::mem::take(&mut batch)).await {
                ack.context("writing the changelog")?;
            }
        }
    }
    let commit = CommitRecord { generation: 1, flush: 1, position: 0, hooks: 0, epoch: 0, earlier: Vec::new() };
    broker
        .publish(OutboundMessage::new(
            Subjects::kv_subject(&bucket, &store::commit_key(prefix)),
            bytes::Bytes::from(serde_json::to_vec(&commit)?),
        ))
        .await?;
    let write_ms = written.elapsed().as_millis() as u64;
    let mut events = broker.subscribe(&format!("flotilla.{job}._evt.state_restored"), None).await?;
    let running = job_def.start(broker.clone()).await?;
    let event = tokio::time::timeout(Duration::from_secs(600), events.next())
        .await
        .context("no restore within 600 s")?
        .context("event subscription ended")?;
    running.stop();
    tokio::time::timeout(Duration::from_secs(60), running.wait()).await.context("job did not stop")??;
    let v: serde_json::Value = serde_json::from_slice(&event.payload)?;
    let restored = v["keys"].as_u64().unwrap_or(0);
    if restored != keys {
        bail!("{label}: restored {restored} keys of {keys}");
    }
    let restore_ms = v["millis"].as_u64().unwrap_or(0);
    Ok(Restore {
        broker: label.to_owned(),
        keys,
        write_ms,
        restore_ms,
        keys_per_sec: keys as f64 / (restore_ms.max(1) as f64 / 1000.0),
    })
}

pub fn print(r: &Restore) {
    println!(
        "restore, {:<9} {:>8} keys in {:>6} ms: {:>9.0} keys/s (changelog written in {} ms)",
        r.broker, r.keys, r.restore_ms, r.keys_per_sec, r.write_ms
    );
}
