//! What a user writes: a [`Task`], and the [`TaskContext`] it works through.
//!
//! ```no_run
//! use flotilla_actors::{StoreDef, StreamDef, Task, TaskContext, TaskError};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize)]
//! struct Order { id: u64, customer: String, cents: u64 }
//! #[derive(Serialize, Deserialize)]
//! struct Total { customer: String, cents: u64 }
//! const TOTALS: StreamDef<Total> = StreamDef::ordered("totals", 8);
//! // Durable state, declared on the job with `.store(BY_CUSTOMER).store(CHANGED)`.
//! const BY_CUSTOMER: StoreDef<String, u64> = StoreDef::new("by-customer");
//! const CHANGED: StoreDef<String, ()> = StoreDef::new("changed");
//!
//! struct Revenue;
//!
//! impl Task for Revenue {
//!     type Input = Order;
//!     async fn process(&mut self, order: Order, ctx: &mut TaskContext) -> Result<(), TaskError> {
//!         ctx.store(&BY_CUSTOMER)?.update(order.customer.clone(), |c| Some(c.unwrap_or(0) + order.cents))?;
//!         ctx.store(&CHANGED)?.put(order.customer, ())?;
//!         Ok(())
//!     }
//!     async fn window(&mut self, ctx: &mut TaskContext) -> Result<(), TaskError> {
//!         for (customer, ()) in ctx.store(&CHANGED)?.entries() {
//!             let cents = ctx.store(&BY_CUSTOMER)?.get(&customer).unwrap_or(0);
//!             ctx.send(&TOTALS, &customer.clone(), Total { customer: customer.clone(), cents }).await?;
//!             ctx.store(&CHANGED)?.delete(&customer);
//!         }
//!         Ok(())
//!     }
//! }
//! ```
//!
//! # Concurrency without locks
//!
//! `process` gets `&mut self`, so one `process` call runs at a time. A task with
//! `max_concurrency > 1` does its state changes synchronously, then hands the slow part
//! to [`TaskContext::defer`] as a `'static` future; the message counts as in flight
//! until that future completes, and the next message's `process` starts at once.
//! Outputs sent from a deferred future go through [`TaskContext::outputs`].

use crate::state::ShutdownScope;
use crate::stream::{StreamDef, StreamKind};
use flotilla_transport::broker::{OutboundMessage, SharedBroker};
use flotilla_transport::clock::unix_millis;
use flotilla_transport::topology;
use flotilla_transport::wire::{
    Codec, CodecError, HeaderText, Headers, MessageId, StreamName, Subjects, headers, partition_for,
};
use futures::future::LocalBoxFuture;
use rustc_hash::FxHashMap;
use serde::{Serialize, de::DeserializeOwned};
use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::fmt::Write as _;
use std::future::Future;
use std::rc::Rc;
use std::time::{Duration, SystemTime};

mod context;
pub(crate) mod durable;
pub use context::TaskContext;
pub use durable::Misfire;

/// Why a task callback did not succeed.
///
/// Any error converts with `?` into [`TaskError::Failed`]. `TaskError` deliberately does
/// not implement `std::error::Error`, so that blanket conversion is possible.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskError {
    /// This message failed: retry it by the retry policy, then dead-letter it.
    Failed(String),
    /// The task cannot go on: fail the container or restart the task, by policy.
    Fatal(String),
    /// Something the message needs is unreachable right now (the broker, a database):
    /// retry after a back-off without counting an attempt (up to
    /// [`TaskConfig::unavailable_retries`](crate::TaskConfig::unavailable_retries)).
    Unavailable(String),
    /// This message can never succeed, however often it is tried (for example an
    /// output over the broker's size limit): dead-letter it at once, with `reason` as
    /// its dead-letter reason.
    Permanent {
        /// The dead-letter reason code (`too-large`, `rejected`, …).
        reason: &'static str,
        /// What is wrong, for a human.
        detail: String,
    },
}

