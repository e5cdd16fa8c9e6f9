//! The `Job` builder: declares a job's tasks and their settings, validates them,
//! provisions the streams and consumers, and starts the actors on the current arbiter.
//!
//! ```no_run
//! # use flotilla_actors::{Job, StreamDef, Task, TaskContext, TaskError};
//! # #[derive(serde::Deserialize)] struct Order;
//! # #[derive(Default)] struct Revenue;
//! # impl Task for Revenue { type Input = Order;
//! #   async fn process(&mut self, _: Order, _: &mut TaskContext) -> Result<(), TaskError> { Ok(()) } }
//! const ORDERS: StreamDef<Order> = StreamDef::ordered("orders", 8);
//! let job = Job::new("revenue")
//!     .task(ORDERS, |_partition| Revenue::default())
//!     .window_every(std::time::Duration::from_secs(10))
//!     .max_attempts(5);
//! ```

use crate::config::{ConfigError, FailurePolicy, TaskConfig};
use crate::container::{Container, ContainerConfig, ContainerExit, SlotContext, SlotSpec, StopContainer, WorkerHandle};
use crate::reaper::Reaper;
use crate::retry::RetryPolicy;
use crate::stream::{StreamDef, StreamKind};
use crate::task::{Task, TaskEnv};
use crate::task_worker::{Binding, TaskWorker};
use crate::timer_service::{Promotion, TimerService};
use actix::prelude::*;
use flotilla_transport::broker::{BrokerError, SharedBroker};
use flotilla_transport::topology;
use flotilla_transport::wire::{Codec, JobName, MessageId, NameError, StreamName, Subjects};
use std::rc::Rc;
use std::time::Duration;
use tokio::sync::oneshot;

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
}

type Starter = Rc<dyn Fn(Rc<TaskEnv>, Binding, TaskConfig, SlotContext) -> WorkerHandle>;

struct TaskEntry {
    stream: &'static str,
    kind: StreamKind,
    type_name: &'static str,
    config: TaskConfig,
    starter: Starter,
}

/// A job: its name and tasks. Settings apply to the task added last.
pub struct Job {
    name: String,
    tasks: Vec<TaskEntry>,
    outputs: Vec<(&'static str, StreamKind)>,
    run_id: Option<String>,
    codec: Codec,
    container: ContainerConfig,
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
            run_id: None,
            codec: Codec::default(),
            container: ContainerConfig::default(),
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
        let factory = Rc::new(factory);
        let starter: Starter = Rc::new(move |env, binding, config, sc: SlotContext| {
            let task = factory(binding.partition);
            let worker = TaskWorker::new(task, env, binding, config, sc.container, sc.timers, sc.reaper).start();
            WorkerHandle { deliver: worker.clone().recipient(), stop: worker.recipient() }
        });
        self.tasks.push(TaskEntry {
            stream: input.name(),
            kind: input.kind(),
            type_name: input.type_name(),
            config: TaskConfig::default(),
            starter,
        });
        self
    }

    /// Declares an output stream, so it is provisioned when the job starts (outputs are
    /// otherwise created on first send).
    pub fn output<T>(mut self, stream: StreamDef<T>) -> Self {
        self.outputs.push((stream.name(), stream.kind()));
        self
    }

