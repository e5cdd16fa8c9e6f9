//! Flotilla is a durable, distributed actor runtime on NATS JetStream. You write
//! [`Task`](prelude::Task)s — actors with typed messages — and declare a
//! [`Job`](prelude::Job) of them; Flotilla runs one task per partition of an ordered
//! stream (in-order commits, windows, timers, drain markers) or competing workers on a
//! queue (claim what can start, heartbeat long work, retry with backoff, dead-letter
//! poison), on a cluster of node processes, and keeps work safe when a node dies, a
//! handler hangs or a message is poison. Without a NATS URL it runs on an embedded
//! in-memory broker with the same semantics.
//!
//! ```no_run
//! use flotilla::prelude::*;
//!
//! #[derive(Serialize, Deserialize)]
//! struct Order { id: u64, cents: u64 }
//! const ORDERS: StreamDef<Order> = StreamDef::ordered("orders", 8);
//!
//! struct Audit;
//! impl Task for Audit {
//!     type Input = Order;
//!     async fn process(&mut self, order: Order, _ctx: &mut TaskContext) -> Result<(), TaskError> {
//!         println!("order {} for {} cents", order.id, order.cents);
//!         Ok(())
//!     }
//! }
//!
//! fn main() -> Result<(), NodeError> {
//!     Job::new("audit").task(ORDERS, |_partition| Audit).run_from_args()
//! }
//! ```
//!
//! Where to go next:
//!
//! * [`prelude`]: what a job or a tool needs in scope: [`Task`](prelude::Task),
//!   [`TaskContext`](prelude::TaskContext) (outputs, stores, timers),
//!   [`Job`](prelude::Job), [`StreamDef`](prelude::StreamDef),
//!   [`StoreDef`](prelude::StoreDef), [`Producer`](prelude::Producer) (feeding a job
//!   from any program), [`NodeArgs`](prelude::NodeArgs).
//! * [`actors`]: the run loop as actix actors (task workers, container, timer service,
//!   reaper) and the plain-data decisions they act on.
//! * [`node`]: a node process, the cluster layer (joining, membership, leases;
//!   `job.start_node(…)` with [`JoinCluster`](prelude::JoinCluster)), the control
//!   plane's client (`status`, `drain`, `stop`, `dlq`, `publish`) and the `flotilla`
//!   command-line tool.
//! * [`transport`]: the wire format, the codec, the broker interface and its JetStream
//!   and embedded backends.
//!
//! The repository's `README.md` has the set-up, the examples and the cluster commands;
//! its `docs/` folder has the wire format for producers in other languages
//! (`wire-format.md`), membership and leases (`cluster.md`), what each error costs a
//! message (`errors.md`), durable state (`state.md`) and the fault matrix
//! (`reliability.md`).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

// The README's examples compile as doc tests, so the README stays true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

pub use flotilla_actors as actors;
pub use flotilla_node as node;
pub use flotilla_transport as transport;

pub use flotilla_node::NodeError;

/// What a job or tool usually needs in scope.
pub mod prelude {
    pub use flotilla_actors::{
        FailurePolicy, Job, MessageMeta, Misfire, Producer, ProducerError, RetryPolicy, Sent, ShutdownScope, Store,
        StoreDef, StreamDef, Task, TaskConfig, TaskContext, TaskError,
    };
    pub use flotilla_node::cluster::JoinCluster;
    pub use flotilla_node::connect::{BrokerChoice, connect};
    pub use flotilla_node::{JobRunner, NodeArgs, NodeError};
    pub use flotilla_transport::broker::{
        AckKind, Broker, BrokerError, ConsumerSpec, Delivery, OutboundMessage, SharedBroker, StreamSpec,
    };
    pub use flotilla_transport::wire::{Codec, CodecError, Headers, JobName, MessageId, StreamName, Subjects};
    pub use serde::{Deserialize, Serialize};
}