impl TaskError {
    /// A failed attempt.
    pub fn failed(reason: impl Into<String>) -> Self {
        TaskError::Failed(reason.into())
    }

    /// A failure of the task itself.
    pub fn fatal(reason: impl Into<String>) -> Self {
        TaskError::Fatal(reason.into())
    }

    /// Something is unreachable right now; retried without counting an attempt.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        TaskError::Unavailable(reason.into())
    }

    /// This message can never succeed: dead-lettered at once as `rejected`.
    pub fn rejected(detail: impl Into<String>) -> Self {
        TaskError::Permanent { reason: "rejected", detail: detail.into() }
    }

    /// The reason text.
    pub fn reason(&self) -> &str {
        match self {
            TaskError::Failed(r) | TaskError::Fatal(r) | TaskError::Unavailable(r) => r,
            TaskError::Permanent { detail, .. } => detail,
        }
    }
}

impl std::fmt::Display for TaskError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TaskError::Failed(r) => write!(f, "failed: {r}"),
            TaskError::Fatal(r) => write!(f, "fatal: {r}"),
            TaskError::Unavailable(r) => write!(f, "unavailable: {r}"),
            TaskError::Permanent { reason, detail } => write!(f, "{reason}: {detail}"),
        }
    }
}

impl<E: std::error::Error + 'static> From<E> for TaskError {
    /// A failed attempt with the error's text and its causes; a store's refusal
    /// ([`StoreError`](crate::StoreError)) is permanent instead (see there).
    fn from(err: E) -> Self {
        if let Some(refused) = (&err as &dyn std::error::Error).downcast_ref::<crate::StoreError>() {
            return refused.permanent();
        }
        let mut text = err.to_string();
        let mut source = err.source();
        while let Some(s) = source {
            text.push_str(": ");
            text.push_str(&s.to_string());
            source = s.source();
        }
        TaskError::Failed(text)
    }
}

/// The user's actor for one partition (or, for a queue input, for one node).
///
/// Every hook but `process` has a default that does nothing.
pub trait Task: 'static {
    /// The input message type (serde, encoded with the wire codec). `Serialize` too, so
    /// the job binary can publish it from JSON and show dead letters decoded.
    type Input: DeserializeOwned + Serialize + 'static;

    /// Processes one message.
    fn process(&mut self, input: Self::Input, ctx: &mut TaskContext) -> impl Future<Output = Result<(), TaskError>>;

    /// Runs once before the first message.
    fn init(&mut self, _ctx: &mut TaskContext) -> impl Future<Output = Result<(), TaskError>> {
        async { Ok(()) }
    }

    /// Runs every window interval, never while a `process` runs.
    fn window(&mut self, _ctx: &mut TaskContext) -> impl Future<Output = Result<(), TaskError>> {
        async { Ok(()) }
    }

    /// Runs before each commit of the input position.
    fn commit(&mut self, _ctx: &mut TaskContext) -> impl Future<Output = Result<(), TaskError>> {
        async { Ok(()) }
    }

    /// A timer is due: one scheduled in memory with [`TaskContext::schedule`], or a
    /// durable one ([`TaskContext::schedule_durable`]), which arrives in order with the
    /// partition's messages and is retried and dead-lettered as a message is.
    fn timer(&mut self, _name: String, _ctx: &mut TaskContext) -> impl Future<Output = Result<(), TaskError>> {
        async { Ok(()) }
    }

    /// Every input saw a drain marker of the current run; everything before was processed.
    fn drain(&mut self, _ctx: &mut TaskContext) -> impl Future<Output = Result<(), TaskError>> {
        async { Ok(()) }
    }

    /// Every input ended.
    fn end_of_stream(&mut self, _ctx: &mut TaskContext) -> impl Future<Output = Result<(), TaskError>> {
        async { Ok(()) }
    }

    /// The task is stopping (graceful leave, rebalance, shutdown).
    fn shutdown(&mut self, _ctx: &mut TaskContext) -> impl Future<Output = Result<(), TaskError>> {
        async { Ok(()) }
    }
}

