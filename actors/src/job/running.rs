//! A started job ([`RunningJob`]) and how it stops ([`JobStopper`]). On a single node
//! the container stops it; in a cluster the node's membership (in `flotilla-node`)
//! does, reached through the [`NodeLink`] it gives the job: [`Leave`] to stop,
//! [`Deregister`] once the container exited.

use super::JobError;
use crate::container::{Container, ContainerExit, StopContainer};
use actix::prelude::*;
pub use flotilla_proto::cluster::control::LeaveReason;
use std::time::Duration;
use tokio::sync::oneshot;
use tracing::warn;

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

/// What a job running as one node of a cluster keeps of the node's membership.
#[derive(Debug)]
pub struct NodeLink {
    /// Asks the node to leave ([`RunningJob::stop`], [`JobStopper::stop`]).
    pub leave: Recipient<Leave>,
    /// Tells the node the container exited ([`RunningJob::wait`]).
    pub deregister: Recipient<Deregister>,
    /// Why the node left, once it does ([`RunningJob::left`]).
    pub left: tokio::sync::watch::Sender<Option<LeaveReason>>,
}

/// How a started container reports its end, and how long its stop may take.
#[derive(Debug)]
pub struct JobExit {
    pub(crate) exit: oneshot::Receiver<ContainerExit>,
    pub(crate) stop_deadline: Duration,
}

/// A started job.
#[derive(Debug)]
pub struct RunningJob {
    container: Addr<Container>,
    exit: oneshot::Receiver<ContainerExit>,
    run_id: String,
    /// Cluster mode: the node's membership, and why it left.
    membership: Option<NodeLink>,
    /// How long a graceful stop may take before the container exits anyway.
    stop_deadline: Duration,
}

/// How long a node that stopped may take to delete its leases and membership before it
/// goes without (they expire on their own, after the lease TTL).
pub const DEREGISTER_BUDGET: Duration = Duration::from_secs(3);

impl RunningJob {
    /// A job started as one node of a cluster ([`Job::start_member`](crate::Job::start_member)):
    /// its stop goes through the node's membership (`link`).
    pub fn joined(container: Addr<Container>, exit: JobExit, run_id: String, link: NodeLink) -> Self {
        Self { container, exit: exit.exit, run_id, membership: Some(link), stop_deadline: exit.stop_deadline }
    }

    /// A job started on its own (single node).
    pub(crate) fn alone(container: Addr<Container>, exit: JobExit, run_id: String) -> Self {
        Self { container, exit: exit.exit, run_id, membership: None, stop_deadline: exit.stop_deadline }
    }

    /// The run id drain markers must carry.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Asks the job to stop gracefully (in a cluster: leave, handing partitions over).
    pub fn stop(&self) {
        self.stopper().stop();
    }

    /// A handle that can stop the job from elsewhere.
    pub fn stopper(&self) -> JobStopper {
        match &self.membership {
            Some(link) => JobStopper(Stopper::Node(link.leave.clone())),
            None => JobStopper(Stopper::Container(self.container.clone())),
        }
    }

    /// The longest a graceful stop takes, whatever the network does: the container's
    /// stop deadline and [`DEREGISTER_BUDGET`]. A process may exit once it passed.
    pub fn stop_deadline(&self) -> Duration {
        self.stop_deadline + DEREGISTER_BUDGET
    }

    /// Why the node left the cluster, once it does (cluster mode).
    pub fn left(&self) -> Option<tokio::sync::watch::Receiver<Option<LeaveReason>>> {
        self.membership.as_ref().map(|link| link.left.subscribe())
    }

    /// Waits until the job ends. In a cluster the node then deletes its leases and its
    /// membership, so other nodes take its partitions at once.
    ///
    /// # Errors
    /// [`JobError::Failed`] when a task failed the container, or the stop could not
    /// finish (workers still running at the stop deadline, or the leases not deleted
    /// within [`DEREGISTER_BUDGET`]): the message says what was left undone.
    pub async fn wait(self) -> Result<(), JobError> {
        let exit = self.exit.await;
        let mut undone = None;
        if let Some(link) = &self.membership
            && tokio::time::timeout(DEREGISTER_BUDGET, link.deregister.send(Deregister)).await.is_err()
        {
            let what = "this node's leases and membership were not deleted (the broker did not answer within 3 s): its partitions move once their leases expire";
            warn!("{what}");
            undone = Some(what);
        }
        match (exit, undone) {
            (Ok(ContainerExit::Failed(reason)), _) => Err(JobError::Failed(reason)),
            (Err(_), _) => Err(JobError::Failed("the container stopped without reporting".into())),
            (Ok(ContainerExit::Completed), Some(what)) => {
                Err(JobError::Failed(format!("the stop did not finish: {what}")))
            }
            (Ok(ContainerExit::Completed), None) => Ok(()),
        }
    }
}

#[derive(Debug, Clone)]
enum Stopper {
    Container(Addr<Container>),
    Node(Recipient<Leave>),
}

/// Stops a running job.
#[derive(Debug, Clone)]
pub struct JobStopper(Stopper);

impl JobStopper {
    /// Asks the job to stop gracefully.
    pub fn stop(&self) {
        match &self.0 {
            Stopper::Container(c) => c.do_send(StopContainer),
            Stopper::Node(m) => m.do_send(Leave(LeaveReason::Requested)),
        }
    }
}
