//! Durable task state: typed key-value stores that move with their partition.
//!
//! A task declares its stores on the job ([`Job::store`](crate::Job::store)) and reaches
//! them through [`TaskContext::store`](crate::TaskContext::store). Reads and writes hit
//! memory; what changed is written to the job's changelog (the KV bucket
//! `FLOTILLA_<job>_STATE`) at each commit, before the input is acknowledged, and read back
//! by the next owner of the partition before it processes anything. `docs/state.md`
//! gives the design and the argument for exactly-once.
//!
//! This module holds the typed stores; `flotilla_proto::store` holds the changelog's rules as plain data: how a
//! record and a commit record are encoded, and which value of a key a restore takes
//! ([`Resolution`]). The worker performs the I/O.
//!
//! # Changelog layout
//!
//! * one key per partition and store key: `<input>.<partition>.<store>.<hex of the key's
//!   encoding>`, holding a [`Record`]: the writer's generation and flush number, the new
//!   value (none for a delete) and the value the key had at the writer's last commit;
//! * one commit key per partition: `<input>.<partition>._commit`, holding a
//!   [`CommitRecord`]: the generation and flush number of the last complete flush, the
//!   input position it reflects (the stream sequence of the last input applied), and the
//!   last complete flush of each earlier generation still referenced.
//!
//! Every write is a compare-and-set on the key's last revision, so a stale owner cannot
//! overwrite what a newer one wrote; the commit key's compare-and-set is what makes a
//! flush count.

use flotilla_transport::wire::Codec;
use serde::{Serialize, de::DeserializeOwned};
use std::any::Any;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::rc::Rc;

use crate::task::TaskError;

pub use flotilla_proto::store::records::{
    CommitRecord, Record, Resolution, claim, commit_key, hex, record_key, resolve, unhex,
};

/// The KV bucket (per job) that holds every store's changelog.
pub const STATE: &str = "STATE";

/// The longest encoded store key, in bytes (its hex form is twice that, in a subject).
pub const MAX_KEY_BYTES: usize = 256;

/// Bytes of a changelog record that are not its two values (version, generation, flush,
/// presence bytes and lengths), with room to spare.
const RECORD_OVERHEAD: usize = 64;

/// The largest encoded store value a broker taking payloads of up to `max_payload`
/// bytes can hold: a changelog record carries the new and the committed value of its
/// key, so each must fit in half.
pub fn max_value_bytes(max_payload: usize) -> usize {
    (max_payload / 2).saturating_sub(RECORD_OVERHEAD)
}

/// Why a store refused a write. It converts into a [`TaskError::Permanent`]
/// ([`permanent`](Self::permanent)), so a handler's `?` dead-letters the message at once with the reason `too-large` (a value
/// or key too large) or `rejected` (one that cannot be encoded).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The value encodes to more than the changelog can hold.
    #[error(
        "store {store} key {key}: the value encodes to {size} bytes, over the limit of {limit} bytes (a changelog record holds the new and the committed value, so each must fit in half the broker's max_payload): keep large values elsewhere and store a reference"
    )]
    ValueTooLarge {
        /// The store.
        store: &'static str,
        /// The key, as the changelog names it (the hex of its encoding, cut at 64 digits).
        key: String,
        /// The value's encoded size in bytes.
        size: usize,
        /// The largest value the store takes, in bytes.
        limit: usize,
    },
    /// The key encodes to more than [`MAX_KEY_BYTES`].
    #[error("store {store}: the key encodes to {size} bytes, over the limit of {MAX_KEY_BYTES}")]
    KeyTooLarge {
        /// The store.
        store: &'static str,
        /// The key's encoded size in bytes.
        size: usize,
    },
    /// The key or value cannot be encoded.
    #[error("store {store}: {reason}")]
    Encode {
        /// The store.
        store: &'static str,
        /// Why.
        reason: String,
    },
}

impl StoreError {
    /// The task error a refused write is: permanent, with the dead-letter reason
    /// `too-large` or `rejected` (what `?` in a handler makes of it).
    pub fn permanent(&self) -> TaskError {
        let reason = match self {
            StoreError::ValueTooLarge { .. } | StoreError::KeyTooLarge { .. } => "too-large",
            StoreError::Encode { .. } => "rejected",
        };
        TaskError::Permanent { reason, detail: self.to_string() }
    }
}

