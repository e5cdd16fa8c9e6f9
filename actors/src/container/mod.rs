//! `Container`: the node's run loop for one job.
//!
//! It owns the task workers of the inputs this node consumes — one per ordered
//! partition, one per queue input — and pulls for each only what its worker can take:
//! for an ordered partition, up to the commit window of uncommitted messages; for a
//! queue input, up to `max_concurrency` messages in flight, so the backlog stays in the
//! broker. It routes claimed messages to the workers, tracks coordinator requests
//! (a task's `shutdown(CurrentTask | AllTasksInContainer)`), applies the failure policy
//! (fail the container, or restart the task), backs off with jitter while the broker
//! is unreachable (keeping in-flight work, emitting `queue_unavailable`), watches the
//! backlog (`degraded` after several high checks, `recovered` after), and has the
//! reaper sweep queue inputs for stranded messages.
//!
//! Supervision: started by the job runner; when it exits it reports a
//! [`ContainerExit`] through the channel it was given and stops.

mod messages;

use messages::Claimed;
pub use messages::{AddSlot, ContainerExit, ReleaseSlot, SetPaused, SlotEnded, Snapshot, StepSlot, StopContainer};

use crate::config::FailurePolicy;
use crate::events::{Event, emit};
use crate::metrics::{SlotMetrics, Utilization};
use crate::reaper::{Reaper, Sweep};
use crate::state::{CoordinatorRequests, ShutdownScope};
use crate::task_worker::{Deliver, Outcome, StopWorker, WorkerControl, WorkerReport};
use crate::timer_service::{After, Every, Tick, TimerService};
use actix::prelude::*;
use flotilla_transport::broker::SharedBroker;
use flotilla_transport::wire::Subjects;
use rand::Rng;
use std::time::Duration;
use tokio::sync::oneshot;
use tracing::{info, warn};

/// The addresses of a running worker.
#[derive(Debug, Clone)]
pub struct WorkerHandle {
    /// Where claimed messages go.
    pub deliver: Recipient<Deliver>,
    /// Where stop requests go.
    pub stop: Recipient<StopWorker>,
    /// Where pause, resume and step go.
    pub control: Recipient<WorkerControl>,
}

/// What the container needs to start a worker for a slot.
pub struct SlotContext {
    /// The slot's index.
    pub slot: usize,
    /// The container, for the worker's reports.
    pub container: Recipient<WorkerReport>,
    /// The node's timer service.
    pub timers: Addr<TimerService>,
    /// The node's reaper.
    pub reaper: Addr<Reaper>,
    /// Ordered inputs: where the partition resumes (see
    /// [`PartitionStart`](crate::task_worker::PartitionStart)).
    pub start: Option<crate::task_worker::PartitionStart>,
}

/// Starts a worker for a slot.
pub type SpawnWorker = Box<dyn Fn(SlotContext) -> WorkerHandle>;

/// One input partition (or queue input) the container consumes.
pub struct SlotSpec {
    /// The input stream's name.
    pub stream: String,
    /// The partition (ordered inputs).
    pub partition: Option<u32>,
    /// The JetStream stream.
    pub js_stream: String,
    /// The durable consumer.
    pub consumer: String,
    /// Messages the worker may hold at once (claimed, not yet finished).
    pub capacity: usize,
    /// What a failure of this slot's task does.
    pub policy: FailurePolicy,
    /// Whether the reaper sweeps this input for stranded messages (queue inputs).
    pub sweep: bool,
    /// Ordered inputs: the partition consumer, reset at the committed position before a
    /// restarted task starts (so it resumes in order, at once).
    pub takeover: Option<flotilla_transport::broker::ConsumerSpec>,
    /// Ordered inputs: where the next worker starts, as the last take-over found it
    /// (updated by each reset).
    pub start: Option<crate::task_worker::PartitionStart>,
    /// The partition's lease epoch (0 without leases).
    pub epoch: u64,
    /// Cluster mode: the partition's lease fence. Nothing is claimed for the slot, and a
    /// restart does not reset the partition's consumer, once it is no longer valid (the
    /// lease may be someone else's by then, and so would the claimed messages be).
    pub fence: Option<crate::fence::Fence>,
    /// Starts paused.
    pub paused: bool,
    /// Starts the worker.
    pub spawn: SpawnWorker,
}

impl std::fmt::Debug for SlotSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotSpec")
            .field("stream", &self.stream)
            .field("partition", &self.partition)
            .finish_non_exhaustive()
    }
}

