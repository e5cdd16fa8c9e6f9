//! The KV buckets: opening them, their reads and writes, key listings, watches and scans.

use super::Inner;
use super::errors::{api_error, js_code, stream_missing};
use crate::broker::{BoxStream, BrokerError, BrokerResult, KvEntry, KvOperation, KvSpec, compare};
use async_nats::jetstream;
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use std::time::Duration;

impl Inner {
    async fn kv_store(&self, bucket: &str) -> BrokerResult<jetstream::kv::Store> {
        if let Some(s) = self.kv.get(bucket) {
            return Ok(s.clone());
        }
        match self.js.get_key_value(bucket).await {
            Ok(store) => {
                self.kv.insert(bucket.to_owned(), store.clone());
                Ok(store)
            }
            Err(e) if stream_missing(&e) || e.to_string().contains("not found") => {
                Err(BrokerError::BucketNotFound { bucket: bucket.to_owned() })
            }
            Err(e) => Err(api_error(&format!("open KV bucket {bucket}"), e, self.request_timeout)),
        }
    }

    pub(super) async fn ensure_kv(&self, spec: KvSpec) -> BrokerResult<()> {
        compare::validate_bucket(&spec.bucket)?;
        let stream = compare::kv_stream(&spec);
        self.ensure_stream(stream).await.map_err(|e| match e {
            BrokerError::ConfigMismatch { field, existing, wanted, .. } => BrokerError::ConfigMismatch {
                object: format!("KV bucket {}", spec.bucket),
                field: if field == "max_msgs_per_subject" { "history".into() } else { field },
                existing,
                wanted,
            },
            BrokerError::LosesRecords { field, existing, fix, .. } => {
                BrokerError::LosesRecords { object: format!("KV bucket {}", spec.bucket), field, existing, fix }
            }
            other => other,
        })?;
        self.kv_store(&spec.bucket).await.map(|_| ())
    }

    pub(super) async fn kv_get(&self, bucket: String, key: String) -> BrokerResult<Option<KvEntry>> {
        compare::validate_key(&key)?;
        let store = self.kv_store(&bucket).await?;
        let entry = store
            .entry(key.clone())
            .await
            .map_err(|e| api_error(&format!("KV get {bucket}/{key}"), e, self.request_timeout))?;
        Ok(entry.map(|e| kv_entry(&bucket, e)).filter(|e| e.operation == KvOperation::Put))
    }

    pub(super) async fn kv_create(&self, bucket: String, key: String, value: Bytes) -> BrokerResult<u64> {
        compare::validate_key(&key)?;
        let store = self.kv_store(&bucket).await?;
        store.create(&key, value).await.map_err(|e| match e.kind() {
            jetstream::kv::CreateErrorKind::AlreadyExists => BrokerError::KvKeyExists { bucket, key },
            _ => api_error(&format!("KV create {bucket}/{key}"), e, self.request_timeout),
        })
    }

    pub(super) async fn kv_update(
        &self,
        bucket: String,
        key: String,
        value: Bytes,
        revision: u64,
    ) -> BrokerResult<u64> {
        compare::validate_key(&key)?;
        let store = self.kv_store(&bucket).await?;
        store.update(&key, value, revision).await.map_err(|e| match e.kind() {
            jetstream::kv::UpdateErrorKind::WrongLastRevision => {
                BrokerError::KvWrongRevision { bucket, key, expected: revision }
            }
            _ => api_error(&format!("KV update {bucket}/{key}"), e, self.request_timeout),
        })
    }

    pub(super) async fn kv_put(&self, bucket: String, key: String, value: Bytes) -> BrokerResult<u64> {
        compare::validate_key(&key)?;
        let store = self.kv_store(&bucket).await?;
        store.put(&key, value).await.map_err(|e| api_error(&format!("KV put {bucket}/{key}"), e, self.request_timeout))
    }

    pub(super) async fn kv_delete(&self, bucket: String, key: String, revision: Option<u64>) -> BrokerResult<()> {
        compare::validate_key(&key)?;
        let store = self.kv_store(&bucket).await?;
        store.delete_expect_revision(&key, revision).await.map_err(|e| {
            if e.to_string().contains("wrong last sequence") || js_code(&e) == Some(10071) {
                BrokerError::KvWrongRevision {
                    bucket: bucket.clone(),
                    key: key.clone(),
                    expected: revision.unwrap_or(0),
                }
            } else {
                api_error(&format!("KV delete {bucket}/{key}"), e, self.request_timeout)
            }
        })
    }

