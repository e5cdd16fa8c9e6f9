//! `Reaper`: takes back work nobody will finish.
//!
//! It moves poison and undecodable messages to the dead-letter stream with the reason
//! (the worker then skips or terminates them), and sweeps queue inputs for messages
//! stranded at the consumer's max deliveries — JetStream keeps those in the stream,
//! invisible, forever. In a cluster it acquires partition leases that expired (their
//! holder died), taking the partition's consumer over at the committed position, and
//! removes what departed nodes left in the control bucket.
//!
//! Supervision: started by the job runner on the container's arbiter; every operation
//! is idempotent (dead letters carry `Nats-Msg-Id: dlq-<stream>-<seq>`), so a restart
//! loses nothing.

mod messages;

pub use messages::{AcquireLease, Acquired, DeadLetter, Sweep, Tidy};

use crate::events::{Event, emit};
use actix::prelude::*;
use flotilla_transport::broker::{BrokerError, Delivery, OutboundMessage, SharedBroker};
use flotilla_transport::wire::{StreamName, Subjects, headers};
use tracing::{Instrument, debug};

/// The reaper actor.
#[derive(Debug)]
pub struct Reaper {
    broker: SharedBroker,
    subjects: Subjects,
}

impl Reaper {
    /// A reaper for one job.
    pub fn new(broker: SharedBroker, subjects: Subjects) -> Self {
        Self { broker, subjects }
    }
}

impl Actor for Reaper {
    type Context = Context<Self>;
}

/// Builds the dead letter of a message: original payload and headers, a new id and
/// the reason headers.
fn dead_letter_message(subjects: &Subjects, msg: &DeadLetter) -> Result<OutboundMessage, BrokerError> {
    let stream = StreamName::new(msg.stream.clone())?;
    let mut out = dead_letter_to(subjects.dlq(&stream), &msg.delivery, msg.reason, &msg.detail);
    if let Some(attempts) = msg.attempts {
        out.headers.insert(headers::DLQ_ATTEMPTS, attempts.to_string());
    }
    if let Some(trace) = msg.trace {
        // A replay continues the trace from the dead letter.
        out.headers.insert(headers::TRACEPARENT, trace.header());
    }
    Ok(out)
}

/// The dead letter of delivery `d` on `subject`: its payload and headers (not the
/// broker's own, such as a producer's `Nats-Expected-*`, which JetStream would check
/// against the DLQ and refuse), the id `dlq-<stream>-<seq>` (so moving it twice stores
/// it once) and the reason headers.
pub(crate) fn dead_letter_to(subject: String, d: &Delivery, reason: &str, detail: &str) -> OutboundMessage {
    let mut out = OutboundMessage::new(subject, d.payload.clone());
    out.headers = d.headers.without_broker_controls();
    out.headers.insert(headers::MSG_ID, format!("dlq-{}-{}", d.info.stream, d.info.stream_seq));
    out.headers.insert(headers::DLQ_REASON, reason.to_owned());
    out.headers.insert(headers::DLQ_DETAIL, detail.replace(['\r', '\n'], " "));
    out.headers.insert(headers::DLQ_STREAM, d.info.stream.to_string());
    out.headers.insert(headers::DLQ_SUBJECT, &*d.subject);
    out.headers.insert(headers::DLQ_SEQ, d.info.stream_seq.to_string());
    out.headers.insert(headers::DLQ_DELIVERIES, d.info.delivered.to_string());
    out
}

impl Handler<DeadLetter> for Reaper {
    type Result = ResponseFuture<Result<(), BrokerError>>;

    fn handle(&mut self, msg: DeadLetter, _: &mut Context<Self>) -> Self::Result {
        let broker = self.broker.clone();
        let subjects = self.subjects.clone();
        // A child of the attempt's span, across the worker and this actor.
        let span = tracing::debug_span!(
            parent: None,
            "dead_letter",
            stream = %msg.stream,
            partition = msg.partition,
            seq = msg.delivery.info.stream_seq,
            reason = msg.reason,
            trace_id = tracing::field::Empty,
            span_id = tracing::field::Empty,
            parent_id = tracing::field::Empty,
        );
        let mut msg = msg;
        msg.trace = crate::trace::open(&span, msg.trace, false);
        Box::pin(
            async move {
                let out = dead_letter_message(&subjects, &msg)?;
                broker.publish(out).await?;
                emit(
                    &broker,
                    &subjects,
                    Event::DeadLettered {
                        stream: msg.stream,
                        partition: msg.partition,
                        seq: msg.delivery.info.stream_seq,
                        reason: msg.reason.to_owned(),
                        detail: msg.detail,
                    },
                );
                Ok(())
            }
            .instrument(span),
        )
    }
}