/// What the runtime shares with every task of a job on this node.
#[derive(Debug)]
pub struct TaskEnv {
    /// The broker.
    pub broker: SharedBroker,
    /// The payload codec.
    pub codec: Codec,
    /// The job's subjects.
    pub subjects: Subjects,
    /// The current run id (drain markers carry it).
    pub run_id: String,
    /// Replicas of the output streams this environment creates.
    replicas: usize,
    /// Output streams known to exist, with the subject (the partition's, less its
    /// number, for ordered streams) outputs to them go to.
    provisioned: RefCell<FxHashMap<&'static str, Rc<str>>>,
    /// One suspect message in flight per node at a time (see
    /// [`SuspectRecord`](crate::task_worker::SuspectRecord)): when a node dies, the one
    /// suspect it was running is the one to blame, not its neighbours in other
    /// partitions.
    pub(crate) suspect_lane: std::sync::Arc<tokio::sync::Semaphore>,
    /// Keys of queue inputs parked by `park --key` (kept current by the node's
    /// membership).
    pub parked: ParkedKeys,
    /// The last change this node's workers made to each of their durable timers.
    pub(crate) armings: durable::Armings,
}

/// The keys parked on each queue input (`park --stream S --key K`): their messages are
/// set aside in the job's PARKED stream instead of running, until `step` or `unpark`.
/// Shared by the node's membership (which reads the desired state) and its workers.
#[derive(Debug, Clone, Default)]
pub struct ParkedKeys(std::sync::Arc<ParkedInner>);

#[derive(Debug, Default)]
struct ParkedInner {
    /// Whether any key is parked: the check on the hot path.
    any: std::sync::atomic::AtomicBool,
    keys: std::sync::RwLock<std::collections::BTreeMap<String, std::collections::BTreeSet<String>>>,
}

impl ParkedKeys {
    /// Replaces the parked keys (stream → keys).
    pub fn set(&self, keys: std::collections::BTreeMap<String, std::collections::BTreeSet<String>>) {
        let any = keys.values().any(|k| !k.is_empty());
        if let Ok(mut k) = self.0.keys.write() {
            *k = keys;
        }
        self.0.any.store(any, std::sync::atomic::Ordering::Release);
    }

    /// Whether any key is parked (one atomic load).
    pub fn any(&self) -> bool {
        self.0.any.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether `key` of queue input `stream` is parked.
    pub fn is_parked(&self, stream: &str, key: &str) -> bool {
        self.0.any.load(std::sync::atomic::Ordering::Acquire)
            && self.0.keys.read().is_ok_and(|k| k.get(stream).is_some_and(|keys| keys.contains(key)))
    }
}

impl TaskEnv {
    /// An environment for `subjects`' job.
    pub fn new(broker: SharedBroker, codec: Codec, subjects: Subjects, run_id: impl Into<String>) -> Self {
        Self {
            broker,
            codec,
            subjects,
            run_id: run_id.into(),
            replicas: 1,
            provisioned: RefCell::default(),
            suspect_lane: std::sync::Arc::new(tokio::sync::Semaphore::new(1)),
            parked: ParkedKeys::default(),
            armings: Default::default(),
        }
    }

    /// The same environment creating output streams with `replicas` copies.
    #[must_use]
    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// Makes sure the stream behind `def` exists (once per node), and returns the
    /// subject an output keyed `key` goes to.
    async fn output_subject<T>(&self, def: &StreamDef<T>, key: &str) -> Result<String, TaskError> {
        let known = self.provisioned.borrow().get(def.name()).cloned();
        let base = match known {
            Some(base) => base,
            None => self.provision_output(def).await?,
        };
        Ok(match def.kind() {
            // As `Subjects::ordered_partition`, without formatting the whole subject.
            StreamKind::Ordered { partitions } => {
                let mut subject = String::with_capacity(base.len() + 11);
                subject.push_str(&base);
                // Writing into a String cannot fail.
                let _ = write!(subject, ".{}", partition_for(key, partitions));
                subject
            }
            StreamKind::Queue => String::from(&*base),
        })
    }

