//! `TimerService`: the node's only source of time for the run loop.
//!
//! Window and commit intervals, heartbeats, callback-timeout checks, retry backoffs,
//! user timers, backlog checks and sweeps all arrive as [`Tick`]s from here. It keeps
//! time with actix/tokio timers, so a test that pauses tokio's clock
//! (`tokio::time::pause()`) runs a ten-minute schedule in milliseconds.
//!
//! It also promotes durable delayed messages (`send_after`): they wait in the job's
//! timer stream; each is nak'd with the time it still has to wait (nak delays survive
//! broker restarts, and work on 2.9 servers), and published to its target when due,
//! then acknowledged. Every node's timer service competes on the timer stream's
//! consumer, so a delayed message is promoted by whichever node is alive.
//!
//! Supervision: started by the job runner next to the container, on the same arbiter;
//! it holds no state worth restarting for (delayed messages live in the broker). A
//! periodic timer ends by itself when its target has stopped.

mod messages;

pub use messages::{After, Cancel, Every, Tick, TimerId};

use actix::prelude::*;
use flotilla_transport::broker::{AckKind, BrokerResult, Delivery, OutboundMessage, SharedBroker};
use flotilla_transport::wire::headers;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Duration;
use tokio::time::Instant;
use tracing::{debug, warn};

/// Where delayed messages wait.
#[derive(Debug, Clone)]
pub struct Promotion {
    /// The broker.
    pub broker: SharedBroker,
    /// The job's timer stream (`FLOTILLA_<job>_TIMERS`).
    pub js_stream: String,
    /// Its consumer.
    pub consumer: String,
}

/// The timer actor.
///
/// Timers wait in one queue ordered by deadline, behind a single wake-up for the
/// earliest: a node with 10,000 partitions has tens of thousands of timers, and an
/// actix context polls every future it holds whenever it wakes, so one future per
/// timer made each wake-up cost them all.
#[derive(Debug, Default)]
pub struct TimerService {
    next: u64,
    /// Live timers by id; a cancelled or finished timer is gone from here (its queue
    /// entry is skipped when it comes up).
    timers: HashMap<u64, Timer>,
    /// (deadline, id), earliest first.
    queue: BinaryHeap<Reverse<(Instant, u64)>>,
    /// The pending wake-up and its time.
    wake: Option<(Instant, SpawnHandle)>,
    promotion: Option<Promotion>,
}

#[derive(Debug)]
struct Timer {
    target: Recipient<Tick>,
    tick: Tick,
    /// `Some` for a periodic timer.
    period: Option<Duration>,
}

impl TimerService {
    /// A timer service that also promotes due delayed messages.
    pub fn with_promotion(promotion: Promotion) -> Self {
        Self { promotion: Some(promotion), ..Self::default() }
    }

    fn promote(&mut self, ctx: &mut Context<Self>) {
        let Some(p) = self.promotion.clone() else { return };
        let fut = async move {
            let batch = p.broker.claim(&p.js_stream, &p.consumer, 256, Duration::from_secs(1)).await?;
            for d in batch {
                promote_one(&p.broker, d).await;
            }
            BrokerResult::Ok(())
        };
        ctx.spawn(fut.into_actor(self).map(|result, act, ctx| match result {
            // Nobody can ask for timers any more (the job stopped): end the loop, and
            // with it the actor and its hold on the broker.
            _ if !ctx.connected() => ctx.stop(),
            Ok(()) => act.promote(ctx),
            Err(e) => {
                debug!(error = %e, "delayed messages: claim failed; retrying in 1 s");
                ctx.run_later(Duration::from_secs(1), |act, ctx| act.promote(ctx));
            }
        }));
    }

    fn add(&mut self, deadline: Instant, timer: Timer, ctx: &mut Context<Self>) -> TimerId {
        self.next += 1;
        let id = self.next;
        self.timers.insert(id, timer);
        self.queue.push(Reverse((deadline, id)));
        self.schedule(ctx);
        TimerId(id)
    }

