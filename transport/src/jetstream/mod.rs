//! The JetStream backend, on async-nats 0.51.
//!
//! What it does about the traps in `notes/jetstream.md`:
//!
//! * pings every few seconds (default 3 s, not async-nats's 60 s) and reconnects with
//!   capped, jittered backoff, so a partitioned node notices in seconds and a server
//!   restart does not cause a reconnect herd; connection changes are typed
//!   [`ConnectionEvent`]s;
//! * KV buckets are created as plain `KV_<bucket>` streams, because async-nats's
//!   `create_key_value` cannot parse 2.9's account info;
//! * every pull is a bounded `fetch` with `expires`, so no request can hang at
//!   `max_ack_pending`, and one claim is one pull request: nothing re-pulls in a loop when
//!   a 2.9 server answers `409 Exceeded MaxWaiting` (the claim backs off instead);
//! * the server version is read at connect and newer features are gated on it
//!   ([`ServerInfo::require`]); every stream and consumer is read back after creation,
//!   which catches fields an old server ignored silently;
//! * TERM is sent bare (`+TERM`), which 2.9 understands;
//! * publishes are core NATS publishes with a reply subject under one subscription of
//!   this connection (`publisher`), not async-nats' JetStream publish with an inbox,
//!   a channel and a timer per message: at most `max_ack_inflight` wait for their acks.

mod publisher;

use crate::broker::{
    AckKind, AckPolicy, AckToken, AckTokenInner, BoxFuture, BoxStream, Broker, BrokerError, BrokerKind, BrokerResult,
    ConnectionEvent, ConsumerSpec, ConsumerState, CoreMessage, Delivery, DeliveryInfo, Discard, KvEntry, KvOperation,
    KvSpec, OutboundMessage, PendingBatch, PublishAck, Retention, ServerInfo, Storage, StoredMessage, StreamSpec,
    StreamState, Version, compare,
};
use crate::wire::{HeaderText, Headers};
use async_nats::jetstream::{self, consumer::PullConsumer, stream};
use bytes::Bytes;
use dashmap::DashMap;
use futures::{StreamExt, TryStreamExt};
use rand::Rng;
use std::borrow::Cow;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::broadcast;
use tracing::{debug, warn};

/// How to connect to NATS.
#[derive(Debug, Clone)]
pub struct JetStreamOptions {
    /// Server URLs (`nats://host:4222`); several for a cluster.
    pub urls: Vec<String>,
    /// The client connection name (shows in the server's monitoring).
    pub name: Option<String>,
    /// How often to ping the server; a dead connection is noticed after about two.
    pub ping_interval: Duration,
    /// How long one connection attempt may take.
    pub connect_timeout: Duration,
    /// How long a JetStream API request (stream info, KV write, …) may take.
    pub request_timeout: Duration,
    /// Publish acks outstanding at once before publishing waits.
    pub max_ack_inflight: usize,
    /// User and password.
    pub user_password: Option<(String, String)>,
    /// An auth token.
    pub token: Option<String>,
    /// A `.creds` file (JWT and nkey seed).
    pub credentials_file: Option<PathBuf>,
    /// An nkey seed (`SU…`).
    pub nkey_seed: Option<String>,
    /// A CA certificate (PEM) to trust for TLS.
    pub tls_ca: Option<PathBuf>,
    /// A client certificate and its key (PEM) for mutual TLS.
    pub tls_client_cert: Option<(PathBuf, PathBuf)>,
}

impl JetStreamOptions {
    /// Options for one server URL with Flotilla's defaults.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            urls: vec![url.into()],
            name: None,
            ping_interval: Duration::from_secs(3),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            max_ack_inflight: 4096,
            user_password: None,
            token: None,
            credentials_file: None,
            nkey_seed: None,
            tls_ca: None,
            tls_client_cert: None,
        }
    }
}

/// A broker on NATS JetStream. Cheap to clone.
#[derive(Clone)]
pub struct JetStreamBroker {
    inner: Arc<Inner>,
}

struct Inner {
    client: async_nats::Client,
    js: jetstream::Context,
    info: ServerInfo,
    events: broadcast::Sender<ConnectionEvent>,
    streams: DashMap<String, stream::Stream>,
    consumers: DashMap<(String, String), PullConsumer>,
    kv: DashMap<String, jetstream::kv::Store>,
    request_timeout: Duration,
    /// JetStream publishes (async-nats' own is used for nothing on the hot path).
    publisher: publisher::Publisher,
}

impl std::fmt::Debug for JetStreamBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStreamBroker").field("server", &self.inner.info).finish_non_exhaustive()
    }
}

/// The reconnect delay after `attempts` failed attempts: exponential from 100 ms, capped
/// at 5 s, times a random factor in [0.5, 1.5).
pub fn reconnect_delay(attempts: usize) -> Duration {
    let base = Duration::from_millis(100).saturating_mul(1u32 << attempts.min(6));
    let capped = base.min(Duration::from_secs(5));
    capped.mul_f64(rand::rng().random_range(0.5..1.5))
}

fn map_event(ev: async_nats::Event) -> ConnectionEvent {
    use async_nats::Event;
    match ev {
        Event::Connected => ConnectionEvent::Connected,
        Event::Disconnected => ConnectionEvent::Disconnected,
        Event::LameDuckMode => ConnectionEvent::LameDuck,
        Event::SlowConsumer(_) => ConnectionEvent::SlowConsumer,
        Event::ServerError(e) => ConnectionEvent::ServerError(e.to_string()),
        Event::ClientError(e) => ConnectionEvent::ClientError(e.to_string()),
        Event::Closed => ConnectionEvent::Closed,
        other => ConnectionEvent::ClientError(other.to_string()),
    }
}

