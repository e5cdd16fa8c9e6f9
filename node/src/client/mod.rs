//! The control plane's client side: `status`, `drain`, `stop`, `shutdown`, `pause`,
//! `resume` and `step`, for the `flotilla` binary and for job binaries alike. It needs
//! no job code: the job's inputs and run come from its CONTROL bucket.
//!
//! Each command writes the desired state to the CONTROL bucket first (so a node that
//! is disconnected now catches up later), then sends the request on
//! `flotilla.<J>._ctl.…` with a fresh request id, retried with the same id when nobody
//! answers, and waits, with progress, for the outcome.

mod commands;
mod drain;
mod leave;
mod park;
mod pause;
mod status;

pub use commands::{ControlCommand, exit_code, run_command, run_command_typed};
pub use drain::PendingDrain;
pub use status::{ClusterStatus, PartitionStatus, print_status};

use crate::cluster::Buckets;
use flotilla_proto::cluster::control::{
    self as cluster, ControlReply, ControlRequest, RunRecord, TopologyRecord, decode, keys,
};
use flotilla_transport::broker::{BrokerError, CoreMessage, SharedBroker};
use flotilla_transport::kv::{KvError, TypedKey};
use flotilla_transport::wire::{JobName, MessageId, Subjects};
use futures::StreamExt;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// Why a control command failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The broker failed.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// The job was never started on this broker.
    #[error("job {0:?} has no control bucket on this server: start a node of it first (with --nats)")]
    UnknownJob(String),
    /// The command cannot be carried out as given.
    #[error("{0}")]
    Refused(String),
    /// The command ran but did not reach its goal.
    #[error("{0}")]
    Incomplete(String),
}

impl From<KvError> for ControlError {
    fn from(e: KvError) -> Self {
        match e {
            KvError::Broker(e) => ControlError::Broker(e),
            KvError::Contended { key, .. } => {
                ControlError::Incomplete(format!("the {key} record kept changing under other writers: try again"))
            }
            e @ KvError::Undecodable { .. } => ControlError::Refused(e.to_string()),
        }
    }
}

/// A connection to one job's control plane.
pub struct ControlClient {
    broker: SharedBroker,
    subjects: Subjects,
    buckets: Buckets,
    job: String,
    /// How long to collect replies to a broadcast.
    pub reply_window: Duration,
}

impl std::fmt::Debug for ControlClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlClient").field("job", &self.job).finish_non_exhaustive()
    }
}

fn json<T: Serialize>(v: &T) -> bytes::Bytes {
    bytes::Bytes::from(serde_json::to_vec(v).unwrap_or_default())
}

impl ControlClient {
    /// The record at `key` of the job's CONTROL bucket, typed.
    fn control_key<T: Serialize + serde::de::DeserializeOwned>(&self, key: &str) -> TypedKey<T> {
        TypedKey::new(self.broker.clone(), self.buckets.control.clone(), key)
    }

    /// Connects to the control plane of `job`.
    ///
    /// # Errors
    /// [`ControlError::UnknownJob`] when the job never ran on this broker.
    pub async fn new(broker: SharedBroker, job: &str) -> Result<Self, ControlError> {
        let name = JobName::new(job.to_owned()).map_err(|e| ControlError::Refused(e.to_string()))?;
        let subjects = Subjects::new(name);
        let buckets = Buckets::new(&subjects);
        match broker.kv_get(&buckets.control, keys::TOPOLOGY).await {
            Ok(Some(_)) => {}
            Ok(None) | Err(BrokerError::BucketNotFound { .. } | BrokerError::StreamNotFound { .. }) => {
                return Err(ControlError::UnknownJob(job.to_owned()));
            }
            Err(e) => return Err(e.into()),
        }
        Ok(Self { broker, subjects, buckets, job: job.to_owned(), reply_window: Duration::from_millis(1500) })
    }

    /// The job's inputs.
    ///
    /// # Errors
    /// Broker failures.
    pub async fn topology(&self) -> Result<TopologyRecord, ControlError> {
        Ok(match self.broker.kv_get(&self.buckets.control, keys::TOPOLOGY).await? {
            Some(e) => decode(keys::TOPOLOGY, &e.value).unwrap_or_default(),
            None => TopologyRecord::default(),
        })
    }

    /// The current run id.
    ///
    /// # Errors
    /// Broker failures.
    pub async fn run_id(&self) -> Result<Option<String>, ControlError> {
        Ok(match self.broker.kv_get(&self.buckets.control, keys::RUN).await? {
            Some(e) => decode::<RunRecord>(keys::RUN, &e.value).ok().map(|r| r.run_id),
            None => None,
        })
    }

