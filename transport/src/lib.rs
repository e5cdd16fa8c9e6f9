//! Flotilla's transport layer: the wire format, the payload codec, and the [`Broker`]
//! interface with its two backends, [`JetStreamBroker`] (NATS JetStream) and
//! [`EmbeddedBroker`] (in process, same semantics).
//!
//! This crate knows nothing of actors: the run loop in `flotilla-actors` talks to a
//! broker only through [`SharedBroker`].
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod broker;
pub mod clock;
pub mod embedded;
pub mod jetstream;
pub mod kv;
pub mod topology;
pub mod wire;

pub use broker::{Broker, BrokerError, SharedBroker};
pub use embedded::EmbeddedBroker;
pub use jetstream::{JetStreamBroker, JetStreamOptions};
