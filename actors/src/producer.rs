//! Putting records into a job's streams from outside its tasks: a service, a script, a
//! test or the `publish` command.
//!
//! A [`Producer`] writes what a task's [`Outputs`](crate::Outputs) would: the stream's
//! subject (an ordered stream's partition from the key, with the same hash), the
//! `Nats-Msg-Id`, `Flotilla-Key`, `Flotilla-Type` and `Flotilla-Sent` headers, and the
//! value encoded with the job's codec. It creates a stream that does not exist yet the
//! way the job would, so records can be sent before any node of the job started.
//!
//! ```no_run
//! # use flotilla_actors::{StreamDef, producer::Producer};
//! # async fn feed(broker: flotilla_actors::SharedBroker) -> Result<(), flotilla_actors::producer::ProducerError> {
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Order { id: u64, cents: u64 }
//! const ORDERS: StreamDef<Order> = StreamDef::ordered("orders", 8);
//!
//! let producer = Producer::new(broker, "shop")?;
//! let sent = producer.send(&ORDERS, "customer-7", &Order { id: 1, cents: 1250 }).await?;
//! println!("stored as {} in partition {:?}", sent.id, sent.partition);
//! # Ok(()) }
//! ```
//!
//! Every method is `Send`: a producer works from any tokio program, not only inside
//! a node.

use crate::stream::{StreamDef, StreamKind};
use crate::timer_service::MAX_DELAY;
use flotilla_transport::broker::{BrokerError, OutboundMessage, SharedBroker, StreamSpec};
use flotilla_transport::clock::unix_millis;
use flotilla_transport::topology;
use flotilla_transport::wire::{Codec, CodecError, JobName, MessageId, NameError, StreamName, Subjects, headers};
use serde::Serialize;
use std::borrow::Borrow;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// At most this many records go to the broker in one pipelined batch.
const BATCH: usize = 1024;

/// Why a record was not sent.
#[derive(Debug, thiserror::Error)]
pub enum ProducerError {
    /// A job or stream name breaks the naming rule.
    #[error(transparent)]
    Name(#[from] NameError),
    /// The key cannot travel in a header.
    #[error("key {key:?} cannot be sent: keys travel in the {} header, and {problem}", headers::KEY)]
    Key {
        /// The key.
        key: String,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// The id cannot travel in a header.
    #[error("id {id:?} cannot be sent: ids travel in the {} header, and {problem}", headers::MSG_ID)]
    Id {
        /// The id.
        id: String,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// The value does not encode (or is too large).
    #[error("the value for key {key:?} cannot be encoded: {source}")]
    Encode {
        /// The key.
        key: String,
        /// Why.
        source: CodecError,
    },
    /// A delay over [`MAX_DELAY`].
    #[error(
        "a delay of {0:?} is over the limit of 365 days; store far-off work elsewhere and schedule it nearer the time"
    )]
    Delay(Duration),
    /// The broker refused, or kept failing past the producer's patience. Records sent
    /// with ids of their own ([`Producer::send_with_id`],
    /// [`Producer::send_batch_with_ids`]) can be sent again as they were: the server
    /// stores none twice within its duplicate window.
    #[error("{stored} of {total} records stored; the broker failed for the rest: {source}")]
    Broker {
        /// Records stored.
        stored: usize,
        /// Records in the call.
        total: usize,
        /// The last error.
        source: BrokerError,
    },
    /// Provisioning the stream failed.
    #[error("cannot create stream {stream}: {source}")]
    Provision {
        /// The stream.
        stream: String,
        /// Why.
        source: BrokerError,
    },
}

/// One record as the broker stored it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    /// Its `Nats-Msg-Id`: sending it again with this id within the stream's duplicate
    /// window (2 minutes) stores nothing new.
    pub id: String,
    /// The subject it went to.
    pub subject: String,
    /// Its partition (ordered streams).
    pub partition: Option<u32>,
    /// Its stream sequence (for a delayed record: in the job's timer stream).
    pub seq: u64,
    /// Whether the broker already held a record with this id (nothing new stored).
    pub duplicate: bool,
}