    /// The live nodes.
    ///
    /// # Errors
    /// Broker failures.
    pub async fn members(&self) -> Result<BTreeSet<String>, ControlError> {
        // Listing a bucket whose keys are being rewritten (every node's heartbeat) can
        // stall its ordered consumer until the scan deadline (seen once on 2.9.10): a
        // fresh listing is tried before giving up.
        let mut attempt = 0;
        loop {
            match self.broker.kv_keys(&self.buckets.nodes).await {
                Ok(keys) => return Ok(keys.into_iter().collect()),
                Err(e @ BrokerError::TimedOut { .. }) if attempt < 2 => {
                    attempt += 1;
                    tracing::debug!(error = %e, attempt, "listing the members stalled; listing again");
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Sends `verb` to every node and collects the replies for the reply window (or
    /// until every live node answered). Retried twice with the same request id when
    /// live nodes stay silent.
    ///
    /// # Errors
    /// Broker failures.
    pub async fn broadcast(&self, verb: &str, request: &ControlRequest) -> Result<Vec<ControlReply>, ControlError> {
        let members = self.members().await?;
        let mut replies: BTreeMap<String, ControlReply> = BTreeMap::new();
        for _attempt in 0..3 {
            let inbox = format!("_INBOX.flotilla.{}", MessageId::new_v7());
            let mut sub = self.broker.subscribe(&inbox, None).await?;
            let mut msg = CoreMessage::new(self.subjects.control(&format!("all.{verb}")), json(request));
            msg.reply = Some(inbox);
            self.broker.core_publish(msg).await?;
            self.broker.flush().await?;
            let deadline = tokio::time::Instant::now() + self.reply_window;
            loop {
                if !members.is_empty() && members.iter().all(|m| replies.contains_key(m)) {
                    break;
                }
                match tokio::time::timeout_at(deadline, sub.next()).await {
                    Ok(Some(m)) => {
                        if let Ok(r) = decode::<ControlReply>("control reply", &m.payload) {
                            replies.entry(r.node.clone()).or_insert(r);
                        }
                    }
                    Ok(None) | Err(_) => break,
                }
            }
            // Retry (same request id) only when nobody answered: the request itself may
            // have been lost. A member that stays silent while others answer is dead or
            // stuck, and status reports it as silent.
            if members.is_empty() || !replies.is_empty() {
                break;
            }
        }
        Ok(replies.into_values().collect())
    }

    /// Sends `verb` to one node and waits for its reply (retried with the same id).
    ///
    /// # Errors
    /// [`ControlError::Incomplete`] when it never answered.
    pub async fn ask(&self, node: &str, verb: &str, request: &ControlRequest) -> Result<ControlReply, ControlError> {
        let subject = self.subjects.control(&format!("node.{node}.{verb}"));
        let mut last = String::new();
        for _attempt in 0..3 {
            match self.broker.request(CoreMessage::new(subject.clone(), json(request)), self.reply_window).await {
                Ok(m) => {
                    return serde_json::from_slice(&m.payload)
                        .map_err(|e| ControlError::Incomplete(format!("node {node} sent an unreadable reply: {e}")));
                }
                Err(e) => last = e.to_string(),
            }
        }
        Err(ControlError::Incomplete(format!("node {node} did not answer {verb}: {last}")))
    }

    fn request(&self) -> ControlRequest {
        ControlRequest {
            request_id: MessageId::new_v7().to_string(),
            run_id: None,
            stream: None,
            partition: None,
            offset: None,
        }
    }

    async fn check_scope(&self, stream: Option<&str>, partition: Option<u32>) -> Result<(), ControlError> {
        let topology = self.topology().await?;
        let Some(stream) = stream else { return Ok(()) };
        let Some(input) = topology.inputs.iter().find(|i| i.stream == stream) else {
            let known: Vec<&str> = topology.inputs.iter().map(|i| i.stream.as_str()).collect();
            return Err(ControlError::Refused(format!(
                "job {} has no input stream {stream:?}; its inputs: {}",
                self.job,
                known.join(", ")
            )));
        };
        if let Some(p) = partition {
            match input.partitions {
                Some(n) if p < n => {}
                Some(n) => {
                    return Err(ControlError::Refused(format!(
                        "{stream} has partitions 0..{n}; there is no partition {p}"
                    )));
                }
                None => return Err(ControlError::Refused(format!("{stream} is a queue input: it has no partitions"))),
            }
        }
        Ok(())
    }
}

/// Whether `verb` is one nodes answer.
pub fn known_verb(verb: &str) -> bool {
    cluster::VERBS.contains(&verb)
}