    async fn provision_output<T>(&self, def: &StreamDef<T>) -> Result<Rc<str>, TaskError> {
        let name = StreamName::new(def.name()).map_err(|e| TaskError::fatal(e.to_string()))?;
        let spec = match def.kind() {
            StreamKind::Ordered { partitions } => topology::ordered_stream(&self.subjects, &name, partitions, None),
            StreamKind::Queue => topology::queue_stream(&self.subjects, &name),
        };
        self.broker
            .ensure_stream(spec.with_replicas(self.replicas))
            .await
            .map_err(|e| TaskError::fatal(format!("output stream {}: {e}", def.name())))?;
        let base: Rc<str> = self.subjects.queue(&name).into();
        self.provisioned.borrow_mut().insert(def.name(), base.clone());
        Ok(base)
    }
}

/// Metadata of the message being processed.
#[derive(Debug, Clone)]
pub struct MessageMeta {
    /// Its `Nats-Msg-Id`.
    pub id: MessageId,
    /// Its key (`Flotilla-Key`), if it has one.
    pub key: Option<String>,
    /// The input stream's name.
    pub stream: &'static str,
    /// Its partition (ordered inputs).
    pub partition: Option<u32>,
    /// Its stream sequence.
    pub stream_seq: u64,
    /// How many times the broker delivered it (this delivery included).
    pub delivered: u64,
    /// This attempt's number (1 for the first).
    pub attempt: u32,
    /// When it was stored.
    pub published: SystemTime,
    /// All its headers.
    pub headers: Headers,
}

/// Sends outputs; cloneable into deferred futures. Every output's publish ack is awaited
/// before the input is acknowledged (effect before ack).
pub struct Outputs {
    env: Rc<TaskEnv>,
    cause: Option<MessageId>,
    traceparent: Option<std::sync::Arc<str>>,
    epoch: u64,
    /// What clones of this handle share: made on the first output or clone, so a
    /// callback that sends nothing (most of them) allocates nothing for it.
    shared: std::cell::OnceCell<Rc<OutputsShared>>,
}

impl Clone for Outputs {
    fn clone(&self) -> Self {
        Self {
            env: self.env.clone(),
            cause: self.cause.clone(),
            traceparent: self.traceparent.clone(),
            epoch: self.epoch,
            shared: std::cell::OnceCell::from(self.shared().clone()),
        }
    }
}

/// The next output's index and the outputs of this callback so far.
#[derive(Default)]
struct OutputsShared {
    next_index: Cell<u32>,
    buffer: RefCell<Vec<OutboundMessage>>,
    /// `Flotilla-Epoch` as text, written once per callback (on its first output) and
    /// shared by its outputs.
    epoch_text: std::cell::OnceCell<std::sync::Arc<str>>,
    /// Changes to durable timers of an ordered partition, by timer key: noted for the
    /// worker once the callback succeeded.
    timer_changes: RefCell<Vec<(String, durable::Change)>>,
}

impl std::fmt::Debug for Outputs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outputs")
            .field("cause", &self.cause)
            .field("buffered", &self.shared.get().map_or(0, |s| s.buffer.borrow().len()))
            .finish()
    }
}

impl Outputs {
    /// Sends `value` with `key` to `stream` (partitioned by the key for ordered
    /// streams). Outputs are published once the callback succeeds — a failed attempt
    /// publishes nothing — in send order, and the input is acknowledged only after
    /// every output's publish ack.
    ///
    /// # Errors
    /// [`TaskError::Failed`] when the value cannot be encoded or the publish cannot be
    /// queued (it is retried with the message).
    pub async fn send<T: Serialize>(
        &self,
        stream: &StreamDef<T>,
        key: &str,
        value: impl std::borrow::Borrow<T>,
    ) -> Result<(), TaskError> {
        let msg = self.build(stream, key, value.borrow()).await?;
        self.queue(msg).await
    }

