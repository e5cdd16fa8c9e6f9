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
    /// Attempts the task made (0 when it never ran: malformed, for one); `None` when
    /// nobody knows (a message the server stopped delivering).
    pub attempts: Option<u32>,
    /// The trace of the attempt that gave up (the dead letter continues it).
    pub trace: Option<crate::trace::TraceContext>,
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

/// Acquire a partition lease: create it when absent (expired), or replace it at
/// `replace` (a lease left by a dead incarnation of this node), then take the
/// partition's consumer over at the committed position. Returns what was acquired, or
/// `None` when another node got it first.
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<Option<Acquired>, BrokerError>")]
pub struct AcquireLease {
    /// The lease bucket.
    pub bucket: String,
    /// The lease key.
    pub key: String,
    /// The lease value.
    pub value: bytes::Bytes,
    /// Replace the lease at this revision instead of creating it.
    pub replace: Option<u64>,
    /// The partition's JetStream stream.
    pub js_stream: String,
    /// The partition's consumer, recreated at the committed position when a previous
    /// owner left deliveries behind.
    pub consumer: Option<flotilla_transport::broker::ConsumerSpec>,
}

/// A lease acquired by [`AcquireLease`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acquired {
    /// The lease's revision: the partition's fencing epoch.
    pub revision: u64,
    /// Where the partition resumes (after the take-over), when a consumer was given.
    pub start: Option<crate::task_worker::PartitionStart>,
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
