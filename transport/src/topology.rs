//! The streams, consumers and buckets Flotilla provisions for a job (DESIGN §3).
//!
//! These are plain [`StreamSpec`] / [`ConsumerSpec`] / [`KvSpec`] builders; the broker's
//! `ensure_*` methods create them idempotently and refuse a mismatching existing config.

use crate::broker::{
    AckPolicy, BrokerResult, ConsumerSpec, ConsumerState, KvSpec, Retention, SharedBroker, StreamSpec,
};
use crate::wire::{StreamName, Subjects};
use std::time::Duration;

/// An ordered (partitioned) stream: Limits retention, one subject per partition,
/// `flotilla.<J>.<S>.0` to `flotilla.<J>.<S>.<partitions - 1>`. The server takes
/// nothing else, so a record published to a partition that does not exist is refused
/// at publish time instead of being stored where no consumer reads it.
pub fn ordered_stream(
    subjects: &Subjects,
    stream: &StreamName,
    partitions: u32,
    max_age: Option<Duration>,
) -> StreamSpec {
    let names = (0..partitions.max(1)).map(|p| subjects.ordered_partition(stream, p)).collect();
    let mut spec = StreamSpec::new(subjects.stream_name(stream), names, Retention::Limits);
    spec.max_age = max_age;
    spec
}

/// The durable consumer of one ordered partition: ack-all (commit = checkpoint),
/// unlimited deliveries (order beats poison handling; the worker dead-letters), at
/// most `window` messages in flight.
pub fn partition_consumer(
    subjects: &Subjects,
    stream: &StreamName,
    partition: u32,
    ack_wait: Duration,
    window: u32,
) -> ConsumerSpec {
    ConsumerSpec {
        name: Subjects::partition_consumer(stream, partition),
        filter_subject: Some(subjects.ordered_partition(stream, partition)),
        ack_policy: AckPolicy::All,
        ack_wait,
        max_deliver: None,
        max_ack_pending: Some(window.max(1)),
    }
}

/// A queue input: WorkQueue retention, subject `flotilla.<J>.<S>`.
pub fn queue_stream(subjects: &Subjects, stream: &StreamName) -> StreamSpec {
    StreamSpec::new(subjects.stream_name(stream), vec![subjects.queue(stream)], Retention::WorkQueue)
}

/// The shared consumer of a queue input: explicit acks. `max_deliver` is the backstop
/// past the retry policy's attempts (the worker dead-letters first).
pub fn queue_consumer(stream: &StreamName, ack_wait: Duration, max_deliver: u32, max_ack_pending: u32) -> ConsumerSpec {
    ConsumerSpec {
        name: Subjects::queue_consumer(stream),
        filter_subject: None,
        ack_policy: AckPolicy::Explicit,
        ack_wait,
        max_deliver: Some(max_deliver.max(1)),
        max_ack_pending: Some(max_ack_pending.max(1)),
    }
}

/// The job's dead-letter stream: Limits retention, `flotilla.<J>._dlq.>`.
pub fn dlq_stream(subjects: &Subjects) -> StreamSpec {
    StreamSpec::new(subjects.dlq_stream_name(), vec![subjects.dlq_all()], Retention::Limits)
}

/// The stream that keeps the `MAX_DELIVERIES` advisories of queue input `stream` (its
/// JetStream stream `js_stream`): each names a message stranded at the consumer's
/// `max_deliver`, which the reaper moves to the dead-letter stream however busy the
/// queue is. WorkQueue retention; kept a week at most.
pub fn stranded_stream(js_stream: &str, stream: &StreamName) -> StreamSpec {
    let subject =
        format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{js_stream}.{}", Subjects::queue_consumer(stream));
    let mut spec = StreamSpec::new(stranded_stream_name(js_stream), vec![subject], Retention::WorkQueue);
    spec.max_age = Some(Duration::from_secs(7 * 24 * 3600));
    spec
}

