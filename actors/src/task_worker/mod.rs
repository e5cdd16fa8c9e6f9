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
//! The rules (which delivery to take, when to commit, what a failure, a hand-back or a
//! dead letter does to the message, which suspect to quarantine) are plain data in
//! `core.rs`, tested on their own; this actor performs what they decide.
//!
//! Supervision: the [`Container`](crate::container::Container) starts workers and decides,
//! by the task's [`FailurePolicy`](crate::config::FailurePolicy), what a failed worker
//! means: the worker itself hands back everything it holds (nak without delay) and stops.

mod changelog;
mod messages;
mod released;
mod suspects;
pub(crate) mod timers;
pub use released::{RELEASE_ALLOWANCE, RELEASED, RELEASED_TTL};
pub use timers::{ARMINGS, ARMINGS_TTL};

pub use messages::{Deliver, Outcome, StopWorker, WorkerControl, WorkerReport};

use crate::config::TaskConfig;
use crate::events::{Event, emit};
use crate::metrics::{AckCount, TaskMetrics};
use crate::reaper::{DeadLetter, Reaper};
use crate::state::{EnvelopeKind, Op, TaskState};
use crate::stream::StreamKind;
use crate::supervise::{Panic, Supervised, panic_text, supervised};
use crate::task::{MessageMeta, Outputs, Task, TaskContext, TaskEnv, TaskError};
use crate::timer_service::{After, Every, Tick, TimerService};
use crate::trace::TraceContext;
use actix::prelude::*;
use flotilla_proto::partition::intake as core;
pub use flotilla_proto::partition::intake::SuspectRecord;
use flotilla_proto::partition::intake::{Admission, AfterFailure, Discipline, Intake, Suspects, park_retry_delay};
use flotilla_transport::broker::{AckKind, AckToken, BrokerError, Delivery, ErrorClass, OutboundMessage};
use flotilla_transport::wire::{MessageId, MessageKind, headers};
use futures::future::LocalBoxFuture;
use rustc_hash::FxHashMap;
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

    fn discipline(&self) -> Discipline {
        if self.ordered() { Discipline::Ordered } else { Discipline::Queue }
    }

    /// The partition's lease is gone (or could not be renewed in time).
    fn fenced(&self) -> bool {
        self.fence.as_ref().is_some_and(|f| !f.valid())
    }
}

