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

mod connect;
mod consume;
mod core_nats;
mod errors;
mod headers;
mod kv;
mod messages;
mod provision;
mod publish;
mod publisher;

pub use connect::{JetStreamOptions, reconnect_delay};

use crate::broker::{
    AckKind, AckToken, BoxFuture, BoxStream, Broker, BrokerResult, ConnectionEvent, ConsumerSpec, ConsumerState,
    CoreMessage, Delivery, KvEntry, KvSpec, OutboundMessage, PendingBatch, PendingPublish, PublishAck, ServerInfo,
    StoredMessage, StreamSpec, StreamState,
};
use async_nats::jetstream::{self, consumer::PullConsumer, stream};
use bytes::Bytes;
use dashmap::DashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::broadcast;
// What `publisher` takes from its parent.
use headers::to_header_map;
use publish::publish_payload_check;

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

impl JetStreamBroker {
    /// This broker as a [`SharedBroker`](crate::broker::SharedBroker).
    pub fn shared(&self) -> crate::broker::SharedBroker {
        Arc::new(self.clone())
    }

    /// The underlying async-nats client, for what the interface does not cover.
    pub fn client(&self) -> &async_nats::Client {
        &self.inner.client
    }
}

/// Each method hands its work to `Inner`, in the file of its role: `provision` (streams
/// and consumers), `publish`, `consume` (claims and acks), `messages` (stored messages by
/// sequence), `kv` and `core_nats`.
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
        let (inner, stream) = (self.inner.clone(), stream.to_owned());
        Box::pin(async move { inner.stream_state(stream).await })
    }

    fn subject_counts(
        &self,
        stream: &str,
        filter: &str,
    ) -> BoxFuture<BrokerResult<std::collections::BTreeMap<String, u64>>> {
        let (inner, stream, filter) = (self.inner.clone(), stream.to_owned(), filter.to_owned());
        Box::pin(async move { inner.subject_counts(stream, filter).await })
    }

    fn ensure_consumer(&self, stream: &str, spec: ConsumerSpec) -> BoxFuture<BrokerResult<ConsumerState>> {
        let (inner, stream) = (self.inner.clone(), stream.to_owned());
        Box::pin(async move { inner.ensure_consumer(&stream, spec).await })
    }

    fn consumer_state(&self, stream: &str, consumer: &str) -> BoxFuture<BrokerResult<ConsumerState>> {
        let (inner, stream, consumer) = (self.inner.clone(), stream.to_owned(), consumer.to_owned());
        Box::pin(async move { inner.consumer_state(stream, consumer).await })
    }

    fn reset_consumer(
        &self,
        stream: &str,
        spec: ConsumerSpec,
        start_seq: u64,
    ) -> BoxFuture<BrokerResult<ConsumerState>> {
        let (inner, stream) = (self.inner.clone(), stream.to_owned());
        Box::pin(async move { inner.reset_consumer(stream, spec, start_seq).await })
    }

    fn delete_consumer(&self, stream: &str, consumer: &str) -> BoxFuture<BrokerResult<bool>> {
        let (inner, stream, consumer) = (self.inner.clone(), stream.to_owned(), consumer.to_owned());
        Box::pin(async move { inner.delete_consumer(stream, consumer).await })
    }

    fn publish(&self, msg: OutboundMessage) -> BoxFuture<BrokerResult<PublishAck>> {
        let inner = self.inner.clone();
        Box::pin(async move { inner.publish(msg).await })
    }

    fn publish_pipelined(&self, msg: OutboundMessage) -> BoxFuture<BrokerResult<PendingPublish>> {
        let inner = self.inner.clone();
        Box::pin(async move { inner.publish_pipelined(msg).await })
    }

    fn publish_pipelined_batch(&self, msgs: Arc<[OutboundMessage]>) -> BoxFuture<BrokerResult<PendingBatch>> {
        let inner = self.inner.clone();
        Box::pin(async move { inner.publish_pipelined_batch(msgs).await })
    }

    fn publish_batch(&self, msgs: Vec<OutboundMessage>) -> BoxFuture<Vec<BrokerResult<PublishAck>>> {
        let inner = self.inner.clone();
        Box::pin(async move { inner.publish_batch(msgs).await })
    }

    fn claim(
        &self,
        stream: &str,
        consumer: &str,
        max: usize,
        max_wait: Duration,
    ) -> BoxFuture<BrokerResult<Vec<Delivery>>> {
        let (inner, stream, consumer) = (self.inner.clone(), stream.to_owned(), consumer.to_owned());
        Box::pin(async move { inner.claim(stream, consumer, max, max_wait).await })
    }

    fn ack(&self, token: &AckToken, kind: AckKind) -> BoxFuture<BrokerResult<()>> {
        self.ack_many(vec![(token.clone(), kind)])
    }

    fn ack_many(&self, acks: Vec<(AckToken, AckKind)>) -> BoxFuture<BrokerResult<()>> {
        let inner = self.inner.clone();
        Box::pin(async move { inner.ack_many(acks).await })
    }

    fn ack_confirmed(&self, token: &AckToken, kind: AckKind) -> BoxFuture<BrokerResult<()>> {
        let (inner, reply) = (self.inner.clone(), consume::reply_of(token));
        Box::pin(async move { inner.ack_confirmed(reply?, kind).await })
    }

    fn get_message(&self, stream: &str, seq: u64) -> BoxFuture<BrokerResult<Option<StoredMessage>>> {
        let (inner, stream) = (self.inner.clone(), stream.to_owned());
        Box::pin(async move { inner.get_message(stream, seq).await })
    }

    fn get_next_message(
        &self,
        stream: &str,
        seq: u64,
        subject: &str,
    ) -> BoxFuture<BrokerResult<Option<StoredMessage>>> {
        let (inner, stream, subject) = (self.inner.clone(), stream.to_owned(), subject.to_owned());
        Box::pin(async move { inner.get_next_message(stream, seq, subject).await })
    }

    fn delete_message(&self, stream: &str, seq: u64) -> BoxFuture<BrokerResult<bool>> {
        let (inner, stream) = (self.inner.clone(), stream.to_owned());
        Box::pin(async move { inner.delete_message(stream, seq).await })
    }

    fn ensure_kv(&self, spec: KvSpec) -> BoxFuture<BrokerResult<()>> {
        let inner = self.inner.clone();
        Box::pin(async move { inner.ensure_kv(spec).await })
    }

    fn kv_get(&self, bucket: &str, key: &str) -> BoxFuture<BrokerResult<Option<KvEntry>>> {
        let (inner, bucket, key) = (self.inner.clone(), bucket.to_owned(), key.to_owned());
        Box::pin(async move { inner.kv_get(bucket, key).await })
    }

    fn kv_create(&self, bucket: &str, key: &str, value: Bytes) -> BoxFuture<BrokerResult<u64>> {
        let (inner, bucket, key) = (self.inner.clone(), bucket.to_owned(), key.to_owned());
        Box::pin(async move { inner.kv_create(bucket, key, value).await })
    }

    fn kv_update(&self, bucket: &str, key: &str, value: Bytes, revision: u64) -> BoxFuture<BrokerResult<u64>> {
        let (inner, bucket, key) = (self.inner.clone(), bucket.to_owned(), key.to_owned());
        Box::pin(async move { inner.kv_update(bucket, key, value, revision).await })
    }

    fn kv_put(&self, bucket: &str, key: &str, value: Bytes) -> BoxFuture<BrokerResult<u64>> {
        let (inner, bucket, key) = (self.inner.clone(), bucket.to_owned(), key.to_owned());
        Box::pin(async move { inner.kv_put(bucket, key, value).await })
    }

    fn kv_delete(&self, bucket: &str, key: &str, revision: Option<u64>) -> BoxFuture<BrokerResult<()>> {
        let (inner, bucket, key) = (self.inner.clone(), bucket.to_owned(), key.to_owned());
        Box::pin(async move { inner.kv_delete(bucket, key, revision).await })
    }

    fn kv_keys(&self, bucket: &str) -> BoxFuture<BrokerResult<Vec<String>>> {
        let (inner, bucket) = (self.inner.clone(), bucket.to_owned());
        Box::pin(async move { inner.kv_keys(bucket).await })
    }

    fn kv_watch(&self, bucket: &str, key: &str) -> BoxFuture<BrokerResult<BoxStream<BrokerResult<KvEntry>>>> {
        let (inner, bucket, key) = (self.inner.clone(), bucket.to_owned(), key.to_owned());
        Box::pin(async move { inner.kv_watch(bucket, key).await })
    }

    fn kv_scan(&self, bucket: &str, key: &str) -> BoxFuture<BrokerResult<BoxStream<BrokerResult<KvEntry>>>> {
        let (inner, bucket, key) = (self.inner.clone(), bucket.to_owned(), key.to_owned());
        Box::pin(async move { inner.kv_scan(bucket, key).await })
    }

    fn core_publish(&self, msg: CoreMessage) -> BoxFuture<BrokerResult<()>> {
        let inner = self.inner.clone();
        Box::pin(async move { inner.core_publish(msg).await })
    }

    fn subscribe(&self, subject: &str, queue_group: Option<&str>) -> BoxFuture<BrokerResult<BoxStream<CoreMessage>>> {
        let (inner, subject, group) = (self.inner.clone(), subject.to_owned(), queue_group.map(str::to_owned));
        Box::pin(async move { inner.subscribe(subject, group).await })
    }

    fn request(&self, msg: CoreMessage, timeout: Duration) -> BoxFuture<BrokerResult<CoreMessage>> {
        let inner = self.inner.clone();
        Box::pin(async move { inner.request(msg, timeout).await })
    }

    fn flush(&self) -> BoxFuture<BrokerResult<()>> {
        let inner = self.inner.clone();
        Box::pin(async move { inner.flush().await })
    }
}
