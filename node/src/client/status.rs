//! `status`: what the nodes, the leases, the consumers and the CONTROL bucket say of a
//! job, and its printing as tables.

use super::{ControlClient, ControlError, PendingDrain};
use crate::cluster::read_end;
use flotilla_actors::cluster::now_ms;
use flotilla_proto::cluster::control::{
    ControlRequest, LeaseRecord, NodeStatus, ParkedRecord, PauseRecord, SlotStatus, decode, keys,
};
use flotilla_transport::broker::BrokerError;
use flotilla_transport::wire::{StreamName, Subjects};
use futures::StreamExt;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

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

impl ControlClient {
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
                Some(e) => decode::<LeaseRecord>("lease", &e.value).ok(),
                None => None,
            },
            None => None,
        };
        let drained = match (p, &run_id) {
            (Some(p), Some(run)) => read_end(&self.broker, &self.buckets.control, &stream, p, run).await?.drained,
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
            Some(e) => decode(keys::PAUSED, &e.value).unwrap_or_default(),
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
            Some(e) => decode::<ParkedRecord>(keys::PARKED, &e.value).unwrap_or_default().keys,
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