    pub(super) async fn kv_keys(&self, bucket: String) -> BrokerResult<Vec<String>> {
        let store = self.kv_store(&bucket).await?;
        let op = format!("KV keys of {bucket}");
        let keys = store.keys().await.map_err(|e| api_error(&op, e, self.request_timeout))?;
        // Its ordered consumer can stop delivering (a replicated bucket electing a
        // leader): without a deadline the caller (a node's cluster scan) would wait
        // for ever. It fails, passing, and the caller reads again.
        let mut keys: Vec<String> = tokio::time::timeout(SCAN_STALL, keys.try_collect())
            .await
            .map_err(|_| BrokerError::TimedOut { operation: op.clone(), after: SCAN_STALL })?
            .map_err(|e| api_error(&op, e, self.request_timeout))?;
        keys.sort();
        Ok(keys)
    }

    pub(super) async fn kv_watch(&self, bucket: String, key: String) -> BrokerResult<BoxStream<BrokerResult<KvEntry>>> {
        let store = self.kv_store(&bucket).await?;
        let op = format!("KV watch {bucket}/{key}");
        let watch = store.watch_with_history(&key).await.map_err(|e| api_error(&op, e, self.request_timeout))?;
        let b = bucket.clone();
        let stream = watch.map(move |r| r.map(|e| kv_entry(&b, e)).map_err(|e| BrokerError::other(&op, e)));
        Ok(stream.boxed())
    }

    pub(super) async fn kv_scan(&self, bucket: String, key: String) -> BrokerResult<BoxStream<BrokerResult<KvEntry>>> {
        let store = self.kv_store(&bucket).await?;
        let op = format!("KV scan {bucket}/{key}");
        let prefix = crate::wire::Subjects::kv_prefix(&bucket);
        // An ordered push consumer of the last message per key, as async-nats'
        // `keys()` reads a bucket, but with the values: it ends when the server
        // says nothing is pending.
        let consumer = store
            .stream
            .create_consumer(jetstream::consumer::push::OrderedConfig {
                deliver_subject: self.client.new_inbox(),
                description: Some("flotilla state restore".into()),
                filter_subject: format!("{prefix}{key}"),
                replay_policy: jetstream::consumer::ReplayPolicy::Instant,
                deliver_policy: jetstream::consumer::DeliverPolicy::LastPerSubject,
                ..Default::default()
            })
            .await
            .map_err(|e| api_error(&op, e, self.request_timeout))?;
        if consumer.cached_info().num_pending == 0 {
            return Ok(futures::stream::empty().boxed());
        }
        let messages = consumer.messages().await.map_err(|e| api_error(&op, e, self.request_timeout))?;
        let stream = futures::stream::unfold((messages, false), move |(mut messages, done)| {
            let (op, prefix, bucket) = (op.clone(), prefix.clone(), bucket.clone());
            async move {
                if done {
                    return None;
                }
                // A consumer that stops delivering (its server gone, a leader
                // change) must not hold the reader forever: it fails, passing, and
                // the reader tries again.
                let next = match tokio::time::timeout(SCAN_STALL, messages.next()).await {
                    Ok(next) => next?,
                    Err(_) => {
                        let stalled = BrokerError::TimedOut { operation: op.clone(), after: SCAN_STALL };
                        return Some((Err(stalled), (messages, true)));
                    }
                };
                let item = match next {
                    Err(e) => return Some((Err(BrokerError::other(&op, e)), (messages, true))),
                    Ok(m) => m,
                };
                let info = match item.info() {
                    Ok(info) => (info.stream_sequence, info.pending),
                    Err(e) => return Some((Err(BrokerError::other(&op, e)), (messages, true))),
                };
                let operation = match item.headers.as_ref().and_then(|h| h.get("KV-Operation")).map(|v| v.as_str()) {
                    Some("DEL") => KvOperation::Delete,
                    Some("PURGE") => KvOperation::Purge,
                    _ => KvOperation::Put,
                };
                let entry = KvEntry {
                    bucket,
                    key: item.subject.as_str().strip_prefix(&prefix).unwrap_or(item.subject.as_str()).to_owned(),
                    value: item.payload.clone(),
                    revision: info.0,
                    operation,
                };
                Some((Ok(entry), (messages, info.1 == 0)))
            }
        });
        Ok(stream.boxed())
    }
}

/// How long a [`Broker::kv_scan`] waits for its next entry, and a [`Broker::kv_keys`]
/// for all of its keys, before it fails.
const SCAN_STALL: Duration = Duration::from_secs(10);

fn kv_entry(bucket: &str, e: jetstream::kv::Entry) -> KvEntry {
    KvEntry {
        bucket: bucket.to_owned(),
        key: e.key,
        value: e.value,
        revision: e.revision,
        operation: match e.operation {
            jetstream::kv::Operation::Put => KvOperation::Put,
            jetstream::kv::Operation::Delete => KvOperation::Delete,
            jetstream::kv::Operation::Purge => KvOperation::Purge,
        },
    }
}