/// Sends typed records into a job's streams; cheap to clone (clones share the
/// connection and what was provisioned).
#[derive(Clone)]
pub struct Producer {
    broker: SharedBroker,
    subjects: Subjects,
    codec: Codec,
    replicas: usize,
    patience: Duration,
    provisioned: Arc<Mutex<HashSet<String>>>,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer").field("job", self.subjects.job()).field("replicas", &self.replicas).finish()
    }
}

impl Producer {
    /// A producer for `job`'s streams on `broker`.
    ///
    /// # Errors
    /// [`ProducerError::Name`] when `job` breaks the naming rule.
    pub fn new(broker: SharedBroker, job: &str) -> Result<Self, ProducerError> {
        Ok(Self {
            broker,
            subjects: Subjects::new(JobName::new(job)?),
            codec: Codec::default(),
            replicas: 1,
            patience: Duration::from_secs(30),
            provisioned: Arc::default(),
        })
    }

    /// Copies of a stream this producer has to create (default 1; as the job's
    /// `replicas`).
    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas.max(1);
        self
    }

    /// How long a send keeps retrying while the broker is unavailable (default 30 s).
    /// Retries reuse the record's id, so none is stored twice.
    pub fn with_patience(mut self, patience: Duration) -> Self {
        self.patience = patience;
        self
    }

    /// The broker it sends to.
    pub fn broker(&self) -> &SharedBroker {
        &self.broker
    }

    /// The job's subjects.
    pub fn subjects(&self) -> &Subjects {
        &self.subjects
    }

    /// Sends `value` with `key` to `stream` (an ordered stream's partition follows the
    /// key) with a new id, and waits until the broker stored it.
    ///
    /// # Errors
    /// [`ProducerError`]: a bad key, a value that does not encode, or a broker failure
    /// after the producer's patience.
    pub async fn send<T: Serialize>(
        &self,
        stream: &StreamDef<T>,
        key: &str,
        value: impl Borrow<T>,
    ) -> Result<Sent, ProducerError> {
        self.send_with_id(stream, MessageId::new_v7().as_str(), key, value).await
    }

    /// As [`send`](Self::send) with the id given: sending the same id again within the
    /// stream's duplicate window (2 minutes) stores nothing new, which makes a retry
    /// after a crash safe.
    ///
    /// # Errors
    /// As [`send`](Self::send); an id that cannot travel in a header.
    pub async fn send_with_id<T: Serialize>(
        &self,
        stream: &StreamDef<T>,
        id: &str,
        key: &str,
        value: impl Borrow<T>,
    ) -> Result<Sent, ProducerError> {
        let msg = self.message(stream, key, value.borrow())?;
        let msg = self.with_id(msg, id)?;
        self.provision(stream).await?;
        let ordered = matches!(stream.kind(), StreamKind::Ordered { .. });
        let mut sent = self.publish(vec![msg], ordered).await?;
        Ok(sent.remove(0))
    }

    /// Sends every `(key, value)` of `records` to `stream`, pipelined, and waits until
    /// all are stored. Records of one key keep their order, unless one of them had to
    /// be sent again after a passing broker failure (it then lands after the others).
    ///
    /// # Errors
    /// As [`send`](Self::send); nothing is sent when a record does not encode.
    pub async fn send_batch<T, K, V>(
        &self,
        stream: &StreamDef<T>,
        records: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Vec<Sent>, ProducerError>
    where
        T: Serialize,
        K: AsRef<str>,
        V: Borrow<T>,
    {
        let msgs = records
            .into_iter()
            .map(|(k, v)| self.message(stream, k.as_ref(), v.borrow()))
            .collect::<Result<Vec<_>, _>>()?;
        self.provision(stream).await?;
        self.publish(msgs, matches!(stream.kind(), StreamKind::Ordered { .. })).await
    }

    /// As [`send_batch`](Self::send_batch), with an id per record: `(id, key, value)`.
    /// A batch that failed can be sent again as it was, and the server stores none of
    /// its records twice within its duplicate window (2 minutes).
    ///
    /// # Errors
    /// As [`send_batch`](Self::send_batch); an id that cannot travel in a header.
    pub async fn send_batch_with_ids<T, I, K, V>(
        &self,
        stream: &StreamDef<T>,
        records: impl IntoIterator<Item = (I, K, V)>,
    ) -> Result<Vec<Sent>, ProducerError>
    where
        T: Serialize,
        I: AsRef<str>,
        K: AsRef<str>,
        V: Borrow<T>,
    {
        let msgs = records
            .into_iter()
            .map(|(id, k, v)| self.with_id(self.message(stream, k.as_ref(), v.borrow())?, id.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        self.provision(stream).await?;
        self.publish(msgs, matches!(stream.kind(), StreamKind::Ordered { .. })).await
    }

    /// Publishes messages built elsewhere (for example by [`message`](Self::message),
    /// or raw ones by the `publish` command), pipelined, with the producer's retries.
    /// Their streams must exist. `ordered` says whether their subjects end in a
    /// partition (it fills [`Sent::partition`]).
    ///
    /// # Errors
    /// [`ProducerError::Broker`].
    pub async fn send_messages(&self, msgs: Vec<OutboundMessage>, ordered: bool) -> Result<Vec<Sent>, ProducerError> {
        self.publish(msgs, ordered).await
    }

    /// Sends `value` so that it reaches `stream` after `delay`. It waits in the job's
    /// timer stream, durably, and a node of the job publishes it when due (so the job
    /// must be running then).
    ///
    /// # Errors
    /// As [`send`](Self::send); [`ProducerError::Delay`] past 365 days.
    pub async fn send_after<T: Serialize>(
        &self,
        stream: &StreamDef<T>,
        key: &str,
        value: impl Borrow<T>,
        delay: Duration,
    ) -> Result<Sent, ProducerError> {
        if delay > MAX_DELAY {
            return Err(ProducerError::Delay(delay));
        }
        let msg = self.message(stream, key, value.borrow())?;
        let id = msg.headers.msg_id().unwrap_or_default().to_owned();
        let partition = partition_of(&msg.subject, stream);
        let mut timer = OutboundMessage::new(self.subjects.timer(&id), msg.payload);
        timer.headers = msg.headers;
        timer.headers.insert(headers::MSG_ID, format!("timer-{id}"));
        timer.headers.insert(headers::DELAY, delay.as_millis().to_string());
        timer.headers.insert(headers::TARGET, msg.subject.clone());
        self.provision(stream).await?;
        self.ensure(topology::timer_stream(&self.subjects)).await?;
        let mut sent = self.publish(vec![timer], false).await?;
        let mut sent = sent.remove(0);
        (sent.id, sent.subject, sent.partition) = (id, msg.subject, partition);
        Ok(sent)
    }

    /// As [`send_after`](Self::send_after), due at `at` (at once when `at` has passed).
    ///
    /// # Errors
    /// As [`send_after`](Self::send_after).
    pub async fn send_at<T: Serialize>(
        &self,
        stream: &StreamDef<T>,
        key: &str,
        value: impl Borrow<T>,
        at: SystemTime,
    ) -> Result<Sent, ProducerError> {
        let delay = at.duration_since(self.broker.system_now()).unwrap_or_default();
        self.send_after(stream, key, value, delay).await
    }

    /// The message [`send`](Self::send) would publish, with a new id.
    ///
    /// # Errors
    /// A bad key or a value that does not encode.
    pub fn message<T: Serialize>(
        &self,
        stream: &StreamDef<T>,
        key: &str,
        value: &T,
    ) -> Result<OutboundMessage, ProducerError> {
        if let Some(problem) = headers::entry_problem(headers::KEY, key) {
            return Err(ProducerError::Key { key: key.to_owned(), problem });
        }
        let payload =
            self.codec.encode(value).map_err(|source| ProducerError::Encode { key: key.to_owned(), source })?;
        let name = StreamName::new(stream.name())?;
        let subject = match stream.kind() {
            StreamKind::Ordered { partitions } => {
                self.subjects.ordered_partition(&name, flotilla_transport::wire::partition_for(key, partitions))
            }
            StreamKind::Queue => self.subjects.queue(&name),
        };
        Ok(OutboundMessage::new(subject, payload)
            .with_id(MessageId::new_v7().as_str())
            .with_header(headers::KEY, key)
            .with_header(headers::TYPE, stream.type_name())
            .with_header(headers::SENT, unix_millis(SystemTime::now()).to_string()))
    }

    fn with_id(&self, mut msg: OutboundMessage, id: &str) -> Result<OutboundMessage, ProducerError> {
        if let Some(problem) = headers::entry_problem(headers::MSG_ID, id) {
            return Err(ProducerError::Id { id: id.to_owned(), problem });
        }
        msg.headers.insert(headers::MSG_ID, id.to_owned());
        Ok(msg)
    }

    /// Creates `stream` as the job would, once per producer.
    async fn provision<T>(&self, stream: &StreamDef<T>) -> Result<(), ProducerError> {
        let name = StreamName::new(stream.name())?;
        let spec = match stream.kind() {
            StreamKind::Ordered { partitions } => topology::ordered_stream(&self.subjects, &name, partitions, None),
            StreamKind::Queue => topology::queue_stream(&self.subjects, &name),
        };
        self.ensure(spec).await
    }

    async fn ensure(&self, spec: StreamSpec) -> Result<(), ProducerError> {
        if self.provisioned.lock().is_ok_and(|p| p.contains(&spec.name)) {
            return Ok(());
        }
        let name = spec.name.clone();
        let started = Instant::now();
        let mut tries = 0;
        loop {
            match self.broker.ensure_stream(spec.clone().with_replicas(self.replicas)).await {
                Ok(_) => break,
                Err(e) if e.is_transient() && started.elapsed() < self.patience => {
                    tries += 1;
                    tokio::time::sleep(flotilla_transport::jetstream::reconnect_delay(tries)).await;
                }
                Err(source) => return Err(ProducerError::Provision { stream: name, source }),
            }
        }
        if let Ok(mut p) = self.provisioned.lock() {
            p.insert(name);
        }
        Ok(())
    }

    /// Publishes `msgs` in pipelined batches, retrying those that failed for a passing
    /// reason with the same ids until the producer's patience runs out. The subjects of
    /// an `ordered` stream end in their partition.
    async fn publish(&self, msgs: Vec<OutboundMessage>, ordered: bool) -> Result<Vec<Sent>, ProducerError> {
        let total = msgs.len();
        let mut sent: Vec<Option<Sent>> = vec![None; total];
        let started = Instant::now();
        let mut tries = 0;
        let mut todo: Vec<usize> = (0..total).collect();
        loop {
            let mut failed = Vec::new();
            let mut last: Option<BrokerError> = None;
            for chunk in todo.chunks(BATCH) {
                let batch: Vec<OutboundMessage> = chunk.iter().map(|&i| msgs[i].clone()).collect();
                for (&i, ack) in chunk.iter().zip(self.broker.publish_batch(batch).await) {
                    match ack {
                        Ok(ack) => {
                            let msg = &msgs[i];
                            sent[i] = Some(Sent {
                                id: msg.headers.msg_id().unwrap_or_default().to_owned(),
                                subject: msg.subject.clone(),
                                partition: ordered
                                    .then(|| msg.subject.rsplit_once('.').and_then(|(_, p)| p.parse().ok()))
                                    .flatten(),
                                seq: ack.seq,
                                duplicate: ack.duplicate,
                            });
                        }
                        Err(e) => {
                            failed.push(i);
                            // A refusal is reported over a passing failure.
                            if last.as_ref().is_none_or(|l| l.is_transient()) {
                                last = Some(e);
                            }
                        }
                    }
                }
            }
            let Some(error) = last else {
                return Ok(sent.into_iter().flatten().collect());
            };
            if !error.is_transient() || started.elapsed() >= self.patience {
                let stored = sent.iter().flatten().count();
                return Err(ProducerError::Broker { stored, total, source: error });
            }
            tries += 1;
            let wait = flotilla_transport::jetstream::reconnect_delay(tries);
            tracing::warn!(error = %error, records = failed.len(), retry_in = ?wait, "publish failed; retrying with the same ids");
            tokio::time::sleep(wait).await;
            todo = failed;
        }
    }
}

fn partition_of<T>(subject: &str, stream: &StreamDef<T>) -> Option<u32> {
    match stream.kind() {
        StreamKind::Ordered { .. } => subject.rsplit_once('.').and_then(|(_, p)| p.parse().ok()),
        StreamKind::Queue => None,
    }
}
