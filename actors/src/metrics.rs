//! What the run loop measures, through the [`metrics`] facade.
//!
//! The actors record into whatever recorder the process installed: the node installs a
//! Prometheus one when it serves `--http` (`flotilla_node::http`), and without one every
//! handle here is a no-op. Handles are made once per slot and per task (labels are
//! resolved then), so the hot path pays an atomic add, not a label lookup.
//!
//! Names follow Prometheus conventions: `flotilla_` prefix, base units (seconds),
//! `_total` on counters. Labels: `stream`, `partition` (absent for queue inputs),
//! `kind`, `reason`, `hook`. `docs/metrics.md` lists them all.

use metrics::{Counter, Gauge, Histogram, Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Metric names (each described in [`describe`] and `docs/metrics.md`).
pub mod names {
    /// Messages handed to tasks (the reference run loop's envelopes).
    pub const ENVELOPES: &str = "flotilla_envelopes_total";
    /// Of those, redeliveries (delivered before).
    pub const REDELIVERIES: &str = "flotilla_redeliveries_total";
    /// Claims (pulls) that came back empty.
    pub const IDLE_POLLS: &str = "flotilla_idle_polls_total";
    /// Messages claimed and not yet finished, per slot.
    pub const PENDING: &str = "flotilla_pending_messages";
    /// Messages whose `process` is running, per task.
    pub const IN_FLIGHT: &str = "flotilla_in_flight_messages";
    /// `process` latency (to its return; outputs are counted in publish latency).
    pub const PROCESS_SECONDS: &str = "flotilla_process_seconds";
    /// Hook latency (`window`, `timer`, `commit`, …).
    pub const HOOK_SECONDS: &str = "flotilla_hook_seconds";
    /// Commit latency: from the commit's start to the acknowledgement of its inputs
    /// (store flush included).
    pub const COMMIT_SECONDS: &str = "flotilla_commit_seconds";
    /// Attempts that failed (and will be retried or dead-lettered).
    pub const FAILED_ATTEMPTS: &str = "flotilla_failed_attempts_total";
    /// Acknowledgements sent, by kind (`ack`, `nak`, `term`, `in_progress`).
    pub const ACKS: &str = "flotilla_acks_total";
    /// Messages moved to the dead-letter stream, by reason.
    pub const DEAD_LETTERS: &str = "flotilla_dead_letters_total";
    /// Share of the last interval the node's tasks spent in callbacks (0 to 1 per
    /// thread).
    pub const UTILIZATION: &str = "flotilla_utilization_ratio";
    /// Batches of outputs stored, and their latency from publish to stored.
    pub const PUBLISH_SECONDS: &str = "flotilla_publish_seconds";
    /// Output messages stored.
    pub const PUBLISHED: &str = "flotilla_published_messages_total";
    /// Messages waiting (unacknowledged and undelivered) per slot, from the broker.
    pub const BACKLOG: &str = "flotilla_backlog_messages";
    /// Age of the oldest unacknowledged message per slot.
    pub const OLDEST_AGE: &str = "flotilla_oldest_message_age_seconds";
    /// Leases acquired, by how (`assigned`, `unclaimed`, `takeover`).
    pub const LEASES_ACQUIRED: &str = "flotilla_leases_acquired_total";
    /// Leases lost (not renewed in time, or membership lost).
    pub const LEASES_LOST: &str = "flotilla_leases_lost_total";
    /// Leases handed over (rebalance, drain, end, stop).
    pub const LEASES_RELEASED: &str = "flotilla_leases_released_total";
    /// Partitions this node holds now.
    pub const PARTITIONS_OWNED: &str = "flotilla_partitions_owned";
    /// State flushes to the changelog, and their latency.
    pub const STORE_FLUSH_SECONDS: &str = "flotilla_store_flush_seconds";
    /// Records written to the changelog.
    pub const STORE_FLUSHED_RECORDS: &str = "flotilla_store_flushed_records_total";
    /// Restores of a partition's stores, and their latency.
    pub const STORE_RESTORE_SECONDS: &str = "flotilla_store_restore_seconds";
    /// Keys restored.
    pub const STORE_RESTORED_KEYS: &str = "flotilla_store_restored_keys_total";
    /// Connection losses to the NATS server.
    pub const DISCONNECTS: &str = "flotilla_nats_disconnects_total";
    /// Reconnections to the NATS server.
    pub const RECONNECTS: &str = "flotilla_nats_reconnects_total";
    /// 1 while connected to the NATS server.
    pub const CONNECTED: &str = "flotilla_nats_connected";
    /// 1, with the node's id, job and version as labels.
    pub const NODE_INFO: &str = "flotilla_node_info";
    /// When the node started (seconds since the Unix epoch).
    pub const START_TIME: &str = "flotilla_node_start_time_seconds";
    /// Messages in the job's dead-letter stream.
    pub const DLQ_MESSAGES: &str = "flotilla_dlq_messages";
    /// Bytes in the job's dead-letter stream.
    pub const DLQ_BYTES: &str = "flotilla_dlq_bytes";
    /// Age of the oldest dead letter.
    pub const DLQ_OLDEST_AGE: &str = "flotilla_dlq_oldest_age_seconds";
}

/// Histogram buckets, in seconds: 50 µs to 30 s.
pub const BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0,
];

