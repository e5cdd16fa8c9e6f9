//! The wire format (DESIGN §4): names, subjects, headers, ids, the partitioner and the
//! payload codec. `docs/wire-format.md` is the byte-level description of the same.

pub mod codec;
pub mod headers;
pub mod ids;
pub mod names;
/// The partitioner (`flotilla_proto::partitioner`): part of the wire format.
pub mod partition {
    pub use flotilla_proto::partitioner::*;
}
pub mod subjects;

pub use codec::{Codec, CodecError, DEFAULT_MAX_PAYLOAD, HARD_MAX_PAYLOAD, WIRE_VERSION};
pub use headers::{HeaderText, Headers, MessageKind};
pub use ids::MessageId;
pub use names::{JobName, NAME_RULE, NameError, StreamName};
pub use partition::{fnv1a64, partition_for};
pub use subjects::Subjects;

#[cfg(test)]
mod props;
