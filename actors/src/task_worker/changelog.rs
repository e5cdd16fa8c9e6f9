//! A partition's changelog I/O: restore (read every key, claim the partition) and
//! persist (write a flush's records, then its commit record). The rules (encoding, which
//! value a key resolves to, what a claim keeps) are plain data in [`crate::store`].

use crate::store::{self, Change, CommitRecord, Record, Resolution};
use bytes::Bytes;
use flotilla_transport::broker::{BrokerError, OutboundMessage, SharedBroker};
use flotilla_transport::wire::Subjects;
use futures::StreamExt;
use std::sync::Arc;

/// Where a partition's changelog is, and where its writer stands.
#[derive(Debug, Clone)]
pub(crate) struct Changelog {
    /// The KV bucket.
    pub bucket: String,
    /// `<input>.<partition>`: every key of the partition starts with it.
    pub prefix: String,
    /// The last commit record this writer stored (its claim at first).
    pub commit: CommitRecord,
    /// That record's revision.
    pub commit_revision: u64,
}

impl Changelog {
    fn subject(&self, key: &str) -> String {
        Subjects::kv_subject(&self.bucket, key)
    }
}

/// One restored key.
pub(crate) struct RestoredKey {
    pub store: String,
    pub key_hex: String,
    pub value: Option<Bytes>,
    pub revision: u64,
}

/// What a restore read and claimed.
pub(crate) struct Restored {
    pub changelog: Changelog,
    pub keys: Vec<RestoredKey>,
    /// Keys whose latest record's flush never completed.
    pub incomplete: u64,
}

/// Why a restore or a persist did not succeed.
#[derive(Debug)]
pub(crate) enum StateError {
    /// The broker failed; trying again may work.
    Broker(BrokerError),
    /// Someone else wrote the partition's changelog meanwhile (a newer owner, or a
    /// stale one): read it again.
    Conflict(String),
    /// The changelog holds something this node cannot read.
    Corrupt(String),
}

impl std::fmt::Display for StateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StateError::Broker(e) => write!(f, "{e}"),
            StateError::Conflict(what) | StateError::Corrupt(what) => f.write_str(what),
        }
    }
}

impl From<BrokerError> for StateError {
    fn from(e: BrokerError) -> Self {
        StateError::Broker(e)
    }
}

/// Reads the partition's changelog (every key under `prefix`), resolves each key, and
/// claims the partition with a new generation (compare-and-set on the commit key).
pub(crate) async fn restore(
    broker: SharedBroker,
    bucket: String,
    prefix: String,
    epoch: u64,
) -> Result<Restored, StateError> {
    let mut scan = broker.kv_scan(&bucket, &format!("{prefix}.>")).await?;
    let commit_key = store::commit_key(&prefix);
    let mut commit = CommitRecord::default();
    let mut commit_revision = 0;
    // A key written again while the scan runs may come twice: the later one counts.
    let mut latest = std::collections::BTreeMap::new();
    let started = std::time::Instant::now();
    let mut read = 0u64;
    while let Some(entry) = scan.next().await {
        let entry = entry?;
        latest.insert(entry.key.clone(), entry);
        read += 1;
        if read.is_multiple_of(100_000) {
            tracing::info!(partition = %prefix, keys = read, elapsed = ?started.elapsed(), "restoring state: keys read so far");
        }
    }
    let mut records = Vec::new();
    for (_, entry) in latest {
        if entry.key == commit_key {
            commit = serde_json::from_slice(&entry.value).map_err(|e| {
                StateError::Corrupt(format!(
                    "commit record {commit_key} (revision {}) does not decode: {e}",
                    entry.revision
                ))
            })?;
            commit_revision = entry.revision;
            continue;
        }
        let rest = entry.key.strip_prefix(&prefix).and_then(|r| r.strip_prefix('.')).unwrap_or_default();
        let Some((store, key_hex)) = rest.split_once('.') else {
            return Err(StateError::Corrupt(format!("changelog key {} is not <store>.<key>", entry.key)));
        };
        if entry.value.is_empty() {
            // Deleted or purged by hand: the key is absent.
            records.push((store.to_owned(), key_hex.to_owned(), None, entry.revision));
            continue;
        }
        let record = Record::decode(&entry.value).map_err(|e| {
            StateError::Corrupt(format!("changelog record {} (revision {}): {e}", entry.key, entry.revision))
        })?;
        records.push((store.to_owned(), key_hex.to_owned(), Some(record), entry.revision));
    }
    let mut keys = Vec::with_capacity(records.len());
    let mut referenced = Vec::new();
    let mut incomplete = 0;
    for (store, key_hex, record, revision) in records {
        let value = match record {
            None => None,
            Some(record) => match store::resolve(&commit, &record) {
                Resolution::Written(v) => {
                    if !referenced.contains(&record.generation) {
                        referenced.push(record.generation);
                    }
                    v
                }
                Resolution::Committed(v) => {
                    incomplete += 1;
                    v
                }
            },
        };
        keys.push(RestoredKey { store, key_hex, value, revision });
    }
    let claim = store::claim(&commit, referenced, epoch);
    let payload = Bytes::from(serde_json::to_vec(&claim).map_err(|e| StateError::Corrupt(e.to_string()))?);
    let changelog = Changelog { bucket, prefix, commit: claim, commit_revision };
    let mut msg = OutboundMessage::new(changelog.subject(&commit_key), payload);
    msg.expected_last_subject_seq = Some(commit_revision);
    let ack = match broker.publish(msg).await {
        Ok(ack) => ack,
        Err(BrokerError::WrongLastSequence { actual, .. }) => {
            return Err(StateError::Conflict(format!(
                "the commit record changed while it was read (revision {commit_revision}, now {actual})"
            )));
        }
        Err(e) => return Err(e.into()),
    };
    Ok(Restored { changelog: Changelog { commit_revision: ack.seq, ..changelog }, keys, incomplete })
}

