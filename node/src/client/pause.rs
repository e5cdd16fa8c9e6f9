//! `pause`, `resume` and `step` of a paused partition.

use super::{ControlClient, ControlError};
use flotilla_proto::cluster::control::{PauseRecord, keys};
use flotilla_transport::kv::Edit;
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
        let record = self
            .control_key::<PauseRecord>(keys::PAUSED)
            // An operator's pause must not give up because nodes or tools write at once.
            .with_tries(1000)
            .modify(|record| {
                let mut record = record.unwrap_or_default();
                match (stream, partition) {
                    (None, _) => record.job = paused,
                    (Some(s), None) => set(&mut record.streams, s.to_owned(), paused),
                    (Some(s), Some(p)) => set(&mut record.partitions, format!("{s}/{p}"), paused),
                }
                Edit::Write(record.clone(), record)
            })
            .await?;
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
