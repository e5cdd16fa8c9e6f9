//! Reads a partition's drained and ended records for the one rule that judges them,
//! [`flotilla_proto::cluster::run_end`].

use flotilla_proto::cluster::control::{DrainedRecord, EndedRecord, decode, keys};
use flotilla_proto::cluster::run_end::PartitionEnd;
use flotilla_transport::broker::{BrokerError, SharedBroker};
use serde::de::DeserializeOwned;

/// What the records of `stream`'s partition `p` in the CONTROL bucket `control` say
/// about run `run` (an undecodable record says nothing).
///
/// # Errors
/// The broker could not be read.
pub async fn read_end(
    broker: &SharedBroker,
    control: &str,
    stream: &str,
    p: u32,
    run: &str,
) -> Result<PartitionEnd, BrokerError> {
    let drained = read::<DrainedRecord>(broker, control, &keys::drained(stream, p)).await?;
    let ended = read::<EndedRecord>(broker, control, &keys::ended(stream, p)).await?;
    Ok(PartitionEnd::of(drained.as_ref(), ended.as_ref(), run))
}

async fn read<T: DeserializeOwned>(broker: &SharedBroker, bucket: &str, key: &str) -> Result<Option<T>, BrokerError> {
    Ok(broker.kv_get(bucket, key).await?.and_then(|e| decode::<T>(key, &e.value).ok()))
}
