//! The embedded broker: JetStream's semantics in process memory.
//!
//! It is what a node uses when no NATS URL is given, so a newcomer's first command runs
//! a real job without a server, and what the fast deterministic tests use: several
//! "nodes" can share one [`EmbeddedBroker`] (it is a cheap handle) and run on tokio's
//! paused clock, through [`TokioClock`].
//!
//! What it keeps of JetStream (each checked by the conformance suite on both backends):
//! streams with Limits / Interest / WorkQueue retention, max age and per-subject limits,
//! the duplicate window, durable pull consumers with explicit or ack-all policy,
//! ack-wait redelivery with delivery counts, nak with delay, in-progress acks, max
//! deliveries leaving the message stranded in the stream (with a `MAX_DELIVERIES`
//! advisory on the same subject JetStream uses), KV buckets as streams with
//! compare-and-set and expiry (no watch event on expiry, as on 2.9), and core
//! publish/subscribe/request with queue groups and no-responders errors.
//!
//! What it leaves out: persistence across process restarts, replicas, push consumers,
//! and the features of servers newer than 2.10.

mod expect;
mod state;

use crate::broker::{
    AckKind, AckToken, AckTokenInner, BoxFuture, BoxStream, Broker, BrokerError, BrokerKind, BrokerResult,
    ConnectionEvent, ConsumerSpec, ConsumerState, CoreMessage, Delivery, KvEntry, KvOperation, KvSpec, OutboundMessage,
    PublishAck, ServerInfo, StoredMessage, StreamSpec, StreamState, Version, compare,
};
use crate::clock::{Clock, TokioClock};
use crate::wire::codec::DEFAULT_MAX_PAYLOAD;
use bytes::Bytes;
use futures::StreamExt;
use state::{Advisory, State, Stream, Subscription};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// Refuses headers a NATS server could not carry, as the JetStream backend does.
fn check_headers(headers: &crate::wire::Headers) -> BrokerResult<()> {
    match headers.invalid_entry() {
        None => Ok(()),
        Some((name, reason)) => Err(BrokerError::InvalidHeader { name: name.to_owned(), reason }),
    }
}

/// The in-process broker. Clone it to give several nodes the same broker.
#[derive(Clone)]
pub struct EmbeddedBroker {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    /// Fault injection: JetStream operations fail while set.
    unavailable: std::sync::atomic::AtomicBool,
    /// Fault injection: writes to subjects matching this pattern fail while set.
    refused: Mutex<Option<String>>,
    /// Fault injection: KV reads of keys whose subjects match this pattern fail while set.
    refused_reads: Mutex<Option<String>>,
    clock: Arc<dyn Clock>,
    events: broadcast::Sender<ConnectionEvent>,
    max_payload: usize,
}

impl std::fmt::Debug for EmbeddedBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedBroker").finish_non_exhaustive()
    }
}

impl Default for EmbeddedBroker {
    fn default() -> Self {
        Self::new()
    }
}

impl EmbeddedBroker {
    /// A broker on tokio's clock (paused in tests that pause it).
    pub fn new() -> Self {
        Self::with_clock(Arc::new(TokioClock::default()))
    }

    /// A broker on the given clock.
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        let (events, _) = broadcast::channel(64);
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State::default()),
                unavailable: std::sync::atomic::AtomicBool::new(false),
                refused: Mutex::new(None),
                refused_reads: Mutex::new(None),
                clock,
                events,
                max_payload: DEFAULT_MAX_PAYLOAD,
            }),
        }
    }

    /// This broker as a [`SharedBroker`](crate::broker::SharedBroker).
    pub fn shared(&self) -> crate::broker::SharedBroker {
        Arc::new(self.clone())
    }

    /// Fault injection for tests: while `true`, publishes, claims, acks and KV
    /// operations fail with [`BrokerError::Disconnected`] (as when JetStream has lost its
    /// quorum); core publish/subscribe keeps working. Raises
    /// [`ConnectionEvent::Disconnected`] / [`ConnectionEvent::Connected`].
    pub fn set_unavailable(&self, unavailable: bool) {
        let was = self.inner.unavailable.swap(unavailable, std::sync::atomic::Ordering::SeqCst);
        if was != unavailable {
            let _ = self.inner.events.send(if unavailable {
                ConnectionEvent::Disconnected
            } else {
                ConnectionEvent::Connected
            });
        }
    }
}

