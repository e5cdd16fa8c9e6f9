//! Message ids: UUID v7 for new messages, and deterministic ids for outputs.
//!
//! Every message Flotilla publishes carries `Nats-Msg-Id`, so JetStream's duplicate
//! window drops a retried publish. A message that a handler produces while processing an
//! input gets an id derived from the input's id and the output's index, so when the input
//! is redelivered and processed again, the same outputs get the same ids and are dropped
//! as duplicates downstream.

use std::fmt;
use std::sync::Arc;
use uuid::Uuid;

/// The UUID v5 namespace of derived output ids. Part of the wire format: never change it.
pub const OUTPUT_ID_NAMESPACE: Uuid = Uuid::from_u128(0x6f4c_1a2e_3b5d_4e7f_8a9b_0c1d_2e3f_4a5b);

/// A message id, as carried in `Nats-Msg-Id`.
///
/// Flotilla's own ids are UUIDs in the hyphenated lowercase form; ids from foreign
/// producers may be any non-empty string and are kept verbatim.
/// Clones share the text.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId(Arc<str>);

impl MessageId {
    /// A fresh, time-ordered UUID v7 id.
    pub fn new_v7() -> Self {
        let mut out = Uuid::encode_buffer();
        Self(Arc::from(&*Uuid::now_v7().hyphenated().encode_lower(&mut out)))
    }

    /// Wraps an id received on the wire.
    pub fn from_wire(id: impl AsRef<str>) -> Self {
        Self(Arc::from(id.as_ref()))
    }

    /// The id in a header value, sharing its text when the value is shared.
    pub fn from_header(id: &super::HeaderText) -> Self {
        match id {
            super::HeaderText::Shared(text) => Self(text.clone()),
            other => Self::from_wire(other.as_str()),
        }
    }

    /// The id of the `index`-th output (counting from 0) produced while processing the
    /// message with this id: `UUIDv5(OUTPUT_ID_NAMESPACE, "<this id>/<index>")`, where
    /// `<index>` is written in decimal. See `docs/wire-format.md`.
    pub fn derive_output(&self, index: u32) -> MessageId {
        let mut out = Uuid::encode_buffer();
        Self(Arc::from(&*self.derived(index).hyphenated().encode_lower(&mut out)))
    }

    /// [`derive_output`](Self::derive_output) as the text that goes into `Nats-Msg-Id`
    /// (one allocation, for the hot path of sending outputs).
    pub fn derive_output_text(&self, index: u32) -> String {
        let mut out = Uuid::encode_buffer();
        self.derived(index).hyphenated().encode_lower(&mut out).to_owned()
    }

    fn derived(&self, index: u32) -> Uuid {
        // "<id>/<index>" on the stack when it fits (the hot path sends many outputs).
        let mut buf = [0u8; 96];
        let name = {
            use std::io::Write;
            let mut w = &mut buf[..];
            match write!(w, "{}/{}", self.0, index) {
                Ok(()) => {
                    let len = 96 - w.len();
                    std::borrow::Cow::Borrowed(&buf[..len])
                }
                Err(_) => std::borrow::Cow::Owned(format!("{}/{}", self.0, index).into_bytes()),
            }
        };
        Uuid::new_v5(&OUTPUT_ID_NAMESPACE, &name)
    }

    /// The id as sent on the wire.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&MessageId> for super::HeaderText {
    /// The id as header text, sharing it (no copy).
    fn from(id: &MessageId) -> Self {
        super::HeaderText::Shared(id.0.clone())
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_ids_are_v7_and_time_ordered() {
        let a = MessageId::new_v7();
        let b = MessageId::new_v7();
        let ua = Uuid::parse_str(a.as_str()).expect("uuid");
        assert_eq!(ua.get_version_num(), 7);
        assert!(a < b, "{a} then {b}");
    }

    #[test]
    fn output_ids_are_deterministic_and_pinned() {
        let cause = MessageId::from_wire("0190b6a4-7d2c-7c3e-9a51-3f0e8b1c2d4e");
        assert_eq!(cause.derive_output(0), cause.derive_output(0));
        assert_ne!(cause.derive_output(0), cause.derive_output(1));
        // Pinned: docs/wire-format.md shows this worked example.
        assert_eq!(cause.derive_output(0).as_str(), PINNED_OUTPUT_0);
        assert_eq!(cause.derive_output_text(0), PINNED_OUTPUT_0);
        let foreign = MessageId::from_wire("order-42");
        assert_eq!(
            foreign.derive_output(3),
            MessageId::from_wire(Uuid::new_v5(&OUTPUT_ID_NAMESPACE, b"order-42/3").hyphenated().to_string())
        );
    }

    const PINNED_OUTPUT_0: &str = "b6b2f8bd-770b-54be-a0b8-ec7eae4acf40";
}