/// A message the worker holds from claim to acknowledgement.
struct Envelope {
    delivery: Delivery,
    /// This attempt's number.
    attempt: u32,
    /// Whether it counts as in flight in the state machine now.
    counted: bool,
    started: Option<Instant>,
    /// A dead letter that could not be published yet: (reason, detail).
    dead_letter: Option<(&'static str, String)>,
    /// Retries because something was unavailable (not counted as attempts).
    unavailable: u32,
    /// Its `process` returned and its store changes are applied (tasks with stores):
    /// from here on it cannot be retried, only finished or restored from the changelog.
    applied: bool,
    /// It waits for its next attempt (a retry back-off): no callback runs for it, so a
    /// stop hands it back at once instead of waiting out the back-off.
    backing_off: bool,
    /// The task's `process` ran for its current attempt (it decoded).
    ran: bool,
    /// The trace context of its current attempt (see [`crate::trace`]).
    trace: Option<TraceContext>,
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

/// Back-off while something is unreachable: 200 ms doubling to 30 s, then ±50 %
/// jitter, so that many workers retrying after one outage do not come back at once.
fn unavailable_backoff(n: u32) -> Duration {
    use rand::Rng;
    let base = Duration::from_millis(200).saturating_mul(1 << n.saturating_sub(1).min(8)).min(Duration::from_secs(30));
    base.mul_f64(rand::rng().random_range(0.5..1.5))
}

/// A claimed message's acknowledgement handle, kept until it is committed.
struct Claimed {
    token: AckToken,
    seq: u64,
    at: Instant,
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

/// What follows a commit whose state flush is on its way.
enum AfterCommit {
    /// Go on processing.
    Drive,
    /// Hand back what has not started and end with this outcome (drain, end of stream).
    Finish(Outcome),
    /// Run the `shutdown` hook (a graceful stop).
    Shutdown,
}

/// A partition's durable state: its stores, and their changelog once restored.
struct Durable {
    stores: Rc<RefCell<crate::store::StoreSet>>,
    changelog: Option<changelog::Changelog>,
    /// Restore failures in a row.
    restore_failures: u32,
    /// A flush is being written.
    persisting: bool,
    /// A commit waits for messages whose changes are applied to finish.
    waiting: Option<AfterCommit>,
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
    state: TaskState<Delivery>,
    env: Rc<TaskEnv>,
    binding: Binding,
    config: TaskConfig,
    container: Recipient<WorkerReport>,
    timers: Addr<TimerService>,
    reaper: Addr<Reaper>,
    /// Started messages until acknowledged (queue) or effects stored (ordered).
    inflight: FxHashMap<u64, Envelope>,
    /// Claimed messages by order, until committed: every message of an ordered input,
    /// only the markers of a queue input (its data messages are acked one by one).
    claimed: BTreeMap<u64, Claimed>,
    /// Ordered inputs: which deliveries are taken, and the committed position.
    intake: Intake,
    /// Ordered inputs: the delivery whose ack-all made the last commit.
    last_commit: Option<AckToken>,
    /// Ordered inputs: a delivery was lost; the worker stops and the partition is reset.
    resync: Option<String>,
    /// Ordered inputs after a take-over that found unfinished work: the suspects.
    suspects: Option<Suspects>,
    /// The suspect this worker runs, with the node's suspect lane until its finish is
    /// stored or it outlived [`SUSPECT_WINDOW`](core::SUSPECT_WINDOW) (the permit then
    /// `None`: it runs on, no longer counted).
    lane: Option<(u64, Option<tokio::sync::OwnedSemaphorePermit>)>,
    retries: VecDeque<u64>,
    /// Queue hand-backs on their way (release count, then nak).
    releases: Vec<tokio::task::JoinHandle<()>>,
    due_timers: Vec<String>,
    stopping: bool,
    finished: bool,
    self_recipient: Option<Recipient<Tick>>,
    publish_queue: VecDeque<Flush>,
    publishing: bool,
    /// Acknowledgements queued during this turn.
    acks: Vec<(AckToken, AckKind)>,
    /// Messages finished during this turn, not yet reported to the container.
    completed: usize,
    /// A commit tick is on its way (armed when completions wait for a commit, so an
    /// idle partition gets no ticks).
    commit_tick_armed: bool,
    /// A heartbeat tick is on its way (armed while messages are held).
    heartbeat_armed: bool,
    /// A callback-timeout check is on its way (armed while messages are in flight).
    timeout_check_armed: bool,
    /// Output batches published and not yet stored (or given up).
    flushes_in_flight: usize,
    /// Tasks with stores (ordered inputs).
    durable: Option<Durable>,
    /// Inputs up to this stream sequence are applied (with stores: to the restored
    /// state already, so they are skipped when they come again).
    applied_through: u64,
    /// Ordered hooks derive their outputs' ids from the input position they ran at
    /// and how many hooks ran there before.
    hook_at: (u64, u32),
    /// What this task's work is measured by.
    metrics: TaskMetrics,
    /// When the commit under way began, and its span.
    commit_started: Option<(Instant, tracing::Span)>,
    /// A stop handed back a message waiting out a retry back-off: the first such order.
    handed_back_mid_retry: Option<u64>,
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
        config: TaskConfig,
        container: Recipient<WorkerReport>,
        timers: Addr<TimerService>,
        reaper: Addr<Reaper>,
    ) -> Self {
        let state = TaskState::new([0], config.max_concurrency, config.async_commit, env.run_id.clone());
        let intake = Intake::after(binding.start.as_ref().map(|s| s.delivered_consumer_seq));
        let suspects =
            binding.start.as_ref().and_then(|s| s.suspects_up_to).map(|up_to| Suspects::new(up_to, config.crash_limit));
        let metrics = TaskMetrics::new(binding.stream, binding.partition);
        Self {
            metrics,
            commit_started: None,
            task: Some(Box::new(task)),
            state,
            env,
            binding,
            config,
            container,
            timers,
            reaper,
            inflight: FxHashMap::default(),
            claimed: BTreeMap::new(),
            intake,
            last_commit: None,
            resync: None,
            suspects,
            lane: None,
            retries: VecDeque::new(),
            releases: Vec::new(),
            due_timers: Vec::new(),
            stopping: false,
            finished: false,
            self_recipient: None,
            publish_queue: VecDeque::new(),
            publishing: false,
            acks: Vec::new(),
            completed: 0,
            commit_tick_armed: false,
            heartbeat_armed: false,
            timeout_check_armed: false,
            flushes_in_flight: 0,
            durable: None,
            applied_through: 0,
            hook_at: (0, 0),
            handed_back_mid_retry: None,
        }
    }

    /// The same worker keeping `stores` durable (ordered inputs; ignored when empty).
    #[must_use]
    pub fn with_stores(mut self, stores: crate::store::StoreSet) -> Self {
        if !stores.is_empty() && self.binding.ordered() {
            self.durable = Some(Durable {
                stores: Rc::new(RefCell::new(stores)),
                changelog: None,
                restore_failures: 0,
                persisting: false,
                waiting: None,
            });
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

    /// Queues an acknowledgement; what one turn of the worker queues is sent together
    /// when the turn ends ([`send_batched`](Self::send_batched)).
    fn ack(&mut self, token: &AckToken, kind: AckKind) {
        self.acks.push((token.clone(), kind));
    }

    /// Counts messages this worker is done with, for the container's claim credit.
    fn completed(&mut self, count: usize) {
        self.completed += count;
    }

    /// Sends the acknowledgements and the completion count queued during this turn:
    /// one broker operation and one container message, however many messages finished.
    fn send_batched(&mut self) {
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
        self.metrics.in_flight.set(self.state.in_flight() as f64);
        if self.completed > 0 {
            let count = std::mem::take(&mut self.completed);
            self.report(WorkerReport::Completed { slot: self.binding.slot, count });
        }
    }

    fn context(&self, meta: Option<MessageMeta>) -> TaskContext {
        TaskContext::new(self.env.clone(), self.binding.partition, self.binding.epoch, meta)
            .with_stores(self.stores())
            .with_input(self.binding.stream)
    }

    /// The id a hook's outputs derive theirs from, on an ordered partition: from the
    /// partition, the hook, the input position it ran at and how many hooks ran there
    /// before, so that a hook run again at the same position after a crash (on the
    /// same state, restored) sends outputs with the same ids, which the broker drops.
    fn hook_cause(&mut self, kind: HookKind) -> Option<MessageId> {
        // Only with stores: the restored state makes a hook at the same position the
        // same hook. Without, a restarted worker's hooks would reuse ids of outputs
        // that said something else, and the broker would drop them.
        self.durable.as_ref()?;
        let partition = self.binding.partition?;
        let position = self.applied_through;
        let n = if self.hook_at.0 == position { self.hook_at.1 } else { 0 };
        // `init` runs after every restore, where the run before the restore ran none:
        // numbered like the others, it would shift every later hook at this position
        // by one, and a window run again on the same state would store its outputs
        // again under new ids. It takes a number only once it changed state (hook_done).
        if kind != HookKind::Init {
            self.hook_at = (position, n + 1);
        }
        let base =
            MessageId::from_wire(format!("hook/{}/{partition}/{}/{position}", self.binding.stream, kind.label()));
        Some(base.derive_output(n))
    }

    /// Reads the partition's stores back from the changelog and claims it, then runs
    /// `init`. Until then nothing is processed. A failure holds the partition (retried
    /// with backoff, an event each time) and never starts it empty; a changelog that
    /// does not decode (a type changed) fails the task, naming the store and key.
    fn restore(&mut self, ctx: &mut Context<Self>) {
        if self.finished {
            return;
        }
        let Some(partition) = self.binding.partition else { return };
        let bucket = self.env.subjects.bucket_name(crate::store::STATE);
        let prefix = format!("{}.{partition}", self.binding.stream);
        let started = Instant::now();
        let fut = changelog::restore(self.env.broker.clone(), bucket, prefix, self.binding.epoch);
        ctx.spawn(fut.into_actor(self).map(move |result, act, ctx| {
            if act.finished {
                return;
            }
            match result {
                Ok(restored) => act.restored(partition, restored, started, ctx),
                Err(changelog::StateError::Corrupt(e)) => act.restore_failed(partition, e, ctx),
                Err(e) => {
                    let Some(d) = &mut act.durable else { return };
                    d.restore_failures += 1;
                    let delay = unavailable_backoff(d.restore_failures);
                    warn!(stream = act.binding.stream, partition, error = %e, ?delay, "state not restored: holding the partition and trying again");
                    emit(
                        &act.env.broker,
                        &act.env.subjects,
                        Event::StateRestoreFailed {
                            stream: act.binding.stream.to_owned(),
                            partition,
                            error: e.to_string(),
                            retry_in_ms: delay.as_millis() as u64,
                        },
                    );
                    ctx.run_later(delay, |act, ctx| act.restore(ctx));
                }
            }
        }));
    }

    /// The changelog cannot be read into the stores: the task fails (never starts empty).
    fn restore_failed(&mut self, partition: u32, error: String, ctx: &mut Context<Self>) {
        emit(
            &self.env.broker,
            &self.env.subjects,
            Event::StateRestoreFailed {
                stream: self.binding.stream.to_owned(),
                partition,
                error: error.clone(),
                retry_in_ms: 0,
            },
        );
        self.fail(format!("state restore: {error}"), ctx);
    }

    fn restored(&mut self, partition: u32, restored: changelog::Restored, started: Instant, ctx: &mut Context<Self>) {
        let Some(d) = &mut self.durable else { return };
        let stream = self.binding.stream;
        let mut unknown = std::collections::BTreeSet::new();
        let mut failed = None;
        let keys = {
            let mut stores = d.stores.borrow_mut();
            let codec = *stores.codec();
            for key in &restored.keys {
                match stores.get_mut(&key.store) {
                    Some(store) => {
                        if let Err(e) = store.restore(&codec, &key.key_hex, key.value.as_ref(), key.revision) {
                            failed = Some(e);
                            break;
                        }
                    }
                    None => {
                        unknown.insert(key.store.clone());
                    }
                }
            }
            stores.len() as u64
        };
        if let Some(e) = failed {
            self.restore_failed(partition, e, ctx);
            return;
        }
        if !unknown.is_empty() {
            warn!(stream, partition, stores = ?unknown, "the changelog holds stores this task does not declare: left as they are");
        }
        let (position, hooks) = (restored.changelog.commit.position, restored.changelog.commit.hooks);
        d.changelog = Some(restored.changelog);
        d.restore_failures = 0;
        self.applied_through = position;
        self.hook_at = (position, hooks);
        self.metrics.restored(restored.keys.len() as u64, started.elapsed());
        emit(
            &self.env.broker,
            &self.env.subjects,
            Event::StateRestored {
                stream: stream.to_owned(),
                partition,
                keys,
                position,
                incomplete: restored.incomplete,
                millis: started.elapsed().as_millis() as u64,
            },
        );
        self.run_hook(Hook::Init, ctx);
        self.drive(ctx);
    }

    /// Commits, then does `then`. With stores, the commit first writes what changed to
    /// the changelog (records, then the commit record) and acknowledges the inputs only
    /// once that is stored; it first waits for messages whose changes are applied but
    /// whose outputs are not stored yet, so the state it writes is that of exactly the
    /// inputs it acknowledges.
    fn commit_then(&mut self, then: AfterCommit, ctx: &mut Context<Self>) {
        if self.commit_started.is_none() {
            let span = tracing::debug_span!(
                "commit",
                stream = self.binding.stream,
                partition = self.binding.partition,
                uncommitted = self.state.uncommitted_count(0),
            );
            self.commit_started = Some((Instant::now(), span));
        }
        let Some(d) = &mut self.durable else {
            let positions = self.state.committable().clone();
            self.commit_positions(positions);
            self.after_commit(then, ctx);
            return;
        };
        if self.inflight.values().any(|e| e.applied) {
            d.waiting = Some(then);
            return;
        }
        let Some(log) = &d.changelog else {
            // Not restored: nothing was processed, nothing to commit.
            self.after_commit(then, ctx);
            return;
        };
        let positions = self.state.committable().clone();
        let position = positions
            .get(&0)
            .and_then(|&pos| self.claimed.range(..=pos).next_back())
            .map_or(0, |(_, c)| c.seq)
            .max(log.commit.position);
        let codec = *d.stores.borrow().codec();
        let mut changes = Vec::new();
        let mut failed = None;
        for store in d.stores.borrow_mut().iter_mut() {
            match store.take_changes(&codec) {
                Ok(c) => changes.extend(c),
                Err(e) => failed = Some(e),
            }
        }
        let flush = match failed {
            Some(e) => Err(e),
            None if changes.is_empty() && position == log.commit.position => {
                self.commit_positions(positions);
                self.after_commit(then, ctx);
                return;
            }
            None => {
                // Hooks that ran at this position are in the state written.
                let hooks = if self.hook_at.0 == position { self.hook_at.1 } else { 0 };
                changelog::build_flush(log, changes, position, hooks, self.binding.epoch)
            }
        };
        match flush {
            Ok(flush) => {
                d.persisting = true;
                self.persist(Arc::new(flush), positions, then, 0, ctx);
            }
            Err(e) => self.fail(format!("state not stored: {e}"), ctx),
        }
    }

    fn persist(
        &mut self,
        flush: Arc<changelog::Flush>,
        positions: BTreeMap<u32, u64>,
        then: AfterCommit,
        attempt: u32,
        ctx: &mut Context<Self>,
    ) {
        if self.finished {
            return;
        }
        if self.binding.fenced() {
            self.abort_fenced(ctx);
            return;
        }
        let bucket = self.env.subjects.bucket_name(crate::store::STATE);
        let span = self.commit_started.as_ref().map_or_else(tracing::Span::none, |(_, s)| s.clone());
        let fut = changelog::persist(self.env.broker.clone(), bucket, flush.clone()).instrument(span);
        let sent = Instant::now();
        ctx.spawn(fut.into_actor(self).map(move |result, act, ctx| {
            if act.finished {
                return;
            }
            match result {
                Ok(persisted) => {
                    act.metrics.store_flush.record(sent.elapsed().as_secs_f64());
                    act.metrics.store_flushed.increment(persisted.revisions.len() as u64 + 1);
                    let Some(d) = &mut act.durable else { return };
                    {
                        let mut stores = d.stores.borrow_mut();
                        for (store, key_hex, revision) in &persisted.revisions {
                            if let Some(s) = stores.get_mut(store) {
                                s.stored(key_hex, *revision);
                            }
                        }
                    }
                    if let Some(log) = &mut d.changelog {
                        log.commit = flush.commit.clone();
                        log.commit_revision = persisted.commit_revision;
                    }
                    d.persisting = false;
                    crate::failpoint::hit(crate::failpoint::Point::StateCommittedBeforeAck);
                    act.commit_positions(positions);
                    act.after_commit(then, ctx);
                }
                Err(changelog::StateError::Broker(e))
                    if e.class() == ErrorClass::Transient && attempt < act.config.unavailable_retries =>
                {
                    let delay = unavailable_backoff(attempt + 1);
                    warn!(stream = act.binding.stream, partition = act.binding.partition, error = %e, ?delay, "state not stored; writing it again");
                    ctx.run_later(delay, move |act, ctx| act.persist(flush, positions, then, attempt + 1, ctx));
                }
                Err(changelog::StateError::Conflict(e)) => {
                    if let Some(d) = &mut act.durable {
                        d.persisting = false;
                    }
                    if act.binding.fenced() {
                        act.abort_fenced(ctx);
                    } else {
                        act.restart_from_changelog(format!("state not stored: {e}"), ctx);
                    }
                }
                Err(e) => {
                    if let Some(d) = &mut act.durable {
                        d.persisting = false;
                    }
                    act.fail(format!("state not stored: {e}; the partition restarts from its last commit"), ctx);
                }
            }
        }));
    }

    /// The state in memory cannot be committed as it is (a message whose changes are
    /// applied cannot finish, or someone else wrote the partition's changelog): hand
    /// everything back without committing and end asking for a reset, whatever the
    /// failure policy. The next worker restores the last commit and goes on from there.
    fn restart_from_changelog(&mut self, reason: String, ctx: &mut Context<Self>) {
        self.end_for_restore(reason, None, ctx);
    }

    /// [`restart_from_changelog`](Self::restart_from_changelog) because of the message
    /// at `order`: the restore counts as one of its attempts, so one that keeps forcing
    /// restores is dead-lettered like one that keeps failing.
    fn restore_blaming(&mut self, order: u64, reason: String, ctx: &mut Context<Self>) {
        let blame = self.inflight.get(&order).map(|e| e.delivery.info.stream_seq);
        self.end_for_restore(reason, blame, ctx);
    }

    fn end_for_restore(&mut self, reason: String, blame: Option<u64>, ctx: &mut Context<Self>) {
        if self.finished {
            return;
        }
        warn!(stream = self.binding.stream, partition = self.binding.partition, %reason, ?blame, "restarting the partition from its last commit");
        self.release_all(true);
        self.finish(Outcome::Restore { reason, blame }, ctx);
    }

    /// The message at `order` failed after its `process` returned: undoes its store
    /// changes, if it had any kept. `false` when they cannot be undone alone (a later
    /// callback changed one of its keys): then only a restore takes them back.
    fn undo_applied(&mut self, order: u64) -> bool {
        let Some(e) = self.inflight.get_mut(&order) else { return true };
        if !e.applied {
            return true;
        }
        let Some(d) = &self.durable else { return true };
        if !d.stores.borrow_mut().undo(order) {
            return false;
        }
        e.applied = false;
        true
    }

    fn after_commit(&mut self, then: AfterCommit, ctx: &mut Context<Self>) {
        if let Some((started, span)) = self.commit_started.take() {
            self.metrics.commit.record(started.elapsed().as_secs_f64());
            // The span closes here: its duration is the commit's.
            drop(span);
        }
        match then {
            AfterCommit::Drive => self.drive(ctx),
            AfterCommit::Finish(outcome) => {
                self.hand_back_unstarted();
                self.finish(outcome, ctx);
            }
            AfterCommit::Shutdown => self.run_hook(Hook::Shutdown, ctx),
        }
    }

    /// A hook changed the stores: commit soon, also on a partition with no new input
    /// (its outputs are out; what they report must not be reported again).
    fn commit_hook_changes(&mut self) {
        if self.durable.as_ref().is_some_and(|d| d.stores.borrow().has_changes()) {
            self.state.request_commit();
        }
    }

    /// Whether a commit of a task with stores is on its way.
    fn state_busy(&self) -> bool {
        self.durable.as_ref().is_some_and(|d| d.persisting || d.waiting.is_some())
    }

    /// A commit that waited for applied messages goes on once none is left.
    fn resume_waiting_commit(&mut self, ctx: &mut Context<Self>) {
        if self.inflight.values().any(|e| e.applied) {
            return;
        }
        if let Some(then) = self.durable.as_mut().and_then(|d| d.waiting.take()) {
            self.commit_then(then, ctx);
        }
    }

    /// Runs the next operations the state machine allows while the task is home, then
    /// sends what the turn queued.
    fn drive(&mut self, ctx: &mut Context<Self>) {
        self.resume_waiting_commit(ctx);
        self.drive_ops(ctx);
        self.send_batched();
        self.arm_ticks();
    }

    /// Arms the ticks this worker needs now, and only those: completions wait for a
    /// commit at most a commit interval (armed when the first is done), and held
    /// messages get in-progress acks every third of ack-wait (armed while any is held).
    /// Ticks every interval for every partition would cost an idle node with thousands
    /// of them more than their claims.
    fn arm_ticks(&mut self) {
        if self.finished {
            return;
        }
        let Some(me) = &self.self_recipient else { return };
        if !self.commit_tick_armed && self.state.uncommitted() {
            self.commit_tick_armed = true;
            self.timers.do_send(After { delay: self.config.commit_interval, target: me.clone(), tick: Tick::Commit });
        }
        if let Some(timeout) = self.config.callback_timeout
            && !self.timeout_check_armed
            && self.state.in_flight() > 0
        {
            // Checked every quarter of the timeout while something runs: an idle
            // partition gets no ticks.
            self.timeout_check_armed = true;
            let delay = (timeout / 4).max(Duration::from_millis(10));
            self.timers.do_send(After { delay, target: me.clone(), tick: Tick::CheckTimeouts });
        }
        let held = if self.binding.ordered() { !self.claimed.is_empty() } else { !self.inflight.is_empty() };
        if !self.heartbeat_armed && held {
            self.heartbeat_armed = true;
            let beat = (self.config.ack_wait / 3).max(Duration::from_millis(50));
            self.timers.do_send(After { delay: beat, target: me.clone(), tick: Tick::Heartbeat });
        }
    }

    fn drive_ops(&mut self, ctx: &mut Context<Self>) {
        if self.binding.fenced() {
            self.abort_fenced(ctx);
            return;
        }
        while !self.finished && self.task.is_some() && self.state.failure().is_none() {
            // Per message, not once per turn: a turn can start many, and the lease's
            // validity is a deadline.
            if self.binding.fenced() {
                self.abort_fenced(ctx);
                return;
            }
            if self.durable.as_ref().is_some_and(|d| d.changelog.is_none()) {
                // Restoring: nothing runs before the state is back.
                if self.stopping {
                    self.release_all(true);
                    self.finish(self.stopped_outcome(), ctx);
                }
                return;
            }
            if self.state_busy() {
                // A commit's flush is on its way: what it acknowledges is fixed, and a
                // retry would change the state it writes.
                return;
            }
            if let Some(order) = self.retries.pop_front() {
                self.start_attempt(order, ctx);
                continue;
            }
            if self.stopping {
                self.try_finish_stop(ctx);
                return;
            }
            match self.state.next_op(Instant::now().into_std()) {
                Op::Process(p) => {
                    let envelope = Envelope {
                        delivery: p.msg,
                        attempt: 0,
                        counted: true,
                        started: None,
                        dead_letter: None,
                        unavailable: 0,
                        applied: false,
                        backing_off: false,
                        ran: false,
                        trace: None,
                    };
                    let mut attempt = (envelope.delivery.info.delivered.max(1)).min(u64::from(u32::MAX)) as u32;
                    let seq = envelope.delivery.info.stream_seq;
                    let restores = self.restores_forced_by(seq);
                    attempt = attempt.max(restores.saturating_add(1));
                    self.inflight.insert(p.order, Envelope { attempt, ..envelope });
                    if restores > 0 && attempt > self.config.retry.max_attempts {
                        let max = self.config.retry.max_attempts;
                        self.dead_letter(
                            p.order,
                            "max-attempts",
                            format!(
                                "its {restores} attempts of {max} failed after changing the task's stores together with other messages, each forcing a restore of the partition"
                            ),
                            ctx,
                        );
                        continue;
                    }
                    if self.durable.is_some() && seq <= self.applied_through {
                        // The restored state reflects it already: it was processed,
                        // its outputs stored and its changes committed; only its
                        // acknowledgement was lost.
                        debug!(
                            stream = self.binding.stream,
                            partition = self.binding.partition,
                            seq,
                            "skipping an input the restored state reflects"
                        );
                        self.process_done(p.order);
                        self.flushed(FlushTarget::Message(p.order), ctx);
                        continue;
                    }
                    let delivered = self.inflight.get(&p.order).map_or(1, |e| e.delivery.info.delivered);
                    if !self.binding.ordered() && self.key_parked(p.order) {
                        self.park(p.order, ctx);
                    } else if !self.binding.ordered() && delivered > 1 {
                        self.count_releases(p.order, seq, delivered, ctx);
                    } else if self.suspects.as_ref().is_some_and(|s| s.covers(seq)) {
                        self.count_suspect(p.order, seq, ctx);
                    } else {
                        self.start_attempt(p.order, ctx);
                    }
                }
                Op::Commit => self.run_hook(Hook::Commit, ctx),
                Op::Window => self.run_hook(Hook::Window, ctx),
                Op::Timer => {
                    let due = std::mem::take(&mut self.due_timers);
                    self.run_hook(Hook::Timers(due), ctx);
                }
                Op::Drain => self.run_hook(Hook::Drain, ctx),
                Op::EndOfStream => self.run_hook(Hook::EndOfStream, ctx),
                Op::NoOp => return,
            }
        }
    }

    /// How many restores of the partition the message at stream sequence `seq` forced
    /// before this worker (see [`PartitionStart::blamed`]).
    fn restores_forced_by(&self, seq: u64) -> u32 {
        let blamed = self.binding.start.as_ref().map_or(&[][..], |s| &s.blamed);
        blamed.iter().find(|(at, _)| *at == seq).map_or(0, |(_, n)| *n)
    }

    /// Whether the queue message at `order` has a parked key (and was not let through
    /// by `step --key`).
    fn key_parked(&self, order: u64) -> bool {
        if !self.env.parked.any() {
            return false;
        }
        let Some(e) = self.inflight.get(&order) else { return false };
        let h = &e.delivery.headers;
        h.get(headers::STEP).is_none()
            && h.get(headers::KEY).is_some_and(|key| self.env.parked.is_parked(self.binding.stream, key))
    }

    /// Sets a message of a parked key aside in the job's PARKED stream, with its
    /// sequence (so it goes back in order), and takes it off the queue: others keep
    /// flowing. It costs no attempt. If it cannot be stored it is handed back.
    fn park(&mut self, order: u64, ctx: &mut Context<Self>) {
        let Some(e) = self.inflight.get(&order) else { return };
        let d = &e.delivery;
        let Ok(stream) = flotilla_transport::wire::StreamName::new(self.binding.stream) else { return };
        let mut out = OutboundMessage::new(self.env.subjects.parked(&stream), d.payload.clone());
        out.headers = d.headers.without_broker_controls();
        if out.headers.get(headers::ORIGIN_ID).is_none()
            && let Some(id) = d.headers.msg_id()
        {
            out.headers.insert(headers::ORIGIN_ID, id.to_owned());
        }
        // The same message parked again (its term was lost) is dropped as a duplicate.
        out.headers.insert(headers::MSG_ID, format!("parked-{}-{}", d.info.stream, d.info.stream_seq));
        out.headers.insert(headers::PARKED_SEQ, d.info.stream_seq.to_string());
        let key = d.headers.get(headers::KEY).unwrap_or_default().to_owned();
        let recheck = crate::parked::recheck(
            self.env.broker.clone(),
            self.env.subjects.clone(),
            self.env.parked.clone(),
            stream.clone(),
            key,
        );
        let broker = self.env.broker.clone();
        let token = d.token.clone();
        self.metrics.acked(AckCount::Term, 1);
        let stored = async move {
            broker.publish(out).await?;
            if let Err(e) = broker.ack_confirmed(&token, AckKind::Term).await {
                debug!(error = %e, "parked message not taken off the queue: it comes again and is parked again (once)");
            }
            Ok::<(), BrokerError>(())
        };
        ctx.spawn(stored.into_actor(self).map(move |result, act, ctx| {
            match result {
                Ok(()) => {
                    act.forget(order);
                    // Parked after an unpark's last sweep, nobody would send it back.
                    actix::spawn(recheck);
                }
                Err(e) => {
                    if let Some(env) = act.inflight.get(&order) {
                        // Not at once: it would come straight back and be refused again,
                        // spending its deliveries in a second.
                        let delivery = env.delivery.clone();
                        let delay = park_retry_delay(delivery.info.delivered, rand::Rng::random_range(&mut rand::rng(), 0.5..1.5));
                        warn!(stream = act.binding.stream, seq = delivery.info.stream_seq, ?delay, error = %e, "could not park a message of a parked key: handing it back for later");
                        act.forget(order);
                        act.hand_back_after(&delivery, true, Some(delay));
                    }
                }
            }
            act.drive(ctx);
        }));
    }

    /// A queue message delivered before: its attempt is its deliveries less the
    /// hand-backs counted for it (interrupted is not failed). One whose attempts are
    /// spent — its earlier ones ended without a verdict, as when the node running it
    /// died or hung — is dead-lettered without running again.
    fn count_releases(&mut self, order: u64, seq: u64, delivered: u64, ctx: &mut Context<Self>) {
        let broker = self.env.broker.clone();
        let bucket = self.env.subjects.bucket_name(RELEASED);
        let key = released::key(self.binding.stream, seq);
        let fut = async move { released::count(&broker, &bucket, &key).await };
        ctx.spawn(fut.into_actor(self).map(move |count, act, ctx| {
            let max = act.config.retry.max_attempts;
            let (released, known) = match count {
                Ok(n) => (n, true),
                Err(e) => {
                    debug!(stream = act.binding.stream, seq, error = %e, "hand-backs not read: running it on its last attempt");
                    (0, false)
                }
            };
            // Unknown hand-backs: run it (as its last attempt at most), never dead-letter it unread.
            let attempt = if known { released::attempt(delivered, released) } else { released::attempt(delivered, 0).min(max) };
            if act.stopping {
                // A stop came while the count was read: hand it back unstarted.
                if let Some(e) = act.inflight.get(&order) {
                    let delivery = e.delivery.clone();
                    act.forget(order);
                    act.hand_back(&delivery, true);
                }
                act.drive(ctx);
                return;
            }
            let Some(envelope) = act.inflight.get_mut(&order) else { return };
            envelope.attempt = attempt;
            if attempt > max {
                act.dead_letter(
                    order,
                    "max-attempts",
                    format!(
                        "delivered {delivered} times, {released} of them handed back unfinished (not counted): its {} attempts ended without a verdict, as when the node running it dies or hangs",
                        attempt - 1
                    ),
                    ctx,
                );
            } else {
                act.retries.push_back(order);
            }
            act.drive(ctx);
        }));
    }

    /// Starts (or retries) processing of the message at `order`.
    fn start_attempt(&mut self, order: u64, ctx: &mut Context<Self>) {
        let Some(envelope) = self.inflight.get_mut(&order) else { return };
        if let Some((reason, detail)) = envelope.dead_letter.take() {
            self.dead_letter(order, reason, detail, ctx);
            return;
        }
        let now = Instant::now();
        envelope.started = Some(now);
        envelope.backing_off = false;
        if envelope.counted {
            self.state.attempt_started(order, now.into_std());
        }
        let Some(envelope) = self.inflight.get(&order) else { return };
        let d = &envelope.delivery;
        let decoded = match d.headers.kind() {
            // The input type's `Deserialize` is user code: a panic there is a message
            // that cannot be decoded, not the end of the worker.
            Some(MessageKind::Data) => supervised(|| {
                TaskContext::decode::<T::Input>(&self.env.codec, &d.headers, self.binding.type_name, &d.payload)
            })
            .unwrap_or_else(|panic| {
                Err(flotilla_transport::wire::CodecError::Malformed {
                    type_name: self.binding.type_name.to_owned(),
                    reason: format!("its Deserialize panicked: {}", panic_text(&panic)),
                })
            })
            .map(Call::Process)
            .map_err(|e| (e.reason(), e.to_string())),
            // A durable timer that came due: the `timer` hook runs in its place.
            Some(MessageKind::Timer) => match d.headers.get(headers::TIMER) {
                Some(name) => Ok(Call::Timer(name.to_owned())),
                None => Err(("malformed", format!("a timer message without its {} header", headers::TIMER))),
            },
            Some(marker @ (MessageKind::Drain | MessageKind::EndOfStream)) => Err((
                "malformed",
                format!(
                    "Flotilla-Kind {:?} is a marker of ordered partitions; queue input {} takes only data",
                    marker.as_str(),
                    self.binding.stream
                ),
            )),
            None => Err((
                "malformed",
                format!(
                    "unknown Flotilla-Kind {:?} on a data message",
                    d.headers.get(headers::KIND).unwrap_or_default()
                ),
            )),
        };
        let input = match decoded {
            Ok(input) => input,
            Err((reason, detail)) => {
                self.dead_letter(order, reason, detail, ctx);
                return;
            }
        };
        if let Some(e) = self.inflight.get_mut(&order) {
            e.ran = true;
        }
        let Some(envelope) = self.inflight.get_mut(&order) else { return };
        let d = &envelope.delivery;
        let span = tracing::debug_span!(
            "process",
            stream = self.binding.stream,
            partition = self.binding.partition,
            seq = d.info.stream_seq,
            attempt = envelope.attempt,
            trace_id = tracing::field::Empty,
            span_id = tracing::field::Empty,
            parent_id = tracing::field::Empty,
        );
        // Nothing collects the span (the default): no ids, and the context passes the
        // input's traceparent on as it is, without this lookup.
        envelope.trace = if span.is_disabled() {
            None
        } else {
            crate::trace::message_context(&span, d.headers.get(headers::TRACEPARENT))
        };
        let trace = envelope.trace;
        let d = &envelope.delivery;
        let meta = MessageMeta {
            // A message that was parked keeps the id it had.
            id: match d.headers.get_text(headers::ORIGIN_ID).or_else(|| d.headers.get_text(headers::MSG_ID)) {
                Some(id) => MessageId::from_header(id),
                None => MessageId::from_wire(format!("{}-{}", d.info.stream, d.info.stream_seq)),
            },
            key: d.headers.get(headers::KEY).map(str::to_owned),
            stream: self.binding.stream,
            partition: self.binding.partition,
            stream_seq: d.info.stream_seq,
            delivered: d.info.delivered,
            attempt: envelope.attempt,
            published: d.info.published,
            headers: d.headers.clone(),
        };
        let Some(mut task) = self.task.take() else { return };
        let mut tctx = self.context(Some(meta));
        if let Some(t) = trace {
            // Outputs continue the trace with this message's span as their parent.
            tctx = tctx.with_traceparent(t.header());
        }
        let mut fut: LocalBoxFuture<'static, Processed<T>> = Box::pin(async move {
            let result = match input {
                Call::Process(input) => Supervised::new(task.process(input, &mut tctx)).await,
                Call::Timer(name) => Supervised::new(timers::fire(&mut *task, name, &mut tctx)).await,
            };
            (task, tctx, result)
        });
        // Most handlers finish without waiting on anything: run them here, in this turn,
        // instead of paying a spawn and a later poll per message. A handler that does
        // wait is spawned and polled again with the actor's waker (a future re-registers
        // its waker on every poll, so the first, no-op waker is never relied on).
        let polled = {
            let _in_span = span.enter();
            fut.as_mut().poll(&mut std::task::Context::from_waker(Waker::noop()))
        };
        if let Poll::Ready(processed) = polled {
            // The caller's loop goes on with the next operation.
            self.processed(order, processed, ctx);
            return;
        }
        ctx.spawn(fut.instrument(span).into_actor(self).map(move |processed, act, ctx| {
            act.processed(order, processed, ctx);
            act.drive(ctx);
        }));
    }

    /// The handler of the message at `order` returned.
    fn processed(&mut self, order: u64, (task, mut tctx, result): Processed<T>, ctx: &mut Context<Self>) {
        self.task = Some(task);
        if let Some(started) = self.inflight.get(&order).and_then(|e| e.started) {
            let took = started.elapsed();
            self.metrics.process.record(took.as_secs_f64());
            self.metrics.busy(took);
        }
        self.apply_requests(&mut tctx);
        let ok = matches!(result, Ok(Ok(())));
        // With stores, a message that does not finish in this turn (its deferred work or
        // its outputs are on their way) keeps the journal of its changes: if it fails
        // after all, they are undone and it is retried like any other.
        let unfinished = ok && (tctx.deferred.is_some() || !tctx.outputs_handle().is_empty());
        match &self.durable {
            Some(d) if unfinished => d.stores.borrow_mut().end_callback_held(order),
            _ => self.end_callback(ok),
        }
        if ok && let Some(e) = self.inflight.get_mut(&order) {
            e.applied = self.durable.is_some();
            self.applied_through = self.applied_through.max(e.delivery.info.stream_seq);
        }
        match result {
            Ok(Ok(())) => {
                let deferred = tctx.deferred.take();
                let outputs = tctx.into_outputs();
                self.after_process(order, deferred, outputs, ctx);
            }
            Ok(Err(TaskError::Failed(reason))) => self.failed_attempt(order, reason, ctx),
            Ok(Err(TaskError::Fatal(reason))) => {
                self.suspect_ended_owner(order);
                self.fail(format!("process: {reason}"), ctx)
            }
            Ok(Err(TaskError::Unavailable(reason))) => self.retry_unavailable(order, reason, ctx),
            Ok(Err(TaskError::Permanent { reason, detail })) => self.dead_letter(order, reason, detail, ctx),
            Err(panic) => self.failed_attempt(order, format!("handler panicked: {}", panic_text(&panic)), ctx),
        }
    }

    /// Something was unreachable: try the message again after a back-off, in place,
    /// without counting an attempt.
    fn retry_unavailable(&mut self, order: u64, reason: String, ctx: &mut Context<Self>) {
        let Some(envelope) = self.inflight.get_mut(&order) else { return };
        envelope.unavailable += 1;
        envelope.started = None;
        if !envelope.counted {
            envelope.counted = true;
            self.state.restart(order, Instant::now().into_std());
        }
        let n = envelope.unavailable;
        if n > self.config.unavailable_retries {
            // The ceiling: from here on, being unavailable costs attempts.
            let limit = self.config.unavailable_retries;
            self.failed_attempt(order, format!("{reason} (still unavailable after {limit} retries)"), ctx);
            return;
        }
        let delay = unavailable_backoff(n);
        warn!(stream = self.binding.stream, partition = self.binding.partition, seq = envelope.delivery.info.stream_seq, ?delay, %reason, "unavailable; retrying without counting an attempt");
        envelope.backing_off = true;
        self.state.attempt_paused(order);
        self.timers.do_send(After { delay, target: ctx.address().recipient(), tick: Tick::Retry(order) });
    }

    fn after_process(
        &mut self,
        order: u64,
        deferred: Option<LocalBoxFuture<'static, Result<(), TaskError>>>,
        outputs: Outputs,
        ctx: &mut Context<Self>,
    ) {
        match deferred {
            None => {
                self.process_done(order);
                self.await_effects(order, outputs, ctx);
            }
            Some(fut) => {
                let fut = Supervised::new(fut);
                ctx.spawn(fut.into_actor(self).map(move |result, act, ctx| {
                    if !matches!(result, Ok(Ok(()))) && !act.undo_applied(order) {
                        // Its store changes are tied to later ones: a retry would apply
                        // them twice, and only the last commit can take them back.
                        let why = match &result {
                            Ok(Err(e)) => e.to_string(),
                            Err(panic) => format!("panicked: {}", panic_text(panic)),
                            Ok(Ok(())) => String::new(),
                        };
                        act.restore_blaming(
                            order,
                            format!("deferred work of a message failed after its store changes were applied ({why})"),
                            ctx,
                        );
                        return;
                    }
                    match result {
                        Ok(Ok(())) => {
                            act.process_done(order);
                            act.await_effects(order, outputs, ctx);
                        }
                        Ok(Err(TaskError::Failed(reason))) => act.failed_attempt(order, reason, ctx),
                        Ok(Err(TaskError::Fatal(reason))) => {
                            act.suspect_ended_owner(order);
                            act.fail(format!("process: {reason}"), ctx)
                        }
                        Ok(Err(TaskError::Unavailable(reason))) => act.retry_unavailable(order, reason, ctx),
                        Ok(Err(TaskError::Permanent { reason, detail })) => act.dead_letter(order, reason, detail, ctx),
                        Err(panic) => {
                            act.failed_attempt(order, format!("handler panicked: {}", panic_text(&panic)), ctx)
                        }
                    }
                    act.drive(ctx);
                }));
            }
        }
    }

    fn process_done(&mut self, order: u64) {
        if let Some(e) = self.inflight.get_mut(&order)
            && e.counted
        {
            e.counted = false;
            self.state.process_done(order);
        }
    }

    /// Publishes the message's outputs; it finishes once they are stored.
    fn await_effects(&mut self, order: u64, outputs: Outputs, ctx: &mut Context<Self>) {
        let msgs = outputs.take_buffer();
        if msgs.is_empty() {
            // Nothing to publish (most messages of most tasks): no batch to build.
            self.flushed(FlushTarget::Message(order), ctx);
            return;
        }
        self.flush(Flush { target: FlushTarget::Message(order), msgs: msgs.into(), attempt: 0 }, ctx);
    }

    /// Queues outputs for publishing. Batches are sent one after the other, in the order
    /// their callbacks finished, so outputs keep their order across messages; their
    /// acks are awaited concurrently (publishes pipeline across messages).
    fn flush(&mut self, flush: Flush, ctx: &mut Context<Self>) {
        if flush.msgs.is_empty() {
            self.flushed(flush.target, ctx);
            return;
        }
        self.flushes_in_flight += 1;
        self.publish_queue.push_back(flush);
        self.pump_publish(ctx);
    }

    fn pump_publish(&mut self, ctx: &mut Context<Self>) {
        if self.publishing || self.finished {
            return;
        }
        if self.binding.fenced() {
            self.abort_fenced(ctx);
            return;
        }
        let Some(flush) = self.publish_queue.pop_front() else { return };
        self.publishing = true;
        let sent = Instant::now();
        let queued = self.env.broker.publish_pipelined_batch(flush.msgs.clone());
        ctx.spawn(queued.into_actor(self).map(move |queued, act, ctx| {
            act.publishing = false;
            act.pump_publish(ctx);
            match queued {
                Ok(stored) => {
                    ctx.spawn(stored.into_actor(act).map(move |stored, act, ctx| {
                        match stored {
                            Ok(()) => {
                                act.metrics.publish.record(sent.elapsed().as_secs_f64());
                                act.metrics.published.increment(flush.msgs.len() as u64);
                                act.flushes_in_flight = act.flushes_in_flight.saturating_sub(1);
                                act.flushed(flush.target, ctx)
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
    fn flush_failed(&mut self, mut flush: Flush, err: flotilla_transport::BrokerError, ctx: &mut Context<Self>) {
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
                self.dead_letter(order, reason, format!("output not stored: {err}"), ctx);
            }
            FlushTarget::Message(order) => {
                if let Some(e) = self.inflight.get_mut(&order)
                    && !e.counted
                {
                    e.counted = true;
                    self.state.restart(order, Instant::now().into_std());
                }
                self.failed_attempt(order, format!("output not stored: {err}"), ctx);
            }
            FlushTarget::Hook(kind) => self.fail(format!("{}: output not stored: {err}", kind.label()), ctx),
        }
    }

    fn flushed(&mut self, target: FlushTarget, ctx: &mut Context<Self>) {
        match target {
            FlushTarget::Message(order) => self.effects_stored(order),
            FlushTarget::Hook(kind) => self.hook_done(kind, ctx),
        }
    }

    /// The message is processed and its outputs are stored.
    fn effects_stored(&mut self, order: u64) {
        let Some(envelope) = self.inflight.remove(&order) else { return };
        if envelope.applied
            && let Some(d) = &self.durable
        {
            d.stores.borrow_mut().release(order);
        }
        self.suspect_finished(envelope.delivery.info.stream_seq);
        if self.binding.ordered() {
            self.state.effects_done(order);
            self.maybe_request_commit();
        } else {
            self.claimed.remove(&order);
            crate::failpoint::hit(crate::failpoint::Point::EffectsStoredBeforeAck);
            self.ack(&envelope.delivery.token, AckKind::Ack);
            self.state.effects_done(order);
            self.completed(1);
        }
    }

    fn maybe_request_commit(&mut self) {
        if !self.state.uncommitted() || self.state.commit_pending() {
            return;
        }
        let idle = self.state.pending_len() == 0 && self.state.in_flight() == 0;
        if core::commit_due(self.state.uncommitted_count(0), idle, self.config.window) {
            self.state.request_commit();
        }
    }

    /// One attempt failed: retry, or dead-letter on the last attempt.
    fn failed_attempt(&mut self, order: u64, reason: String, ctx: &mut Context<Self>) {
        let Some(envelope) = self.inflight.get_mut(&order) else { return };
        self.metrics.failed_attempts.increment(1);
        let attempt = envelope.attempt;
        let max = self.config.retry.max_attempts;
        let seq = envelope.delivery.info.stream_seq;
        match self.binding.discipline().after_failure(attempt, &self.config.retry) {
            AfterFailure::DeadLetter => {
                debug!(stream = self.binding.stream, partition = self.binding.partition, seq, attempt, %reason, "last attempt failed; dead-lettering");
                self.dead_letter(order, "max-attempts", format!("attempt {attempt} of {max} failed: {reason}"), ctx);
            }
            AfterFailure::RetryInPlace(delay) => {
                debug!(stream = self.binding.stream, partition = self.binding.partition, seq, attempt, ?delay, %reason, "attempt failed; retrying");
                envelope.attempt += 1;
                envelope.started = None;
                envelope.backing_off = true;
                self.state.attempt_paused(order);
                self.timers.do_send(After { delay, target: ctx.address().recipient(), tick: Tick::Retry(order) });
            }
            AfterFailure::Nak(delay) => {
                debug!(stream = self.binding.stream, partition = self.binding.partition, seq, attempt, ?delay, %reason, "attempt failed; retrying");
                let token = envelope.delivery.token.clone();
                self.ack(&token, AckKind::Nak(Some(delay)));
                self.forget(order);
            }
        }
    }

    /// Done with a queue message without acking it here (nak'd or terminated).
    fn forget(&mut self, order: u64) {
        if let Some(e) = self.inflight.remove(&order)
            && e.counted
        {
            self.state.process_done(order);
        }
        self.claimed.remove(&order);
        self.state.effects_done(order);
        self.completed(1);
    }

    /// Moves the message to the dead-letter stream, then skips (ordered) or terminates (queue) it.
    fn dead_letter(&mut self, order: u64, reason: &'static str, detail: String, ctx: &mut Context<Self>) {
        let Some(envelope) = self.inflight.get(&order) else { return };
        let letter = DeadLetter {
            delivery: envelope.delivery.clone(),
            stream: self.binding.stream.to_owned(),
            partition: self.binding.partition,
            reason,
            detail: detail.clone(),
            // The attempts before this one, and this one if `process` ran for it.
            attempts: Some(envelope.attempt.saturating_sub(1) + u32::from(envelope.ran)),
            trace: envelope.trace,
        };
        ctx.spawn(self.reaper.send(letter).into_actor(self).map(move |result, act, ctx| {
            match result {
                Ok(Ok(())) => match act.binding.discipline().after_dead_letter() {
                    None => {
                        act.process_done(order);
                        act.effects_stored(order);
                    }
                    Some(kind) => {
                        if let Some(e) = act.inflight.get(&order) {
                            let token = e.delivery.token.clone();
                            act.ack(&token, kind);
                            act.forget(order);
                        }
                    }
                },
                Ok(Err(e)) => {
                    warn!(error = %e, "dead letter not stored; trying again in 1 s");
                    if let Some(env) = act.inflight.get_mut(&order) {
                        env.dead_letter = Some((reason, detail));
                    }
                    act.timers.do_send(After {
                        delay: Duration::from_secs(1),
                        target: ctx.address().recipient(),
                        tick: Tick::Retry(order),
                    });
                }
                Err(mailbox) => act.fail(format!("reaper unavailable: {mailbox}"), ctx),
            }
            act.drive(ctx);
        }));
    }

    fn apply_requests(&mut self, tctx: &mut TaskContext) {
        if tctx.requests.commit {
            self.state.request_commit();
        }
        if let Some(scope) = tctx.requests.shutdown {
            self.report(WorkerReport::ShutdownRequested { slot: self.binding.slot, scope });
        }
        for (name, after) in tctx.timers.drain(..) {
            if let Some(me) = &self.self_recipient {
                self.timers.do_send(After { delay: after, target: me.clone(), tick: Tick::UserTimer(name) });
            }
        }
    }

    /// Runs a hook with the task checked out; its outputs are stored before the
    /// operation counts as done.
    fn run_hook(&mut self, hook: Hook, ctx: &mut Context<Self>) {
        let kind = match &hook {
            Hook::Init => HookKind::Init,
            Hook::Window => HookKind::Window,
            Hook::Commit => HookKind::Commit,
            Hook::Timers(_) => HookKind::Timers,
            Hook::Drain => HookKind::Drain,
            Hook::EndOfStream => HookKind::EndOfStream,
            Hook::Shutdown => HookKind::Shutdown,
        };
        let Some(mut task) = self.task.take() else { return };
        let mut tctx = self.context(None);
        if let Some(cause) = self.hook_cause(kind) {
            tctx = tctx.with_cause(cause);
        }
        let label = kind.label();
        let started = Instant::now();
        let span = tracing::debug_span!(
            "hook",
            hook = label,
            stream = self.binding.stream,
            partition = self.binding.partition,
            trace_id = tracing::field::Empty,
            span_id = tracing::field::Empty,
        );
        if let Some(trace) = crate::trace::open(&span, None, true) {
            tctx = tctx.with_traceparent(trace.header());
        }
        let fut = async move {
            let result = Supervised::new(async {
                match hook {
                    Hook::Init => task.init(&mut tctx).await,
                    Hook::Window => task.window(&mut tctx).await,
                    Hook::Commit => task.commit(&mut tctx).await,
                    Hook::Timers(names) => {
                        for name in names {
                            task.timer(name, &mut tctx).await?;
                        }
                        Ok(())
                    }
                    Hook::Drain => task.drain(&mut tctx).await,
                    Hook::EndOfStream => task.end_of_stream(&mut tctx).await,
                    Hook::Shutdown => task.shutdown(&mut tctx).await,
                }
            })
            .await;
            (task, tctx, result)
        };
        ctx.spawn(fut.instrument(span).into_actor(self).map(move |(task, mut tctx, result), act, ctx| {
            act.task = Some(task);
            act.metrics.hook(label, started.elapsed());
            act.apply_requests(&mut tctx);
            act.end_callback(matches!(result, Ok(Ok(()))));
            let result = match result {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(format!("{label}: {e}")),
                Err(panic) => Err(format!("{label} panicked: {}", panic_text(&panic))),
            };
            if let Err(reason) = result {
                act.fail(reason, ctx);
                return;
            }
            let msgs = tctx.outputs_handle().take_buffer().into();
            act.flush(Flush { target: FlushTarget::Hook(kind), msgs, attempt: 0 }, ctx);
            act.drive(ctx);
        }));
    }

    /// A hook ran and its outputs are stored.
    fn hook_done(&mut self, kind: HookKind, ctx: &mut Context<Self>) {
        match kind {
            HookKind::Init => {
                if self.hook_at.0 == self.applied_through
                    && self.durable.as_ref().is_some_and(|d| d.stores.borrow().has_changes())
                {
                    self.hook_at.1 += 1;
                }
                self.commit_hook_changes();
            }
            HookKind::Window => {
                self.state.window_done();
                self.commit_hook_changes();
            }
            HookKind::Timers => {
                self.state.timer_done();
                self.commit_hook_changes();
            }
            HookKind::Commit => {
                self.commit_then(AfterCommit::Drive, ctx);
                return;
            }
            HookKind::Drain | HookKind::EndOfStream => {
                let outcome = if kind == HookKind::Drain { Outcome::Drained } else { Outcome::EndOfStream };
                self.commit_then(AfterCommit::Finish(outcome), ctx);
                return;
            }
            HookKind::Shutdown => {
                self.finish(self.stopped_outcome(), ctx);
                return;
            }
        }
        self.drive(ctx);
    }

    /// Acknowledges everything up to `positions` (the state machine's committable
    /// positions when the commit began).
    fn commit_positions(&mut self, positions: BTreeMap<u32, u64>) {
        if self.binding.fenced() {
            // Another node may own the partition now: acking here could skip its work.
            return;
        }
        let mut count = 0;
        if let Some(&pos) = positions.get(&0) {
            let rest = self.claimed.split_off(&(pos + 1));
            let done = std::mem::replace(&mut self.claimed, rest);
            if self.binding.ordered() {
                if let Some((_, last)) = done.iter().next_back() {
                    crate::failpoint::hit(crate::failpoint::Point::EffectsStoredBeforeAck);
                    self.ack(&last.token, AckKind::Ack);
                    self.intake.committed_to(last.seq);
                    self.last_commit = Some(last.token.clone());
                }
            } else {
                // Queue data messages were acked one by one; what is left are markers.
                for c in done.values() {
                    self.ack(&c.token, AckKind::Ack);
                }
            }
            count = done.len();
        }
        self.state.commit_done(positions);
        self.completed(count);
    }

    /// The task failed: hand everything back and report.
    fn fail(&mut self, reason: String, ctx: &mut Context<Self>) {
        if self.finished {
            return;
        }
        warn!(stream = self.binding.stream, partition = self.binding.partition, %reason, "task failed");
        // Keep what is done: commit the completed prefix before handing the rest back.
        // Not with stores: the state in memory may hold changes of messages not
        // finished, and acknowledging without writing it would lose the rest; the next
        // owner restores the last commit and skips what it reflects.
        if self.state.uncommitted() && self.durable.is_none() {
            let positions = self.state.committable().clone();
            self.commit_positions(positions);
        }
        self.state.fail(reason.clone());
        emit(
            &self.env.broker,
            &self.env.subjects,
            Event::TaskFailed {
                stream: self.binding.stream.to_owned(),
                partition: self.binding.partition,
                reason: reason.clone(),
            },
        );
        self.release_all(false);
        self.finish(Outcome::Failed(reason), ctx);
    }

    /// Naks (without delay) what was claimed and never started — for example what
    /// followed a drain marker — so the next run gets it at once.
    fn hand_back_unstarted(&mut self) {
        let unstarted = self.state.take_unstarted();
        let count = unstarted.len();
        for p in unstarted {
            self.claimed.remove(&p.order);
            self.hand_back(&p.msg, true);
        }
        self.completed(count);
    }

    /// Hands back the messages waiting for a retry: a stop does not wait out their
    /// back-off. The commit position stays before them, so whoever runs the partition
    /// next gets them again.
    fn hand_back_backing_off(&mut self) {
        let waiting: Vec<u64> =
            self.inflight.iter().filter(|(_, e)| e.backing_off && !e.applied).map(|(&order, _)| order).collect();
        if waiting.is_empty() {
            return;
        }
        info!(
            stream = self.binding.stream,
            partition = self.binding.partition,
            messages = waiting.len(),
            "stopping: handing back what waits for a retry instead of waiting out its back-off"
        );
        if let Some(&first) = waiting.iter().min() {
            self.handed_back_mid_retry = Some(self.handed_back_mid_retry.map_or(first, |h| h.min(first)));
        }
        for order in waiting {
            let Some(e) = self.inflight.remove(&order) else { continue };
            self.claimed.remove(&order);
            if e.counted {
                self.state.release(order);
            }
            self.hand_back(&e.delivery, true);
        }
    }

    /// Gives a claimed, unfinished message back ([`Discipline::release`]). An
    /// `interrupted` queue message (a stop, a drain deadline, a back-off cut short: not
    /// its fault) has the release counted first, so its next delivery costs no attempt
    /// (see [`released`]).
    fn hand_back(&mut self, d: &Delivery, interrupted: bool) {
        self.hand_back_after(d, interrupted, None);
    }

    /// [`hand_back`](Self::hand_back), a queue message coming again after `delay`.
    fn hand_back_after(&mut self, d: &Delivery, interrupted: bool, delay: Option<Duration>) {
        let Some(kind) = self.binding.discipline().release() else { return };
        let kind = match kind {
            AckKind::Nak(None) => AckKind::Nak(delay),
            other => other,
        };
        if !interrupted || self.binding.ordered() {
            self.ack(&d.token, kind);
            return;
        }
        let broker = self.env.broker.clone();
        let bucket = self.env.subjects.bucket_name(RELEASED);
        let key = released::key(self.binding.stream, d.info.stream_seq);
        let token = d.token.clone();
        self.metrics.acked(ack_count(kind), 1);
        // Not tied to this actor (a stop ends it before the count is stored), and
        // awaited before the worker reports its end, so the process does not exit first.
        self.releases.retain(|h| !h.is_finished());
        self.releases.push(actix::spawn(async move {
            if let Err(e) = released::record(&broker, &bucket, &key).await {
                debug!(error = %e, %key, "release not counted: the next delivery counts as an attempt");
            }
            if let Err(e) = broker.ack(&token, kind).await {
                debug!(error = %e, %key, "hand-back not sent: the message comes again after its ack-wait");
            }
        }));
    }

    /// Naks every message held and not finished, without delay; `interrupted` when
    /// that is not their fault (a stop's deadline), so it costs queue messages no
    /// attempt. After a task failure it does: the culprit is among them.
    fn release_all(&mut self, interrupted: bool) {
        for p in self.state.take_unstarted() {
            self.hand_back(&p.msg, interrupted);
        }
        let inflight: Vec<Envelope> = self.inflight.drain().map(|(_, e)| e).collect();
        for e in inflight {
            self.hand_back(&e.delivery, interrupted);
        }
        self.claimed.clear();
    }

    /// The partition's lease is lost: act no more for it. Nothing is acked, nak'd or
    /// published; the new owner resumes at the committed position.
    fn abort_fenced(&mut self, ctx: &mut Context<Self>) {
        if self.finished {
            return;
        }
        warn!(
            stream = self.binding.stream,
            partition = self.binding.partition,
            in_flight = self.inflight.len(),
            "lease lost: stopping the partition without acking or publishing more"
        );
        self.publish_queue.clear();
        let _ = self.state.take_unstarted();
        self.inflight.clear();
        self.claimed.clear();
        self.finish(Outcome::Stopped, ctx);
    }

    fn finish(&mut self, outcome: Outcome, ctx: &mut Context<Self>) {
        if self.finished {
            return;
        }
        self.finished = true;
        self.state.mark_complete();
        // What this turn acked and completed goes out before the worker reports its end.
        self.send_batched();
        // Nothing runs here any more (a fenced or released worker leaves counts behind).
        self.metrics.in_flight.set(0.0);
        // Handing an ordered partition over: the next owner resets its consumer at the
        // ack floor it reads, so the last commit must have reached the broker before
        // the lease goes (re-acking the same ack-all is idempotent).
        let confirm = match (&self.last_commit, &outcome) {
            (
                Some(token),
                Outcome::Stopped
                | Outcome::Drained
                | Outcome::EndOfStream
                | Outcome::Resync(_)
                | Outcome::Restore { .. },
            ) if !self.binding.fenced() => Some(self.env.broker.ack_confirmed(token, AckKind::Ack)),
            _ => None,
        };
        let flush = self.env.broker.flush();
        let releases = std::mem::take(&mut self.releases);
        let (stream, partition) = (self.binding.stream, self.binding.partition);
        let report = WorkerReport::Finished { slot: self.binding.slot, outcome };
        let container = self.container.clone();
        ctx.spawn(
            async move {
                // Hand-backs counted and sent first: the process may exit once it hears.
                // All of it within a budget, whatever the network does.
                let handed_over = async {
                    let _ = futures::future::join_all(releases).await;
                    let _ = flush.await;
                    match confirm {
                        Some(confirm) => confirm.await.map_err(|e| e.to_string()),
                        None => Ok(()),
                    }
                };
                match tokio::time::timeout(FINISH_BUDGET, handed_over).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        warn!(stream, partition, error = %e, "last commit not confirmed; the next owner may process its messages again");
                    }
                    Err(_) => warn!(
                        stream,
                        partition,
                        "hand-backs and the last commit not confirmed within {FINISH_BUDGET:?} (the broker does not answer): the next owner may process those messages again"
                    ),
                }
                container.do_send(report);
            }
            .into_actor(self)
            .map(|(), _, ctx| ctx.stop()),
        );
    }

    /// Stops gracefully: hands back what has not started, finishes what has (up to the
    /// drain timeout), commits, runs `shutdown` and ends with
    /// [`stopped_outcome`](Self::stopped_outcome).
    fn stop(&mut self, ctx: &mut Context<Self>) {
        if self.stopping || self.finished {
            return;
        }
        self.stopping = true;
        // Interrupted is not failed: hand back at once what has not started, and what
        // waits out a retry back-off.
        self.hand_back_unstarted();
        self.hand_back_backing_off();
        let deadline = self.config.drain_timeout;
        ctx.run_later(deadline, |act, ctx| {
            if !act.finished {
                warn!(
                    stream = act.binding.stream,
                    partition = act.binding.partition,
                    in_flight = act.inflight.len(),
                    "drain timeout: handing back in-flight messages"
                );
                act.release_all(true);
                act.finish(act.stopped_outcome(), ctx);
            }
        });
    }

    /// A delivery was lost: take nothing more, finish and commit what came before the
    /// loss (all of it arrived), and end asking for the partition to be reset at the
    /// committed position, where the lost delivery comes again.
    fn resync(&mut self, reason: String, ctx: &mut Context<Self>) {
        if self.resync.is_some() || self.finished {
            return;
        }
        warn!(stream = self.binding.stream, partition = self.binding.partition, %reason, "delivery sequence broken: committing what arrived complete, then resetting the partition");
        self.resync = Some(reason);
        self.stop(ctx);
    }

    /// How a graceful stop ends: [`Outcome::Resync`] after a lost delivery.
    fn stopped_outcome(&self) -> Outcome {
        match &self.resync {
            Some(reason) => Outcome::Resync(reason.clone()),
            None => Outcome::Stopped,
        }
    }

    /// While stopping: once nothing is in flight, commit, run `shutdown`, finish.
    fn try_finish_stop(&mut self, ctx: &mut Context<Self>) {
        // Outputs of a hook (a window) still on their way: a stop runs no half-done
        // window, so the commit waits for them.
        if self.finished || self.task.is_none() || !self.inflight.is_empty() || self.flushes_in_flight > 0 {
            return;
        }
        if self.state_busy() {
            return;
        }
        if self.durable.is_some()
            && let Some(first) = self.handed_back_mid_retry
            && self.claimed.range(first..).next().is_some()
        {
            // Messages after the one handed back finished: their store changes are in
            // memory, but the commit position stays before it, and a commit would write
            // them there (the next owner would apply them twice). Commit nothing.
            warn!(
                stream = self.binding.stream,
                partition = self.binding.partition,
                "stopping without a commit: messages that finished after one handed back mid-retry cannot have their store changes committed apart from it; the next owner restores the last commit and runs them again"
            );
            self.release_all(true);
            self.finish(self.stopped_outcome(), ctx);
            return;
        }
        let changed = self.durable.as_ref().is_some_and(|d| d.stores.borrow().has_changes());
        if self.state.uncommitted() || changed {
            self.commit_then(AfterCommit::Shutdown, ctx);
            return;
        }
        self.run_hook(Hook::Shutdown, ctx);
    }

    fn heartbeat(&mut self) {
        if self.binding.fenced() {
            return;
        }
        let now = Instant::now();
        let ack_wait = self.config.ack_wait;
        if self.binding.ordered() {
            // Claimed but uncommitted messages near ack-wait: keep them ours.
            for c in self.claimed.values_mut() {
                if core::progress_due(c.at.into_std(), now.into_std(), ack_wait) {
                    c.at = now;
                    self.acks.push((c.token.clone(), AckKind::InProgress));
                }
            }
        } else {
            for e in self.inflight.values() {
                if e.started.is_some_and(|s| core::progress_due(s.into_std(), now.into_std(), ack_wait)) {
                    self.acks.push((e.delivery.token.clone(), AckKind::InProgress));
                }
            }
        }
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
        if self.durable.is_some() {
            self.restore(ctx);
            return;
        }
        self.run_hook(Hook::Init, ctx);
    }
}

impl<T: Task> Handler<Deliver> for TaskWorker<T> {
    type Result = ();

    fn handle(&mut self, msg: Deliver, ctx: &mut Context<Self>) {
        let now = Instant::now();
        let mut dropped = 0;
        for d in msg.0 {
            if self.stopping || self.finished {
                self.hand_back(&d, true);
                dropped += 1;
                continue;
            }
            if self.binding.ordered() {
                match self.intake.admit(d.info.stream_seq, d.info.consumer_seq) {
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
            let held = self.binding.ordered() || !matches!(kind, EnvelopeKind::Data);
            let claimed = held.then(|| Claimed { token: d.token.clone(), seq: d.info.stream_seq, at: now });
            let order = self.state.insert(0, kind, d);
            if let Some(claimed) = claimed {
                self.claimed.insert(order, claimed);
            }
        }
        self.completed(dropped);
        self.drive(ctx);
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
            WorkerControl::Pause => self.state.pause(),
            WorkerControl::Resume => self.state.resume(),
            WorkerControl::Step => {
                if !self.state.step() {
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
            Tick::Commit => {
                self.commit_tick_armed = false;
                if self.state.uncommitted() {
                    self.state.request_commit();
                }
            }
            Tick::Window => self.state.request_window(),
            Tick::Heartbeat => {
                self.heartbeat_armed = false;
                self.heartbeat();
            }
            Tick::CheckTimeouts => {
                self.timeout_check_armed = false;
                if let Some(timeout) = self.config.callback_timeout {
                    let late = self.state.timed_out(Instant::now().into_std(), timeout);
                    if let Some(&order) = late.first() {
                        self.suspect_ended_owner(order);
                        let seq = self.inflight.get(&order).map(|e| e.delivery.info.stream_seq);
                        self.fail(format!("callback for message {seq:?} did not complete within {timeout:?}"), ctx);
                        return;
                    }
                }
            }
            Tick::UserTimer(name) => {
                self.due_timers.push(name);
                self.state.request_timer();
            }
            Tick::Retry(order) => self.retries.push_back(order),
            Tick::Backlog | Tick::Sweep | Tick::Resume | Tick::Restart(_) | Tick::Scan | Tick::Renew => {}
        }
        self.drive(ctx);
    }
}
