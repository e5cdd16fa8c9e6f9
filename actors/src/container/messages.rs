use actix::prelude::*;

/// Stop the container gracefully: every worker hands back what has not started,
/// finishes what has, commits and stops; then the container exits.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct StopContainer;

/// How the container ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContainerExit {
    /// Every task finished (drained, ended, stopped or asked to shut down).
    Completed,
    /// A task failed and the policy fails the container.
    Failed(String),
}

/// Start consuming one more ordered partition (cluster mode: its lease was acquired).
/// Returns the new slot's index (`None` for a stream this job does not consume).
#[derive(Debug, Clone, Message)]
#[rtype(result = "Option<usize>")]
pub struct AddSlot {
    /// The input stream.
    pub stream: String,
    /// The partition.
    pub partition: u32,
    /// The lease epoch.
    pub epoch: u64,
    /// Valid while the lease is held.
    pub fence: crate::fence::Fence,
    /// Starts paused.
    pub paused: bool,
    /// Where the partition resumes.
    pub start: Option<crate::task_worker::PartitionStart>,
}

/// Hand a slot over gracefully: stop claiming, finish in-flight work, commit, stop the
/// worker; the observer then gets [`SlotEnded`].
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct ReleaseSlot(pub usize);

/// Pause or resume a slot's intake.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct SetPaused {
    /// The slot.
    pub slot: usize,
    /// Paused or not.
    pub paused: bool,
}

/// Let a paused slot process exactly one more message.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct StepSlot(pub usize);

/// What each slot is doing, for `status`.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "Vec<crate::cluster::SlotStatus>")]
pub struct Snapshot;

/// A slot's worker ended (sent to the container's observer).
#[derive(Debug, Clone, PartialEq, Eq, Message)]
#[rtype(result = "()")]
pub struct SlotEnded {
    /// The slot.
    pub slot: usize,
    /// Its stream.
    pub stream: String,
    /// Its partition.
    pub partition: Option<u32>,
    /// How its worker ended.
    pub outcome: crate::task_worker::Outcome,
}
