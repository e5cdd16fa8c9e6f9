//! The cluster layer (DESIGN §7): a node joins a job's cluster ([`start_node`], or
//! `job.start_node(…)` with [`JoinCluster`] in scope), registers in the NODES bucket,
//! takes its share of the ordered partitions' leases and follows the desired state and
//! control requests ([`membership`]). What the nodes share (records, keys, the control
//! protocol) is [`flotilla_proto::cluster::control`], re-exported as [`control`];
//! `flotilla-actors` runs what the membership decides.

mod host;
mod join;
pub mod membership;
mod run_end;

pub use flotilla_proto::cluster::control;
pub use join::{JoinCluster, start_node};
pub use membership::{Buckets, ControlMessage, Deregister, Leave, LeaveReason, Membership, MembershipSetup};
pub use run_end::read_end;
