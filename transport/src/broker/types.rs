use crate::wire::Headers;
use bytes::Bytes;
use std::{fmt, sync::Arc, time::Duration, time::SystemTime};

/// Which backend a broker is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerKind {
    /// NATS JetStream over the network.
    JetStream,
    /// The in-process embedded broker.
    Embedded,
}

/// A server version, `major.minor.patch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch version.
    pub patch: u32,
}

impl Version {
    /// A version from its parts.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self { major, minor, patch }
    }

    /// Parses `2.9.10`, `v2.10.0-beta.1` and the like; `None` when there are no numbers.
    pub fn parse(text: &str) -> Option<Self> {
        let core = text.trim().trim_start_matches('v');
        let core = core.split(['-', '+', ' ']).next().unwrap_or("");
        let mut parts = core.split('.').map(|p| p.parse::<u32>());
        let major = parts.next()?.ok()?;
        let minor = parts.next().unwrap_or(Ok(0)).ok()?;
        let patch = parts.next().unwrap_or(Ok(0)).ok()?;
        Some(Self { major, minor, patch })
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// A broker feature that only some servers have. Flotilla gates on these instead of
/// trusting a request that "succeeded" (2.9 silently ignores fields it does not know).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Feature {
    /// Consumers with several filter subjects (2.10).
    MultiFilter,
    /// Consumer pause/resume (2.11).
    ConsumerPause,
    /// Per-message TTL and KV limit markers (2.11).
    MessageTtl,
    /// `+TERM <reason>` (2.11; 2.9 treats it as unknown and redelivers).
    TermWithReason,
    /// Priority groups: overflow and pinned client (2.11).
    PriorityGroups,
    /// Native delayed delivery with `Nats-Schedule: @at` (2.12).
    MessageSchedules,
    /// Atomic batch publish (2.12).
    AtomicBatch,
    /// Consumer reset to a sequence (2.14).
    ConsumerReset,
}

impl Feature {
    /// Every feature, for listings.
    pub const ALL: [Feature; 8] = [
        Feature::MultiFilter,
        Feature::ConsumerPause,
        Feature::MessageTtl,
        Feature::TermWithReason,
        Feature::PriorityGroups,
        Feature::MessageSchedules,
        Feature::AtomicBatch,
        Feature::ConsumerReset,
    ];

    /// The oldest nats-server that has the feature.
    pub fn min_version(self) -> Version {
        match self {
            Feature::MultiFilter => Version::new(2, 10, 0),
            Feature::ConsumerPause | Feature::MessageTtl | Feature::TermWithReason | Feature::PriorityGroups => {
                Version::new(2, 11, 0)
            }
            Feature::MessageSchedules | Feature::AtomicBatch => Version::new(2, 12, 0),
            Feature::ConsumerReset => Version::new(2, 14, 0),
        }
    }

    /// A short name for messages.
    pub fn name(self) -> &'static str {
        match self {
            Feature::MultiFilter => "multi-filter consumers",
            Feature::ConsumerPause => "consumer pause",
            Feature::MessageTtl => "per-message TTL",
            Feature::TermWithReason => "TERM with reason",
            Feature::PriorityGroups => "priority groups",
            Feature::MessageSchedules => "message schedules",
            Feature::AtomicBatch => "atomic batch publish",
            Feature::ConsumerReset => "consumer reset",
        }
    }
}

/// What the connected broker is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerInfo {
    /// The backend.
    pub kind: BrokerKind,
    /// The server version (for the embedded broker: the level of JetStream it models).
    pub version: Version,
    /// The server's name or id.
    pub name: String,
    /// The largest payload the server accepts, in bytes.
    pub max_payload: usize,
    /// Features the embedded broker implements regardless of version.
    pub(crate) extra: Vec<Feature>,
}

impl ServerInfo {
    /// Whether the broker supports `feature`.
    pub fn supports(&self, feature: Feature) -> bool {
        match self.kind {
            BrokerKind::JetStream => self.version >= feature.min_version(),
            BrokerKind::Embedded => self.extra.contains(&feature),
        }
    }

    /// `Ok` when the broker supports `feature`.
    ///
    /// # Errors
    /// [`BrokerError::Unsupported`](super::BrokerError::Unsupported) naming the version needed.
    pub fn require(&self, feature: Feature) -> Result<(), super::BrokerError> {
        if self.supports(feature) {
            Ok(())
        } else {
            Err(super::BrokerError::Unsupported {
                feature: feature.name().into(),
                needs: feature.min_version().to_string(),
                server: format!("{} {}", self.name, self.version),
            })
        }
    }
}

