use actix::prelude::*;
use flotilla_transport::broker::{BrokerError, Delivery};

/// Move a message to the job's dead-letter stream, with the reason.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), BrokerError>")]
pub struct DeadLetter {
    /// The message as delivered.
    pub delivery: Delivery,
    /// The input stream's name.
    pub stream: String,
    /// Its partition (ordered inputs).
    pub partition: Option<u32>,
    /// The reason code (`malformed`, `max-attempts`, …).
    pub reason: &'static str,
    /// Details for a human.
    pub detail: String,
}

/// Sweep a queue input for messages stranded at max deliveries.
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<usize, BrokerError>")]
pub struct Sweep {
    /// The input stream's name.
    pub stream: String,
    /// The JetStream stream.
    pub js_stream: String,
    /// Its consumer.
    pub consumer: String,
}

/// Acquire an expired (absent) partition lease: create it, then take the partition's
/// consumer over at the committed position. Returns the lease revision (the epoch), or
/// `None` when another node got it first.
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<Option<u64>, BrokerError>")]
pub struct AcquireLease {
    /// The lease bucket.
    pub bucket: String,
    /// The lease key.
    pub key: String,
    /// The lease value.
    pub value: bytes::Bytes,
    /// The partition's JetStream stream.
    pub js_stream: String,
    /// The partition's consumer, recreated at the committed position when a previous
    /// owner left deliveries behind.
    pub consumer: Option<flotilla_transport::broker::ConsumerSpec>,
}

/// Remove what departed nodes left behind in the control bucket (`stop.<node>` keys).
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<usize, BrokerError>")]
pub struct Tidy {
    /// The control bucket.
    pub control: String,
    /// The live nodes.
    pub live: std::collections::BTreeSet<String>,
}
