//! `Container`: the node's run loop for one job.
//!
//! It supervises the task workers of the inputs this node consumes — one per ordered
//! partition, one per queue input — each of which pulls for itself only what it can
//! take (for an ordered partition, up to the commit window of uncommitted messages;
//! for a queue input, up to `max_concurrency` messages in flight, so the backlog stays
//! in the broker; see `task_worker/pull.rs`). The container starts them, tracks
//! coordinator requests (a task's `shutdown(CurrentTask | AllTasksInContainer)`),
//! applies the failure policy (fail the container, or restart the task), forwards an
//! operator's pause and step, watches the backlog (`degraded` after several high
//! checks, `recovered` after), and has the reaper sweep queue inputs for stranded
//! messages.
//!
//! Supervision: started by the job runner; when it exits it reports a
//! [`ContainerExit`] through the channel it was given and stops.

mod backlog;
mod messages;
mod slot;
mod supervision;
#[cfg(test)]
mod tests;

pub use messages::{AddSlot, ContainerExit, ReleaseSlot, SetPaused, SlotEnded, Snapshot, StepSlot, StopContainer};
use slot::{Run, Slot};
pub use slot::{SlotContext, SlotSpec, SpawnWorker, WorkerHandle};

use crate::config::FailurePolicy;
use crate::events::{Event, emit};
use crate::metrics::{SlotMetrics, Utilization};
use crate::reaper::{Reaper, Sweep};
use crate::state::{CoordinatorRequests, ShutdownScope};
use crate::task_worker::{ClaimCounts, Outcome, Source, StopWorker, WorkerControl, WorkerReport};
use crate::timer_service::{After, Every, Tick, TimerService};
use actix::prelude::*;
use flotilla_proto::partition::machine::ClaimRules;
use flotilla_transport::broker::SharedBroker;
use flotilla_transport::wire::Subjects;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tracing::{info, warn};

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
    /// The claim rules of the slots, one copy per capacity.
    claim_rules: std::collections::HashMap<usize, Arc<ClaimRules>>,
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
            claim_rules: std::collections::HashMap::new(),
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

    /// Tells the observer (cluster mode) that slot `i` ended (its worker reports its end
    /// once its last claim is back).
    fn report_ended(&mut self, i: usize, outcome: Outcome) {
        let Some(observer) = &self.observer else { return };
        let Some(s) = self.slots.get(&i) else { return };
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
            source: Source { js_stream: slot.spec.js_stream.clone(), consumer: slot.spec.consumer.clone() },
            claims: self
                .claim_rules
                .entry(slot.spec.capacity)
                .or_insert_with(|| {
                    Arc::new(ClaimRules {
                        capacity: slot.spec.capacity,
                        wait: self.config.claim_wait,
                        idle_wait: self.config.idle_claim_wait,
                    })
                })
                .clone(),
            paused: slot.paused,
            counts: slot.counts.clone(),
        });
        // (A shutdown request belonged to the worker that made it.)
        slot.run = Run::Running(handle);
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
    }
}

impl Handler<WorkerReport> for Container {
    type Result = ();

    fn handle(&mut self, report: WorkerReport, ctx: &mut Context<Self>) {
        match report {
            WorkerReport::Progressed { slot } => {
                if let Some(s) = self.slots.get_mut(&slot) {
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
                {
                    // In a cluster the request outlives this node: the partition is done
                    // for the run, and the run ends once every partition is.
                    let asked_to_end = s.spec.partition.is_some();
                    s.stop_worker(asked_to_end);
                }
            }
            WorkerReport::Finished { slot, outcome } => self.worker_finished(slot, outcome, ctx),
        }
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
        if self.stopping {
            slot.run = Run::Ended;
        }
        self.slots.insert(i, slot);
        if self.stopping {
            // Too late to start: report it ended, so its lease is released.
            self.report_ended(i, Outcome::Stopped);
            return Some(i);
        }
        self.spawn_worker(i, ctx);
        Some(i)
    }
}

impl Handler<ReleaseSlot> for Container {
    type Result = ();

    fn handle(&mut self, ReleaseSlot(i): ReleaseSlot, _: &mut Context<Self>) {
        let Some(s) = self.slots.get_mut(&i) else { return };
        match s.run {
            Run::Waiting { resetting, .. } => {
                // The task waits for a restart: nothing runs, so it ends now and the
                // restart is cancelled (the lease goes to whoever takes it next).
                info!(stream = %s.spec.stream, partition = s.spec.partition, "handing over a partition whose task waits for a restart");
                s.run = Run::Ended;
                if !resetting {
                    // (A reset in flight reports it when it returns.)
                    self.report_ended(i, Outcome::Stopped);
                }
            }
            Run::Running(_) => {
                info!(stream = %s.spec.stream, partition = s.spec.partition, "handing a partition over");
                s.stop_worker(false);
            }
            Run::Stopping { .. } | Run::Ended => {}
        }
    }
}

impl Handler<SetPaused> for Container {
    type Result = ();

    fn handle(&mut self, msg: SetPaused, _: &mut Context<Self>) {
        if let Some(s) = self.slots.get_mut(&msg.slot)
            && s.paused != msg.paused
        {
            s.paused = msg.paused;
            if let Some(w) = s.worker() {
                w.control.do_send(if msg.paused { WorkerControl::Pause } else { WorkerControl::Resume });
            }
        }
    }
}

impl Handler<StepSlot> for Container {
    type Result = ();

    fn handle(&mut self, StepSlot(i): StepSlot, _: &mut Context<Self>) {
        if let Some(s) = self.slots.get(&i)
            && s.paused
            && let Some(w) = s.worker()
        {
            w.control.do_send(WorkerControl::Step);
        }
    }
}

impl Handler<Snapshot> for Container {
    type Result = MessageResult<Snapshot>;

    fn handle(&mut self, _: Snapshot, _: &mut Context<Self>) -> Self::Result {
        MessageResult(
            self.slots
                .values()
                .filter(|s| s.live())
                .map(|s| crate::cluster::SlotStatus {
                    stream: s.spec.stream.clone(),
                    partition: s.spec.partition,
                    epoch: s.spec.epoch,
                    in_flight: s.counts.in_flight(),
                    deliveries: s.counts.deliveries(),
                    redeliveries: s.counts.redeliveries(),
                    paused: s.paused,
                    state: if matches!(s.run, Run::Stopping { .. }) { "stopping" } else { "running" }.to_owned(),
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
            Tick::Restart(slot) => self.restart(slot, ctx),
            Tick::Backlog => self.check_backlog(ctx),
            Tick::Sweep => {
                for s in self.slots.values().filter(|s| s.spec.sweep && s.live()) {
                    let sweep = Sweep {
                        stream: s.spec.stream.clone(),
                        js_stream: s.spec.js_stream.to_string(),
                        consumer: s.spec.consumer.to_string(),
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
    }
}
