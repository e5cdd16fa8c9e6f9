//! A Flotilla node process: choosing and connecting the broker, running a job with
//! flags, logging and signals, joining the cluster (membership and leases run in
//! `flotilla-actors`), and the control plane's client side for the `flotilla` CLI and
//! job binaries.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub use flotilla_actors::assignment;
pub mod config;
pub mod connect;
pub mod control;
pub mod runner;

pub use control::{ControlClient, ControlCommand};
pub use runner::{JobRunner, NodeArgs, NodeError, NodeHandle, run};
