//! How a message and the worker end: failed attempts, dead letters, hand-backs, a
//! fenced or failed worker, stop and resync.

use super::*;

impl<T: Task> TaskWorker<T> {
    /// One attempt failed: retry, or dead-letter on the last attempt.
    pub(super) fn failed_attempt(&mut self, order: u64, reason: String) {
        let Some(h) = self.part.held(order) else { return };
        let (seq, attempt) = (h.msg.delivery.info.stream_seq, h.attempt);
        self.metrics.failed_attempts.increment(1);
        let (stream, partition) = (self.binding.stream, self.binding.partition);
        let failed = ev::Failed { order, reason: &reason, sample: crate::retry::sample() };
        match self.part.handle(failed, now()) {
            Some(AfterFailure::DeadLetter) => {
                debug!(stream, partition, seq, attempt, %reason, "last attempt failed; dead-lettering");
            }
            Some(AfterFailure::RetryInPlace(delay) | AfterFailure::Nak(delay)) => {
                debug!(stream, partition, seq, attempt, ?delay, %reason, "attempt failed; retrying");
            }
            None => {}
        }
    }

    /// Stores the message in the dead-letter stream (the partition's rules decided so),
    /// then tells the rules, which skip (ordered) or terminate (queue) it.
    pub(super) fn send_dead_letter(
        &mut self,
        order: u64,
        reason: &'static str,
        detail: String,
        attempts: u32,
        ctx: &mut Context<Self>,
    ) {
        let Some(held) = self.part.held(order) else { return };
        let letter = DeadLetter {
            delivery: held.msg.delivery.clone(),
            stream: self.binding.stream.to_owned(),
            partition: self.binding.partition,
            reason,
            detail: detail.clone(),
            attempts: Some(attempts),
            trace: held.msg.trace.as_deref().copied(),
        };
        ctx.spawn(self.reaper.send(letter).into_actor(self).map(move |result, act, ctx| {
            match result {
                Ok(Ok(())) => {
                    if let Some(finished) = act.part.handle(ev::DeadLettered(order), now()) {
                        act.after_stored(order, finished);
                    }
                }
                Ok(Err(e)) => {
                    warn!(error = %e, "dead letter not stored; trying again in {:?}", machine::DEAD_LETTER_RETRY);
                    act.part.handle(ev::DeadLetterRefused { order, reason, detail }, now());
                }
                Err(mailbox) => act.fail(format!("reaper unavailable: {mailbox}"), ctx),
            }
            act.drive(ctx);
        }));
    }

