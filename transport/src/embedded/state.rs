//! The embedded broker's state: streams, consumers and core subscriptions, as plain
//! data behind one lock. Every method takes `now` so the clock stays outside.

use crate::broker::compare::{subject_matches, subjects_overlap};
use crate::broker::{
    AckKind, AckPolicy, AckToken, AckTokenInner, BrokerError, BrokerResult, ConsumerSpec, ConsumerState, CoreMessage,
    Delivery, DeliveryInfo, Discard, KvEntry, KvOperation, OutboundMessage, PublishAck, Retention, StoredMessage,
    StreamSpec, StreamState,
};
use crate::wire::Headers;
use bytes::Bytes;
use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::SystemTime;
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

/// The header KV writes carry to mark deletes and purges, as in NATS.
pub(crate) const KV_OPERATION: &str = "KV-Operation";

pub(crate) struct Stored {
    pub subject: Arc<str>,
    pub headers: Headers,
    pub payload: Bytes,
    pub published: SystemTime,
    pub stored_at: Instant,
}

impl Stored {
    /// Its bytes as a server counts them: subject, headers and payload.
    fn size(&self) -> u64 {
        let headers: usize = self.headers.iter().map(|(name, value)| name.len() + value.len() + 4).sum();
        (self.subject.len() + headers + self.payload.len()) as u64
    }
}

pub(crate) struct Pending {
    pub count: u64,
    pub deadline: Instant,
}

pub(crate) struct Consumer {
    pub spec: ConsumerSpec,
    pub name: Arc<str>,
    /// Next stream sequence to look at for a first delivery.
    pub next_seq: u64,
    pub consumer_seq: u64,
    pub pending: BTreeMap<u64, Pending>,
    /// Messages that reached max deliveries: never redelivered, ack floor stuck below.
    pub stranded: BTreeSet<u64>,
    /// Undelivered matching messages at or after `next_seq`.
    pub num_pending: u64,
    /// Highest stream sequence below which every delivered message is acked.
    pub ack_floor: u64,
    /// Acked sequences above `ack_floor` (acked out of order).
    pub acked_above: BTreeSet<u64>,
    pub last_delivered: u64,
    /// Wakes this consumer's waiting claims (one per consumer, so a publish wakes only
    /// the claims it can feed, not every partition's).
    pub notify: Arc<Notify>,
}

impl Consumer {
    fn matches(&self, subject: &str) -> bool {
        self.spec.filter_subject.as_deref().is_none_or(|f| subject_matches(f, subject))
    }

    /// Whether this consumer is done with `seq` (acked, terminated or never interested).
    fn done_with(&self, seq: u64, subject: &str) -> bool {
        !self.matches(subject)
            || (seq < self.next_seq && !self.pending.contains_key(&seq) && !self.stranded.contains(&seq))
    }

    /// Moves the ack floor up after acks: to the highest acked sequence below the
    /// lowest unacked one (as JetStream reports it), or to the last delivered one when
    /// nothing is unacked.
    fn advance_floor(&mut self) {
        let low = [self.pending.keys().next(), self.stranded.iter().next()].into_iter().flatten().min().copied();
        match low {
            None => {
                self.ack_floor = self.ack_floor.max(self.last_delivered);
                self.acked_above.clear();
            }
            Some(low) => {
                let above = self.acked_above.split_off(&low);
                if let Some(&top) = self.acked_above.iter().next_back() {
                    self.ack_floor = self.ack_floor.max(top);
                }
                self.acked_above = above;
            }
        }
    }
}

pub(crate) struct KvWatcher {
    pub pattern: String,
    pub tx: mpsc::UnboundedSender<BrokerResult<KvEntry>>,
}

pub(crate) struct Stream {
    pub spec: StreamSpec,
    pub name: Arc<str>,
    pub msgs: BTreeMap<u64, Stored>,
    /// The bytes of `msgs` (subject, headers and payload of each).
    pub bytes: u64,
    pub last_seq: u64,
    // Fx hashing: these are looked up for every message stored, taken and acked.
    pub by_subject: FxHashMap<Arc<str>, BTreeSet<u64>>,
    pub dedupe: FxHashMap<String, u64>,
    pub dedupe_order: VecDeque<(Instant, String)>,
    pub consumers: BTreeMap<String, Consumer>,
    /// Which consumers a subject can match, so a message touches only those.
    pub index: ConsumerIndex,
    pub kv_watchers: Vec<KvWatcher>,
    /// For KV streams, the bucket name.
    pub kv_bucket: Option<String>,
}