/// A flush on its way: each changed key's record, then the commit record.
pub(crate) struct Flush {
    /// (store, key hex, record message).
    pub records: Vec<(&'static str, String, OutboundMessage)>,
    pub commit: CommitRecord,
    pub commit_msg: OutboundMessage,
}

/// The hooks that ran at the position, for [`build_flush`].
pub(crate) type HooksAt = u32;

/// Builds the flush of `changes` as the next of `changelog`'s writer, reflecting inputs
/// up to `position`.
pub(crate) fn build_flush(
    changelog: &Changelog,
    changes: Vec<Change>,
    position: u64,
    hooks: HooksAt,
    epoch: u64,
) -> Result<Flush, String> {
    let generation = changelog.commit.generation;
    let flush = changelog.commit.flush + 1;
    let records = changes
        .into_iter()
        .map(|c| {
            let record = Record { generation, flush, value: c.value, committed: c.committed };
            let key = store::record_key(&changelog.prefix, c.store, &c.key_hex);
            let mut msg = OutboundMessage::new(changelog.subject(&key), record.encode());
            msg.expected_last_subject_seq = Some(c.expected_revision);
            (c.store, c.key_hex, msg)
        })
        .collect();
    let commit = CommitRecord { generation, flush, position, hooks, epoch, earlier: changelog.commit.earlier.clone() };
    let payload = serde_json::to_vec(&commit).map_err(|e| e.to_string())?;
    let mut commit_msg =
        OutboundMessage::new(changelog.subject(&store::commit_key(&changelog.prefix)), Bytes::from(payload));
    commit_msg.expected_last_subject_seq = Some(changelog.commit_revision);
    Ok(Flush { records, commit, commit_msg })
}

/// What a stored flush gives back: each record's revision, and the commit record's.
pub(crate) struct Persisted {
    pub revisions: Vec<(&'static str, String, u64)>,
    pub commit_revision: u64,
}

/// Writes `flush`: every record (pipelined), then, once all are stored, the commit
/// record. Safe to call again with the same flush after a failure: a record or commit
/// record already stored (its compare-and-set fails) counts as stored when the key
/// holds exactly its bytes.
pub(crate) async fn persist(broker: SharedBroker, bucket: String, flush: Arc<Flush>) -> Result<Persisted, StateError> {
    let msgs: Vec<OutboundMessage> = flush.records.iter().map(|(_, _, m)| m.clone()).collect();
    let results = if msgs.is_empty() { Vec::new() } else { broker.publish_batch(msgs).await };
    let mut revisions = Vec::with_capacity(results.len());
    for ((store, key_hex, msg), result) in flush.records.iter().zip(results) {
        let revision = stored_revision(&broker, &bucket, msg, result).await?;
        revisions.push((*store, key_hex.clone(), revision));
    }
    crate::failpoint::hit(crate::failpoint::Point::StateRecordsStored);
    let result = broker.publish(flush.commit_msg.clone()).await;
    let commit_revision = stored_revision(&broker, &bucket, &flush.commit_msg, result).await?;
    Ok(Persisted { revisions, commit_revision })
}

/// The revision `msg` was stored at, also when an earlier try stored it (its
/// compare-and-set then fails, and the key holds its bytes).
async fn stored_revision(
    broker: &SharedBroker,
    bucket: &str,
    msg: &OutboundMessage,
    result: Result<flotilla_transport::broker::PublishAck, BrokerError>,
) -> Result<u64, StateError> {
    match result {
        Ok(ack) => Ok(ack.seq),
        Err(BrokerError::WrongLastSequence { subject, expected, actual }) => {
            let key = Subjects::kv_key(bucket, &subject).unwrap_or(&subject).to_owned();
            match broker.kv_get(bucket, &key).await? {
                // A record or commit record is unique (its writer's generation and flush
                // are in it): the key holding its bytes means an earlier try stored it.
                // (The JetStream publisher does not report the actual revision.)
                Some(entry) if entry.value == msg.payload => Ok(entry.revision),
                _ => Err(StateError::Conflict(format!(
                    "changelog key {key} was written by someone else (expected revision {expected}{})",
                    if actual > 0 { format!(", found {actual}") } else { String::new() }
                ))),
            }
        }
        Err(e) => Err(e.into()),
    }
}