impl JetStreamBroker {
    /// Connects, reads the server version and checks that JetStream is enabled.
    ///
    /// # Errors
    /// [`BrokerError::Unreachable`] when no server answers (with what to do about it),
    /// [`BrokerError::JetStreamDisabled`] when the server runs without `-js`.
    pub async fn connect(opts: JetStreamOptions) -> BrokerResult<Self> {
        let url = opts.urls.join(",");
        let (events, _) = broadcast::channel(256);
        let tx = events.clone();
        let mut co = async_nats::ConnectOptions::new()
            .ping_interval(opts.ping_interval)
            .connection_timeout(opts.connect_timeout)
            .request_timeout(Some(opts.request_timeout))
            .max_reconnects(None)
            .reconnect_delay_callback(reconnect_delay)
            .event_callback(move |ev| {
                let tx = tx.clone();
                async move {
                    let ev = map_event(ev);
                    match &ev {
                        ConnectionEvent::Connected | ConnectionEvent::Closed => debug!(event = ?ev, "nats connection"),
                        _ => warn!(event = ?ev, "nats connection"),
                    }
                    let _ = tx.send(ev);
                }
            });
        if let Some(name) = &opts.name {
            co = co.name(name);
        }
        if let Some((user, pass)) = &opts.user_password {
            co = co.user_and_password(user.clone(), pass.clone());
        }
        if let Some(token) = &opts.token {
            co = co.token(token.clone());
        }
        if let Some(seed) = &opts.nkey_seed {
            co = co.nkey(seed.clone());
        }
        if let Some(path) = &opts.credentials_file {
            co = co.credentials_file(path).await.map_err(|e| BrokerError::Unreachable {
                url: url.clone(),
                reason: format!("cannot read credentials file {}: {e}", path.display()),
            })?;
        }
        if let Some(ca) = &opts.tls_ca {
            co = co.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let Some((cert, key)) = &opts.tls_client_cert {
            co = co.add_client_certificate(cert.clone(), key.clone()).require_tls(true);
        }
        let mut addrs = Vec::with_capacity(opts.urls.len());
        for u in &opts.urls {
            let addr = u.parse::<async_nats::ServerAddr>().map_err(|e| BrokerError::Unreachable {
                url: u.clone(),
                reason: format!("invalid NATS URL ({e}); use the form nats://host:port"),
            })?;
            addrs.push(addr);
        }
        if addrs.is_empty() {
            return Err(BrokerError::Unreachable { url, reason: "no NATS URL given".into() });
        }
        let client = co
            .connect(addrs)
            .await
            .map_err(|e| BrokerError::Unreachable { url: url.clone(), reason: e.to_string() })?;
        let si = client.server_info();
        if !si.jetstream {
            return Err(BrokerError::JetStreamDisabled { url });
        }
        let version = Version::parse(&si.version).ok_or_else(|| {
            BrokerError::other("connect", format!("server at {url} reports an unreadable version {:?}", si.version))
        })?;
        let info = ServerInfo {
            kind: BrokerKind::JetStream,
            version,
            name: if si.server_name.is_empty() { si.server_id.clone() } else { si.server_name.clone() },
            max_payload: si.max_payload,
            extra: vec![],
        };
        let js = jetstream::context::ContextBuilder::new().timeout(opts.request_timeout).build(client.clone());
        let publisher =
            publisher::Publisher::start(client.clone(), info.max_payload, opts.max_ack_inflight, opts.request_timeout)
                .await?;
        debug!(server.version = %info.version, server.name = %info.name, "connected to nats");
        Ok(Self {
            inner: Arc::new(Inner {
                client,
                js,
                info,
                events,
                streams: DashMap::new(),
                consumers: DashMap::new(),
                kv: DashMap::new(),
                request_timeout: opts.request_timeout,
                publisher,
            }),
        })
    }

    /// This broker as a [`SharedBroker`](crate::broker::SharedBroker).
    pub fn shared(&self) -> crate::broker::SharedBroker {
        Arc::new(self.clone())
    }

    /// The underlying async-nats client, for what the interface does not cover.
    pub fn client(&self) -> &async_nats::Client {
        &self.inner.client
    }
}

fn to_stream_config(spec: &StreamSpec) -> stream::Config {
    let kv = spec.name.starts_with("KV_");
    stream::Config {
        name: spec.name.clone(),
        subjects: spec.subjects.clone(),
        retention: match spec.retention {
            Retention::Limits => stream::RetentionPolicy::Limits,
            Retention::Interest => stream::RetentionPolicy::Interest,
            Retention::WorkQueue => stream::RetentionPolicy::WorkQueue,
        },
        storage: match spec.storage {
            Storage::File => stream::StorageType::File,
            Storage::Memory => stream::StorageType::Memory,
        },
        max_age: spec.max_age.unwrap_or_default(),
        max_messages_per_subject: spec.max_msgs_per_subject.map_or(-1, |n| n as i64),
        max_messages: spec.max_msgs.map_or(-1, |n| n as i64),
        max_bytes: spec.max_bytes.map_or(-1, |n| n as i64),
        discard: match spec.discard {
            Discard::Old => stream::DiscardPolicy::Old,
            Discard::New => stream::DiscardPolicy::New,
        },
        duplicate_window: spec.duplicate_window,
        num_replicas: spec.replicas,
        allow_direct: true,
        allow_rollup: kv,
        deny_delete: kv,
        ..Default::default()
    }
}

fn from_stream_config(c: &stream::Config) -> StreamSpec {
    StreamSpec {
        name: c.name.clone(),
        subjects: c.subjects.clone(),
        retention: match c.retention {
            stream::RetentionPolicy::Limits => Retention::Limits,
            stream::RetentionPolicy::Interest => Retention::Interest,
            stream::RetentionPolicy::WorkQueue => Retention::WorkQueue,
        },
        storage: match c.storage {
            stream::StorageType::File => Storage::File,
            stream::StorageType::Memory => Storage::Memory,
        },
        max_age: (!c.max_age.is_zero()).then_some(c.max_age),
        max_msgs_per_subject: (c.max_messages_per_subject > 0).then_some(c.max_messages_per_subject as u64),
        max_msgs: (c.max_messages > 0).then_some(c.max_messages as u64),
        max_bytes: (c.max_bytes > 0).then_some(c.max_bytes as u64),
        discard: match c.discard {
            stream::DiscardPolicy::Old => Discard::Old,
            stream::DiscardPolicy::New => Discard::New,
        },
        duplicate_window: c.duplicate_window,
        replicas: c.num_replicas.max(1),
        keep_all: false,
    }
}

fn to_consumer_config(spec: &ConsumerSpec) -> jetstream::consumer::pull::Config {
    jetstream::consumer::pull::Config {
        durable_name: Some(spec.name.clone()),
        filter_subject: spec.filter_subject.clone().unwrap_or_default(),
        ack_policy: match spec.ack_policy {
            AckPolicy::Explicit => jetstream::consumer::AckPolicy::Explicit,
            AckPolicy::All => jetstream::consumer::AckPolicy::All,
        },
        deliver_policy: jetstream::consumer::DeliverPolicy::All,
        ack_wait: spec.ack_wait,
        max_deliver: spec.max_deliver.map_or(-1, i64::from),
        max_ack_pending: spec.max_ack_pending.map_or(-1, i64::from),
        max_waiting: 512,
        ..Default::default()
    }
}

fn from_consumer_info(name: &str, c: &jetstream::consumer::Config) -> ConsumerSpec {
    ConsumerSpec {
        name: name.to_owned(),
        filter_subject: (!c.filter_subject.is_empty()).then(|| c.filter_subject.clone()),
        ack_policy: match c.ack_policy {
            jetstream::consumer::AckPolicy::All => AckPolicy::All,
            _ => AckPolicy::Explicit,
        },
        ack_wait: c.ack_wait,
        max_deliver: (c.max_deliver > 0).then_some(c.max_deliver as u32),
        max_ack_pending: (c.max_ack_pending > 0).then_some(c.max_ack_pending as u32),
    }
}

fn consumer_state(stream: &str, info: &jetstream::consumer::Info) -> ConsumerState {
    // A consumer created at a start sequence has committed everything before it, but
    // until its first ack nats-server reports ack floor 0 (checked on 2.9.10).
    let start_floor = match info.config.deliver_policy {
        jetstream::consumer::DeliverPolicy::ByStartSequence { start_sequence } => start_sequence.saturating_sub(1),
        _ => 0,
    };
    ConsumerState {
        stream: stream.to_owned(),
        name: info.name.clone(),
        spec: from_consumer_info(&info.name, &info.config),
        num_pending: info.num_pending,
        num_ack_pending: info.num_ack_pending as u64,
        num_redelivered: info.num_redelivered as u64,
        ack_floor: info.ack_floor.stream_sequence.max(start_floor),
        delivered: info.delivered.stream_sequence,
        delivered_consumer_seq: info.delivered.consumer_sequence,
    }
}

fn stream_state(info: &stream::Info) -> StreamState {
    StreamState {
        name: info.config.name.clone(),
        messages: info.state.messages,
        first_seq: info.state.first_sequence,
        last_seq: info.state.last_sequence,
        consumers: info.state.consumer_count,
        subjects: info.config.subjects.clone(),
        bytes: info.state.bytes,
        first_published: (info.state.messages > 0)
            .then(|| {
                let nanos = info.state.first_timestamp.unix_timestamp_nanos();
                u64::try_from(nanos).ok().map(|n| std::time::UNIX_EPOCH + std::time::Duration::from_nanos(n))
            })
            .flatten(),
    }
}

/// Refuses a payload the server would not take (its `max_payload`), before it is sent.
fn publish_payload_check(msg: &OutboundMessage, limit: usize) -> BrokerResult<()> {
    let size = msg.wire_size();
    if size > limit {
        return Err(BrokerError::PayloadTooLarge { size, limit });
    }
    Ok(())
}

/// async-nats's form of Flotilla's own header names, in the order of `headers::KNOWN`,
/// built at compile time: an output's names are neither looked up nor checked again.
static NATS_NAMES: [async_nats::HeaderName; 25] = {
    use crate::wire::headers::*;
    use async_nats::HeaderName;
    [
        HeaderName::from_static(MSG_ID),
        HeaderName::from_static(KEY),
        HeaderName::from_static(KIND),
        HeaderName::from_static(RUN),
        HeaderName::from_static(TYPE),
        HeaderName::from_static(SENT),
        HeaderName::from_static(CAUSE),
        HeaderName::from_static(EPOCH),
        HeaderName::from_static(TRACEPARENT),
        HeaderName::from_static(WIRE),
        HeaderName::from_static(DELAY),
        HeaderName::from_static(TARGET),
        HeaderName::from_static(DLQ_REASON),
        HeaderName::from_static(DLQ_DETAIL),
        HeaderName::from_static(DLQ_STREAM),
        HeaderName::from_static(DLQ_SUBJECT),
        HeaderName::from_static(DLQ_SEQ),
        HeaderName::from_static(DLQ_DELIVERIES),
        HeaderName::from_static(DLQ_ATTEMPTS),
        HeaderName::from_static(TIMER),
        HeaderName::from_static(MISFIRE),
        HeaderName::from_static(STEP),
        HeaderName::from_static(PARKED_SEQ),
        HeaderName::from_static(ORIGIN_ID),
        HeaderName::from_static(ARMING),
    ]
};

/// The headers as async-nats carries them. Refuses (instead of letting async-nats
/// panic on) a name or value NATS cannot carry. This runs for every header of every
/// output: Flotilla's own names are taken ready-made, and each value is checked once,
/// by async-nats as it copies it.
fn to_header_map(headers: &Headers) -> BrokerResult<async_nats::HeaderMap> {
    use crate::wire::headers::{known_index, name_problem, value_problem};
    let entries = headers.entries();
    let mut map = async_nats::HeaderMap::new();
    for (i, (name, value)) in entries.iter().enumerate() {
        let invalid = |reason| BrokerError::InvalidHeader { name: name.to_string(), reason };
        let header = match known_index(name) {
            Some(k) => NATS_NAMES[k].clone(),
            None => {
                if let Some(reason) = name_problem(name) {
                    return Err(invalid(reason));
                }
                async_nats::HeaderName::from_str(name).map_err(|_| invalid("not a header name"))?
            }
        };
        let value = value.as_str();
        let value = async_nats::HeaderValue::from_str(value)
            .map_err(|_| invalid(value_problem(value).unwrap_or("not a header value")))?;
        // A name seen before gets one more value; a new one is inserted (one hash
        // lookup instead of two).
        if entries[..i].iter().any(|(earlier, _)| earlier == name) {
            map.append(header, value);
        } else {
            map.insert(header, value);
        }
    }
    Ok(map)
}

fn from_header_map(map: Option<&async_nats::HeaderMap>) -> Headers {
    let Some(map) = map else { return Headers::new() };
    let mut entries = Vec::with_capacity(map.len());
    for (name, values) in map.iter() {
        let name: &str = name.as_ref();
        // Flotilla's own names (most of what arrives) are not copied.
        let name = match crate::wire::headers::known(name) {
            Some(known) => Cow::Borrowed(known),
            None => Cow::Owned(name.to_owned()),
        };
        // Shared text: the task's message id shares it instead of copying it.
        entries.extend(values.iter().map(|v| (name.clone(), HeaderText::Shared(Arc::from(v.as_str())))));
    }
    Headers::from(entries)
}

/// The ack of a one-message batch.
fn only_ack(acks: Vec<BrokerResult<PublishAck>>) -> BrokerResult<PublishAck> {
    acks.into_iter().next().unwrap_or_else(|| Err(BrokerError::other("publish", "no ack for the message")))
}

fn js_code<E: std::fmt::Display>(err: &E) -> Option<u64> {
    // async-nats formats JetStream API errors as "... (code 404, error code 10059)".
    let text = err.to_string();
    let at = text.find("error code ")?;
    text[at + 11..].chars().take_while(char::is_ascii_digit).collect::<String>().parse().ok()
}

/// Whether `err` says the consumer (10014) does not exist; async-nats reports this as a
/// JetStream error code on some calls and as a typed "consumer not found" on others.
fn consumer_missing<E: std::fmt::Display>(err: &E) -> bool {
    js_code(err) == Some(10014) || err.to_string().contains("consumer not found")
}

/// Whether `err` says the stream (10059) does not exist.
fn stream_missing<E: std::fmt::Display>(err: &E) -> bool {
    js_code(err) == Some(10059) || err.to_string().contains("stream not found")
}

fn is_timeout<E: std::fmt::Display>(err: &E) -> bool {
    let t = err.to_string().to_lowercase();
    t.contains("timed out") || t.contains("timeout")
}

fn api_error<E: std::fmt::Display>(operation: &str, err: E, timeout: Duration) -> BrokerError {
    let text = err.to_string();
    if is_timeout(&err) {
        BrokerError::TimedOut { operation: operation.to_owned(), after: timeout }
    } else if let Some(full) = js_code(&err).and_then(|code| BrokerError::from_js_api(operation, 0, code, &text)) {
        full
    } else if text.contains("no space left on device") || text.contains("insufficient resources") {
        BrokerError::StorageFull { operation: operation.to_owned(), reason: text }
    } else if err.to_string().to_lowercase().contains("no responders") {
        BrokerError::Disconnected {
            operation: operation.to_owned(),
            reason: "JetStream did not respond (no responders)".into(),
        }
    } else {
        BrokerError::other(operation, err)
    }
}

impl Inner {
    async fn stream_handle(&self, name: &str) -> BrokerResult<stream::Stream> {
        if let Some(s) = self.streams.get(name) {
            return Ok(s.clone());
        }
        match self.js.get_stream(name).await {
            Ok(s) => {
                self.streams.insert(name.to_owned(), s.clone());
                Ok(s)
            }
            Err(e) if stream_missing(&e) => Err(BrokerError::StreamNotFound { stream: name.to_owned() }),
            Err(e) => Err(api_error(&format!("look up stream {name}"), e, self.request_timeout)),
        }
    }

