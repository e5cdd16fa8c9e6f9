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