struct Slot {
    spec: SlotSpec,
    worker: Option<WorkerHandle>,
    outstanding: usize,
    claiming: bool,
    /// The task of the claim out, if any (aborted when the container stops).
    claim_task: Option<tokio::task::JoinHandle<()>>,
    /// Claims in a row that came back empty (the next one waits longer).
    empty_claims: u32,
    finished: bool,
    failures: u32,
    backoff_until: Option<tokio::time::Instant>,
    /// Restarts since the task last finished a message.
    restarts: u32,
    /// The failed task waits for a restart (`Tick::Restart`).
    restart_pending: bool,
    /// The restart is resetting the partition's consumer.
    resetting: bool,
    /// Resets in a row that failed (the next waits longer; no worker starts meanwhile).
    reset_failures: u32,
    /// The restart under way follows a lost delivery ([`Outcome::Resync`]) or a restore
    /// ([`Outcome::Restore`]), not a failure.
    resyncing: bool,
    /// Restores since the task last finished a message (the next waits longer).
    restores: u32,
    /// The messages that forced restores (their stream sequences), and how many each
    /// (those the partition has committed past are dropped at each restart).
    blamed: Vec<(u64, u32)>,
    /// The worker was told to stop: claim nothing more for it.
    stopping: bool,
    /// Its task asked to shut down (`ShutdownScope::CurrentTask`) on a node of a
    /// cluster: the partition is done for this run, as at its end of stream.
    asked_to_end: bool,
    paused: bool,
    step_credits: u32,
    deliveries: u64,
    redeliveries: u64,
    /// The worker ended while a claim was out: tell the observer when it returns (so
    /// the next owner never competes with this node's outstanding pull).
    ended: Option<Outcome>,
    metrics: SlotMetrics,
}

impl Slot {
    fn new(spec: SlotSpec) -> Self {
        let paused = spec.paused;
        Self {
            metrics: SlotMetrics::new(&spec.stream, spec.partition),
            spec,
            worker: None,
            outstanding: 0,
            claiming: false,
            claim_task: None,
            empty_claims: 0,
            finished: false,
            failures: 0,
            backoff_until: None,
            restarts: 0,
            restart_pending: false,
            resetting: false,
            reset_failures: 0,
            resyncing: false,
            restores: 0,
            blamed: Vec::new(),
            stopping: false,
            asked_to_end: false,
            paused,
            step_credits: 0,
            deliveries: 0,
            redeliveries: 0,
            ended: None,
        }
    }
}

/// Cluster mode: failed resets of a partition in a row after which its lease is handed
/// back (about 10 s of backoff), so that a node never holds a partition it cannot run.
const RESETS_BEFORE_HANDING_BACK: u32 = 5;

/// The wait of a slot's next claim after `empty` empty claims in a row: `base`,
/// doubling per empty claim, at most `idle` (and never less than `base`).
fn claim_wait_after(empty: u32, base: Duration, idle: Duration) -> Duration {
    base.saturating_mul(1 << empty.min(16)).min(idle.max(base))
}

/// Container settings.
#[derive(Debug, Clone)]
pub struct ContainerConfig {
    /// How long one claim waits for messages.
    pub claim_wait: Duration,
    /// How long a claim waits once a slot's claims keep coming back empty: the wait
    /// doubles from `claim_wait` up to this, and is `claim_wait` again after the first
    /// message. A message ends a waiting claim at once, so a longer wait costs no
    /// latency; it cuts what idle partitions cost (each empty claim is renewed). Cluster
    /// mode sets it to `claim_wait`: a released partition is handed over only once its
    /// claim is back.
    pub idle_claim_wait: Duration,
    /// How often the backlog is checked.
    pub backlog_interval: Duration,
    /// Backlog (messages waiting) above which a check counts as high.
    pub backlog_threshold: u64,
    /// Consecutive high checks before `degraded` is emitted.
    pub backlog_strikes: u32,
    /// How often queue inputs are swept for stranded messages: the captured
    /// `MAX_DELIVERIES` advisories are handled each time, busy or not, and an idle
    /// queue is walked for any the capture missed.
    pub sweep_interval: Duration,
    /// How long a graceful stop may take before the container exits anyway (failed,
    /// naming the partitions still running). A job bounds it further by its tasks'
    /// drain timeouts.
    pub stop_timeout: Duration,
}

impl Default for ContainerConfig {
    fn default() -> Self {
        Self {
            claim_wait: Duration::from_secs(1),
            idle_claim_wait: Duration::from_secs(5),
            backlog_interval: Duration::from_secs(5),
            backlog_threshold: 10_000,
            backlog_strikes: 3,
            sweep_interval: Duration::from_secs(10),
            stop_timeout: Duration::from_secs(60),
        }
    }
}