    async fn consumer_handle(&self, stream: &str, consumer: &str) -> BrokerResult<PullConsumer> {
        let key = (stream.to_owned(), consumer.to_owned());
        if let Some(c) = self.consumers.get(&key) {
            return Ok(c.clone());
        }
        let s = self.stream_handle(stream).await?;
        match s.get_consumer::<jetstream::consumer::pull::Config>(consumer).await {
            Ok(c) => {
                self.consumers.insert(key, c.clone());
                Ok(c)
            }
            Err(e) if consumer_missing(&e) => {
                Err(BrokerError::ConsumerNotFound { stream: stream.to_owned(), consumer: consumer.to_owned() })
            }
            Err(e) => Err(api_error(&format!("look up consumer {consumer} of {stream}"), e, self.request_timeout)),
        }
    }

    async fn ensure_stream(&self, spec: StreamSpec) -> BrokerResult<StreamState> {
        let op = format!("create stream {}", spec.name);
        let found = match self.js.get_stream(&spec.name).await {
            Ok(mut s) => Some(s.info().await.map_err(|e| api_error(&op, e, self.request_timeout))?.clone()),
            Err(e) if stream_missing(&e) => None,
            Err(e) => return Err(api_error(&op, e, self.request_timeout)),
        };
        let info = match found {
            Some(info) => info,
            None => match self.js.create_stream(to_stream_config(&spec)).await {
                Ok(mut s) => s.info().await.map_err(|e| api_error(&op, e, self.request_timeout))?.clone(),
                // Someone else created it meanwhile: compare with theirs.
                Err(e) if js_code(&e) == Some(10058) => {
                    let mut s =
                        self.js.get_stream(&spec.name).await.map_err(|e| api_error(&op, e, self.request_timeout))?;
                    s.info().await.map_err(|e| api_error(&op, e, self.request_timeout))?.clone()
                }
                Err(e) => return Err(api_error(&op, e, self.request_timeout)),
            },
        };
        for note in compare::stream(&from_stream_config(&info.config), &spec)? {
            note.log();
        }
        Ok(stream_state(&info))
    }

    async fn ensure_consumer(&self, stream: &str, spec: ConsumerSpec) -> BrokerResult<ConsumerState> {
        let op = format!("create consumer {} of stream {stream}", spec.name);
        let s = self.stream_handle(stream).await?;
        let info = match s.consumer_info(&spec.name).await {
            Ok(info) => {
                let existing = from_consumer_info(&spec.name, &info.config);
                compare::consumer_fixed(stream, &existing, &spec)?;
                if existing == spec {
                    info
                } else {
                    // Re-creating a durable with new ack-wait / max deliveries / max
                    // ack-pending updates it (2.9 and later).
                    tracing::info!(stream, consumer = %spec.name, from = ?existing, to = ?spec, "consumer settings updated");
                    self.consumers.remove(&(stream.to_owned(), spec.name.clone()));
                    // Only those settings change: where it delivers from stays as it
                    // is (a partition reset moved it to a start sequence, which the
                    // server refuses to change: error 10012).
                    let mut config = info.config.clone();
                    config.ack_wait = spec.ack_wait;
                    config.max_deliver = spec.max_deliver.map_or(-1, i64::from);
                    config.max_ack_pending = spec.max_ack_pending.map_or(-1, i64::from);
                    match s.create_consumer(config).await {
                        Ok(mut c) => c.info().await.cloned().map_err(|e| api_error(&op, e, self.request_timeout))?,
                        Err(e) => match s.consumer_info(&spec.name).await {
                            Ok(info) if from_consumer_info(&spec.name, &info.config) == spec => info,
                            _ => return Err(api_error(&op, e, self.request_timeout)),
                        },
                    }
                }
            }
            Err(e) if consumer_missing(&e) => self.create_or_adopt(&s, &spec, &op).await?,
            Err(e) => return Err(api_error(&op, e, self.request_timeout)),
        };
        compare::consumer(stream, &from_consumer_info(&spec.name, &info.config), &spec)?;
        Ok(consumer_state(stream, &info))
    }

