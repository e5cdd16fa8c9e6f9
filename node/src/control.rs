//! The control plane's client side: `status`, `drain`, `stop`, `shutdown`, `pause`,
//! `resume` and `step`, for the `flotilla` binary and for job binaries alike. It needs
//! no job code: the job's inputs and run come from its CONTROL bucket.
//!
//! Each command writes the desired state to the CONTROL bucket first (so a node that
//! is disconnected now catches up later), then sends the request on
//! `flotilla.<J>._ctl.…` with a fresh request id, retried with the same id when nobody
//! answers, and waits, with progress, for the outcome.

use flotilla_actors::cluster::{
    self, ControlReply, ControlRequest, DrainedRecord, LeaseRecord, NodeStatus, ParkedRecord, PauseRecord,
    RequestRecord, RunRecord, SlotStatus, TopologyRecord, keys, now_ms,
};
use flotilla_actors::membership::Buckets;
use flotilla_transport::broker::{BrokerError, CoreMessage, OutboundMessage, SharedBroker};
use flotilla_transport::wire::{JobName, MessageId, StreamName, Subjects, headers};
use futures::StreamExt;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// A control command (a subcommand of `flotilla` and of every job binary).
#[derive(Debug, Clone, clap::Subcommand)]
pub enum ControlCommand {
    /// Show nodes, leases with their epochs, in-flight work, deliveries, backlog and the DLQ.
    #[command(
        after_help = "Example:\n  flotilla --job relay status\n  flotilla --job relay status --json | jq .partitions"
    )]
    Status {
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Append a drain marker to every ordered partition and wait until all are processed.
    #[command(
        after_help = "Examples:\n  flotilla --job relay drain --deadline 5m\n  flotilla --job relay drain --cancel"
    )]
    Drain {
        /// Give up (exit 1, naming what is stuck) after this long.
        #[arg(long, default_value = "2m", value_parser = crate::config::parse_duration)]
        deadline: Duration,
        /// The run to drain (default: the current one; another one is refused).
        #[arg(long)]
        run: Option<String>,
        /// Cancel a pending drain instead: a new run begins, so nodes started from now
        /// on pass the old run's markers (nodes still running keep draining until restarted).
        #[arg(long, conflicts_with = "run")]
        cancel: bool,
    },
    /// Make one node leave gracefully (its partitions move with no redelivery).
    #[command(after_help = "Example:\n  flotilla --job relay stop --node b")]
    Stop {
        /// The node id (see `status`).
        #[arg(long)]
        node: String,
        /// How long to wait for it to leave.
        #[arg(long, default_value = "60s", value_parser = crate::config::parse_duration)]
        timeout: Duration,
    },
    /// Make every node leave and exit; waits until each has.
    #[command(after_help = "Example:\n  flotilla --job relay shutdown --timeout 2m")]
    Shutdown {
        /// How long to wait for the nodes to leave.
        #[arg(long, default_value = "60s", value_parser = crate::config::parse_duration)]
        timeout: Duration,
    },
    /// Stop intake for the job, a stream or one partition.
    #[command(after_help = "Example:\n  flotilla --job relay pause --stream relay-in --partition 3")]
    Pause {
        /// Only this stream.
        #[arg(long)]
        stream: Option<String>,
        /// Only this partition of --stream.
        #[arg(long, requires = "stream")]
        partition: Option<u32>,
    },
    /// Undo a pause (the same scope that was paused).
    #[command(after_help = "Example:\n  flotilla --job relay resume --stream relay-in --partition 3")]
    Resume {
        /// Only this stream.
        #[arg(long)]
        stream: Option<String>,
        /// Only this partition of --stream.
        #[arg(long, requires = "stream")]
        partition: Option<u32>,
    },
    /// Process exactly one message of a paused partition, or of a parked key.
    #[command(
        after_help = "Examples:\n  flotilla --job relay step --stream relay-in --partition 3\n  flotilla --job shop step --stream refunds --key customer-7"
    )]
    Step {
        /// The stream.
        #[arg(long)]
        stream: String,
        /// The partition (ordered inputs).
        #[arg(long, required_unless_present = "key", conflicts_with = "key")]
        partition: Option<u32>,
        /// The parked key (queue inputs): its oldest message runs.
        #[arg(long)]
        key: Option<String>,
    },
    /// Park one key of a queue input: its messages are set aside, in order, while the
    /// others keep flowing (until `unpark`; `step --key` lets one through).
    #[command(after_help = "Example:\n  flotilla --job shop park --stream refunds --key customer-7")]
    Park {
        /// The queue input.
        #[arg(long)]
        stream: String,
        /// The key.
        #[arg(long)]
        key: String,
    },
    /// Unpark a key: its messages set aside go back to the queue in their order.
    #[command(after_help = "Example:\n  flotilla --job shop unpark --stream refunds --key customer-7")]
    Unpark {
        /// The queue input.
        #[arg(long)]
        stream: String,
        /// The key.
        #[arg(long)]
        key: String,
    },
    /// A live view of the job in the terminal: nodes, partitions with owner, backlog,
    /// age and rate, the DLQ, drains and moves (the dashboard's view; `--http` serves it
    /// as a page).
    #[command(after_help = "Examples:\n  flotilla --job relay top\n  flotilla --job relay top --once --interval 2s")]
    Top {
        /// How often to redraw (rates are over this interval).
        #[arg(long, default_value = "2s", value_parser = crate::config::parse_duration)]
        interval: Duration,
        /// Print one screen (after one interval, for the rates) and exit.
        #[arg(long)]
        once: bool,
    },
    /// Dead letters: list, show, replay, purge.
    Dlq {
        /// What to do.
        #[command(subcommand)]
        command: crate::dlq::DlqCommand,
    },
}

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