/// The container actor.
pub struct Container {
    broker: SharedBroker,
    subjects: Subjects,
    config: ContainerConfig,
    /// Slots by id. Ids are never reused; in cluster mode a slot is removed once its
    /// end is reported, so partitions moving back and forth leave nothing behind.
    slots: std::collections::BTreeMap<usize, Slot>,
    next_slot: usize,
    timers: Addr<TimerService>,
    reaper: Addr<Reaper>,
    requests: CoordinatorRequests<usize>,
    exit: Option<oneshot::Sender<ContainerExit>>,
    stopping: bool,
    failure: Option<String>,
    strikes: u32,
    degraded: bool,
    backlog_check_running: bool,
    utilization: Utilization,
    /// Cluster mode: slots come and go, and whoever holds the leases hears when one ends.
    observer: Option<Recipient<SlotEnded>>,
    /// Cluster mode: builds the slot of an ordered partition whose lease was acquired.
    partitions: Option<PartitionFactory>,
}

/// Builds the slot of an ordered partition: `(stream, partition, epoch, fence, paused)`.
pub type PartitionFactory = std::rc::Rc<dyn Fn(&str, u32, u64, crate::fence::Fence, bool) -> Option<SlotSpec>>;

impl std::fmt::Debug for Container {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Container")
            .field("slots", &self.slots.len())
            .field("stopping", &self.stopping)
            .finish_non_exhaustive()
    }
}

impl Container {
    /// A container over `slots`; it reports how it ended on `exit`.
    pub fn new(
        broker: SharedBroker,
        subjects: Subjects,
        config: ContainerConfig,
        slots: Vec<SlotSpec>,
        timers: Addr<TimerService>,
        reaper: Addr<Reaper>,
        exit: oneshot::Sender<ContainerExit>,
    ) -> Self {
        let requests = CoordinatorRequests::new(0..slots.len());
        let next_slot = slots.len();
        let slots = slots.into_iter().map(Slot::new).enumerate().collect();
        Self {
            broker,
            subjects,
            config,
            slots,
            next_slot,
            timers,
            reaper,
            requests,
            exit: Some(exit),
            stopping: false,
            failure: None,
            strikes: 0,
            degraded: false,
            backlog_check_running: false,
            utilization: Utilization::default(),
            observer: None,
            partitions: None,
        }
    }

    /// Cluster mode: slots are added and released as leases come and go, `observer`
    /// hears when each ends, and the container runs until it is stopped (a drained
    /// partition does not end it).
    pub fn observed_by(mut self, observer: Recipient<SlotEnded>, partitions: PartitionFactory) -> Self {
        self.observer = Some(observer);
        self.partitions = Some(partitions);
        self
    }

    /// Tells the observer (cluster mode) that slot `i` ended, once no claim is out.
    fn report_ended(&mut self, i: usize, outcome: Outcome) {
        let Some(observer) = &self.observer else { return };
        let Some(s) = self.slots.get_mut(&i) else { return };
        if s.claiming {
            s.ended = Some(outcome);
            return;
        }
        observer.do_send(SlotEnded { slot: i, stream: s.spec.stream.clone(), partition: s.spec.partition, outcome });
        // Its end is reported and nothing of it is out: free it.
        self.slots.remove(&i);
    }

    fn spawn_worker(&mut self, i: usize, ctx: &mut Context<Self>) {
        let Some(slot) = self.slots.get_mut(&i) else { return };
        let handle = (slot.spec.spawn)(SlotContext {
            slot: i,
            container: ctx.address().recipient(),
            timers: self.timers.clone(),
            reaper: self.reaper.clone(),
            start: slot.spec.start.clone(),
        });
        if slot.paused {
            handle.control.do_send(WorkerControl::Pause);
        }
        slot.worker = Some(handle);
        slot.outstanding = 0;
        slot.finished = false;
        slot.stopping = false;
        // A shutdown request belonged to the worker that made it.
        slot.asked_to_end = false;
    }

    /// Starts claims for every slot with room.
    fn pump(&mut self, ctx: &mut Context<Self>) {
        let ids: Vec<usize> = self.slots.keys().copied().collect();
        for i in ids {
            self.pump_slot(i, ctx);
        }
    }

