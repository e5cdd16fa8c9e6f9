//! Typed runtime events: logged, and published on `flotilla.<job>._evt.<type>` as JSON.

use flotilla_transport::broker::{CoreMessage, SharedBroker};
use flotilla_transport::wire::Subjects;
use serde::Serialize;
use tracing::{debug, info, warn};

/// Something operators want to know about.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// A message went to the dead-letter stream.
    DeadLettered {
        /// Input stream.
        stream: String,
        /// Partition, for ordered inputs.
        partition: Option<u32>,
        /// Its stream sequence.
        seq: u64,
        /// The reason code.
        reason: String,
        /// Details.
        detail: String,
    },
    /// A task failed.
    TaskFailed {
        /// Input stream.
        stream: String,
        /// Partition, for ordered inputs.
        partition: Option<u32>,
        /// Why.
        reason: String,
    },
    /// The broker cannot be reached: in-flight work is kept, claims back off.
    QueueUnavailable {
        /// Input stream.
        stream: String,
        /// The error.
        error: String,
        /// When the next attempt is, in milliseconds.
        retry_in_ms: u64,
    },
    /// The broker answers again.
    QueueAvailable {
        /// Input stream.
        stream: String,
    },
    /// The backlog stayed above the threshold for several checks.
    Degraded {
        /// The stream holding most of it.
        stream: String,
        /// Its partition, for ordered inputs.
        partition: Option<u32>,
        /// Messages waiting there.
        backlog: u64,
        /// Age of the oldest waiting message, in milliseconds.
        oldest_age_ms: u64,
        /// Messages waiting across the job's inputs on this node.
        total_backlog: u64,
    },
    /// A partition's stores were restored from the changelog; it processes from here.
    StateRestored {
        /// Input stream.
        stream: String,
        /// Partition.
        partition: u32,
        /// Keys restored, over all stores.
        keys: u64,
        /// The input position the state reflects (inputs up to it are skipped).
        position: u64,
        /// Keys whose latest record belonged to a flush that never completed (their
        /// committed value was taken).
        incomplete: u64,
        /// How long the restore took, in milliseconds.
        millis: u64,
    },
    /// A partition's stores could not be restored: the partition is held, and nothing
    /// is processed until they are.
    StateRestoreFailed {
        /// Input stream.
        stream: String,
        /// Partition.
        partition: u32,
        /// Why.
        error: String,
        /// When the next attempt is, in milliseconds (0: none, the task failed).
        retry_in_ms: u64,
    },
    /// The backlog is back under the threshold.
    Recovered {
        /// Messages waiting across the job's inputs on this node.
        total_backlog: u64,
    },
    /// A node took a partition's lease.
    PartitionAcquired {
        /// Input stream.
        stream: String,
        /// Partition.
        partition: u32,
        /// The node that took it.
        node: String,
        /// Its lease epoch.
        epoch: u64,
        /// `assigned` (the plan gives it this node), `unclaimed` (nobody held it for a
        /// lease TTL: its owner died or left) or `takeover` (left by this node id's
        /// previous process).
        how: String,
    },
    /// A node lost a partition's lease (not renewed in time, or membership lost).
    PartitionLost {
        /// Input stream.
        stream: String,
        /// Partition.
        partition: u32,
        /// The node that lost it.
        node: String,
        /// Why.
        why: String,
    },
    /// A node handed a partition over (rebalance, stop, drain, end of stream).
    PartitionReleased {
        /// Input stream.
        stream: String,
        /// Partition.
        partition: u32,
        /// The node that released it.
        node: String,
    },
    /// A message of a key was parked after the key was unparked (a node saw the unpark
    /// late, after `unpark` had swept): the node sent what was set aside for the key
    /// back to its queue, or says why it could not (then `unpark` the key again).
    ParkedAfterUnpark {
        /// The queue input.
        stream: String,
        /// The key.
        key: String,
        /// Messages sent back.
        sent_back: u64,
        /// Why they could not be sent back.
        error: Option<String>,
    },
    /// A partition is drained or at its end of stream, and the record saying so could
    /// not be stored in the CONTROL bucket: the node keeps its lease (no worker runs for
    /// it) and tries again; the run (or the drain) completes once it is stored.
    DoneNotRecorded {
        /// Input stream.
        stream: String,
        /// Partition.
        partition: u32,
        /// The node holding it.
        node: String,
        /// `ended` or `drained`.
        done: String,
        /// The error.
        error: String,
        /// Tries that failed so far.
        failures: u32,
        /// When the next try is, in milliseconds.
        retry_in_ms: u64,
    },
}

impl Event {
    /// The subject suffix: `dead_lettered`, `queue_unavailable`, `degraded`, …
    pub fn type_name(&self) -> &'static str {
        match self {
            Event::DeadLettered { .. } => "dead_lettered",
            Event::TaskFailed { .. } => "task_failed",
            Event::QueueUnavailable { .. } => "queue_unavailable",
            Event::QueueAvailable { .. } => "queue_available",
            Event::Degraded { .. } => "degraded",
            Event::Recovered { .. } => "recovered",
            Event::StateRestored { .. } => "state_restored",
            Event::StateRestoreFailed { .. } => "state_restore_failed",
            Event::PartitionAcquired { .. } => "partition_acquired",
            Event::PartitionLost { .. } => "partition_lost",
            Event::PartitionReleased { .. } => "partition_released",
            Event::DoneNotRecorded { .. } => "done_not_recorded",
            Event::ParkedAfterUnpark { .. } => "parked_after_unpark",
        }
    }
}

/// Logs the event and publishes it (best effort: events are notifications).
pub fn emit(broker: &SharedBroker, subjects: &Subjects, event: Event) {
    let kind = event.type_name();
    if let Event::DeadLettered { stream, reason, .. } = &event {
        crate::metrics::dead_lettered(stream, reason);
    }
    let payload = match serde_json::to_vec(&event) {
        Ok(p) => p,
        Err(e) => {
            warn!(error = %e, "event not encodable");
            return;
        }
    };
    // The event as JSON: one line per event, readable by people and by log tools.
    let detail = String::from_utf8_lossy(&payload);
    match &event {
        // The membership actor logs lease changes in its own words.
        Event::PartitionAcquired { .. } | Event::PartitionLost { .. } | Event::PartitionReleased { .. } => {
            debug!(event = kind, %detail, "flotilla event")
        }
        Event::QueueAvailable { .. }
        | Event::Recovered { .. }
        | Event::StateRestored { .. }
        | Event::ParkedAfterUnpark { error: None, .. } => {
            info!(event = kind, %detail, "flotilla event")
        }
        _ => warn!(event = kind, %detail, "flotilla event"),
    }
    let fut = broker.core_publish(CoreMessage::new(subjects.event(kind), payload));
    actix::spawn(async move {
        let _ = fut.await;
    });
}
