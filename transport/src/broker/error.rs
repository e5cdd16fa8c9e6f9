use crate::wire::{CodecError, NameError};

/// What went wrong talking to the broker. Every message says what to do about it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BrokerError {
    /// The server could not be reached at connect time.
    #[error(
        "cannot reach NATS at {url}: {reason}; is nats-server running with JetStream (-js)? \
         Install it with `apt-get install nats-server`, or run without --nats to use the embedded broker"
    )]
    Unreachable {
        /// The URL(s) tried.
        url: String,
        /// The connection error.
        reason: String,
    },
    /// The server answers but has JetStream disabled.
    #[error("the NATS server at {url} has JetStream disabled: start it with `nats-server -js`")]
    JetStreamDisabled {
        /// The server URL.
        url: String,
    },
    /// The connection is down right now; the operation may succeed after reconnecting.
    #[error("NATS connection unavailable during {operation}: {reason}")]
    Disconnected {
        /// What was attempted.
        operation: String,
        /// The transport error.
        reason: String,
    },
    /// A stream does not exist.
    #[error("stream {stream} does not exist; it is created when the job that owns it starts")]
    StreamNotFound {
        /// The stream name.
        stream: String,
    },
    /// A consumer does not exist.
    #[error("consumer {consumer} of stream {stream} does not exist")]
    ConsumerNotFound {
        /// The stream name.
        stream: String,
        /// The consumer name.
        consumer: String,
    },
    /// No stream takes the subject of a JetStream publish.
    #[error(
        "no stream takes subject {subject}: the stream does not exist yet (start the job, or send with a Producer, which creates it), or it has no such partition"
    )]
    NoStream {
        /// The subject published to.
        subject: String,
    },
    /// An existing stream, consumer or bucket has another configuration than wanted.
    #[error(
        "{object} exists with {field} = {existing}, but this job wants {wanted}; nothing was changed. \
         Delete or migrate it (for example `nats stream rm`), or change the job's settings to match"
    )]
    ConfigMismatch {
        /// `stream X`, `consumer X of stream Y` or `KV bucket X`.
        object: String,
        /// The differing field.
        field: String,
        /// The value found.
        existing: String,
        /// The value wanted.
        wanted: String,
    },
    /// An existing stream or bucket every record of which is needed (a changelog) has a
    /// limit that drops or refuses records.
    #[error(
        "{object} has {field} = {existing}, which {}; every record of it is needed, so nothing was \
         started or changed. Remove the limit: `{fix}`",
        limit_consequence(field)
    )]
    LosesRecords {
        /// `stream X` or `KV bucket X`.
        object: String,
        /// The limit (`max_age`, `max_msgs`, `max_bytes`).
        field: &'static str,
        /// Its value on the server.
        existing: String,
        /// The command that removes it.
        fix: String,
    },
    /// A publish expectation (`expected_last_subject_seq`) failed.
    #[error("publish to {subject} refused: expected last sequence {expected} but it is {actual}")]
    WrongLastSequence {
        /// The subject.
        subject: String,
        /// The expected sequence.
        expected: u64,
        /// The actual last sequence (0 when unknown).
        actual: u64,
    },
    /// A KV bucket does not exist.
    #[error("KV bucket {bucket} does not exist")]
    BucketNotFound {
        /// The bucket name.
        bucket: String,
    },
    /// `kv_create` on a key that has a live value.
    #[error("key {key} in bucket {bucket} already exists")]
    KvKeyExists {
        /// The bucket.
        bucket: String,
        /// The key.
        key: String,
    },
    /// `kv_update` / `kv_delete` with a revision that is no longer current.
    #[error("key {key} in bucket {bucket} is no longer at revision {expected}")]
    KvWrongRevision {
        /// The bucket.
        bucket: String,
        /// The key.
        key: String,
        /// The revision the caller expected.
        expected: u64,
    },
    /// A request found nobody listening on its subject.
    #[error("no responders on {subject}: no node of the job is listening")]
    NoResponders {
        /// The subject.
        subject: String,
    },
    /// An operation did not complete in time.
    #[error("{operation} timed out after {after:?}")]
    TimedOut {
        /// What was attempted.
        operation: String,
        /// How long it waited.
        after: std::time::Duration,
    },
    /// A feature the server does not support.
    #[error("{feature} needs nats-server {needs} or newer, but the server is {server}")]
    Unsupported {
        /// The feature.
        feature: String,
        /// The minimum server version.
        needs: String,
        /// The server's version.
        server: String,
    },
    /// The message (payload and headers) is over the server's `max_payload`.
    #[error("message of {size} bytes (payload and headers) exceeds the server's max_payload of {limit} bytes")]
    PayloadTooLarge {
        /// The message size.
        size: usize,
        /// The server's limit.
        limit: usize,
    },
    /// A header NATS cannot carry: a name that is not printable ASCII or holds `:`, or
    /// a value with a line break.
    #[error(
        "header {name:?} cannot be sent: {reason} (names are printable ASCII without ':', \
         values have no CR or LF)"
    )]
    InvalidHeader {
        /// The header's name.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A name broke the naming rule.
    #[error(transparent)]
    Name(#[from] NameError),
    /// A payload could not be encoded or decoded.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// The server answered that it cannot take the request now (status 503: JetStream
    /// unavailable, a stream without a leader, insufficient resources, a store error).
    #[error("{operation}: the server is unavailable for it now: {reason}")]
    ServerUnavailable {
        /// What was attempted.
        operation: String,
        /// What the server said.
        reason: String,
    },
    /// The server's JetStream store is full: its `max_file_store` / `max_memory_store`,
    /// an account limit or the disk itself (JetStream error codes 10023 "insufficient
    /// resources", 10047 "insufficient storage resources available", 10028 for
    /// memory, or a store write that failed with no space left). Nothing was stored; the
    /// same request succeeds once space returns.
    #[error(
        "{operation}: the NATS server's JetStream store is full ({reason}); nothing was stored. \
         Free space on the server (purge or delete streams, raise max_file_store, grow the disk); \
         retrying with backoff"
    )]
    StorageFull {
        /// What was attempted.
        operation: String,
        /// What the server said.
        reason: String,
    },
    /// Any other error the server or client reported.
    #[error("{operation} failed: {reason}")]
    Other {
        /// What was attempted.
        operation: String,
        /// The error as reported.
        reason: String,
    },
}

