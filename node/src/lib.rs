//! A Flotilla node process: choosing and connecting the broker, and (as the cluster
//! issue lands) configuration, membership, leases, the control plane and the
//! `flotilla` CLI.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod connect;
