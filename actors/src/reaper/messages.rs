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
