//! Claims: pulling for each slot only what its worker has room for, and routing the
//! claimed messages to it.

use super::*;

/// The wait of a slot's next claim after `empty` empty claims in a row: `base`,
/// doubling per empty claim, at most `idle` (and never less than `base`).
pub(super) fn claim_wait_after(empty: u32, base: Duration, idle: Duration) -> Duration {
    crate::retry::Backoff::doubling(base, idle.max(base), 0.0).base(empty.saturating_add(1))
}

impl Container {
    /// Starts claims for every slot with room.
    pub(super) fn pump(&mut self, ctx: &mut Context<Self>) {
        let ids: Vec<usize> = self.slots.keys().copied().collect();
        for i in ids {
            self.pump_slot(i, ctx);
        }
    }

    /// Starts a claim for slot `i` if it has room. Events of one slot pump only that
    /// slot: a node holding thousands of partitions must not scan them all per message.
    pub(super) fn pump_slot(&mut self, i: usize, ctx: &mut Context<Self>) {
        if self.stopping {
            return;
        }
        let now = tokio::time::Instant::now();
        let Some(slot) = self.slots.get_mut(&i) else { return };
        if slot.claiming
            || slot.finished
            || slot.stopping
            || slot.worker.is_none()
            || slot.backoff_until.is_some_and(|t| t > now)
            || slot.spec.fence.as_ref().is_some_and(|f| !f.valid())
        {
            return;
        }
        let mut free = slot.spec.capacity.saturating_sub(slot.outstanding);
        if slot.paused {
            // Paused: claim only for steps.
            free = free.min(slot.step_credits as usize);
            slot.step_credits = 0;
        }
        if free == 0 {
            return;
        }
        slot.claiming = true;
        let wait = claim_wait_after(slot.empty_claims, self.config.claim_wait, self.config.idle_claim_wait);
        let fut = self.broker.claim(&slot.spec.js_stream, &slot.spec.consumer, free, wait);
        // Each claim is a task of its own, not a future in this actor's context: actix
        // polls every future a context holds whenever it wakes, and a node has a claim
        // out for each of its partitions (10,000 made every wake-up poll 10,000).
        let me = ctx.address();
        slot.claim_task = Some(actix::spawn(async move {
            let result = fut.await;
            me.do_send(Claimed { slot: i, result });
        }));
    }

    pub(super) fn claimed(
        &mut self,
        i: usize,
        result: flotilla_transport::broker::BrokerResult<Vec<flotilla_transport::broker::Delivery>>,
        ctx: &mut Context<Self>,
    ) {
        let broker = self.broker.clone();
        let subjects = self.subjects.clone();
        let Some(slot) = self.slots.get_mut(&i) else { return };
        slot.claiming = false;
        slot.claim_task = None;
        if let Some(outcome) = slot.ended.take() {
            // Whatever the claim brought is left unacked for the next owner.
            self.report_ended(i, outcome);
            return;
        }
        let Some(slot) = self.slots.get_mut(&i) else { return };
        match result {
            Ok(batch) => {
                if slot.failures > 0 {
                    slot.failures = 0;
                    emit(&broker, &subjects, Event::QueueAvailable { stream: slot.spec.stream.clone() });
                }
                if batch.is_empty() {
                    slot.empty_claims = slot.empty_claims.saturating_add(1);
                    slot.metrics.idle_polls.increment(1);
                    return;
                }
                slot.empty_claims = 0;
                match &slot.worker {
                    Some(w) if !slot.finished && !slot.stopping => {
                        slot.outstanding += batch.len();
                        let redelivered = batch.iter().filter(|d| d.info.delivered > 1).count() as u64;
                        slot.deliveries += batch.len() as u64;
                        slot.redeliveries += redelivered;
                        slot.metrics.envelopes.increment(batch.len() as u64);
                        slot.metrics.redeliveries.increment(redelivered);
                        slot.metrics.pending.set(slot.outstanding as f64);
                        w.deliver.do_send(Deliver(batch));
                    }
                    _ if slot.spec.partition.is_some() => {
                        // Ordered: leave them; the partition's next owner recreates
                        // its consumer at the committed position.
                    }
                    _ => {
                        // Nobody to take them: hand them back at once.
                        for d in batch {
                            let fut = broker.ack(&d.token, flotilla_transport::broker::AckKind::Nak(None));
                            actix::spawn(async move {
                                let _ = fut.await;
                            });
                        }
                    }
                }
            }
            Err(e) => {
                slot.failures += 1;
                let delay = crate::retry::CLAIM_FAILED.wait(slot.failures, crate::retry::sample());
                slot.backoff_until = Some(tokio::time::Instant::now() + delay);
                if slot.failures == 1 || slot.failures.is_multiple_of(10) {
                    emit(
                        &broker,
                        &subjects,
                        Event::QueueUnavailable {
                            stream: slot.spec.stream.clone(),
                            error: e.to_string(),
                            retry_in_ms: delay.as_millis() as u64,
                        },
                    );
                }
                self.timers.do_send(After { delay, target: ctx.address().recipient(), tick: Tick::Resume });
            }
        }
    }
}
