//! The per-partition run loop's rules.

pub mod intake;
pub mod machine;
pub mod readiness;

/// How to acknowledge a delivery (the broker's acknowledgement verbs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckKind {
    /// Done (on an ack-all consumer: this and every earlier delivery).
    Ack,
    /// Not done: redeliver after the delay (at once when `None`).
    Nak(Option<std::time::Duration>),
    /// Still working: restart the ack-wait timer.
    InProgress,
    /// Never redeliver (removes it from WorkQueue and Interest streams). Sent without a
    /// reason, which 2.9 servers would not understand.
    Term,
}

pub use readiness::{CoordinatorRequests, EnvelopeKind, InputId, Op, Pending, ShutdownScope, TaskState};