/// A typed key-value store of a task, declared on the job beside its streams.
///
/// ```
/// use flotilla_actors::StoreDef;
/// const COUNTS: StoreDef<String, u64> = StoreDef::new("counts");
/// ```
pub struct StoreDef<K, V> {
    name: &'static str,
    _types: PhantomData<fn() -> (K, V)>,
}

impl<K, V> Clone for StoreDef<K, V> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<K, V> Copy for StoreDef<K, V> {}

impl<K, V> std::fmt::Debug for StoreDef<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreDef").field("name", &self.name).finish()
    }
}

impl<K, V> StoreDef<K, V> {
    /// A store named `name`: lowercase letters, digits, `-` and `_`, not starting with
    /// `_` (checked when the job starts).
    pub const fn new(name: &'static str) -> Self {
        Self { name, _types: PhantomData }
    }

    /// The store's name.
    pub const fn name(&self) -> &'static str {
        self.name
    }
}

/// Why a store name cannot be used, if it cannot.
pub fn name_problem(name: &str) -> Option<String> {
    if name.is_empty() || name.len() > 64 {
        return Some(format!("store name {name:?} must be 1 to 64 characters"));
    }
    if name.starts_with('_') {
        return Some(format!("store name {name:?} must not start with '_' (reserved for the changelog's own keys)"));
    }
    if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_') {
        return Some(format!("store name {name:?} may hold lowercase letters, digits, '-' and '_' only"));
    }
    None
}

/// What keys and values of a store must be.
pub trait StoreKey: Serialize + DeserializeOwned + Ord + Clone + 'static {}
impl<T: Serialize + DeserializeOwned + Ord + Clone + 'static> StoreKey for T {}
/// What values of a store must be.
pub trait StoreValue: Serialize + DeserializeOwned + Clone + 'static {}
impl<T: Serialize + DeserializeOwned + Clone + 'static> StoreValue for T {}

// ---------------------------------------------------------------------------------------
// Typed stores
// ---------------------------------------------------------------------------------------

/// A changed key, ready for the changelog.
#[derive(Debug, Clone)]
pub struct Change {
    /// The store.
    pub store: &'static str,
    /// The hex of the key's encoding.
    pub key_hex: String,
    /// The new value's encoding; `None` for a delete.
    pub value: Option<bytes::Bytes>,
    /// The value's encoding at the last commit.
    pub committed: Option<bytes::Bytes>,
    /// The key's changelog revision the write must find (0: none).
    pub expected_revision: u64,
}

/// What the worker needs of a store, whatever its types.
pub trait ErasedStore: Any {
    /// The store's name.
    fn name(&self) -> &'static str;
    /// Keys held.
    fn len(&self) -> usize;
    /// Whether it holds nothing.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The callback that changed it succeeded (`true`: keep its changes) or failed
    /// (`false`: undo them).
    fn end_callback(&mut self, keep: bool);
    /// The callback of message `token` succeeded but the message is not finished (its
    /// deferred work or its outputs are on their way): keep its changes, and its journal
    /// until [`release`](Self::release) or [`undo`](Self::undo).
    fn end_callback_held(&mut self, token: u64);
    /// Whether the held changes of `token` can be undone alone: no later callback
    /// changed one of its keys (none held: `true`).
    fn can_undo(&self, token: u64) -> bool;
    /// Undoes the held changes of `token` (check [`can_undo`](Self::can_undo) first).
    fn undo(&mut self, token: u64);
    /// Message `token` finished: its changes stay, its journal goes.
    fn release(&mut self, token: u64);
    /// Whether something changed since the last [`take_changes`](Self::take_changes).
    fn has_changes(&self) -> bool;
    /// What changed since the last call, encoded; the store forgets it.
    ///
    /// # Errors
    /// A value that cannot be encoded, naming the store and key.
    fn take_changes(&mut self, codec: &Codec) -> Result<Vec<Change>, String>;
    /// The changelog stored `key_hex` at `revision`.
    fn stored(&mut self, key_hex: &str, revision: u64);
    /// Takes one restored key.
    ///
    /// # Errors
    /// The key or value no longer decodes (its type changed), naming the store and key.
    fn restore(
        &mut self,
        codec: &Codec,
        key_hex: &str,
        value: Option<&bytes::Bytes>,
        revision: u64,
    ) -> Result<(), String>;
    /// For downcasting to the typed store.
    fn as_any(&mut self) -> &mut dyn Any;
}

