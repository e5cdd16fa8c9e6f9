//! A Flotilla node process: choosing and connecting the broker, running a job with
//! flags, logging and signals, and (as the cluster issue lands) membership, leases,
//! the control plane and the `flotilla` CLI.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod assignment;
pub mod config;
pub mod connect;
pub mod runner;

pub use runner::{JobRunner, NodeArgs, NodeError, NodeHandle, run};