    /// Starts a claim for slot `i` if it has room. Events of one slot pump only that
    /// slot: a node holding thousands of partitions must not scan them all per message.
    fn pump_slot(&mut self, i: usize, ctx: &mut Context<Self>) {
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

    fn claimed(
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
                let base = Duration::from_millis(100).saturating_mul(1 << slot.failures.min(8));
                let delay = base.min(Duration::from_secs(5)).mul_f64(rand::rng().random_range(0.5..1.5));
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

    fn stop_all(&mut self, ctx: &mut Context<Self>) {
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

    fn maybe_exit(&mut self, ctx: &mut Context<Self>) {
        if self.slots.values().all(|s| s.finished || s.worker.is_none()) {
            self.exit(ctx);
        }
    }

    fn exit(&mut self, ctx: &mut Context<Self>) {
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
    fn restart(&mut self, i: usize, ctx: &mut Context<Self>) {
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
                    let base = Duration::from_millis(250).saturating_mul(1 << s.reset_failures.min(5));
                    let delay = base.min(Duration::from_secs(5)).mul_f64(rand::rng().random_range(0.5..1.5));
                    warn!(stream = %s.spec.stream, partition = s.spec.partition, error = %e, ?delay, "could not reset the partition; its task waits for the reset");
                    act.timers.do_send(After { delay, target: ctx.address().recipient(), tick: Tick::Restart(i) });
                }
            }
        }));
    }

    fn check_backlog(&mut self, ctx: &mut Context<Self>) {
        if self.backlog_check_running {
            return;
        }
        self.backlog_check_running = true;
        let broker = self.broker.clone();
        self.utilization.sample();
        let targets: Vec<(usize, String, Option<u32>, BacklogSource)> = self
            .slots
            .iter()
            .filter(|(_, s)| !s.finished)
            .map(|(i, s)| {
                let spec = &s.spec;
                // An ordered partition's messages share its stream with the others'.
                let subject = spec.partition.and_then(|p| {
                    let name = flotilla_transport::wire::StreamName::new(spec.stream.clone()).ok()?;
                    Some(self.subjects.ordered_partition(&name, p))
                });
                let source = BacklogSource { js: spec.js_stream.clone(), consumer: spec.consumer.clone(), subject };
                (*i, spec.stream.clone(), spec.partition, source)
            })
            .collect();
        let dlq = self.subjects.dlq_stream_name();
        let fut = async move {
            // The dead letters, as part of the backlog an operator watches.
            if let Ok(state) = broker.stream_state(&dlq).await {
                crate::metrics::dlq_reading(&state, std::time::SystemTime::now());
            }
            let mut readings = Vec::new();
            for (i, stream, partition, BacklogSource { js, consumer, subject }) in targets {
                if let Ok(c) = broker.consumer_state(&js, &consumer).await {
                    let waiting = c.num_pending + c.num_ack_pending;
                    let age = if waiting == 0 {
                        Duration::ZERO
                    } else {
                        oldest_unacked(&broker, &js, c.ack_floor + 1, subject.as_deref()).await
                    };
                    readings.push((i, stream, partition, waiting, age));
                }
            }
            readings
        };
        ctx.spawn(fut.into_actor(self).map(|readings, act, _| {
            act.backlog_check_running = false;
            // Only slots still running here report (one that ended meanwhile was zeroed).
            for (i, _, _, waiting, age) in &readings {
                if let Some(s) = act.slots.get(i).filter(|s| !s.finished) {
                    s.metrics.backlog.set(*waiting as f64);
                    s.metrics.oldest_age.set(age.as_secs_f64());
                }
            }
            let readings: Vec<(String, Option<u32>, u64, Duration)> = readings
                .into_iter()
                .map(|(_, stream, partition, waiting, age)| (stream, partition, waiting, age))
                .collect();
            let total: u64 = readings.iter().map(|r| r.2).sum();
            if total > act.config.backlog_threshold {
                act.strikes += 1;
                if act.strikes >= act.config.backlog_strikes && !act.degraded {
                    act.degraded = true;
                    if let Some((stream, partition, backlog, age)) = readings.into_iter().max_by_key(|r| r.2) {
                        emit(
                            &act.broker,
                            &act.subjects,
                            Event::Degraded {
                                stream,
                                partition,
                                backlog,
                                oldest_age_ms: age.as_millis() as u64,
                                total_backlog: total,
                            },
                        );
                    }
                }
            } else {
                act.strikes = 0;
                if act.degraded {
                    act.degraded = false;
                    emit(&act.broker, &act.subjects, Event::Recovered { total_backlog: total });
                }
            }
        }));
    }
}

/// Where the backlog check reads a slot's backlog: its JetStream stream and consumer,
/// and (ordered partitions) the partition's subject.
struct BacklogSource {
    js: String,
    consumer: String,
    subject: Option<String>,
}

/// How many messages of other partitions the backlog check reads past, looking for a
/// partition's oldest unacknowledged one.
const AGE_SCAN: u64 = 16;

/// The age of the oldest unacknowledged message from `first` on: the first message on
/// `subject` (an ordered partition's; any, for a queue input) within [`AGE_SCAN`]
/// sequences. Past that, the first message read stands in (older than the partition's
/// own, so the age is an upper bound).
async fn oldest_unacked(broker: &SharedBroker, js: &str, first: u64, subject: Option<&str>) -> Duration {
    let mut stand_in = None;
    for seq in first..first.saturating_add(AGE_SCAN) {
        match broker.get_message(js, seq).await {
            Ok(Some(m)) => {
                if subject.is_none_or(|s| m.subject == s) {
                    stand_in = Some(m.published);
                    break;
                }
                stand_in.get_or_insert(m.published);
            }
            Ok(None) => continue,
            Err(_) => break,
        }
    }
    stand_in.map_or(Duration::ZERO, |t| std::time::SystemTime::now().duration_since(t).unwrap_or_default())
}

