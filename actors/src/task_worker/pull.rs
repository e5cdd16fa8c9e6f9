//! Claims: the worker pulls for itself what its machine has room for
//! ([`Partition::poll_claim`]) and takes what comes back in.
//!
//! A worker that ends while a claim is out decides what to do with it by
//! [`ClaimAtEnd`]: wait for it before reporting its end when someone else consumes the
//! partition next, hand back what it brings when a queue task restarts beside it, or
//! abort it when the job ends.

use super::*;
use std::sync::atomic::{AtomicU64, Ordering};

/// Where a worker claims from.
#[derive(Debug, Clone)]
pub struct Source {
    /// The JetStream stream.
    pub js_stream: Rc<str>,
    /// The durable consumer.
    pub consumer: Rc<str>,
}

/// What a slot's workers count of their claims, for `status`: each worker of the slot
/// writes them in turn, the container reads them.
#[derive(Debug, Default)]
pub struct ClaimCounts {
    in_flight: AtomicU64,
    deliveries: AtomicU64,
    redeliveries: AtomicU64,
}

impl ClaimCounts {
    /// Claimed and not finished.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Messages claimed.
    pub fn deliveries(&self) -> u64 {
        self.deliveries.load(Ordering::Relaxed)
    }

    /// Of those, redeliveries.
    pub fn redeliveries(&self) -> u64 {
        self.redeliveries.load(Ordering::Relaxed)
    }
}

/// What an ending worker does with the claim it has out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ClaimAtEnd {
    /// Report the end only once the claim is back: an ordered partition that someone
    /// else consumes next (a lease holder), or that is reset for a restart, must never
    /// have this worker's pull compete with its next consumer.
    Wait,
    /// Report at once, stop once the claim is back and hand back what it brought: a
    /// queue input whose task restarts (the next worker claims beside it).
    HandBack,
    /// Report at once and abort the claim: nothing of this worker runs the input again
    /// in this process (the job ends, or the task asked to shut down). What a claim
    /// aborted on its way brought waits out its ack-wait.
    Abort,
}

/// Where an ended worker's report stands while its last claim is out.
#[derive(Debug, Default)]
pub(super) enum EndReport {
    /// Not ended, or the hand-over is on its way.
    #[default]
    Finishing,
    /// Held back until the claim is back (boxed: a worker keeps this slot all its life).
    Held(Box<WorkerReport>),
    /// Sent: the worker stops once the claim is back.
    Sent,
}

/// A claim came back (sent by the claim's own task).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct Claimed(pub BrokerResult<Vec<Delivery>>);

impl<T: Task> TaskWorker<T> {
    /// Sends the claim the machine asks for, if any.
    pub(super) fn pump(&mut self, ctx: &mut Context<Self>) {
        if self.binding.fenced() {
            return;
        }
        let Some(claim) = self.part.poll_claim(now()) else { return };
        let fut = self.env.broker.claim(&self.source.js_stream, &self.source.consumer, claim.max, claim.wait);
        // A task of its own, not a future in this actor's context: actix polls every
        // future a context holds whenever it wakes, and the claim waits for seconds.
        let me = ctx.address();
        self.claim_task = Some(actix::spawn(async move {
            let result = fut.await;
            me.do_send(Claimed(result));
        }));
    }

    /// Publishes what `status` shows of the claims (nothing once the worker ended: what
    /// it released is not credited back, and is no longer this node's).
    pub(super) fn count_claims(&self) {
        let outstanding = if self.part.ended() { 0 } else { self.part.outstanding() };
        self.counts.in_flight.store(outstanding as u64, Ordering::Relaxed);
        self.metrics.pending.set(outstanding as f64);
    }

    /// What an ending worker does with the claim it has out, ending as `outcome`.
    pub(super) fn claim_at_end(&self, outcome: &Outcome) -> ClaimAtEnd {
        let restarts = matches!(outcome, Outcome::Failed(_) | Outcome::Resync(_) | Outcome::Restore { .. });
        if self.binding.ordered() && (self.binding.fence.is_some() || restarts) {
            ClaimAtEnd::Wait
        } else if !self.binding.ordered() && restarts {
            ClaimAtEnd::HandBack
        } else {
            ClaimAtEnd::Abort
        }
    }

    /// The hand-over of an ending worker is done: reports its end and stops, unless its
    /// claim is out and must come back first ([`ClaimAtEnd`]).
    pub(super) fn end_reported(&mut self, report: WorkerReport, at_end: ClaimAtEnd, ctx: &mut Context<Self>) {
        if !self.part.claim_out() {
            self.report(report);
            ctx.stop();
            return;
        }
        match at_end {
            ClaimAtEnd::Wait => self.end = EndReport::Held(Box::new(report)),
            ClaimAtEnd::HandBack => {
                self.report(report);
                self.end = EndReport::Sent;
            }
            ClaimAtEnd::Abort => {
                if let Some(task) = self.claim_task.take() {
                    task.abort();
                }
                self.report(report);
                ctx.stop();
            }
        }
    }

    /// Ends the worker's life once its claim is back: reports the end it held back,
    /// hands back what the claim brought (queue inputs) and stops.
    fn claim_back_after_end(&mut self, batch: Vec<Delivery>, ctx: &mut Context<Self>) {
        // Not through the machine: it ended, and these were never its messages. Not
        // their fault either: a queue message's hand-back is counted (no attempt spent).
        for d in &batch {
            self.hand_back(d, true);
        }
        if !self.acks.is_empty() {
            let fut = self.env.broker.ack_many(std::mem::take(&mut self.acks));
            actix::spawn(async move {
                let _ = fut.await;
            });
        }
        match std::mem::take(&mut self.end) {
            EndReport::Held(report) => {
                self.report(*report);
                ctx.stop();
            }
            EndReport::Sent => ctx.stop(),
            // The hand-over is still on its way: it reports and stops.
            EndReport::Finishing => {}
        }
    }
}

impl<T: Task> Handler<Claimed> for TaskWorker<T> {
    type Result = ();

    fn handle(&mut self, Claimed(result): Claimed, ctx: &mut Context<Self>) {
        self.claim_task = None;
        let now = now();
        let stream = self.binding.stream;
        match result {
            Ok(batch) => {
                if self.part.handle(ev::ClaimReturned(batch.len()), now) {
                    emit(&self.env.broker, &self.env.subjects, Event::QueueAvailable { stream: stream.to_owned() });
                }
                if self.part.ended() {
                    self.claim_back_after_end(batch, ctx);
                    return;
                }
                if batch.is_empty() {
                    self.metrics.idle_polls.increment(1);
                } else {
                    let redelivered = batch.iter().filter(|d| d.info.delivered > 1).count() as u64;
                    self.counts.deliveries.fetch_add(batch.len() as u64, Ordering::Relaxed);
                    self.counts.redeliveries.fetch_add(redelivered, Ordering::Relaxed);
                    self.metrics.envelopes.increment(batch.len() as u64);
                    self.metrics.redeliveries.increment(redelivered);
                    self.take(batch, ctx);
                }
            }
            Err(e) => {
                let retry = self.part.handle(ev::ClaimFailed { sample: crate::retry::sample() }, now);
                if retry.announce {
                    emit(
                        &self.env.broker,
                        &self.env.subjects,
                        Event::QueueUnavailable {
                            stream: stream.to_owned(),
                            error: e.to_string(),
                            retry_in_ms: retry.after.as_millis() as u64,
                        },
                    );
                }
                if self.part.ended() {
                    self.claim_back_after_end(Vec::new(), ctx);
                    return;
                }
            }
        }
        self.drive(ctx);
    }
}
