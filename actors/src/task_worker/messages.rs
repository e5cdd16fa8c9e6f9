use crate::state::ShutdownScope;
use actix::prelude::*;

/// Stop the worker gracefully: hand back what has not started, finish what has (up to
/// the drain timeout), commit, run the `shutdown` hook, report [`Outcome::Stopped`].
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct StopWorker;

/// Intake control (pause, resume, step) for a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Message)]
#[rtype(result = "()")]
pub enum WorkerControl {
    /// Start no more messages (commits, windows and timers go on).
    Pause,
    /// Start messages again.
    Resume,
    /// While paused, start exactly one more message.
    Step,
}

/// How a worker ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every input saw a current drain marker; drained and committed.
    Drained,
    /// Every input ended; committed.
    EndOfStream,
    /// Stopped on request.
    Stopped,
    /// The task failed.
    Failed(String),
    /// Ordered inputs: a delivery of the partition was lost in transit (the consumer's
    /// delivery sequence skipped). The worker committed what arrived before the loss
    /// and stopped; the partition must be reset to its committed position before a
    /// new worker consumes it. Not a failure: it spends no attempt and no restart.
    Resync(String),
    /// Tasks with stores: the state in memory cannot be committed as it is (the store
    /// changes of a message that failed are tied to later ones, or someone else wrote
    /// the partition's changelog). The worker handed everything back without
    /// committing; the partition restarts from its last commit, after a back-off when
    /// restores repeat.
    Restore {
        /// Why.
        reason: String,
        /// The stream sequence of the message that forced it, if one did: the restore
        /// counts as one of its attempts.
        blame: Option<u64>,
    },
}

/// What a worker tells its container.
#[derive(Debug, Clone, PartialEq, Eq, Message)]
#[rtype(result = "()")]
pub enum WorkerReport {
    /// The worker finished its first message (its restarts and restores before it are
    /// forgiven). Sent once per worker.
    Progressed {
        /// The worker's slot in the container.
        slot: usize,
    },
    /// The task asked to shut down.
    ShutdownRequested {
        /// The worker's slot.
        slot: usize,
        /// This task or the whole container.
        scope: ShutdownScope,
    },
    /// The worker ended.
    Finished {
        /// The worker's slot.
        slot: usize,
        /// How.
        outcome: Outcome,
    },
}