/// The consumers of a stream by exact filter subject, and those with a wildcard or no
/// filter. A stream of 10,000 partitions has 10,000 consumers: a publish, an ack or a
/// removal must not test every one of them.
#[derive(Debug, Default)]
pub(crate) struct ConsumerIndex {
    exact: FxHashMap<String, Vec<String>>,
    other: BTreeSet<String>,
}

impl ConsumerIndex {
    fn exact_filter(spec: &ConsumerSpec) -> Option<&str> {
        spec.filter_subject.as_deref().filter(|f| !f.contains(['*', '>']))
    }

    fn add(&mut self, spec: &ConsumerSpec) {
        match Self::exact_filter(spec) {
            Some(f) => self.exact.entry(f.to_owned()).or_default().push(spec.name.clone()),
            None => {
                self.other.insert(spec.name.clone());
            }
        }
    }

    fn remove(&mut self, spec: &ConsumerSpec) {
        match Self::exact_filter(spec) {
            Some(f) => {
                if let Some(names) = self.exact.get_mut(f) {
                    names.retain(|n| *n != spec.name);
                    if names.is_empty() {
                        self.exact.remove(f);
                    }
                }
            }
            None => {
                self.other.remove(&spec.name);
            }
        }
    }

    /// Names of the consumers that may match `subject` (callers still check `matches`
    /// for those with a wildcard filter).
    fn candidates<'a>(&'a self, subject: &str) -> impl Iterator<Item = &'a String> + 'a {
        self.exact.get(subject).into_iter().flatten().chain(self.other.iter())
    }
}

/// A MAX_DELIVERIES advisory to publish after the lock is released.
pub(crate) struct Advisory {
    pub subject: String,
    pub payload: Bytes,
}

impl Stream {
    pub fn new(spec: StreamSpec) -> Self {
        let kv_bucket = spec.name.strip_prefix("KV_").map(str::to_owned);
        Self {
            name: Arc::from(spec.name.as_str()),
            spec,
            msgs: BTreeMap::new(),
            bytes: 0,
            last_seq: 0,
            by_subject: FxHashMap::default(),
            dedupe: FxHashMap::default(),
            dedupe_order: VecDeque::new(),
            consumers: BTreeMap::new(),
            index: ConsumerIndex::default(),
            kv_watchers: Vec::new(),
            kv_bucket,
        }
    }

    /// The waker of `consumer`'s claims, if it exists.
    pub fn consumer_notify(&self, consumer: &str) -> Option<Arc<Notify>> {
        self.consumers.get(consumer).map(|c| c.notify.clone())
    }

    pub fn state(&self) -> StreamState {
        StreamState {
            name: self.spec.name.clone(),
            messages: self.msgs.len() as u64,
            first_seq: self.msgs.keys().next().copied().unwrap_or(self.last_seq + 1),
            last_seq: self.last_seq,
            consumers: self.consumers.len(),
            subjects: self.spec.subjects.clone(),
            bytes: self.bytes,
            first_published: self.msgs.values().next().map(|m| m.published),
        }
    }

    /// Drops messages past `max_age` and dedupe entries past the window.
    pub fn expire(&mut self, now: Instant) {
        if let Some(age) = self.spec.max_age {
            while let Some((&seq, m)) = self.msgs.first_key_value() {
                if m.stored_at + age > now {
                    break;
                }
                self.remove(seq);
            }
        }
        let window = self.spec.duplicate_window;
        while let Some((at, _)) = self.dedupe_order.front() {
            if *at + window > now {
                break;
            }
            if let Some((_, id)) = self.dedupe_order.pop_front() {
                self.dedupe.remove(&id);
            }
        }
    }