impl EmbeddedBroker {
    /// Fault injection for tests: while `Some(pattern)`, writes to subjects matching it
    /// (NATS wildcards; a KV write goes to `$KV.<bucket>.<key>`) fail with
    /// [`BrokerError::ServerUnavailable`], as when one stream has no leader or its store
    /// is full; reads and every other subject keep working. `None` lifts it.
    pub fn refuse_writes(&self, pattern: Option<&str>) {
        *self.inner.refused.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = pattern.map(str::to_owned);
    }

    /// Fault injection for tests: while `Some(pattern)`, KV reads of keys whose subject
    /// (`$KV.<bucket>.<key>`) matches it fail with [`BrokerError::ServerUnavailable`];
    /// everything else keeps working. `None` lifts it.
    pub fn refuse_reads(&self, pattern: Option<&str>) {
        *self.inner.refused_reads.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = pattern.map(str::to_owned);
    }
}

impl Inner {
    /// Fails a write to `subject` while [`EmbeddedBroker::refuse_writes`] covers it.
    fn check_write(&self, subject: &str) -> BrokerResult<()> {
        Self::check_refused(&self.refused, "publish to", "writes", subject)
    }

    /// Fails a KV read of `subject` while [`EmbeddedBroker::refuse_reads`] covers it.
    fn check_read(&self, subject: &str) -> BrokerResult<()> {
        Self::check_refused(&self.refused_reads, "read", "reads", subject)
    }

    fn check_refused(refused: &Mutex<Option<String>>, verb: &str, what: &str, subject: &str) -> BrokerResult<()> {
        let refused = refused.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match refused.as_deref() {
            Some(pattern) if compare::subject_matches(pattern, subject) => Err(BrokerError::ServerUnavailable {
                operation: format!("{verb} {subject}"),
                reason: format!("{what} of {pattern} refused (fault injection)"),
            }),
            _ => Ok(()),
        }
    }

