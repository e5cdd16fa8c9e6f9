//! `TaskWorker`: owns one user task and its [`TaskState`], and wires the state machine
//! to time (ticks from the [`TimerService`]) and to the broker (acks, naks, in-progress
//! acks, commits, dead letters through the [`Reaper`]).
//!
//! One worker serves one ordered partition, or one queue input on this node.
//!
//! * **Effect before ack.** A message's outputs are published pipelined while the task
//!   goes on; the message is acknowledged (queue) or becomes committable (ordered) only
//!   once every output has its publish ack.
//! * **Ordered inputs** commit with an ack-all of the contiguous completed prefix once
//!   everything claimed is done (the task is idle) or a whole window is uncommitted, and
//!   at the latest a commit interval after a completion: one commit per claimed window,
//!   as a plain consumer acks the last message of each fetch.
//!   A failing message is retried in place with backoff (the partition waits, order is
//!   kept), then dead-lettered and skipped.
//! * **Queue inputs** ack each message; a failing message is nak'd with the backoff
//!   delay, and dead-lettered then terminated on its last attempt (the attempt number
//!   is the broker's delivery count, so it survives nodes). Long handlers get an
//!   in-progress ack every third of ack-wait.
//! * Undecodable messages (bad bytes, wrong type header, unknown kind, too large) go to
//!   the dead-letter stream on their first delivery; a panicking handler is a failed
//!   attempt.
//! * **A lost delivery** (the consumer's delivery sequence skips) stops an ordered
//!   worker: it commits what arrived complete and ends with [`Outcome::Resync`], and the
//!   container resets the partition at its committed position.
//! * **Suspects**: after a take-over that found the previous owner's work unfinished,
//!   each message up to where it had got is counted in the job's KV while it runs, one
//!   per node at a time, for its first seconds (see `suspects.rs`); one that ended
//!   `crash_limit` owners goes to the dead-letter stream as `crash-loop`.
//!
//! The rules (which delivery to take, what runs next, a message's attempts, what a
//! failure, a hand-back or a dead letter does to it, when to commit and what a commit
//! acknowledges, which suspect to quarantine) are the partition machine
//! [`Partition`] in `flotilla_proto::partition::machine`, tested on its own: it owns
//! the held and claimed messages and the readiness machine's in-flight count, and says
//! what to do as [`Effect`]s, which this actor performs (`perform`, once per turn with
//! the batched acks). This file holds the actor, its state and its handlers; the work
//! is in role files beside it: `attempt.rs` (one attempt at a message), `effects.rs`
//! (publishing outputs, acking positions), `finish.rs` (dead letters, hand-backs,
//! stop), `hooks.rs`, `stores.rs` (restore, commits with stores) and `drive.rs` (the
//! turn, routing, parking).
//!
//! Supervision: the [`Container`](crate::container::Container) starts workers and decides,
//! by the task's [`FailurePolicy`](crate::config::FailurePolicy), what a failed worker
//! means: the worker itself hands back everything it holds (nak without delay) and stops.

mod attempt;
mod changelog;
mod drive;
mod effects;
mod finish;
mod hooks;
mod messages;
mod pull;
mod released;
mod stores;
mod suspects;
pub(crate) mod timers;
pub use released::{RELEASE_ALLOWANCE, RELEASED, RELEASED_TTL};
pub use timers::{ARMINGS, ARMINGS_TTL};

pub use messages::{Outcome, StopWorker, WorkerControl, WorkerReport};
pub use pull::{ClaimCounts, Source};