impl Actor for Container {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let ids: Vec<usize> = self.slots.keys().copied().collect();
        for i in ids {
            self.spawn_worker(i, ctx);
        }
        let me = ctx.address().recipient::<Tick>();
        self.timers.do_send(Every { period: self.config.backlog_interval, target: me.clone(), tick: Tick::Backlog });
        if self.slots.values().any(|s| s.spec.sweep) {
            self.timers.do_send(Every { period: self.config.sweep_interval, target: me, tick: Tick::Sweep });
        }
        self.pump(ctx);
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        // A claim that outlived the container would take messages nobody handles (they
        // would wait for ack-wait): end them with it.
        for slot in self.slots.values_mut() {
            if let Some(task) = slot.claim_task.take() {
                task.abort();
            }
        }
    }
}

impl Handler<Claimed> for Container {
    type Result = ();

    fn handle(&mut self, Claimed { slot, result }: Claimed, ctx: &mut Context<Self>) {
        if !self.slots.contains_key(&slot) {
            return;
        }
        self.claimed(slot, result, ctx);
        self.pump_slot(slot, ctx);
    }
}

impl Handler<WorkerReport> for Container {
    type Result = ();

    fn handle(&mut self, report: WorkerReport, ctx: &mut Context<Self>) {
        let slot = match &report {
            WorkerReport::Completed { slot, .. }
            | WorkerReport::ShutdownRequested { slot, .. }
            | WorkerReport::Finished { slot, .. } => *slot,
        };
        match report {
            WorkerReport::Completed { slot, count } => {
                if let Some(s) = self.slots.get_mut(&slot) {
                    s.outstanding = s.outstanding.saturating_sub(count);
                    s.metrics.pending.set(s.outstanding as f64);
                    s.restarts = 0;
                    s.restores = 0;
                }
            }
            WorkerReport::ShutdownRequested { slot, scope } => {
                self.requests.request(slot, scope);
                let all = scope == ShutdownScope::AllTasksInContainer;
                if (self.observer.is_none() || all) && self.requests.should_shutdown() {
                    info!(?scope, "tasks asked to shut down the container");
                    self.stop_all(ctx);
                } else if scope == ShutdownScope::CurrentTask
                    && let Some(s) = self.slots.get_mut(&slot)
                    && let Some(w) = s.worker.as_ref()
                {
                    s.stopping = true;
                    // In a cluster the request outlives this node: the partition is done
                    // for the run, and the run ends once every partition is.
                    s.asked_to_end = s.spec.partition.is_some();
                    w.stop.do_send(StopWorker);
                }
            }
            WorkerReport::Finished { slot, outcome } => {
                let outcome_copy = outcome.clone();
                let Some(s) = self.slots.get_mut(&slot) else { return };
                s.finished = true;
                s.outstanding = 0;
                // What this node no longer runs, it no longer reports.
                s.metrics.pending.set(0.0);
                s.metrics.backlog.set(0.0);
                s.metrics.oldest_age.set(0.0);
                match outcome {
                    Outcome::Failed(reason) if !self.stopping => match s.spec.policy {
                        FailurePolicy::FailContainer => {
                            self.failure = Some(format!(
                                "task {} partition {:?} failed: {reason}",
                                s.spec.stream, s.spec.partition
                            ));
                            self.stop_all(ctx);
                        }
                        FailurePolicy::RestartTask => {
                            // Back off exponentially, so a message that fails the task
                            // every time does not restart it in a tight loop.
                            s.restarts += 1;
                            s.worker = None;
                            s.restart_pending = true;
                            let base = Duration::from_millis(100).saturating_mul(1 << s.restarts.min(9));
                            let delay = base.min(Duration::from_secs(30)).mul_f64(rand::rng().random_range(0.8..1.2));
                            warn!(stream = %s.spec.stream, partition = s.spec.partition, %reason, restarts = s.restarts, ?delay, "restarting the failed task");
                            self.timers.do_send(After {
                                delay,
                                target: ctx.address().recipient(),
                                tick: Tick::Restart(slot),
                            });
                        }
                    },
                    Outcome::Resync(reason) if !self.stopping && !s.stopping => {
                        // Not a failure: reset the partition at once and go on.
                        info!(stream = %s.spec.stream, partition = s.spec.partition, %reason, "resetting the partition to its committed position");
                        s.worker = None;
                        s.restart_pending = true;
                        s.resyncing = true;
                        self.restart(slot, ctx);
                    }
                    Outcome::Restore { reason, blame } if !self.stopping && !s.stopping => {
                        // Not a failure either, but one that repeats backs off, and the
                        // message that forces it has the restore counted as an attempt.
                        s.restores += 1;
                        if let Some(seq) = blame {
                            match s.blamed.iter_mut().find(|(at, _)| *at == seq) {
                                Some((_, n)) => *n += 1,
                                None => s.blamed.push((seq, 1)),
                            }
                        }
                        s.worker = None;
                        s.restart_pending = true;
                        s.resyncing = true;
                        let delay = match s.restores {
                            1 => Duration::ZERO,
                            n => crate::retry::RetryPolicy {
                                initial_backoff: Duration::from_millis(100),
                                ..crate::retry::RetryPolicy::default()
                            }
                            .backoff(n - 1),
                        };
                        info!(stream = %s.spec.stream, partition = s.spec.partition, %reason, ?blame, restores = s.restores, ?delay, "restoring the partition from its last commit");
                        self.timers.do_send(After {
                            delay,
                            target: ctx.address().recipient(),
                            tick: Tick::Restart(slot),
                        });
                    }
                    Outcome::Drained | Outcome::EndOfStream if self.observer.is_none() => {
                        self.requests.request(slot, ShutdownScope::CurrentTask);
                        if self.requests.should_shutdown() {
                            self.stop_all(ctx);
                        }
                    }
                    _ => {}
                }
                let restarting = self.slots.get(&slot).is_some_and(|s| s.worker.is_none()) && !self.stopping;
                let asked_to_end = self.slots.get(&slot).is_some_and(|s| s.asked_to_end);
                let outcome_copy = match outcome_copy {
                    Outcome::Stopped if asked_to_end => {
                        info!(slot, "the task asked to shut down: its partition is done for this run");
                        Outcome::EndOfStream
                    }
                    other => other,
                };
                if !restarting {
                    self.report_ended(slot, outcome_copy);
                }
                if self.stopping {
                    self.maybe_exit(ctx);
                }
            }
        }
        self.pump_slot(slot, ctx);
    }
}