    /// Removes one message from the stream and from every consumer's bookkeeping.
    pub fn remove(&mut self, seq: u64) -> bool {
        let Some(m) = self.msgs.remove(&seq) else { return false };
        self.bytes = self.bytes.saturating_sub(m.size());
        if let Some(set) = self.by_subject.get_mut(&m.subject) {
            set.remove(&seq);
            if set.is_empty() {
                self.by_subject.remove(&m.subject);
            }
        }
        let Stream { consumers, index, .. } = self;
        for name in index.candidates(&m.subject) {
            if let Some(c) = consumers.get_mut(name)
                && c.matches(&m.subject)
            {
                if seq >= c.next_seq {
                    c.num_pending = c.num_pending.saturating_sub(1);
                }
                c.stranded.remove(&seq);
            }
        }
        true
    }

    pub fn last_for_subject(&self, subject: &str) -> Option<u64> {
        self.by_subject.get(subject).and_then(|s| s.iter().next_back().copied())
    }

    /// Stores a message; the caller has matched the subject to this stream.
    pub fn store(&mut self, msg: OutboundMessage, now: Instant, system_now: SystemTime) -> BrokerResult<PublishAck> {
        self.expire(now);
        let id = msg.headers.msg_id().map(str::to_owned);
        if let Some(id) = &id
            && let Some(&seq) = self.dedupe.get(id)
        {
            return Ok(PublishAck { stream: self.spec.name.clone(), seq, duplicate: true });
        }
        super::expect::check(&msg.headers, &msg.subject, &self.spec.name, self.last_seq, || {
            self.last_for_subject(&msg.subject).unwrap_or(0)
        })?;
        if let Some(expected) = msg.expected_last_subject_seq {
            let actual = self.last_for_subject(&msg.subject).unwrap_or(0);
            if actual != expected {
                return Err(BrokerError::WrongLastSequence { subject: msg.subject, expected, actual });
            }
        }
        if let Some(max) = self.spec.max_msgs
            && self.msgs.len() as u64 >= max
        {
            match self.spec.discard {
                Discard::New => {
                    return Err(BrokerError::other(
                        format!("publish to {}", msg.subject),
                        format!("stream {} is full: maximum messages exceeded", self.spec.name),
                    ));
                }
                Discard::Old => {
                    if let Some(&first) = self.msgs.keys().next() {
                        self.remove(first);
                    }
                }
            }
        }
        self.last_seq += 1;
        let seq = self.last_seq;
        if let Some(id) = id {
            self.dedupe.insert(id.clone(), seq);
            self.dedupe_order.push_back((now, id));
        }
        let subject: Arc<str> = self
            .by_subject
            .get_key_value(msg.subject.as_str())
            .map(|(k, _)| k.clone())
            .unwrap_or_else(|| Arc::from(msg.subject.as_str()));
        // Interest retention with nobody interested stores nothing (but still acks).
        let interested = self.spec.retention != Retention::Interest
            || self.index.candidates(&subject).any(|n| self.consumers.get(n).is_some_and(|c| c.matches(&subject)));
        if interested {
            let Stream { consumers, index, .. } = &mut *self;
            for name in index.candidates(&subject) {
                if let Some(c) = consumers.get_mut(name)
                    && c.matches(&subject)
                {
                    c.num_pending += 1;
                }
            }
            self.by_subject.entry(subject.clone()).or_default().insert(seq);
            let stored = Stored {
                subject: subject.clone(),
                headers: msg.headers,
                payload: msg.payload,
                published: system_now,
                stored_at: now,
            };
            self.bytes += stored.size();
            self.msgs.insert(seq, stored);
            if let Some(limit) = self.spec.max_msgs_per_subject {
                let over: Vec<u64> = match self.by_subject.get(&subject) {
                    Some(set) if set.len() as u64 > limit => {
                        set.iter().take(set.len() - limit as usize).copied().collect()
                    }
                    _ => Vec::new(),
                };
                for old in over {
                    self.remove(old);
                }
            }
            self.notify_kv_watchers(seq);
            for name in self.index.candidates(&subject) {
                if let Some(c) = self.consumers.get(name)
                    && c.matches(&subject)
                {
                    c.notify.notify_waiters();
                }
            }
        }
        Ok(PublishAck { stream: self.spec.name.clone(), seq, duplicate: false })
    }