/// The name of [`stranded_stream`]: the queue input's JetStream stream with `_STRANDED`.
pub fn stranded_stream_name(js_stream: &str) -> String {
    format!("{js_stream}_STRANDED")
}

/// The reapers' consumer of a [`stranded_stream`].
pub fn stranded_consumer() -> ConsumerSpec {
    ConsumerSpec {
        name: "reapers".into(),
        filter_subject: None,
        ack_policy: AckPolicy::Explicit,
        ack_wait: Duration::from_secs(30),
        max_deliver: None,
        max_ack_pending: None,
    }
}

/// The job's parked messages (queue inputs, `park --key`): Limits retention,
/// `flotilla.<J>._parked.>`.
pub fn parked_stream(subjects: &Subjects) -> StreamSpec {
    StreamSpec::new(subjects.parked_stream_name(), vec![subjects.parked_all()], Retention::Limits)
}

/// The job's timer stream: one subject per timer, one message per subject, so
/// re-arming a timer replaces it.
pub fn timer_stream(subjects: &Subjects) -> StreamSpec {
    let mut spec = StreamSpec::new(subjects.timer_stream_name(), vec![subjects.timer_all()], Retention::WorkQueue);
    spec.max_msgs_per_subject = Some(1);
    spec
}

/// The timer consumer: nak-delayed timers hold ack-pending slots, so no cap. Its
/// ack-wait is short: a nak's delay does not survive a restart of the server, and a
/// timer waiting then comes back after the ack-wait (so at most 5 s late).
pub fn timer_consumer() -> ConsumerSpec {
    ConsumerSpec {
        name: "timers".into(),
        filter_subject: None,
        ack_policy: AckPolicy::Explicit,
        ack_wait: Duration::from_secs(5),
        max_deliver: None,
        max_ack_pending: None,
    }
}

/// A KV bucket of the job (`NODES`, `LEASES`, `STATE`), with server-side expiry.
pub fn bucket(subjects: &Subjects, name: &str, ttl: Option<Duration>) -> KvSpec {
    KvSpec::new(subjects.bucket_name(name), ttl)
}

/// Provisions an ordered input: its stream (with `replicas` copies) and one consumer
/// per partition.
///
/// # Errors
/// Whatever `ensure_stream` / `ensure_consumer` return, e.g. a config mismatch.
pub async fn provision_ordered(
    broker: &SharedBroker,
    subjects: &Subjects,
    stream: &StreamName,
    partitions: u32,
    ack_wait: Duration,
    window: u32,
    replicas: usize,
) -> BrokerResult<()> {
    let spec = ordered_stream(subjects, stream, partitions, None).with_replicas(replicas);
    let name = spec.name.clone();
    broker.ensure_stream(spec).await?;
    for p in 0..partitions {
        broker.ensure_consumer(&name, partition_consumer(subjects, stream, p, ack_wait, window)).await?;
    }
    Ok(())
}

/// Where an ordered partition resumes after [`take_over_partition`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resumption {
    /// The consumer as taken over (after the reset, if one was needed). Its
    /// `delivered_consumer_seq` is the delivery the new owner's first one must follow
    /// (0 after a reset).
    pub state: ConsumerState,
    /// When the previous owner left deliveries unfinished (it died, failed, hung or
    /// lost them): the stream sequence of the last one delivered to it. One of the
    /// messages up to there may be what ended it.
    pub orphaned_up_to: Option<u64>,
}