/// A store's contents and bookkeeping.
pub struct TypedStore<K, V> {
    name: &'static str,
    live: BTreeMap<K, V>,
    /// Changelog revision of each key that has a record (absent keys whose record is
    /// a delete included).
    revisions: BTreeMap<K, u64>,
    /// Keys changed since the last flush, with their value at the last commit.
    changed: BTreeMap<K, Option<V>>,
    /// Keys the running callback changed, with their value before it.
    undo: BTreeMap<K, Option<V>>,
    /// Keys of the flush on its way, by the hex of their encoding.
    flushing: std::collections::HashMap<String, K>,
    /// Journals of messages whose changes are kept but which have not finished.
    held: Vec<Held<K, V>>,
}

/// The changes of a message that has not finished: each key's value before it, and
/// whether a later callback changed one of those keys (then only a restore of the last
/// commit can take them back).
struct Held<K, V> {
    token: u64,
    before: BTreeMap<K, Option<V>>,
    entangled: bool,
}

impl<K: StoreKey, V: StoreValue> TypedStore<K, V> {
    /// An empty store named `name`.
    pub fn new(name: &'static str) -> Self {
        Self {
            name,
            live: BTreeMap::new(),
            revisions: BTreeMap::new(),
            changed: BTreeMap::new(),
            undo: BTreeMap::new(),
            flushing: std::collections::HashMap::new(),
            held: Vec::new(),
        }
    }

    fn remember(&mut self, key: &K) {
        if !self.undo.contains_key(key) {
            self.undo.insert(key.clone(), self.live.get(key).cloned());
        }
    }

    fn key_hex(codec: &Codec, key: &K) -> Result<String, String> {
        let bytes = codec.encode(key).map_err(|e| e.to_string())?;
        if bytes.len() > MAX_KEY_BYTES {
            return Err(format!("the key encodes to {} bytes, over the limit of {MAX_KEY_BYTES}", bytes.len()));
        }
        Ok(hex(&bytes))
    }

    /// Checks that `key` and `value` can be written to the changelog.
    fn check_write(&self, codec: &Codec, value_limit: usize, key: &K, value: &V) -> Result<(), StoreError> {
        let store = self.name;
        let key_bytes = codec.encode(key).map_err(|e| StoreError::Encode { store, reason: e.to_string() })?;
        if key_bytes.len() > MAX_KEY_BYTES {
            return Err(StoreError::KeyTooLarge { store, size: key_bytes.len() });
        }
        let size = codec.encoded_len(value).map_err(|e| StoreError::Encode { store, reason: e.to_string() })?;
        if size > value_limit {
            let mut key = hex(&key_bytes);
            key.truncate(64);
            return Err(StoreError::ValueTooLarge { store, key, size, limit: value_limit });
        }
        Ok(())
    }

    /// Gives each key of `journal` its value before (absent: removed).
    fn put_back(&mut self, journal: BTreeMap<K, Option<V>>) {
        for (key, before) in journal {
            match before {
                Some(v) => self.live.insert(key, v),
                None => self.live.remove(&key),
            };
        }
    }

    /// Ends the running callback: keeps its changes (`held`: with a journal under that
    /// token) or undoes them.
    fn end(&mut self, keep: bool, held: Option<u64>) {
        let undo = std::mem::take(&mut self.undo);
        if !keep {
            self.put_back(undo);
            return;
        }
        // A kept change to a key of an unfinished message ties them: undoing that
        // message alone would lose this one.
        for h in self.held.iter_mut().filter(|h| !h.entangled) {
            h.entangled = undo.keys().any(|k| h.before.contains_key(k));
        }
        match held {
            Some(token) if !undo.is_empty() => {
                for (key, before) in &undo {
                    if !self.changed.contains_key(key) {
                        self.changed.insert(key.clone(), before.clone());
                    }
                }
                self.held.push(Held { token, before: undo, entangled: false });
            }
            _ => {
                for (key, before) in undo {
                    self.changed.entry(key).or_insert(before);
                }
            }
        }
    }
}