/// One partition in `status`.
#[derive(Debug, Clone, Serialize)]
pub struct PartitionStatus {
    /// The stream.
    pub stream: String,
    /// The partition (`None` for a queue input).
    pub partition: Option<u32>,
    /// The node holding the lease.
    pub owner: Option<String>,
    /// The lease epoch.
    pub epoch: Option<u64>,
    /// Messages not yet committed / acked.
    pub backlog: u64,
    /// Age of the oldest message after the committed position, in ms.
    pub oldest_ms: u64,
    /// In flight on the owner.
    pub in_flight: u64,
    /// Delivered to the owner (since it took the partition).
    pub deliveries: u64,
    /// Of those, redeliveries.
    pub redeliveries: u64,
    /// Intake paused.
    pub paused: bool,
    /// Drained in the current run.
    pub drained: bool,
}

/// A drain requested for the current run and not finished.
#[derive(Debug, Clone, Serialize)]
pub struct PendingDrain {
    /// The run.
    pub run_id: String,
    /// When it was requested (ms since the Unix epoch).
    pub issued_ms: u64,
    /// Partitions drained so far.
    pub drained: usize,
    /// Ordered partitions in all.
    pub partitions: usize,
}

/// The whole `status`.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterStatus {
    /// The job.
    pub job: String,
    /// The current run.
    pub run_id: Option<String>,
    /// Live nodes (from the membership bucket).
    pub members: Vec<String>,
    /// What each answering node said.
    pub nodes: Vec<NodeStatus>,
    /// Members that did not answer in time.
    pub silent: Vec<String>,
    /// Per partition (and queue input).
    pub partitions: Vec<PartitionStatus>,
    /// Messages in the dead-letter stream.
    pub dlq: u64,
    /// Bytes in the dead-letter stream (its size against any limit an operator set).
    #[serde(default)]
    pub dlq_bytes: u64,
    /// Age of the oldest dead letter, in milliseconds (`None` when there is none).
    #[serde(default)]
    pub dlq_oldest_age_ms: Option<u64>,
    /// A drain of the current run that has not ended: it makes every node of the run
    /// drain and exit, those started later too, until it ends or is cancelled.
    pub pending_drain: Option<PendingDrain>,
    /// Parked keys of queue inputs (stream → keys).
    pub parked_keys: BTreeMap<String, BTreeSet<String>>,
    /// Messages set aside for parked keys, all streams.
    pub parked_messages: u64,
    /// Records stored where no consumer reads them, per subject: on partitions an
    /// ordered input does not have (only a stream created before streams listed their
    /// partitions takes them).
    pub unreachable: BTreeMap<String, u64>,
    /// What is paused.
    pub paused: PauseRecord,
}

fn json<T: Serialize>(v: &T) -> bytes::Bytes {
    bytes::Bytes::from(serde_json::to_vec(v).unwrap_or_default())
}