impl Handler<AddSlot> for Container {
    type Result = Option<usize>;

    fn handle(&mut self, add: AddSlot, ctx: &mut Context<Self>) -> Option<usize> {
        let factory = self.partitions.as_ref()?;
        let mut spec = factory(&add.stream, add.partition, add.epoch, add.fence, add.paused)?;
        spec.start = add.start;
        let i = self.next_slot;
        self.next_slot += 1;
        info!(stream = %spec.stream, partition = spec.partition, epoch = spec.epoch, "consuming a partition");
        let mut slot = Slot::new(spec);
        slot.finished = self.stopping;
        self.slots.insert(i, slot);
        if self.stopping {
            // Too late to start: report it ended, so its lease is released.
            self.report_ended(i, Outcome::Stopped);
            return Some(i);
        }
        self.spawn_worker(i, ctx);
        self.pump_slot(i, ctx);
        Some(i)
    }
}

impl Handler<ReleaseSlot> for Container {
    type Result = ();

    fn handle(&mut self, ReleaseSlot(i): ReleaseSlot, _: &mut Context<Self>) {
        let Some(s) = self.slots.get_mut(&i) else { return };
        if s.restart_pending {
            // The failed task waits for a restart: nothing runs, so it ends now and the
            // restart is cancelled (the lease goes to whoever takes it next).
            info!(stream = %s.spec.stream, partition = s.spec.partition, "handing over a partition whose task waits for a restart");
            s.restart_pending = false;
            s.stopping = true;
            s.finished = true;
            if !s.resetting {
                // (A reset in flight reports it when it returns.)
                self.report_ended(i, Outcome::Stopped);
            }
            return;
        }
        if !s.finished && !s.stopping {
            info!(stream = %s.spec.stream, partition = s.spec.partition, "handing a partition over");
            s.stopping = true;
            if let Some(w) = &s.worker {
                w.stop.do_send(StopWorker);
            }
        }
    }
}

impl Handler<SetPaused> for Container {
    type Result = ();

    fn handle(&mut self, msg: SetPaused, ctx: &mut Context<Self>) {
        if let Some(s) = self.slots.get_mut(&msg.slot)
            && s.paused != msg.paused
        {
            s.paused = msg.paused;
            s.step_credits = 0;
            if let Some(w) = &s.worker {
                w.control.do_send(if msg.paused { WorkerControl::Pause } else { WorkerControl::Resume });
            }
        }
        self.pump_slot(msg.slot, ctx);
    }
}

impl Handler<StepSlot> for Container {
    type Result = ();

