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
            slot.stop_worker(false);
        }
        let deadline = self.config.stop_timeout;
        ctx.run_later(deadline, move |act, ctx| {
            if act.exit.is_none() {
                return;
            }
            let running: Vec<String> = act
                .slots
                .values()
                .filter(|s| s.live())
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
        if !self.slots.values().any(Slot::live) {
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
    /// deliveries would let the new one's first ack-all cover them unprocessed. (The
    /// old worker reported its end only once its last claim was back, so nothing of it
    /// is out when the reset runs.)
    pub(super) fn restart(&mut self, i: usize, ctx: &mut Context<Self>) {
        let Some(s) = self.slots.get_mut(&i) else { return };
        let Run::Waiting { resetting: false, resync } = s.run else { return };
        if self.stopping {
            return;
        }
        if s.spec.fence.as_ref().is_some_and(|f| !f.valid()) {
            // The lease lapsed while the task waited: the partition (and its consumer)
            // may be another node's now. End the slot instead.
            s.run = Run::Ended;
            self.report_ended(i, Outcome::Stopped);
            return;
        }
        let Some(spec) = s.spec.takeover.clone() else {
            self.spawn_worker(i, ctx);
            return;
        };
        s.run = Run::Waiting { resetting: true, resync };
        let broker = self.broker.clone();
        let js = s.spec.js_stream.clone();
        let fut = async move { flotilla_transport::topology::take_over_partition(&broker, &js, spec).await };
        ctx.spawn(fut.into_actor(self).map(move |result, act, ctx| {
            let Some(s) = act.slots.get_mut(&i) else { return };
            let Run::Waiting { resetting: true, resync } = s.run else {
                // Released meanwhile: it ends now that no reset is out.
                act.report_ended(i, Outcome::Stopped);
                return;
            };
            s.run = Run::Waiting { resetting: false, resync };
            match result {
                Ok(resumed) => {
                    s.reset_failures = 0;
                    let mut start = crate::task_worker::PartitionStart::from(&resumed);
                    if resync {
                        // Lost in transit or restored, not ended by a crash: nothing is
                        // suspect.
                        start.suspects_up_to = None;
                    }
                    // Those committed past are done with.
                    s.blamed.retain(|(seq, _)| *seq > resumed.state.ack_floor);
                    start.blamed = s.blamed.clone();
                    s.spec.start = Some(start);
                    if !act.stopping {
                        act.spawn_worker(i, ctx);
                    }
                }
                Err(e) if act.observer.is_some() && s.reset_failures >= RESETS_BEFORE_HANDING_BACK => {
                    // Cluster mode: a partition this node cannot reset is a partition it
                    // does not serve; hand the lease back so another node tries.
                    warn!(stream = %s.spec.stream, partition = s.spec.partition, error = %e, "could not reset the partition after repeated tries: handing it back");
                    s.run = Run::Ended;
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

impl Container {
    /// Slot `i`'s worker ended with `outcome`: the failure policy, a restart after a
    /// lost delivery or a restore, the end of a drained or ended partition, and (unless
    /// the slot restarts) its end reported.
    pub(super) fn worker_finished(&mut self, i: usize, outcome: Outcome, ctx: &mut Context<Self>) {
        let Some(s) = self.slots.get_mut(&i) else { return };
        // A worker told to stop (a hand-over, the container's stop, its task's request)
        // is not restarted, whatever it ended with (a failure still fails the container
        // under `FailContainer`).
        let (told_to_stop, asked_to_end) = match &s.run {
            Run::Stopping { asked_to_end, .. } => (true, *asked_to_end),
            _ => (false, false),
        };
        let stopping = told_to_stop || self.stopping;
        s.run = Run::Ended;
        // What this node no longer runs, it no longer reports.
        s.metrics.backlog.set(0.0);
        s.metrics.oldest_age.set(0.0);
        match &outcome {
            Outcome::Failed(reason) if !self.stopping => match s.spec.policy {
                FailurePolicy::FailContainer => {
                    self.failure =
                        Some(format!("task {} partition {:?} failed: {reason}", s.spec.stream, s.spec.partition));
                    self.stop_all(ctx);
                }
                FailurePolicy::RestartTask if told_to_stop => {
                    info!(stream = %s.spec.stream, partition = s.spec.partition, %reason, "a task told to stop failed: not restarted");
                }
                FailurePolicy::RestartTask => {
                    // Back off exponentially, so a message that fails the task every
                    // time does not restart it in a tight loop.
                    s.restarts += 1;
                    s.run = Run::Waiting { resetting: false, resync: false };
                    let delay = crate::retry::TASK_RESTART.wait(s.restarts, crate::retry::sample());
                    warn!(stream = %s.spec.stream, partition = s.spec.partition, %reason, restarts = s.restarts, ?delay, "restarting the failed task");
                    self.timers.do_send(After { delay, target: ctx.address().recipient(), tick: Tick::Restart(i) });
                }
            },
            Outcome::Resync(reason) if !stopping => {
                // Not a failure: reset the partition at once and go on.
                info!(stream = %s.spec.stream, partition = s.spec.partition, %reason, "resetting the partition to its committed position");
                s.run = Run::Waiting { resetting: false, resync: true };
                self.restart(i, ctx);
            }
            Outcome::Restore { reason, blame } if !stopping => {
                // Not a failure either, but one that repeats backs off, and the message
                // that forces it has the restore counted as an attempt.
                s.restores += 1;
                if let Some(seq) = *blame {
                    match s.blamed.iter_mut().find(|(at, _)| *at == seq) {
                        Some((_, n)) => *n += 1,
                        None => s.blamed.push((seq, 1)),
                    }
                }
                s.run = Run::Waiting { resetting: false, resync: true };
                let delay = match s.restores {
                    1 => Duration::ZERO,
                    n => crate::retry::RESTORE.wait(n - 1, crate::retry::sample()),
                };
                info!(stream = %s.spec.stream, partition = s.spec.partition, %reason, ?blame, restores = s.restores, ?delay, "restoring the partition from its last commit");
                self.timers.do_send(After { delay, target: ctx.address().recipient(), tick: Tick::Restart(i) });
            }
            Outcome::Drained | Outcome::EndOfStream if self.observer.is_none() => {
                self.requests.request(i, ShutdownScope::CurrentTask);
                if self.requests.should_shutdown() {
                    self.stop_all(ctx);
                }
            }
            _ => {}
        }
        let restarting = self.slots.get(&i).is_some_and(|s| matches!(s.run, Run::Waiting { .. }));
        if !restarting {
            let outcome = match outcome {
                Outcome::Stopped if asked_to_end => {
                    info!(slot = i, "the task asked to shut down: its partition is done for this run");
                    Outcome::EndOfStream
                }
                other => other,
            };
            self.report_ended(i, outcome);
        }
        if self.stopping {
            self.maybe_exit(ctx);
        }
    }
}