/// A change in the broker connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectionEvent {
    /// Connected (or reconnected).
    Connected,
    /// The connection dropped; the client is reconnecting.
    Disconnected,
    /// The server is shutting down gracefully (lame duck mode).
    LameDuck,
    /// A subscription fell behind and messages were dropped.
    SlowConsumer,
    /// The server reported an error.
    ServerError(String),
    /// The client reported an error (for example a failed reconnect attempt).
    ClientError(String),
    /// The connection is closed for good.
    Closed,
}

/// JetStream retention policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// Keep messages until limits remove them (replayable).
    Limits,
    /// Keep messages until every consumer acked them.
    Interest,
    /// Remove a message once acked (one consumer per subject).
    WorkQueue,
}

/// Where a stream keeps its messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// On disk.
    File,
    /// In memory.
    Memory,
}

/// What a full stream does with a new message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Discard {
    /// Drop the oldest message.
    Old,
    /// Refuse the new message.
    New,
}

/// The configuration of a stream, as Flotilla wants it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSpec {
    /// The stream's name.
    pub name: String,
    /// Subjects it takes (wildcards allowed).
    pub subjects: Vec<String>,
    /// Retention policy.
    pub retention: Retention,
    /// Storage.
    pub storage: Storage,
    /// Maximum age of a message; `None` keeps messages forever.
    pub max_age: Option<Duration>,
    /// Maximum messages kept per subject; `None` for no limit.
    pub max_msgs_per_subject: Option<u64>,
    /// Maximum messages in the stream; `None` for no limit.
    pub max_msgs: Option<u64>,
    /// Maximum bytes in the stream; `None` for no limit (Flotilla sets none; an
    /// operator may).
    pub max_bytes: Option<u64>,
    /// What happens when a limit is reached.
    pub discard: Discard,
    /// The window in which a repeated `Nats-Msg-Id` is dropped.
    pub duplicate_window: Duration,
    /// Number of replicas (1 on a single server).
    pub replicas: usize,
    /// Every message is needed (a changelog): an operator's age, count or size limit,
    /// which would drop or refuse some, is refused instead of kept as a safe
    /// difference ([`BrokerError::LosesRecords`](super::BrokerError::LosesRecords)).
    pub keep_all: bool,
}

impl StreamSpec {
    /// A file-backed stream with the given name, subjects and retention, no limits and a
    /// two-minute duplicate window.
    pub fn new(name: impl Into<String>, subjects: Vec<String>, retention: Retention) -> Self {
        Self {
            name: name.into(),
            subjects,
            retention,
            storage: Storage::File,
            max_age: None,
            max_msgs_per_subject: None,
            max_msgs: None,
            max_bytes: None,
            discard: Discard::Old,
            duplicate_window: Duration::from_secs(120),
            replicas: 1,
            keep_all: false,
        }
    }

    /// The same stream with `replicas` copies (1 to 5; a clustered server places them).
    #[must_use]
    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// The same stream, every message of which is needed (see [`StreamSpec::keep_all`]).
    #[must_use]
    pub fn keeping_all(mut self) -> Self {
        self.keep_all = true;
        self
    }
}

/// The state of a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamState {
    /// The stream's name.
    pub name: String,
    /// Messages stored now.
    pub messages: u64,
    /// Sequence of the first stored message (or the next one when empty).
    pub first_seq: u64,
    /// Sequence of the last message ever stored.
    pub last_seq: u64,
    /// Number of consumers.
    pub consumers: usize,
    /// The subjects it takes.
    pub subjects: Vec<String>,
    /// Bytes stored (messages with their subjects and headers, as the server counts).
    pub bytes: u64,
    /// When the first stored message was published (`None` when empty).
    pub first_published: Option<std::time::SystemTime>,
}

/// How a consumer acknowledges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckPolicy {
    /// Each message is acked on its own.
    Explicit,
    /// Acking a message acks every earlier one (a checkpoint).
    All,
}

/// The configuration of a durable pull consumer, as Flotilla wants it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerSpec {
    /// The durable name.
    pub name: String,
    /// Only messages on this subject (pattern) are delivered; `None` for all.
    pub filter_subject: Option<String>,
    /// Ack policy.
    pub ack_policy: AckPolicy,
    /// How long a delivery may stay unacked before it is redelivered.
    pub ack_wait: Duration,
    /// Deliveries per message before it is left alone; `None` for unlimited.
    pub max_deliver: Option<u32>,
    /// Delivered-but-unacked messages allowed at once; `None` for unlimited.
    pub max_ack_pending: Option<u32>,
}