    fn handle(&mut self, StepSlot(i): StepSlot, ctx: &mut Context<Self>) {
        if let Some(s) = self.slots.get_mut(&i)
            && s.paused
        {
            s.step_credits += 1;
            if let Some(w) = &s.worker {
                w.control.do_send(WorkerControl::Step);
            }
        }
        self.pump_slot(i, ctx);
    }
}

impl Handler<Snapshot> for Container {
    type Result = MessageResult<Snapshot>;

    fn handle(&mut self, _: Snapshot, _: &mut Context<Self>) -> Self::Result {
        MessageResult(
            self.slots
                .values()
                .filter(|s| !s.finished)
                .map(|s| crate::cluster::SlotStatus {
                    stream: s.spec.stream.clone(),
                    partition: s.spec.partition,
                    epoch: s.spec.epoch,
                    in_flight: s.outstanding as u64,
                    deliveries: s.deliveries,
                    redeliveries: s.redeliveries,
                    paused: s.paused,
                    state: if s.stopping { "stopping" } else { "running" }.to_owned(),
                })
                .collect(),
        )
    }
}

impl Handler<StopContainer> for Container {
    type Result = ();

    fn handle(&mut self, _: StopContainer, ctx: &mut Context<Self>) {
        info!("graceful stop requested");
        self.stop_all(ctx);
    }
}

impl Handler<Tick> for Container {
    type Result = ();

    fn handle(&mut self, tick: Tick, ctx: &mut Context<Self>) {
        match tick {
            Tick::Resume => {}
            Tick::Restart(slot) => self.restart(slot, ctx),
            Tick::Backlog => self.check_backlog(ctx),
            Tick::Sweep => {
                for s in self.slots.values().filter(|s| s.spec.sweep && !s.finished) {
                    let sweep = Sweep {
                        stream: s.spec.stream.clone(),
                        js_stream: s.spec.js_stream.clone(),
                        consumer: s.spec.consumer.clone(),
                    };
                    let fut = self.reaper.send(sweep);
                    actix::spawn(async move {
                        if let Ok(Err(e)) = fut.await {
                            warn!(error = %e, "sweep failed");
                        }
                    });
                }
            }
            _ => {}
        }
        self.pump(ctx);
    }
}

/// How many slots the container holds (tests).
#[cfg(test)]
#[derive(Debug, Message)]
#[rtype(result = "usize")]
struct SlotCount;

#[cfg(test)]
impl Handler<SlotCount> for Container {
    type Result = usize;

