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
//! consumer, so a delayed message is promoted by whichever node is alive. A delayed
//! message is published only to a data subject of the job itself
//! ([`Subjects::data_target_problem`]); one with another target, or without a usable
//! delay, goes to the dead-letter stream (`flotilla.<job>._dlq._timers`, reason
//! `bad-timer`), never silently away.
//!
//! A delayed message is due `delay` after the server stored it, so it is judged on the
//! server's clock, not the node's: the service estimates the server's clock
//! ([`server_clock`]) by writing the key `clock` in the job's CONTROL bucket at start
//! and every minute, and reading back the time the server stored with it. Without the
//! bucket (a node outside a cluster) or while probes fail, it uses its own clock.
//!
//! Supervision: started by the job runner next to the container, on the same arbiter;
//! it holds no state worth restarting for (delayed messages live in the broker). A
//! periodic timer ends by itself when its target has stopped.

mod messages;
pub mod server_clock;

pub use messages::{After, Cancel, Every, Tick, TimerId};
pub use server_clock::ServerClock;
use server_clock::{CLOCK_KEY, PROBE_INTERVAL, Probe};

use actix::prelude::*;
use flotilla_transport::broker::{AckKind, BrokerError, BrokerResult, Delivery, OutboundMessage, SharedBroker};
use flotilla_transport::clock::unix_millis;
use flotilla_transport::wire::{Headers, Subjects, headers};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::{Duration, SystemTime};
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// The longest delay a timer or a delayed message may have (365 days). Longer ones are
/// refused when they are asked for ([`TaskContext::send_after`](crate::TaskContext::send_after),
/// [`TaskContext::schedule`](crate::TaskContext::schedule)) and dead-lettered when
/// found in the timer stream: a clock cannot represent arbitrary delays, and a year is
/// longer than any stream keeps its messages by default.
pub const MAX_DELAY: Duration = Duration::from_secs(365 * 24 * 3600);

/// Where delayed messages wait.
#[derive(Debug, Clone)]
pub struct Promotion {
    /// The broker.
    pub broker: SharedBroker,
    /// The job's timer stream (`FLOTILLA_<job>_TIMERS`).
    pub js_stream: String,
    /// Its consumer.
    pub consumer: String,
    /// The job's subjects: delayed messages go only to its data subjects.
    pub subjects: Subjects,
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
    /// The server's clock, as last probed.
    clock: ServerClock,
    /// Whether the promotion loop runs (it starts after the first clock probe).
    promoting: bool,
    /// Probes retried soon after a failed one, since the last good one.
    quick_probes: u32,
}