    fn notify_kv_watchers(&mut self, seq: u64) {
        if self.kv_watchers.is_empty() {
            return;
        }
        let Some(entry) = self.kv_entry(seq) else { return };
        let subject = self.msgs.get(&seq).map(|m| m.subject.clone());
        if let Some(subject) = subject {
            self.kv_watchers.retain(|w| {
                !w.tx.is_closed() && (!subject_matches(&w.pattern, &subject) || w.tx.send(Ok(entry.clone())).is_ok())
            });
        }
    }

    /// The KV entry stored at `seq`, for a KV stream.
    /// The current entry of every key whose subject matches `pattern`, in revision order.
    pub fn kv_current(&self, pattern: &str) -> Vec<KvEntry> {
        let mut current: Vec<u64> = self
            .by_subject
            .iter()
            .filter(|(subject, _)| subject_matches(pattern, subject))
            .filter_map(|(_, seqs)| seqs.iter().next_back().copied())
            .collect();
        current.sort_unstable();
        current.into_iter().filter_map(|seq| self.kv_entry(seq)).collect()
    }

    pub fn kv_entry(&self, seq: u64) -> Option<KvEntry> {
        let bucket = self.kv_bucket.as_ref()?;
        let m = self.msgs.get(&seq)?;
        let key = crate::wire::Subjects::kv_key(bucket, &m.subject)?.to_owned();
        let operation = match m.headers.get(KV_OPERATION) {
            Some("DEL") => KvOperation::Delete,
            Some("PURGE") => KvOperation::Purge,
            _ => KvOperation::Put,
        };
        Some(KvEntry { bucket: bucket.clone(), key, value: m.payload.clone(), revision: seq, operation })
    }

    pub fn add_consumer(&mut self, spec: ConsumerSpec) -> BrokerResult<()> {
        if self.spec.retention == Retention::WorkQueue {
            if spec.ack_policy != AckPolicy::Explicit {
                return Err(BrokerError::other(
                    format!("create consumer {}", spec.name),
                    "workqueue stream requires explicit ack",
                ));
            }
            for other in self.consumers.values() {
                let overlap = match (&spec.filter_subject, &other.spec.filter_subject) {
                    (Some(a), Some(b)) => subjects_overlap(a, b),
                    _ => true,
                };
                if overlap {
                    return Err(BrokerError::other(
                        format!("create consumer {}", spec.name),
                        "filtered consumer not unique on workqueue stream",
                    ));
                }
            }
        }
        let mut c = Consumer {
            name: Arc::from(spec.name.as_str()),
            spec,
            next_seq: 1,
            consumer_seq: 0,
            pending: BTreeMap::new(),
            stranded: BTreeSet::new(),
            num_pending: 0,
            ack_floor: 0,
            acked_above: BTreeSet::new(),
            last_delivered: 0,
            notify: Arc::new(Notify::new()),
        };
        c.num_pending = self.msgs.values().filter(|m| c.matches(&m.subject)).count() as u64;
        self.index.add(&c.spec);
        self.consumers.insert(c.spec.name.clone(), c);
        Ok(())
    }

    /// Removes a consumer (waking its claims, which then find it gone).
    pub fn remove_consumer(&mut self, name: &str) -> Option<Consumer> {
        let old = self.consumers.remove(name)?;
        self.index.remove(&old.spec);
        old.notify.notify_waiters();
        Some(old)
    }

    /// Applies changed settings to an existing consumer.
    pub fn update_consumer(&mut self, spec: ConsumerSpec) {
        let Stream { consumers, index, .. } = self;
        if let Some(c) = consumers.get_mut(&spec.name) {
            index.remove(&c.spec);
            index.add(&spec);
            c.spec = spec;
        }
    }

