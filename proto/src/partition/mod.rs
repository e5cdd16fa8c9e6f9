//! The per-partition run loop's rules.

pub mod readiness;

pub use readiness::{CoordinatorRequests, EnvelopeKind, InputId, Op, Pending, ShutdownScope, TaskState};
