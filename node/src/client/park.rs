//! `park`, `unpark` and `step --key`: one key of a queue input set aside and let back.

use super::{ControlClient, ControlError};
use flotilla_proto::cluster::control::{ParkedRecord, keys};
use flotilla_transport::kv::Edit;
use flotilla_transport::wire::StreamName;
use std::time::Duration;

impl ControlClient {
    /// Parks (`on`) or unparks a key of a queue input. Parking writes the desired state;
    /// nodes set the key's messages aside from their next scan on. Unparking sends the
    /// messages set aside back to the queue in their order (let through even where the
    /// park is still seen), clears the key, and after a scan interval sends back any
    /// message a node parked meanwhile. Returns how many messages are (were) set aside.
    ///
    /// # Errors
    /// [`ControlError::Refused`] for a stream that is not a queue input of the job.
    pub async fn park(&self, stream: &str, key: &str, on: bool) -> Result<usize, ControlError> {
        self.check_queue(stream).await?;
        if on {
            self.change_parked(stream, key, true).await?;
            return Ok(self.parked_messages(stream, key).await?.len());
        }
        let mut moved = self.send_back(stream, key, usize::MAX).await?;
        self.change_parked(stream, key, false).await?;
        // Nodes see the change at their next scans; what one parked meanwhile goes back
        // too. (`status` counts messages still set aside; `unpark` again sends them.)
        for wait in [3, 10] {
            tokio::time::sleep(Duration::from_secs(wait)).await;
            moved += self.send_back(stream, key, usize::MAX).await?;
        }
        Ok(moved)
    }

    /// Lets the oldest message set aside of a parked key run; returns its sequence in
    /// the queue stream it came from.
    ///
    /// # Errors
    /// [`ControlError::Refused`] when none is set aside.
    pub async fn step_key(&self, stream: &str, key: &str) -> Result<u64, ControlError> {
        self.check_queue(stream).await?;
        let parked = self.parked_messages(stream, key).await?;
        let Some((seq, _)) = parked.first() else {
            return Err(ControlError::Refused(format!("no message of key {key:?} of {stream} is set aside")));
        };
        let seq = *seq;
        self.send_back(stream, key, 1).await?;
        Ok(seq)
    }

    async fn check_queue(&self, stream: &str) -> Result<(), ControlError> {
        self.check_scope(Some(stream), None).await?;
        let topology = self.topology().await?;
        if topology.inputs.iter().any(|i| i.stream == stream && i.partitions.is_some()) {
            return Err(ControlError::Refused(format!(
                "{stream} is an ordered input: its keys share partitions, so pause a partition (pause --stream {stream} --partition P); park --key is for queue inputs"
            )));
        }
        Ok(())
    }

    async fn change_parked(&self, stream: &str, key: &str, on: bool) -> Result<(), ControlError> {
        self.control_key::<ParkedRecord>(keys::PARKED)
            .modify(|record| {
                let mut record = record.unwrap_or_default();
                let keys = record.keys.entry(stream.to_owned()).or_default();
                let changed = if on { keys.insert(key.to_owned()) } else { keys.remove(key) };
                record.keys.retain(|_, k| !k.is_empty());
                if changed { Edit::Write(record, ()) } else { Edit::Keep(()) }
            })
            .await?;
        Ok(())
    }

    /// The messages set aside for `key` of `stream`: (sequence in the queue stream,
    /// the stored parked message), oldest first.
    async fn parked_messages(
        &self,
        stream: &str,
        key: &str,
    ) -> Result<Vec<(u64, flotilla_transport::broker::StoredMessage)>, ControlError> {
        let name = StreamName::new(stream.to_owned()).map_err(|e| ControlError::Refused(e.to_string()))?;
        Ok(flotilla_actors::parked::set_aside(&self.broker, &self.subjects, &name, key).await?)
    }

    /// Sends up to `limit` messages set aside for `key` back to the queue, oldest
    /// first, let through although the key may still be parked; returns how many.
    async fn send_back(&self, stream: &str, key: &str, limit: usize) -> Result<usize, ControlError> {
        let name = StreamName::new(stream.to_owned()).map_err(|e| ControlError::Refused(e.to_string()))?;
        Ok(flotilla_actors::parked::send_back(&self.broker, &self.subjects, &name, key, limit).await?)
    }
}
