//! What the container runs per input partition: the spec of a slot and the handles
//! of its worker.

use super::*;

/// The addresses of a running worker.
#[derive(Debug, Clone)]
pub struct WorkerHandle {
    /// Where claimed messages go.
    pub deliver: Recipient<Deliver>,
    /// Where stop requests go.
    pub stop: Recipient<StopWorker>,
    /// Where pause, resume and step go.
    pub control: Recipient<WorkerControl>,
}

/// What the container needs to start a worker for a slot.
pub struct SlotContext {
    /// The slot's index.
    pub slot: usize,
    /// The container, for the worker's reports.
    pub container: Recipient<WorkerReport>,
    /// The node's timer service.
    pub timers: Addr<TimerService>,
    /// The node's reaper.
    pub reaper: Addr<Reaper>,
    /// Ordered inputs: where the partition resumes (see
    /// [`PartitionStart`](crate::task_worker::PartitionStart)).
    pub start: Option<crate::task_worker::PartitionStart>,
}

/// Starts a worker for a slot.
pub type SpawnWorker = Box<dyn Fn(SlotContext) -> WorkerHandle>;

/// One input partition (or queue input) the container consumes.
pub struct SlotSpec {
    /// The input stream's name.
    pub stream: String,
    /// The partition (ordered inputs).
    pub partition: Option<u32>,
    /// The JetStream stream.
    pub js_stream: String,
    /// The durable consumer.
    pub consumer: String,
    /// Messages the worker may hold at once (claimed, not yet finished).
    pub capacity: usize,
    /// What a failure of this slot's task does.
    pub policy: FailurePolicy,
    /// Whether the reaper sweeps this input for stranded messages (queue inputs).
    pub sweep: bool,
    /// Ordered inputs: the partition consumer, reset at the committed position before a
    /// restarted task starts (so it resumes in order, at once).
    pub takeover: Option<flotilla_transport::broker::ConsumerSpec>,
    /// Ordered inputs: where the next worker starts, as the last take-over found it
    /// (updated by each reset).
    pub start: Option<crate::task_worker::PartitionStart>,
    /// The partition's lease epoch (0 without leases).
    pub epoch: u64,
    /// Cluster mode: the partition's lease fence. Nothing is claimed for the slot, and a
    /// restart does not reset the partition's consumer, once it is no longer valid (the
    /// lease may be someone else's by then, and so would the claimed messages be).
    pub fence: Option<crate::fence::Fence>,
    /// Starts paused.
    pub paused: bool,
    /// Starts the worker.
    pub spawn: SpawnWorker,
}

impl std::fmt::Debug for SlotSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotSpec")
            .field("stream", &self.stream)
            .field("partition", &self.partition)
            .finish_non_exhaustive()
    }
}