impl<K: StoreKey, V: StoreValue> ErasedStore for TypedStore<K, V> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn len(&self) -> usize {
        self.live.len()
    }

    fn end_callback(&mut self, keep: bool) {
        self.end(keep, None);
    }

    fn end_callback_held(&mut self, token: u64) {
        self.end(true, Some(token));
    }

    fn can_undo(&self, token: u64) -> bool {
        self.held.iter().find(|h| h.token == token).is_none_or(|h| !h.entangled)
    }

    fn undo(&mut self, token: u64) {
        let Some(at) = self.held.iter().position(|h| h.token == token) else { return };
        // The keys' entries in `changed` stay: they hold the committed values, and a
        // key changed back to its committed value is not written.
        let held = self.held.remove(at);
        self.put_back(held.before);
    }

    fn release(&mut self, token: u64) {
        if let Some(at) = self.held.iter().position(|h| h.token == token) {
            self.held.swap_remove(at);
        }
    }

    fn has_changes(&self) -> bool {
        !self.changed.is_empty()
    }

    fn take_changes(&mut self, codec: &Codec) -> Result<Vec<Change>, String> {
        let changed = std::mem::take(&mut self.changed);
        let mut out = Vec::with_capacity(changed.len());
        for (key, committed) in changed {
            let now = self.live.get(&key);
            let encode = |v: Option<&V>| -> Result<Option<bytes::Bytes>, String> {
                v.map(|v| codec.encode(v)).transpose().map_err(|e| e.to_string())
            };
            let key_hex = Self::key_hex(codec, &key).map_err(|e| format!("store {}: {e}", self.name))?;
            let value = encode(now).map_err(|e| format!("store {} key {key_hex}: {e}", self.name))?;
            let committed =
                encode(committed.as_ref()).map_err(|e| format!("store {} key {key_hex}: {e}", self.name))?;
            if value == committed {
                // Changed and changed back: nothing to write.
                continue;
            }
            self.flushing.insert(key_hex.clone(), key.clone());
            out.push(Change {
                store: self.name,
                expected_revision: self.revisions.get(&key).copied().unwrap_or(0),
                key_hex,
                value,
                committed,
            });
        }
        Ok(out)
    }

    fn stored(&mut self, key_hex: &str, revision: u64) {
        if let Some(key) = self.flushing.remove(key_hex) {
            self.revisions.insert(key, revision);
        }
    }

    fn restore(
        &mut self,
        codec: &Codec,
        key_hex: &str,
        value: Option<&bytes::Bytes>,
        revision: u64,
    ) -> Result<(), String> {
        let name = self.name;
        let bytes = unhex(key_hex).ok_or_else(|| format!("store {name}: changelog key {key_hex:?} is not hex"))?;
        let key: K = codec.decode(&bytes).map_err(|e| {
            format!("store {name} key {key_hex}: the key no longer decodes as the store's key type: {e}")
        })?;
        match value {
            Some(v) => {
                let v: V = codec.decode(v).map_err(|e| {
                    format!("store {name} key {key_hex}: the value no longer decodes as the store's value type: {e}")
                })?;
                self.live.insert(key.clone(), v);
            }
            None => {
                self.live.remove(&key);
            }
        }
        self.revisions.insert(key, revision);
        Ok(())
    }

    fn as_any(&mut self) -> &mut dyn Any {
        self
    }
}

/// A task partition's stores, shared by the worker and the task's context.
#[derive(Default)]
pub struct StoreSet {
    stores: Vec<Box<dyn ErasedStore>>,
    codec: Codec,
    /// The largest encoded value a `put` takes ([`max_value_bytes`]).
    value_limit: usize,
}

impl std::fmt::Debug for StoreSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.stores.iter().map(|s| (s.name(), s.len()))).finish()
    }
}

/// How a job makes a task's stores for each of its workers.
pub type StoreMaker = Rc<dyn Fn() -> Box<dyn ErasedStore>>;

/// A maker of empty stores of `def`'s types.
pub fn maker<K: StoreKey, V: StoreValue>(def: StoreDef<K, V>) -> StoreMaker {
    Rc::new(move || Box::new(TypedStore::<K, V>::new(def.name())))
}

impl StoreSet {
    /// The stores made by `makers`, encoding with `codec` and taking values that fit a
    /// changelog record within the codec's payload limit.
    pub fn new(makers: &[StoreMaker], codec: Codec) -> Self {
        let value_limit = max_value_bytes(codec.max_payload());
        Self { stores: makers.iter().map(|m| m()).collect(), codec, value_limit }
    }

