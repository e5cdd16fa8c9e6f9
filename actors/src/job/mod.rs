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

use crate::cluster::{
    self, ClusterConfig, DrainedRecord, Fence, InputRecord, NodeRecord, RequestRecord, RunRecord, TopologyRecord, keys,
    now_ms,
};
use crate::config::{ConfigError, FailurePolicy, TaskConfig};
use crate::container::{Container, ContainerConfig, ContainerExit, SlotContext, SlotSpec, StopContainer, WorkerHandle};
use crate::membership::{Buckets, ControlMessage, Deregister, Leave, LeaveReason, Membership, MembershipSetup};
use crate::reaper::Reaper;
use crate::retry::RetryPolicy;
use crate::stream::{StreamDef, StreamKind, StreamType};
use crate::task::{Task, TaskEnv};
use crate::task_worker::{Binding, TaskWorker};
use crate::timer_service::{Promotion, TimerService};
use actix::prelude::*;
use flotilla_transport::broker::{BrokerError, ConsumerSpec, SharedBroker};
use flotilla_transport::topology;
use flotilla_transport::wire::{Codec, JobName, MessageId, NameError, StreamName, Subjects};
use std::rc::Rc;
use std::time::Duration;
use tokio::sync::oneshot;
use tracing::{info, warn};

/// The most replicas a JetStream stream can have.
pub const MAX_REPLICAS: usize = 5;

/// How long a starting node keeps retrying what fails for a passing reason (the
/// broker unreachable, slow, or electing a leader, as a replicated stream or bucket
/// does while it is created or a server restarts) before it gives up.
const STARTUP_PATIENCE: Duration = Duration::from_secs(30);

/// Runs `op` until it succeeds, fails for good, or transient errors have lasted
/// [`STARTUP_PATIENCE`]; jittered backoff between tries.
async fn patiently<T, Fut>(what: &str, mut op: impl FnMut() -> Fut) -> Result<T, JobError>
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

type Starter = Rc<dyn Fn(Rc<TaskEnv>, Binding, TaskConfig, SlotContext) -> WorkerHandle>;

