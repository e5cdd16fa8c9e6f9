//! `pause`, `resume` and `step` of a paused partition.

use super::{ControlClient, ControlError, json};
use flotilla_proto::cluster::control::{PauseRecord, decode, keys};
use flotilla_transport::broker::BrokerError;
use std::collections::BTreeSet;

impl ControlClient {
    /// Pauses (or, with `paused = false`, resumes) the job, a stream or a partition.
    ///
    /// # Errors
    /// [`ControlError::Refused`] for an unknown stream or partition.
    pub async fn set_paused(
        &self,
        stream: Option<&str>,
        partition: Option<u32>,
        paused: bool,
    ) -> Result<PauseRecord, ControlError> {
        self.check_scope(stream, partition).await?;
        let record = loop {
            let entry = self.broker.kv_get(&self.buckets.control, keys::PAUSED).await?;
            let mut record: PauseRecord =
                entry.as_ref().and_then(|e| decode(keys::PAUSED, &e.value).ok()).unwrap_or_default();
            match (stream, partition) {
                (None, _) => record.job = paused,
                (Some(s), None) => set(&mut record.streams, s.to_owned(), paused),
                (Some(s), Some(p)) => set(&mut record.partitions, format!("{s}/{p}"), paused),
            }
            let written = match &entry {
                Some(e) => self.broker.kv_update(&self.buckets.control, keys::PAUSED, json(&record), e.revision).await,
                None => self.broker.kv_create(&self.buckets.control, keys::PAUSED, json(&record)).await,
            };
            match written {
                Ok(_) => break record,
                Err(BrokerError::KvWrongRevision { .. } | BrokerError::KvKeyExists { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        let _ = self.broadcast(if paused { "pause" } else { "resume" }, &self.request()).await?;
        Ok(record)
    }

    /// Lets a paused partition process exactly one message. Returns the node that did.
    ///
    /// # Errors
    /// [`ControlError::Refused`] when the partition is not paused or nobody holds it.
    pub async fn step(&self, stream: &str, partition: u32) -> Result<String, ControlError> {
        self.check_scope(Some(stream), Some(partition)).await?;
        let mut request = self.request();
        request.stream = Some(stream.to_owned());
        request.partition = Some(partition);
        let replies = self.broadcast("step", &request).await?;
        if let Some(r) = replies.iter().find(|r| r.acted) {
            return Ok(r.node.clone());
        }
        if let Some(r) = replies.iter().find(|r| !r.ok) {
            return Err(ControlError::Refused(format!("{}: {}", r.node, r.message)));
        }
        Err(ControlError::Refused(format!("no live node holds {stream}/{partition} now; try again in a moment")))
    }
}

fn set(set: &mut BTreeSet<String>, item: String, on: bool) {
    if on {
        set.insert(item);
    } else {
        set.remove(&item);
    }
}
