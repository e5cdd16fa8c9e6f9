//! The `Job` builder: declares a job's tasks and their settings, validates them,
//! provisions the streams and consumers, and starts the actors on the current arbiter.
//!
//! Per-task settings (`max_attempts`, `window_every`, `retry`, `ack_wait`, ...) given
//! before any `.task(...)` are the defaults every task starts from; given after a
//! `.task(...)`, they configure that task only.
//!
//! ```no_run
//! # use flotilla_actors::{Job, StreamDef, Task, TaskContext, TaskError};
//! # #[derive(serde::Serialize, serde::Deserialize)] struct Order;
//! # #[derive(serde::Serialize, serde::Deserialize)] struct Refund;
//! # #[derive(Default)] struct Revenue;
//! # impl Task for Revenue { type Input = Order;
//! #   async fn process(&mut self, _: Order, _: &mut TaskContext) -> Result<(), TaskError> { Ok(()) } }
//! # #[derive(Default)] struct Refunds;
//! # impl Task for Refunds { type Input = Refund;
//! #   async fn process(&mut self, _: Refund, _: &mut TaskContext) -> Result<(), TaskError> { Ok(()) } }
//! const ORDERS: StreamDef<Order> = StreamDef::ordered("orders", 8);
//! const REFUNDS: StreamDef<Refund> = StreamDef::queue("refunds");
//! let job = Job::new("revenue")
//!     .max_attempts(5) // every task
//!     .task(ORDERS, |_partition| Revenue::default())
//!     .window_every(std::time::Duration::from_secs(10)) // the orders task only
//!     .task(REFUNDS, |_| Refunds::default())
//!     .max_concurrency(16); // the refunds task only
//! ```

mod member;
mod running;

pub use member::{JobExit, Member, TakeoverSpec};
pub use running::{DEREGISTER_BUDGET, Deregister, JobStopper, Leave, LeaveReason, NodeLink, RunningJob};

use crate::config::{ConfigError, FailurePolicy, TaskConfig};
use crate::container::{Container, ContainerConfig, SlotContext, SlotSpec, WorkerHandle};
use crate::fence::Fence;
use crate::reaper::Reaper;
use crate::retry::RetryPolicy;
use crate::stream::{StreamDef, StreamKind, StreamType};
use crate::task::{Task, TaskEnv};
use crate::task_worker::{Binding, Settings, TaskWorker};
use crate::timer_service::{Promotion, TimerService};
use actix::prelude::*;
use flotilla_transport::broker::{BrokerError, ConsumerSpec, SharedBroker};
use flotilla_transport::topology;
use flotilla_transport::wire::{Codec, JobName, MessageId, NameError, StreamName, Subjects};
use std::rc::Rc;
use std::time::Duration;
use tokio::sync::oneshot;

/// The most replicas a JetStream stream can have.
pub const MAX_REPLICAS: usize = 5;

/// How long a starting node keeps retrying what fails for a passing reason (the
/// broker unreachable, slow, or electing a leader, as a replicated stream or bucket
/// does while it is created or a server restarts) before it gives up.
pub const STARTUP_PATIENCE: Duration = Duration::from_secs(30);

/// Runs `op` until it succeeds, fails for good, or transient errors have lasted
/// [`STARTUP_PATIENCE`]; jittered backoff between tries.
///
/// # Errors
/// What `op` returned last: an error that does not pass, or one that lasted too long.
pub async fn patiently<T, Fut>(what: &str, mut op: impl FnMut() -> Fut) -> Result<T, JobError>
where
    Fut: std::future::Future<Output = Result<T, JobError>>,
{
    let started = std::time::Instant::now();
    let mut tries = 0;
    loop {
        match op().await {
            Err(JobError::Broker(e)) if e.is_transient() && started.elapsed() < STARTUP_PATIENCE => {
                tries += 1;
                let wait = flotilla_transport::jetstream::reconnect_delay(tries);
                tracing::warn!(error = %e, retry_in = ?wait, "cannot {what} yet; the broker is not ready, retrying");
                tokio::time::sleep(wait).await;
            }
            other => return other,
        }
    }
}

