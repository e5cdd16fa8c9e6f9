//! Flotilla's rules as plain data (sans-IO, like `quinn-proto`): every decision the
//! runtime makes, as data and functions with time passed in. No actors, no broker, no
//! clock or thread of its own; `flotilla-actors` performs what these rules decide.
//!
//! * [`partition`]: the per-partition run loop's readiness and priorities
//!   ([`partition::TaskState`]);
//! * [`store`]: the changelog's records, how a restore resolves a key, and the claim a
//!   new writer makes;
//! * [`backoff`]: the retry policy and its one back-off;
//! * [`cluster`]: the plan of which node holds which ordered partition, and the typed
//!   control protocol (bucket records, requests, replies; one decode policy);
//! * [`partitioner`]: the partition of a key (part of the wire format);
//! * [`timers`]: when a durable timer's fire is stale, and the record of its last change.
//!
//! `docs/architecture.md` says which crate decides and which performs.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod backoff;
pub mod cluster;
pub mod partition;
pub mod partitioner;
pub mod store;
pub mod timers;