/// JetStream API error codes that mean the cluster cannot place or serve a request for
/// now: 10005 "no suitable peers for placement" (a peer offline), 10008 "JetStream
/// system temporarily unavailable".
const CLUSTER_UNAVAILABLE_CODES: [u64; 2] = [10005, 10008];

/// JetStream error codes that mean the server's store is full: 10023 insufficient
/// resources (the server's `max_file_store`/`max_memory_store` reached), 10047
/// insufficient storage resources, 10028 insufficient memory resources.
pub const STORAGE_FULL_CODES: [u64; 3] = [10023, 10047, 10028];

/// What an error means for the work it happened to, decided once, here (the table in
/// `docs/errors.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The broker is unreachable, slow or busy: try the same again later, with
    /// jittered backoff. It spends no attempt of the message (up to a ceiling).
    Transient,
    /// The same request can never succeed (a message over the server's `max_payload`):
    /// the message goes to the dead-letter stream at once, with this reason.
    Permanent(&'static str),
    /// The broker refused this request: a failed attempt, retried by the retry policy
    /// and dead-lettered after the last.
    Refused,
}

/// What a limit of [`BrokerError::LosesRecords`] does to the records.
fn limit_consequence(field: &str) -> &'static str {
    if field == "max_age" {
        "expires records not written for that long, and a restore then takes older values of their keys \
         instead (state silently rolls back)"
    } else {
        "refuses new records once reached (or drops the oldest), so writes fail or records are lost"
    }
}

impl BrokerError {
    /// What this error means: see [`ErrorClass`].
    pub fn class(&self) -> ErrorClass {
        match self {
            BrokerError::Disconnected { .. }
            | BrokerError::TimedOut { .. }
            | BrokerError::Unreachable { .. }
            | BrokerError::ServerUnavailable { .. }
            | BrokerError::StorageFull { .. }
            // A 503 "no responders" to a publish: no stream listens on the subject, or
            // JetStream is restarting or electing a leader; the two look the same.
            | BrokerError::NoStream { .. }
            | BrokerError::NoResponders { .. } => ErrorClass::Transient,
            BrokerError::PayloadTooLarge { .. } | BrokerError::Codec(CodecError::TooLarge { .. }) => {
                ErrorClass::Permanent("too-large")
            }
            _ => ErrorClass::Refused,
        }
    }

    /// Whether retrying later may succeed (the broker is unreachable, slow or busy), as
    /// opposed to a refusal that will repeat.
    pub fn is_transient(&self) -> bool {
        self.class() == ErrorClass::Transient
    }