/// How many times in a row a failed clock probe is retried soon, and how soon.
const QUICK_PROBES: u32 = 5;
const QUICK_PROBE_DELAY: Duration = Duration::from_secs(2);

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

    /// Probes the server's clock (see [`server_clock`]); starts the promotion loop
    /// after the first probe, whatever its outcome.
    fn probe_clock(&mut self, ctx: &mut Context<Self>) {
        let Some(p) = self.promotion.clone() else { return };
        let bucket = p.subjects.bucket_name(crate::cluster::CONTROL);
        let fut = async move {
            let sent = p.broker.system_now();
            let value = bytes::Bytes::from(unix_millis(sent).to_string());
            let revision = p.broker.kv_put(&bucket, CLOCK_KEY, value).await?;
            let received = p.broker.system_now();
            // The KV bucket's stream: the write's revision is its sequence there.
            let stored = p.broker.get_message(&format!("KV_{bucket}"), revision).await?;
            BrokerResult::Ok(stored.map(|m| Probe { sent, received, server: m.published }))
        };
        ctx.spawn(fut.into_actor(self).map(|probe, act, ctx| {
            let observed = match probe {
                Ok(Some(probe)) => match act.clock.observe(&probe) {
                    Some(offset_ms) if offset_ms.abs() >= 1000 => {
                        info!(offset_ms, "this node's clock differs from the NATS server's: delayed messages are timed on the server's");
                        true
                    }
                    Some(offset_ms) => {
                        debug!(offset_ms, "server clock probed");
                        true
                    }
                    None => {
                        debug!(?probe, "server clock probe unusable (slow round trip or a clock step)");
                        false
                    }
                },
                Ok(None) => {
                    debug!("server clock probe: the write was not found; keeping the last estimate");
                    false
                }
                Err(e) => {
                    debug!(error = %e, "server clock probe failed; keeping the last estimate (or the local clock)");
                    false
                }
            };
            // A probe that failed (a busy server, a slow round trip) is tried again
            // soon, a few times, rather than a minute later.
            if observed {
                act.quick_probes = 0;
            } else if act.quick_probes < QUICK_PROBES {
                act.quick_probes += 1;
                ctx.run_later(QUICK_PROBE_DELAY, |act, ctx| act.probe_clock(ctx));
            }
            if !act.promoting {
                act.promoting = true;
                act.promote(ctx);
            }
        }));
    }

    fn promote(&mut self, ctx: &mut Context<Self>) {
        let Some(p) = self.promotion.clone() else { return };
        let clock = self.clock;
        let fut = async move {
            let batch = p.broker.claim(&p.js_stream, &p.consumer, 256, Duration::from_secs(1)).await?;
            for d in batch {
                let now = clock.now(p.broker.system_now());
                promote_one(&p.broker, &p.subjects, d, now).await;
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
                    let period = period.min(MAX_DELAY);
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

/// What to do with a delayed message from the timer stream.
#[derive(Debug, Clone, PartialEq, Eq)]
enum TimerVerdict {
    /// Not yet due: wait this long (a nak with this delay).
    Wait(Duration),
    /// Due: publish to this target.
    Due(String),
    /// Unusable (bad or missing delay or target): dead-letter it with this detail.
    Broken(String),
    /// Dropped without publishing: a cancelled timer's tombstone, or a timer due
    /// later than its misfire policy allows (the reason, for the log).
    Drop(String),
}

/// Judges a delayed message stored at `published`, at `now`.
fn judge_timer(subjects: &Subjects, h: &Headers, published: SystemTime, now: SystemTime) -> TimerVerdict {
    if h.get(headers::KIND) == Some(headers::TIMER_CANCELLED) {
        return TimerVerdict::Drop(format!("timer {:?} cancelled", h.get(headers::TIMER).unwrap_or_default()));
    }
    let delay = match h.get(headers::DELAY).map(|v| (v, v.parse::<u64>())) {
        None => return TimerVerdict::Broken(format!("no {} header", headers::DELAY)),
        Some((v, Err(_))) => {
            return TimerVerdict::Broken(format!("{} {v:?} is not a number of milliseconds", headers::DELAY));
        }
        Some((_, Ok(ms))) => Duration::from_millis(ms),
    };
    if delay > MAX_DELAY {
        return TimerVerdict::Broken(format!("a delay of {delay:?} is over the limit of {MAX_DELAY:?}"));
    }
    let Some(target) = h.get(headers::TARGET) else {
        return TimerVerdict::Broken(format!("no {} header", headers::TARGET));
    };
    if let Some(problem) = subjects.data_target_problem(target) {
        return TimerVerdict::Broken(format!("{}: {problem}", headers::TARGET));
    }
    let allowance = match misfire_allowance(h) {
        Ok(a) => a,
        Err(problem) => return TimerVerdict::Broken(problem),
    };
    let Some(due) = published.checked_add(delay) else {
        return TimerVerdict::Broken(format!("a delay of {delay:?} from {published:?} is past what a clock can hold"));
    };
    match due.duration_since(now) {
        Ok(wait) if !wait.is_zero() => TimerVerdict::Wait(wait),
        Ok(_) => TimerVerdict::Due(target.to_owned()),
        Err(late) => match allowance {
            Some(allowed) if late.duration() > allowed => TimerVerdict::Drop(format!(
                "timer {:?} came due {:?} late, over its misfire allowance of {allowed:?}: skipped",
                h.get(headers::TIMER).unwrap_or_default(),
                late.duration()
            )),
            _ => TimerVerdict::Due(target.to_owned()),
        },
    }
}

/// How late a timer may fire (`None`: however late), from its misfire header.
fn misfire_allowance(h: &Headers) -> Result<Option<Duration>, String> {
    match h.get(headers::MISFIRE) {
        None | Some("fire") => Ok(None),
        Some(v) => match v.strip_prefix("skip:").map(str::parse::<u64>) {
            Some(Ok(ms)) => Ok(Some(Duration::from_millis(ms))),
            _ => Err(format!("{} {v:?} is neither \"fire\" nor \"skip:<ms>\"", headers::MISFIRE)),
        },
    }
}

/// Publishes one delayed message if it is due at `now` (the server's time, as
/// estimated), else waits it out with a nak delay; an unusable one goes to the
/// dead-letter stream.
async fn promote_one(broker: &SharedBroker, subjects: &Subjects, d: Delivery, now: SystemTime) {
    let target = match judge_timer(subjects, &d.headers, d.info.published, now) {
        TimerVerdict::Wait(wait) => {
            let _ = broker.ack(&d.token, AckKind::Nak(Some(wait))).await;
            return;
        }
        TimerVerdict::Broken(detail) => {
            let letter = crate::reaper::dead_letter_to(subjects.dlq_timers(), &d, "bad-timer", &detail);
            match broker.publish(letter).await {
                Ok(_) => {
                    warn!(subject = %d.subject, seq = d.info.stream_seq, %detail, "unusable delayed message dead-lettered");
                    let _ = broker.ack(&d.token, AckKind::Term).await;
                }
                Err(e) => {
                    warn!(error = %e, "unusable delayed message not dead-lettered yet; retrying in 1 s");
                    let _ = broker.ack(&d.token, AckKind::Nak(Some(Duration::from_secs(1)))).await;
                }
            }
            return;
        }
        TimerVerdict::Drop(why) => {
            tracing::info!(subject = %d.subject, "{why}");
            let _ = broker.ack(&d.token, AckKind::Term).await;
            return;
        }
        TimerVerdict::Due(target) => target,
    };
    let mut out = OutboundMessage::new(target.clone(), d.payload.clone());
    // Not the broker's own headers: a producer's `Nats-Expected-*` were for the timer
    // stream, and the target's stream would refuse them.
    out.headers = d.headers.without_broker_controls();
    out.headers.remove(headers::DELAY);
    out.headers.remove(headers::TARGET);
    out.headers.remove(headers::MISFIRE);
    if let Some(id) = d.headers.msg_id().and_then(|id| id.strip_prefix("timer-")) {
        out.headers.insert(headers::MSG_ID, id.to_owned());
    }
    match broker.publish(out).await {
        Ok(_) => {
            let _ = broker.ack(&d.token, AckKind::Ack).await;
        }
        Err(BrokerError::NoStream { .. }) if target_stream_exists(broker, subjects, &target).await => {
            // Its stream exists but takes no such subject: a partition it does not have.
            // That will not change: dead-letter it.
            let detail = format!("its target {target} is a partition its stream does not have");
            let letter = crate::reaper::dead_letter_to(subjects.dlq_timers(), &d, "bad-timer", &detail);
            if broker.publish(letter).await.is_ok() {
                warn!(subject = %d.subject, seq = d.info.stream_seq, %detail, "unusable delayed message dead-lettered");
                let _ = broker.ack(&d.token, AckKind::Term).await;
            } else {
                let _ = broker.ack(&d.token, AckKind::Nak(Some(Duration::from_secs(1)))).await;
            }
        }
        Err(e) => {
            warn!(error = %e, target, "delayed message not published; retrying in 1 s");
            let _ = broker.ack(&d.token, AckKind::Nak(Some(Duration::from_secs(1)))).await;
        }
    }
}

/// Whether the stream a data subject of this job belongs to exists (then a publish it
/// refused was for a partition the stream does not have).
async fn target_stream_exists(broker: &SharedBroker, subjects: &Subjects, target: &str) -> bool {
    let prefix = format!("flotilla.{}.", subjects.job());
    let Some(rest) = target.strip_prefix(&prefix) else { return false };
    let stream = rest.split_once('.').map_or(rest, |(s, _)| s);
    let Ok(name) = flotilla_transport::wire::StreamName::new(stream) else { return false };
    broker.stream_state(&subjects.stream_name(&name)).await.is_ok()
}

/// Now plus `delay`, at most [`MAX_DELAY`] ahead: a delay no clock can hold never
/// panics here (callers refuse such delays first; this keeps the service alive).
fn deadline_after(delay: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(delay.min(MAX_DELAY)).unwrap_or(now)
}

impl Actor for TimerService {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if self.promotion.is_some() {
            self.probe_clock(ctx);
            ctx.run_interval(PROBE_INTERVAL, |act, ctx| act.probe_clock(ctx));
        }
    }
}

impl Handler<Every> for TimerService {
    type Result = MessageResult<Every>;

    fn handle(&mut self, msg: Every, ctx: &mut Context<Self>) -> Self::Result {
        let Every { period, target, tick } = msg;
        // A zero period would tick in a busy loop.
        let period = period.max(Duration::from_millis(1));
        MessageResult(self.add(deadline_after(period), Timer { target, tick, period: Some(period) }, ctx))
    }
}

impl Handler<After> for TimerService {
    type Result = MessageResult<After>;

    fn handle(&mut self, msg: After, ctx: &mut Context<Self>) -> Self::Result {
        let After { delay, target, tick } = msg;
        MessageResult(self.add(deadline_after(delay), Timer { target, tick, period: None }, ctx))
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
            .send(After { delay: Duration::from_secs(90), target: rec.clone().recipient(), tick: Tick::Restart(7) })
            .await
            .expect("after");
        let cancelled = timers
            .send(After { delay: Duration::from_secs(30), target: rec.recipient(), tick: Tick::Deadline })
            .await
            .expect("after");
        timers.send(Cancel(cancelled)).await.expect("cancel");
        let _ = once;
        tokio::time::sleep(Duration::from_secs(3 * 600 + 1)).await;
        let seen = seen.lock().expect("lock").clone();
        let ticks: Vec<_> = seen.iter().map(|(at, t)| (at.duration_since(start).as_secs(), t.clone())).collect();
        assert_eq!(
            ticks,
            vec![(90, Tick::Restart(7)), (600, Tick::Window), (1200, Tick::Window), (1800, Tick::Window)],
            "three 10-minute windows and the one-off, not the cancelled one"
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
                .send(After { delay, target: rec.clone().recipient(), tick: Tick::Restart(delay.as_secs() as usize) })
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
            .send(Every { period: Duration::from_secs(1), target: gone.clone().recipient(), tick: Tick::Deadline })
            .await
            .expect("every");
        drop(gone);
        tokio::time::sleep(Duration::from_secs(1001)).await;
        let seen = seen.lock().expect("lock").clone();
        let retries: Vec<(u64, u64)> = seen
            .iter()
            .filter_map(|(at, t)| match t {
                Tick::Restart(d) => Some((at.duration_since(start).as_secs(), *d as u64)),
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

    #[test]
    fn delayed_messages_are_judged_by_delay_and_target() {
        use flotilla_transport::wire::JobName;
        let subjects = Subjects::new(JobName::new("relay").expect("job"));
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let timer = |delay: &str, target: &str| {
            Headers::new().with(headers::DELAY, delay.to_owned()).with(headers::TARGET, target.to_owned())
        };
        let judge = |h: &Headers, now: SystemTime| judge_timer(&subjects, h, at, now);
        let ok = timer("5000", "flotilla.relay.relay-out.3");
        assert_eq!(judge(&ok, at + Duration::from_secs(2)), TimerVerdict::Wait(Duration::from_secs(3)));
        assert_eq!(judge(&ok, at + Duration::from_secs(5)), TimerVerdict::Due("flotilla.relay.relay-out.3".into()));
        assert_eq!(judge(&ok, at + Duration::from_secs(9)), TimerVerdict::Due("flotilla.relay.relay-out.3".into()));
        let broken = |h: Headers| matches!(judge(&h, at), TimerVerdict::Broken(_));
        assert!(broken(timer("5000", "$JS.API.STREAM.DELETE.FLOTILLA_relay_relay-in")), "the JetStream API");
        assert!(broken(timer("5000", "flotilla.relay._ctl.all.shutdown")), "the control plane");
        assert!(broken(timer("5000", "flotilla.other.relay-out.1")), "another job");
        assert!(broken(timer("soon", "flotilla.relay.relay-out.1")), "a delay that is no number");
        assert!(broken(timer(&u64::MAX.to_string(), "flotilla.relay.relay-out.1")), "a delay no clock holds");
        let year_and_a_day = (MAX_DELAY + Duration::from_secs(86_400)).as_millis().to_string();
        assert!(broken(timer(&year_and_a_day, "flotilla.relay.relay-out.1")), "over the limit");
        assert!(broken(Headers::new().with(headers::DELAY, "5")), "no target");
        assert!(broken(Headers::new().with(headers::TARGET, "flotilla.relay.relay-out.1")), "no delay");
        // Durable timers: a tombstone is dropped; a late one fires, or is skipped past
        // its misfire allowance.
        let tombstone = Headers::new().with(headers::KIND, headers::TIMER_CANCELLED).with(headers::TIMER, "t");
        assert!(matches!(judge(&tombstone, at), TimerVerdict::Drop(_)));
        let skip = ok.clone().with(headers::MISFIRE, "skip:2000");
        assert_eq!(judge(&skip, at + Duration::from_secs(6)), TimerVerdict::Due("flotilla.relay.relay-out.3".into()));
        assert!(matches!(judge(&skip, at + Duration::from_secs(8)), TimerVerdict::Drop(_)), "3 s late, 2 s allowed");
        let fire = ok.clone().with(headers::MISFIRE, "fire");
        assert!(matches!(judge(&fire, at + Duration::from_secs(600)), TimerVerdict::Due(_)));
        assert!(broken(ok.clone().with(headers::MISFIRE, "sometimes")), "an unknown policy");
    }

    #[actix_rt::test]
    async fn a_delay_no_clock_holds_does_not_panic_the_service() {
        tokio::time::pause();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let rec = Recorder(seen.clone()).start();
        let timers = TimerService::default().start();
        timers
            .send(After { delay: Duration::MAX, target: rec.clone().recipient(), tick: Tick::Restart(1) })
            .await
            .expect("the service answers");
        timers
            .send(Every { period: Duration::MAX, target: rec.clone().recipient(), tick: Tick::Window })
            .await
            .expect("the service answers");
        timers
            .send(After { delay: Duration::from_secs(1), target: rec.recipient(), tick: Tick::Restart(2) })
            .await
            .expect("still alive");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            seen.lock().expect("lock").iter().map(|(_, t)| t.clone()).collect::<Vec<_>>(),
            vec![Tick::Restart(2)]
        );
    }
}
