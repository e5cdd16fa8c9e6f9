//! Effects before acks: publishing a message's outputs (and store records) pipelined,
//! what a refused publish costs, and acknowledging the committable positions.

use super::*;

impl<T: Task> TaskWorker<T> {
    /// Queues outputs for publishing. Batches are sent one after the other, in the order
    /// their callbacks finished, so outputs keep their order across messages; their
    /// acks are awaited concurrently (publishes pipeline across messages).
    pub(super) fn flush(&mut self, flush: Flush, ctx: &mut Context<Self>) {
        if flush.msgs.is_empty() {
            self.flushed(flush.target, now(), ctx);
            return;
        }
        self.flushes_in_flight += 1;
        self.publish_queue.push_back(flush);
        self.pump_publish(ctx);
    }

    pub(super) fn pump_publish(&mut self, ctx: &mut Context<Self>) {
        if self.publishing || self.part.ended() {
            return;
        }
        if self.binding.fenced() {
            self.abort_fenced(ctx);
            return;
        }
        let Some(flush) = self.publish_queue.pop_front() else { return };
        self.publishing = true;
        let sent = now();
        let queued = self.env.broker.publish_pipelined_batch(flush.msgs.clone());
        ctx.spawn(queued.into_actor(self).map(move |queued, act, ctx| {
            act.publishing = false;
            act.pump_publish(ctx);
            match queued {
                Ok(stored) => {
                    ctx.spawn(stored.into_actor(act).map(move |stored, act, ctx| {
                        match stored {
                            Ok(()) => {
                                let now = now();
                                act.metrics.publish.record(now.saturating_duration_since(sent).as_secs_f64());
                                act.metrics.published.increment(flush.msgs.len() as u64);
                                act.flushes_in_flight = act.flushes_in_flight.saturating_sub(1);
                                act.flushed(flush.target, now, ctx)
                            }
                            Err(err) => act.flush_failed(flush, err, ctx),
                        }
                        act.drive(ctx);
                    }));
                }
                Err(err) => {
                    act.flush_failed(flush, err, ctx);
                    act.drive(ctx);
                }
            }
        }));
    }

    /// Outputs could not be stored. Unreachable broker: publish the same messages (same
    /// ids, so what was stored is deduplicated) again after a back-off, without counting
    /// an attempt. Refused: a failed attempt of the message (or a failure of the hook).
    pub(super) fn flush_failed(
        &mut self,
        mut flush: Flush,
        err: flotilla_transport::BrokerError,
        ctx: &mut Context<Self>,
    ) {
        let class = err.class();
        if class == ErrorClass::Transient && flush.attempt < self.config.unavailable_retries {
            flush.attempt += 1;
            let delay = unavailable_backoff(flush.attempt);
            warn!(stream = self.binding.stream, partition = self.binding.partition, error = %err, ?delay, "outputs not stored; publishing them again");
            ctx.run_later(delay, move |act, ctx| {
                act.publish_queue.push_front(flush);
                act.pump_publish(ctx);
            });
            return;
        }
        self.flushes_in_flight = self.flushes_in_flight.saturating_sub(1);
        if let FlushTarget::Message(order) = flush.target
            && !self.undo_applied(order)
        {
            // Its store changes are tied to later ones: a retry would apply them twice.
            self.restore_blaming(
                order,
                format!("outputs of a message not stored after its store changes were applied ({err})"),
                ctx,
            );
            return;
        }
        match flush.target {
            FlushTarget::Message(order) if matches!(class, ErrorClass::Permanent(_)) => {
                // Publishing the same outputs again can never work.
                let ErrorClass::Permanent(reason) = class else { return };
                debug!(stream = self.binding.stream, partition = self.binding.partition, error = %err, reason, "outputs can never be stored: dead-lettering the message");
                let detail = format!("output not stored: {err}");
                self.part.handle(ev::Poison { order, reason, detail }, now());
            }
            FlushTarget::Message(order) => {
                self.part.handle(ev::OutputsRefused(order), now());
                self.failed_attempt(order, format!("output not stored: {err}"));
            }
            FlushTarget::Hook(kind) => self.fail(format!("{}: output not stored: {err}", kind.label()), ctx),
        }
    }

    pub(super) fn flushed(&mut self, target: FlushTarget, now: std::time::Instant, ctx: &mut Context<Self>) {
        match target {
            FlushTarget::Message(order) => self.effects_stored(order, now),
            FlushTarget::Hook(kind) => self.hook_done(kind, ctx),
        }
    }

    /// The message is processed and its outputs are stored: the partition's rules ack
    /// it (queue) or let it be committed (ordered).
    pub(super) fn effects_stored(&mut self, order: u64, now: std::time::Instant) {
        let Some(finished) = self.part.handle(ev::EffectsStored(order), now) else { return };
        if !self.binding.ordered() {
            // Its ack is queued and leaves at the end of the turn.
            crate::failpoint::hit(crate::failpoint::Point::EffectsStoredBeforeAck);
        }
        self.after_stored(order, finished);
    }

    /// What the worker kept for a finished message: its store journal, its suspect
    /// record.
    pub(super) fn after_stored(&mut self, order: u64, finished: Finished) {
        if finished.applied
            && let Some(d) = &self.durable
        {
            d.stores.borrow_mut().release(order);
        }
        self.suspect_finished(finished.seq);
    }

    /// Acknowledges everything up to `positions` (the state machine's committable
    /// positions when the commit began).
    pub(super) fn commit_positions(&mut self, positions: BTreeMap<u32, u64>) {
        if self.binding.fenced() {
            // Another node may own the partition now: acking here could skip its work.
            return;
        }
        if self.part.handle(ev::Committed(positions), now()) > 0 && self.binding.ordered() {
            // Its ack-all is queued and leaves at the end of the turn.
            crate::failpoint::hit(crate::failpoint::Point::EffectsStoredBeforeAck);
        }
    }
}
