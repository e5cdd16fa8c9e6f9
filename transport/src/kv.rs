//! One typed accessor for a key of a control bucket: [`TypedKey`] reads a record as its
//! type (`get`), changes it by compare-and-set with retry (`modify`) and follows it
//! (`watch`), so no caller writes its own read-edit-update loop.
//!
//! Records are JSON (docs/cluster.md: an operator or a script can read and write them).
//! The decode policy is one: `get` and `watch` report a record that does not decode as
//! [`KvError::Undecodable`]; `modify` starts from "absent" when the stored record does
//! not decode, so that the write that follows replaces it (a control record a newer or
//! broken writer left must not wedge the verb that sets it right).

use crate::broker::{BrokerError, KvEntry, KvOperation, SharedBroker};
use bytes::Bytes;
use futures::StreamExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::marker::PhantomData;

/// How many compare-and-set conflicts [`TypedKey::modify`] rides out before it reports
/// [`KvError::Contended`], unless [`TypedKey::with_tries`] says otherwise.
pub const MODIFY_TRIES: usize = 10;

/// What a typed key operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// The broker failed.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// The stored record is not a valid record of its type.
    #[error("{bucket}/{key} does not decode: {reason}")]
    Undecodable {
        /// The bucket.
        bucket: String,
        /// The key.
        key: String,
        /// What the decoder said.
        reason: String,
    },
    /// Others changed the key between each read and write.
    #[error("{bucket}/{key} kept changing: {tries} compare-and-set tries lost to other writers")]
    Contended {
        /// The bucket.
        bucket: String,
        /// The key.
        key: String,
        /// How many writes were tried.
        tries: usize,
    },
}

impl From<KvError> for BrokerError {
    fn from(e: KvError) -> Self {
        match e {
            KvError::Broker(e) => e,
            other => BrokerError::Other { operation: "compare-and-set".into(), reason: other.to_string() },
        }
    }
}

/// What a [`TypedKey::modify`] change decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Edit<T, R> {
    /// Write nothing; answer `R`.
    Keep(R),
    /// Store this record; answer `R` once it is stored.
    Write(T, R),
    /// Delete the key (nothing when it is absent); answer `R` once it is gone.
    Delete(R),
}

/// A record and the revision it was read at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned<T> {
    /// The record.
    pub value: T,
    /// Its revision (the bucket's stream sequence of its write).
    pub revision: u64,
}

/// One key of one KV bucket, read and written as a `T`.
pub struct TypedKey<T> {
    broker: SharedBroker,
    bucket: String,
    key: String,
    tries: usize,
    record: PhantomData<fn() -> T>,
}

impl<T> Clone for TypedKey<T> {
    fn clone(&self) -> Self {
        Self {
            broker: self.broker.clone(),
            bucket: self.bucket.clone(),
            key: self.key.clone(),
            tries: self.tries,
            record: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for TypedKey<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TypedKey").field("bucket", &self.bucket).field("key", &self.key).finish()
    }
}

impl<T: Serialize + DeserializeOwned> TypedKey<T> {
    /// The key `key` of the bucket named `bucket` (its full name, e.g. `FLOTILLA_J_CONTROL`).
    pub fn new(broker: SharedBroker, bucket: impl Into<String>, key: impl Into<String>) -> Self {
        Self { broker, bucket: bucket.into(), key: key.into(), tries: MODIFY_TRIES, record: PhantomData }
    }

    /// The same key, with `modify` riding out up to `tries` conflicts (at least 1).
    #[must_use]
    pub fn with_tries(mut self, tries: usize) -> Self {
        self.tries = tries.max(1);
        self
    }

    /// The bucket's name.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }

    fn decode(&self, bytes: &[u8]) -> Result<T, KvError> {
        serde_json::from_slice(bytes).map_err(|e| KvError::Undecodable {
            bucket: self.bucket.clone(),
            key: self.key.clone(),
            reason: e.to_string(),
        })
    }

    fn encode(value: &T) -> Bytes {
        // Records are plain structs, maps with string keys and numbers: they always encode.
        Bytes::from(serde_json::to_vec(value).unwrap_or_default())
    }

    /// The current record and its revision; `None` when the key is absent, deleted or
    /// expired.
    ///
    /// # Errors
    /// [`KvError::Broker`]; [`KvError::Undecodable`] for a record that is not a `T`.
    pub async fn get(&self) -> Result<Option<Versioned<T>>, KvError> {
        match self.broker.kv_get(&self.bucket, &self.key).await? {
            Some(e) => Ok(Some(Versioned { value: self.decode(&e.value)?, revision: e.revision })),
            None => Ok(None),
        }
    }