    fn handle(&mut self, _: SlotCount, _: &mut Context<Self>) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_claims_wait_longer_up_to_the_idle_wait() {
        let (base, idle) = (Duration::from_secs(1), Duration::from_secs(5));
        let waits: Vec<u64> = (0..6).map(|n| claim_wait_after(n, base, idle).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 5, 5, 5]);
        assert_eq!(claim_wait_after(u32::MAX, base, idle), idle, "no overflow");
        // Cluster mode: the idle wait is the claim wait.
        assert_eq!(claim_wait_after(7, base, base), base);
        // An idle wait below the claim wait never shortens it.
        assert_eq!(claim_wait_after(3, base, Duration::from_millis(10)), base);
    }

    /// A worker that takes nothing and stops when told (or fails at once).
    struct Idle {
        slot: usize,
        container: Recipient<WorkerReport>,
        fail: bool,
    }
    impl Actor for Idle {
        type Context = Context<Self>;
        fn started(&mut self, ctx: &mut Context<Self>) {
            if self.fail {
                self.container
                    .do_send(WorkerReport::Finished { slot: self.slot, outcome: Outcome::Failed("boom".into()) });
                ctx.stop();
            }
        }
    }
    impl Handler<Deliver> for Idle {
        type Result = ();
        fn handle(&mut self, _: Deliver, _: &mut Context<Self>) {}
    }
    impl Handler<WorkerControl> for Idle {
        type Result = ();
        fn handle(&mut self, _: WorkerControl, _: &mut Context<Self>) {}
    }
    impl Handler<StopWorker> for Idle {
        type Result = ();
        fn handle(&mut self, _: StopWorker, ctx: &mut Context<Self>) {
            self.container.do_send(WorkerReport::Finished { slot: self.slot, outcome: Outcome::Stopped });
            ctx.stop();
        }
    }

    struct Ends(std::sync::Arc<std::sync::Mutex<Vec<usize>>>);
    impl Actor for Ends {
        type Context = Context<Self>;
    }
    impl Handler<SlotEnded> for Ends {
        type Result = ();
        fn handle(&mut self, ended: SlotEnded, _: &mut Context<Self>) {
            self.0.lock().expect("lock").push(ended.slot);
        }
    }

    /// Cluster mode: a partition that comes and goes a hundred times leaves no slot
    /// behind, and no slot id is used twice.
    #[actix_rt::test]
    async fn slots_of_released_partitions_are_freed() {
        let broker = flotilla_transport::EmbeddedBroker::new().shared();
        let subjects = Subjects::new(flotilla_transport::wire::JobName::new("j").expect("name"));
        let timers = TimerService::default().start();
        let reaper = Reaper::new(broker.clone(), subjects.clone()).start();
        let factory: PartitionFactory = std::rc::Rc::new(|stream: &str, p, epoch, fence, paused| {
            Some(SlotSpec {
                stream: stream.to_owned(),
                partition: Some(p),
                js_stream: "FLOTILLA_j_in".into(),
                consumer: format!("in-p{p}"),
                capacity: 1,
                policy: FailurePolicy::FailContainer,
                sweep: false,
                takeover: None,
                start: None,
                epoch,
                fence: Some(fence),
                paused,
                spawn: Box::new(|sc: SlotContext| {
                    let idle = Idle { slot: sc.slot, container: sc.container, fail: false }.start();
                    WorkerHandle {
                        deliver: idle.clone().recipient(),
                        stop: idle.clone().recipient(),
                        control: idle.recipient(),
                    }
                }),
            })
        });
        let ended = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let observer = Ends(ended.clone()).start();
        let (tx, _rx) = oneshot::channel();
        let container = Container::new(broker, subjects, ContainerConfig::default(), Vec::new(), timers, reaper, tx)
            .observed_by(observer.recipient(), factory)
            .start();
        let mut ids = Vec::new();
        for _ in 0..100 {
            let fence = crate::fence::Fence::until(tokio::time::Instant::now() + Duration::from_secs(60));
            let add = AddSlot { stream: "in".into(), partition: 3, epoch: 1, fence, paused: false, start: None };
            let id = container.send(add).await.expect("container").expect("a slot");
            ids.push(id);
            container.send(ReleaseSlot(id)).await.expect("container");
            for _ in 0..200 {
                if ended.lock().expect("lock").contains(&id) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert!(ended.lock().expect("lock").contains(&id), "slot {id} never ended");
        }
        let held = container.send(SlotCount).await.expect("container");
        assert_eq!(held, 0, "slots left behind");
        ids.dedup();
        assert_eq!(ids.len(), 100, "slot ids are not reused");
    }

    /// Cluster mode: a failed task whose partition cannot be reset (its stream is gone)
    /// starts no worker, and after a few tries the partition is handed back.
    #[actix_rt::test]
    async fn a_partition_that_cannot_be_reset_is_handed_back_not_run() {
        tokio::time::pause();
        let broker = flotilla_transport::EmbeddedBroker::new().shared();
        let subjects = Subjects::new(flotilla_transport::wire::JobName::new("j").expect("name"));
        let timers = TimerService::default().start();
        let reaper = Reaper::new(broker.clone(), subjects.clone()).start();
        let starts = std::rc::Rc::new(std::cell::Cell::new(0));
        let counted = starts.clone();
        let factory: PartitionFactory = std::rc::Rc::new(move |stream: &str, p, epoch, fence, paused| {
            let counted = counted.clone();
            Some(SlotSpec {
                stream: stream.to_owned(),
                partition: Some(p),
                js_stream: "FLOTILLA_j_gone".into(),
                consumer: format!("in-p{p}"),
                capacity: 1,
                policy: FailurePolicy::RestartTask,
                sweep: false,
                takeover: Some(flotilla_transport::broker::ConsumerSpec::new(format!("in-p{p}"))),
                start: None,
                epoch,
                fence: Some(fence),
                paused,
                spawn: Box::new(move |sc: SlotContext| {
                    counted.set(counted.get() + 1);
                    let idle = Idle { slot: sc.slot, container: sc.container, fail: true }.start();
                    WorkerHandle {
                        deliver: idle.clone().recipient(),
                        stop: idle.clone().recipient(),
                        control: idle.recipient(),
                    }
                }),
            })
        });
        let ended = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let observer = Ends(ended.clone()).start();
        let (tx, _rx) = oneshot::channel();
        let container = Container::new(broker, subjects, ContainerConfig::default(), Vec::new(), timers, reaper, tx)
            .observed_by(observer.recipient(), factory)
            .start();
        let fence = crate::fence::Fence::until(tokio::time::Instant::now() + Duration::from_secs(3600));
        let add = AddSlot { stream: "in".into(), partition: 0, epoch: 1, fence, paused: false, start: None };
        let id = container.send(add).await.expect("container").expect("a slot");
        for _ in 0..600 {
            if ended.lock().expect("lock").contains(&id) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(ended.lock().expect("lock").contains(&id), "the partition was never handed back");
        assert_eq!(starts.get(), 1, "no worker started after a failed reset");
    }
}