    /// Creates (or updates) the consumer. Nodes starting together race to do the same:
    /// when the call fails but the consumer now has exactly the wanted settings, another
    /// node did it and that is success.
    async fn create_or_adopt(
        &self,
        s: &jetstream::stream::Stream,
        spec: &ConsumerSpec,
        op: &str,
    ) -> BrokerResult<jetstream::consumer::Info> {
        let created = match s.create_consumer(to_consumer_config(spec)).await {
            Ok(mut c) => c.info().await.cloned().map_err(|e| api_error(op, e, self.request_timeout)),
            Err(e) => Err(api_error(op, e, self.request_timeout)),
        };
        match created {
            Ok(info) => Ok(info),
            Err(err) => match s.consumer_info(&spec.name).await {
                Ok(info) if from_consumer_info(&spec.name, &info.config) == *spec => {
                    debug!(consumer = %spec.name, error = %err, "consumer created by another node meanwhile");
                    Ok(info)
                }
                _ => Err(err),
            },
        }
    }

    async fn kv_store(&self, bucket: &str) -> BrokerResult<jetstream::kv::Store> {
        if let Some(s) = self.kv.get(bucket) {
            return Ok(s.clone());
        }
        match self.js.get_key_value(bucket).await {
            Ok(store) => {
                self.kv.insert(bucket.to_owned(), store.clone());
                Ok(store)
            }
            Err(e) if stream_missing(&e) || e.to_string().contains("not found") => {
                Err(BrokerError::BucketNotFound { bucket: bucket.to_owned() })
            }
            Err(e) => Err(api_error(&format!("open KV bucket {bucket}"), e, self.request_timeout)),
        }
    }

    /// `msg` as async-nats publishes it.
    /// Sends a pull request for up to `max` messages, waiting at most `expires` for the
    /// first, and returns the subscription they arrive on. Plain core NATS, as async-nats' fetch
    /// does it, but its messages are read as they are: async-nats wraps each in a
    /// JetStream message holding a clone of its context, made and dropped per message.
    async fn pull(
        &self,
        stream: &str,
        consumer: &str,
        max: usize,
        expires: Duration,
    ) -> Result<async_nats::Subscriber, async_nats::Error> {
        let inbox = self.client.new_inbox();
        let sub = self.client.subscribe(inbox.clone()).await?;
        // As async-nats' fetch: no_wait with an expiry returns what is there, or waits
        // (up to the expiry) for the first message, then ends with a 404 status.
        let request = serde_json::json!({ "batch": max, "expires": expires.as_nanos() as u64, "no_wait": true });
        self.client
            .publish_with_reply(
                format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"),
                inbox,
                Bytes::from(request.to_string()),
            )
            .await?;
        Ok(sub)
    }

    /// A pulled message as a delivery. `shared` keeps the last stream and consumer names
    /// and subject, so the messages of one claim share them instead of allocating their own.
    fn delivery(&self, message: async_nats::Message, shared: &mut SharedNames) -> Option<Delivery> {
        let reply = message.reply.clone()?;
        // The common reply form is parsed here, without async-nats' per-token
        // iterator and date conversion (this runs for every delivery); any other form
        // goes through async-nats.
        let info = match parse_ack_subject(reply.as_str()) {
            Some(a) => {
                let (stream, consumer) = shared.names(a.stream, a.consumer);
                DeliveryInfo {
                    stream,
                    consumer,
                    stream_seq: a.stream_seq,
                    consumer_seq: a.consumer_seq,
                    delivered: a.delivered,
                    pending: a.pending,
                    published: SystemTime::UNIX_EPOCH + Duration::from_nanos(a.timestamp_ns),
                }
            }
            // async-nats reads the other forms (with a domain) from a JetStream message.
            None => match (jetstream::Message { message: message.clone(), context: self.js.clone() }).info() {
                Ok(info) => {
                    let (stream, consumer) = shared.names(info.stream, info.consumer);
                    DeliveryInfo {
                        stream,
                        consumer,
                        stream_seq: info.stream_sequence,
                        consumer_seq: info.consumer_sequence,
                        delivered: info.delivered.max(0) as u64,
                        pending: info.pending,
                        published: SystemTime::from(info.published),
                    }
                }
                Err(e) => {
                    warn!(error = %e, subject = %message.subject, "pulled message without JetStream metadata; skipped");
                    return None;
                }
            },
        };
        Some(Delivery {
            subject: shared.subject(message.subject.as_str()),
            headers: from_header_map(message.headers.as_ref()),
            payload: message.payload,
            info,
            token: AckToken(AckTokenInner::Reply(reply)),
        })
    }
}

/// The metadata a JetStream delivery's reply subject carries.
#[derive(Debug, PartialEq, Eq)]
struct AckSubject<'a> {
    stream: &'a str,
    consumer: &'a str,
    delivered: u64,
    stream_seq: u64,
    consumer_seq: u64,
    timestamp_ns: u64,
    pending: u64,
}

/// Parses `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ns>.<pending>`,
/// the form nats-server 2.9 and later send without a domain; `None` for anything else.
fn parse_ack_subject(subject: &str) -> Option<AckSubject<'_>> {
    let rest = subject.strip_prefix("$JS.ACK.")?;
    // One pass over the bytes: tokens end at '.', which is ASCII, so every cut is a
    // char boundary. (`str::find` per token and `str::parse` cost about a thousand
    // instructions per delivery; this runs for every delivery.)
    let mut tokens = [""; 7];
    let mut n = 0;
    let mut start = 0;
    for (i, &b) in rest.as_bytes().iter().enumerate() {
        if b == b'.' {
            // More tokens than the plain form: the domain-qualified form, left to
            // async-nats.
            *tokens.get_mut(n)? = &rest[start..i];
            n += 1;
            start = i + 1;
        }
    }
    *tokens.get_mut(n)? = &rest[start..];
    if n != 6 {
        return None;
    }
    let [stream, consumer, delivered, stream_seq, consumer_seq, timestamp_ns, pending] = tokens;
    if stream.is_empty() || consumer.is_empty() {
        return None;
    }
    Some(AckSubject {
        stream,
        consumer,
        delivered: decimal(delivered)?,
        stream_seq: decimal(stream_seq)?,
        consumer_seq: decimal(consumer_seq)?,
        timestamp_ns: decimal(timestamp_ns)?,
        pending: decimal(pending)?,
    })
}

/// A non-empty run of ASCII digits as a `u64`; `None` for anything else or on overflow.
fn decimal(token: &str) -> Option<u64> {
    if token.is_empty() {
        return None;
    }
    token.bytes().try_fold(0u64, |acc, b| {
        let digit = b.wrapping_sub(b'0');
        if digit > 9 {
            return None;
        }
        acc.checked_mul(10)?.checked_add(u64::from(digit))
    })
}

/// What the deliveries of one claim share: the (stream, consumer) names, and the subject
/// (one per partition), each replaced when a message names another.
#[derive(Default)]
struct SharedNames {
    names: Option<(Arc<str>, Arc<str>)>,
    subject: Option<Arc<str>>,
}

impl SharedNames {
    fn names(&mut self, stream: &str, consumer: &str) -> (Arc<str>, Arc<str>) {
        match &self.names {
            Some((s, c)) if &**s == stream && &**c == consumer => (s.clone(), c.clone()),
            _ => {
                let fresh = (Arc::<str>::from(stream), Arc::<str>::from(consumer));
                self.names = Some(fresh.clone());
                fresh
            }
        }
    }

    fn subject(&mut self, subject: &str) -> Arc<str> {
        match &self.subject {
            Some(s) if &**s == subject => s.clone(),
            _ => self.subject.insert(Arc::from(subject)).clone(),
        }
    }
}

