//! How a message and the worker end: failed attempts, dead letters, hand-backs, a
//! fenced or failed worker, stop and resync.

use super::*;

impl<T: Task> TaskWorker<T> {
    /// One attempt failed: retry, or dead-letter on the last attempt.
    pub(super) fn failed_attempt(&mut self, order: u64, reason: String, ctx: &mut Context<Self>) {
        let Some(envelope) = self.inflight.get_mut(&order) else { return };
        self.metrics.failed_attempts.increment(1);
        let attempt = envelope.attempt;
        let max = self.config.retry.max_attempts;
        let seq = envelope.delivery.info.stream_seq;
        match self.binding.discipline().after_failure(attempt, &self.config.retry, crate::retry::sample()) {
            AfterFailure::DeadLetter => {
                debug!(stream = self.binding.stream, partition = self.binding.partition, seq, attempt, %reason, "last attempt failed; dead-lettering");
                self.dead_letter(order, "max-attempts", format!("attempt {attempt} of {max} failed: {reason}"), ctx);
            }
            AfterFailure::RetryInPlace(delay) => {
                debug!(stream = self.binding.stream, partition = self.binding.partition, seq, attempt, ?delay, %reason, "attempt failed; retrying");
                envelope.attempt += 1;
                envelope.started = None;
                envelope.backing_off = true;
                self.state.attempt_paused(order);
                self.timers.do_send(After { delay, target: ctx.address().recipient(), tick: Tick::Retry(order) });
            }
            AfterFailure::Nak(delay) => {
                debug!(stream = self.binding.stream, partition = self.binding.partition, seq, attempt, ?delay, %reason, "attempt failed; retrying");
                let token = envelope.delivery.token.clone();
                self.ack(&token, AckKind::Nak(Some(delay)));
                self.forget(order);
            }
        }
    }

    /// Done with a queue message without acking it here (nak'd or terminated).
    pub(super) fn forget(&mut self, order: u64) {
        if let Some(e) = self.inflight.remove(&order)
            && e.counted
        {
            self.state.process_done(order);
        }
        self.claimed.remove(&order);
        self.state.effects_done(order);
        self.completed(1);
    }

    /// Moves the message to the dead-letter stream, then skips (ordered) or terminates (queue) it.
    pub(super) fn dead_letter(&mut self, order: u64, reason: &'static str, detail: String, ctx: &mut Context<Self>) {
        let Some(envelope) = self.inflight.get(&order) else { return };
        let letter = DeadLetter {
            delivery: envelope.delivery.clone(),
            stream: self.binding.stream.to_owned(),
            partition: self.binding.partition,
            reason,
            detail: detail.clone(),
            // The attempts before this one, and this one if `process` ran for it.
            attempts: Some(envelope.attempt.saturating_sub(1) + u32::from(envelope.ran)),
            trace: envelope.trace,
        };
        ctx.spawn(self.reaper.send(letter).into_actor(self).map(move |result, act, ctx| {
            match result {
                Ok(Ok(())) => match act.binding.discipline().after_dead_letter() {
                    None => {
                        act.process_done(order);
                        act.effects_stored(order);
                    }
                    Some(kind) => {
                        if let Some(e) = act.inflight.get(&order) {
                            let token = e.delivery.token.clone();
                            act.ack(&token, kind);
                            act.forget(order);
                        }
                    }
                },
                Ok(Err(e)) => {
                    warn!(error = %e, "dead letter not stored; trying again in 1 s");
                    if let Some(env) = act.inflight.get_mut(&order) {
                        env.dead_letter = Some((reason, detail));
                    }
                    act.timers.do_send(After {
                        delay: Duration::from_secs(1),
                        target: ctx.address().recipient(),
                        tick: Tick::Retry(order),
                    });
                }
                Err(mailbox) => act.fail(format!("reaper unavailable: {mailbox}"), ctx),
            }
            act.drive(ctx);
        }));
    }

    /// The task failed: hand everything back and report.
    pub(super) fn fail(&mut self, reason: String, ctx: &mut Context<Self>) {
        if self.finished {
            return;
        }
        warn!(stream = self.binding.stream, partition = self.binding.partition, %reason, "task failed");
        // Keep what is done: commit the completed prefix before handing the rest back.
        // Not with stores: the state in memory may hold changes of messages not
        // finished, and acknowledging without writing it would lose the rest; the next
        // owner restores the last commit and skips what it reflects.
        if self.state.uncommitted() && self.durable.is_none() {
            let positions = self.state.committable().clone();
            self.commit_positions(positions);
        }
        self.state.fail(reason.clone());
        emit(
            &self.env.broker,
            &self.env.subjects,
            Event::TaskFailed {
                stream: self.binding.stream.to_owned(),
                partition: self.binding.partition,
                reason: reason.clone(),
            },
        );
        self.release_all(false);
        self.finish(Outcome::Failed(reason), ctx);
    }

