//! Flotilla's run loop as actix actors: `TaskWorker`, `Container`, `TimerService` and
//! `Reaper` (DESIGN §6), and the [`Task`] API users implement.
//!
//! It depends only on `flotilla-transport` and talks to a broker through
//! [`SharedBroker`], never to NATS directly.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod state;

pub use flotilla_transport::SharedBroker;