/// Registers every metric's description and unit with the installed recorder.
pub fn describe() {
    use names::*;
    describe_counter!(ENVELOPES, "Messages handed to tasks");
    describe_counter!(REDELIVERIES, "Messages handed to tasks that were delivered before");
    describe_counter!(IDLE_POLLS, "Claims (pulls) that came back empty");
    describe_gauge!(PENDING, "Messages claimed by the node and not yet finished");
    describe_gauge!(IN_FLIGHT, "Messages whose process callback is running");
    describe_histogram!(PROCESS_SECONDS, Unit::Seconds, "Latency of the process callback");
    describe_histogram!(HOOK_SECONDS, Unit::Seconds, "Latency of hooks (window, timer, commit, init, drain, ...)");
    describe_histogram!(COMMIT_SECONDS, Unit::Seconds, "Latency of a commit, store flush included");
    describe_counter!(FAILED_ATTEMPTS, "Attempts that failed");
    describe_counter!(ACKS, "Acknowledgements sent to the broker, by kind");
    describe_counter!(DEAD_LETTERS, "Messages moved to the dead-letter stream, by reason");
    describe_gauge!(UTILIZATION, "Share of the last interval spent in task callbacks");
    describe_histogram!(PUBLISH_SECONDS, Unit::Seconds, "Latency of storing a batch of outputs");
    describe_counter!(PUBLISHED, "Output messages stored");
    describe_gauge!(BACKLOG, "Messages waiting in the broker, per slot");
    describe_gauge!(OLDEST_AGE, Unit::Seconds, "Age of the oldest unacknowledged message, per slot");
    describe_counter!(LEASES_ACQUIRED, "Partition leases acquired, by how");
    describe_counter!(LEASES_LOST, "Partition leases lost");
    describe_counter!(LEASES_RELEASED, "Partition leases handed over");
    describe_gauge!(PARTITIONS_OWNED, "Partitions this node holds");
    describe_histogram!(STORE_FLUSH_SECONDS, Unit::Seconds, "Latency of writing state changes to the changelog");
    describe_counter!(STORE_FLUSHED_RECORDS, "Records written to the changelog");
    describe_histogram!(STORE_RESTORE_SECONDS, Unit::Seconds, "Latency of restoring a partition's stores");
    describe_counter!(STORE_RESTORED_KEYS, "Keys restored from the changelog");
    describe_counter!(DISCONNECTS, "Connection losses to the NATS server");
    describe_counter!(RECONNECTS, "Reconnections to the NATS server");
    describe_gauge!(CONNECTED, "1 while connected to the NATS server");
    describe_gauge!(NODE_INFO, "1, labelled with the node's id, job and version");
    describe_gauge!(START_TIME, Unit::Seconds, "When the node started, seconds since the Unix epoch");
    describe_gauge!(DLQ_MESSAGES, "Messages in the job's dead-letter stream");
    describe_gauge!(DLQ_BYTES, Unit::Bytes, "Bytes in the job's dead-letter stream");
    describe_gauge!(DLQ_OLDEST_AGE, Unit::Seconds, "Age of the oldest dead letter (0 when there is none)");
}

