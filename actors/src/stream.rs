//! Typed stream definitions.

use flotilla_transport::wire::Codec;
use serde::{Serialize, de::DeserializeOwned};
use std::marker::PhantomData;

/// How a stream is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// Partitioned by key, in order per partition, one task per partition.
    Ordered {
        /// Number of partitions (fixed at creation).
        partitions: u32,
    },
    /// A work queue: no order, every node competes.
    Queue,
}

/// A named, typed stream of `T`: `const ORDERS: StreamDef<Order> = StreamDef::ordered("orders", 8);`
pub struct StreamDef<T> {
    name: &'static str,
    kind: StreamKind,
    type_name: Option<&'static str>,
    _type: PhantomData<fn() -> T>,
}

impl<T> Clone for StreamDef<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for StreamDef<T> {}

impl<T> std::fmt::Debug for StreamDef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamDef").field("name", &self.name).field("kind", &self.kind).finish()
    }
}

impl<T> StreamDef<T> {
    /// An ordered stream with `partitions` partitions.
    pub const fn ordered(name: &'static str, partitions: u32) -> Self {
        Self { name, kind: StreamKind::Ordered { partitions }, type_name: None, _type: PhantomData }
    }

    /// A queue stream.
    pub const fn queue(name: &'static str) -> Self {
        Self { name, kind: StreamKind::Queue, type_name: None, _type: PhantomData }
    }

    /// Sets the type name carried in `Flotilla-Type` (default: `T`'s name without its path).
    pub const fn with_type_name(mut self, type_name: &'static str) -> Self {
        self.type_name = Some(type_name);
        self
    }

    /// The stream's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Its layout.
    pub fn kind(&self) -> StreamKind {
        self.kind
    }

    /// The type name in `Flotilla-Type`.
    pub fn type_name(&self) -> &'static str {
        self.type_name.unwrap_or_else(short_type_name::<T>)
    }
}

/// What a job knows of one of its streams' types: its layout, and how to show a payload
/// as JSON and make one from JSON. Job binaries use it for a typed `publish` and to
/// decode dead letters in `dlq show`.
#[derive(Clone, Copy)]
pub struct StreamType {
    /// The stream's name.
    pub stream: &'static str,
    /// Its layout.
    pub kind: StreamKind,
    /// The type name in `Flotilla-Type`.
    pub type_name: &'static str,
    to_json: fn(&Codec, &[u8]) -> Result<serde_json::Value, String>,
    from_json: fn(&Codec, serde_json::Value) -> Result<bytes::Bytes, String>,
}

impl std::fmt::Debug for StreamType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamType").field("stream", &self.stream).field("type_name", &self.type_name).finish()
    }
}

impl StreamType {
    /// The type of `def`'s records.
    pub fn of<T: Serialize + DeserializeOwned + 'static>(def: &StreamDef<T>) -> Self {
        Self {
            stream: def.name(),
            kind: def.kind(),
            type_name: def.type_name(),
            to_json: |codec, bytes| {
                let value: T = codec.decode(bytes).map_err(|e| e.to_string())?;
                serde_json::to_value(&value).map_err(|e| e.to_string())
            },
            from_json: |codec, json| {
                let value: T = serde_json::from_value(json).map_err(|e| e.to_string())?;
                codec.encode(&value).map_err(|e| e.to_string())
            },
        }
    }

    /// A payload of this type as JSON.
    ///
    /// # Errors
    /// Why the payload does not decode as this type.
    pub fn to_json(&self, codec: &Codec, payload: &[u8]) -> Result<serde_json::Value, String> {
        (self.to_json)(codec, payload)
    }

    /// The payload of a record given as JSON.
    ///
    /// # Errors
    /// Why the JSON is not a value of this type.
    pub fn from_json(&self, codec: &Codec, json: serde_json::Value) -> Result<bytes::Bytes, String> {
        (self.from_json)(codec, json)
    }
}

/// `T`'s name without module path or generics: `relay::Record` → `Record`.
pub fn short_type_name<T>() -> &'static str {
    let full = std::any::type_name::<T>();
    // Char searches, not `split("::")`: this runs for every output.
    let base = full.find('<').map_or(full, |at| &full[..at]);
    base.rfind(':').map_or(base, |at| &base[at + 1..])
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Record;

    #[test]
    fn type_names_are_short() {
        assert_eq!(StreamDef::<Record>::ordered("relay-in", 8).type_name(), "Record");
        assert_eq!(StreamDef::<Vec<u8>>::queue("raw").type_name(), "Vec");
        assert_eq!(StreamDef::<std::collections::HashMap<String, u8>>::queue("m").type_name(), "HashMap");
        assert_eq!(StreamDef::<u64>::queue("n").type_name(), "u64");
        assert_eq!(StreamDef::<Record>::queue("q").with_type_name("relay.Record").type_name(), "relay.Record");
    }
}