    /// Replaces a consumer with one that delivers from `start_seq` on.
    pub fn reset_consumer(&mut self, spec: ConsumerSpec, start_seq: u64) -> BrokerResult<()> {
        self.remove_consumer(&spec.name);
        let name = spec.name.clone();
        self.add_consumer(spec)?;
        let Stream { msgs, consumers, .. } = self;
        if let Some(c) = consumers.get_mut(&name) {
            c.next_seq = start_seq.max(1);
            c.ack_floor = start_seq.saturating_sub(1);
            c.last_delivered = start_seq.saturating_sub(1);
            c.num_pending = msgs.range(c.next_seq..).filter(|(_, m)| c.matches(&m.subject)).count() as u64;
            c.notify.notify_waiters();
        }
        Ok(())
    }

    pub fn consumer_state(&self, name: &str) -> BrokerResult<ConsumerState> {
        let c = self.consumer(name)?;
        Ok(ConsumerState {
            stream: self.spec.name.clone(),
            name: name.to_owned(),
            spec: c.spec.clone(),
            num_pending: c.num_pending,
            num_ack_pending: c.pending.len() as u64,
            num_redelivered: c.pending.values().filter(|p| p.count > 1).count() as u64,
            ack_floor: c.ack_floor,
            delivered: c.last_delivered,
            delivered_consumer_seq: c.consumer_seq,
        })
    }

    fn consumer(&self, name: &str) -> BrokerResult<&Consumer> {
        self.consumers
            .get(name)
            .ok_or_else(|| BrokerError::ConsumerNotFound { stream: self.spec.name.clone(), consumer: name.to_owned() })
    }

    /// Takes up to `max` deliveries: due redeliveries first, then new messages. Returns
    /// them and the earliest future redelivery deadline.
    pub fn take(
        &mut self,
        consumer: &str,
        max: usize,
        now: Instant,
        advisories: &mut Vec<Advisory>,
    ) -> BrokerResult<(Vec<Delivery>, Option<Instant>)> {
        self.expire(now);
        let Stream { msgs, consumers, by_subject, name: stream_name, spec, .. } = self;
        let c = consumers.get_mut(consumer).ok_or_else(|| BrokerError::ConsumerNotFound {
            stream: spec.name.clone(),
            consumer: consumer.to_owned(),
        })?;
        let ack_wait = c.spec.ack_wait;
        let mut out = Vec::new();
        let mut gone = Vec::new();
        let mut stranded = Vec::new();
        let make = |c: &mut Consumer, seq: u64, m: &Stored, count: u64| {
            c.consumer_seq += 1;
            Delivery {
                subject: m.subject.clone(),
                headers: m.headers.clone(),
                payload: m.payload.clone(),
                info: DeliveryInfo {
                    stream: stream_name.clone(),
                    consumer: c.name.clone(),
                    stream_seq: seq,
                    consumer_seq: c.consumer_seq,
                    delivered: count,
                    pending: 0,
                    published: m.published,
                },
                token: AckToken(AckTokenInner::Embedded { stream: stream_name.clone(), consumer: c.name.clone(), seq }),
            }
        };
        // Due redeliveries, in stream order.
        let due: Vec<u64> = c.pending.iter().filter(|(_, p)| p.deadline <= now).map(|(s, _)| *s).collect();
        for seq in due {
            if out.len() >= max {
                break;
            }
            let Some(m) = msgs.get(&seq) else {
                gone.push(seq);
                continue;
            };
            let count = c.pending.get(&seq).map_or(0, |p| p.count);
            if c.spec.max_deliver.is_some_and(|limit| count >= u64::from(limit)) {
                stranded.push((seq, count));
                continue;
            }
            if let Some(p) = c.pending.get_mut(&seq) {
                p.count += 1;
                p.deadline = now + ack_wait;
            }
            let d = make(c, seq, m, count + 1);
            out.push(d);
        }
        for seq in gone {
            c.pending.remove(&seq);
        }
        for (seq, count) in stranded {
            c.pending.remove(&seq);
            c.stranded.insert(seq);
            advisories.push(Advisory {
                subject: format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{}.{}", spec.name, c.spec.name),
                payload: Bytes::from(
                    serde_json::json!({
                        "type": "io.nats.jetstream.advisory.v1.max_deliver",
                        "stream": spec.name, "consumer": c.spec.name,
                        "stream_seq": seq, "deliveries": count,
                    })
                    .to_string(),
                ),
            });
        }
        // First deliveries: one walk over the messages at or after the consumer's next
        // sequence that its filter matches (by subject when the filter is exact).
        let filter = c.spec.filter_subject.clone();
        let from = c.next_seq;
        let candidates: Box<dyn Iterator<Item = (u64, &Stored)> + '_> =
            match filter.as_deref().filter(|f| !f.contains(['*', '>'])) {
                Some(exact) => Box::new(
                    by_subject
                        .get(exact)
                        .into_iter()
                        .flat_map(move |seqs| seqs.range(from..))
                        .filter_map(|seq| msgs.get(seq).map(|m| (*seq, m))),
                ),
                None => Box::new(
                    msgs.range(from..)
                        .filter(|(_, m)| filter.as_deref().is_none_or(|f| subject_matches(f, &m.subject)))
                        .map(|(seq, m)| (*seq, m)),
                ),
            };
        let mut exhausted = true;
        for (seq, m) in candidates {
            if out.len() >= max || c.spec.max_ack_pending.is_some_and(|cap| c.pending.len() >= cap as usize) {
                exhausted = false;
                break;
            }
            c.next_seq = seq + 1;
            c.num_pending = c.num_pending.saturating_sub(1);
            c.last_delivered = c.last_delivered.max(seq);
            c.pending.insert(seq, Pending { count: 1, deadline: now + ack_wait });
            let d = make(c, seq, m, 1);
            out.push(d);
        }
        if exhausted {
            // Nothing more matches: later messages start after the stream's last.
            c.next_seq = c.next_seq.max(spec_last(msgs) + 1);
        }
        let remaining = c.num_pending;
        let n = out.len() as u64;
        for (i, d) in out.iter_mut().enumerate() {
            d.info.pending = remaining + (n - 1 - i as u64);
        }
        let next_deadline = c.pending.values().map(|p| p.deadline).min();
        Ok((out, next_deadline))
    }

