//! The test record, and reading back what a stream holds.

use flotilla_transport::broker::{AckPolicy, ConsumerSpec, Delivery, SharedBroker};
use flotilla_transport::wire::MessageId;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The record the tests send through their jobs: the shape `examples/relay.rs`
/// declares, so the tests and the example read each other's messages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// The record's number: its key and its message id (`in-{id}`).
    pub id: u64,
    /// Its body; some bodies are instructions to the relay (`poison`, `sleep:MS`, …).
    pub body: String,
}

/// Every message `js_stream` holds, read through a fresh consumer (only the subjects
/// `filter` matches, when given) that claims up to 1000 at a time, each claim waiting up
/// to `wait`, until a claim comes back empty. The consumer is deleted afterwards.
///
/// # Panics
/// When the consumer cannot be created or deleted, or a claim fails.
pub async fn read_messages(b: &SharedBroker, js_stream: &str, filter: Option<String>, wait: Duration) -> Vec<Delivery> {
    let name = format!("reader-{}", MessageId::new_v7().as_str().replace('-', ""));
    let spec = ConsumerSpec {
        filter_subject: filter,
        ack_policy: AckPolicy::Explicit,
        max_ack_pending: None,
        ..ConsumerSpec::new(name.clone())
    };
    b.ensure_consumer(js_stream, spec).await.expect("reader");
    let mut out = Vec::new();
    loop {
        let got = b.claim(js_stream, &name, 1000, wait).await.expect("claim");
        if got.is_empty() {
            break;
        }
        out.extend(got);
    }
    b.delete_consumer(js_stream, &name).await.expect("delete reader");
    out
}
