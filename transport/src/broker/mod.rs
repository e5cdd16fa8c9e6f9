//! The broker interface every part of Flotilla talks to, and the types it exchanges.
//!
//! # Object-safe, not generic
//!
//! [`Broker`] is an object-safe trait used as [`SharedBroker`] (`Arc<dyn Broker>`), and
//! its methods return boxed `'static` futures. The reasons:
//!
//! * the backend is chosen at run time (`--nats URL` or the embedded broker), and a
//!   generic parameter would leak into every actor type (`Container<B>`,
//!   `TaskWorker<T, B>`) and double the code the run loop compiles to;
//! * actix actors spawn futures that must be `'static`; boxed futures that own what they
//!   need (backends are cheap `Arc` handles) drop straight into `ctx.spawn`;
//! * the cost is one allocation and one indirect call per operation, tens of
//!   nanoseconds, against a JetStream round trip of hundreds of microseconds; the hot
//!   paths are batched ([`Broker::claim`] returns many deliveries,
//!   [`Broker::publish_batch`] pipelines many publishes) so the cost is per batch.
//!
//! # Semantics
//!
//! Both backends ([`crate::jetstream::JetStreamBroker`] and
//! [`crate::embedded::EmbeddedBroker`]) implement the JetStream semantics Flotilla relies
//! on, and one conformance suite (`tests/tests/transport_conformance.rs`) runs every case
//! against both: ack-wait redelivery with a delivery count, nak with delay, in-progress
//! acks, max deliveries leaving the message stranded, deduplication by message id,
//! ack-all of a prefix, KV compare-and-set with expiry, and request/reply errors.

pub(crate) mod compare;
mod error;
mod types;

pub use error::{BrokerError, ErrorClass};
pub use types::*;

use bytes::Bytes;
use std::{future::Future, pin::Pin, sync::Arc, time::Duration};
use tokio::sync::broadcast;

/// A boxed, sendable, `'static` future, as returned by every [`Broker`] method.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;
/// A boxed, sendable, `'static` stream.
pub type BoxStream<T> = Pin<Box<dyn futures::Stream<Item = T> + Send + 'static>>;
/// A publish on its way: resolves with the broker's ack.
pub type PendingPublish = BoxFuture<BrokerResult<PublishAck>>;
/// A batch of publishes on its way: resolves once every message is stored, or with the
/// first error.
pub type PendingBatch = BoxFuture<BrokerResult<()>>;
/// The broker as the rest of Flotilla holds it.
pub type SharedBroker = Arc<dyn Broker>;
/// Result of a broker operation.
pub type BrokerResult<T> = Result<T, BrokerError>;