impl Handler<Sweep> for Reaper {
    type Result = ResponseFuture<Result<usize, BrokerError>>;

    fn handle(&mut self, msg: Sweep, _: &mut Context<Self>) -> Self::Result {
        let broker = self.broker.clone();
        let subjects = self.subjects.clone();
        Box::pin(async move {
            // The advisories the server sent for messages it gave up on: moved however
            // busy the queue is.
            let mut moved = move_advised(&broker, &subjects, &msg).await?;
            let consumer = broker.consumer_state(&msg.js_stream, &msg.consumer).await?;
            let stream = broker.stream_state(&msg.js_stream).await?;
            // Nothing undelivered and nothing held by anyone, yet messages remain: those
            // at or below the last delivered sequence are stranded at max deliveries
            // (the backstop for an advisory that was never captured).
            if consumer.num_pending > 0 || consumer.num_ack_pending > 0 || stream.messages == 0 {
                return Ok(moved);
            }
            for seq in stream.first_seq..=stream.last_seq.min(consumer.delivered) {
                let delivered = u64::from(consumer.spec.max_deliver.unwrap_or(0));
                if move_stranded(&broker, &subjects, &msg, seq, delivered).await? {
                    moved += 1;
                }
            }
            debug!(stream = %msg.js_stream, moved, "sweep done");
            Ok(moved)
        })
    }
}

/// Moves the messages named by the captured `MAX_DELIVERIES` advisories of `msg`'s
/// queue input to the dead-letter stream, acknowledging each advisory once handled.
async fn move_advised(broker: &SharedBroker, subjects: &Subjects, msg: &Sweep) -> Result<usize, BrokerError> {
    let capture = flotilla_transport::topology::stranded_stream_name(&msg.js_stream);
    let consumer = flotilla_transport::topology::stranded_consumer().name;
    let mut moved = 0;
    loop {
        let advisories = match broker.claim(&capture, &consumer, 100, std::time::Duration::from_millis(50)).await {
            Ok(got) => got,
            // A job provisioned before advisories were captured: the idle sweep only.
            Err(BrokerError::StreamNotFound { .. } | BrokerError::ConsumerNotFound { .. }) => return Ok(moved),
            Err(e) => return Err(e),
        };
        if advisories.is_empty() {
            return Ok(moved);
        }
        for advisory in advisories {
            #[derive(serde::Deserialize)]
            struct MaxDeliveries {
                stream_seq: u64,
                #[serde(default)]
                deliveries: u64,
            }
            match serde_json::from_slice::<MaxDeliveries>(&advisory.payload) {
                Ok(a) => {
                    if move_stranded(broker, subjects, msg, a.stream_seq, a.deliveries).await? {
                        moved += 1;
                    }
                }
                Err(e) => debug!(error = %e, "a max-deliveries advisory that does not parse: dropped"),
            }
            broker.ack(&advisory.token, flotilla_transport::broker::AckKind::Ack).await?;
        }
    }
}

/// Moves the message at `seq` of `msg`'s queue input, stranded at the consumer's max
/// deliveries, to the dead-letter stream (its id makes a repeat a duplicate) and deletes
/// it from the queue. `false` when it is gone already.
async fn move_stranded(
    broker: &SharedBroker,
    subjects: &Subjects,
    msg: &Sweep,
    seq: u64,
    delivered: u64,
) -> Result<bool, BrokerError> {
    let Some(stored) = broker.get_message(&msg.js_stream, seq).await? else { return Ok(false) };
    let delivery = flotilla_transport::broker::Delivery {
        subject: stored.subject.into(),
        headers: stored.headers,
        payload: stored.payload,
        info: flotilla_transport::broker::DeliveryInfo {
            stream: msg.js_stream.as_str().into(),
            consumer: msg.consumer.as_str().into(),
            stream_seq: seq,
            consumer_seq: 0,
            delivered,
            pending: 0,
            published: stored.published,
        },
        token: flotilla_transport::broker::AckToken::none(),
    };
    let letter = DeadLetter {
        delivery,
        stream: msg.stream.clone(),
        partition: None,
        reason: "max-deliveries",
        detail: "stranded in the stream after the consumer's max deliveries".into(),
        attempts: None,
        trace: None,
    };
    broker.publish(dead_letter_message(subjects, &letter)?).await?;
    broker.delete_message(&msg.js_stream, seq).await?;
    emit(
        broker,
        subjects,
        Event::DeadLettered {
            stream: msg.stream.clone(),
            partition: None,
            seq,
            reason: "max-deliveries".into(),
            detail: letter.detail,
        },
    );
    Ok(true)
}

