//! A Flotilla node process: choosing and connecting the broker, running a job with
//! flags, logging and signals, joining the cluster (membership and leases run in
//! `flotilla-actors`), and the control plane's client side for the `flotilla` CLI and
//! job binaries.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub use flotilla_actors::assignment;

/// `println!` for command output that ends the process quietly (status 0) when standard
/// output is closed, as `flotilla status | head -1` does, instead of panicking.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if writeln!(std::io::stdout().lock(), $($arg)*).is_err() {
            std::process::exit(0);
        }
    }};
}
pub mod config;
pub mod connect;
pub mod control;
pub mod dlq;
pub mod publish;
pub mod runner;

pub use control::{ControlClient, ControlCommand};
pub use runner::{JobRunner, NodeArgs, NodeError, NodeHandle, run};