    fn check(&self, operation: &str) -> BrokerResult<()> {
        if self.unavailable.load(std::sync::atomic::Ordering::SeqCst) {
            Err(BrokerError::Disconnected {
                operation: operation.to_owned(),
                reason: "embedded broker made unavailable (fault injection)".into(),
            })
        } else {
            Ok(())
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state half-updated in a way
        // that matters more than losing the broker; keep serving.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn publish_now(&self, msg: OutboundMessage) -> BrokerResult<PublishAck> {
        self.check("publish")?;
        self.check_write(&msg.subject)?;
        let size = msg.wire_size();
        if size > self.max_payload {
            return Err(BrokerError::PayloadTooLarge { size, limit: self.max_payload });
        }
        check_headers(&msg.headers)?;
        let mut st = self.lock();
        let Some(name) = st.route(&msg.subject) else {
            return Err(BrokerError::NoStream { subject: msg.subject });
        };
        let core = (!st.subs.is_empty()).then(|| CoreMessage {
            subject: msg.subject.clone(),
            reply: None,
            headers: msg.headers.clone(),
            payload: msg.payload.clone(),
        });
        let now = self.clock.now();
        let system_now = self.clock.system_now();
        let ack = st.stream(&name)?.store(msg, now, system_now)?;
        if let Some(core) = core
            && !ack.duplicate
        {
            st.deliver_core(&core);
        }
        Ok(ack)
    }

    fn advise(&self, advisories: Vec<Advisory>) {
        if advisories.is_empty() {
            return;
        }
        let mut st = self.lock();
        for a in advisories {
            let msg = CoreMessage::new(a.subject, a.payload);
            st.deliver_core(&msg);
            // A stream may capture advisories (as JetStream streams can).
            if let Some(name) = st.route(&msg.subject) {
                let now = self.clock.now();
                let sys = self.clock.system_now();
                if let Ok(s) = st.stream(&name) {
                    let _ = s.store(OutboundMessage::new(msg.subject.clone(), msg.payload.clone()), now, sys);
                }
            }
        }
    }

    /// Runs `f` on the (expired-through-now) stream behind a KV bucket.
    fn with_bucket<R>(&self, bucket: &str, f: impl FnOnce(&mut Stream, Instant) -> R) -> BrokerResult<R> {
        let mut st = self.lock();
        let now = self.clock.now();
        let s = st
            .streams
            .get_mut(&format!("KV_{bucket}"))
            .ok_or_else(|| BrokerError::BucketNotFound { bucket: bucket.into() })?;
        s.expire(now);
        Ok(f(s, now))
    }

    fn kv_write(
        &self,
        bucket: &str,
        key: &str,
        value: Bytes,
        op: KvOperation,
        expect: Option<u64>,
    ) -> BrokerResult<u64> {
        self.check("KV write")?;
        compare::validate_key(key)?;
        let mut msg = OutboundMessage::new(crate::wire::Subjects::kv_subject(bucket, key), value);
        self.check_write(&msg.subject)?;
        msg.headers = State::kv_headers(op);
        msg.expected_last_subject_seq = expect;
        let system_now = self.clock.system_now();
        self.with_bucket(bucket, |s, now| s.store(msg, now, system_now))?.map(|ack| ack.seq)
    }

    fn kv_current(&self, bucket: &str, key: &str) -> BrokerResult<Option<KvEntry>> {
        self.check("KV read")?;
        compare::validate_key(key)?;
        let subject = crate::wire::Subjects::kv_subject(bucket, key);
        self.check_read(&subject)?;
        self.with_bucket(bucket, |s, _| s.last_for_subject(&subject).and_then(|seq| s.kv_entry(seq)))
    }
}

fn ready<T: Send + 'static>(value: T) -> BoxFuture<T> {
    Box::pin(std::future::ready(value))
}

impl Broker for EmbeddedBroker {
    fn server(&self) -> ServerInfo {
        ServerInfo {
            kind: BrokerKind::Embedded,
            version: Version::parse(env!("CARGO_PKG_VERSION")).unwrap_or(Version::new(0, 0, 0)),
            name: "embedded".into(),
            max_payload: self.inner.max_payload,
            extra: vec![],
        }
    }

    fn events(&self) -> broadcast::Receiver<ConnectionEvent> {
        self.inner.events.subscribe()
    }

    fn system_now(&self) -> std::time::SystemTime {
        self.inner.clock.system_now()
    }

    fn ensure_stream(&self, spec: StreamSpec) -> BoxFuture<BrokerResult<StreamState>> {
        let mut st = self.inner.lock();
        if let Some(existing) = st.streams.get(&spec.name) {
            return ready(compare::stream(&existing.spec, &spec).map(|tolerated| {
                tolerated.iter().for_each(compare::Tolerated::log);
                existing.state()
            }));
        }
        for other in st.streams.values() {
            for a in &other.spec.subjects {
                if let Some(b) = spec.subjects.iter().find(|b| compare::subjects_overlap(a, b)) {
                    return ready(Err(BrokerError::other(
                        format!("create stream {}", spec.name),
                        format!("subjects overlap with stream {} ({a} and {b})", other.spec.name),
                    )));
                }
            }
        }
        let stream = Stream::new(spec);
        let state = stream.state();
        st.streams.insert(stream.spec.name.clone(), stream);
        st.route_cache.clear();
        ready(Ok(state))
    }

    fn stream_state(&self, stream: &str) -> BoxFuture<BrokerResult<StreamState>> {
        let mut st = self.inner.lock();
        let now = self.inner.clock.now();
        ready(st.stream(stream).map(|s| {
            s.expire(now);
            s.state()
        }))
    }

    fn subject_counts(
        &self,
        stream: &str,
        filter: &str,
    ) -> BoxFuture<BrokerResult<std::collections::BTreeMap<String, u64>>> {
        let mut st = self.inner.lock();
        let now = self.inner.clock.now();
        ready(st.stream(stream).map(|s| {
            s.expire(now);
            s.by_subject
                .iter()
                .filter(|(subject, seqs)| !seqs.is_empty() && crate::broker::compare::subject_matches(filter, subject))
                .map(|(subject, seqs)| (subject.to_string(), seqs.len() as u64))
                .collect()
        }))
    }