use crate::config::TaskConfig;
use crate::events::{Event, emit};
use crate::metrics::{AckCount, TaskMetrics};
use crate::reaper::{DeadLetter, Reaper};
use crate::state::{EnvelopeKind, TaskState};
use crate::stream::StreamKind;
use crate::supervise::{Panic, Supervised, panic_text, supervised};
use crate::task::{MessageMeta, Outputs, Task, TaskContext, TaskEnv, TaskError};
use crate::timer_service::{After, Every, Tick, TimerService};
use crate::trace::TraceContext;
use actix::prelude::*;
pub use flotilla_proto::partition::intake::SuspectRecord;
use flotilla_proto::partition::intake::{Admission, AfterFailure, Discipline, Intake, Suspects, park_retry_delay};
use flotilla_proto::partition::machine::{
    self, AfterCommit, CommitPlan, Delivered, Effect, Finished, Held, Next, Partition, Route, StopFacts, StopStep,
    event as ev,
};
use flotilla_transport::broker::{AckKind, AckToken, BrokerError, BrokerResult, Delivery, ErrorClass, OutboundMessage};
use flotilla_transport::wire::{MessageId, MessageKind, headers};
use futures::future::LocalBoxFuture;
use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::Duration;
use tokio::time::Instant;
use tracing::{Instrument, debug, info, warn};

/// The job's KV bucket of suspects ([`SuspectRecord`] per partition).
pub const SUSPECTS: &str = "SUSPECTS";

/// How long a worker that ends may take to send its hand-backs and confirm its last
/// commit before it reports its end anyway (the broker unreachable): a stop ends within
/// the drain timeout and this.
pub const FINISH_BUDGET: Duration = Duration::from_secs(3);

/// A task's settings as all its workers share them: one copy per task, not per
/// partition (a node may hold thousands of idle partitions).
#[derive(Debug, Clone)]
pub struct Settings {
    config: Rc<TaskConfig>,
    rules: Arc<machine::Config>,
}

impl Settings {
    /// The settings of a task consuming an input of `kind`.
    pub fn new(config: TaskConfig, kind: StreamKind) -> Self {
        let rules = machine::Config {
            discipline: if matches!(kind, StreamKind::Ordered { .. }) {
                Discipline::Ordered
            } else {
                Discipline::Queue
            },
            retry: config.retry,
            unavailable_retries: config.unavailable_retries,
            window: config.window,
            timing: machine::Timing {
                commit_interval: config.commit_interval,
                ack_wait: config.ack_wait,
                callback_timeout: config.callback_timeout,
            },
        };
        Self { config: Rc::new(config), rules: Arc::new(rules) }
    }
}

/// Where a worker's messages come from.
#[derive(Debug, Clone)]
pub struct Binding {
    /// The input stream's name.
    pub stream: &'static str,
    /// Ordered or queue.
    pub kind: StreamKind,
    /// The type name expected in `Flotilla-Type`.
    pub type_name: &'static str,
    /// The partition (ordered inputs).
    pub partition: Option<u32>,
    /// The worker's slot in its container.
    pub slot: usize,
    /// The partition's fencing epoch (0 without leases).
    pub epoch: u64,
    /// Whether this node may still act for the partition (cluster mode): once it is not
    /// valid, the worker starts, publishes and commits nothing more and stops.
    pub fence: Option<crate::fence::Fence>,
    /// Ordered inputs: where the partition resumed, when known.
    pub start: Option<PartitionStart>,
}

/// Where an ordered partition's worker starts, as its take-over found it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PartitionStart {
    /// The partition consumer's delivery sequence before the worker's first delivery
    /// (0 after a reset). Each delivery must follow the one before it; one that does
    /// not means a delivery was lost, and the worker stops committing and asks for a
    /// reset ([`Outcome::Resync`]).
    pub delivered_consumer_seq: u64,
    /// The previous owner left messages unfinished up to this stream sequence (it died,
    /// hung or failed): each of them is a suspect, counted in the job's KV while it
    /// runs, and dead-lettered as `crash-loop` once it has been started
    /// `crash_limit` times without finishing.
    pub suspects_up_to: Option<u64>,
    /// Tasks with stores: the messages (stream sequences) that forced restores of the
    /// partition before this worker, and how many each: each counts as one of its
    /// attempts.
    pub blamed: Vec<(u64, u32)>,
}

impl From<&flotilla_transport::topology::Resumption> for PartitionStart {
    fn from(r: &flotilla_transport::topology::Resumption) -> Self {
        Self {
            delivered_consumer_seq: r.state.delivered_consumer_seq,
            suspects_up_to: r.orphaned_up_to,
            blamed: Vec::new(),
        }
    }
}

