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

mod backlog;
mod claims;
mod messages;
mod slot;
mod supervision;
#[cfg(test)]
mod tests;

use messages::Claimed;
pub use messages::{AddSlot, ContainerExit, ReleaseSlot, SetPaused, SlotEnded, Snapshot, StepSlot, StopContainer};
pub use slot::{SlotContext, SlotSpec, SpawnWorker, WorkerHandle};

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
use std::time::Duration;
use tokio::sync::oneshot;
use tracing::{info, warn};

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
                            let delay = crate::retry::TASK_RESTART.wait(s.restarts, crate::retry::sample());
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
                            n => crate::retry::RESTORE.wait(n - 1, crate::retry::sample()),
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