    /// The same stores taking values that fit a changelog record of at most
    /// `max_payload` bytes (the broker's limit, when lower than the codec's).
    #[must_use]
    pub fn with_max_payload(mut self, max_payload: usize) -> Self {
        self.value_limit = self.value_limit.min(max_value_bytes(max_payload));
        self
    }

    /// The largest encoded value a `put` takes, in bytes.
    pub fn value_limit(&self) -> usize {
        self.value_limit
    }

    /// Whether there are no stores.
    pub fn is_empty(&self) -> bool {
        self.stores.is_empty()
    }

    /// The codec values are encoded with.
    pub fn codec(&self) -> &Codec {
        &self.codec
    }

    /// Each store.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Box<dyn ErasedStore>> {
        self.stores.iter_mut()
    }

    /// The store named `name`.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut Box<dyn ErasedStore>> {
        self.stores.iter_mut().find(|s| s.name() == name)
    }

    /// Ends a callback in every store (see [`ErasedStore::end_callback`]).
    pub fn end_callback(&mut self, keep: bool) {
        for s in &mut self.stores {
            s.end_callback(keep);
        }
    }

    /// Ends the callback of message `token`, which has not finished, in every store
    /// (see [`ErasedStore::end_callback_held`]).
    pub fn end_callback_held(&mut self, token: u64) {
        for s in &mut self.stores {
            s.end_callback_held(token);
        }
    }

    /// Undoes the changes of the unfinished message `token` in every store, if no later
    /// callback changed one of its keys; `false` (and nothing undone) otherwise.
    pub fn undo(&mut self, token: u64) -> bool {
        if !self.stores.iter().all(|s| s.can_undo(token)) {
            return false;
        }
        for s in &mut self.stores {
            s.undo(token);
        }
        true
    }

    /// Message `token` finished: its changes stay, their journal goes.
    pub fn release(&mut self, token: u64) {
        for s in &mut self.stores {
            s.release(token);
        }
    }

    /// Keys held, over all stores.
    pub fn len(&self) -> usize {
        self.stores.iter().map(|s| s.len()).sum()
    }

    /// Whether something changed since the last flush.
    pub fn has_changes(&self) -> bool {
        self.stores.iter().any(|s| s.has_changes())
    }
}

/// A task's handle on one store during a callback. Reads and writes go to memory; a
/// callback's writes are undone when it fails, and written to the changelog with the
/// next commit when it succeeds.
pub struct Store<'a, K, V> {
    set: &'a RefCell<StoreSet>,
    index: usize,
    _types: PhantomData<fn() -> (K, V)>,
}

impl<K, V> std::fmt::Debug for Store<'_, K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("index", &self.index).finish_non_exhaustive()
    }
}

impl<'a, K: StoreKey, V: StoreValue> Store<'a, K, V> {
    pub(crate) fn open(set: &'a RefCell<StoreSet>, def: &StoreDef<K, V>) -> Result<Self, TaskError> {
        let mut guard = set.borrow_mut();
        let Some(index) = guard.stores.iter().position(|s| s.name() == def.name()) else {
            return Err(TaskError::fatal(format!(
                "store {:?} is not declared for this task: add .store({}) after its .task(...) on the job",
                def.name(),
                def.name().to_uppercase()
            )));
        };
        if guard.stores[index].as_any().downcast_mut::<TypedStore<K, V>>().is_none() {
            return Err(TaskError::fatal(format!(
                "store {:?} is declared with other key or value types than this StoreDef",
                def.name()
            )));
        }
        drop(guard);
        Ok(Self { set, index, _types: PhantomData })
    }

    fn with<R>(&self, f: impl FnOnce(&mut TypedStore<K, V>, &Codec, usize) -> R) -> R {
        let mut set = self.set.borrow_mut();
        let set = &mut *set;
        let (codec, limit) = (&set.codec, set.value_limit);
        let store = set.stores[self.index].as_any().downcast_mut::<TypedStore<K, V>>();
        // `open` checked the type, and stores are never replaced.
        match store {
            Some(store) => f(store, codec, limit),
            None => unreachable!("store type checked at open"),
        }
    }