    /// The error for a JetStream API error reply (`{"code":503,"err_code":10023,
    /// "description":"insufficient resources"}`; `code` 0 when only the error code is
    /// known) to `operation`, or `None` when the reply
    /// is not one this type names by itself (the caller keeps its own mapping).
    pub fn from_js_api(operation: &str, code: u16, err_code: u64, description: &str) -> Option<Self> {
        let reason = || match code {
            // No status known (the error came as text that names its codes already).
            0 => description.to_owned(),
            _ => format!("{description} (status {code}, error code {err_code})"),
        };
        if STORAGE_FULL_CODES.contains(&err_code) || description.contains("no space left on device") {
            return Some(BrokerError::StorageFull { operation: operation.to_owned(), reason: reason() });
        }
        // The cluster cannot place or serve the request right now: a peer is offline
        // or still joining (as just after a cluster starts), or the meta leader is
        // being elected. Retried with backoff; a cluster too small for the replicas
        // asked for keeps failing and is reported when the caller's patience ends.
        if CLUSTER_UNAVAILABLE_CODES.contains(&err_code)
            || description.contains("no suitable peers")
            || description.contains("temporarily unavailable")
        {
            return Some(BrokerError::ServerUnavailable { operation: operation.to_owned(), reason: reason() });
        }
        None
    }

    pub(crate) fn other(operation: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        BrokerError::Other { operation: operation.into(), reason: reason.to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_one_class() {
        let transient = [
            BrokerError::Disconnected { operation: "claim".into(), reason: "cut".into() },
            BrokerError::TimedOut { operation: "publish".into(), after: std::time::Duration::from_secs(5) },
            BrokerError::ServerUnavailable { operation: "publish".into(), reason: "no leader".into() },
            BrokerError::NoStream { subject: "a.b".into() },
            BrokerError::NoResponders { subject: "a.b".into() },
        ];
        for e in &transient {
            assert_eq!(e.class(), ErrorClass::Transient, "{e}");
            assert!(e.is_transient());
        }
        let too_large = BrokerError::PayloadTooLarge { size: 2, limit: 1 };
        assert_eq!(too_large.class(), ErrorClass::Permanent("too-large"));
        let codec = BrokerError::Codec(CodecError::TooLarge { size: 2, limit: 1 });
        assert_eq!(codec.class(), ErrorClass::Permanent("too-large"));
        let full = BrokerError::StorageFull { operation: "publish".into(), reason: "insufficient resources".into() };
        assert_eq!(full.class(), ErrorClass::Transient);
        let refused = BrokerError::WrongLastSequence { subject: "a".into(), expected: 1, actual: 2 };
        assert_eq!(refused.class(), ErrorClass::Refused);
        assert!(!refused.is_transient());
    }

    #[test]
    fn a_full_store_is_its_own_retryable_kind() {
        let full = BrokerError::from_js_api("publish to a.b", 500, 10047, "insufficient storage resources available")
            .expect("10047 is storage full");
        assert!(matches!(full, BrokerError::StorageFull { .. }), "{full:?}");
        assert_eq!(full.class(), ErrorClass::Transient, "retried after backoff, no attempt spent");
        let text = full.to_string();
        assert!(text.contains("store is full") && text.contains("10047") && text.contains("a.b"), "{text}");
        for (code, err_code, description) in
            [(503, 10023, "insufficient resources"), (500, 10028, "insufficient memory resources available")]
        {
            let e = BrokerError::from_js_api("publish", code, err_code, description);
            assert!(matches!(e, Some(BrokerError::StorageFull { .. })), "{err_code}: {e:?}");
        }
        let enospc = BrokerError::from_js_api("publish", 503, 10077, "write /data/x: no space left on device");
        assert!(matches!(enospc, Some(BrokerError::StorageFull { .. })), "{enospc:?}");
        assert!(BrokerError::from_js_api("publish", 503, 10077, "maximum messages exceeded").is_none());
        assert!(BrokerError::from_js_api("publish", 400, 10071, "wrong last sequence: 9").is_none());
        for (code, err_code, description) in [
            (400, 10005, "no suitable peers for placement, peer offline"),
            (503, 10008, "JetStream system temporarily unavailable"),
        ] {
            let e = BrokerError::from_js_api("create stream S", code, err_code, description).expect("classified");
            assert!(matches!(e, BrokerError::ServerUnavailable { .. }) && e.is_transient(), "{e}");
        }
    }
}