fn ack_body(kind: AckKind) -> Bytes {
    match kind {
        AckKind::Ack => Bytes::from_static(b"+ACK"),
        AckKind::Nak(None) => Bytes::from_static(b"-NAK"),
        AckKind::Nak(Some(d)) => Bytes::from(format!("-NAK {{\"delay\":{}}}", d.as_nanos())),
        AckKind::InProgress => Bytes::from_static(b"+WPI"),
        AckKind::Term => Bytes::from_static(b"+TERM"),
    }
}

fn reply_of(token: &AckToken) -> BrokerResult<async_nats::Subject> {
    match &token.0 {
        AckTokenInner::Reply(r) => Ok(r.clone()),
        AckTokenInner::Embedded { .. } | AckTokenInner::Detached => {
            Err(BrokerError::other("ack", "not a delivery of this JetStream connection"))
        }
    }
}

fn core_from(msg: async_nats::Message) -> CoreMessage {
    CoreMessage {
        subject: msg.subject.to_string(),
        reply: msg.reply.map(|r| r.to_string()),
        headers: from_header_map(msg.headers.as_ref()),
        payload: msg.payload,
    }
}

impl Broker for JetStreamBroker {
    fn server(&self) -> ServerInfo {
        self.inner.info.clone()
    }

    fn events(&self) -> broadcast::Receiver<ConnectionEvent> {
        self.inner.events.subscribe()
    }

    fn system_now(&self) -> SystemTime {
        SystemTime::now()
    }

    fn ensure_stream(&self, spec: StreamSpec) -> BoxFuture<BrokerResult<StreamState>> {
        let inner = self.inner.clone();
        Box::pin(async move { inner.ensure_stream(spec).await })
    }

    fn stream_state(&self, stream: &str) -> BoxFuture<BrokerResult<StreamState>> {
        let inner = self.inner.clone();
        let stream = stream.to_owned();
        Box::pin(async move {
            let mut s = inner.stream_handle(&stream).await?;
            let info =
                s.info().await.map_err(|e| api_error(&format!("stream info {stream}"), e, inner.request_timeout))?;
            Ok(stream_state(info))
        })
    }

    fn subject_counts(
        &self,
        stream: &str,
        filter: &str,
    ) -> BoxFuture<BrokerResult<std::collections::BTreeMap<String, u64>>> {
        let inner = self.inner.clone();
        let (stream, filter) = (stream.to_owned(), filter.to_owned());
        Box::pin(async move {
            let op = format!("subjects of stream {stream}");
            let s = inner.stream_handle(&stream).await?;
            let mut subjects =
                s.info_with_subjects(filter).await.map_err(|e| api_error(&op, e, inner.request_timeout))?;
            let mut counts = std::collections::BTreeMap::new();
            while let Some(item) = subjects.next().await {
                let (subject, n) = item.map_err(|e| api_error(&op, e, inner.request_timeout))?;
                counts.insert(subject, n as u64);
            }
            Ok(counts)
        })
    }

    fn ensure_consumer(&self, stream: &str, spec: ConsumerSpec) -> BoxFuture<BrokerResult<ConsumerState>> {
        let inner = self.inner.clone();
        let stream = stream.to_owned();
        Box::pin(async move { inner.ensure_consumer(&stream, spec).await })
    }

    fn consumer_state(&self, stream: &str, consumer: &str) -> BoxFuture<BrokerResult<ConsumerState>> {
        let inner = self.inner.clone();
        let (stream, consumer) = (stream.to_owned(), consumer.to_owned());
        Box::pin(async move {
            let s = inner.stream_handle(&stream).await?;
            match s.consumer_info(&consumer).await {
                Ok(info) => Ok(consumer_state(&stream, &info)),
                Err(e) if consumer_missing(&e) => Err(BrokerError::ConsumerNotFound { stream, consumer }),
                Err(e) => Err(api_error(&format!("consumer info {consumer}"), e, inner.request_timeout)),
            }
        })
    }

    fn reset_consumer(
        &self,
        stream: &str,
        spec: ConsumerSpec,
        start_seq: u64,
    ) -> BoxFuture<BrokerResult<ConsumerState>> {
        let inner = self.inner.clone();
        let stream = stream.to_owned();
        Box::pin(async move {
            let op = format!("reset consumer {} of {stream} to sequence {start_seq}", spec.name);
            let s = inner.stream_handle(&stream).await?;
            inner.consumers.remove(&(stream.clone(), spec.name.clone()));
            let mut config = to_consumer_config(&spec);
            let start = jetstream::consumer::DeliverPolicy::ByStartSequence { start_sequence: start_seq.max(1) };
            config.deliver_policy = start;
            // Delete, then create at `start_seq`. Another node provisioning the same
            // consumer (create if missing) can create it in between, from sequence 1;
            // our create then fails (the deliver policy cannot change). Delete that one
            // and try again: adopting it would consume the partition from the start.
            let mut attempt = 0;
            loop {
                attempt += 1;
                // (A delete racing a create can fail on the server's side too, for
                // example "directory not empty" on 2.9: that is retried the same way.)
                let created = match s.delete_consumer(&spec.name).await {
                    Err(e) if !consumer_missing(&e) => Err(api_error(&op, e, inner.request_timeout)),
                    _ => match s.create_consumer(config.clone()).await {
                        Ok(mut c) => c.info().await.cloned().map_err(|e| api_error(&op, e, inner.request_timeout)),
                        Err(e) => Err(api_error(&op, e, inner.request_timeout)),
                    },
                };
                // Checked by where it delivers from, not only by its settings: a
                // consumer re-created while another node's create of the same name was
                // in flight once delivered from sequence 1 with these settings (seen
                // once in the racing test on 2.9.10, cause not proven).
                let starts_where_asked = |info: &jetstream::consumer::Info| {
                    info.config.deliver_policy == start && info.delivered.stream_sequence + 1 >= start_seq.max(1)
                };
                match created {
                    Ok(info) if starts_where_asked(&info) => return Ok(consumer_state(&stream, &info)),
                    Ok(_) | Err(_) if attempt < 20 => {
                        debug!(consumer = %spec.name, attempt, outcome = ?created.err(), "consumer re-created by another node during a reset; resetting again");
                        let pause = Duration::from_millis(rand::rng().random_range(1..20));
                        tokio::time::sleep(pause).await;
                    }
                    Ok(_) => {
                        return Err(BrokerError::other(
                            &op,
                            "another node kept re-creating the consumer from its start",
                        ));
                    }
                    Err(e) => return Err(e),
                }
            }
        })
    }

    fn delete_consumer(&self, stream: &str, consumer: &str) -> BoxFuture<BrokerResult<bool>> {
        let inner = self.inner.clone();
        let (stream, consumer) = (stream.to_owned(), consumer.to_owned());
        Box::pin(async move {
            let s = inner.stream_handle(&stream).await?;
            inner.consumers.remove(&(stream.clone(), consumer.clone()));
            match s.delete_consumer(&consumer).await {
                Ok(_) => Ok(true),
                Err(e) if consumer_missing(&e) => Ok(false),
                Err(e) => Err(api_error(&format!("delete consumer {consumer}"), e, inner.request_timeout)),
            }
        })
    }