    /// Changes the record by compare-and-set: reads it, lets `change` decide from the
    /// current record (`None` when absent or undecodable), writes what it decided only
    /// if nobody wrote in between, and starts over when someone did, up to
    /// [`MODIFY_TRIES`] times (or as set by [`with_tries`](Self::with_tries)). Returns the answer of the change that was applied.
    ///
    /// # Errors
    /// [`KvError::Broker`]; [`KvError::Contended`] when every try lost to another writer.
    ///
    /// # Cancel safety
    /// Dropped between a read and its write, nothing is written; dropped while a write
    /// is in flight, the write may or may not land.
    pub async fn modify<R>(&self, mut change: impl FnMut(Option<T>) -> Edit<T, R>) -> Result<R, KvError> {
        for _ in 0..self.tries {
            let entry = self.broker.kv_get(&self.bucket, &self.key).await?;
            let current = entry.as_ref().and_then(|e| self.decode(&e.value).ok());
            let written = match (change(current), &entry) {
                (Edit::Keep(answer), _) | (Edit::Delete(answer), None) => return Ok(answer),
                (Edit::Write(value, answer), Some(e)) => self
                    .broker
                    .kv_update(&self.bucket, &self.key, Self::encode(&value), e.revision)
                    .await
                    .map(|_| answer),
                (Edit::Write(value, answer), None) => {
                    self.broker.kv_create(&self.bucket, &self.key, Self::encode(&value)).await.map(|_| answer)
                }
                (Edit::Delete(answer), Some(e)) => {
                    self.broker.kv_delete(&self.bucket, &self.key, Some(e.revision)).await.map(|()| answer)
                }
            };
            match written {
                Ok(answer) => return Ok(answer),
                Err(BrokerError::KvWrongRevision { .. } | BrokerError::KvKeyExists { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(KvError::Contended { bucket: self.bucket.clone(), key: self.key.clone(), tries: self.tries })
    }

    /// Follows the record: first its current state, then each change, as `Some(record)`
    /// for a write and `None` for a delete or purge. Expiry raises no event (as on 2.9
    /// servers), so a caller that waits on a key that may expire re-reads it now and
    /// then as well.
    ///
    /// # Errors
    /// [`KvError::Broker`] when the watch cannot start; items carry later broker
    /// failures and undecodable records.
    pub async fn watch(&self) -> Result<futures::stream::BoxStream<'static, Result<Option<T>, KvError>>, KvError>
    where
        T: 'static,
    {
        let entries = self.broker.kv_watch(&self.bucket, &self.key).await?;
        let this = self.clone();
        Ok(entries.map(move |entry| this.record_of(entry?)).fuse().boxed())
    }

    /// Follows every key this key's name matches as a pattern (`*` and `>` wildcards, e.g.
    /// `drained.>`): first the current record of each, then each change, as
    /// `(key, Some(record))` for a write and `(key, None)` for a delete or purge.
    /// Expiry raises no event.
    ///
    /// # Errors
    /// As [`watch`](Self::watch).
    pub async fn watch_keys(
        &self,
    ) -> Result<futures::stream::BoxStream<'static, Result<(String, Option<T>), KvError>>, KvError>
    where
        T: 'static,
    {
        let entries = self.broker.kv_watch(&self.bucket, &self.key).await?;
        let this = self.clone();
        Ok(entries
            .map(move |entry| {
                let entry = entry?;
                let key = entry.key.clone();
                this.record_of(entry).map(|record| (key, record))
            })
            .fuse()
            .boxed())
    }

    fn record_of(&self, entry: KvEntry) -> Result<Option<T>, KvError> {
        match entry.operation {
            KvOperation::Put => self.decode(&entry.value).map(Some),
            KvOperation::Delete | KvOperation::Purge => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::KvSpec;
    use crate::embedded::EmbeddedBroker;
    use std::collections::BTreeSet;
    use std::sync::Arc;
    use std::time::Duration;

    async fn bucket() -> SharedBroker {
        let broker: SharedBroker = Arc::new(EmbeddedBroker::new());
        broker.ensure_kv(KvSpec::new("B", None)).await.expect("bucket");
        broker
    }

    #[tokio::test]
    async fn modify_creates_updates_keeps_and_deletes() {
        let broker = bucket().await;
        let key = TypedKey::<BTreeSet<String>>::new(broker.clone(), "B", "k");
        assert_eq!(key.get().await.expect("get"), None);
        let added = key
            .modify(|set| {
                let mut set = set.unwrap_or_default();
                let added = set.insert("a".into());
                Edit::Write(set, added)
            })
            .await
            .expect("create");
        assert!(added);
        let kept = key.modify(|set| Edit::Keep(set.map(|s| s.len()))).await.expect("keep");
        assert_eq!(kept, Some(1));
        key.modify(|set| Edit::Write(set.unwrap_or_default().into_iter().chain(["b".into()]).collect(), ()))
            .await
            .expect("update");
        let read = key.get().await.expect("get").expect("present");
        assert_eq!(read.value, BTreeSet::from(["a".to_owned(), "b".to_owned()]));
        key.modify(|_| Edit::Delete(())).await.expect("delete");
        assert_eq!(key.get().await.expect("get"), None);
        key.modify(|_| Edit::Delete(())).await.expect("deleting an absent key is nothing");
    }

    #[tokio::test]
    async fn a_conflicting_write_makes_modify_read_again_and_apply_to_the_new_record() {
        let broker = bucket().await;
        let key = TypedKey::<u64>::new(broker.clone(), "B", "count");
        broker.kv_put("B", "count", Bytes::from_static(b"1")).await.expect("seed");
        let mut calls = 0;
        let answer = key
            .modify(|n| {
                calls += 1;
                if calls == 1 {
                    // Another writer gets in between this read and its write.
                    let b = broker.clone();
                    std::thread::spawn(move || {
                        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
                        rt.block_on(b.kv_put("B", "count", Bytes::from_static(b"10"))).expect("interleaved write");
                    })
                    .join()
                    .expect("writer");
                }
                let n = n.unwrap_or(0) + 1;
                Edit::Write(n, n)
            })
            .await
            .expect("modify");
        assert_eq!(calls, 2, "the lost write was tried again");
        assert_eq!(answer, 11, "applied to what the other writer stored");
        assert_eq!(key.get().await.expect("get").map(|v| v.value), Some(11));
    }

    #[tokio::test]
    async fn an_undecodable_record_is_an_error_to_get_and_replaced_by_modify() {
        let broker = bucket().await;
        broker.kv_put("B", "k", Bytes::from_static(b"{not json")).await.expect("seed");
        let key = TypedKey::<u64>::new(broker.clone(), "B", "k");
        let err = key.get().await.expect_err("undecodable");
        assert!(err.to_string().starts_with("B/k does not decode"), "{err}");
        let seen = key.modify(|n| Edit::Write(7, n)).await.expect("modify");
        assert_eq!(seen, None, "an undecodable record counts as absent");
        assert_eq!(key.get().await.expect("get").map(|v| v.value), Some(7));
    }

    #[tokio::test]
    async fn watch_gives_the_current_record_then_each_change_and_deletes() {
        let broker = bucket().await;
        let key = TypedKey::<u64>::new(broker.clone(), "B", "w");
        key.modify(|_| Edit::Write(1, ())).await.expect("first");
        let mut changes = key.watch().await.expect("watch");
        let wait = Duration::from_secs(5);
        let first = tokio::time::timeout(wait, changes.next()).await.expect("in time").expect("open");
        assert_eq!(first.expect("item"), Some(1));
        key.modify(|n| Edit::Write(n.unwrap_or(0) + 1, ())).await.expect("second");
        let second = tokio::time::timeout(wait, changes.next()).await.expect("in time").expect("open");
        assert_eq!(second.expect("item"), Some(2));
        key.modify(|_| Edit::Delete(())).await.expect("delete");
        let gone = tokio::time::timeout(wait, changes.next()).await.expect("in time").expect("open");
        assert_eq!(gone.expect("item"), None);
    }

    #[tokio::test]
    async fn watch_keys_follows_every_key_of_a_pattern_with_its_name() {
        let broker = bucket().await;
        TypedKey::<u64>::new(broker.clone(), "B", "d.x.1").modify(|_| Edit::Write(1, ())).await.expect("x1");
        TypedKey::<u64>::new(broker.clone(), "B", "other").modify(|_| Edit::Write(9, ())).await.expect("other");
        let mut changes = TypedKey::<u64>::new(broker.clone(), "B", "d.>").watch_keys().await.expect("watch");
        let wait = Duration::from_secs(5);
        let first = tokio::time::timeout(wait, changes.next()).await.expect("in time").expect("open");
        assert_eq!(first.expect("item"), ("d.x.1".to_owned(), Some(1)));
        TypedKey::<u64>::new(broker.clone(), "B", "other").modify(|_| Edit::Write(10, ())).await.expect("other");
        TypedKey::<u64>::new(broker.clone(), "B", "d.y.2").modify(|_| Edit::Write(2, ())).await.expect("y2");
        let second = tokio::time::timeout(wait, changes.next()).await.expect("in time").expect("open");
        assert_eq!(second.expect("item"), ("d.y.2".to_owned(), Some(2)), "keys outside the pattern are not seen");
    }
}
