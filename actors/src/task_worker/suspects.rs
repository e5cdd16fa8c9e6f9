//! The worker's side of suspects ([`Suspects`](flotilla_proto::partition::intake::Suspects)): the node's
//! suspect lane, and the partition's record in the job's `SUSPECTS` bucket, counted
//! before a suspect starts, taken back once it outlived its window
//! ([`SUSPECT_WINDOW`]) with its owner alive, counted again when it ends its owner in
//! sight, and cleared when it finishes.

use super::{SUSPECTS, SuspectRecord, TaskWorker, ev, now};
use crate::task::Task;
use actix::prelude::*;
use flotilla_proto::partition::intake::{SUSPECT_WINDOW, SuspectVerdict};
use flotilla_transport::broker::BrokerError;
use futures::future::LocalBoxFuture;
use std::time::Duration;
use tracing::{debug, warn};

impl<T: Task> TaskWorker<T> {
    /// Before a suspect starts: waits for the node's suspect lane (one suspect runs at
    /// a time per node), then counts it in the job's KV, or dead-letters it as
    /// `crash-loop` when it already ended `crash_limit` owners. It starts (as a retry
    /// does, once the task is home) when the count is stored. When the count cannot be
    /// stored it starts uncounted: the count is a safety net, and a wedged partition
    /// would be worse.
    pub(super) fn count_suspect(&mut self, order: u64, seq: u64, ctx: &mut Context<Self>) {
        let Some(suspects) = self.part.suspects() else { return };
        let lane = self.env.suspect_lane.clone();
        let change = self.change_suspects();
        let committed = self.part.committed();
        let fut = async move {
            let permit = lane.acquire_owned().await.ok();
            let verdict = change(Box::new(move |record| match suspects.judge(record, seq, committed) {
                SuspectVerdict::Start(record) => (Some(record), None),
                SuspectVerdict::Quarantine { starts } => (None, Some(starts)),
            }))
            .await;
            (verdict, permit)
        };
        ctx.spawn(fut.into_actor(self).map(move |(verdict, permit), act, ctx| {
            act.lane = permit.map(|p| (seq, Some(p)));
            let quarantined = match verdict {
                Ok(None) => {
                    ctx.run_later(SUSPECT_WINDOW, move |act, ctx| act.suspect_outlived(seq, ctx));
                    None
                }
                Ok(Some(starts)) => {
                    debug!(stream = act.binding.stream, partition = act.binding.partition, seq, starts, "message ended its owner every time it ran: dead-lettering it");
                    Some(starts)
                }
                Err(e) => {
                    warn!(stream = act.binding.stream, partition = act.binding.partition, seq, error = %e, "could not count a suspect message; running it uncounted");
                    None
                }
            };
            act.part.handle(ev::SuspectJudged { order, quarantined }, now());
            act.drive(ctx);
        }));
    }

    /// The counted suspect at `seq` has run (this attempt) for [`SUSPECT_WINDOW`] with its
    /// owner alive: store its start taken back, so that what ends the owner from now on
    /// is not blamed on it, then free the node's suspect lane for the next suspect. Until
    /// then (an attempt that started later, a back-off between attempts) it looks again
    /// when the window would be over. A take-back that cannot be stored keeps the lane
    /// and is tried again a window later.
    fn suspect_outlived(&mut self, seq: u64, ctx: &mut Context<Self>) {
        let (Some(suspects), Some((running, Some(_)))) = (self.part.suspects(), &self.lane) else { return };
        if *running != seq {
            return;
        }
        let Some(held) = self.part.held_at(seq) else { return };
        let ran = held
            .started
            .map_or(Duration::ZERO, |at| tokio::time::Instant::now().into_std().saturating_duration_since(at));
        if ran < SUSPECT_WINDOW {
            ctx.run_later(SUSPECT_WINDOW - ran, move |act, ctx| act.suspect_outlived(seq, ctx));
            return;
        }
        let permit = self.lane.as_mut().and_then(|(_, permit)| permit.take());
        let committed = self.part.committed();
        let stored =
            self.change_suspects()(Box::new(move |record| (Some(suspects.outlived(record, seq, committed)), ())));
        ctx.spawn(stored.into_actor(self).map(move |result, act, ctx| match result {
            Ok(()) => {
                debug!(stream = act.binding.stream, partition = act.binding.partition, seq, "suspect outlived its window: no longer blamed for its owner's end");
                drop(permit);
            }
            Err(e) => {
                debug!(stream = act.binding.stream, partition = act.binding.partition, seq, error = %e, "suspect's window not stored: it stays counted and keeps the lane");
                if let Some((running, held @ None)) = &mut act.lane
                    && *running == seq
                {
                    *held = permit;
                    ctx.run_later(SUSPECT_WINDOW, move |act, ctx| act.suspect_outlived(seq, ctx));
                }
            }
        }));
    }