    /// Naks (without delay) what was claimed and never started — for example what
    /// followed a drain marker — so the next run gets it at once.
    pub(super) fn hand_back_unstarted(&mut self) {
        let unstarted = self.state.take_unstarted();
        let count = unstarted.len();
        for p in unstarted {
            self.claimed.remove(&p.order);
            self.hand_back(&p.msg, true);
        }
        self.completed(count);
    }

    /// Hands back the messages waiting for a retry: a stop does not wait out their
    /// back-off. The commit position stays before them, so whoever runs the partition
    /// next gets them again.
    pub(super) fn hand_back_backing_off(&mut self) {
        let waiting: Vec<u64> =
            self.inflight.iter().filter(|(_, e)| e.backing_off && !e.applied).map(|(&order, _)| order).collect();
        if waiting.is_empty() {
            return;
        }
        info!(
            stream = self.binding.stream,
            partition = self.binding.partition,
            messages = waiting.len(),
            "stopping: handing back what waits for a retry instead of waiting out its back-off"
        );
        if let Some(&first) = waiting.iter().min() {
            self.handed_back_mid_retry = Some(self.handed_back_mid_retry.map_or(first, |h| h.min(first)));
        }
        for order in waiting {
            let Some(e) = self.inflight.remove(&order) else { continue };
            self.claimed.remove(&order);
            if e.counted {
                self.state.release(order);
            }
            self.hand_back(&e.delivery, true);
        }
    }

    /// Gives a claimed, unfinished message back ([`Discipline::release`]). An
    /// `interrupted` queue message (a stop, a drain deadline, a back-off cut short: not
    /// its fault) has the release counted first, so its next delivery costs no attempt
    /// (see [`released`]).
    pub(super) fn hand_back(&mut self, d: &Delivery, interrupted: bool) {
        self.hand_back_after(d, interrupted, None);
    }

    /// [`hand_back`](Self::hand_back), a queue message coming again after `delay`.
    pub(super) fn hand_back_after(&mut self, d: &Delivery, interrupted: bool, delay: Option<Duration>) {
        let Some(kind) = self.binding.discipline().release() else { return };
        let kind = match kind {
            AckKind::Nak(None) => AckKind::Nak(delay),
            other => other,
        };
        if !interrupted || self.binding.ordered() {
            self.ack(&d.token, kind);
            return;
        }
        let broker = self.env.broker.clone();
        let bucket = self.env.subjects.bucket_name(RELEASED);
        let key = released::key(self.binding.stream, d.info.stream_seq);
        let token = d.token.clone();
        self.metrics.acked(ack_count(kind), 1);
        // Not tied to this actor (a stop ends it before the count is stored), and
        // awaited before the worker reports its end, so the process does not exit first.
        self.releases.retain(|h| !h.is_finished());
        self.releases.push(actix::spawn(async move {
            if let Err(e) = released::record(&broker, &bucket, &key).await {
                debug!(error = %e, %key, "release not counted: the next delivery counts as an attempt");
            }
            if let Err(e) = broker.ack(&token, kind).await {
                debug!(error = %e, %key, "hand-back not sent: the message comes again after its ack-wait");
            }
        }));
    }

    /// Naks every message held and not finished, without delay; `interrupted` when
    /// that is not their fault (a stop's deadline), so it costs queue messages no
    /// attempt. After a task failure it does: the culprit is among them.
    pub(super) fn release_all(&mut self, interrupted: bool) {
        for p in self.state.take_unstarted() {
            self.hand_back(&p.msg, interrupted);
        }
        let inflight: Vec<Envelope> = self.inflight.drain().map(|(_, e)| e).collect();
        for e in inflight {
            self.hand_back(&e.delivery, interrupted);
        }
        self.claimed.clear();
    }

    /// The partition's lease is lost: act no more for it. Nothing is acked, nak'd or
    /// published; the new owner resumes at the committed position.
    pub(super) fn abort_fenced(&mut self, ctx: &mut Context<Self>) {
        if self.finished {
            return;
        }
        warn!(
            stream = self.binding.stream,
            partition = self.binding.partition,
            in_flight = self.inflight.len(),
            "lease lost: stopping the partition without acking or publishing more"
        );
        self.publish_queue.clear();
        let _ = self.state.take_unstarted();
        self.inflight.clear();
        self.claimed.clear();
        self.finish(Outcome::Stopped, ctx);
    }