/// Why a job could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// A job or stream name breaks the naming rule.
    #[error(transparent)]
    Name(#[from] NameError),
    /// A setting cannot work.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The job is not defined completely.
    #[error("job {job} is misconfigured: {problem}")]
    Misconfigured {
        /// The job.
        job: String,
        /// What is wrong, naming the setting.
        problem: String,
    },
    /// The broker refused or failed.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// A task failed and the policy failed the container.
    #[error("job failed: {0}")]
    Failed(String),
    /// Another live node of the job uses this node id.
    #[error(
        "node id {node:?} is already alive in job {job} ({holder}): it kept renewing its registration (every {ttl:?} at the latest) while this node watched; start this node with another --node-id"
    )]
    NodeIdTaken {
        /// The job.
        job: String,
        /// The node id.
        node: String,
        /// Who holds it.
        holder: String,
        /// How long a holder may go without renewing before its entry expires.
        ttl: Duration,
    },
    /// The node id cannot be used in subjects and keys.
    #[error("node id {0:?} is invalid: use letters, digits, '-' and '_' only")]
    NodeIdInvalid(String),
}

type Starter = Rc<dyn Fn(Rc<TaskEnv>, Binding, Settings, SlotContext) -> WorkerHandle>;

struct TaskEntry {
    stream: &'static str,
    /// The task's stores, made anew for each of its workers.
    stores: Rc<std::cell::RefCell<Vec<crate::store::StoreMaker>>>,
    kind: StreamKind,
    type_name: &'static str,
    config: TaskConfig,
    /// The settings its workers share, made once when the first starts (the builder
    /// may change `config` until then).
    settings: std::cell::OnceCell<Settings>,
    starter: Starter,
}

impl TaskEntry {
    fn settings(&self) -> Settings {
        self.settings.get_or_init(|| Settings::new(self.config.clone(), self.kind)).clone()
    }
}

/// A job: its name and tasks. Per-task settings given before any `.task(...)` are
/// every task's defaults; after one, they configure the task added last.
pub struct Job {
    name: String,
    tasks: Vec<TaskEntry>,
    outputs: Vec<(&'static str, StreamKind)>,
    types: Vec<StreamType>,
    /// Settings given before any task: every task starts from them.
    defaults: TaskConfig,
    run_id: Option<String>,
    codec: Codec,
    container: ContainerConfig,
    replicas: usize,
    errors: Vec<String>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job").field("name", &self.name).field("tasks", &self.tasks.len()).finish_non_exhaustive()
    }
}

