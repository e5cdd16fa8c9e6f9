//! Durable timers as outputs: arming and cancelling write to the timer stream, and
//! record the change for the worker that judges their fires
//! ([`task_worker::timers`](crate::task_worker::timers)).

use super::{Outputs, TaskError, check_delay};
use flotilla_transport::broker::OutboundMessage;
use flotilla_transport::clock::unix_millis;
use flotilla_transport::wire::{MessageId, StreamName, Subjects, headers};
use rustc_hash::FxHashMap;
use std::cell::RefCell;
use std::time::{Duration, SystemTime};

/// The bucket of the last change to each durable timer, `FLOTILLA_<job>_ARMINGS`.
pub const ARMINGS: &str = "ARMINGS";

/// How long the last change to a durable timer is kept (30 days).
pub const ARMINGS_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// Timers whose last change a node keeps in memory; past that it forgets them all (and
/// reads the bucket for their fires).
const REMEMBERED: usize = 100_000;

/// The key of durable timer `name` of input `input`'s `partition` (`None`: the queue):
/// its timer stream subject is `…_timer.named-<key>`, and its record's key.
pub(crate) fn timer_key(input: &str, partition: Option<u32>, name: &str) -> String {
    let slot = partition.map_or_else(|| "queue".to_owned(), |p| p.to_string());
    MessageId::from_wire(format!("timer/{input}/{slot}/{name}")).derive_output_text(0)
}

/// The last change to a durable timer (the rule and the record's format are proto's).
pub(crate) use flotilla_proto::timers::TimerChange as Change;

/// The record of `change` to the timer at `key`, published with the callback's outputs
/// (a KV put on the `ARMINGS` bucket).
pub(crate) fn record(change: &Change, subjects: &Subjects, key: &str) -> OutboundMessage {
    OutboundMessage::new(Subjects::kv_subject(&subjects.bucket_name(ARMINGS), key), change.encode())
}

/// The last change each worker of this node made to its partitions' durable timers, by
/// timer key, with the lease epoch of the tenure that made it.
#[derive(Debug, Default)]
pub(crate) struct Armings {
    last: RefCell<FxHashMap<String, (u64, Change)>>,
}

impl Armings {
    /// Notes a change a callback of the tenure with `epoch` made (its outputs are on
    /// their way).
    pub(crate) fn note(&self, key: String, epoch: u64, change: Change) {
        let mut last = self.last.borrow_mut();
        if last.len() >= REMEMBERED && !last.contains_key(&key) {
            last.clear();
        }
        last.insert(key, (epoch, change));
    }

    /// The last change to the timer at `key` made in the tenure with `epoch`, if any.
    pub(crate) fn known(&self, key: &str, epoch: u64) -> Option<Change> {
        self.last.borrow().get(key).filter(|(e, _)| *e == epoch).map(|(_, c)| c.clone())
    }

    pub(crate) fn forget(&self, key: &str) {
        self.last.borrow_mut().remove(key);
    }
}

/// What a durable timer does when it comes due late (its job was down, or busy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Misfire {
    /// Fire once, however late (the default).
    #[default]
    FireLate,
    /// Skip it when it comes due more than this late. Lateness is judged when the
    /// node's timer service takes it from the timer stream (normally within a second of
    /// its time; up to 5 s after a server restart), not when the partition runs it; so
    /// give more than a few seconds.
    SkipIfLateBy(Duration),
}

impl Outputs {
    /// Arms (or re-arms: a timer of the same name is replaced) the durable timer
    /// `name` of the task's `input` partition (`partition`; `None` for a queue input),
    /// while processing the input at stream sequence `at`.
    pub(super) fn arm_timer(
        &self,
        (input, partition, at): (&str, Option<u32>, Option<u64>),
        name: &str,
        after: Duration,
        misfire: Misfire,
    ) -> Result<(), TaskError> {
        check_delay(after, &format!("durable timer {name:?}"))?;
        let (subject, target, key) = self.timer_subjects(input, partition, name)?;
        let id = self.next_id();
        let mut timer = OutboundMessage::new(subject, bytes::Bytes::new());
        timer.headers.insert(headers::MSG_ID, format!("timer-{id}"));
        timer.headers.insert(headers::ARMING, id.clone());
        timer.headers.insert(headers::KIND, headers::MessageKind::Timer.as_str());
        timer.headers.insert(headers::TIMER, name.to_owned());
        timer.headers.insert(headers::DELAY, after.as_millis().to_string());
        timer.headers.insert(headers::TARGET, target);
        timer.headers.insert(headers::SENT, unix_millis(SystemTime::now()).to_string());
        if let MisfireHeader(Some(policy)) = MisfireHeader::of(misfire) {
            timer.headers.insert(headers::MISFIRE, policy);
        }
        if let Some(tp) = &self.traceparent {
            timer.headers.insert(headers::TRACEPARENT, tp.to_string());
        }
        self.shared().buffer.borrow_mut().push(timer);
        self.timer_changed(key, partition, Change::armed(id, at));
        Ok(())
    }

