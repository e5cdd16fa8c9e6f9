use actix::prelude::*;
use flotilla_transport::broker::CoreMessage;

/// Why a node leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaveReason {
    /// A signal (SIGTERM / SIGINT) or the job asked.
    Requested,
    /// `flotilla stop --node <this node>`.
    StopRequested,
    /// `flotilla shutdown`.
    Shutdown,
    /// Every partition processed its drain marker: the run is over.
    Drained,
    /// Every partition processed an end-of-stream marker: the run is over.
    Ended,
}

/// Leave the cluster gracefully: hand every partition over (finish in-flight work,
/// commit, delete the lease) and stop the container.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Leave(pub LeaveReason);

/// The container has exited: delete the leases still held and the node's membership.
/// Resolves once both are gone (or could not be deleted).
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Deregister;

/// A control request arrived on `flotilla.<J>._ctl.…`.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub struct ControlMessage(pub CoreMessage);