    fn ensure_consumer(&self, stream: &str, spec: ConsumerSpec) -> BoxFuture<BrokerResult<ConsumerState>> {
        let mut st = self.inner.lock();
        let result = st.stream(stream).and_then(|s| {
            if let Some(existing) = s.consumers.get(&spec.name) {
                compare::consumer_fixed(stream, &existing.spec, &spec)?;
                if existing.spec != spec {
                    tracing::info!(stream, consumer = %spec.name, from = ?existing.spec, to = ?spec, "consumer settings updated");
                    s.update_consumer(spec.clone());
                }
            } else {
                s.add_consumer(spec.clone())?;
            }
            s.consumer_state(&spec.name)
        });
        ready(result)
    }

    fn consumer_state(&self, stream: &str, consumer: &str) -> BoxFuture<BrokerResult<ConsumerState>> {
        let mut st = self.inner.lock();
        let now = self.inner.clock.now();
        ready(st.stream(stream).and_then(|s| {
            s.expire(now);
            s.consumer_state(consumer)
        }))
    }

    fn reset_consumer(
        &self,
        stream: &str,
        spec: ConsumerSpec,
        start_seq: u64,
    ) -> BoxFuture<BrokerResult<ConsumerState>> {
        let mut st = self.inner.lock();
        let name = spec.name.clone();
        ready(st.stream(stream).and_then(|s| {
            s.reset_consumer(spec, start_seq)?;
            s.consumer_state(&name)
        }))
    }

    fn delete_consumer(&self, stream: &str, consumer: &str) -> BoxFuture<BrokerResult<bool>> {
        let mut st = self.inner.lock();
        ready(st.stream(stream).map(|s| s.remove_consumer(consumer).is_some()))
    }

    fn publish(&self, msg: OutboundMessage) -> BoxFuture<BrokerResult<PublishAck>> {
        ready(self.inner.publish_now(msg))
    }

    fn publish_pipelined(&self, msg: OutboundMessage) -> BoxFuture<BrokerResult<crate::broker::PendingPublish>> {
        let ack = self.inner.publish_now(msg);
        ready(Ok(Box::pin(std::future::ready(ack)) as crate::broker::PendingPublish))
    }

    fn publish_pipelined_batch(
        &self,
        msgs: Arc<[OutboundMessage]>,
    ) -> BoxFuture<BrokerResult<crate::broker::PendingBatch>> {
        // As on JetStream, every message is tried and the first refusal is reported.
        let mut stored = Ok(());
        for m in msgs.iter() {
            if let Err(e) = self.inner.publish_now(m.clone())
                && stored.is_ok()
            {
                stored = Err(e);
            }
        }
        ready(Ok(Box::pin(std::future::ready(stored)) as crate::broker::PendingBatch))
    }

    fn publish_batch(&self, msgs: Vec<OutboundMessage>) -> BoxFuture<Vec<BrokerResult<PublishAck>>> {
        ready(msgs.into_iter().map(|m| self.inner.publish_now(m)).collect())
    }

    fn claim(
        &self,
        stream: &str,
        consumer: &str,
        max: usize,
        max_wait: Duration,
    ) -> BoxFuture<BrokerResult<Vec<Delivery>>> {
        let inner = self.inner.clone();
        let stream = stream.to_owned();
        let consumer = consumer.to_owned();
        Box::pin(async move {
            inner.check("claim")?;
            if max == 0 {
                return Ok(Vec::new());
            }
            let end = inner.clock.now() + max_wait;
            loop {
                // Looked up each time: a reset replaces the consumer (and its waker).
                let notify = inner.lock().stream(&stream)?.consumer_notify(&consumer).unwrap_or_default();
                let notified = notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let mut advisories = Vec::new();
                let now = inner.clock.now();
                let taken = inner.lock().stream(&stream).and_then(|s| s.take(&consumer, max, now, &mut advisories));
                inner.advise(advisories);
                let (got, next_deadline) = taken?;
                if !got.is_empty() || now >= end {
                    return Ok(got);
                }
                let wake = next_deadline.map_or(end, |d| d.min(end));
                tokio::select! {
                    () = &mut notified => {}
                    () = inner.clock.sleep_until(wake) => {}
                }
            }
        })
    }

