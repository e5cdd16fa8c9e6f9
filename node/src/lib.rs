//! A Flotilla node process: choosing and connecting the broker, running a job with
//! flags, logging and signals, the cluster layer ([`cluster`]: joining, membership,
//! leases, the control server, host and pid checks), and the control plane's client
//! side for the `flotilla` CLI and job binaries.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub use flotilla_actors::assignment;

/// `println!` for command output that ends the process quietly when standard output
/// is closed, as `flotilla status | head -1` does (status 0, as a shell expects), and
/// with status 1 and a message on another write error, instead of panicking.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            $crate::output_failed(e);
        }
    }};
}

/// Ends the process after a failed write to standard output (see [`outln!`]).
pub fn output_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("error: cannot write the output: {e}");
    std::process::exit(1);
}
pub mod client;
pub mod cluster;
pub mod config;
pub mod connect;
pub mod dlq;
pub mod http;
#[cfg(feature = "otlp")]
pub mod otlp;
pub mod publish;
pub mod runner;
pub mod top;

/// The control client under its first name: `flotilla_node::control::…` paths keep working.
pub use client as control;
pub use client::{ControlClient, ControlCommand};
pub use cluster::{JoinCluster, start_node};
pub use runner::{JobRunner, NodeArgs, NodeError, NodeHandle, run};