impl Job {
    /// A job named `name` (checked when it starts).
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            tasks: Vec::new(),
            outputs: Vec::new(),
            types: Vec::new(),
            defaults: TaskConfig::default(),
            run_id: None,
            codec: Codec::default(),
            container: ContainerConfig::default(),
            replicas: 1,
            errors: Vec::new(),
        }
    }

    /// The job's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Adds a task consuming `input`; `factory` builds one task per partition (given the
    /// partition) or, for a queue input, one per node (given `None`).
    pub fn task<T: Task, F: Fn(Option<u32>) -> T + 'static>(mut self, input: StreamDef<T::Input>, factory: F) -> Self {
        self.add_type(StreamType::of(&input));
        let factory = Rc::new(factory);
        let stores: Rc<std::cell::RefCell<Vec<crate::store::StoreMaker>>> = Rc::default();
        let makers = stores.clone();
        let starter: Starter = Rc::new(move |env: Rc<TaskEnv>, binding, settings, sc: SlotContext| {
            let task = factory(binding.partition);
            let set = crate::store::StoreSet::new(&makers.borrow(), env.codec)
                .with_max_payload(env.broker.server().max_payload);
            let worker = TaskWorker::new(task, env, binding, settings, sc).with_stores(set).start();
            WorkerHandle { stop: worker.clone().recipient(), control: worker.recipient() }
        });
        self.tasks.push(TaskEntry {
            stream: input.name(),
            stores,
            kind: input.kind(),
            type_name: input.type_name(),
            config: self.defaults.clone(),
            settings: std::cell::OnceCell::new(),
            starter,
        });
        self
    }

    /// Gives the task added last a durable key-value store (see
    /// [`TaskContext::store`](crate::TaskContext::store) and `docs/state.md`). Its
    /// changes are written to the job's changelog with each commit, before the inputs
    /// they reflect are acknowledged; whoever owns the partition next restores it
    /// before processing. Needs an ordered input and no async commit.
    pub fn store<K: crate::store::StoreKey, V: crate::store::StoreValue>(
        mut self,
        def: crate::store::StoreDef<K, V>,
    ) -> Self {
        if let Some(problem) = crate::store::name_problem(def.name()) {
            self.errors.push(problem);
        }
        match self.tasks.last() {
            None => self.errors.push(format!(
                "store {} was declared before any .task(...): stores belong to the task added last",
                def.name()
            )),
            Some(t) if !matches!(t.kind, StreamKind::Ordered { .. }) => self.errors.push(format!(
                "store {} belongs to the task of queue input {}: stores move with ordered partitions, so give it an ordered input",
                def.name(),
                t.stream
            )),
            Some(t) => {
                let mut makers = t.stores.borrow_mut();
                if makers.iter().any(|m| m().name() == def.name()) {
                    self.errors.push(format!("store {} is declared twice for input {}", def.name(), t.stream));
                } else {
                    makers.push(crate::store::maker(def));
                }
            }
        }
        self
    }

    /// Declares an output stream, so it is provisioned when the job starts (outputs are
    /// otherwise created on first send).
    pub fn output<T: serde::Serialize + serde::de::DeserializeOwned + 'static>(mut self, stream: StreamDef<T>) -> Self {
        self.add_type(StreamType::of(&stream));
        self.outputs.push((stream.name(), stream.kind()));
        self
    }

    /// The types of the job's inputs and declared outputs.
    pub fn stream_types(&self) -> &[StreamType] {
        &self.types
    }

    fn add_type(&mut self, t: StreamType) {
        if !self.types.iter().any(|k| k.stream == t.stream) {
            self.types.push(t);
        }
    }

    /// Where a per-task setting goes: the task added last, or, before any
    /// `.task(...)`, the defaults every task starts from.
    fn last(&mut self, _setting: &str) -> Option<&mut TaskConfig> {
        Some(match self.tasks.last_mut() {
            Some(t) => &mut t.config,
            None => &mut self.defaults,
        })
    }

    /// Replaces all settings of the last task.
    pub fn config(mut self, config: TaskConfig) -> Self {
        if let Some(c) = self.last("config") {
            *c = config;
        }
        self
    }

    /// Messages processed at once per task.
    pub fn max_concurrency(mut self, n: usize) -> Self {
        if let Some(c) = self.last("max_concurrency") {
            c.max_concurrency = n;
        }
        self
    }

    /// Runs `window` every `interval`.
    pub fn window_every(mut self, interval: Duration) -> Self {
        if let Some(c) = self.last("window_every") {
            c.window_interval = Some(interval);
        }
        self
    }

    /// Forces a commit every `interval`.
    pub fn commit_every(mut self, interval: Duration) -> Self {
        if let Some(c) = self.last("commit_every") {
            c.commit_interval = interval;
        }
        self
    }

    /// Lets commits overlap processing.
    pub fn async_commit(mut self, on: bool) -> Self {
        if let Some(c) = self.last("async_commit") {
            c.async_commit = on;
        }
        self
    }

    /// Fails the task when a `process` runs longer than `timeout`.
    pub fn callback_timeout(mut self, timeout: Duration) -> Self {
        if let Some(c) = self.last("callback_timeout") {
            c.callback_timeout = Some(timeout);
        }
        self
    }

    /// Sets the retry policy.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        if let Some(c) = self.last("retry") {
            c.retry = policy;
        }
        self
    }

    /// Sets the attempts before dead-lettering.
    pub fn max_attempts(mut self, n: u32) -> Self {
        if let Some(c) = self.last("max_attempts") {
            c.retry.max_attempts = n;
        }
        self
    }

    /// Ordered inputs: how often a message may end its owner (crash, hang, task
    /// failure) before it is dead-lettered as `crash-loop` (default 3).
    pub fn crash_limit(mut self, n: u32) -> Self {
        if let Some(c) = self.last("crash_limit") {
            c.crash_limit = n;
        }
        self
    }

    /// How often one attempt is retried without counting while something is
    /// unavailable (default 50, about 22 minutes of backoff); past it, the attempt fails.
    pub fn unavailable_retries(mut self, n: u32) -> Self {
        if let Some(c) = self.last("unavailable_retries") {
            c.unavailable_retries = n;
        }
        self
    }

    /// How long a graceful stop waits for in-flight work.
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        if let Some(c) = self.last("drain_timeout") {
            c.drain_timeout = timeout;
        }
        self
    }

    /// The broker's redelivery timeout for this task's input.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        if let Some(c) = self.last("ack_wait") {
            c.ack_wait = ack_wait;
        }
        self
    }

    /// What a failure of this task does.
    pub fn on_failure(mut self, policy: FailurePolicy) -> Self {
        if let Some(c) = self.last("on_failure") {
            c.failure_policy = policy;
        }
        self
    }

    /// Sets the run id (drain markers of other runs are dropped). Default: a new UUID v7.
    pub fn run_id(mut self, run_id: impl Into<String>) -> Self {
        self.run_id = Some(run_id.into());
        self
    }

    /// Sets the payload codec (for example a larger size limit).
    pub fn codec(mut self, codec: Codec) -> Self {
        self.codec = codec;
        self
    }

    /// Keeps `replicas` copies (1 to 5) of every stream and KV bucket the job creates,
    /// for a NATS cluster of at least that many servers. Default 1. Objects that exist
    /// with another replica count are kept as they are, with a logged note (a warning
    /// when they have fewer).
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// The replica count the job creates its streams and buckets with.
    pub fn replica_count(&self) -> usize {
        self.replicas
    }

    /// Sets the container's settings (claim wait, backlog thresholds, sweeps).
    pub fn container_config(mut self, config: ContainerConfig) -> Self {
        self.container = config;
        self
    }

    /// Checks names and settings without touching the broker.
    ///
    /// # Errors
    /// The first problem, naming the setting.
    pub fn validate(&self) -> Result<(), JobError> {
        let job = JobName::new(self.name.clone())?;
        let misconfigured = |problem: String| JobError::Misconfigured { job: job.to_string(), problem };
        if let Some(e) = self.errors.first() {
            return Err(misconfigured(e.clone()));
        }
        if self.tasks.is_empty() {
            return Err(misconfigured(
                "it has no tasks: add one with .task(STREAM, |partition| MyTask::default())".into(),
            ));
        }
        if !(1..=MAX_REPLICAS).contains(&self.replicas) {
            return Err(misconfigured(format!(
                "replicas is {}; use 1 to {MAX_REPLICAS} (JetStream keeps at most {MAX_REPLICAS} copies)",
                self.replicas
            )));
        }
        let mut seen = std::collections::HashSet::new();
        for (name, _) in &self.outputs {
            StreamName::new(*name)?;
        }
        for t in &self.tasks {
            StreamName::new(t.stream)?;
            if !seen.insert(t.stream) {
                return Err(misconfigured(format!("stream {} has two tasks; give each input one task", t.stream)));
            }
            if let StreamKind::Ordered { partitions: 0 } = t.kind {
                return Err(misconfigured(format!(
                    "stream {} has 0 partitions; partitions must be at least 1",
                    t.stream
                )));
            }
            t.config.validate(t.stream)?;
            if !t.stores.borrow().is_empty() && t.config.async_commit {
                return Err(misconfigured(format!(
                    "the task of {} has stores and async commit: a commit must see the state of exactly the inputs it acknowledges; turn async_commit off",
                    t.stream
                )));
            }
        }
        Ok(())
    }

    /// Validates the job and creates what it needs on the broker: its dead-letter
    /// stream, declared outputs, and each input's stream and consumers. Idempotent;
    /// refuses (changing nothing) when something exists with another configuration.
    /// Errors that pass (the broker unreachable, a peer of a NATS cluster offline or
    /// still joining) are retried with backoff for up to 30 s.
    ///
    /// # Errors
    /// [`JobError`] for bad names or settings, or when the broker refuses.
    pub async fn provision(&self, broker: SharedBroker) -> Result<(), JobError> {
        // What each task runs with, so a setting given to the wrong task shows.
        for t in &self.tasks {
            let c = &t.config;
            tracing::debug!(
                task = t.stream,
                max_attempts = c.retry.max_attempts,
                max_concurrency = c.max_concurrency,
                window = ?c.window_interval,
                ack_wait = ?c.ack_wait,
                drain_timeout = ?c.drain_timeout,
                "task settings"
            );
        }
        // A replicated stream cannot be placed while a peer is still joining or away:
        // such passing errors are retried for a while (see `patiently`).
        patiently("provision the job's streams", || self.provision_once(broker.clone())).await
    }

    async fn provision_once(&self, broker: SharedBroker) -> Result<(), JobError> {
        self.validate()?;
        let subjects = Subjects::new(JobName::new(self.name.clone())?);
        let r = self.replicas;
        broker.ensure_stream(topology::dlq_stream(&subjects).with_replicas(r)).await?;
        let timers = topology::timer_stream(&subjects).with_replicas(r);
        let timers_name = timers.name.clone();
        broker.ensure_stream(timers).await?;
        broker.ensure_consumer(&timers_name, topology::timer_consumer()).await?;
        let armings = topology::bucket(&subjects, crate::task_worker::ARMINGS, Some(crate::task_worker::ARMINGS_TTL));
        broker.ensure_kv(armings.with_replicas(r)).await?;
        if self.tasks.iter().any(|t| matches!(t.kind, StreamKind::Ordered { .. })) {
            broker.ensure_kv(topology::bucket(&subjects, crate::task_worker::SUSPECTS, None).with_replicas(r)).await?;
        }
        if self.tasks.iter().any(|t| matches!(t.kind, StreamKind::Queue)) {
            let released =
                topology::bucket(&subjects, crate::task_worker::RELEASED, Some(crate::task_worker::RELEASED_TTL));
            broker.ensure_kv(released.with_replicas(r)).await?;
            broker.ensure_stream(topology::parked_stream(&subjects).with_replicas(r)).await?;
            for t in self.tasks.iter().filter(|t| matches!(t.kind, StreamKind::Queue)) {
                let name = StreamName::new(t.stream)?;
                let js_stream = subjects.stream_name(&name);
                let stranded = topology::stranded_stream(&js_stream, &name).with_replicas(r);
                let stranded_name = stranded.name.clone();
                broker.ensure_stream(stranded).await?;
                broker.ensure_consumer(&stranded_name, topology::stranded_consumer()).await?;
            }
        }
        if self.tasks.iter().any(|t| !t.stores.borrow().is_empty()) {
            // The changelog: a restore needs every record of it, so a limit that would
            // expire or drop some (an operator's max age) is refused, not kept.
            let state = topology::bucket(&subjects, crate::store::STATE, None).keeping_all();
            broker.ensure_kv(state.with_replicas(r)).await?;
        }
        for (name, kind) in &self.outputs {
            let name = StreamName::new(*name)?;
            let spec = match kind {
                StreamKind::Ordered { partitions } => topology::ordered_stream(&subjects, &name, *partitions, None),
                StreamKind::Queue => topology::queue_stream(&subjects, &name),
            };
            broker.ensure_stream(spec.with_replicas(r)).await?;
        }
        for t in &self.tasks {
            let name = StreamName::new(t.stream)?;
            let c = &t.config;
            match t.kind {
                StreamKind::Ordered { partitions } => {
                    topology::provision_ordered(&broker, &subjects, &name, partitions, c.ack_wait, c.window, r).await?;
                }
                StreamKind::Queue => {
                    topology::provision_queue(
                        &broker,
                        &subjects,
                        &name,
                        c.ack_wait,
                        c.retry.max_attempts + 1 + crate::task_worker::RELEASE_ALLOWANCE,
                        10_000,
                        r,
                    )
                    .await?;
                }
            }
        }
        Ok(())
    }

    /// Provisions (see [`provision`](Self::provision)) and starts the job's actors on the
    /// current arbiter, consuming every partition (single node).
    ///
    /// # Errors
    /// [`JobError`] for bad names or settings, or when the broker refuses (for example a
    /// stream that exists with another configuration).
    pub async fn start(self, broker: SharedBroker) -> Result<RunningJob, JobError> {
        self.provision(broker.clone()).await?;
        let subjects = Subjects::new(JobName::new(self.name.clone())?);
        let mut slots = Vec::new();
        let run_id = self.run_id.clone().unwrap_or_else(|| MessageId::new_v7().to_string());
        let env =
            Rc::new(TaskEnv::new(broker.clone(), self.codec, subjects.clone(), run_id).with_replicas(self.replicas));
        for t in &self.tasks {
            let name = StreamName::new(t.stream)?;
            // One copy per input, shared by its slots and their workers.
            let js_stream: Rc<str> = subjects.stream_name(&name).into();
            let c = &t.config;
            match t.kind {
                StreamKind::Ordered { partitions } => {
                    for p in 0..partitions {
                        // This node owns every partition: take over what a dead
                        // previous owner left unacked, at the committed position.
                        let spec = partition_spec(&subjects, t, &name, p);
                        let resumed = topology::take_over_partition(&broker, &js_stream, spec.clone()).await?;
                        let mut s = slot(
                            t,
                            &env,
                            Some(p),
                            slots.len(),
                            js_stream.clone(),
                            Subjects::partition_consumer(&name, p).into(),
                            c.window as usize,
                            None,
                        );
                        // A restarted task resumes at the committed position.
                        s.takeover = Some(spec);
                        s.start = Some((&resumed).into());
                        slots.push(s);
                    }
                }
                StreamKind::Queue => {
                    slots.push(slot(
                        t,
                        &env,
                        None,
                        slots.len(),
                        js_stream.clone(),
                        Subjects::queue_consumer(&name).into(),
                        c.max_concurrency,
                        None,
                    ));
                }
            }
        }
        let (timers, reaper) = node_services(&broker, &subjects);
        let (tx, rx) = oneshot::channel();
        let container_config = self.stopping_config();
        let stop_deadline = container_config.stop_timeout;
        let container = Container::new(broker, subjects, container_config, slots, timers, reaper, tx).start();
        Ok(RunningJob::alone(container, JobExit { exit: rx, stop_deadline }, env.run_id.clone()))
    }

    /// The container's settings, its stop bounded by the tasks' drain timeouts: a worker
    /// hands back what is still in flight at its drain timeout and takes at most
    /// [`FINISH_BUDGET`](crate::task_worker::FINISH_BUDGET) more to report, so a stop
    /// that takes longer than both has something stuck (the broker unreachable), and the
    /// container exits saying what it left.
    fn stopping_config(&self) -> ContainerConfig {
        let drain = self.tasks.iter().map(|t| t.config.drain_timeout).max().unwrap_or_default();
        let bound = drain + crate::task_worker::FINISH_BUDGET + Duration::from_secs(1);
        ContainerConfig { stop_timeout: self.container.stop_timeout.min(bound), ..self.container.clone() }
    }
}