    fn ack(&self, token: &AckToken, kind: AckKind) -> BoxFuture<BrokerResult<()>> {
        self.ack_many(vec![(token.clone(), kind)])
    }

    fn ack_many(&self, acks: Vec<(AckToken, AckKind)>) -> BoxFuture<BrokerResult<()>> {
        let now = self.inner.clock.now();
        let mut st = self.inner.lock();
        let mut first = Ok(());
        for (token, kind) in &acks {
            let done = match &token.0 {
                AckTokenInner::Embedded { stream, consumer, seq } => {
                    st.stream(stream).and_then(|s| s.ack(consumer, *seq, *kind, now))
                }
                _ => Err(BrokerError::other("ack", "a JetStream delivery cannot be acked on the embedded broker")),
            };
            if let Err(e) = done
                && first.is_ok()
            {
                first = Err(e);
            }
        }
        ready(first)
    }

    fn ack_confirmed(&self, token: &AckToken, kind: AckKind) -> BoxFuture<BrokerResult<()>> {
        self.ack(token, kind)
    }

    fn get_message(&self, stream: &str, seq: u64) -> BoxFuture<BrokerResult<Option<StoredMessage>>> {
        let mut st = self.inner.lock();
        ready(st.stream(stream).map(|s| s.get(seq)))
    }

    fn get_next_message(
        &self,
        stream: &str,
        seq: u64,
        subject: &str,
    ) -> BoxFuture<BrokerResult<Option<StoredMessage>>> {
        let mut st = self.inner.lock();
        ready(st.stream(stream).map(|s| s.next_for(seq, subject)))
    }

    fn delete_message(&self, stream: &str, seq: u64) -> BoxFuture<BrokerResult<bool>> {
        let mut st = self.inner.lock();
        ready(st.stream(stream).map(|s| s.remove(seq)))
    }

    fn ensure_kv(&self, spec: KvSpec) -> BoxFuture<BrokerResult<()>> {
        if let Err(e) = compare::validate_bucket(&spec.bucket) {
            return ready(Err(e));
        }
        let stream = compare::kv_stream(&spec);
        let existing = self.inner.lock().streams.get(&stream.name).map(|s| s.spec.clone());
        if let Some(existing) = existing {
            if spec.keep_all
                && let Err(e) = compare::keeps_all(&format!("KV bucket {}", spec.bucket), &existing)
            {
                return ready(Err(e));
            }
            let found = KvSpec {
                bucket: spec.bucket.clone(),
                history: existing.max_msgs_per_subject.unwrap_or(1).min(64) as u8,
                max_age: existing.max_age,
                storage: existing.storage,
                replicas: existing.replicas,
                keep_all: spec.keep_all,
            };
            return ready(
                compare::kv(&found, &spec).map(|tolerated| tolerated.iter().for_each(compare::Tolerated::log)),
            );
        }
        let fut = self.ensure_stream(stream);
        Box::pin(async move { fut.await.map(|_| ()) })
    }

    fn kv_get(&self, bucket: &str, key: &str) -> BoxFuture<BrokerResult<Option<KvEntry>>> {
        let entry = self.inner.kv_current(bucket, key);
        ready(entry.map(|e| e.filter(|e| e.operation == KvOperation::Put)))
    }