    /// The value of `key`.
    pub fn get(&self, key: &K) -> Option<V> {
        self.with(|s, _, _| s.live.get(key).cloned())
    }

    /// Whether `key` has a value.
    pub fn contains(&self, key: &K) -> bool {
        self.with(|s, _, _| s.live.contains_key(key))
    }

    /// Sets `key` to `value`.
    ///
    /// # Errors
    /// [`StoreError::ValueTooLarge`] when the value encodes to more than the store takes
    /// (about half the broker's `max_payload`: `docs/state.md`),
    /// [`StoreError::KeyTooLarge`] when the key encodes to more than [`MAX_KEY_BYTES`],
    /// [`StoreError::Encode`] when either cannot be encoded. Nothing is written then; a
    /// handler's `?` dead-letters the message at once (as `too-large` or `rejected`).
    pub fn put(&self, key: K, value: V) -> Result<(), StoreError> {
        self.with(|s, codec, limit| {
            s.check_write(codec, limit, &key, &value)?;
            s.remember(&key);
            s.live.insert(key, value);
            Ok(())
        })
    }

    /// Removes `key`; returns its value.
    pub fn delete(&self, key: &K) -> Option<V> {
        self.with(|s, _, _| {
            if !s.live.contains_key(key) {
                return None;
            }
            s.remember(key);
            s.live.remove(key)
        })
    }

    /// Changes the value of `key` with `f` (given `None` when absent); `f` returning
    /// `None` deletes it. Returns the new value.
    ///
    /// # Errors
    /// As [`put`](Self::put).
    pub fn update(&self, key: K, f: impl FnOnce(Option<V>) -> Option<V>) -> Result<Option<V>, StoreError> {
        let new = f(self.get(&key));
        match &new {
            Some(v) => self.put(key, v.clone())?,
            None => {
                self.delete(&key);
            }
        }
        Ok(new)
    }

    /// The entries with keys in `range`, in key order.
    pub fn range<R: RangeBounds<K>>(&self, range: R) -> Vec<(K, V)> {
        self.with(|s, _, _| s.live.range(range).map(|(k, v)| (k.clone(), v.clone())).collect())
    }

    /// Every entry, in key order.
    pub fn entries(&self) -> Vec<(K, V)> {
        self.range(..)
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.with(|s, _, _| s.live.len())
    }

