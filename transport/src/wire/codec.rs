//! The payload codec: bincode 2 through serde, standard configuration, with a size limit.
//!
//! Standard configuration means little-endian, variable-length integers and no field
//! names; `docs/wire-format.md` spells out the bytes. The codec never panics on input
//! from outside the process: every failure is a [`CodecError`] whose
//! [`reason`](CodecError::reason) becomes the dead-letter reason.

use super::headers::{self, Headers};
use bytes::Bytes;
use serde::{Serialize, de::DeserializeOwned};

/// The payload wire-format version this build writes and reads.
pub const WIRE_VERSION: u32 = 1;
/// Default payload limit: 1 MiB, NATS's default `max_payload`.
pub const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;
/// The largest limit a [`Codec`] accepts (64 MiB, NATS's hard maximum payload).
/// The decoder also refuses any length prefix that would allocate past it.
pub const HARD_MAX_PAYLOAD: usize = 64 * 1024 * 1024;

type Config = bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<HARD_MAX_PAYLOAD>,
>;

fn config() -> Config {
    bincode::config::standard().with_limit::<HARD_MAX_PAYLOAD>()
}

/// Why a payload could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The payload is over the configured limit.
    #[error("payload of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Payload size in bytes.
        size: usize,
        /// The codec's limit in bytes.
        limit: usize,
    },
    /// The bytes are not a valid encoding of the expected type.
    #[error("malformed payload for type {type_name}: {reason}")]
    Malformed {
        /// The type that was expected.
        type_name: String,
        /// What the decoder found wrong.
        reason: String,
    },
    /// The message declares (in `Flotilla-Type`) a type other than the stream's.
    #[error("type mismatch: the stream carries {expected} but the message declares {found}")]
    TypeMismatch {
        /// The stream's declared type name.
        expected: String,
        /// The type name in the message's header.
        found: String,
    },
    /// The message declares (in `Flotilla-Wire`) a wire version this build cannot read.
    #[error("unsupported wire version {found:?}: this build reads version {WIRE_VERSION}")]
    UnsupportedVersion {
        /// The header's value.
        found: String,
    },
    /// The value could not be encoded (for example a map with non-string keys is fine,
    /// but a type whose `Serialize` fails is not).
    #[error("cannot encode a value of type {type_name}: {reason}")]
    Encode {
        /// The type being encoded.
        type_name: String,
        /// The encoder's error.
        reason: String,
    },
}

impl CodecError {
    /// The short code used in the `Flotilla-Dlq-Reason` header.
    pub fn reason(&self) -> &'static str {
        match self {
            CodecError::TooLarge { .. } => "too-large",
            CodecError::Malformed { .. } => "malformed",
            CodecError::TypeMismatch { .. } => "type-mismatch",
            CodecError::UnsupportedVersion { .. } => "unsupported-version",
            CodecError::Encode { .. } => "encode",
        }
    }
}

/// Encodes and decodes message payloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Codec {
    max_payload: usize,
}

impl Default for Codec {
    fn default() -> Self {
        Self { max_payload: DEFAULT_MAX_PAYLOAD }
    }
}

impl Codec {
    /// A codec refusing payloads over `max_payload` bytes (capped at [`HARD_MAX_PAYLOAD`]).
    pub fn with_max_payload(max_payload: usize) -> Self {
        Self { max_payload: max_payload.min(HARD_MAX_PAYLOAD) }
    }

    /// The payload limit in bytes.
    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    /// How many bytes `value` encodes to, without encoding it into memory.
    ///
    /// # Errors
    /// [`CodecError::Encode`] when serialization fails.
    pub fn encoded_len<T: Serialize>(&self, value: &T) -> Result<usize, CodecError> {
        let mut size = bincode::enc::write::SizeWriter::default();
        bincode::serde::encode_into_writer(value, &mut size, config()).map_err(|e| CodecError::Encode {
            type_name: std::any::type_name::<T>().to_owned(),
            reason: e.to_string(),
        })?;
        Ok(size.bytes_written)
    }

    /// Encodes `value`.
    ///
    /// # Errors
    /// [`CodecError::Encode`] when serialization fails, [`CodecError::TooLarge`] when the
    /// result is over the limit.
    pub fn encode<T: Serialize>(&self, value: &T) -> Result<Bytes, CodecError> {
        let bytes = bincode::serde::encode_to_vec(value, config()).map_err(|e| CodecError::Encode {
            type_name: std::any::type_name::<T>().to_owned(),
            reason: e.to_string(),
        })?;
        if bytes.len() > self.max_payload {
            return Err(CodecError::TooLarge { size: bytes.len(), limit: self.max_payload });
        }
        Ok(Bytes::from(bytes))
    }