    /// The message at `order` ended its owner in sight (its callback timed out, or it
    /// failed the task). A suspect still counted needs nothing (its start stays in the
    /// record); one that outlived its window is counted again.
    pub(super) fn suspect_ended_owner(&mut self, order: u64) {
        let Some(suspects) = self.part.suspects() else { return };
        let Some(seq) = self.part.held(order).map(|h| h.msg.delivery.info.stream_seq) else { return };
        if !matches!(&self.lane, Some((running, None)) if *running == seq) {
            return;
        }
        let committed = self.part.committed();
        let stored =
            self.change_suspects()(Box::new(move |record| (Some(suspects.ended_owner(record, seq, committed)), ())));
        actix::spawn(async move {
            if let Err(e) = stored.await {
                warn!(error = %e, seq, "a suspect that ended its owner was not counted again");
            }
        });
    }

    /// The suspect at `seq` finished: store that (it leaves the record), then free the
    /// node's suspect lane for the next.
    pub(super) fn suspect_finished(&mut self, seq: u64) {
        let (Some(suspects), Some((running, _))) = (self.part.suspects(), &self.lane) else { return };
        if *running != seq {
            return;
        }
        let permit = self.lane.take();
        let committed = self.part.committed();
        let stored =
            self.change_suspects()(Box::new(move |record| (Some(suspects.finish(record, seq, committed)), ())));
        actix::spawn(async move {
            if let Err(e) = stored.await {
                debug!(error = %e, seq, "finished suspect not stored; a later owner may count it once more");
            }
            drop(permit);
        });
    }

    /// A function that reads this partition's suspect record, lets `decide` say what
    /// to store (and what to answer), and stores it by compare-and-set, again on a race.
    #[allow(clippy::type_complexity)]
    fn change_suspects<R: 'static>(
        &self,
    ) -> impl FnOnce(
        Box<dyn Fn(SuspectRecord) -> (Option<SuspectRecord>, R)>,
    ) -> LocalBoxFuture<'static, Result<R, BrokerError>>
    + 'static {
        let broker = self.env.broker.clone();
        let bucket = self.env.subjects.bucket_name(SUSPECTS);
        let key = self.suspects_key();
        move |decide| {
            Box::pin(async move {
                use flotilla_transport::kv::{Edit, TypedKey};
                let suspects = TypedKey::<SuspectRecord>::new(broker, bucket, key).with_tries(5);
                let answer = suspects
                    .modify(|record| match decide(record.unwrap_or_default()) {
                        (None, answer) => Edit::Keep(answer),
                        // Nothing suspect any more: the record goes.
                        (Some(record), answer) if record.started.is_empty() => Edit::Delete(answer),
                        (Some(record), answer) => Edit::Write(record, answer),
                    })
                    .await?;
                Ok(answer)
            })
        }
    }

    fn suspects_key(&self) -> String {
        format!("{}.{}", self.binding.stream, self.binding.partition.unwrap_or(0))
    }
}