    fn publish(&self, msg: OutboundMessage) -> BoxFuture<BrokerResult<PublishAck>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let batch = inner.publisher.send(Arc::from([msg]), publisher::Want::Acks).await?;
            only_ack(batch.acks().await?)
        })
    }

    fn publish_pipelined(&self, msg: OutboundMessage) -> BoxFuture<BrokerResult<crate::broker::PendingPublish>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let batch = inner.publisher.send(Arc::from([msg]), publisher::Want::Acks).await?;
            let pending: crate::broker::PendingPublish = Box::pin(async move { only_ack(batch.acks().await?) });
            Ok(pending)
        })
    }

    fn publish_pipelined_batch(&self, msgs: Arc<[OutboundMessage]>) -> BoxFuture<BrokerResult<PendingBatch>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let batch = inner.publisher.send(msgs, publisher::Want::FirstRefusal).await?;
            let stored: PendingBatch = Box::pin(async move { batch.acks().await.map(|_| ()) });
            Ok(stored)
        })
    }

    fn publish_batch(&self, msgs: Vec<OutboundMessage>) -> BoxFuture<Vec<BrokerResult<PublishAck>>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let n = msgs.len();
            let acks = match inner.publisher.send(msgs.into(), publisher::Want::Acks).await {
                Ok(batch) => batch.acks().await,
                Err(e) => Err(e),
            };
            // A batch that failed as a whole: each message may or may not be stored.
            acks.unwrap_or_else(|e| vec![Err(e); n])
        })
    }

    fn claim(
        &self,
        stream: &str,
        consumer: &str,
        max: usize,
        max_wait: Duration,
    ) -> BoxFuture<BrokerResult<Vec<Delivery>>> {
        let inner = self.inner.clone();
        let (stream, consumer) = (stream.to_owned(), consumer.to_owned());
        Box::pin(async move {
            if max == 0 {
                return Ok(Vec::new());
            }
            let started = tokio::time::Instant::now();
            // The server needs an expiry of at least a millisecond or so to answer 408.
            let expires = max_wait.max(Duration::from_millis(10));
            // Known to exist (the handle is cached after the first look-up).
            inner.consumer_handle(&stream, &consumer).await?;
            let op = || format!("claim from consumer {consumer} of {stream}");
            let mut batch = match inner.pull(&stream, &consumer, max, expires).await {
                Ok(b) => b,
                Err(e) => return Err(BrokerError::Disconnected { operation: op(), reason: e.to_string() }),
            };
            // The request ends when the server says so (408 at its expiry, 404 for a
            // no-wait pull) or after `max` messages; the client gives up a few seconds
            // after the expiry in case that status was lost.
            let give_up = tokio::time::sleep(expires.saturating_add(Duration::from_secs(5)));
            tokio::pin!(give_up);
            let mut out = Vec::with_capacity(max.min(1024));
            let mut shared = SharedNames::default();
            while out.len() < max {
                let msg = tokio::select! {
                    msg = batch.next() => msg,
                    () = &mut give_up => None,
                };
                let Some(msg) = msg else { break };
                match msg.status {
                    None | Some(async_nats::StatusCode::OK) => out.extend(inner.delivery(msg, &mut shared)),
                    Some(async_nats::StatusCode::TIMEOUT | async_nats::StatusCode::NOT_FOUND) => break,
                    Some(async_nats::StatusCode::IDLE_HEARTBEAT) => {}
                    Some(async_nats::StatusCode::NO_RESPONDERS) => {
                        // Nobody serves the consumer: it is gone (or JetStream is down).
                        // The next claim looks it up again.
                        inner.consumers.remove(&(stream.clone(), consumer.clone()));
                        if out.is_empty() {
                            return Err(BrokerError::Disconnected {
                                operation: op(),
                                reason: "no responders: the consumer is gone or JetStream is unavailable".into(),
                            });
                        }
                        break;
                    }
                    Some(status) => {
                        let text = format!("{status}: {}", msg.description.as_deref().unwrap_or(""));
                        if status.as_u16() == 409 {
                            // E.g. `Exceeded MaxWaiting` on 2.9 or `Consumer Deleted`:
                            // never re-pull at once, wait out this claim's window.
                            warn!(error = %text, stream = %stream, consumer = %consumer, "pull refused; backing off");
                            if text.contains("Consumer Deleted") {
                                inner.consumers.remove(&(stream.clone(), consumer.clone()));
                            }
                            if out.is_empty() {
                                tokio::time::sleep_until(started + max_wait).await;
                            }
                        } else if out.is_empty() {
                            return Err(BrokerError::Disconnected { operation: op(), reason: text });
                        }
                        break;
                    }
                }
            }
            if out.is_empty() {
                // The server can answer at once with nothing (e.g. `408 Requests
                // Pending` when other pullers' requests cover the backlog): wait out the
                // window, so a caller that claims again does not spin.
                tokio::time::sleep_until(started + max_wait).await;
            }
            Ok(out)
        })
    }

    fn ack(&self, token: &AckToken, kind: AckKind) -> BoxFuture<BrokerResult<()>> {
        self.ack_many(vec![(token.clone(), kind)])
    }

    fn ack_many(&self, acks: Vec<(AckToken, AckKind)>) -> BoxFuture<BrokerResult<()>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let mut first = Ok(());
            for (token, kind) in acks {
                let sent = match reply_of(&token) {
                    Ok(reply) => inner
                        .client
                        .publish(reply, ack_body(kind))
                        .await
                        .map_err(|e| BrokerError::Disconnected { operation: "ack".into(), reason: e.to_string() }),
                    Err(e) => Err(e),
                };
                if let Err(e) = sent
                    && first.is_ok()
                {
                    first = Err(e);
                }
            }
            first
        })
    }

    fn ack_confirmed(&self, token: &AckToken, kind: AckKind) -> BoxFuture<BrokerResult<()>> {
        let inner = self.inner.clone();
        let reply = reply_of(token);
        Box::pin(async move {
            let reply = reply?;
            let req = async_nats::Request::new().payload(ack_body(kind)).timeout(Some(inner.request_timeout));
            inner.client.send_request(reply, req).await.map(|_| ()).map_err(|e| match e.kind() {
                async_nats::RequestErrorKind::TimedOut => {
                    BrokerError::TimedOut { operation: "confirmed ack".into(), after: inner.request_timeout }
                }
                _ => BrokerError::Disconnected { operation: "confirmed ack".into(), reason: e.to_string() },
            })
        })
    }

    fn get_message(&self, stream: &str, seq: u64) -> BoxFuture<BrokerResult<Option<StoredMessage>>> {
        let inner = self.inner.clone();
        let stream = stream.to_owned();
        Box::pin(async move {
            let s = inner.stream_handle(&stream).await?;
            match s.get_raw_message(seq).await {
                Ok(m) => Ok(Some(StoredMessage {
                    subject: m.subject.to_string(),
                    seq: m.sequence,
                    headers: from_header_map(Some(&m.headers)),
                    payload: m.payload,
                    published: SystemTime::from(m.time),
                })),
                Err(e)
                    if matches!(e.kind(), stream::LastRawMessageErrorKind::NoMessageFound)
                        || js_code(&e) == Some(10037) =>
                {
                    Ok(None)
                }
                Err(e) => Err(api_error(&format!("get message {seq} of {stream}"), e, inner.request_timeout)),
            }
        })
    }

    fn get_next_message(
        &self,
        stream: &str,
        seq: u64,
        subject: &str,
    ) -> BoxFuture<BrokerResult<Option<StoredMessage>>> {
        let inner = self.inner.clone();
        let stream = stream.to_owned();
        let subject = subject.to_owned();
        Box::pin(async move {
            let s = inner.stream_handle(&stream).await?;
            // `$JS.API.STREAM.MSG.GET` with `seq` and `next_by_subj` (2.9+): the server
            // skips deleted sequences and other subjects itself.
            match s.raw_message_builder().sequence(seq.max(1)).next_by_subject(subject.clone()).send().await {
                Ok(m) => Ok(Some(StoredMessage {
                    subject: m.subject.to_string(),
                    seq: m.sequence,
                    headers: from_header_map(Some(&m.headers)),
                    payload: m.payload,
                    published: SystemTime::from(m.time),
                })),
                Err(e)
                    if matches!(e.kind(), stream::RawMessageErrorKind::NoMessageFound)
                        || js_code(&e) == Some(10037) =>
                {
                    Ok(None)
                }
                Err(e) => Err(api_error(
                    &format!("get the next message of {subject} from {seq} in {stream}"),
                    e,
                    inner.request_timeout,
                )),
            }
        })
    }

    fn delete_message(&self, stream: &str, seq: u64) -> BoxFuture<BrokerResult<bool>> {
        let inner = self.inner.clone();
        let stream = stream.to_owned();
        Box::pin(async move {
            // `no_erase`: async-nats's delete_message would overwrite the bytes on disk.
            let subject = format!("$JS.API.STREAM.MSG.DELETE.{stream}");
            let body = serde_json::json!({ "seq": seq, "no_erase": true }).to_string();
            let op = format!("delete message {seq} of {stream}");
            let reply = inner
                .client
                .request(subject, Bytes::from(body))
                .await
                .map_err(|e| api_error(&op, e, inner.request_timeout))?;
            let v: serde_json::Value =
                serde_json::from_slice(&reply.payload).map_err(|e| BrokerError::other(&op, e))?;
            if v.get("success").and_then(serde_json::Value::as_bool) == Some(true) {
                return Ok(true);
            }
            match v.pointer("/error/err_code").and_then(serde_json::Value::as_u64) {
                Some(10057) | Some(10037) => Ok(false),
                Some(10059) => Err(BrokerError::StreamNotFound { stream }),
                _ => Err(BrokerError::other(&op, v)),
            }
        })
    }

    fn ensure_kv(&self, spec: KvSpec) -> BoxFuture<BrokerResult<()>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            compare::validate_bucket(&spec.bucket)?;
            let stream = compare::kv_stream(&spec);
            inner.ensure_stream(stream).await.map_err(|e| match e {
                BrokerError::ConfigMismatch { field, existing, wanted, .. } => BrokerError::ConfigMismatch {
                    object: format!("KV bucket {}", spec.bucket),
                    field: if field == "max_msgs_per_subject" { "history".into() } else { field },
                    existing,
                    wanted,
                },
                BrokerError::LosesRecords { field, existing, fix, .. } => {
                    BrokerError::LosesRecords { object: format!("KV bucket {}", spec.bucket), field, existing, fix }
                }
                other => other,
            })?;
            inner.kv_store(&spec.bucket).await.map(|_| ())
        })
    }

    fn kv_get(&self, bucket: &str, key: &str) -> BoxFuture<BrokerResult<Option<KvEntry>>> {
        let inner = self.inner.clone();
        let (bucket, key) = (bucket.to_owned(), key.to_owned());
        Box::pin(async move {
            compare::validate_key(&key)?;
            let store = inner.kv_store(&bucket).await?;
            let entry = store
                .entry(key.clone())
                .await
                .map_err(|e| api_error(&format!("KV get {bucket}/{key}"), e, inner.request_timeout))?;
            Ok(entry.map(|e| kv_entry(&bucket, e)).filter(|e| e.operation == KvOperation::Put))
        })
    }

    fn kv_create(&self, bucket: &str, key: &str, value: Bytes) -> BoxFuture<BrokerResult<u64>> {
        let inner = self.inner.clone();
        let (bucket, key) = (bucket.to_owned(), key.to_owned());
        Box::pin(async move {
            compare::validate_key(&key)?;
            let store = inner.kv_store(&bucket).await?;
            store.create(&key, value).await.map_err(|e| match e.kind() {
                jetstream::kv::CreateErrorKind::AlreadyExists => BrokerError::KvKeyExists { bucket, key },
                _ => api_error(&format!("KV create {bucket}/{key}"), e, inner.request_timeout),
            })
        })
    }

    fn kv_update(&self, bucket: &str, key: &str, value: Bytes, revision: u64) -> BoxFuture<BrokerResult<u64>> {
        let inner = self.inner.clone();
        let (bucket, key) = (bucket.to_owned(), key.to_owned());
        Box::pin(async move {
            compare::validate_key(&key)?;
            let store = inner.kv_store(&bucket).await?;
            store.update(&key, value, revision).await.map_err(|e| match e.kind() {
                jetstream::kv::UpdateErrorKind::WrongLastRevision => {
                    BrokerError::KvWrongRevision { bucket, key, expected: revision }
                }
                _ => api_error(&format!("KV update {bucket}/{key}"), e, inner.request_timeout),
            })
        })
    }

    fn kv_put(&self, bucket: &str, key: &str, value: Bytes) -> BoxFuture<BrokerResult<u64>> {
        let inner = self.inner.clone();
        let (bucket, key) = (bucket.to_owned(), key.to_owned());
        Box::pin(async move {
            compare::validate_key(&key)?;
            let store = inner.kv_store(&bucket).await?;
            store
                .put(&key, value)
                .await
                .map_err(|e| api_error(&format!("KV put {bucket}/{key}"), e, inner.request_timeout))
        })
    }

    fn kv_delete(&self, bucket: &str, key: &str, revision: Option<u64>) -> BoxFuture<BrokerResult<()>> {
        let inner = self.inner.clone();
        let (bucket, key) = (bucket.to_owned(), key.to_owned());
        Box::pin(async move {
            compare::validate_key(&key)?;
            let store = inner.kv_store(&bucket).await?;
            store.delete_expect_revision(&key, revision).await.map_err(|e| {
                if e.to_string().contains("wrong last sequence") || js_code(&e) == Some(10071) {
                    BrokerError::KvWrongRevision {
                        bucket: bucket.clone(),
                        key: key.clone(),
                        expected: revision.unwrap_or(0),
                    }
                } else {
                    api_error(&format!("KV delete {bucket}/{key}"), e, inner.request_timeout)
                }
            })
        })
    }

    fn kv_keys(&self, bucket: &str) -> BoxFuture<BrokerResult<Vec<String>>> {
        let inner = self.inner.clone();
        let bucket = bucket.to_owned();
        Box::pin(async move {
            let store = inner.kv_store(&bucket).await?;
            let op = format!("KV keys of {bucket}");
            let keys = store.keys().await.map_err(|e| api_error(&op, e, inner.request_timeout))?;
            // Its ordered consumer can stop delivering (a replicated bucket electing a
            // leader): without a deadline the caller (a node's cluster scan) would wait
            // for ever. It fails, passing, and the caller reads again.
            let mut keys: Vec<String> = tokio::time::timeout(SCAN_STALL, keys.try_collect())
                .await
                .map_err(|_| BrokerError::TimedOut { operation: op.clone(), after: SCAN_STALL })?
                .map_err(|e| api_error(&op, e, inner.request_timeout))?;
            keys.sort();
            Ok(keys)
        })
    }

    fn kv_watch(&self, bucket: &str, key: &str) -> BoxFuture<BrokerResult<BoxStream<BrokerResult<KvEntry>>>> {
        let inner = self.inner.clone();
        let (bucket, key) = (bucket.to_owned(), key.to_owned());
        Box::pin(async move {
            let store = inner.kv_store(&bucket).await?;
            let op = format!("KV watch {bucket}/{key}");
            let watch = store.watch_with_history(&key).await.map_err(|e| api_error(&op, e, inner.request_timeout))?;
            let b = bucket.clone();
            let stream = watch.map(move |r| r.map(|e| kv_entry(&b, e)).map_err(|e| BrokerError::other(&op, e)));
            Ok(stream.boxed())
        })
    }

    fn kv_scan(&self, bucket: &str, key: &str) -> BoxFuture<BrokerResult<BoxStream<BrokerResult<KvEntry>>>> {
        let inner = self.inner.clone();
        let (bucket, key) = (bucket.to_owned(), key.to_owned());
        Box::pin(async move {
            let store = inner.kv_store(&bucket).await?;
            let op = format!("KV scan {bucket}/{key}");
            let prefix = format!("$KV.{bucket}.");
            // An ordered push consumer of the last message per key, as async-nats'
            // `keys()` reads a bucket, but with the values: it ends when the server
            // says nothing is pending.
            let consumer = store
                .stream
                .create_consumer(jetstream::consumer::push::OrderedConfig {
                    deliver_subject: inner.client.new_inbox(),
                    description: Some("flotilla state restore".into()),
                    filter_subject: format!("{prefix}{key}"),
                    replay_policy: jetstream::consumer::ReplayPolicy::Instant,
                    deliver_policy: jetstream::consumer::DeliverPolicy::LastPerSubject,
                    ..Default::default()
                })
                .await
                .map_err(|e| api_error(&op, e, inner.request_timeout))?;
            if consumer.cached_info().num_pending == 0 {
                return Ok(futures::stream::empty().boxed());
            }
            let messages = consumer.messages().await.map_err(|e| api_error(&op, e, inner.request_timeout))?;
            let stream = futures::stream::unfold((messages, false), move |(mut messages, done)| {
                let (op, prefix, bucket) = (op.clone(), prefix.clone(), bucket.clone());
                async move {
                    if done {
                        return None;
                    }
                    // A consumer that stops delivering (its server gone, a leader
                    // change) must not hold the reader forever: it fails, passing, and
                    // the reader tries again.
                    let next = match tokio::time::timeout(SCAN_STALL, messages.next()).await {
                        Ok(next) => next?,
                        Err(_) => {
                            let stalled = BrokerError::TimedOut { operation: op.clone(), after: SCAN_STALL };
                            return Some((Err(stalled), (messages, true)));
                        }
                    };
                    let item = match next {
                        Err(e) => return Some((Err(BrokerError::other(&op, e)), (messages, true))),
                        Ok(m) => m,
                    };
                    let info = match item.info() {
                        Ok(info) => (info.stream_sequence, info.pending),
                        Err(e) => return Some((Err(BrokerError::other(&op, e)), (messages, true))),
                    };
                    let operation = match item.headers.as_ref().and_then(|h| h.get("KV-Operation")).map(|v| v.as_str())
                    {
                        Some("DEL") => KvOperation::Delete,
                        Some("PURGE") => KvOperation::Purge,
                        _ => KvOperation::Put,
                    };
                    let entry = KvEntry {
                        bucket,
                        key: item.subject.as_str().strip_prefix(&prefix).unwrap_or(item.subject.as_str()).to_owned(),
                        value: item.payload.clone(),
                        revision: info.0,
                        operation,
                    };
                    Some((Ok(entry), (messages, info.1 == 0)))
                }
            });
            Ok(stream.boxed())
        })
    }

    fn core_publish(&self, msg: CoreMessage) -> BoxFuture<BrokerResult<()>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let CoreMessage { subject, reply, headers, payload } = msg;
            let op = || format!("publish to {subject}");
            let res = match reply {
                Some(r) => {
                    inner
                        .client
                        .publish_with_reply_and_headers(subject.clone(), r, to_header_map(&headers)?, payload)
                        .await
                }
                None => inner.client.publish_with_headers(subject.clone(), to_header_map(&headers)?, payload).await,
            };
            res.map_err(|e| BrokerError::Disconnected { operation: op(), reason: e.to_string() })
        })
    }

    fn subscribe(&self, subject: &str, queue_group: Option<&str>) -> BoxFuture<BrokerResult<BoxStream<CoreMessage>>> {
        let inner = self.inner.clone();
        let (subject, group) = (subject.to_owned(), queue_group.map(str::to_owned));
        Box::pin(async move {
            let sub = match group {
                Some(g) => inner.client.queue_subscribe(subject.clone(), g).await,
                None => inner.client.subscribe(subject.clone()).await,
            }
            .map_err(|e| BrokerError::Disconnected {
                operation: format!("subscribe to {subject}"),
                reason: e.to_string(),
            })?;
            Ok(sub.map(core_from).boxed())
        })
    }

    fn request(&self, msg: CoreMessage, timeout: Duration) -> BoxFuture<BrokerResult<CoreMessage>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let subject = msg.subject.clone();
            let req = async_nats::Request::new()
                .payload(msg.payload)
                .headers(to_header_map(&msg.headers)?)
                .timeout(Some(timeout));
            inner.client.send_request(subject.clone(), req).await.map(core_from).map_err(|e| match e.kind() {
                async_nats::RequestErrorKind::NoResponders => BrokerError::NoResponders { subject },
                async_nats::RequestErrorKind::TimedOut => {
                    BrokerError::TimedOut { operation: format!("request on {subject}"), after: timeout }
                }
                _ => BrokerError::Disconnected { operation: format!("request on {subject}"), reason: e.to_string() },
            })
        })
    }

    fn flush(&self) -> BoxFuture<BrokerResult<()>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            inner
                .client
                .flush()
                .await
                .map_err(|e| BrokerError::Disconnected { operation: "flush".into(), reason: e.to_string() })
        })
    }
}