    /// Whether the store is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<V: StoreValue> Store<'_, String, V> {
    /// The entries whose key starts with `prefix`, in key order.
    pub fn prefix(&self, prefix: &str) -> Vec<(String, V)> {
        self.with(|s, _, _| {
            s.live
                .range(prefix.to_owned()..)
                .take_while(|(k, _)| k.starts_with(prefix))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_callback_leaves_no_change_and_a_kept_one_remembers_the_committed_value() {
        let set = RefCell::new(StoreSet::new(&[maker(StoreDef::<String, u64>::new("counts"))], Codec::default()));
        let def = StoreDef::<String, u64>::new("counts");
        let store = Store::open(&set, &def).expect("declared");
        store.put("a".into(), 1).expect("put");
        set.borrow_mut().end_callback(true);
        let changes = set.borrow_mut().stores[0].take_changes(&Codec::default()).expect("changes");
        assert_eq!(changes.len(), 1);
        assert_eq!(changes[0].committed, None);
        // A failed callback: undone, nothing to flush.
        store.put("a".into(), 2).expect("put");
        store.put("b".into(), 5).expect("put");
        store.delete(&"a".into());
        set.borrow_mut().end_callback(false);
        assert_eq!(store.get(&"a".into()), Some(1));
        assert_eq!(store.get(&"b".into()), None);
        assert!(!set.borrow().has_changes());
        // Changed twice in kept callbacks: the committed value is the first one's before.
        store.put("a".into(), 3).expect("put");
        set.borrow_mut().end_callback(true);
        store.put("a".into(), 4).expect("put");
        set.borrow_mut().end_callback(true);
        let changes = set.borrow_mut().stores[0].take_changes(&Codec::default()).expect("changes");
        assert_eq!(changes.len(), 1);
        assert_eq!(changes[0].committed, Some(Codec::default().encode(&1u64).expect("enc")));
        assert_eq!(changes[0].value, Some(Codec::default().encode(&4u64).expect("enc")));
        // An undeclared store or other types are named.
        assert!(Store::open(&set, &StoreDef::<String, u64>::new("other")).is_err());
        assert!(Store::open(&set, &StoreDef::<u64, u64>::new("counts")).is_err());
    }

    #[test]
    fn a_held_message_is_undone_alone_unless_a_later_callback_changed_its_keys() {
        let def = StoreDef::<String, u64>::new("counts");
        let set = RefCell::new(StoreSet::new(&[maker(def)], Codec::default()));
        let store = Store::open(&set, &def).expect("declared");
        store.put("a".into(), 1).expect("put");
        set.borrow_mut().end_callback(true);
        // Message 7 changes a and b and is not finished; message 8 changes c only.
        store.put("a".into(), 2).expect("put");
        store.put("b".into(), 1).expect("put");
        set.borrow_mut().end_callback_held(7);
        store.put("c".into(), 1).expect("put");
        set.borrow_mut().end_callback_held(8);
        assert!(set.borrow_mut().undo(7), "nothing later touched a or b");
        assert_eq!((store.get(&"a".into()), store.get(&"b".into()), store.get(&"c".into())), (Some(1), None, Some(1)));
        // Undone twice is a no-op; a released message keeps its changes.
        assert!(set.borrow_mut().undo(7));
        set.borrow_mut().release(8);
        assert!(set.borrow_mut().undo(8));
        assert_eq!(store.get(&"c".into()), Some(1));
        // Message 9 changes a; a hook (not held) changes a after it: tied.
        store.put("a".into(), 5).expect("put");
        set.borrow_mut().end_callback_held(9);
        store.put("a".into(), 6).expect("put");
        set.borrow_mut().end_callback(true);
        assert!(!set.borrow_mut().undo(9), "a later change to its key ties it");
        assert_eq!(store.get(&"a".into()), Some(6), "nothing undone");
        // What is written is the net change against the last commit.
        let changes = set.borrow_mut().stores[0].take_changes(&Codec::default()).expect("changes");
        let keys: Vec<&str> = changes.iter().map(|c| c.key_hex.as_str()).collect();
        assert_eq!(keys.len(), 2, "a and c changed, b changed back: {keys:?}");
    }

    #[test]
    fn a_value_over_half_the_payload_limit_is_refused_at_put() {
        let def = StoreDef::<String, Vec<u8>>::new("blobs");
        let set = RefCell::new(StoreSet::new(&[maker(def)], Codec::default()).with_max_payload(10_000));
        let limit = set.borrow().value_limit();
        assert_eq!(limit, max_value_bytes(10_000));
        let store = Store::open(&set, &def).expect("declared");
        // A Vec<u8> of n bytes encodes to n plus its length's varint.
        store.put("small".into(), vec![0; limit - 3]).expect("fits");
        let err = store.put("big".into(), vec![0; limit]).expect_err("too large");
        assert!(
            matches!(&err, StoreError::ValueTooLarge { store: "blobs", size, limit: l, .. } if *size > limit && *l == limit),
            "{err:?}"
        );
        assert!(err.to_string().contains(&limit.to_string()), "{err}");
        assert_eq!(store.get(&"big".into()), None, "nothing written");
        let task: TaskError = err.into();
        assert!(matches!(task, TaskError::Permanent { reason: "too-large", .. }), "{task:?}");
        let long_key = "k".repeat(MAX_KEY_BYTES + 1);
        assert!(matches!(store.put(long_key, vec![]), Err(StoreError::KeyTooLarge { .. })));
    }

    #[test]
    fn prefix_and_range_scans_are_ordered() {
        let set = RefCell::new(StoreSet::new(&[maker(StoreDef::<String, u64>::new("s"))], Codec::default()));
        let store = Store::open(&set, &StoreDef::<String, u64>::new("s")).expect("declared");
        for (k, v) in [("b/2", 2), ("a/1", 1), ("b/1", 3), ("c", 4)] {
            store.put(k.into(), v).expect("put");
        }
        assert_eq!(store.prefix("b/"), vec![("b/1".to_owned(), 3), ("b/2".to_owned(), 2)]);
        assert_eq!(store.range("b".to_owned().."c".to_owned()).len(), 2);
        assert_eq!(store.entries().first().map(|e| e.0.clone()), Some("a/1".to_owned()));
    }
}
