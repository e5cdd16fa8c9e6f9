//! Flotilla's run loop as actix actors: [`TaskWorker`](task_worker::TaskWorker),
//! [`Container`](container::Container), [`TimerService`](timer_service::TimerService)
//! and [`Reaper`](reaper::Reaper) (DESIGN §6), the [`Task`] API users implement and the
//! [`Job`] builder that starts them.
//!
//! It depends only on `flotilla-transport` and talks to a broker through
//! [`SharedBroker`], never to NATS directly. A container and its task workers share
//! one arbiter, so a message never crosses a thread between the broker and the task.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod assignment;
pub mod cluster;
pub mod config;
pub mod container;
pub mod events;
pub mod failpoint;
pub mod job;
pub mod membership;
pub mod metrics;
pub mod parked;
pub mod producer;
pub mod reaper;
pub mod retry;
pub mod state;
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