    fn kv_create(&self, bucket: &str, key: &str, value: Bytes) -> BoxFuture<BrokerResult<u64>> {
        // As NATS clients do: create expects no message on the subject; over a delete
        // marker it expects the marker's revision instead.
        let result = self.inner.kv_current(bucket, key).and_then(|current| match current {
            Some(e) if e.operation == KvOperation::Put => {
                Err(BrokerError::KvKeyExists { bucket: bucket.into(), key: key.into() })
            }
            Some(marker) => self.inner.kv_write(bucket, key, value, KvOperation::Put, Some(marker.revision)),
            None => self.inner.kv_write(bucket, key, value, KvOperation::Put, Some(0)),
        });
        let result = result.map_err(|e| match e {
            BrokerError::WrongLastSequence { .. } => {
                BrokerError::KvKeyExists { bucket: bucket.into(), key: key.into() }
            }
            other => other,
        });
        ready(result)
    }

    fn kv_update(&self, bucket: &str, key: &str, value: Bytes, revision: u64) -> BoxFuture<BrokerResult<u64>> {
        let result = self.inner.kv_write(bucket, key, value, KvOperation::Put, Some(revision)).map_err(|e| match e {
            BrokerError::WrongLastSequence { .. } => {
                BrokerError::KvWrongRevision { bucket: bucket.into(), key: key.into(), expected: revision }
            }
            other => other,
        });
        ready(result)
    }

    fn kv_put(&self, bucket: &str, key: &str, value: Bytes) -> BoxFuture<BrokerResult<u64>> {
        ready(self.inner.kv_write(bucket, key, value, KvOperation::Put, None))
    }

    fn kv_delete(&self, bucket: &str, key: &str, revision: Option<u64>) -> BoxFuture<BrokerResult<()>> {
        let result =
            self.inner.kv_write(bucket, key, Bytes::new(), KvOperation::Delete, revision).map_err(|e| match e {
                BrokerError::WrongLastSequence { .. } => BrokerError::KvWrongRevision {
                    bucket: bucket.into(),
                    key: key.into(),
                    expected: revision.unwrap_or(0),
                },
                other => other,
            });
        ready(result.map(|_| ()))
    }

    fn kv_keys(&self, bucket: &str) -> BoxFuture<BrokerResult<Vec<String>>> {
        let result = self.inner.with_bucket(bucket, |s, _| {
            let mut keys: Vec<String> = s
                .by_subject
                .values()
                .filter_map(|seqs| seqs.iter().next_back().and_then(|seq| s.kv_entry(*seq)))
                .filter(|e| e.operation == KvOperation::Put)
                .map(|e| e.key)
                .collect();
            keys.sort();
            keys
        });
        ready(result)
    }

    fn kv_watch(&self, bucket: &str, key: &str) -> BoxFuture<BrokerResult<BoxStream<BrokerResult<KvEntry>>>> {
        if key != ">"
            && key.split('.').all(|t| t != "*" && t != ">")
            && let Err(e) = compare::validate_key(key)
        {
            return ready(Err(e));
        }
        let result = self.inner.with_bucket(bucket, |s, _| {
            let pattern = crate::wire::Subjects::kv_subject(bucket, key);
            let (tx, rx) = mpsc::unbounded_channel();
            for e in s.kv_current(&pattern) {
                let _ = tx.send(Ok(e));
            }
            s.kv_watchers.push(state::KvWatcher { pattern, tx });
            UnboundedReceiverStream::new(rx).boxed()
        });
        ready(result)
    }

    fn kv_scan(&self, bucket: &str, key: &str) -> BoxFuture<BrokerResult<BoxStream<BrokerResult<KvEntry>>>> {
        if let Err(e) = self.inner.check("KV scan") {
            return ready(Err(e));
        }
        let result = self.inner.with_bucket(bucket, |s, _| {
            let entries = s.kv_current(&crate::wire::Subjects::kv_subject(bucket, key));
            futures::stream::iter(entries.into_iter().map(Ok)).boxed()
        });
        ready(result)
    }

    fn core_publish(&self, msg: CoreMessage) -> BoxFuture<BrokerResult<()>> {
        if let Err(e) = check_headers(&msg.headers) {
            return ready(Err(e));
        }
        let mut st = self.inner.lock();
        st.deliver_core(&msg);
        // Streams capture core publishes on their subjects, as in JetStream.
        if let Some(name) = st.route(&msg.subject) {
            let now = self.inner.clock.now();
            let sys = self.inner.clock.system_now();
            let out = OutboundMessage {
                subject: msg.subject,
                headers: msg.headers,
                payload: msg.payload,
                expected_last_subject_seq: None,
            };
            if let Ok(s) = st.stream(&name) {
                let _ = s.store(out, now, sys);
            }
        }
        ready(Ok(()))
    }