    fn last(&mut self, setting: &str) -> Option<&mut TaskConfig> {
        if self.tasks.is_empty() {
            self.errors.push(format!("{setting} was set before any .task(...): settings apply to the task added last"));
        }
        self.tasks.last_mut().map(|t| &mut t.config)
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
        }
        Ok(())
    }

    /// Validates the job and creates what it needs on the broker: its dead-letter
    /// stream, declared outputs, and each input's stream and consumers. Idempotent;
    /// refuses (changing nothing) when something exists with another configuration.
    ///
    /// # Errors
    /// [`JobError`] for bad names or settings, or when the broker refuses.
    pub async fn provision(&self, broker: SharedBroker) -> Result<(), JobError> {
        self.validate()?;
        let subjects = Subjects::new(JobName::new(self.name.clone())?);
        broker.ensure_stream(topology::dlq_stream(&subjects)).await?;
        let timers = topology::timer_stream(&subjects);
        let timers_name = timers.name.clone();
        broker.ensure_stream(timers).await?;
        broker.ensure_consumer(&timers_name, topology::timer_consumer()).await?;
        for (name, kind) in &self.outputs {
            let name = StreamName::new(*name)?;
            let spec = match kind {
                StreamKind::Ordered { .. } => topology::ordered_stream(&subjects, &name, None),
                StreamKind::Queue => topology::queue_stream(&subjects, &name),
            };
            broker.ensure_stream(spec).await?;
        }
        for t in &self.tasks {
            let name = StreamName::new(t.stream)?;
            let c = &t.config;
            match t.kind {
                StreamKind::Ordered { partitions } => {
                    topology::provision_ordered(&broker, &subjects, &name, partitions, c.ack_wait, c.window).await?;
                }
                StreamKind::Queue => {
                    topology::provision_queue(&broker, &subjects, &name, c.ack_wait, c.retry.max_attempts + 1, 10_000)
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
        let env = Rc::new(TaskEnv::new(broker.clone(), self.codec, subjects.clone(), run_id));
        for t in &self.tasks {
            let name = StreamName::new(t.stream)?;
            let js_stream = subjects.stream_name(&name);
            let c = &t.config;
            match t.kind {
                StreamKind::Ordered { partitions } => {
                    for p in 0..partitions {
                        // This node owns every partition: take over what a dead
                        // previous owner left unacked, at the committed position.
                        let spec = topology::partition_consumer(&subjects, &name, p, c.ack_wait, c.window);
                        topology::take_over_partition(&broker, &js_stream, spec).await?;
                        slots.push(slot(
                            t,
                            &env,
                            Some(p),
                            slots.len(),
                            js_stream.clone(),
                            Subjects::partition_consumer(&name, p),
                            c.window as usize,
                        ));
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
                    ));
                }
            }
        }
        let timers = TimerService::with_promotion(Promotion {
            broker: broker.clone(),
            js_stream: subjects.timer_stream_name(),
            consumer: topology::timer_consumer().name,
        })
        .start();
        let reaper = Reaper::new(broker.clone(), subjects.clone()).start();
        let (tx, rx) = oneshot::channel();
        let container = Container::new(broker, subjects, self.container, slots, timers, reaper, tx).start();
        Ok(RunningJob { container, exit: rx, run_id: env.run_id.clone() })
    }
}

fn slot(
    t: &TaskEntry,
    env: &Rc<TaskEnv>,
    partition: Option<u32>,
    index: usize,
    js_stream: String,
    consumer: String,
    capacity: usize,
) -> SlotSpec {
    let starter = t.starter.clone();
    let env = env.clone();
    let config = t.config.clone();
    let binding = Binding { stream: t.stream, kind: t.kind, type_name: t.type_name, partition, slot: index, epoch: 0 };
    SlotSpec {
        stream: t.stream.to_owned(),
        partition,
        js_stream,
        consumer,
        capacity: capacity.max(1),
        policy: t.config.failure_policy,
        sweep: matches!(t.kind, StreamKind::Queue),
        takeover: None,
        spawn: Box::new(move |sc| {
            starter(env.clone(), Binding { slot: sc.slot, ..binding.clone() }, config.clone(), sc)
        }),
    }
}

/// A started job.
#[derive(Debug)]
pub struct RunningJob {
    container: Addr<Container>,
    exit: oneshot::Receiver<ContainerExit>,
    run_id: String,
}

impl RunningJob {
    /// The run id drain markers must carry.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Asks the job to stop gracefully.
    pub fn stop(&self) {
        self.container.do_send(StopContainer);
    }

    /// A handle that can stop the job from elsewhere.
    pub fn stopper(&self) -> JobStopper {
        JobStopper(self.container.clone())
    }

    /// Waits until the job ends.
    ///
    /// # Errors
    /// [`JobError::Failed`] when a task failed the container.
    pub async fn wait(self) -> Result<(), JobError> {
        match self.exit.await {
            Ok(ContainerExit::Completed) => Ok(()),
            Ok(ContainerExit::Failed(reason)) => Err(JobError::Failed(reason)),
            Err(_) => Err(JobError::Failed("the container stopped without reporting".into())),
        }
    }
}

/// Stops a running job.
#[derive(Debug, Clone)]
pub struct JobStopper(Addr<Container>);

impl JobStopper {
    /// Asks the job to stop gracefully.
    pub fn stop(&self) {
        self.0.do_send(StopContainer);
    }
}