    pub(super) fn finish(&mut self, outcome: Outcome, ctx: &mut Context<Self>) {
        if self.finished {
            return;
        }
        self.finished = true;
        self.state.mark_complete();
        // What this turn acked and completed goes out before the worker reports its end.
        self.send_batched();
        // Nothing runs here any more (a fenced or released worker leaves counts behind).
        self.metrics.in_flight.set(0.0);
        // Handing an ordered partition over: the next owner resets its consumer at the
        // ack floor it reads, so the last commit must have reached the broker before
        // the lease goes (re-acking the same ack-all is idempotent).
        let confirm = match (&self.last_commit, &outcome) {
            (
                Some(token),
                Outcome::Stopped
                | Outcome::Drained
                | Outcome::EndOfStream
                | Outcome::Resync(_)
                | Outcome::Restore { .. },
            ) if !self.binding.fenced() => Some(self.env.broker.ack_confirmed(token, AckKind::Ack)),
            _ => None,
        };
        let flush = self.env.broker.flush();
        let releases = std::mem::take(&mut self.releases);
        let (stream, partition) = (self.binding.stream, self.binding.partition);
        let report = WorkerReport::Finished { slot: self.binding.slot, outcome };
        let container = self.container.clone();
        ctx.spawn(
            async move {
                // Hand-backs counted and sent first: the process may exit once it hears.
                // All of it within a budget, whatever the network does.
                let handed_over = async {
                    let _ = futures::future::join_all(releases).await;
                    let _ = flush.await;
                    match confirm {
                        Some(confirm) => confirm.await.map_err(|e| e.to_string()),
                        None => Ok(()),
                    }
                };
                match tokio::time::timeout(FINISH_BUDGET, handed_over).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        warn!(stream, partition, error = %e, "last commit not confirmed; the next owner may process its messages again");
                    }
                    Err(_) => warn!(
                        stream,
                        partition,
                        "hand-backs and the last commit not confirmed within {FINISH_BUDGET:?} (the broker does not answer): the next owner may process those messages again"
                    ),
                }
                container.do_send(report);
            }
            .into_actor(self)
            .map(|(), _, ctx| ctx.stop()),
        );
    }

    /// Stops gracefully: hands back what has not started, finishes what has (up to the
    /// drain timeout), commits, runs `shutdown` and ends with
    /// [`stopped_outcome`](Self::stopped_outcome).
    pub(super) fn stop(&mut self, ctx: &mut Context<Self>) {
        if self.stopping || self.finished {
            return;
        }
        self.stopping = true;
        // Interrupted is not failed: hand back at once what has not started, and what
        // waits out a retry back-off.
        self.hand_back_unstarted();
        self.hand_back_backing_off();
        let deadline = self.config.drain_timeout;
        ctx.run_later(deadline, |act, ctx| {
            if !act.finished {
                warn!(
                    stream = act.binding.stream,
                    partition = act.binding.partition,
                    in_flight = act.inflight.len(),
                    "drain timeout: handing back in-flight messages"
                );
                act.release_all(true);
                act.finish(act.stopped_outcome(), ctx);
            }
        });
    }

    /// A delivery was lost: take nothing more, finish and commit what came before the
    /// loss (all of it arrived), and end asking for the partition to be reset at the
    /// committed position, where the lost delivery comes again.
    pub(super) fn resync(&mut self, reason: String, ctx: &mut Context<Self>) {
        if self.resync.is_some() || self.finished {
            return;
        }
        warn!(stream = self.binding.stream, partition = self.binding.partition, %reason, "delivery sequence broken: committing what arrived complete, then resetting the partition");
        self.resync = Some(reason);
        self.stop(ctx);
    }

    /// How a graceful stop ends: [`Outcome::Resync`] after a lost delivery.
    pub(super) fn stopped_outcome(&self) -> Outcome {
        match &self.resync {
            Some(reason) => Outcome::Resync(reason.clone()),
            None => Outcome::Stopped,
        }
    }

    /// While stopping: once nothing is in flight, commit, run `shutdown`, finish.
    pub(super) fn try_finish_stop(&mut self, ctx: &mut Context<Self>) {
        // Outputs of a hook (a window) still on their way: a stop runs no half-done
        // window, so the commit waits for them.
        if self.finished || self.task.is_none() || !self.inflight.is_empty() || self.flushes_in_flight > 0 {
            return;
        }
        if self.state_busy() {
            return;
        }
        if self.durable.is_some()
            && let Some(first) = self.handed_back_mid_retry
            && self.claimed.range(first..).next().is_some()
        {
            // Messages after the one handed back finished: their store changes are in
            // memory, but the commit position stays before it, and a commit would write
            // them there (the next owner would apply them twice). Commit nothing.
            warn!(
                stream = self.binding.stream,
                partition = self.binding.partition,
                "stopping without a commit: messages that finished after one handed back mid-retry cannot have their store changes committed apart from it; the next owner restores the last commit and runs them again"
            );
            self.release_all(true);
            self.finish(self.stopped_outcome(), ctx);
            return;
        }
        let changed = self.durable.as_ref().is_some_and(|d| d.stores.borrow().has_changes());
        if self.state.uncommitted() || changed {
            self.commit_then(AfterCommit::Shutdown, ctx);
            return;
        }
        self.run_hook(Hook::Shutdown, ctx);
    }
}