    /// Decodes a `T` from `bytes`, which must be consumed entirely.
    ///
    /// # Errors
    /// [`CodecError::TooLarge`] over the limit, [`CodecError::Malformed`] for bytes that are
    /// not exactly one encoded `T`.
    pub fn decode<T: DeserializeOwned>(&self, bytes: &[u8]) -> Result<T, CodecError> {
        if bytes.len() > self.max_payload {
            return Err(CodecError::TooLarge { size: bytes.len(), limit: self.max_payload });
        }
        let malformed =
            |reason: String| CodecError::Malformed { type_name: std::any::type_name::<T>().to_owned(), reason };
        let (value, read) =
            bincode::serde::decode_from_slice::<T, _>(bytes, config()).map_err(|e| malformed(e.to_string()))?;
        if read != bytes.len() {
            return Err(malformed(format!(
                "{} trailing bytes after the value (read {read} of {})",
                bytes.len() - read,
                bytes.len()
            )));
        }
        Ok(value)
    }

    /// Checks the headers that describe a payload: `Flotilla-Wire` must be absent or
    /// [`WIRE_VERSION`], and `Flotilla-Type`, when present, must equal `expected_type`.
    ///
    /// # Errors
    /// [`CodecError::UnsupportedVersion`] or [`CodecError::TypeMismatch`].
    pub fn check_headers(&self, headers: &Headers, expected_type: &str) -> Result<(), CodecError> {
        if let Some(v) = headers.get(headers::WIRE)
            && v.trim().parse::<u32>() != Ok(WIRE_VERSION)
        {
            return Err(CodecError::UnsupportedVersion { found: v.to_owned() });
        }
        if let Some(found) = headers.get(headers::TYPE)
            && found != expected_type
        {
            return Err(CodecError::TypeMismatch { expected: expected_type.to_owned(), found: found.to_owned() });
        }
        Ok(())
    }