impl Binding {
    fn ordered(&self) -> bool {
        matches!(self.kind, StreamKind::Ordered { .. })
    }

    /// The partition's lease is gone (or could not be renewed in time).
    fn fenced(&self) -> bool {
        self.fence.as_ref().is_some_and(|f| !f.valid())
    }
}

/// A delivery as the worker keeps it in its [`Partition`]: with the trace context of
/// its current attempt (see [`crate::trace`]), boxed: it is there only while traces are
/// collected, and every message moves through the machine a few times.
pub(crate) struct Msg {
    delivery: Delivery,
    trace: Option<Box<TraceContext>>,
}

impl Delivered for Msg {
    type Token = AckToken;
    fn stream_seq(&self) -> u64 {
        self.delivery.info.stream_seq
    }
    fn delivered(&self) -> u64 {
        self.delivery.info.delivered
    }
    fn token(&self) -> &AckToken {
        &self.delivery.token
    }
}

/// Outputs waiting to be published, and what they belong to.
struct Flush {
    target: FlushTarget,
    /// Shared with the broker while it publishes them, kept for a retry.
    msgs: std::sync::Arc<[flotilla_transport::broker::OutboundMessage]>,
    /// Publishes retried because the broker was unreachable.
    attempt: u32,
}

#[derive(Clone, Copy)]
enum FlushTarget {
    Message(u64),
    Hook(HookKind),
}

/// Which hook ran, for what happens once its outputs are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HookKind {
    Init,
    Window,
    Commit,
    Timers,
    Drain,
    EndOfStream,
    Shutdown,
}

impl HookKind {
    fn label(self) -> &'static str {
        match self {
            HookKind::Init => "init",
            HookKind::Window => "window",
            HookKind::Commit => "commit",
            HookKind::Timers => "timer",
            HookKind::Drain => "drain",
            HookKind::EndOfStream => "end_of_stream",
            HookKind::Shutdown => "shutdown",
        }
    }
}

/// Back-off while something is unreachable ([`crate::retry::UNAVAILABLE`]: 200 ms
/// doubling to 30 s, ±50 %), so that many workers retrying after one outage do not come
/// back at once.
fn unavailable_backoff(n: u32) -> Duration {
    crate::retry::UNAVAILABLE.wait(n, crate::retry::sample())
}

/// What a `process` call hands back: the task, its context and the handler's result
/// (`Err` when it panicked).
type Processed<T> = (Box<T>, TaskContext, Result<Result<(), TaskError>, Panic>);

/// What a message asks of the task: `process` with its decoded value, or the `timer`
/// hook with a durable timer's name.
enum Call<I> {
    Process(I),
    Timer(String),
}

/// A partition's durable state: its stores, and their changelog once restored.
struct Durable {
    stores: Rc<RefCell<crate::store::StoreSet>>,
    changelog: Option<changelog::Changelog>,
    /// Restore failures in a row.
    restore_failures: u32,
}

/// Which hook a non-process operation runs.
enum Hook {
    Init,
    Window,
    Commit,
    Timers(Vec<String>),
    Drain,
    EndOfStream,
    Shutdown,
}

