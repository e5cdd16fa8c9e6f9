//! Messages set aside for parked keys of queue inputs (`park --key`): reading them from
//! the job's PARKED stream and sending them back to their queue, oldest first. Used by
//! `unpark` and `step --key`, and by a worker that parked a message after its key was
//! unparked (a node that saw the unpark late): nobody would sweep that one any more.

use crate::cluster::{self, ParkedRecord, keys};
use crate::events::{Event, emit};
use crate::task::ParkedKeys;
use flotilla_transport::broker::{BrokerError, OutboundMessage, SharedBroker, StoredMessage};
use flotilla_transport::wire::{StreamName, Subjects, headers};
use tracing::debug;

/// How often a worker tries to send back what it parked after an unpark.
const SEND_BACK_TRIES: u32 = 5;

/// Whether `key` of queue input `stream` is parked in the job's desired state (the
/// CONTROL bucket), read now.
///
/// # Errors
/// The broker's, when the record cannot be read.
pub async fn is_parked(
    broker: &SharedBroker,
    subjects: &Subjects,
    stream: &str,
    key: &str,
) -> Result<bool, BrokerError> {
    let bucket = subjects.bucket_name(cluster::CONTROL);
    let record: ParkedRecord = match broker.kv_get(&bucket, keys::PARKED).await {
        Ok(Some(e)) => cluster::decode(keys::PARKED, &e.value).unwrap_or_default(),
        Ok(None) | Err(BrokerError::BucketNotFound { .. }) => ParkedRecord::default(),
        Err(e) => return Err(e),
    };
    Ok(record.keys.get(stream).is_some_and(|k| k.contains(key)))
}

/// The messages set aside for `key` of `stream`: (sequence in the queue stream, the
/// stored parked message), oldest first.
///
/// # Errors
/// The broker's, when the PARKED stream cannot be read.
pub async fn set_aside(
    broker: &SharedBroker,
    subjects: &Subjects,
    stream: &StreamName,
    key: &str,
) -> Result<Vec<(u64, StoredMessage)>, BrokerError> {
    let parked_stream = subjects.parked_stream_name();
    let subject = subjects.parked(stream);
    let state = match broker.stream_state(&parked_stream).await {
        Ok(s) => s,
        Err(BrokerError::StreamNotFound { .. }) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    if state.messages == 0 {
        return Ok(out);
    }
    for seq in state.first_seq.max(1)..=state.last_seq {
        let Some(m) = broker.get_message(&parked_stream, seq).await? else { continue };
        if m.subject == subject && m.headers.get(headers::KEY) == Some(key) {
            let from = m.headers.get(headers::PARKED_SEQ).and_then(|s| s.parse().ok()).unwrap_or(u64::MAX);
            out.push((from, m));
        }
    }
    out.sort_by_key(|(from, m)| (*from, m.seq));
    Ok(out)
}

/// Sends up to `limit` messages set aside for `key` of `stream` back to the queue, oldest
/// first, let through (`Flotilla-Step`) although the key may still be parked; returns
/// how many. Two senders at once send each message once (one id per queue message set
/// aside, within the duplicate window).
///
/// # Errors
/// The broker's; what was sent back before stays sent.
pub async fn send_back(
    broker: &SharedBroker,
    subjects: &Subjects,
    stream: &StreamName,
    key: &str,
    limit: usize,
) -> Result<usize, BrokerError> {
    let parked_stream = subjects.parked_stream_name();
    let job = subjects.job().as_str();
    let mut moved = 0;
    let mut last_from = None;
    for (from, m) in set_aside(broker, subjects, stream, key).await? {
        // The same queue message parked twice (its first term was lost): send it once.
        if last_from == Some(from) {
            broker.delete_message(&parked_stream, m.seq).await?;
            continue;
        }
        if moved == limit {
            break;
        }
        last_from = Some(from);
        let mut out = OutboundMessage::new(subjects.queue(stream), m.payload.clone());
        for (k, v) in m.headers.iter() {
            if k != headers::PARKED_SEQ && k != headers::MSG_ID && !headers::is_broker_control(k) {
                out.headers.append(k.to_owned(), v.to_owned());
            }
        }
        // One id per queue message set aside: sending it back again (a delete that
        // failed) within the duplicate window stores it once.
        out.headers.insert(headers::MSG_ID, format!("unparked-{job}-{stream}-{from}"));
        out.headers.insert(headers::STEP, "1");
        broker.publish(out).await?;
        broker.delete_message(&parked_stream, m.seq).await?;
        moved += 1;
    }
    Ok(moved)
}

/// After a worker set a message of `key` aside: if the key is not parked any more (this
/// node saw the unpark late, after `unpark` swept for the last time), sends what is set
/// aside for it back, and says so with a `parked_after_unpark` event, also when it
/// could not (then `unpark` sends it). Reads the desired state itself; this node's view
/// (`parked`) only when that cannot be read.
pub(crate) async fn recheck(
    broker: SharedBroker,
    subjects: Subjects,
    parked: ParkedKeys,
    stream: StreamName,
    key: String,
) {
    let still = match is_parked(&broker, &subjects, stream.as_str(), &key).await {
        Ok(still) => still,
        Err(e) => {
            debug!(%stream, %key, error = %e, "parked keys not read: going by this node's view");
            parked.is_parked(stream.as_str(), &key)
        }
    };
    if still {
        return;
    }
    let mut failures = 0;
    let result = loop {
        match send_back(&broker, &subjects, &stream, &key, usize::MAX).await {
            Err(e) if failures + 1 < SEND_BACK_TRIES => {
                failures += 1;
                tokio::time::sleep(crate::retry::CONTROL_RECORD.wait(failures, crate::retry::sample())).await;
                debug!(%stream, %key, error = %e, "sending back messages parked after an unpark failed; trying again");
            }
            result => break result,
        }
    };
    let (sent_back, error) = match result {
        Ok(0) => return, // `unpark` got there first.
        Ok(n) => (n as u64, None),
        Err(e) => (0, Some(e.to_string())),
    };
    emit(&broker, &subjects, Event::ParkedAfterUnpark { stream: stream.to_string(), key, sent_back, error });
}