    /// Cancels the durable timer `name`: a tombstone replaces it in the timer stream.
    pub(super) fn cancel_timer(
        &self,
        (input, partition, at): (&str, Option<u32>, Option<u64>),
        name: &str,
    ) -> Result<(), TaskError> {
        let (subject, _, key) = self.timer_subjects(input, partition, name)?;
        let id = self.next_id();
        let mut tombstone = OutboundMessage::new(subject, bytes::Bytes::new());
        tombstone.headers.insert(headers::MSG_ID, format!("cancel-{id}"));
        tombstone.headers.insert(headers::KIND, headers::TIMER_CANCELLED);
        tombstone.headers.insert(headers::TIMER, name.to_owned());
        self.shared().buffer.borrow_mut().push(tombstone);
        self.timer_changed(key, partition, Change::cancelled(at));
        Ok(())
    }

    /// Records `change` to the durable timer at `key` with the outputs (its fires still
    /// on their way are judged by it), and notes it for the worker of an ordered
    /// partition.
    fn timer_changed(&self, key: String, partition: Option<u32>, change: Change) {
        let shared = self.shared();
        shared.buffer.borrow_mut().push(record(&change, &self.env.subjects, &key));
        if partition.is_some() {
            shared.timer_changes.borrow_mut().push((key, change));
        }
    }

    /// The timer stream subject of durable timer `name` (the same for every arming,
    /// so a new one replaces the last), the input subject it fires into, and its key.
    fn timer_subjects(
        &self,
        input: &str,
        partition: Option<u32>,
        name: &str,
    ) -> Result<(String, String, String), TaskError> {
        if let Some(problem) = headers::entry_problem(headers::TIMER, name) {
            return Err(TaskError::failed(format!(
                "timer name {name:?} cannot be used: names travel in the {} header, and {problem}",
                headers::TIMER
            )));
        }
        let stream = StreamName::new(input).map_err(|e| TaskError::fatal(e.to_string()))?;
        let target = match partition {
            Some(p) => self.env.subjects.ordered_partition(&stream, p),
            None => self.env.subjects.queue(&stream),
        };
        let key = timer_key(input, partition, name);
        Ok((self.env.subjects.timer(&format!("named-{key}")), target, key))
    }

    /// The id of this callback's next output: derived from its cause, else new.
    fn next_id(&self) -> String {
        let shared = self.shared();
        let index = shared.next_index.get();
        shared.next_index.set(index + 1);
        match &self.cause {
            Some(cause) => cause.derive_output_text(index),
            None => MessageId::new_v7().as_str().to_owned(),
        }
    }
}

/// A misfire policy as its header value (`None` for the default).
struct MisfireHeader(Option<String>);

impl MisfireHeader {
    fn of(misfire: Misfire) -> Self {
        match misfire {
            Misfire::FireLate => Self(None),
            Misfire::SkipIfLateBy(late) => Self(Some(format!("skip:{}", late.as_millis()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_per_tenure_and_bounded() {
        let armings = Armings::default();
        armings.note("k".into(), 5, Change::armed("a1", Some(3)));
        assert_eq!(armings.known("k", 5), Some(Change::armed("a1", Some(3))));
        assert_eq!(armings.known("k", 6), None, "another tenure (lease epoch) does not trust it");
        armings.forget("k");
        assert_eq!(armings.known("k", 5), None);
        for i in 0..REMEMBERED + 1 {
            armings.note(i.to_string(), 1, Change::armed("a", None));
        }
        assert_eq!(armings.last.borrow().len(), 1, "past the bound it starts over");
    }

    #[test]
    fn keys_name_the_input_its_partition_and_the_timer() {
        // As docs/wire-format.md §3.4 gives them (Python: `uuid.uuid5(ns, "timer/in/3/a/0")`).
        let k = timer_key("in", Some(3), "a");
        assert_eq!(k, "039ed170-6813-5bb2-a98a-7929925f2d98");
        assert_eq!(timer_key("jobs", None, "a"), "baea42a9-7f17-5fe7-8def-054124eaf2de");
        assert_ne!(k, timer_key("in", Some(2), "a"));
        assert_ne!(k, timer_key("in", None, "a"));
        assert_ne!(k, timer_key("in", Some(3), "b"));
    }
}