/// Records a reading of the job's dead-letter stream.
pub fn dlq_reading(state: &flotilla_transport::broker::StreamState, now: std::time::SystemTime) {
    use names::*;
    metrics::gauge!(DLQ_MESSAGES).set(state.messages as f64);
    metrics::gauge!(DLQ_BYTES).set(state.bytes as f64);
    let age = state.first_published.and_then(|t| now.duration_since(t).ok()).unwrap_or_default();
    metrics::gauge!(DLQ_OLDEST_AGE).set(age.as_secs_f64());
}

fn labels(stream: &str, partition: Option<u32>) -> Vec<(&'static str, String)> {
    let mut l = vec![("stream", stream.to_owned())];
    if let Some(p) = partition {
        l.push(("partition", p.to_string()));
    }
    l
}

fn with(base: &[(&'static str, String)], key: &'static str, value: &str) -> Vec<(&'static str, String)> {
    let mut l = base.to_vec();
    l.push((key, value.to_owned()));
    l
}

/// Nanoseconds spent in task callbacks in this process (for the utilisation gauge).
static BUSY_NANOS: AtomicU64 = AtomicU64::new(0);

/// Reads the time spent in task callbacks for a utilisation reading over an interval.
#[derive(Debug)]
pub struct Utilization {
    last_busy: u64,
    last_at: std::time::Instant,
    gauge: Gauge,
}

impl Default for Utilization {
    fn default() -> Self {
        Self {
            last_busy: BUSY_NANOS.load(Ordering::Relaxed),
            last_at: std::time::Instant::now(),
            gauge: gauge!(names::UTILIZATION),
        }
    }
}

impl Utilization {
    /// Sets the gauge to the busy share since the last call, and returns it.
    pub fn sample(&mut self) -> f64 {
        let busy = BUSY_NANOS.load(Ordering::Relaxed);
        let now = std::time::Instant::now();
        let elapsed = now.duration_since(self.last_at).as_nanos() as f64;
        let ratio = if elapsed > 0.0 { busy.saturating_sub(self.last_busy) as f64 / elapsed } else { 0.0 };
        (self.last_busy, self.last_at) = (busy, now);
        self.gauge.set(ratio);
        ratio
    }
}

/// What the container measures per slot (an ordered partition or a queue input).
#[derive(Clone)]
pub struct SlotMetrics {
    /// Waiting in the broker.
    pub backlog: Gauge,
    /// Age of the oldest unacknowledged message, in seconds.
    pub oldest_age: Gauge,
}

impl SlotMetrics {
    /// Handles for `stream` (and `partition`).
    pub fn new(stream: &str, partition: Option<u32>) -> Self {
        let l = labels(stream, partition);
        Self { backlog: gauge!(names::BACKLOG, &l), oldest_age: gauge!(names::OLDEST_AGE, &l) }
    }
}

/// What a task worker measures.
#[derive(Clone)]
pub struct TaskMetrics {
    labels: Vec<(&'static str, String)>,
    /// `process` latency.
    pub process: Histogram,
    /// `process` callbacks running.
    pub in_flight: Gauge,
    /// Failed attempts.
    pub failed_attempts: Counter,
    /// Messages claimed.
    pub envelopes: Counter,
    /// Of those, redeliveries.
    pub redeliveries: Counter,
    /// Empty claims.
    pub idle_polls: Counter,
    /// Claimed and not finished.
    pub pending: Gauge,
    acks: [Counter; 4],
    /// Commit latency.
    pub commit: Histogram,
    /// Output batches' latency.
    pub publish: Histogram,
    /// Outputs stored.
    pub published: Counter,
    /// Changelog flush latency.
    pub store_flush: Histogram,
    /// Changelog records written.
    pub store_flushed: Counter,
    /// Hook latency, one handle per hook (made on its first run).
    hooks: std::cell::RefCell<Vec<(&'static str, Histogram)>>,
}

impl std::fmt::Debug for TaskMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskMetrics").field("labels", &self.labels).finish_non_exhaustive()
    }
}

/// The acknowledgement kinds counted in [`names::ACKS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckCount {
    /// Done.
    Ack = 0,
    /// Handed back (with or without a delay).
    Nak = 1,
    /// Terminated (a queue message dead-lettered or parked).
    Term = 2,
    /// Work in progress (a heartbeat).
    InProgress = 3,
}

impl TaskMetrics {
    /// Handles for the task of `stream` (and `partition`).
    pub fn new(stream: &str, partition: Option<u32>) -> Self {
        let l = labels(stream, partition);
        let ack = |kind: &str| counter!(names::ACKS, &with(&l, "kind", kind));
        Self {
            process: metrics::histogram!(names::PROCESS_SECONDS, &l),
            in_flight: gauge!(names::IN_FLIGHT, &l),
            failed_attempts: counter!(names::FAILED_ATTEMPTS, &l),
            envelopes: counter!(names::ENVELOPES, &l),
            redeliveries: counter!(names::REDELIVERIES, &l),
            idle_polls: counter!(names::IDLE_POLLS, &l),
            pending: gauge!(names::PENDING, &l),
            acks: [ack("ack"), ack("nak"), ack("term"), ack("in_progress")],
            commit: metrics::histogram!(names::COMMIT_SECONDS, &l),
            publish: metrics::histogram!(names::PUBLISH_SECONDS, &l),
            published: counter!(names::PUBLISHED, &l),
            store_flush: metrics::histogram!(names::STORE_FLUSH_SECONDS, &l),
            store_flushed: counter!(names::STORE_FLUSHED_RECORDS, &l),
            hooks: std::cell::RefCell::new(Vec::new()),
            labels: l,
        }
    }

    /// Counts `n` acknowledgements of `kind`.
    pub fn acked(&self, kind: AckCount, n: u64) {
        self.acks[kind as usize].increment(n);
    }

    /// A callback took `took`: its time counts as busy.
    pub fn busy(&self, took: Duration) {
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        BUSY_NANOS.fetch_add(nanos, Ordering::Relaxed);
    }

    /// A hook ran for `took`.
    pub fn hook(&self, hook: &'static str, took: Duration) {
        let mut hooks = self.hooks.borrow_mut();
        let found = hooks.iter().position(|(h, _)| *h == hook);
        let i = found.unwrap_or_else(|| {
            hooks.push((hook, metrics::histogram!(names::HOOK_SECONDS, &with(&self.labels, "hook", hook))));
            hooks.len() - 1
        });
        hooks[i].1.record(took.as_secs_f64());
        drop(hooks);
        self.busy(took);
    }

    /// A partition's stores were restored.
    pub fn restored(&self, keys: u64, took: Duration) {
        metrics::histogram!(names::STORE_RESTORE_SECONDS, &self.labels).record(took.as_secs_f64());
        counter!(names::STORE_RESTORED_KEYS, &self.labels).increment(keys);
    }
}

/// A message was dead-lettered.
pub fn dead_lettered(stream: &str, reason: &str) {
    counter!(names::DEAD_LETTERS, "stream" => stream.to_owned(), "reason" => reason.to_owned()).increment(1);
}

/// How a lease was acquired.
pub fn lease_acquired(stream: &str, how: &'static str) {
    counter!(names::LEASES_ACQUIRED, "stream" => stream.to_owned(), "how" => how).increment(1);
}

/// A lease was lost.
pub fn lease_lost(stream: &str) {
    counter!(names::LEASES_LOST, "stream" => stream.to_owned()).increment(1);
}

/// A lease was handed over.
pub fn lease_released(stream: &str) {
    counter!(names::LEASES_RELEASED, "stream" => stream.to_owned()).increment(1);
}

/// The node holds `n` partitions of `stream`.
pub fn partitions_owned(stream: &str, n: usize) {
    gauge!(names::PARTITIONS_OWNED, "stream" => stream.to_owned()).set(n as f64);
}