    /// Applies an acknowledgement. Like JetStream, acks are not fenced: a stale holder's
    /// ack lands too.
    pub fn ack(&mut self, consumer: &str, seq: u64, kind: AckKind, now: Instant) -> BrokerResult<()> {
        let retention = self.spec.retention;
        let c = self.consumers.get_mut(consumer).ok_or_else(|| BrokerError::ConsumerNotFound {
            stream: self.spec.name.clone(),
            consumer: consumer.to_owned(),
        })?;
        let mut done: Vec<u64> = Vec::new();
        match kind {
            AckKind::Ack if c.spec.ack_policy == AckPolicy::All => {
                if seq <= c.last_delivered {
                    let above = c.pending.split_off(&(seq + 1));
                    done.extend(c.pending.keys().copied());
                    c.pending = above;
                    let above = c.stranded.split_off(&(seq + 1));
                    done.extend(c.stranded.iter().copied());
                    c.stranded = above;
                    c.acked_above = c.acked_above.split_off(&(seq + 1));
                    c.ack_floor = c.ack_floor.max(seq);
                    c.advance_floor();
                }
            }
            AckKind::Ack | AckKind::Term => {
                if c.pending.remove(&seq).is_some() {
                    done.push(seq);
                    let lowest_held = [c.pending.keys().next(), c.stranded.iter().next()].into_iter().flatten().min();
                    if c.acked_above.is_empty() && lowest_held.is_none_or(|&low| seq < low) {
                        // Acked in order (the usual case): the floor moves up to it, with
                        // nothing to remember above it.
                        c.ack_floor = c.ack_floor.max(seq);
                        if lowest_held.is_none() {
                            c.ack_floor = c.ack_floor.max(c.last_delivered);
                        }
                    } else {
                        c.acked_above.insert(seq);
                        c.advance_floor();
                    }
                }
            }
            AckKind::Nak(delay) => {
                if let Some(p) = c.pending.get_mut(&seq) {
                    p.deadline = now + delay.unwrap_or_default();
                }
            }
            AckKind::InProgress => {
                let wait = c.spec.ack_wait;
                if let Some(p) = c.pending.get_mut(&seq) {
                    p.deadline = now + wait;
                }
            }
        }
        match retention {
            Retention::Limits => {}
            Retention::WorkQueue => {
                for seq in done {
                    self.remove(seq);
                }
            }
            Retention::Interest => {
                for seq in done {
                    let all_done = match self.msgs.get(&seq) {
                        Some(m) => self.consumers.values().all(|c| c.done_with(seq, &m.subject)),
                        None => false,
                    };
                    if all_done {
                        self.remove(seq);
                    }
                }
            }
        }
        // An ack (or nak) can make room or a redelivery for this consumer only.
        if let Some(c) = self.consumers.get(consumer) {
            c.notify.notify_waiters();
        }
        Ok(())
    }