    /// [`check_headers`](Self::check_headers), then [`decode`](Self::decode).
    ///
    /// # Errors
    /// Any [`CodecError`] of either step.
    pub fn decode_message<T: DeserializeOwned>(
        &self,
        headers: &Headers,
        expected_type: &str,
        bytes: &[u8],
    ) -> Result<T, CodecError> {
        self.check_headers(headers, expected_type)?;
        self.decode(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde::Deserialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Record {
        id: u64,
        body: String,
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    enum Shape {
        Dot,
        Circle { r: u32 },
        Line(i32, i32),
    }

    #[test]
    fn record_bytes_are_pinned() {
        let c = Codec::default();
        let bytes = c.encode(&Record { id: 42, body: "hi".into() }).expect("encode");
        assert_eq!(&bytes[..], &[0x2a, 0x02, b'h', b'i']);
        let big = c.encode(&Record { id: 300, body: String::new() }).expect("encode");
        assert_eq!(&big[..], &[0xfb, 0x2c, 0x01, 0x00]);
        let huge = c.encode(&Record { id: 70_000, body: String::new() }).expect("encode");
        assert_eq!(&huge[..], &[0xfc, 0x70, 0x11, 0x01, 0x00, 0x00]);
        assert_eq!(c.decode::<Record>(&bytes).expect("decode"), Record { id: 42, body: "hi".into() });
    }

    #[test]
    fn enums_signed_and_options_are_pinned() {
        let c = Codec::default();
        assert_eq!(&c.encode(&Shape::Dot).expect("e")[..], &[0x00]);
        assert_eq!(&c.encode(&Shape::Circle { r: 5 }).expect("e")[..], &[0x01, 0x05]);
        // zigzag: -1 → 1, 2 → 4
        assert_eq!(&c.encode(&Shape::Line(-1, 2)).expect("e")[..], &[0x02, 0x01, 0x04]);
        assert_eq!(&c.encode(&Some(7u8)).expect("e")[..], &[0x01, 0x07]);
        assert_eq!(&c.encode(&None::<u8>).expect("e")[..], &[0x00]);
        assert_eq!(&c.encode(&true).expect("e")[..], &[0x01]);
        assert_eq!(&c.encode(&1.5f64).expect("e")[..], &1.5f64.to_le_bytes());
    }

    #[test]
    fn malformed_and_trailing_bytes_are_errors() {
        let c = Codec::default();
        let err = c.decode::<Record>(&[0x2a, 0x05, b'h']).expect_err("short");
        assert_eq!(err.reason(), "malformed");
        let err = c.decode::<Record>(&[0x2a, 0x00, 0xff]).expect_err("trailing");
        assert!(err.to_string().contains("1 trailing bytes"), "{err}");
        let err = c.decode::<String>(&[0x02, 0xff, 0xfe]).expect_err("utf8");
        assert_eq!(err.reason(), "malformed");
        // A length prefix claiming 2^60 bytes must not allocate.
        let mut claim = vec![0xfd];
        claim.extend_from_slice(&(1u64 << 60).to_le_bytes());
        assert_eq!(c.decode::<Vec<u8>>(&claim).expect_err("limit").reason(), "malformed");
    }

    #[test]
    fn size_limit_is_enforced_both_ways() {
        let c = Codec::with_max_payload(16);
        let body = "x".repeat(32);
        let err = c.encode(&body).expect_err("too large");
        assert_eq!(err, CodecError::TooLarge { size: 33, limit: 16 });
        let err = c.decode::<String>(&[0u8; 17]).expect_err("too large");
        assert_eq!(err.reason(), "too-large");
        assert_eq!(Codec::with_max_payload(usize::MAX).max_payload(), HARD_MAX_PAYLOAD);
    }

    #[test]
    fn headers_are_checked() {
        let c = Codec::default();
        let ok = Headers::new().with(headers::TYPE, "Record").with(headers::WIRE, "1");
        assert!(c.check_headers(&ok, "Record").is_ok());
        assert!(c.check_headers(&Headers::new(), "Record").is_ok());
        let wrong_type = Headers::new().with(headers::TYPE, "Order");
        let err = c.check_headers(&wrong_type, "Record").expect_err("type");
        assert_eq!(err, CodecError::TypeMismatch { expected: "Record".into(), found: "Order".into() });
        let wrong_version = Headers::new().with(headers::WIRE, "2");
        assert_eq!(c.check_headers(&wrong_version, "Record").expect_err("v").reason(), "unsupported-version");
        let err =
            c.decode_message::<Record>(&wrong_type, "Record", &[0x2a, 0x00]).expect_err("checked before decoding");
        assert_eq!(err.reason(), "type-mismatch");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let c = Codec::default();
            let _ = c.decode::<Record>(&bytes);
            let _ = c.decode::<Vec<Shape>>(&bytes);
            let _ = c.decode::<(String, Option<u64>, Vec<String>)>(&bytes);
            let _ = c.decode::<std::collections::HashMap<String, i64>>(&bytes);
        }

        #[test]
        fn round_trips(id in any::<u64>(), body in ".*") {
            let c = Codec::with_max_payload(HARD_MAX_PAYLOAD);
            let r = Record { id, body };
            let bytes = c.encode(&r).expect("encode");
            prop_assert_eq!(c.decode::<Record>(&bytes).expect("decode"), r);
        }
    }
}

/// The encodings `docs/wire-format.md` states, pinned.
#[cfg(test)]
mod documented_encodings {
    use super::Codec;
    use std::collections::BTreeMap;

    fn enc<T: serde::Serialize>(v: &T) -> Vec<u8> {
        Codec::default().encode(v).expect("encode").to_vec()
    }

    #[test]
    fn integers() {
        assert_eq!(enc(&250u64), [250]);
        assert_eq!(enc(&251u64), [251, 251, 0]);
        assert_eq!(enc(&65_535u32), [251, 0xff, 0xff]);
        assert_eq!(enc(&65_536u32), [252, 0, 0, 1, 0]);
        assert_eq!(enc(&(1u64 << 32)), [253, 0, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(enc(&200u8), [200], "u8 is one raw byte");
        assert_eq!(enc(&-1i8), [0xff], "i8 is one raw byte");
        assert_eq!(enc(&-1i64), [1], "zigzag");
        assert_eq!(enc(&-2i32), [3]);
        assert_eq!(enc(&63i64), [126]);
        assert_eq!(enc(&-126i64), [251, 251, 0]);
    }

    #[test]
    fn text_sequences_maps() {
        assert_eq!(enc(&'é'), [0xc3, 0xa9], "char as UTF-8");
        assert_eq!(enc(&"héllo"), [6, b'h', 0xc3, 0xa9, b'l', b'l', b'o']);
        assert_eq!(enc(&vec![1u32, 300]), [2, 1, 251, 0x2c, 0x01]);
        let m: BTreeMap<String, u32> = [("a".to_owned(), 1), ("b".to_owned(), 2)].into();
        assert_eq!(enc(&m), [2, 1, b'a', 1, 1, b'b', 2]);
        assert_eq!(enc(&()), Vec::<u8>::new());
        assert_eq!(enc(&(7u16, false)), [7, 0]);
        assert_eq!(enc(&1.0f32), 1.0f32.to_le_bytes());
    }
}