impl ConsumerSpec {
    /// An explicit-ack consumer with a 30 s ack-wait, unlimited deliveries and at most
    /// 1000 messages pending.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            filter_subject: None,
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            max_deliver: None,
            max_ack_pending: Some(1000),
        }
    }
}

/// The state of a consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerState {
    /// The stream.
    pub stream: String,
    /// The consumer.
    pub name: String,
    /// The consumer's configuration as the broker holds it.
    pub spec: ConsumerSpec,
    /// Messages not yet delivered.
    pub num_pending: u64,
    /// Messages delivered and not yet acked.
    pub num_ack_pending: u64,
    /// Messages redelivered at least once and still unacked.
    pub num_redelivered: u64,
    /// Stream sequence below which everything is acked.
    pub ack_floor: u64,
    /// Stream sequence of the last delivered message.
    pub delivered: u64,
    /// The consumer's delivery sequence of its last delivery (0 before the first). Every
    /// delivery, redeliveries included, takes the next number, so a reader that saw
    /// this one knows which delivery must come next.
    pub delivered_consumer_seq: u64,
}

/// A message to publish into a stream (or as a core message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboundMessage {
    /// The subject.
    pub subject: String,
    /// Headers, including `Nats-Msg-Id` when set.
    pub headers: Headers,
    /// The payload.
    pub payload: Bytes,
    /// Refuse the publish unless the subject's last sequence is this (0: no message yet).
    pub expected_last_subject_seq: Option<u64>,
}

impl OutboundMessage {
    /// The bytes the server counts against its `max_payload`: the payload and the
    /// header block (`NATS/1.0`, a line per header, a blank line) together.
    pub fn wire_size(&self) -> usize {
        let headers = if self.headers.is_empty() && self.expected_last_subject_seq.is_none() {
            0
        } else {
            let entries: usize = self.headers.iter().map(|(name, value)| name.len() + value.len() + 4).sum();
            // `Nats-Expected-Last-Subject-Sequence: <n>` when set.
            let expected = self.expected_last_subject_seq.map_or(0, |n| 36 + 4 + n.to_string().len());
            "NATS/1.0\r\n".len() + entries + expected + 2
        };
        self.payload.len() + headers
    }

    /// A message with the given subject and payload and no headers.
    pub fn new(subject: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Self {
            subject: subject.into(),
            headers: Headers::new(),
            payload: payload.into(),
            expected_last_subject_seq: None,
        }
    }

    /// Sets `Nats-Msg-Id`.
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.headers.insert(crate::wire::headers::MSG_ID, id.into());
        self
    }

    /// Sets a header.
    pub fn with_header(mut self, name: impl Into<std::borrow::Cow<'static, str>>, value: impl Into<String>) -> Self {
        self.headers.insert(name, value.into());
        self
    }
}

/// The broker's confirmation that a message is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishAck {
    /// The stream that stored it.
    pub stream: String,
    /// Its stream sequence.
    pub seq: u64,
    /// Whether it was a duplicate of an earlier message id (and not stored again).
    pub duplicate: bool,
}

/// Delivery metadata of a claimed message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryInfo {
    /// The stream.
    pub stream: Arc<str>,
    /// The consumer.
    pub consumer: Arc<str>,
    /// The message's stream sequence.
    pub stream_seq: u64,
    /// The consumer's delivery sequence.
    pub consumer_seq: u64,
    /// How many times it has been delivered, this one included (1 on first delivery).
    pub delivered: u64,
    /// Messages still pending on the consumer after this one.
    pub pending: u64,
    /// When the message was stored.
    pub published: SystemTime,
}

/// Identifies a delivery for acknowledgement. Opaque; cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AckToken(pub(crate) AckTokenInner);