/// The worker actor for task type `T`.
pub struct TaskWorker<T: Task> {
    /// Boxed so the actor is `Unpin` whatever the task is; `None` while checked out.
    task: Option<Box<T>>,
    /// The partition's messages and their rules: what is held, claimed, committed.
    part: Partition<Msg>,
    env: Rc<TaskEnv>,
    binding: Binding,
    /// Where it claims from.
    source: Source,
    /// What `status` shows of its claims.
    counts: Arc<ClaimCounts>,
    /// The claim out, if any (aborted if the worker stops before it is back).
    claim_task: Option<tokio::task::JoinHandle<()>>,
    /// Where its end's report stands while its last claim is out.
    end: pull::EndReport,
    config: Rc<TaskConfig>,
    container: Recipient<WorkerReport>,
    timers: Addr<TimerService>,
    reaper: Addr<Reaper>,
    /// The suspect this worker runs, with the node's suspect lane until its finish is
    /// stored or it outlived [`SUSPECT_WINDOW`](flotilla_proto::partition::intake::SUSPECT_WINDOW) (the permit then
    /// `None`: it runs on, no longer counted).
    lane: Option<(u64, Option<tokio::sync::OwnedSemaphorePermit>)>,
    /// Queue hand-backs on their way (release count, then nak).
    releases: Vec<tokio::task::JoinHandle<()>>,
    due_timers: Vec<String>,
    self_recipient: Option<Recipient<Tick>>,
    publish_queue: VecDeque<Flush>,
    publishing: bool,
    /// Acknowledgements queued during this turn.
    acks: Vec<(AckToken, AckKind)>,
    /// The container heard that this worker finished a message.
    progressed: bool,
    /// The deadline the last [`Tick::Deadline`] on its way was armed for.
    tick_at: Option<std::time::Instant>,
    /// Output batches published and not yet stored (or given up).
    flushes_in_flight: usize,
    /// Tasks with stores (ordered inputs).
    durable: Option<Durable>,
    /// What this task's work is measured by.
    metrics: TaskMetrics,
    /// When the commit under way began, and its span.
    commit_started: Option<(Instant, tracing::Span)>,
}

/// The time, for the partition machine (which keeps `std` instants; under a paused
/// test clock this is the paused time).
fn now() -> std::time::Instant {
    Instant::now().into_std()
}

/// The kind an acknowledgement counts as in [`crate::metrics::names::ACKS`].
fn ack_count(kind: AckKind) -> AckCount {
    match kind {
        AckKind::Ack => AckCount::Ack,
        AckKind::Nak(_) => AckCount::Nak,
        AckKind::Term => AckCount::Term,
        AckKind::InProgress => AckCount::InProgress,
    }
}

impl<T: Task> std::fmt::Debug for TaskWorker<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskWorker").field("binding", &self.binding).finish_non_exhaustive()
    }
}

impl<T: Task> TaskWorker<T> {
    /// A worker for `task`.
    pub fn new(
        task: T,
        env: Rc<TaskEnv>,
        binding: Binding,
        settings: Settings,
        slot: crate::container::SlotContext,
    ) -> Self {
        let config = settings.config;
        let state = TaskState::new([0], config.max_concurrency, config.async_commit, env.run_id.clone());
        let intake = Intake::after(binding.start.as_ref().map(|s| s.delivered_consumer_seq));
        let suspects =
            binding.start.as_ref().and_then(|s| s.suspects_up_to).map(|up_to| Suspects::new(up_to, config.crash_limit));
        let metrics = TaskMetrics::new(binding.stream, binding.partition);
        let mut part = Partition::new(settings.rules, state, intake);
        if let Some(start) = binding.start.as_ref().filter(|s| !s.blamed.is_empty()) {
            part.set_blamed(start.blamed.clone());
        }
        part.set_suspects(suspects);
        part.set_claims(slot.claims);
        if slot.paused {
            part.handle(ev::Paused, now());
        }
        Self {
            metrics,
            commit_started: None,
            task: Some(Box::new(task)),
            part,
            env,
            binding,
            source: slot.source,
            counts: slot.counts,
            claim_task: None,
            end: pull::EndReport::Finishing,
            config,
            container: slot.container,
            timers: slot.timers,
            reaper: slot.reaper,
            lane: None,
            releases: Vec::new(),
            due_timers: Vec::new(),
            self_recipient: None,
            publish_queue: VecDeque::new(),
            publishing: false,
            acks: Vec::new(),
            progressed: false,
            tick_at: None,
            flushes_in_flight: 0,
            durable: None,
        }
    }