    /// Like [`send`](Self::send), but the message reaches `stream` only after `delay`.
    /// It is durable: it waits in the job's timer stream and survives node and broker
    /// restarts; the timer service of any node publishes it when due (with the id it
    /// would have had, so a redelivered input's delayed outputs are deduplicated too).
    ///
    /// # Errors
    /// As [`send`](Self::send); [`TaskError::Failed`] for a delay over
    /// [`MAX_DELAY`](crate::timer_service::MAX_DELAY).
    pub async fn send_after<T: Serialize>(
        &self,
        stream: &StreamDef<T>,
        key: &str,
        value: impl std::borrow::Borrow<T>,
        delay: Duration,
    ) -> Result<(), TaskError> {
        check_delay(delay, &format!("delayed output to {}", stream.name()))?;
        let msg = self.build(stream, key, value.borrow()).await?;
        let id = msg.headers.msg_id().unwrap_or_default().to_owned();
        let mut timer = OutboundMessage::new(self.env.subjects.timer(&id), msg.payload);
        timer.headers = msg.headers;
        timer.headers.insert(headers::MSG_ID, format!("timer-{id}"));
        timer.headers.insert(headers::DELAY, delay.as_millis().to_string());
        timer.headers.insert(headers::TARGET, msg.subject);
        self.queue(timer).await
    }

    async fn build<T: Serialize>(
        &self,
        stream: &StreamDef<T>,
        key: &str,
        value: &T,
    ) -> Result<OutboundMessage, TaskError> {
        if let Some(problem) = headers::entry_problem(headers::KEY, key) {
            return Err(TaskError::failed(format!(
                "output key {key:?} cannot be sent: keys travel in the {} header, and {problem}",
                headers::KEY
            )));
        }
        let subject = self.env.output_subject(stream, key).await?;
        let payload = self.env.codec.encode(value).map_err(|e| match e {
            // The same value will never fit: no point in retrying.
            CodecError::TooLarge { .. } => TaskError::Permanent { reason: "too-large", detail: e.to_string() },
            e => TaskError::failed(e.to_string()),
        })?;
        let shared = self.shared();
        let index = shared.next_index.get();
        shared.next_index.set(index + 1);
        let id = match &self.cause {
            Some(cause) => cause.derive_output_text(index),
            None => MessageId::new_v7().as_str().to_owned(),
        };
        let epoch = shared.epoch_text.get_or_init(|| self.epoch.to_string().into()).clone();
        // Per output, only its id, key and time are new text; the rest is shared.
        let mut entries = Vec::with_capacity(7);
        entries.extend([
            (Cow::Borrowed(headers::MSG_ID), HeaderText::Owned(id)),
            (Cow::Borrowed(headers::KEY), HeaderText::Owned(key.to_owned())),
            (Cow::Borrowed(headers::TYPE), HeaderText::Static(stream.type_name())),
            (Cow::Borrowed(headers::SENT), HeaderText::Owned(unix_millis(SystemTime::now()).to_string())),
            (Cow::Borrowed(headers::EPOCH), HeaderText::Shared(epoch)),
        ]);
        if let Some(cause) = &self.cause {
            entries.push((Cow::Borrowed(headers::CAUSE), HeaderText::from(cause)));
        }
        if let Some(tp) = &self.traceparent {
            entries.push((Cow::Borrowed(headers::TRACEPARENT), HeaderText::Shared(tp.clone())));
        }
        Ok(OutboundMessage { subject, headers: Headers::from(entries), payload, expected_last_subject_seq: None })
    }