impl AckToken {
    /// A token for a message read by sequence rather than delivered: it cannot be acked.
    pub fn none() -> Self {
        AckToken(AckTokenInner::Detached)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AckTokenInner {
    /// Not a delivery: acking it is an error.
    Detached,
    /// JetStream: the reply subject of the delivery (shared bytes: cloning is cheap).
    Reply(async_nats::Subject),
    /// Embedded: stream, consumer, stream sequence.
    Embedded { stream: Arc<str>, consumer: Arc<str>, seq: u64 },
}

pub use flotilla_proto::partition::AckKind;

/// A message claimed from a consumer.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The subject it was published to (shared: the deliveries of one partition, or of
    /// one stored message, hold the same allocation).
    pub subject: Arc<str>,
    /// Its headers.
    pub headers: Headers,
    /// Its payload.
    pub payload: Bytes,
    /// Delivery metadata.
    pub info: DeliveryInfo,
    /// Pass to [`Broker::ack`](super::Broker::ack).
    pub token: AckToken,
}

/// A message read from a stream by sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    /// The subject.
    pub subject: String,
    /// The stream sequence.
    pub seq: u64,
    /// Headers.
    pub headers: Headers,
    /// Payload.
    pub payload: Bytes,
    /// When it was stored.
    pub published: SystemTime,
}

/// The configuration of a KV bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvSpec {
    /// The bucket's name (`[A-Za-z0-9_-]+`).
    pub bucket: String,
    /// Values kept per key (1 to 64).
    pub history: u8,
    /// Entries expire this long after their last write; `None` never.
    pub max_age: Option<Duration>,
    /// Storage.
    pub storage: Storage,
    /// Number of replicas of the bucket's stream (1 on a single server).
    pub replicas: usize,
    /// Every record is needed (a changelog that a restore reads): an operator's max
    /// age, or a count or size limit on the bucket's stream, is refused instead of kept
    /// as a safe difference ([`BrokerError::LosesRecords`](super::BrokerError::LosesRecords)).
    pub keep_all: bool,
}

impl KvSpec {
    /// A file-backed bucket with history 1 and one replica.
    pub fn new(bucket: impl Into<String>, max_age: Option<Duration>) -> Self {
        Self { bucket: bucket.into(), history: 1, max_age, storage: Storage::File, replicas: 1, keep_all: false }
    }

    /// The same bucket with `replicas` copies.
    #[must_use]
    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// The same bucket, every record of which is needed (see [`KvSpec::keep_all`]).
    #[must_use]
    pub fn keeping_all(mut self) -> Self {
        self.keep_all = true;
        self
    }
}

/// What a KV entry records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvOperation {
    /// A value was written.
    Put,
    /// The key was deleted.
    Delete,
    /// The key was purged.
    Purge,
}

/// A KV entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEntry {
    /// The bucket.
    pub bucket: String,
    /// The key.
    pub key: String,
    /// The value (empty for deletes).
    pub value: Bytes,
    /// The revision (the stream sequence of this write): the fencing epoch of a lease.
    pub revision: u64,
    /// What the entry records.
    pub operation: KvOperation,
}

/// A core NATS message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoreMessage {
    /// The subject.
    pub subject: String,
    /// Where to reply, for requests.
    pub reply: Option<String>,
    /// Headers.
    pub headers: Headers,
    /// Payload.
    pub payload: Bytes,
}

impl CoreMessage {
    /// A message with a subject and payload.
    pub fn new(subject: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Self { subject: subject.into(), reply: None, headers: Headers::new(), payload: payload.into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_size_counts_the_header_block() {
        let bare = OutboundMessage::new("s", vec![0u8; 100]);
        assert_eq!(bare.wire_size(), 100);
        let with = bare.clone().with_header("Nats-Msg-Id", "abc");
        // "NATS/1.0\r\n" + "Nats-Msg-Id: abc\r\n" + "\r\n"
        assert_eq!(with.wire_size(), 100 + 10 + (11 + 2 + 3 + 2) + 2);
    }

    #[test]
    fn versions_parse_and_gate() {
        assert_eq!(Version::parse("2.9.10"), Some(Version::new(2, 9, 10)));
        assert_eq!(Version::parse("v2.10.0-beta.1"), Some(Version::new(2, 10, 0)));
        assert_eq!(Version::parse("2.11"), Some(Version::new(2, 11, 0)));
        assert_eq!(Version::parse(""), None);
        assert_eq!(Version::parse("x.y"), None);
        let old = ServerInfo {
            kind: BrokerKind::JetStream,
            version: Version::new(2, 9, 10),
            name: "n".into(),
            max_payload: 1 << 20,
            extra: vec![],
        };
        assert!(!old.supports(Feature::MultiFilter));
        let err = old.require(Feature::MessageSchedules).expect_err("2.9 has no schedules").to_string();
        assert!(err.contains("2.12.0") && err.contains("2.9.10"), "{err}");
        let new = ServerInfo { version: Version::new(2, 15, 1), ..old };
        assert!(Feature::ALL.iter().all(|f| new.supports(*f)));
    }
}