    /// The first message at or after `seq` on a subject matching `pattern`.
    pub fn next_for(&self, seq: u64, pattern: &str) -> Option<StoredMessage> {
        let (&found, _) =
            self.msgs.range(seq..).find(|(_, m)| crate::broker::compare::subject_matches(pattern, &m.subject))?;
        self.get(found)
    }

    pub fn get(&self, seq: u64) -> Option<StoredMessage> {
        self.msgs.get(&seq).map(|m| StoredMessage {
            subject: m.subject.to_string(),
            seq,
            headers: m.headers.clone(),
            payload: m.payload.clone(),
            published: m.published,
        })
    }
}

fn spec_last(msgs: &BTreeMap<u64, Stored>) -> u64 {
    msgs.keys().next_back().copied().unwrap_or(0)
}

pub(crate) struct Subscription {
    pub id: u64,
    pub pattern: String,
    pub queue: Option<String>,
    pub tx: mpsc::UnboundedSender<CoreMessage>,
}

/// Everything the embedded broker holds.
#[derive(Default)]
pub(crate) struct State {
    pub streams: BTreeMap<String, Stream>,
    pub route_cache: FxHashMap<String, Option<String>>,
    pub subs: Vec<Subscription>,
    pub next_id: u64,
    pub queue_rr: u64,
}

impl State {
    pub fn stream(&mut self, name: &str) -> BrokerResult<&mut Stream> {
        self.streams.get_mut(name).ok_or_else(|| BrokerError::StreamNotFound { stream: name.to_owned() })
    }

    /// The stream that takes `subject`, if any.
    pub fn route(&mut self, subject: &str) -> Option<String> {
        if let Some(hit) = self.route_cache.get(subject) {
            return hit.clone();
        }
        let found = self
            .streams
            .values()
            .find(|s| s.spec.subjects.iter().any(|p| subject_matches(p, subject)))
            .map(|s| s.spec.name.clone());
        if self.route_cache.len() > 100_000 {
            self.route_cache.clear();
        }
        self.route_cache.insert(subject.to_owned(), found.clone());
        found
    }

    /// Delivers a core message to matching subscribers (one per queue group); returns
    /// how many received it.
    pub fn deliver_core(&mut self, msg: &CoreMessage) -> usize {
        self.subs.retain(|s| !s.tx.is_closed());
        let mut delivered = 0;
        let mut groups: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, s) in self.subs.iter().enumerate() {
            if !subject_matches(&s.pattern, &msg.subject) {
                continue;
            }
            match &s.queue {
                Some(q) => groups.entry(q.as_str()).or_default().push(i),
                None => {
                    if s.tx.send(msg.clone()).is_ok() {
                        delivered += 1;
                    }
                }
            }
        }
        for members in groups.values() {
            self.queue_rr = self.queue_rr.wrapping_add(1);
            let pick = members[(self.queue_rr as usize) % members.len()];
            if self.subs[pick].tx.send(msg.clone()).is_ok() {
                delivered += 1;
            }
        }
        delivered
    }

    /// Headers of a KV write.
    pub fn kv_headers(op: KvOperation) -> Headers {
        match op {
            KvOperation::Put => Headers::new(),
            KvOperation::Delete => Headers::new().with(KV_OPERATION, "DEL"),
            KvOperation::Purge => Headers::new().with(KV_OPERATION, "PURGE").with("Nats-Rollup", "sub"),
        }
    }
}