    /// The task failed: hand everything back and report.
    pub(super) fn fail(&mut self, reason: String, ctx: &mut Context<Self>) {
        if self.part.ended() {
            return;
        }
        warn!(stream = self.binding.stream, partition = self.binding.partition, %reason, "task failed");
        // Keep what is done: commit the completed prefix before handing the rest back.
        // Not with stores: the state in memory may hold changes of messages not
        // finished, and acknowledging without writing it would lose the rest; the next
        // owner restores the last commit and skips what it reflects.
        if self.part.readiness().uncommitted() && self.durable.is_none() {
            let positions = self.part.readiness().committable().clone();
            self.commit_positions(positions);
        }
        self.part.handle(ev::TaskFailed(reason.clone()), now());
        emit(
            &self.env.broker,
            &self.env.subjects,
            Event::TaskFailed {
                stream: self.binding.stream.to_owned(),
                partition: self.binding.partition,
                reason: reason.clone(),
            },
        );
        self.part.handle(ev::ReleaseAll { interrupted: false }, now());
        self.finish(Outcome::Failed(reason), ctx);
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
        let Some(kind) = self.part.discipline().release() else { return };
        let kind = match kind {
            AckKind::Nak(None) => AckKind::Nak(delay),
            other => other,
        };
        if !interrupted || self.binding.ordered() {
            self.acks.push((d.token.clone(), kind));
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

    /// The partition's lease is lost: act no more for it. Nothing is acked, nak'd or
    /// published; the new owner resumes at the committed position.
    pub(super) fn abort_fenced(&mut self, ctx: &mut Context<Self>) {
        if self.part.ended() {
            return;
        }
        warn!(
            stream = self.binding.stream,
            partition = self.binding.partition,
            in_flight = self.part.held_count(),
            "lease lost: stopping the partition without acking or publishing more"
        );
        self.publish_queue.clear();
        self.part.handle(ev::LeaseLost, now());
        self.finish(Outcome::Stopped, ctx);
    }

    pub(super) fn finish(&mut self, outcome: Outcome, ctx: &mut Context<Self>) {
        if self.part.ended() {
            return;
        }
        self.part.handle(ev::Ended, now());
        // What this turn acked and completed goes out before the worker reports its end.
        self.send_batched(ctx);
        // Nothing runs here any more (a fenced or released worker leaves counts behind).
        self.metrics.in_flight.set(0.0);
        self.metrics.pending.set(0.0);
        // Handing an ordered partition over: the next owner resets its consumer at the
        // ack floor it reads, so the last commit must have reached the broker before
        // the lease goes (re-acking the same ack-all is idempotent).
        let confirm = match (self.part.last_commit(), &outcome) {
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
        let at_end = self.claim_at_end(&outcome);
        let report = WorkerReport::Finished { slot: self.binding.slot, outcome };
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
            }
            .into_actor(self)
            .map(move |(), act, ctx| act.end_reported(report, at_end, ctx)),
        );
    }

    /// Stops gracefully: hands back what has not started, finishes what has (up to the
    /// drain timeout), commits, runs `shutdown` and ends with
    /// [`stopped_outcome`](Self::stopped_outcome).
    pub(super) fn stop(&mut self, ctx: &mut Context<Self>) {
        // Interrupted is not failed: the machine hands back at once what has not
        // started, and what waits out a retry back-off (the commit position stays
        // before them, so whoever runs the partition next gets them again).
        let Some(handed_back) = self.part.handle(ev::StopAsked, now()) else { return };
        if handed_back > 0 {
            info!(
                stream = self.binding.stream,
                partition = self.binding.partition,
                messages = handed_back,
                "stopping: handing back what waits for a retry instead of waiting out its back-off"
            );
        }
        let deadline = self.config.drain_timeout;
        ctx.run_later(deadline, |act, ctx| {
            if !act.part.ended() {
                warn!(
                    stream = act.binding.stream,
                    partition = act.binding.partition,
                    in_flight = act.part.held_count(),
                    "drain timeout: handing back in-flight messages"
                );
                act.part.handle(ev::ReleaseAll { interrupted: true }, now());
                act.finish(act.stopped_outcome(), ctx);
            }
        });
    }

    /// A delivery was lost: take nothing more, finish and commit what came before the
    /// loss (all of it arrived), and end asking for the partition to be reset at the
    /// committed position, where the lost delivery comes again.
    pub(super) fn resync(&mut self, reason: String, ctx: &mut Context<Self>) {
        if self.part.handle(ev::DeliveryLost(reason), now()) {
            let reason = self.part.resync().unwrap_or_default();
            warn!(stream = self.binding.stream, partition = self.binding.partition, %reason, "delivery sequence broken: committing what arrived complete, then resetting the partition");
            self.stop(ctx);
        }
    }

    /// How a graceful stop ends: [`Outcome::Resync`] after a lost delivery.
    pub(super) fn stopped_outcome(&self) -> Outcome {
        match self.part.resync() {
            Some(reason) => Outcome::Resync(reason.to_owned()),
            None => Outcome::Stopped,
        }
    }

    /// While stopping: once nothing is in flight, commit, run `shutdown`, finish
    /// ([`Partition::stop_step`] decides).
    pub(super) fn try_finish_stop(&mut self, ctx: &mut Context<Self>) {
        let facts = StopFacts {
            task_home: self.task.is_some(),
            outputs_in_flight: self.flushes_in_flight > 0,
            stores_changed: self.durable.as_ref().is_some_and(|d| d.stores.borrow().has_changes()),
        };
        match self.part.stop_step(facts) {
            StopStep::Wait => {}
            StopStep::EndWithoutCommit => {
                warn!(
                    stream = self.binding.stream,
                    partition = self.binding.partition,
                    "stopping without a commit: messages that finished after one handed back mid-retry cannot have their store changes committed apart from it; the next owner restores the last commit and runs them again"
                );
                self.part.handle(ev::ReleaseAll { interrupted: true }, now());
                self.finish(self.stopped_outcome(), ctx);
            }
            StopStep::Commit => self.commit_then(AfterCommit::Shutdown, ctx),
            StopStep::Shutdown => self.run_hook(Hook::Shutdown, ctx),
        }
    }
}
