//! Recording that a partition is done for the run (drained, or at its end of stream)
//! in the CONTROL bucket, holding its lease until the record is stored.

use super::{Membership, Part};
use actix::prelude::*;
use bytes::Bytes;
use flotilla_actors::events::{Event, emit};
use flotilla_proto::cluster::control::{DrainedRecord, encode, keys};
use tracing::info;

/// How a partition is done for the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Done {
    /// It reached its end of stream (or its task asked to shut down).
    Ended,
    /// It processed the current drain marker.
    Drained,
}

impl Done {
    pub(super) fn name(self) -> &'static str {
        match self {
            Done::Ended => "ended",
            Done::Drained => "drained",
        }
    }

    /// The CONTROL key recording it.
    pub(super) fn key(self, (stream, partition): &Part) -> String {
        match self {
            Done::Ended => keys::ended(stream, *partition),
            Done::Drained => keys::drained(stream, *partition),
        }
    }
}

/// The wait before storing a partition's done record again after `failures` failed
/// tries: 200 ms doubling to 30 s, ±50 %.
fn record_backoff(failures: u32) -> std::time::Duration {
    flotilla_actors::retry::DONE_RECORD.wait(failures, flotilla_actors::retry::sample())
}

impl Membership {
    /// Stores that `part` is done for the run, again and again with back-off (an event
    /// each time it fails) until it is stored: meanwhile the lease is kept and renewed,
    /// with no worker running for it, so no node takes the partition up again in the
    /// run. Then it counts as done here, and its lease is released. A stop of the node
    /// tries once more ([`Deregister`](super::Deregister)), then lets it go.
    pub(super) fn record_done(&mut self, part: Part, done: Done, failures: u32, ctx: &mut Context<Self>) {
        let record = DrainedRecord { run_id: self.s.run_id.clone(), node: self.s.node.clone() };
        let value = Bytes::from(encode(&record));
        let put = self.s.broker.kv_put(&self.buckets.control, &done.key(&part), value);
        ctx.spawn(put.into_actor(self).map(move |result, act, ctx| {
            if act.gone {
                return;
            }
            match result {
                Ok(_) => {
                    if failures > 0 {
                        info!(stream = %part.0, partition = part.1, failures, "recorded that the partition is {} for the run", done.name());
                    }
                    match done {
                        Done::Ended => act.ended.insert(part.clone()),
                        Done::Drained => act.drained.insert(part.clone()),
                    };
                    if act.held.get(&part).is_some_and(|h| h.done.is_some()) {
                        act.delete_lease(&part);
                    }
                    // Whether the run (or the drain) is over: look now.
                    act.scan(ctx);
                }
                Err(e) => {
                    let failures = failures.saturating_add(1);
                    let delay = record_backoff(failures);
                    let event = Event::DoneNotRecorded {
                        stream: part.0.clone(),
                        partition: part.1,
                        node: act.s.node.clone(),
                        done: done.name().to_owned(),
                        error: e.to_string(),
                        failures,
                        retry_in_ms: u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                    };
                    emit(&act.s.broker, &act.s.subjects, event);
                    ctx.run_later(delay, move |act, ctx| act.record_done(part, done, failures, ctx));
                }
            }
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn tries_back_off_to_half_a_minute_with_jitter() {
        for _ in 0..100 {
            let first = record_backoff(1);
            assert!(first >= Duration::from_millis(100) && first <= Duration::from_millis(300), "{first:?}");
            let late = record_backoff(40);
            assert!(late >= Duration::from_secs(15) && late <= Duration::from_secs(45), "{late:?}");
        }
    }

    #[test]
    fn each_kind_has_its_key() {
        let part = ("in".to_owned(), 3);
        assert_eq!((Done::Ended.key(&part), Done::Ended.name()), ("ended.in.3".to_owned(), "ended"));
        assert_eq!((Done::Drained.key(&part), Done::Drained.name()), ("drained.in.3".to_owned(), "drained"));
    }
}