/// The node's timer service (promoting the job's delayed messages) and reaper.
fn node_services(broker: &SharedBroker, subjects: &Subjects) -> (Addr<TimerService>, Addr<Reaper>) {
    let timers = TimerService::with_promotion(Promotion {
        broker: broker.clone(),
        js_stream: subjects.timer_stream_name(),
        consumer: topology::timer_consumer().name,
        subjects: subjects.clone(),
    })
    .start();
    (timers, Reaper::new(broker.clone(), subjects.clone()).start())
}

/// The consumer of partition `p` of `t`'s input, as provisioned.
fn partition_spec(subjects: &Subjects, t: &TaskEntry, name: &StreamName, p: u32) -> ConsumerSpec {
    topology::partition_consumer(subjects, name, p, t.config.ack_wait, t.config.window)
}

#[allow(clippy::too_many_arguments)]
fn slot(
    t: &TaskEntry,
    env: &Rc<TaskEnv>,
    partition: Option<u32>,
    index: usize,
    js_stream: Rc<str>,
    consumer: Rc<str>,
    capacity: usize,
    lease: Option<(u64, Fence)>,
) -> SlotSpec {
    let starter = t.starter.clone();
    let env = env.clone();
    let settings = t.settings();
    let (epoch, fence) = match lease {
        Some((epoch, fence)) => (epoch, Some(fence)),
        None => (0, None),
    };
    let binding = Binding {
        stream: t.stream,
        kind: t.kind,
        type_name: t.type_name,
        partition,
        slot: index,
        epoch,
        fence: fence.clone(),
        start: None,
    };
    SlotSpec {
        stream: t.stream.to_owned(),
        partition,
        js_stream,
        consumer,
        capacity: capacity.max(1),
        policy: t.config.failure_policy,
        sweep: matches!(t.kind, StreamKind::Queue),
        takeover: None,
        start: None,
        epoch,
        fence,
        paused: false,
        spawn: Box::new(move |sc| {
            let binding = Binding { slot: sc.slot, start: sc.start.clone(), ..binding.clone() };
            starter(env.clone(), binding, settings.clone(), sc)
        }),
    }
}