/// A durable broker: JetStream streams, pull consumers, KV buckets and core pub/sub.
///
/// All methods return `'static` futures; none of them borrows `self`. Each future is
/// cancel safe in the sense that dropping it never loses a message: a dropped claim
/// leaves its messages to ack-wait redelivery, a dropped publish may or may not have
/// been stored (publish again with the same id).
pub trait Broker: Send + Sync + std::fmt::Debug + 'static {
    /// What the broker is: its kind, server version and the features it supports.
    fn server(&self) -> ServerInfo;

    /// Wall-clock time as the broker stamps messages (`Delivery::info.published`).
    /// Due times of delayed messages are compared against it; the embedded broker
    /// follows its (possibly paused) clock.
    fn system_now(&self) -> std::time::SystemTime;

    /// Connection events (connected, disconnected, slow consumer, …). Each call gives a
    /// new receiver that sees events from now on.
    fn events(&self) -> broadcast::Receiver<ConnectionEvent>;

    /// Creates the stream if it does not exist, then reads its configuration back.
    ///
    /// # Errors
    /// [`BrokerError::ConfigMismatch`] when the stream exists (or was stored) with a
    /// configuration other than `spec`, naming the field; nothing is changed then.
    fn ensure_stream(&self, spec: StreamSpec) -> BoxFuture<BrokerResult<StreamState>>;

    /// The state of a stream (message count, sequences, consumers).
    ///
    /// # Errors
    /// [`BrokerError::StreamNotFound`].
    fn stream_state(&self, stream: &str) -> BoxFuture<BrokerResult<StreamState>>;

    /// How many messages `stream` holds per subject matching `filter` (a subject with
    /// `*` and `>` wildcards); subjects with none are left out.
    fn subject_counts(
        &self,
        stream: &str,
        filter: &str,
    ) -> BoxFuture<BrokerResult<std::collections::BTreeMap<String, u64>>>;

    /// Creates the durable pull consumer if it does not exist, then reads it back. An
    /// existing consumer whose ack-wait, max deliveries or max ack-pending differ is
    /// updated to `spec` (logged); one whose filter or ack policy differ is refused.
    ///
    /// # Errors
    /// [`BrokerError::StreamNotFound`]; [`BrokerError::ConfigMismatch`] when the consumer
    /// exists with another filter or ack policy (nothing is changed then).
    fn ensure_consumer(&self, stream: &str, spec: ConsumerSpec) -> BoxFuture<BrokerResult<ConsumerState>>;

    /// The state of a consumer (pending, ack-pending, ack floor, redeliveries).
    ///
    /// # Errors
    /// [`BrokerError::StreamNotFound`], [`BrokerError::ConsumerNotFound`].
    fn consumer_state(&self, stream: &str, consumer: &str) -> BoxFuture<BrokerResult<ConsumerState>>;

    /// Recreates a durable consumer so that it delivers from stream sequence `start_seq`
    /// on, forgetting its pending deliveries. This is how a new owner takes over an
    /// ordered partition whose previous owner died holding unacked messages: without
    /// it, the broker would hand out later messages first (the orphaned ones wait out
    /// ack-wait), and the next ack-all would acknowledge the orphaned ones unprocessed.
    ///
    /// # Errors
    /// [`BrokerError::StreamNotFound`], transport errors.
    fn reset_consumer(
        &self,
        stream: &str,
        spec: ConsumerSpec,
        start_seq: u64,
    ) -> BoxFuture<BrokerResult<ConsumerState>>;

    /// Deletes a consumer; `Ok(false)` when it did not exist.
    fn delete_consumer(&self, stream: &str, consumer: &str) -> BoxFuture<BrokerResult<bool>>;

    /// Publishes into a stream and resolves once the broker has stored it.
    ///
    /// # Errors
    /// [`BrokerError::NoStream`] when no stream takes the subject,
    /// [`BrokerError::WrongLastSequence`] when an expectation fails, transport errors.
    fn publish(&self, msg: OutboundMessage) -> BoxFuture<BrokerResult<PublishAck>>;

    /// Queues a publish and resolves once it is sent (publishes queued by successive
    /// calls go out in call order), with a future of its ack. This is how outputs are
    /// pipelined across messages: the caller keeps the ack futures and acknowledges its
    /// input only once they resolve.
    ///
    /// # Errors
    /// The outer result fails when the publish could not be queued; the inner future
    /// as [`publish`](Self::publish).
    fn publish_pipelined(&self, msg: OutboundMessage) -> BoxFuture<BrokerResult<PendingPublish>>;

    /// Queues `msgs` in order and resolves once all are sent (batches queued by
    /// successive calls go out in call order), with a future that resolves once every
    /// message is stored, or with the first error. This is the hot path of a worker's
    /// outputs: one call per batch, and acks that arrive while the batch is still being
    /// queued are taken in as it goes, so a batch larger than the broker's ack window
    /// cannot wait forever for a permit.
    ///
    /// # Errors
    /// The outer result fails when a message could not be queued (those before it may
    /// have been stored: publish the batch again, its ids deduplicate); the inner
    /// future as [`publish`](Self::publish), for the first message that failed.
    fn publish_pipelined_batch(&self, msgs: Arc<[OutboundMessage]>) -> BoxFuture<BrokerResult<PendingBatch>> {
        let queued: Vec<_> = msgs.iter().map(|m| self.publish_pipelined(m.clone())).collect();
        Box::pin(async move {
            let mut pending = Vec::with_capacity(queued.len());
            for q in queued {
                pending.push(q.await?);
            }
            let stored: PendingBatch = Box::pin(async move {
                for p in pending {
                    p.await?;
                }
                Ok(())
            });
            Ok(stored)
        })
    }

    /// Publishes many messages pipelined (all sent before any ack is awaited, in order)
    /// and resolves with one result per message, in order.
    fn publish_batch(&self, msgs: Vec<OutboundMessage>) -> BoxFuture<Vec<BrokerResult<PublishAck>>>;

    /// Claims up to `max` messages from a durable consumer, waiting at most `max_wait`
    /// for the first; returns as soon as at least one is available. An empty result means
    /// nothing arrived in time. Never claims more than `max`.
    ///
    /// # Errors
    /// [`BrokerError::StreamNotFound`], [`BrokerError::ConsumerNotFound`], transport errors.
    fn claim(
        &self,
        stream: &str,
        consumer: &str,
        max: usize,
        max_wait: Duration,
    ) -> BoxFuture<BrokerResult<Vec<Delivery>>>;

    /// Acknowledges a delivery (fire and forget: resolves once the ack is sent).
    ///
    /// On a consumer with [`AckPolicy::All`], [`AckKind::Ack`] acks every earlier
    /// delivery of that consumer too.
    fn ack(&self, token: &AckToken, kind: AckKind) -> BoxFuture<BrokerResult<()>>;

    /// Acknowledges several deliveries in order, as one operation (the hot path acks
    /// what one turn of a worker finished together). Resolves once all are sent; the
    /// first error is returned and the acks after it are still attempted.
    fn ack_many(&self, acks: Vec<(AckToken, AckKind)>) -> BoxFuture<BrokerResult<()>> {
        let futs: Vec<_> = acks.iter().map(|(token, kind)| self.ack(token, *kind)).collect();
        Box::pin(async move {
            let mut first = Ok(());
            for fut in futs {
                if let Err(e) = fut.await
                    && first.is_ok()
                {
                    first = Err(e);
                }
            }
            first
        })
    }

    /// Like [`ack`](Self::ack), but resolves only once the broker confirmed it.
    /// Note that acks are not fenced: a stale holder's ack is accepted too.
    fn ack_confirmed(&self, token: &AckToken, kind: AckKind) -> BoxFuture<BrokerResult<()>>;

    /// Reads one stored message by stream sequence; `None` when there is none.
    fn get_message(&self, stream: &str, seq: u64) -> BoxFuture<BrokerResult<Option<StoredMessage>>>;

    /// Reads the first stored message at or after `seq` whose subject matches
    /// `subject` (`*` and `>` wildcards allowed); `None` when there is none. One
    /// request, however many deleted sequences or other subjects' messages lie between.
    ///
    /// # Errors
    /// [`BrokerError::StreamNotFound`].
    fn get_next_message(&self, stream: &str, seq: u64, subject: &str)
    -> BoxFuture<BrokerResult<Option<StoredMessage>>>;

    /// Deletes one stored message by stream sequence; `Ok(false)` when it was not there.
    fn delete_message(&self, stream: &str, seq: u64) -> BoxFuture<BrokerResult<bool>>;

    /// Creates the KV bucket if it does not exist (as a stream, so that 2.9 servers
    /// work), then reads it back.
    ///
    /// # Errors
    /// [`BrokerError::ConfigMismatch`] when it exists with another history or expiry.
    fn ensure_kv(&self, spec: KvSpec) -> BoxFuture<BrokerResult<()>>;

    /// The current entry of `key`; `None` when absent, deleted or expired.
    fn kv_get(&self, bucket: &str, key: &str) -> BoxFuture<BrokerResult<Option<KvEntry>>>;

    /// Creates `key` only if it is absent (or deleted, or expired); returns the revision.
    ///
    /// # Errors
    /// [`BrokerError::KvKeyExists`] when the key has a live value.
    fn kv_create(&self, bucket: &str, key: &str, value: Bytes) -> BoxFuture<BrokerResult<u64>>;

    /// Replaces `key` only if its revision is still `revision`; returns the new revision.
    ///
    /// # Errors
    /// [`BrokerError::KvWrongRevision`] when the key changed since.
    fn kv_update(&self, bucket: &str, key: &str, value: Bytes, revision: u64) -> BoxFuture<BrokerResult<u64>>;

    /// Sets `key` unconditionally; returns the new revision.
    fn kv_put(&self, bucket: &str, key: &str, value: Bytes) -> BoxFuture<BrokerResult<u64>>;

    /// Deletes `key`; with `revision`, only if its revision is still that.
    ///
    /// # Errors
    /// [`BrokerError::KvWrongRevision`] when `revision` no longer matches.
    fn kv_delete(&self, bucket: &str, key: &str, revision: Option<u64>) -> BoxFuture<BrokerResult<()>>;

    /// The keys with a live value.
    fn kv_keys(&self, bucket: &str) -> BoxFuture<BrokerResult<Vec<String>>>;

    /// Watches `key` (a NATS subject pattern: `>` for all): first the current value of
    /// each matching key, then every change. Expiry raises no event (as on 2.9 servers).
    fn kv_watch(&self, bucket: &str, key: &str) -> BoxFuture<BrokerResult<BoxStream<BrokerResult<KvEntry>>>>;

    /// The current entry of every key matching `key` (a NATS subject pattern), deletes
    /// included, in revision order; the stream ends once all of them were read. This is
    /// how a partition's task state is restored.
    ///
    /// # Errors
    /// [`BrokerError::BucketNotFound`], transport errors (also as items, mid-read).
    fn kv_scan(&self, bucket: &str, key: &str) -> BoxFuture<BrokerResult<BoxStream<BrokerResult<KvEntry>>>>;

    /// Publishes a core NATS message (no persistence, no ack).
    fn core_publish(&self, msg: CoreMessage) -> BoxFuture<BrokerResult<()>>;

    /// Subscribes to a core subject (wildcards allowed), optionally in a queue group.
    fn subscribe(&self, subject: &str, queue_group: Option<&str>) -> BoxFuture<BrokerResult<BoxStream<CoreMessage>>>;

    /// Sends a request and waits up to `timeout` for the reply.
    ///
    /// # Errors
    /// [`BrokerError::NoResponders`] at once when nobody listens,
    /// [`BrokerError::TimedOut`] when nobody answered in time.
    fn request(&self, msg: CoreMessage, timeout: Duration) -> BoxFuture<BrokerResult<CoreMessage>>;

    /// Flushes everything buffered (acks, core publishes) to the broker.
    fn flush(&self) -> BoxFuture<BrokerResult<()>>;
}