/// How long a [`Broker::kv_scan`] waits for its next entry, and a [`Broker::kv_keys`]
/// for all of its keys, before it fails.
const SCAN_STALL: Duration = Duration::from_secs(10);

fn kv_entry(bucket: &str, e: jetstream::kv::Entry) -> KvEntry {
    KvEntry {
        bucket: bucket.to_owned(),
        key: e.key,
        value: e.value,
        revision: e.revision,
        operation: match e.operation {
            jetstream::kv::Operation::Put => KvOperation::Put,
            jetstream::kv::Operation::Delete => KvOperation::Delete,
            jetstream::kv::Operation::Purge => KvOperation::Purge,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_subjects_parse_like_async_nats() {
        let got = parse_ack_subject("$JS.ACK.FLOTILLA_j_in.in-p3.2.1041.17.1764770000123456789.55").expect("parsed");
        assert_eq!(
            got,
            AckSubject {
                stream: "FLOTILLA_j_in",
                consumer: "in-p3",
                delivered: 2,
                stream_seq: 1041,
                consumer_seq: 17,
                timestamp_ns: 1_764_770_000_123_456_789,
                pending: 55,
            }
        );
        // The domain form (12 tokens) and anything malformed go to async-nats.
        assert_eq!(parse_ack_subject("$JS.ACK.dom.acc.S.C.1.2.3.4.5.rand"), None);
        assert_eq!(parse_ack_subject("$JS.ACK.S.C.1.2.3.4"), None);
        assert_eq!(parse_ack_subject("$JS.ACK.S.C.1.x.3.4.5"), None);
        assert_eq!(parse_ack_subject("_INBOX.abc"), None);
        for malformed in [
            "$JS.ACK.S.C.1..3.4.5",
            "$JS.ACK..C.1.2.3.4.5",
            "$JS.ACK.S..1.2.3.4.5",
            "$JS.ACK.S.C.+1.2.3.4.5",
            "$JS.ACK.S.C.1.2.3.4.5.",
            "$JS.ACK.S.C.1.2.3.18446744073709551616.5",
        ] {
            assert_eq!(parse_ack_subject(malformed), None, "{malformed}");
        }
        let max = parse_ack_subject("$JS.ACK.S.C.1.2.3.18446744073709551615.0").expect("u64::MAX parses");
        assert_eq!(max.timestamp_ns, u64::MAX);
    }

    #[test]
    fn reconnect_delay_is_capped_and_jittered() {
        for attempt in 0..20 {
            let d = reconnect_delay(attempt);
            assert!(d <= Duration::from_millis(7500), "{attempt}: {d:?}");
            assert!(d >= Duration::from_millis(50), "{attempt}: {d:?}");
        }
        let samples: std::collections::HashSet<_> = (0..20).map(|_| reconnect_delay(10)).collect();
        assert!(samples.len() > 1, "no jitter");
    }

    #[test]
    fn ack_bodies_match_the_protocol() {
        assert_eq!(ack_body(AckKind::Ack), "+ACK");
        assert_eq!(ack_body(AckKind::Nak(Some(Duration::from_millis(1500)))), "-NAK {\"delay\":1500000000}");
        assert_eq!(ack_body(AckKind::Term), "+TERM");
        assert_eq!(ack_body(AckKind::InProgress), "+WPI");
    }

    #[test]
    fn header_maps_carry_every_entry_and_refuse_what_nats_cannot() {
        use crate::wire::headers::{self, KNOWN};
        for (i, name) in KNOWN.iter().enumerate() {
            let nats: &str = NATS_NAMES[i].as_ref();
            assert_eq!(nats, *name, "NATS_NAMES follows headers::KNOWN");
        }
        let h = Headers::new()
            .with(headers::MSG_ID, "id-1")
            .with(headers::KEY, "k")
            .with("X-Custom", "c")
            .with(String::from("Flotilla-Cause"), "cause");
        let mut h2 = h.clone();
        h2.append(headers::KEY, "k2");
        let map = to_header_map(&h2).expect("valid");
        assert_eq!(map.get(headers::MSG_ID).map(|v| v.as_str()), Some("id-1"));
        assert_eq!(map.get("X-Custom").map(|v| v.as_str()), Some("c"));
        assert_eq!(map.get(headers::CAUSE).map(|v| v.as_str()), Some("cause"));
        let keys: Vec<&str> = map.get_all(headers::KEY).map(|v| v.as_str()).collect();
        assert_eq!(keys, ["k", "k2"]);
        assert_eq!(from_header_map(Some(&map)).len(), 5);
        let refused = |h: Headers| match to_header_map(&h) {
            Err(BrokerError::InvalidHeader { name, reason }) => (name, reason),
            other => panic!("not refused: {other:?}"),
        };
        assert_eq!(refused(h.clone().with(headers::KEY, "a\nb")), (headers::KEY.into(), "the value has a line break"));
        assert_eq!(refused(h.clone().with("X-Other", "a\rb")).1, "the value has a line break");
        assert_eq!(refused(h.clone().with("Bad:Name", "v")).0, "Bad:Name");
        assert_eq!(refused(h.with("", "v")).1, "the name is empty");
    }

    #[test]
    fn stream_config_round_trips() {
        let mut spec = StreamSpec::new("S", vec!["a.>".into()], Retention::WorkQueue);
        spec.max_msgs_per_subject = Some(1);
        spec.max_age = Some(Duration::from_secs(5));
        assert_eq!(from_stream_config(&to_stream_config(&spec)), spec);
    }
}

#[cfg(test)]
mod props;
