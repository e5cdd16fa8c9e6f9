//! Flotilla's run loop as actix actors: `TaskWorker`, `Container`, `TimerService` and
//! `Reaper` (DESIGN §6).
//!
//! Not built yet: this crate is the home of the run-loop issue. It depends only on
//! `flotilla-transport` and talks to a broker through
//! [`SharedBroker`], never to NATS directly.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub use flotilla_transport::SharedBroker;