struct TaskEntry {
    stream: &'static str,
    /// The task's stores, made anew for each of its workers.
    stores: Rc<std::cell::RefCell<Vec<crate::store::StoreMaker>>>,
    kind: StreamKind,
    type_name: &'static str,
    config: TaskConfig,
    starter: Starter,
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
        let starter: Starter = Rc::new(move |env: Rc<TaskEnv>, binding, config, sc: SlotContext| {
            let task = factory(binding.partition);
            let set = crate::store::StoreSet::new(&makers.borrow(), env.codec)
                .with_max_payload(env.broker.server().max_payload);
            let worker = TaskWorker::new(task, env, binding, config, sc.container, sc.timers, sc.reaper)
                .with_stores(set)
                .start();
            WorkerHandle {
                deliver: worker.clone().recipient(),
                stop: worker.clone().recipient(),
                control: worker.recipient(),
            }
        });
        self.tasks.push(TaskEntry {
            stream: input.name(),
            stores,
            kind: input.kind(),
            type_name: input.type_name(),
            config: self.defaults.clone(),
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
            let js_stream = subjects.stream_name(&name);
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
                            Subjects::partition_consumer(&name, p),
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
                        Subjects::queue_consumer(&name),
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
        Ok(RunningJob { container, exit: rx, run_id: env.run_id.clone(), membership: None, stop_deadline })
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

    /// Provisions and starts the job as one node of a cluster (DESIGN §7): registers
    /// `node` in the NODES bucket (refusing a node id that is alive), joins the
    /// cluster's run, consumes the queue inputs at once and the ordered partitions whose
    /// leases it acquires, and follows the desired state and control requests.
    ///
    /// # Errors
    /// [`JobError::NodeIdTaken`] when another live node has this id, and whatever
    /// [`start`](Self::start) refuses.
    pub async fn start_node(
        self,
        broker: SharedBroker,
        node: &str,
        config: ClusterConfig,
    ) -> Result<RunningJob, JobError> {
        if node.is_empty() || !node.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            return Err(JobError::NodeIdInvalid(node.to_owned()));
        }
        self.provision(broker.clone()).await?;
        // A claim sent just before a partition's fence closes must end on the server
        // before the lease can expire (at a third of the TTL after the fence), or it
        // could take messages from the next owner's consumer.
        let mut this = self;
        this.container.claim_wait = this.container.claim_wait.min(config.lease_ttl / 4);
        // A released partition is handed over only once its claim is back: idle
        // partitions must not wait longer than busy ones.
        this.container.idle_claim_wait = this.container.claim_wait;
        let subjects = Subjects::new(JobName::new(this.name.clone())?);
        let b = Buckets::new(&subjects);
        for (bucket, ttl) in [(cluster::NODES, config.node_ttl), (cluster::LEASES, config.lease_ttl)] {
            let spec = topology::bucket(&subjects, bucket, Some(ttl)).with_replicas(this.replicas);
            match patiently("create the cluster's buckets", || async { Ok(broker.ensure_kv(spec.clone()).await?) })
                .await
            {
                Ok(()) => {}
                Err(JobError::Broker(BrokerError::ConfigMismatch { field, existing, .. })) if field == "max_age" => {
                    return Err(JobError::Misconfigured {
                        job: this.name.clone(),
                        problem: format!(
                            "the cluster runs with a lease TTL of {} (bucket KV_{}), this node asks for {ttl:?}: every node of a job must use the same TTL. Start it with --lease-ttl matching the others, or stop every node and delete the buckets KV_{} and KV_{} to change it",
                            existing.trim_start_matches("Some(").trim_end_matches(')'),
                            subjects.bucket_name(bucket),
                            subjects.bucket_name(cluster::NODES),
                            subjects.bucket_name(cluster::LEASES),
                        ),
                    });
                }
                Err(e) => return Err(e),
            }
        }
        let control = topology::bucket(&subjects, cluster::CONTROL, None).with_replicas(this.replicas);
        patiently("create the cluster's buckets", || async { Ok(broker.ensure_kv(control.clone()).await?) }).await?;

        let record = NodeRecord {
            node: node.to_owned(),
            pid: std::process::id(),
            host: host_name(),
            started_ms: now_ms(),
            incarnation: MessageId::new_v7().to_string(),
        };
        let incarnation = record.incarnation.clone();
        let node_value = bytes::Bytes::from(serde_json::to_vec(&record).unwrap_or_default());
        let register = || async {
            match broker.kv_create(&b.nodes, node, node_value.clone()).await {
                // A create whose reply was lost may have been stored: ours, if it
                // holds this incarnation.
                Err(BrokerError::KvKeyExists { .. }) => match broker.kv_get(&b.nodes, node).await? {
                    Some(entry) if entry.value == node_value => Ok(entry.revision),
                    _ => Err(BrokerError::KvKeyExists { bucket: b.nodes.clone(), key: node.to_owned() }.into()),
                },
                other => Ok(other?),
            }
        };
        let node_revision = match patiently("register the node", register).await {
            Ok(rev) => rev,
            Err(JobError::Broker(BrokerError::KvKeyExists { .. })) => {
                // Restart in place: the id is this node's again if its holder is gone.
                let beat = config.lease_ttl.min(config.node_ttl) / 4;
                match take_over_node_id(&broker, &b.nodes, &record, node_value.clone(), beat).await? {
                    Ok(rev) => rev,
                    Err(holder) => {
                        return Err(JobError::NodeIdTaken {
                            job: this.name.clone(),
                            node: node.to_owned(),
                            holder,
                            ttl: config.node_ttl,
                        });
                    }
                }
            }
            Err(e) => return Err(e),
        };
        match this.join(broker.clone(), &subjects, &b, (node, incarnation), node_value, node_revision, config).await {
            Ok(running) => Ok(running),
            Err(e) => {
                // Do not block a restart with this id for a whole TTL.
                let _ = broker.kv_delete(&b.nodes, node, Some(node_revision)).await;
                Err(e)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn join(
        self,
        broker: SharedBroker,
        subjects: &Subjects,
        b: &Buckets,
        (node, incarnation): (&str, String),
        node_value: bytes::Bytes,
        node_revision: u64,
        config: ClusterConfig,
    ) -> Result<RunningJob, JobError> {
        let topology = TopologyRecord {
            inputs: self
                .tasks
                .iter()
                .map(|t| InputRecord {
                    stream: t.stream.to_owned(),
                    partitions: match t.kind {
                        StreamKind::Ordered { partitions } => Some(partitions),
                        StreamKind::Queue => None,
                    },
                })
                .collect(),
        };
        let read_control_state = || async {
            let run_id = current_run(&broker, b, &topology, self.run_id.clone()).await?;
            broker.kv_put(&b.control, keys::TOPOLOGY, json(&topology)).await?;
            // A stop request for an earlier process with this id is not for this one.
            if broker.kv_get(&b.control, &keys::stop(node)).await?.is_some() {
                broker.kv_delete(&b.control, &keys::stop(node), None).await?;
            }
            let shutdown_seen = broker.kv_get(&b.control, keys::SHUTDOWN).await?.map_or(0, |e| e.revision);
            let paused: cluster::PauseRecord = match broker.kv_get(&b.control, keys::PAUSED).await? {
                Some(e) => serde_json::from_slice(&e.value).unwrap_or_default(),
                None => cluster::PauseRecord::default(),
            };
            Ok((run_id, shutdown_seen, paused))
        };
        let (run_id, shutdown_seen, paused) = patiently("read the cluster's desired state", read_control_state).await?;

        let env = Rc::new(
            TaskEnv::new(broker.clone(), self.codec, subjects.clone(), run_id.clone()).with_replicas(self.replicas),
        );
        let mut slots = Vec::new();
        let mut queue_slots = Vec::new();
        let mut ordered = Vec::new();
        let container_config = self.stopping_config();
        let tasks: Rc<Vec<TaskEntry>> = Rc::new(self.tasks);
        for t in tasks.iter() {
            let name = StreamName::new(t.stream)?;
            match t.kind {
                StreamKind::Ordered { partitions } => ordered.push((t.stream.to_owned(), partitions)),
                StreamKind::Queue => {
                    queue_slots.push((slots.len(), t.stream.to_owned()));
                    let mut spec = slot(
                        t,
                        &env,
                        None,
                        slots.len(),
                        subjects.stream_name(&name),
                        Subjects::queue_consumer(&name),
                        t.config.max_concurrency,
                        None,
                    );
                    spec.paused = paused.covers(t.stream, None);
                    slots.push(spec);
                }
            }
        }
        let factory_env = env.clone();
        let factory_subjects = subjects.clone();
        let factory_tasks = tasks.clone();
        let factory: crate::container::PartitionFactory = Rc::new(move |stream, p, epoch, fence, paused| {
            let t = factory_tasks.iter().find(|t| t.stream == stream)?;
            let name = StreamName::new(t.stream).ok()?;
            let c = &t.config;
            let mut spec = slot(
                t,
                &factory_env,
                Some(p),
                0,
                factory_subjects.stream_name(&name),
                Subjects::partition_consumer(&name, p),
                c.window as usize,
                Some((epoch, fence)),
            );
            spec.takeover = Some(partition_spec(&factory_subjects, t, &name, p));
            spec.paused = paused;
            Some(spec)
        });
        let takeover_subjects = subjects.clone();
        let takeover: crate::membership::TakeoverSpec = Rc::new(move |stream, p| {
            let t = tasks.iter().find(|t| t.stream == stream)?;
            let name = StreamName::new(t.stream).ok()?;
            Some((takeover_subjects.stream_name(&name), partition_spec(&takeover_subjects, t, &name, p)))
        });

        // Control requests reach the membership actor as messages; the subscriptions
        // live in its context, so they end when it stops.
        let mut control = Vec::new();
        for pattern in [subjects.control("all.*"), subjects.control(&format!("node.{node}.*"))] {
            control.push(broker.subscribe(&pattern, None).await?);
        }
        let (timers, reaper) = node_services(&broker, subjects);
        let (tx, rx) = oneshot::channel();
        let mut membership_ctx = Context::<Membership>::new();
        for requests in control {
            use futures::StreamExt;
            membership_ctx.add_message_stream(requests.map(ControlMessage));
        }
        let membership = membership_ctx.address();
        let stop_deadline = container_config.stop_timeout;
        let container = Container::new(
            broker.clone(),
            subjects.clone(),
            container_config,
            slots,
            timers.clone(),
            reaper.clone(),
            tx,
        )
        .observed_by(membership.clone().recipient(), factory)
        .start();
        let (left, _) = tokio::sync::watch::channel(None);
        membership_ctx.run(Membership::new(MembershipSetup {
            broker: broker.clone(),
            subjects: subjects.clone(),
            node: node.to_owned(),
            incarnation,
            node_revision,
            node_value,
            run_id: run_id.clone(),
            config,
            ordered,
            queue_slots,
            takeover,
            container: container.clone(),
            timers,
            reaper,
            shutdown_seen,
            left: left.clone(),
            parked: env.parked.clone(),
        }));
        Ok(RunningJob { container, exit: rx, run_id, membership: Some((membership, left)), stop_deadline })
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

fn json<T: serde::Serialize>(value: &T) -> bytes::Bytes {
    bytes::Bytes::from(serde_json::to_vec(value).unwrap_or_default())
}

/// Takes over the node id `record.node` whose registration exists: at once when its
/// holder is provably gone (same host, process gone), else after watching it for two
/// heartbeats and a half without a renewal. Returns the new revision of the
/// registration, or who holds it (`Err`) when the holder is alive.
///
/// # Errors
/// Whatever the broker returns.
async fn take_over_node_id(
    broker: &SharedBroker,
    bucket: &str,
    record: &NodeRecord,
    value: bytes::Bytes,
    beat: Duration,
) -> Result<Result<u64, String>, BrokerError> {
    let node = record.node.as_str();
    let Some(found) = broker.kv_get(bucket, node).await? else {
        // It expired meanwhile.
        return Ok(broker
            .kv_create(bucket, node, value)
            .await
            .map_err(|_| "a node registering at the same moment".to_owned()));
    };
    let previous = serde_json::from_slice::<NodeRecord>(&found.value).ok();
    let holder = previous
        .as_ref()
        .map_or_else(|| "an entry this version cannot read".to_owned(), |r| format!("pid {} on {}", r.pid, r.host));
    let gone = previous.as_ref().is_some_and(|r| r.provably_gone(&record.host, record.pid, process_alive));
    if !gone {
        // Maybe alive (another host, or a live pid): a live node renews every beat.
        info!(%node, %holder, wait = ?beat.mul_f64(2.5), "node id registered by another process: waiting to see whether it is alive");
        tokio::time::sleep(beat.mul_f64(2.5)).await;
        match broker.kv_get(bucket, node).await? {
            Some(now) if now.revision == found.revision => {}
            None => {
                return Ok(broker.kv_create(bucket, node, value).await.map_err(|_| holder));
            }
            Some(_) => return Ok(Err(holder)),
        }
    }
    match broker.kv_update(bucket, node, value, found.revision).await {
        Ok(revision) => {
            info!(%node, previous = %holder, "restart in place: took the node id over from its previous process, which is gone");
            Ok(Ok(revision))
        }
        Err(BrokerError::KvWrongRevision { .. }) => Ok(Err(holder)),
        Err(e) => Err(e),
    }
}

/// Whether process `pid` on this host is alive (not gone, not a zombie). Where that
/// cannot be told (no `/proc`), it counts as alive, and a restart waits to see whether
/// its registration is renewed.
fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses.
        Ok(stat) => stat.rsplit_once(')').is_none_or(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => !std::path::Path::new("/proc/self").exists(),
    }
}

fn host_name() -> String {
    std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_owned()).unwrap_or_else(|_| "unknown".into())
}

/// The cluster's current run: the one in the CONTROL bucket, unless it was drained to
/// the end (then a new one begins); created when there is none.
async fn current_run(
    broker: &SharedBroker,
    b: &Buckets,
    topology: &TopologyRecord,
    wanted: Option<String>,
) -> Result<String, JobError> {
    for _ in 0..5 {
        let fresh = RunRecord {
            run_id: wanted.clone().unwrap_or_else(|| MessageId::new_v7().to_string()),
            started_ms: now_ms(),
        };
        let Some(entry) = broker.kv_get(&b.control, keys::RUN).await? else {
            match broker.kv_create(&b.control, keys::RUN, json(&fresh)).await {
                Ok(_) => return Ok(fresh.run_id),
                Err(BrokerError::KvKeyExists { .. } | BrokerError::KvWrongRevision { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        let Ok(current) = serde_json::from_slice::<RunRecord>(&entry.value) else {
            broker.kv_update(&b.control, keys::RUN, json(&fresh), entry.revision).await?;
            return Ok(fresh.run_id);
        };
        if !run_drained(broker, b, topology, &current.run_id).await? {
            return Ok(current.run_id);
        }
        match broker.kv_update(&b.control, keys::RUN, json(&fresh), entry.revision).await {
            Ok(_) => {
                tracing::info!(previous = %current.run_id, run = %fresh.run_id, "the previous run was drained or ended: a new run begins");
                return Ok(fresh.run_id);
            }
            Err(BrokerError::KvWrongRevision { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(JobError::Misconfigured {
        job: String::new(),
        problem: "could not agree on the current run with the other nodes after 5 tries".into(),
    })
}

/// Whether `run` is over: every ordered partition reached its end of stream in it, or
/// a drain was requested for it and every ordered partition recorded its drain.
async fn run_drained(
    broker: &SharedBroker,
    b: &Buckets,
    topology: &TopologyRecord,
    run: &str,
) -> Result<bool, JobError> {
    let parts = topology.partitions();
    if parts.is_empty() {
        return Ok(false);
    }
    // Drained partitions count only when a drain of the run was asked.
    let drain_asked = match broker.kv_get(&b.control, keys::DRAIN).await? {
        Some(d) => serde_json::from_slice::<RequestRecord>(&d.value).is_ok_and(|d| d.run_id == run),
        None => false,
    };
    for (stream, p) in parts {
        let ended = match broker.kv_get(&b.control, &keys::ended(&stream, p)).await? {
            Some(e) => serde_json::from_slice::<crate::cluster::EndedRecord>(&e.value).is_ok_and(|r| r.run_id == run),
            None => false,
        };
        let drained = drain_asked
            && match broker.kv_get(&b.control, &keys::drained(&stream, p)).await? {
                Some(e) => serde_json::from_slice::<DrainedRecord>(&e.value).is_ok_and(|r| r.run_id == run),
                None => false,
            };
        if !ended && !drained {
            return Ok(false);
        }
    }
    Ok(true)
}

#[allow(clippy::too_many_arguments)]
fn slot(
    t: &TaskEntry,
    env: &Rc<TaskEnv>,
    partition: Option<u32>,
    index: usize,
    js_stream: String,
    consumer: String,
    capacity: usize,
    lease: Option<(u64, Fence)>,
) -> SlotSpec {
    let starter = t.starter.clone();
    let env = env.clone();
    let config = t.config.clone();
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
            starter(env.clone(), binding, config.clone(), sc)
        }),
    }
}

/// A started job.
#[derive(Debug)]
pub struct RunningJob {
    container: Addr<Container>,
    exit: oneshot::Receiver<ContainerExit>,
    run_id: String,
    /// Cluster mode: the node's membership, and why it left.
    membership: Option<(Addr<Membership>, tokio::sync::watch::Sender<Option<LeaveReason>>)>,
    /// How long a graceful stop may take before the container exits anyway.
    stop_deadline: Duration,
}

/// How long a node that stopped may take to delete its leases and membership before it
/// goes without (they expire on their own, after the lease TTL).
pub const DEREGISTER_BUDGET: Duration = Duration::from_secs(3);

impl RunningJob {
    /// The run id drain markers must carry.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Asks the job to stop gracefully (in a cluster: leave, handing partitions over).
    pub fn stop(&self) {
        self.stopper().stop();
    }

    /// A handle that can stop the job from elsewhere.
    pub fn stopper(&self) -> JobStopper {
        match &self.membership {
            Some((m, _)) => JobStopper(Stopper::Node(m.clone())),
            None => JobStopper(Stopper::Container(self.container.clone())),
        }
    }

    /// The longest a graceful stop takes, whatever the network does: the container's
    /// stop deadline and [`DEREGISTER_BUDGET`]. A process may exit once it passed.
    pub fn stop_deadline(&self) -> Duration {
        self.stop_deadline + DEREGISTER_BUDGET
    }

    /// Why the node left the cluster, once it does (cluster mode).
    pub fn left(&self) -> Option<tokio::sync::watch::Receiver<Option<LeaveReason>>> {
        self.membership.as_ref().map(|(_, tx)| tx.subscribe())
    }

    /// Waits until the job ends. In a cluster the node then deletes its leases and its
    /// membership, so other nodes take its partitions at once.
    ///
    /// # Errors
    /// [`JobError::Failed`] when a task failed the container, or the stop could not
    /// finish (workers still running at the stop deadline, or the leases not deleted
    /// within [`DEREGISTER_BUDGET`]): the message says what was left undone.
    pub async fn wait(self) -> Result<(), JobError> {
        let exit = self.exit.await;
        let mut undone = None;
        if let Some((m, _)) = &self.membership
            && tokio::time::timeout(DEREGISTER_BUDGET, m.send(Deregister)).await.is_err()
        {
            let what = "this node's leases and membership were not deleted (the broker did not answer within 3 s): its partitions move once their leases expire";
            warn!("{what}");
            undone = Some(what);
        }
        match (exit, undone) {
            (Ok(ContainerExit::Failed(reason)), _) => Err(JobError::Failed(reason)),
            (Err(_), _) => Err(JobError::Failed("the container stopped without reporting".into())),
            (Ok(ContainerExit::Completed), Some(what)) => {
                Err(JobError::Failed(format!("the stop did not finish: {what}")))
            }
            (Ok(ContainerExit::Completed), None) => Ok(()),
        }
    }
}

#[derive(Debug, Clone)]
enum Stopper {
    Container(Addr<Container>),
    Node(Addr<Membership>),
}

/// Stops a running job.
#[derive(Debug, Clone)]
pub struct JobStopper(Stopper);

impl JobStopper {
    /// Asks the job to stop gracefully.
    pub fn stop(&self) {
        match &self.0 {
            Stopper::Container(c) => c.do_send(StopContainer),
            Stopper::Node(m) => m.do_send(Leave(LeaveReason::Requested)),
        }
    }
}
