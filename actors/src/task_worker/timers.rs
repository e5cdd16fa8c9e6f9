//! Stale fires of durable timers.
//!
//! A durable timer's fire is promoted into its partition when due, at the end. When the
//! partition lags or is paused, messages that were in it already run after the
//! promotion but before the fire; one of them may cancel the timer or arm it again, and
//! then the fire waiting behind is stale: the `timer` hook must not see it.
//!
//! Each arming has an id, in the timer message's `Flotilla-Arming` header, which the
//! promotion copies into the fire. What the task did last to each of its timers (armed
//! it with some id, or cancelled it) is known
//! * in memory, to the worker that did it ([`Armings`], by lease epoch, so a later
//!   tenure on the same node does not trust it): a fire costs no I/O in the common case;
//! * in the job's `ARMINGS` bucket, which every arming and cancel updates with the
//!   callback's outputs (so before its input is acknowledged): for the partition's next
//!   owner, and for queue inputs, which every node runs.
//!
//! A fire is stale ([`TimerChange::makes_stale`](flotilla_proto::timers::TimerChange::makes_stale),
//! the rule in `flotilla-proto`) when the last change to its timer is another arming or
//! a cancel made before the fire's place in the input. A change made while processing the fire itself
//! or a later message (the fire runs again after a crash) leaves it as it was. A fire
//! without the header (a foreign producer's, or armed before this rule) always runs.
//! Records expire after [`ARMINGS_TTL`]: a fire still waiting that long after its timer
//! was changed runs (the one case this does not cover).

use crate::task::{Task, TaskContext, TaskError};
use flotilla_transport::broker::{BrokerError, OutboundMessage};
use flotilla_transport::wire::{MessageId, Subjects, headers};
use rustc_hash::FxHashMap;
use std::cell::RefCell;
use std::time::Duration;

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
    fn known(&self, key: &str, epoch: u64) -> Option<Change> {
        self.last.borrow().get(key).filter(|(e, _)| *e == epoch).map(|(_, c)| c.clone())
    }

    fn forget(&self, key: &str) {
        self.last.borrow_mut().remove(key);
    }
}

/// Runs `task`'s `timer` hook for the durable timer `name` whose fire is being
/// processed, unless the fire is stale: then nothing runs, and the fire is done.
///
/// # Errors
/// The hook's; [`TaskError::Unavailable`] when the record cannot be read now.
pub(crate) async fn fire<T: Task>(task: &mut T, name: String, ctx: &mut TaskContext) -> Result<(), TaskError> {
    if stale(&name, ctx).await? {
        return Ok(());
    }
    task.timer(name, ctx).await
}

/// Whether the fire being processed in `ctx` is stale (see the module's doc).
async fn stale(name: &str, ctx: &TaskContext) -> Result<bool, TaskError> {
    let (Some(meta), Some(input)) = (ctx.message(), ctx.input_stream()) else { return Ok(false) };
    let Some(arming) = meta.headers.get(headers::ARMING) else { return Ok(false) };
    let (env, partition, seq) = (ctx.env(), ctx.partition(), meta.stream_seq);
    let key = timer_key(input, partition, name);
    // A queue's timers are changed by every node: only the bucket knows.
    let known = partition.and_then(|_| env.armings.known(&key, ctx.epoch()));
    let change = match known {
        Some(change) => {
            if change.arming.as_deref() == Some(arming) && !change.makes_stale(arming, seq) {
                // Its own fire: nothing older can come after it. Keep memory small.
                env.armings.forget(&key);
            }
            Some(change)
        }
        None => match env.broker.kv_get(&env.subjects.bucket_name(ARMINGS), &key).await {
            Ok(entry) => entry.and_then(|e| Change::decode(&e.value)),
            // A job provisioned by a node from before the bucket: no record.
            Err(BrokerError::BucketNotFound { .. } | BrokerError::StreamNotFound { .. }) => None,
            Err(e) if e.is_transient() => {
                return Err(TaskError::unavailable(format!("the last change to timer {name:?} cannot be read: {e}")));
            }
            Err(e) => return Err(TaskError::failed(format!("the last change to timer {name:?} cannot be read: {e}"))),
        },
    };
    let stale = change.as_ref().is_some_and(|c| c.makes_stale(arming, seq));
    if stale {
        tracing::info!(
            stream = input,
            partition,
            seq,
            timer = name,
            arming,
            "durable timer fire dropped: the timer was armed again or cancelled before the fire's turn"
        );
    }
    Ok(stale)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn armed(id: &str, at: Option<u64>) -> Change {
        Change { arming: Some(id.into()), at }
    }

    #[test]
    fn memory_is_per_tenure_and_bounded() {
        let armings = Armings::default();
        armings.note("k".into(), 5, armed("a1", Some(3)));
        assert_eq!(armings.known("k", 5), Some(armed("a1", Some(3))));
        assert_eq!(armings.known("k", 6), None, "another tenure (lease epoch) does not trust it");
        armings.forget("k");
        assert_eq!(armings.known("k", 5), None);
        for i in 0..REMEMBERED + 1 {
            armings.note(i.to_string(), 1, armed("a", None));
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