    /// The same worker keeping `stores` durable (ordered inputs; ignored when empty).
    #[must_use]
    pub fn with_stores(mut self, stores: crate::store::StoreSet) -> Self {
        if !stores.is_empty() && self.binding.ordered() {
            self.part.set_durable(true);
            self.durable =
                Some(Durable { stores: Rc::new(RefCell::new(stores)), changelog: None, restore_failures: 0 });
        }
        self
    }

    fn stores(&self) -> Option<Rc<RefCell<crate::store::StoreSet>>> {
        self.durable.as_ref().map(|d| d.stores.clone())
    }

    /// Ends a callback in the stores: keeps or undoes its changes.
    fn end_callback(&self, keep: bool) {
        if let Some(d) = &self.durable {
            d.stores.borrow_mut().end_callback(keep);
        }
    }

    fn report(&self, report: WorkerReport) {
        self.container.do_send(report);
    }

    /// Performs what the partition's rules decided: acknowledgements and credit are
    /// queued for the end of the turn, dead letters sent, hand-backs given. (Retries are
    /// the machine's deadlines: `arm_ticks` serves them.)
    fn perform(&mut self, ctx: &mut Context<Self>) {
        while let Some(effect) = self.part.poll_effect() {
            match effect {
                Effect::Acks(batch) if self.acks.is_empty() => self.acks = batch,
                Effect::Acks(batch) => self.acks.extend(batch),
                Effect::Credit(_) if self.progressed => {}
                Effect::Credit(_) => {
                    self.progressed = true;
                    self.report(WorkerReport::Progressed { slot: self.binding.slot });
                }
                Effect::DeadLetter { order, reason, detail, attempts } => {
                    self.send_dead_letter(order, reason, detail, attempts, ctx);
                }
                Effect::HandBack { msg, interrupted } => self.hand_back(&msg.delivery, interrupted),
            }
        }
    }

    /// Sends the acknowledgements queued during this turn (one broker operation however
    /// many messages finished) and claims what there is room for now.
    fn send_batched(&mut self, ctx: &mut Context<Self>) {
        self.perform(ctx);
        if !self.acks.is_empty() {
            let mut counts = [0u64; 4];
            for (_, kind) in &self.acks {
                counts[ack_count(*kind) as usize] += 1;
            }
            for (kind, n) in
                [AckCount::Ack, AckCount::Nak, AckCount::Term, AckCount::InProgress].into_iter().zip(counts)
            {
                if n > 0 {
                    self.metrics.acked(kind, n);
                }
            }
            let fut = self.env.broker.ack_many(std::mem::take(&mut self.acks));
            let stream = self.binding.stream;
            actix::spawn(async move {
                if let Err(e) = fut.await {
                    warn!(error = %e, stream, "acknowledgement not sent; the broker redelivers after ack-wait");
                }
            });
        }
        self.metrics.in_flight.set(self.part.readiness().in_flight() as f64);
        self.count_claims();
        self.pump(ctx);
    }

    fn context(&self, meta: Option<MessageMeta>) -> TaskContext {
        TaskContext::new(self.env.clone(), self.binding.partition, self.binding.epoch, meta)
            .with_stores(self.stores())
            .with_input(self.binding.stream)
    }
}

impl<T: Task> Actor for TaskWorker<T> {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let me = ctx.address().recipient::<Tick>();
        self.self_recipient = Some(me.clone());
        if let Some(every) = self.config.window_interval {
            self.timers.do_send(Every { period: every, target: me.clone(), tick: Tick::Window });
        }
        // Claimed messages wait in the machine while the state is restored.
        self.pump(ctx);
        if self.durable.is_some() {
            self.restore(ctx);
            return;
        }
        self.run_hook(Hook::Init, ctx);
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        // A claim that outlived the worker would take messages nobody handles (they
        // would wait for ack-wait).
        if let Some(task) = self.claim_task.take() {
            task.abort();
        }
    }
}