    /// Makes sure the actor wakes at the earliest deadline (and not needlessly earlier).
    fn schedule(&mut self, ctx: &mut Context<Self>) {
        // Skip entries of timers that are gone.
        while let Some(Reverse((_, id))) = self.queue.peek() {
            if self.timers.contains_key(id) {
                break;
            }
            self.queue.pop();
        }
        let Some(&Reverse((earliest, _))) = self.queue.peek() else {
            if let Some((_, handle)) = self.wake.take() {
                ctx.cancel_future(handle);
            }
            return;
        };
        match self.wake {
            Some((at, _)) if at <= earliest => {}
            _ => {
                if let Some((_, handle)) = self.wake.take() {
                    ctx.cancel_future(handle);
                }
                let delay = earliest.saturating_duration_since(Instant::now());
                let handle = ctx.run_later(delay, |act, ctx| {
                    act.wake = None;
                    act.fire(ctx);
                });
                self.wake = Some((earliest, handle));
            }
        }
    }

    /// Sends every due tick, re-arms periodic timers, and sleeps until the next.
    fn fire(&mut self, ctx: &mut Context<Self>) {
        let now = Instant::now();
        while let Some(&Reverse((deadline, id))) = self.queue.peek() {
            if deadline > now {
                break;
            }
            self.queue.pop();
            let Some(timer) = self.timers.get(&id) else { continue };
            match timer.period {
                // A periodic tick skips a busy target (the next one comes a period
                // later); the timer ends once its target has stopped.
                Some(_) if timer.target.try_send(timer.tick.clone()).is_err() && !timer.target.connected() => {
                    self.timers.remove(&id);
                }
                Some(period) => {
                    // Ticks missed while the node was busy are not made up in a burst.
                    let mut next = deadline + period;
                    if next <= now {
                        next = now + period;
                    }
                    self.queue.push(Reverse((next, id)));
                }
                // A one-off tick (a retry, a user timer) is delivered however full the
                // target's mailbox is.
                None => {
                    if let Some(timer) = self.timers.remove(&id) {
                        timer.target.do_send(timer.tick);
                    }
                }
            }
        }
        self.schedule(ctx);
    }
}

/// Publishes one delayed message if it is due, else waits it out with a nak delay.
async fn promote_one(broker: &SharedBroker, d: Delivery) {
    let (Some(delay), Some(target)) =
        (d.headers.get(headers::DELAY).and_then(|v| v.parse::<u64>().ok()), d.headers.get(headers::TARGET))
    else {
        warn!(subject = %d.subject, "delayed message without a valid Flotilla-Delay / Flotilla-Target; dropped");
        let _ = broker.ack(&d.token, AckKind::Term).await;
        return;
    };
    let due = d.info.published + Duration::from_millis(delay);
    if let Ok(wait) = due.duration_since(broker.system_now())
        && !wait.is_zero()
    {
        let _ = broker.ack(&d.token, AckKind::Nak(Some(wait))).await;
        return;
    }
    let mut out = OutboundMessage::new(target.to_owned(), d.payload.clone());
    out.headers = d.headers.clone();
    out.headers.remove(headers::DELAY);
    out.headers.remove(headers::TARGET);
    if let Some(id) = d.headers.msg_id().and_then(|id| id.strip_prefix("timer-")) {
        out.headers.insert(headers::MSG_ID, id.to_owned());
    }
    match broker.publish(out).await {
        Ok(_) => {
            let _ = broker.ack(&d.token, AckKind::Ack).await;
        }
        Err(e) => {
            warn!(error = %e, target, "delayed message not published; retrying in 1 s");
            let _ = broker.ack(&d.token, AckKind::Nak(Some(Duration::from_secs(1)))).await;
        }
    }
}

impl Actor for TimerService {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.promote(ctx);
    }
}

impl Handler<Every> for TimerService {
    type Result = MessageResult<Every>;

    fn handle(&mut self, msg: Every, ctx: &mut Context<Self>) -> Self::Result {
        let Every { period, target, tick } = msg;
        // A zero period would tick in a busy loop.
        let period = period.max(Duration::from_millis(1));
        MessageResult(self.add(Instant::now() + period, Timer { target, tick, period: Some(period) }, ctx))
    }
}

impl Handler<After> for TimerService {
    type Result = MessageResult<After>;

    fn handle(&mut self, msg: After, ctx: &mut Context<Self>) -> Self::Result {
        let After { delay, target, tick } = msg;
        MessageResult(self.add(Instant::now() + delay, Timer { target, tick, period: None }, ctx))
    }
}

impl Handler<Cancel> for TimerService {
    type Result = ();

