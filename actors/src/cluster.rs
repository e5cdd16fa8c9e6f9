//! What the nodes of a job share: the records in the job's KV buckets and the control
//! requests and replies. The types and keys are `flotilla-proto`'s
//! ([`flotilla_proto::cluster::control`]), re-exported here at their old paths; the
//! cluster layer that acts on them (membership, join, leases) is `flotilla-node`'s.

pub use crate::fence::Fence;
pub use flotilla_proto::cluster::control::*;

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}