/// Takes over an ordered partition: when its consumer delivered beyond the committed
/// position (a previous owner died, handed over what it had claimed but not started,
/// or a delivery was lost in transit), recreates it at the committed position so
/// processing resumes at once, in order, and as first deliveries.
///
/// # Errors
/// Whatever the broker returns. A caller must not consume the partition after an
/// error: its consumer may still hold another owner's deliveries, and an ack-all would
/// cover them.
pub async fn take_over_partition(
    broker: &SharedBroker,
    js_stream: &str,
    spec: ConsumerSpec,
) -> BrokerResult<Resumption> {
    let state = match broker.consumer_state(js_stream, &spec.name).await {
        Ok(state) => state,
        // A reset interrupted between deleting the consumer and creating it again (its
        // node died, or the create timed out while the cluster elected a leader) leaves
        // no consumer, and with it no committed position. Nothing may be skipped: start
        // again from the stream's start. Outputs replayed within the duplicate window
        // are dropped by their derived ids; older ones are processed again.
        Err(crate::broker::BrokerError::ConsumerNotFound { .. }) => {
            tracing::warn!(
                stream = js_stream,
                consumer = %spec.name,
                "the partition's consumer is gone (a reset was interrupted): recreating it from the stream's start, so records after the lost committed position are processed again, none skipped"
            );
            let state = broker.ensure_consumer(js_stream, spec).await?;
            return Ok(Resumption { state, orphaned_up_to: None });
        }
        Err(e) => return Err(e),
    };
    if state.num_ack_pending == 0 && state.delivered <= state.ack_floor {
        return Ok(Resumption { state, orphaned_up_to: None });
    }
    tracing::info!(
        stream = js_stream,
        consumer = %spec.name,
        orphaned = state.num_ack_pending,
        resume_at = state.ack_floor + 1,
        "taking over a partition with unacked deliveries: resuming at the committed position"
    );
    let orphaned_up_to = Some(state.delivered);
    let state = broker.reset_consumer(js_stream, spec, state.ack_floor + 1).await?;
    Ok(Resumption { state, orphaned_up_to })
}

/// Provisions a queue input: its stream (with `replicas` copies) and its shared
/// consumer.
///
/// # Errors
/// Whatever `ensure_stream` / `ensure_consumer` return, e.g. a config mismatch.
pub async fn provision_queue(
    broker: &SharedBroker,
    subjects: &Subjects,
    stream: &StreamName,
    ack_wait: Duration,
    max_deliver: u32,
    max_ack_pending: u32,
    replicas: usize,
) -> BrokerResult<()> {
    let spec = queue_stream(subjects, stream).with_replicas(replicas);
    let name = spec.name.clone();
    broker.ensure_stream(spec).await?;
    broker.ensure_consumer(&name, queue_consumer(stream, ack_wait, max_deliver, max_ack_pending)).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::Discard;
    use crate::wire::JobName;

    #[test]
    fn specs_follow_the_jetstream_mapping() {
        let s = Subjects::new(JobName::new("relay").expect("job"));
        let input = StreamName::new("relay-in").expect("stream");
        let st = ordered_stream(&s, &input, 3, None);
        assert_eq!(st.name, "FLOTILLA_relay_relay-in");
        assert_eq!(
            st.subjects,
            ["flotilla.relay.relay-in.0", "flotilla.relay.relay-in.1", "flotilla.relay.relay-in.2"]
        );
        assert_eq!(st.retention, Retention::Limits);
        let c = partition_consumer(&s, &input, 2, Duration::from_secs(30), 256);
        assert_eq!(c.ack_policy, AckPolicy::All);
        assert_eq!(c.filter_subject.as_deref(), Some("flotilla.relay.relay-in.2"));
        assert_eq!(c.max_ack_pending, Some(256));
        let q = queue_stream(&s, &input);
        assert_eq!(q.retention, Retention::WorkQueue);
        assert_eq!(q.subjects, vec!["flotilla.relay.relay-in".to_string()]);
        assert_eq!(queue_consumer(&input, Duration::from_secs(30), 5, 64).ack_policy, AckPolicy::Explicit);
        assert_eq!(timer_stream(&s).max_msgs_per_subject, Some(1));
        assert_eq!(dlq_stream(&s).subjects, vec!["flotilla.relay._dlq.>".to_string()]);
        assert_eq!(timer_stream(&s).discard, Discard::Old);
    }
}
