//! Flotilla's run loop as actix actors: [`TaskWorker`](task_worker::TaskWorker),
//! [`Container`](container::Container), [`TimerService`](timer_service::TimerService)
//! and [`Reaper`](reaper::Reaper) (DESIGN §6), the [`Task`] API users implement and the
//! [`Job`] builder that starts them.
//!
//! The rules it follows are `flotilla-proto`'s (plain data, time passed in); it
//! performs what they decide. It talks to a broker only through `flotilla-transport`'s
//! [`SharedBroker`], never to NATS directly. A container and its task workers share
//! one arbiter, so a message never crosses a thread between the broker and the task.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// The cluster plan ([`flotilla_proto::cluster::assignment`]).
pub mod assignment {
    pub use flotilla_proto::cluster::assignment::*;
}
pub mod cluster;
pub mod config;
pub mod container;
pub mod events;
pub mod failpoint;
pub mod fence;
pub mod job;
pub mod metrics;
pub mod parked;
pub mod producer;
pub mod reaper;
/// The retry policy ([`flotilla_proto::backoff`]).
pub mod retry {
    pub use flotilla_proto::backoff::*;

    /// A uniform draw in `[0, 1)` from the thread's generator, for the jitter the rules
    /// take as an argument (the rules draw none of their own).
    pub fn sample() -> f64 {
        rand::random()
    }
}
/// The run loop's state machine ([`flotilla_proto::partition`]).
pub mod state {
    pub use flotilla_proto::partition::readiness::*;
}
pub mod store;
pub mod stream;
pub mod supervise;
pub mod task;
pub mod task_worker;
pub mod timer_service;
pub mod trace;

pub use config::{FailurePolicy, TaskConfig};
pub use flotilla_transport::SharedBroker;
pub use job::{Job, JobError, JobStopper, MAX_REPLICAS, RunningJob};
pub use producer::{Producer, ProducerError, Sent};
pub use retry::RetryPolicy;
pub use state::ShutdownScope;
pub use store::{Store, StoreDef, StoreError};
pub use stream::{StreamDef, StreamKind, StreamType};
pub use task::{MessageMeta, Misfire, Outputs, Task, TaskContext, TaskError};