impl<T: Task> TaskWorker<T> {
    /// Takes what a claim brought into the machine (an ordered partition's deliveries
    /// checked against its consumer's sequence first).
    fn take(&mut self, batch: Vec<Delivery>, ctx: &mut Context<Self>) {
        let now = now();
        let mut dropped = 0;
        for d in batch {
            if self.part.stopping() || self.part.ended() {
                self.hand_back(&d, true);
                dropped += 1;
                continue;
            }
            if self.binding.ordered() {
                match self
                    .part
                    .handle(ev::Offered { stream_seq: d.info.stream_seq, consumer_seq: d.info.consumer_seq }, now)
                {
                    Admission::Take => {}
                    Admission::Redelivered => {
                        dropped += 1;
                        continue;
                    }
                    Admission::Lost { expected, got } => {
                        // Nothing from here on is taken: an ack-all over it could cover
                        // the lost delivery. What came before is complete and is committed.
                        self.resync(
                            format!(
                                "delivery {got} of the partition's consumer arrived where {expected} was due (stream sequence {}): a delivery was lost in transit",
                                d.info.stream_seq
                            ),
                            ctx,
                        );
                        dropped += 1;
                        continue;
                    }
                }
            }
            // Markers are for ordered partitions; on a queue input anyone could end
            // the job with one, so there they are data (and fail to decode as such).
            let kind = match d.headers.kind() {
                Some(MessageKind::Drain) if self.binding.ordered() => {
                    EnvelopeKind::Drain { run_id: d.headers.get(headers::RUN).unwrap_or_default().to_owned() }
                }
                Some(MessageKind::EndOfStream) if self.binding.ordered() => EnvelopeKind::EndOfStream,
                _ => EnvelopeKind::Data,
            };
            self.part.handle(ev::Arrived { kind, msg: Msg { delivery: d, trace: None } }, now);
        }
        self.part.handle(ev::Dropped(dropped), now);
    }
}

impl<T: Task> Handler<StopWorker> for TaskWorker<T> {
    type Result = ();

    fn handle(&mut self, _: StopWorker, ctx: &mut Context<Self>) {
        self.stop(ctx);
        self.drive(ctx);
    }
}

impl<T: Task> Handler<WorkerControl> for TaskWorker<T> {
    type Result = ();

    fn handle(&mut self, control: WorkerControl, ctx: &mut Context<Self>) {
        match control {
            WorkerControl::Pause => self.part.handle(ev::Paused, now()),
            WorkerControl::Resume => self.part.handle(ev::Resumed, now()),
            WorkerControl::Step => {
                if !self.part.handle(ev::Stepped, now()) {
                    debug!(
                        stream = self.binding.stream,
                        partition = self.binding.partition,
                        "step ignored: not paused"
                    );
                }
            }
        }
        self.drive(ctx);
    }
}

impl<T: Task> Handler<Tick> for TaskWorker<T> {
    type Result = ();

    fn handle(&mut self, tick: Tick, ctx: &mut Context<Self>) {
        match tick {
            Tick::Deadline => {
                let now = Instant::now().into_std();
                // The tick armed for `tick_at` came: the turn arms the next. An earlier
                // tick armed for a later deadline (one came due sooner since) leaves
                // `tick_at` alone, so it never arms a second tick for the same deadline.
                if self.tick_at.is_some_and(|at| at <= now) {
                    self.tick_at = None;
                }
                // A fenced worker keeps nothing alive: the turn below stops it.
                if !self.binding.fenced()
                    && let Some(order) = self.part.handle_timeout(now)
                {
                    self.suspect_ended_owner(order);
                    let seq = self.part.held(order).map(|h| h.msg.delivery.info.stream_seq);
                    let timeout = self.config.callback_timeout.unwrap_or_default();
                    self.fail(format!("callback for message {seq:?} did not complete within {timeout:?}"), ctx);
                    return;
                }
            }
            Tick::Window => self.part.handle(ev::WindowDue, now()),
            Tick::UserTimer(name) => {
                self.due_timers.push(name);
                self.part.handle(ev::TimersDue, now());
            }
            Tick::Backlog | Tick::Sweep | Tick::Resume | Tick::Restart(_) | Tick::Scan | Tick::Renew => {}
        }
        self.drive(ctx);
    }
}
