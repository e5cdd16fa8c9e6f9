//! Supervision: stopping every worker, exiting, and restarting a failed task's worker
//! (after resetting an ordered partition at its committed position).

use super::*;

/// Cluster mode: failed resets of a partition in a row after which its lease is handed
/// back (about 10 s of backoff), so that a node never holds a partition it cannot run.
const RESETS_BEFORE_HANDING_BACK: u32 = 5;

impl Container {
    pub(super) fn stop_all(&mut self, ctx: &mut Context<Self>) {
        if self.stopping {
            return;
        }
        self.stopping = true;
        for slot in self.slots.values_mut() {
            if let (Some(w), false) = (&slot.worker, slot.finished) {
                slot.stopping = true;
                w.stop.do_send(StopWorker);
            }
        }
        let deadline = self.config.stop_timeout;
        ctx.run_later(deadline, move |act, ctx| {
            if act.exit.is_none() {
                return;
            }
            let running: Vec<String> = act
                .slots
                .values()
                .filter(|s| !s.finished && s.worker.is_some())
                .map(|s| match s.spec.partition {
                    Some(p) => format!("{} partition {p}", s.spec.stream),
                    None => s.spec.stream.to_string(),
                })
                .collect();
            let undone = format!(
                "the stop did not finish within {deadline:?}: {} still running ({}); what they held unacknowledged comes again after ack-wait, their leases expire on their own",
                running.len(),
                running.join(", ")
            );
            warn!(%undone, "workers did not stop in time; exiting anyway");
            act.failure.get_or_insert(undone);
            act.exit(ctx);
        });
        self.maybe_exit(ctx);
    }

    pub(super) fn maybe_exit(&mut self, ctx: &mut Context<Self>) {
        if self.slots.values().all(|s| s.finished || s.worker.is_none()) {
            self.exit(ctx);
        }
    }

    pub(super) fn exit(&mut self, ctx: &mut Context<Self>) {
        if let Some(tx) = self.exit.take() {
            let exit = match self.failure.take() {
                Some(reason) => ContainerExit::Failed(reason),
                None => ContainerExit::Completed,
            };
            info!(?exit, "container exits");
            let _ = tx.send(exit);
        }
        ctx.stop();
    }

    /// Starts a new worker for slot `i`, whose task failed or whose worker lost a
    /// delivery. An ordered partition is first reset at its committed position, and no
    /// worker starts until a reset succeeded: a consumer still holding the old worker's
    /// deliveries would let the new one's first ack-all cover them unprocessed.
    pub(super) fn restart(&mut self, i: usize, ctx: &mut Context<Self>) {
        let Some(s) = self.slots.get_mut(&i) else { return };
        if self.stopping || !s.restart_pending || s.resetting {
            return;
        }
        if s.spec.fence.as_ref().is_some_and(|f| !f.valid()) {
            // The lease lapsed while the task waited: the partition (and its consumer)
            // may be another node's now. End the slot instead.
            s.restart_pending = false;
            s.finished = true;
            self.report_ended(i, Outcome::Stopped);
            return;
        }
        if s.claiming {
            // The old worker's claim is still out: what it brings goes to nobody, and
            // the reset must come after it, or the new worker could get it.
            let delay = (self.config.claim_wait / 8).max(Duration::from_millis(10));
            self.timers.do_send(After { delay, target: ctx.address().recipient(), tick: Tick::Restart(i) });
            return;
        }
        let Some(spec) = s.spec.takeover.clone() else {
            s.restart_pending = false;
            self.spawn_worker(i, ctx);
            return;
        };
        s.resetting = true;
        let broker = self.broker.clone();
        let js = s.spec.js_stream.clone();
        let fut = async move { flotilla_transport::topology::take_over_partition(&broker, &js, spec).await };
        ctx.spawn(fut.into_actor(self).map(move |result, act, ctx| {
            let Some(s) = act.slots.get_mut(&i) else { return };
            s.resetting = false;
            if !s.restart_pending {
                // Released meanwhile: it ends now that no reset is out.
                act.report_ended(i, Outcome::Stopped);
                return;
            }
            match result {
                Ok(resumed) => {
                    s.reset_failures = 0;
                    let mut start = crate::task_worker::PartitionStart::from(&resumed);
                    if std::mem::take(&mut s.resyncing) {
                        // Lost in transit or restored, not ended by a crash: nothing is
                        // suspect.
                        start.suspects_up_to = None;
                    }
                    // Those committed past are done with.
                    s.blamed.retain(|(seq, _)| *seq > resumed.state.ack_floor);
                    start.blamed = s.blamed.clone();
                    s.spec.start = Some(start);
                    if !act.stopping {
                        s.restart_pending = false;
                        act.spawn_worker(i, ctx);
                        act.pump_slot(i, ctx);
                    }
                }
                Err(e) if act.observer.is_some() && s.reset_failures >= RESETS_BEFORE_HANDING_BACK => {
                    // Cluster mode: a partition this node cannot reset is a partition it
                    // does not serve; hand the lease back so another node tries.
                    warn!(stream = %s.spec.stream, partition = s.spec.partition, error = %e, "could not reset the partition after repeated tries: handing it back");
                    s.restart_pending = false;
                    s.finished = true;
                    act.report_ended(i, Outcome::Stopped);
                }
                Err(e) => {
                    s.reset_failures += 1;
                    let delay = crate::retry::PARTITION_RESET.wait(s.reset_failures, crate::retry::sample());
                    warn!(stream = %s.spec.stream, partition = s.spec.partition, error = %e, ?delay, "could not reset the partition; its task waits for the reset");
                    act.timers.do_send(After { delay, target: ctx.address().recipient(), tick: Tick::Restart(i) });
                }
            }
        }));
    }
}