impl Handler<AcquireLease> for Reaper {
    type Result = ResponseFuture<Result<Option<Acquired>, BrokerError>>;

    fn handle(&mut self, msg: AcquireLease, _: &mut Context<Self>) -> Self::Result {
        let broker = self.broker.clone();
        Box::pin(async move {
            let written = match msg.replace {
                None => broker.kv_create(&msg.bucket, &msg.key, msg.value).await,
                Some(previous) => broker.kv_update(&msg.bucket, &msg.key, msg.value, previous).await,
            };
            let revision = match written {
                Ok(rev) => rev,
                Err(BrokerError::KvKeyExists { .. } | BrokerError::KvWrongRevision { .. }) => return Ok(None),
                Err(e) => return Err(e),
            };
            let Some(spec) = msg.consumer else {
                return Ok(Some(Acquired { revision, start: None }));
            };
            match flotilla_transport::topology::take_over_partition(&broker, &msg.js_stream, spec).await {
                Ok(resumed) => Ok(Some(Acquired { revision, start: Some((&resumed).into()) })),
                Err(e) => {
                    // Give the lease back rather than run the partition from wherever its
                    // consumer is now: one re-created by a node provisioning meanwhile
                    // starts at sequence 1, and would process the partition again. The
                    // next acquisition (here or elsewhere) tries the reset again.
                    tracing::warn!(key = %msg.key, error = %e, "could not reset the partition's consumer after acquiring it; giving the lease back");
                    if let Err(d) = broker.kv_delete(&msg.bucket, &msg.key, Some(revision)).await {
                        tracing::warn!(key = %msg.key, error = %d, "could not give the lease back; it expires after its TTL");
                    }
                    Err(e)
                }
            }
        })
    }
}

impl Handler<Tidy> for Reaper {
    type Result = ResponseFuture<Result<usize, BrokerError>>;

    fn handle(&mut self, msg: Tidy, _: &mut Context<Self>) -> Self::Result {
        let broker = self.broker.clone();
        Box::pin(async move {
            let mut removed = 0;
            for key in broker.kv_keys(&msg.control).await? {
                if let Some(node) = key.strip_prefix("stop.")
                    && !msg.live.contains(node)
                {
                    broker.kv_delete(&msg.control, &key, None).await?;
                    removed += 1;
                }
            }
            Ok(removed)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_transport::broker::{ConsumerSpec, KvSpec};
    use flotilla_transport::wire::JobName;

    /// A lease whose partition cannot be reset is given back, not kept: running the
    /// partition from wherever its consumer happens to be could process it again.
    #[actix_rt::test]
    async fn a_lease_whose_reset_fails_is_given_back() {
        let broker = flotilla_transport::EmbeddedBroker::new().shared();
        broker.ensure_kv(KvSpec::new("LEASES", None)).await.expect("bucket");
        let subjects = Subjects::new(JobName::new("j").expect("name"));
        let reaper = Reaper::new(broker.clone(), subjects).start();
        let acquire = |js_stream: &str| AcquireLease {
            bucket: "LEASES".into(),
            key: "in.0".into(),
            value: bytes::Bytes::from_static(b"node-a"),
            replace: None,
            js_stream: js_stream.into(),
            consumer: Some(ConsumerSpec::new("in-p0")),
        };
        // The stream does not exist, so the reset fails.
        let got = reaper.send(acquire("FLOTILLA_j_missing")).await.expect("reaper answers");
        assert!(got.is_err(), "{got:?}");
        assert_eq!(broker.kv_get("LEASES", "in.0").await.expect("read"), None, "the lease was given back");
        // Once the partition can be reset, the lease is taken.
        broker
            .ensure_stream(flotilla_transport::broker::StreamSpec::new(
                "FLOTILLA_j_in",
                vec!["flotilla.j.in.*".into()],
                flotilla_transport::broker::Retention::Limits,
            ))
            .await
            .expect("stream");
        broker.ensure_consumer("FLOTILLA_j_in", ConsumerSpec::new("in-p0")).await.expect("consumer");
        let got = reaper.send(acquire("FLOTILLA_j_in")).await.expect("reaper answers");
        assert!(matches!(got, Ok(Some(_))), "{got:?}");
    }
}