impl ControlClient {
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
            Some(e) => serde_json::from_slice(&e.value).unwrap_or_default(),
            None => TopologyRecord::default(),
        })
    }

    /// The current run id.
    ///
    /// # Errors
    /// Broker failures.
    pub async fn run_id(&self) -> Result<Option<String>, ControlError> {
        Ok(match self.broker.kv_get(&self.buckets.control, keys::RUN).await? {
            Some(e) => serde_json::from_slice::<RunRecord>(&e.value).ok().map(|r| r.run_id),
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
                        if let Ok(r) = serde_json::from_slice::<ControlReply>(&m.payload) {
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

    /// Records of an ordered stream with `partitions` partitions on subjects no
    /// partition consumer reads. Only a stream whose subjects are a wildcard can hold
    /// any, so others cost one stream info.
    async fn unreachable(&self, stream: &StreamName, partitions: u32) -> Result<BTreeMap<String, u64>, ControlError> {
        let js = self.subjects.stream_name(stream);
        let all = self.subjects.ordered_all(stream);
        match self.broker.stream_state(&js).await {
            Ok(s) if s.subjects.contains(&all) => {}
            Ok(_) | Err(BrokerError::StreamNotFound { .. }) => return Ok(BTreeMap::new()),
            Err(e) => return Err(e.into()),
        }
        let counts = self.broker.subject_counts(&js, &all).await?;
        let read: BTreeSet<String> = (0..partitions).map(|p| self.subjects.ordered_partition(stream, p)).collect();
        Ok(counts.into_iter().filter(|(subject, _)| !read.contains(subject)).collect())
    }

    /// One partition's line of `status`, given what the nodes said of it (`slots`).
    async fn partition_status(
        &self,
        (stream, name, p): (String, StreamName, Option<u32>),
        slots: &[&SlotStatus],
        paused: &PauseRecord,
        run_id: &Option<String>,
    ) -> Result<PartitionStatus, ControlError> {
        let js = self.subjects.stream_name(&name);
        let consumer = match p {
            Some(p) => Subjects::partition_consumer(&name, p),
            None => Subjects::queue_consumer(&name),
        };
        let (backlog, oldest_ms) = match self.broker.consumer_state(&js, &consumer).await {
            Ok(c) => {
                let age = match self.broker.get_message(&js, c.ack_floor + 1).await {
                    Ok(Some(m)) if c.num_pending + c.num_ack_pending > 0 => {
                        std::time::SystemTime::now().duration_since(m.published).unwrap_or_default()
                    }
                    _ => Duration::ZERO,
                };
                (c.num_pending + c.num_ack_pending, age.as_millis() as u64)
            }
            Err(_) => (0, 0),
        };
        let lease = match p {
            Some(p) => match self.broker.kv_get(&self.buckets.leases, &keys::lease(&stream, p)).await? {
                Some(e) => serde_json::from_slice::<LeaseRecord>(&e.value).ok(),
                None => None,
            },
            None => None,
        };
        let drained = match (p, &run_id) {
            (Some(p), Some(run)) => {
                match self.broker.kv_get(&self.buckets.control, &keys::drained(&stream, p)).await? {
                    Some(e) => serde_json::from_slice::<DrainedRecord>(&e.value).is_ok_and(|r| &r.run_id == run),
                    None => false,
                }
            }
            _ => false,
        };
        Ok(PartitionStatus {
            paused: paused.covers(&stream, p),
            stream,
            partition: p,
            owner: lease.as_ref().map(|l| l.node.clone()),
            epoch: slots.iter().map(|s| s.epoch).max().filter(|e| *e > 0),
            backlog,
            oldest_ms,
            in_flight: slots.iter().map(|s| s.in_flight).sum(),
            deliveries: slots.iter().map(|s| s.deliveries).sum(),
            redeliveries: slots.iter().map(|s| s.redeliveries).sum(),
            drained,
        })
    }

    /// Everything `status` shows.
    ///
    /// # Errors
    /// Broker failures.
    pub async fn status(&self) -> Result<ClusterStatus, ControlError> {
        let topology = self.topology().await?;
        let run_id = self.run_id().await?;
        let members = self.members().await?;
        let replies = self.broadcast("status", &self.request()).await?;
        let mut nodes: Vec<NodeStatus> = replies.into_iter().filter_map(|r| r.status).collect();
        // A node with many partitions answers in pages: fetch the rest.
        for n in &mut nodes {
            while let Some(from) = n.more_from.take() {
                let page = ControlRequest { offset: Some(from), ..self.request() };
                let reply = self.ask(&n.node, "status", &page).await?;
                let Some(more) = reply.status else {
                    return Err(ControlError::Incomplete(format!(
                        "node {} sent no status page: {}",
                        n.node, reply.message
                    )));
                };
                if more.slots.is_empty() {
                    break;
                }
                n.slots.extend(more.slots);
                n.more_from = more.more_from;
            }
        }
        let silent = members.iter().filter(|m| !nodes.iter().any(|n| &n.node == *m)).cloned().collect();
        let paused: PauseRecord = match self.broker.kv_get(&self.buckets.control, keys::PAUSED).await? {
            Some(e) => serde_json::from_slice(&e.value).unwrap_or_default(),
            None => PauseRecord::default(),
        };
        // Every partition's consumer, lease and drain record: read 64 at a time, in
        // order (a job with 10,000 partitions would otherwise take 40,000 round trips
        // one after the other).
        let mut targets = Vec::new();
        for input in &topology.inputs {
            let Ok(name) = StreamName::new(input.stream.clone()) else { continue };
            match input.partitions {
                Some(n) => targets.extend((0..n).map(|p| (input.stream.clone(), name.clone(), Some(p)))),
                None => targets.push((input.stream.clone(), name, None)),
            }
        }
        let mut by_partition: BTreeMap<(String, Option<u32>), Vec<&SlotStatus>> = BTreeMap::new();
        for slot in nodes.iter().flat_map(|n| &n.slots) {
            by_partition.entry((slot.stream.clone(), slot.partition)).or_default().push(slot);
        }
        let (paused_ref, run_ref, none) = (&paused, &run_id, Vec::new());
        let partitions: Vec<PartitionStatus> = futures::stream::iter(targets)
            .map(|target| {
                let slots = by_partition.get(&(target.0.clone(), target.2)).unwrap_or(&none);
                self.partition_status(target, slots, paused_ref, run_ref)
            })
            .buffered(64)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        let dlq_state = self.broker.stream_state(&self.subjects.dlq_stream_name()).await.ok();
        let dlq = dlq_state.as_ref().map_or(0, |s| s.messages);
        let dlq_bytes = dlq_state.as_ref().map_or(0, |s| s.bytes);
        let dlq_oldest_age_ms = dlq_state
            .and_then(|s| s.first_published)
            .map(|t| std::time::SystemTime::now().duration_since(t).unwrap_or_default().as_millis() as u64);
        let mut unreachable = BTreeMap::new();
        for input in &topology.inputs {
            let (Ok(name), Some(n)) = (StreamName::new(input.stream.clone()), input.partitions) else { continue };
            // A diagnostic: when it cannot be read, status says the rest.
            match self.unreachable(&name, n).await {
                Ok(found) => unreachable.extend(found),
                Err(e) => tracing::warn!(stream = %name, error = %e, "could not count records on missing partitions"),
            }
        }
        let pending_drain = match &run_id {
            Some(run) => self.pending_drain(run, &topology).await?,
            None => None,
        };
        let parked_keys = match self.broker.kv_get(&self.buckets.control, keys::PARKED).await? {
            Some(e) => serde_json::from_slice::<ParkedRecord>(&e.value).unwrap_or_default().keys,
            None => BTreeMap::new(),
        };
        let parked_messages =
            self.broker.stream_state(&self.subjects.parked_stream_name()).await.map(|s| s.messages).unwrap_or(0);
        Ok(ClusterStatus {
            pending_drain,
            parked_keys,
            parked_messages,
            job: self.job.clone(),
            run_id,
            members: members.into_iter().collect(),
            nodes,
            silent,
            partitions,
            dlq,
            dlq_bytes,
            dlq_oldest_age_ms,
            unreachable,
            paused,
        })
    }

    /// The drain of `run` when one was requested and not every partition finished it.
    async fn pending_drain(&self, run: &str, topology: &TopologyRecord) -> Result<Option<PendingDrain>, ControlError> {
        let Some(entry) = self.broker.kv_get(&self.buckets.control, keys::DRAIN).await? else { return Ok(None) };
        let Ok(record) = serde_json::from_slice::<RequestRecord>(&entry.value) else { return Ok(None) };
        if record.run_id != run {
            return Ok(None);
        }
        let parts = topology.partitions();
        let mut drained = 0;
        for (stream, p) in &parts {
            let drained_here = match self.broker.kv_get(&self.buckets.control, &keys::drained(stream, *p)).await? {
                Some(e) => serde_json::from_slice::<DrainedRecord>(&e.value).is_ok_and(|r| r.run_id == run),
                None => false,
            };
            // An ended partition never reaches a drain marker: it counts as done.
            let ended_here = match self.broker.kv_get(&self.buckets.control, &keys::ended(stream, *p)).await? {
                Some(e) => serde_json::from_slice::<cluster::EndedRecord>(&e.value).is_ok_and(|r| r.run_id == run),
                None => false,
            };
            if drained_here || ended_here {
                drained += 1;
            }
        }
        Ok((drained < parts.len()).then(|| PendingDrain {
            run_id: run.to_owned(),
            issued_ms: record.issued_ms,
            drained,
            partitions: parts.len(),
        }))
    }

    /// Cancels the current run's pending drain: a new run begins (its id in the CONTROL
    /// bucket), so nodes that start from now on pass the old run's markers and take the
    /// drained partitions up again; nodes still running in the old run keep draining
    /// until they are restarted. Returns what happened, for people.
    ///
    /// # Errors
    /// Broker failures; [`ControlError::Incomplete`] when the run changed meanwhile.
    pub async fn cancel_drain(&self) -> Result<String, ControlError> {
        let Some(entry) = self.broker.kv_get(&self.buckets.control, keys::RUN).await? else {
            return Ok("no drain is pending: the job has no run yet".into());
        };
        let current = serde_json::from_slice::<RunRecord>(&entry.value)
            .map_err(|e| ControlError::Refused(format!("the job's run record does not parse: {e}")))?;
        let topology = self.topology().await?;
        if self.pending_drain(&current.run_id, &topology).await?.is_none() {
            return Ok(format!("no drain is pending for run {}: nothing was changed", current.run_id));
        }
        let fresh = RunRecord { run_id: MessageId::new_v7().to_string(), started_ms: now_ms() };
        match self.broker.kv_update(&self.buckets.control, keys::RUN, json(&fresh), entry.revision).await {
            Ok(_) => {}
            Err(BrokerError::KvWrongRevision { .. }) => {
                return Err(ControlError::Incomplete(
                    "the run changed while cancelling (a node began a new one): check `status` and try again".into(),
                ));
            }
            Err(e) => return Err(e.into()),
        }
        // The drain record stays: it names the old run, so nodes of the new run ignore it
        // and nodes still in the old run keep draining as they were asked.
        let live = self.members().await?.len();
        Ok(format!(
            "drain of run {} cancelled: run {} begins, and nodes started from now on pass the old markers{}",
            current.run_id,
            fresh.run_id,
            if live > 0 {
                format!(
                    "; the {live} node(s) still running keep draining run {}: restart them (`stop --node ID`, then start) to join the new run",
                    current.run_id
                )
            } else {
                String::new()
            }
        ))
    }

    /// Appends a drain marker to every ordered partition, then waits until each
    /// partition has processed everything before it (or the deadline passes).
    ///
    /// # Errors
    /// [`ControlError::Refused`] for a stale run, [`ControlError::Incomplete`] naming the
    /// partitions still short of their marker at the deadline.
    pub async fn drain(&self, run: Option<String>, deadline: Duration, progress: bool) -> Result<(), ControlError> {
        let current = self.run_id().await?.ok_or_else(|| ControlError::Refused("the job has no run yet".into()))?;
        if let Some(r) = &run
            && *r != current
        {
            return Err(ControlError::Refused(format!(
                "stale run id {r}: the current run is {current}; nothing was changed"
            )));
        }
        let topology = self.topology().await?;
        let parts = topology.partitions();
        if parts.is_empty() {
            return Err(ControlError::Refused(format!(
                "job {} has no ordered inputs: drain markers only apply to ordered partitions (use shutdown for queue inputs)",
                self.job
            )));
        }
        let mut request = self.request();
        request.run_id = Some(current.clone());
        let record =
            RequestRecord { request_id: request.request_id.clone(), run_id: current.clone(), issued_ms: now_ms() };
        self.broker.kv_put(&self.buckets.control, keys::DRAIN, json(&record)).await?;
        let mut markers = BTreeMap::new();
        for (stream, p) in &parts {
            let name = StreamName::new(stream.clone()).map_err(|e| ControlError::Refused(e.to_string()))?;
            let msg = OutboundMessage::new(self.subjects.ordered_partition(&name, *p), bytes::Bytes::new())
                .with_id(format!("drain-{current}-{stream}-{p}"))
                .with_header(headers::KIND, "drain")
                .with_header(headers::RUN, current.clone());
            let ack = self.broker.publish(msg).await?;
            markers.insert((stream.clone(), *p), ack.seq);
        }
        if progress {
            crate::outln!(
                "drain: markers of run {current} appended to {} partitions; waiting (deadline {deadline:?})",
                parts.len()
            );
        }
        let _ = self.broadcast("drain", &request).await;
        let started = Instant::now();
        let mut last_done = usize::MAX;
        loop {
            let mut done = BTreeSet::new();
            for (stream, p) in &parts {
                if let Some(e) = self.broker.kv_get(&self.buckets.control, &keys::drained(stream, *p)).await?
                    && serde_json::from_slice::<DrainedRecord>(&e.value).is_ok_and(|r| r.run_id == current)
                {
                    done.insert((stream.clone(), *p));
                } else if let Some(e) = self.broker.kv_get(&self.buckets.control, &keys::ended(stream, *p)).await?
                    && serde_json::from_slice::<cluster::EndedRecord>(&e.value).is_ok_and(|r| r.run_id == current)
                {
                    // Ended in this run: no marker will be reached there.
                    done.insert((stream.clone(), *p));
                }
            }
            if done.len() != last_done && progress {
                last_done = done.len();
                let waiting: Vec<String> =
                    parts.iter().filter(|p| !done.contains(*p)).map(|(s, p)| format!("{s}/{p}")).collect();
                crate::outln!(
                    "drain: {}/{} partitions drained ({:.1}s){}",
                    done.len(),
                    parts.len(),
                    started.elapsed().as_secs_f64(),
                    if waiting.is_empty() { String::new() } else { format!("; waiting for {}", waiting.join(" ")) }
                );
            }
            if done.len() == parts.len() {
                if progress {
                    crate::outln!("drain: done; every partition processed everything before its marker");
                }
                return Ok(());
            }
            if started.elapsed() >= deadline {
                let mut stuck = Vec::new();
                for (stream, p) in parts.iter().filter(|p| !done.contains(*p)) {
                    let name = StreamName::new(stream.clone()).map_err(|e| ControlError::Refused(e.to_string()))?;
                    let js = self.subjects.stream_name(&name);
                    let floor = self
                        .broker
                        .consumer_state(&js, &Subjects::partition_consumer(&name, *p))
                        .await
                        .map(|c| c.ack_floor)
                        .unwrap_or(0);
                    let owner = match self.broker.kv_get(&self.buckets.leases, &keys::lease(stream, *p)).await? {
                        Some(e) => serde_json::from_slice::<LeaseRecord>(&e.value).map(|l| l.node).unwrap_or_default(),
                        None => "nobody".into(),
                    };
                    let marker = markers.get(&(stream.clone(), *p)).copied().unwrap_or(0);
                    stuck.push(format!(
                        "{stream}/{p} (held by {owner}; committed up to stream seq {floor}, marker at {marker})"
                    ));
                }
                return Err(ControlError::Incomplete(format!(
                    "drain deadline {deadline:?} passed with {} of {} partitions not drained: {}",
                    stuck.len(),
                    parts.len(),
                    stuck.join(", ")
                )));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn wait_gone(&self, nodes: &BTreeSet<String>, timeout: Duration, progress: bool) -> Result<(), ControlError> {
        let started = Instant::now();
        let mut last = usize::MAX;
        loop {
            let live = self.members().await?;
            let left: Vec<&String> = nodes.iter().filter(|n| live.contains(*n)).collect();
            if left.len() != last && progress {
                last = left.len();
                if left.is_empty() {
                    crate::outln!("all {} node(s) have left ({:.1}s)", nodes.len(), started.elapsed().as_secs_f64());
                } else {
                    let names: Vec<&str> = left.iter().map(|s| s.as_str()).collect();
                    crate::outln!(
                        "waiting for {} of {} node(s) to leave: {}",
                        left.len(),
                        nodes.len(),
                        names.join(", ")
                    );
                }
            }
            if left.is_empty() {
                return Ok(());
            }
            if started.elapsed() >= timeout {
                let names: Vec<&str> = left.iter().map(|s| s.as_str()).collect();
                return Err(ControlError::Incomplete(format!(
                    "timeout {timeout:?}: still alive: {}",
                    names.join(", ")
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Makes `node` leave gracefully and waits until it has.
    ///
    /// # Errors
    /// [`ControlError::Refused`] when `node` is not a live member.
    pub async fn stop(&self, node: &str, timeout: Duration, progress: bool) -> Result<(), ControlError> {
        let members = self.members().await?;
        if !members.contains(node) {
            let live: Vec<&str> = members.iter().map(String::as_str).collect();
            return Err(ControlError::Refused(format!(
                "node {node:?} is not a live member of job {}; live nodes: {}",
                self.job,
                if live.is_empty() { "none".to_owned() } else { live.join(", ") }
            )));
        }
        let request = self.request();
        let record = RequestRecord {
            request_id: request.request_id.clone(),
            run_id: self.run_id().await?.unwrap_or_default(),
            issued_ms: now_ms(),
        };
        self.broker.kv_put(&self.buckets.control, &keys::stop(node), json(&record)).await?;
        match self.ask(node, "stop", &request).await {
            Ok(r) if progress => crate::outln!("{}: {}", r.node, r.message),
            Ok(_) => {}
            // It reads the desired state on its next scan anyway.
            Err(e) if progress => crate::outln!("{e}; it will read the stop request from the control bucket"),
            Err(_) => {}
        }
        self.wait_gone(&BTreeSet::from([node.to_owned()]), timeout, progress).await
    }

    /// Makes every node leave and exit, and waits until each has.
    ///
    /// # Errors
    /// [`ControlError::Incomplete`] naming the nodes still alive at the timeout.
    pub async fn shutdown(&self, timeout: Duration, progress: bool) -> Result<(), ControlError> {
        let members = self.members().await?;
        let request = self.request();
        let record = RequestRecord {
            request_id: request.request_id.clone(),
            run_id: self.run_id().await?.unwrap_or_default(),
            issued_ms: now_ms(),
        };
        self.broker.kv_put(&self.buckets.control, keys::SHUTDOWN, json(&record)).await?;
        if progress {
            crate::outln!("shutdown requested; {} live node(s)", members.len());
        }
        let replies = self.broadcast("shutdown", &request).await?;
        if progress {
            for r in &replies {
                crate::outln!("{}: {}", r.node, r.message);
            }
        }
        self.wait_gone(&members, timeout, progress).await
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
                entry.as_ref().and_then(|e| serde_json::from_slice(&e.value).ok()).unwrap_or_default();
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
        for _ in 0..10 {
            let entry = self.broker.kv_get(&self.buckets.control, keys::PARKED).await?;
            let mut record: ParkedRecord =
                entry.as_ref().and_then(|e| serde_json::from_slice(&e.value).ok()).unwrap_or_default();
            let keys = record.keys.entry(stream.to_owned()).or_default();
            let changed = if on { keys.insert(key.to_owned()) } else { keys.remove(key) };
            record.keys.retain(|_, k| !k.is_empty());
            if !changed {
                return Ok(());
            }
            let written = match &entry {
                Some(e) => self.broker.kv_update(&self.buckets.control, keys::PARKED, json(&record), e.revision).await,
                None => self.broker.kv_create(&self.buckets.control, keys::PARKED, json(&record)).await,
            };
            match written {
                Ok(_) => return Ok(()),
                Err(BrokerError::KvWrongRevision { .. } | BrokerError::KvKeyExists { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ControlError::Incomplete("the parked keys kept changing: try again".into()))
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

fn set(set: &mut BTreeSet<String>, item: String, on: bool) {
    if on {
        set.insert(item);
    } else {
        set.remove(&item);
    }
}

/// Prints `status` as tables.
pub fn print_status(s: &ClusterStatus) {
    let dlq_detail = match s.dlq_oldest_age_ms {
        Some(age) if s.dlq > 0 => {
            format!(" ({} bytes, oldest {})", s.dlq_bytes, humantime::format_duration(Duration::from_secs(age / 1000)))
        }
        _ => String::new(),
    };
    crate::outln!(
        "job {} · run {} · {} live node(s) · DLQ {} message(s){dlq_detail}{}",
        s.job,
        s.run_id.as_deref().unwrap_or("-"),
        s.members.len(),
        s.dlq,
        if s.paused.job { " · PAUSED" } else { "" }
    );
    if let Some(d) = &s.pending_drain {
        let age = now_ms().saturating_sub(d.issued_ms) / 1000;
        crate::outln!(
            "DRAIN PENDING: run {} asked to drain {age}s ago, {}/{} partitions drained; every node of the run drains and exits, also those started later (`drain --cancel` cancels it)",
            d.run_id,
            d.drained,
            d.partitions
        );
    }
    for (stream, keys) in &s.parked_keys {
        let keys: Vec<String> = keys.iter().map(|k| format!("{k:?}")).collect();
        crate::outln!("PARKED: {stream} keys {} (`unpark --stream {stream} --key K` sends them back)", keys.join(", "));
    }
    if s.parked_messages > 0 {
        crate::outln!("{} message(s) set aside for parked keys", s.parked_messages);
    }
    for (subject, n) in &s.unreachable {
        crate::outln!(
            "UNREACHABLE: {n} record(s) on {subject}, a partition the stream does not have: no consumer reads them (`nats stream purge <stream> --subject {subject}` drops them)"
        );
    }
    crate::outln!();
    crate::outln!(
        "{:<24} {:>8} {:>6} {:>9} {:>11} {:>13}  STATE",
        "NODE",
        "PID",
        "SLOTS",
        "IN-FLIGHT",
        "DELIVERIES",
        "REDELIVERIES"
    );
    for n in &s.nodes {
        crate::outln!(
            "{:<24} {:>8} {:>6} {:>9} {:>11} {:>13}  {}",
            n.node,
            n.pid,
            n.slots.len(),
            n.slots.iter().map(|x| x.in_flight).sum::<u64>(),
            n.slots.iter().map(|x| x.deliveries).sum::<u64>(),
            n.slots.iter().map(|x| x.redeliveries).sum::<u64>(),
            if n.leaving { "leaving" } else { "running" }
        );
    }
    for m in &s.silent {
        crate::outln!("{m:<24} {:>8} (did not answer)", "?");
    }
    crate::outln!();
    crate::outln!(
        "{:<20} {:<24} {:>7} {:>9} {:>10} {:>9} {:>11} {:>13}  FLAGS",
        "PARTITION",
        "OWNER",
        "EPOCH",
        "BACKLOG",
        "OLDEST",
        "IN-FLIGHT",
        "DELIVERIES",
        "REDELIVERIES"
    );
    for p in &s.partitions {
        let name = match p.partition {
            Some(n) => format!("{}/{n}", p.stream),
            None => format!("{} (queue)", p.stream),
        };
        let mut flags = Vec::new();
        if p.paused {
            flags.push("paused");
        }
        if p.drained {
            flags.push("drained");
        }
        crate::outln!(
            "{:<20} {:<24} {:>7} {:>9} {:>10} {:>9} {:>11} {:>13}  {}",
            name,
            p.owner.as_deref().unwrap_or(if p.partition.is_some() { "-" } else { "(every node)" }),
            p.epoch.map_or("-".to_owned(), |e| e.to_string()),
            p.backlog,
            if p.oldest_ms == 0 { "-".to_owned() } else { format!("{:.1}s", p.oldest_ms as f64 / 1000.0) },
            p.in_flight,
            p.deliveries,
            p.redeliveries,
            flags.join(",")
        );
    }
}

/// Runs a control command for `job` over `broker`, printing what happens. Returns the
/// process exit code (0 done, 1 not done, 2 refused).
pub async fn run_command(broker: SharedBroker, job: &str, command: ControlCommand) -> i32 {
    run_command_typed(broker, job, command, &[]).await
}

/// As [`run_command`], in a binary that knows the job's stream types (`dlq show`
/// decodes payloads with them).
pub async fn run_command_typed(
    broker: SharedBroker,
    job: &str,
    command: ControlCommand,
    types: &[flotilla_actors::StreamType],
) -> i32 {
    if let ControlCommand::Dlq { command } = command {
        return crate::dlq::run(broker, job, command, types).await;
    }
    let client = match ControlClient::new(broker, job).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let result = match command {
        ControlCommand::Status { json } => client.status().await.map(|s| {
            if json {
                crate::outln!("{}", serde_json::to_string_pretty(&s).unwrap_or_default());
            } else {
                print_status(&s);
            }
        }),
        ControlCommand::Top { interval, once } => crate::top::run(&client, interval, once).await,
        ControlCommand::Drain { cancel: true, .. } => {
            client.cancel_drain().await.map(|outcome| crate::outln!("{outcome}"))
        }
        ControlCommand::Drain { deadline, run, cancel: false } => client.drain(run, deadline, true).await,
        ControlCommand::Stop { node, timeout } => client.stop(&node, timeout, true).await,
        ControlCommand::Shutdown { timeout } => client.shutdown(timeout, true).await,
        ControlCommand::Pause { stream, partition } => client
            .set_paused(stream.as_deref(), partition, true)
            .await
            .map(|r| crate::outln!("paused: {}", describe(&r))),
        ControlCommand::Resume { stream, partition } => client
            .set_paused(stream.as_deref(), partition, false)
            .await
            .map(|r| crate::outln!("paused now: {}", describe(&r))),
        ControlCommand::Step { stream, key: Some(key), .. } => client
            .step_key(&stream, &key)
            .await
            .map(|seq| crate::outln!("stepped {stream} key {key:?}: its message of sequence {seq} runs")),
        ControlCommand::Park { stream, key } => client
            .park(&stream, &key, true)
            .await
            .map(|n| crate::outln!("parked {stream} key {key:?}; {n} message(s) of it set aside so far")),
        ControlCommand::Unpark { stream, key } => client
            .park(&stream, &key, false)
            .await
            .map(|n| crate::outln!("unparked {stream} key {key:?}: {n} message(s) back in the queue, in order")),
        ControlCommand::Step { stream, partition: None, .. } => {
            Err(ControlError::Refused(format!("step --stream {stream} needs --partition P or --key K")))
        }
        ControlCommand::Step { stream, partition: Some(partition), .. } => client
            .step(&stream, partition)
            .await
            .map(|node| crate::outln!("stepped {stream}/{partition} on node {node}")),
        ControlCommand::Dlq { .. } => unreachable!("handled above"),
    };
    exit_code(result)
}

/// Prints a command's error, if any, and returns its exit code: 0 done, 2 refused (bad
/// input, unknown job), 1 not done (the broker failed, or the goal was not reached).
pub fn exit_code(result: Result<(), ControlError>) -> i32 {
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            match e {
                ControlError::Refused(_) | ControlError::UnknownJob(_) => 2,
                ControlError::Broker(_) | ControlError::Incomplete(_) => 1,
            }
        }
    }
}

fn describe(r: &PauseRecord) -> String {
    let mut parts = Vec::new();
    if r.job {
        parts.push("the whole job".to_owned());
    }
    parts.extend(r.streams.iter().map(|s| format!("stream {s}")));
    parts.extend(r.partitions.iter().cloned());
    if parts.is_empty() { "nothing".to_owned() } else { parts.join(", ") }
}

/// Whether `verb` is one nodes answer.
pub fn known_verb(verb: &str) -> bool {
    cluster::VERBS.contains(&verb)
}