    fn subscribe(&self, subject: &str, queue_group: Option<&str>) -> BoxFuture<BrokerResult<BoxStream<CoreMessage>>> {
        let mut st = self.inner.lock();
        let (tx, rx) = mpsc::unbounded_channel();
        st.next_id += 1;
        let id = st.next_id;
        st.subs.push(Subscription { id, pattern: subject.to_owned(), queue: queue_group.map(str::to_owned), tx });
        ready(Ok(UnboundedReceiverStream::new(rx).boxed()))
    }

    fn request(&self, mut msg: CoreMessage, timeout: Duration) -> BoxFuture<BrokerResult<CoreMessage>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let (tx, mut rx) = mpsc::unbounded_channel();
            let subject = msg.subject.clone();
            {
                let mut st = inner.lock();
                st.next_id += 1;
                let id = st.next_id;
                let inbox = format!("_INBOX.embedded.{id}");
                st.subs.push(Subscription { id, pattern: inbox.clone(), queue: None, tx });
                msg.reply = Some(inbox);
                let delivered = st.deliver_core(&msg);
                if delivered == 0 {
                    st.subs.retain(|s| s.id != id);
                    return Err(BrokerError::NoResponders { subject });
                }
            }
            let deadline = inner.clock.now() + timeout;
            let result = tokio::select! {
                reply = rx.recv() => reply.ok_or_else(|| BrokerError::other(format!("request on {subject}"), "reply inbox closed")),
                () = inner.clock.sleep_until(deadline) => Err(BrokerError::TimedOut { operation: format!("request on {subject}"), after: timeout }),
            };
            drop(rx);
            inner.lock().subs.retain(|s| !s.tx.is_closed());
            result
        })
    }

    fn flush(&self) -> BoxFuture<BrokerResult<()>> {
        ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::Retention;

    #[tokio::test]
    async fn refused_writes_and_reads_fail_only_on_their_subjects_until_lifted() {
        let b = EmbeddedBroker::new();
        b.ensure_stream(StreamSpec::new("A", vec!["a.>".into()], Retention::Limits)).await.expect("stream a");
        b.ensure_stream(StreamSpec::new("B", vec!["b.>".into()], Retention::Limits)).await.expect("stream b");
        b.ensure_kv(KvSpec::new("K", None)).await.expect("bucket");
        b.refuse_writes(Some("a.>"));
        let refused = b.publish(OutboundMessage::new("a.1", Bytes::new())).await;
        assert!(matches!(refused, Err(BrokerError::ServerUnavailable { .. })), "{refused:?}");
        b.publish(OutboundMessage::new("b.1", Bytes::new())).await.expect("other subjects are written");
        b.kv_put("K", "k", Bytes::from_static(b"1")).await.expect("and buckets");
        b.refuse_writes(Some("$KV.K.>"));
        assert!(b.kv_put("K", "k", Bytes::from_static(b"2")).await.is_err(), "a refused bucket");
        assert_eq!(b.kv_get("K", "k").await.expect("reads work").map(|e| e.value), Some(Bytes::from_static(b"1")));
        b.refuse_writes(None);
        b.publish(OutboundMessage::new("a.1", Bytes::new())).await.expect("lifted");
        b.kv_put("K", "j", Bytes::from_static(b"3")).await.expect("another key");
        b.refuse_reads(Some("$KV.K.k"));
        assert!(b.kv_get("K", "k").await.is_err(), "a refused read");
        assert!(b.kv_get("K", "j").await.expect("other keys are read").is_some());
        b.kv_put("K", "k", Bytes::from_static(b"4")).await.expect("writes work");
        b.refuse_reads(None);
        assert_eq!(b.kv_get("K", "k").await.expect("lifted").map(|e| e.value), Some(Bytes::from_static(b"4")));
    }
}
