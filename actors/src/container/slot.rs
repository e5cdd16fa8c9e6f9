//! What the container runs per input partition: the spec of a slot, the handles of
//! its worker and where the slot stands.

use super::*;

/// The addresses of a running worker.
#[derive(Debug, Clone)]
pub struct WorkerHandle {
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
    /// Where the worker claims from.
    pub source: Source,
    /// How it claims (one copy for the container's slots of the same capacity).
    pub claims: Arc<flotilla_proto::partition::machine::ClaimRules>,
    /// The worker starts paused.
    pub paused: bool,
    /// What `status` shows of the slot's claims (the worker counts them).
    pub counts: Arc<ClaimCounts>,
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
    pub js_stream: std::rc::Rc<str>,
    /// The durable consumer.
    pub consumer: std::rc::Rc<str>,
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

/// Where a slot stands: one state, not a handful of flags.
pub(super) enum Run {
    /// No worker: before the first starts, or after one ended that is restarted (its
    /// task failed, a delivery was lost, or the stores are restored).
    Waiting {
        /// The partition's consumer is being reset at its committed position; no
        /// worker starts until the reset succeeded.
        resetting: bool,
        /// The restart follows a lost delivery or a restore, not a crash: nothing the
        /// previous worker left is suspect.
        resync: bool,
    },
    /// Its worker runs.
    Running(WorkerHandle),
    /// Its worker was told to stop (a hand-over, the container's stop, or its task's
    /// own request).
    Stopping {
        /// The worker.
        worker: WorkerHandle,
        /// Its task asked to shut down (`ShutdownScope::CurrentTask`) on a node of a
        /// cluster: the partition is done for this run, as at its end of stream.
        asked_to_end: bool,
    },
    /// Its worker ended for good (in cluster mode the slot goes once that is reported).
    Ended,
}

/// One input partition (or queue input) of the container.
pub(super) struct Slot {
    pub(super) spec: SlotSpec,
    pub(super) run: Run,
    /// Restarts since the task last finished a message.
    pub(super) restarts: u32,
    /// Resets in a row that failed (the next waits longer; no worker starts meanwhile).
    pub(super) reset_failures: u32,
    /// Restores since the task last finished a message (the next waits longer).
    pub(super) restores: u32,
    /// The messages that forced restores (their stream sequences), and how many each
    /// (those the partition has committed past are dropped at each restart).
    pub(super) blamed: Vec<(u64, u32)>,
    /// An operator paused it (each worker of the slot starts paused).
    pub(super) paused: bool,
    /// What its workers count of their claims.
    pub(super) counts: Arc<ClaimCounts>,
    pub(super) metrics: SlotMetrics,
}

impl Slot {
    pub(super) fn new(spec: SlotSpec) -> Self {
        let paused = spec.paused;
        Self {
            metrics: SlotMetrics::new(&spec.stream, spec.partition),
            spec,
            run: Run::Waiting { resetting: false, resync: false },
            restarts: 0,
            reset_failures: 0,
            restores: 0,
            blamed: Vec::new(),
            paused,
            counts: Arc::default(),
        }
    }

    /// Its worker, while one runs (or stops).
    pub(super) fn worker(&self) -> Option<&WorkerHandle> {
        match &self.run {
            Run::Running(w) | Run::Stopping { worker: w, .. } => Some(w),
            Run::Waiting { .. } | Run::Ended => None,
        }
    }

    /// A worker runs (or stops): the slot is swept, checked for backlog, shown in
    /// `status`, and waited for by a stop.
    pub(super) fn live(&self) -> bool {
        self.worker().is_some()
    }

    /// Tells its worker to stop, if one runs and was not told yet. `asked_to_end`: its
    /// task asked to shut down, on a node of a cluster (a request after a hand-over
    /// began still ends the partition for the run).
    pub(super) fn stop_worker(&mut self, asked_to_end: bool) {
        self.run = match std::mem::replace(&mut self.run, Run::Ended) {
            Run::Running(worker) => {
                worker.stop.do_send(StopWorker);
                Run::Stopping { worker, asked_to_end }
            }
            Run::Stopping { worker, asked_to_end: asked } => {
                Run::Stopping { worker, asked_to_end: asked || asked_to_end }
            }
            other => other,
        };
    }
}
