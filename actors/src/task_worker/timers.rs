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
//! * in memory, to the worker that did it (`Armings` in `task/durable.rs`, by lease epoch, so a later
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

pub use crate::task::durable::{ARMINGS, ARMINGS_TTL};
use crate::task::durable::{Change, timer_key};
use crate::task::{Task, TaskContext, TaskError};
use flotilla_transport::broker::BrokerError;
use flotilla_transport::wire::headers;

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