    fn handle(&mut self, msg: Cancel, ctx: &mut Context<Self>) {
        if self.timers.remove(&msg.0.0).is_some() {
            self.schedule(ctx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    struct Recorder(Arc<Mutex<Vec<(tokio::time::Instant, Tick)>>>);
    impl Actor for Recorder {
        type Context = Context<Self>;
    }
    impl Handler<Tick> for Recorder {
        type Result = ();
        fn handle(&mut self, tick: Tick, _: &mut Context<Self>) {
            self.0.lock().expect("lock").push((tokio::time::Instant::now(), tick));
        }
    }

    #[actix_rt::test]
    async fn a_ten_minute_window_schedule_runs_on_paused_time() {
        tokio::time::pause();
        let start = tokio::time::Instant::now();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let rec = Recorder(seen.clone()).start();
        let timers = TimerService::default().start();
        timers
            .send(Every { period: Duration::from_secs(600), target: rec.clone().recipient(), tick: Tick::Window })
            .await
            .expect("every");
        let once = timers
            .send(After { delay: Duration::from_secs(90), target: rec.clone().recipient(), tick: Tick::Retry(7) })
            .await
            .expect("after");
        let cancelled = timers
            .send(After { delay: Duration::from_secs(30), target: rec.recipient(), tick: Tick::Commit })
            .await
            .expect("after");
        timers.send(Cancel(cancelled)).await.expect("cancel");
        let _ = once;
        tokio::time::sleep(Duration::from_secs(3 * 600 + 1)).await;
        let seen = seen.lock().expect("lock").clone();
        let ticks: Vec<_> = seen.iter().map(|(at, t)| (at.duration_since(start).as_secs(), t.clone())).collect();
        assert_eq!(
            ticks,
            vec![(90, Tick::Retry(7)), (600, Tick::Window), (1200, Tick::Window), (1800, Tick::Window)],
            "three 10-minute windows and one retry, no cancelled commit"
        );
    }

    /// Many timers, added out of order, some cancelled: each one-off fires once at its
    /// deadline, in deadline order; each periodic one fires every period; cancelled ones
    /// never; and a periodic timer whose target stopped disturbs none of them.
    #[actix_rt::test]
    async fn thousands_of_timers_fire_in_deadline_order() {
        tokio::time::pause();
        let start = tokio::time::Instant::now();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let rec = Recorder(seen.clone()).start();
        let timers = TimerService::default().start();
        let mut cancelled = Vec::new();
        for i in 0..2000u64 {
            // Delays 1..=1000 s in a scrambled order.
            let delay = Duration::from_secs(1 + (i * 7919) % 1000);
            let id = timers
                .send(After { delay, target: rec.clone().recipient(), tick: Tick::Retry(delay.as_secs()) })
                .await
                .expect("after");
            if i % 10 == 0 {
                cancelled.push(id);
            }
        }
        for id in cancelled {
            timers.send(Cancel(id)).await.expect("cancel");
        }
        timers
            .send(Every { period: Duration::from_secs(250), target: rec.clone().recipient(), tick: Tick::Window })
            .await
            .expect("every");
        let gone = Recorder(Arc::new(Mutex::new(Vec::new()))).start();
        timers
            .send(Every { period: Duration::from_secs(1), target: gone.clone().recipient(), tick: Tick::Commit })
            .await
            .expect("every");
        drop(gone);
        tokio::time::sleep(Duration::from_secs(1001)).await;
        let seen = seen.lock().expect("lock").clone();
        let retries: Vec<(u64, u64)> = seen
            .iter()
            .filter_map(|(at, t)| match t {
                Tick::Retry(d) => Some((at.duration_since(start).as_secs(), *d)),
                _ => None,
            })
            .collect();
        assert_eq!(retries.len(), 1800, "every one-off but the 200 cancelled fired once");
        assert!(retries.iter().all(|(at, d)| at == d), "each at its deadline");
        assert!(retries.windows(2).all(|w| w[0].0 <= w[1].0), "in deadline order");
        let windows: Vec<u64> =
            seen.iter().filter(|(_, t)| *t == Tick::Window).map(|(at, _)| at.duration_since(start).as_secs()).collect();
        assert_eq!(windows, vec![250, 500, 750, 1000]);
    }
}
