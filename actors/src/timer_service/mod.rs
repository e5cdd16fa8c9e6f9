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
use std::collections::HashMap;
use std::time::Duration;
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
#[derive(Debug, Default)]
pub struct TimerService {
    next: u64,
    handles: HashMap<u64, SpawnHandle>,
    promotion: Option<Promotion>,
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

impl TimerService {
    fn id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }
}

impl Handler<Every> for TimerService {
    type Result = MessageResult<Every>;

    fn handle(&mut self, msg: Every, ctx: &mut Context<Self>) -> Self::Result {
        let id = self.id();
        let Every { period, target, tick } = msg;
        let handle = ctx.run_interval(period, move |act, ctx| {
            if target.try_send(tick.clone()).is_err()
                && !target.connected()
                && let Some(h) = act.handles.remove(&id)
            {
                ctx.cancel_future(h);
            }
        });
        self.handles.insert(id, handle);
        MessageResult(TimerId(id))
    }
}

impl Handler<After> for TimerService {
    type Result = MessageResult<After>;

    fn handle(&mut self, msg: After, ctx: &mut Context<Self>) -> Self::Result {
        let id = self.id();
        let After { delay, target, tick } = msg;
        let handle = ctx.run_later(delay, move |act, _| {
            act.handles.remove(&id);
            let _ = target.try_send(tick);
        });
        self.handles.insert(id, handle);
        MessageResult(TimerId(id))
    }
}

impl Handler<Cancel> for TimerService {
    type Result = ();

    fn handle(&mut self, msg: Cancel, ctx: &mut Context<Self>) {
        if let Some(h) = self.handles.remove(&msg.0.0) {
            ctx.cancel_future(h);
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
}