    async fn queue(&self, msg: OutboundMessage) -> Result<(), TaskError> {
        self.shared().buffer.borrow_mut().push(msg);
        Ok(())
    }

    /// Whether this callback sent nothing (yet).
    pub(crate) fn is_empty(&self) -> bool {
        self.shared.get().is_none_or(|s| s.buffer.borrow().is_empty())
    }

    /// The outputs of this callback, in send order (it succeeded: its changes to
    /// durable timers are noted).
    pub(crate) fn take_buffer(&self) -> Vec<OutboundMessage> {
        let Some(s) = self.shared.get() else { return Vec::new() };
        for (key, change) in s.timer_changes.take() {
            self.env.armings.note(key, self.epoch, change);
        }
        std::mem::take(&mut *s.buffer.borrow_mut())
    }

    fn shared(&self) -> &Rc<OutputsShared> {
        self.shared.get_or_init(Rc::default)
    }
}

/// Refuses a delay over [`MAX_DELAY`](crate::timer_service::MAX_DELAY) for `what`.
fn check_delay(delay: Duration, what: &str) -> Result<(), TaskError> {
    let max = crate::timer_service::MAX_DELAY;
    if delay > max {
        return Err(TaskError::failed(format!(
            "{what}: a delay of {delay:?} is over the limit of {max:?} (365 days); store far-off work elsewhere and schedule it nearer the time"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timers_and_delayed_outputs_past_the_limit_are_refused_with_a_reason() {
        let env = Rc::new(TaskEnv::new(
            flotilla_transport::embedded::EmbeddedBroker::new().shared(),
            Codec::default(),
            Subjects::new(flotilla_transport::wire::JobName::new("job").expect("name")),
            "run",
        ));
        let mut ctx = TaskContext::new(env, Some(0), 1, None);
        assert!(ctx.schedule("soon", Duration::from_secs(60)).is_ok());
        let err = ctx.schedule("never", Duration::MAX).expect_err("refused");
        assert!(err.to_string().contains("timer \"never\"") && err.to_string().contains("over the limit"), "{err}");
        let out = StreamDef::<u64>::ordered("out", 4);
        let err = futures::executor::block_on(ctx.send_after(&out, "k", 1, Duration::from_secs(400 * 86_400)))
            .expect_err("refused");
        assert!(err.to_string().contains("delayed output to out"), "{err}");
        assert!(futures::executor::block_on(ctx.send_after(&out, "k", 1, Duration::from_secs(60))).is_ok());
    }

    #[test]
    fn output_subjects_are_the_wire_subjects() {
        let broker = flotilla_transport::embedded::EmbeddedBroker::new().shared();
        let subjects = Subjects::new(flotilla_transport::wire::JobName::new("job").expect("name"));
        let env = TaskEnv::new(broker, Codec::default(), subjects.clone(), "run");
        let ordered = StreamDef::<u64>::ordered("out", 16);
        let queue = StreamDef::<u64>::queue("work");
        futures::executor::block_on(async {
            for key in ["a", "b", "user-42", ""] {
                let want = subjects.ordered_partition(&StreamName::new("out").expect("name"), partition_for(key, 16));
                assert_eq!(env.output_subject(&ordered, key).await.expect("subject"), want);
                // Twice: the second comes from the cache.
                assert_eq!(env.output_subject(&ordered, key).await.expect("subject"), want);
            }
            let want = subjects.queue(&StreamName::new("work").expect("name"));
            assert_eq!(env.output_subject(&queue, "k").await.expect("subject"), want);
            assert_eq!(env.output_subject(&queue, "k").await.expect("subject"), want);
        });
    }

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn any_error_converts_to_a_failed_attempt_with_its_causes() {
        let e: TaskError = Outer(std::io::Error::other("inner")).into();
        assert_eq!(e, TaskError::Failed("outer: inner".into()));
        assert_eq!(TaskError::fatal("x").to_string(), "fatal: x");
    }
}
