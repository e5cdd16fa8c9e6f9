//! The [`TaskContext`]: a task's window on the runtime during one callback.

use super::*;

/// Coordinator requests a task made during one callback.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Requests {
    pub commit: bool,
    pub shutdown: Option<ShutdownScope>,
}

/// The task's window on the runtime during one callback.
pub struct TaskContext {
    outputs: Outputs,
    meta: Option<MessageMeta>,
    partition: Option<u32>,
    pub(crate) requests: Requests,
    pub(crate) deferred: Option<LocalBoxFuture<'static, Result<(), TaskError>>>,
    pub(crate) timers: Vec<(String, Duration)>,
    /// The partition's stores (tasks that declared some).
    pub(crate) stores: Option<Rc<RefCell<crate::store::StoreSet>>>,
    /// The task's input stream.
    input: Option<&'static str>,
}

impl std::fmt::Debug for TaskContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskContext")
            .field("meta", &self.meta)
            .field("partition", &self.partition)
            .finish_non_exhaustive()
    }
}

impl TaskContext {
    pub(crate) fn new(env: Rc<TaskEnv>, partition: Option<u32>, epoch: u64, meta: Option<MessageMeta>) -> Self {
        let cause = meta.as_ref().map(|m| m.id.clone());
        let traceparent = meta.as_ref().and_then(|m| m.headers.get(headers::TRACEPARENT).map(std::sync::Arc::from));
        Self {
            outputs: Outputs { env, cause, traceparent, epoch, shared: std::cell::OnceCell::new() },
            meta,
            partition,
            requests: Requests::default(),
            deferred: None,
            timers: Vec::new(),
            stores: None,
            input: None,
        }
    }

    /// The same context, its outputs carrying `traceparent` (the span that made them).
    pub(crate) fn with_traceparent(mut self, traceparent: String) -> Self {
        self.outputs.traceparent = Some(std::sync::Arc::from(traceparent));
        self
    }

    /// The same context for a task of `input`.
    pub(crate) fn with_input(mut self, input: &'static str) -> Self {
        self.input = Some(input);
        self
    }

    /// The same context whose outputs derive their ids from `cause` (hooks of ordered
    /// partitions: see the worker's `hook_cause`).
    pub(crate) fn with_cause(mut self, cause: MessageId) -> Self {
        self.outputs.cause = Some(cause);
        self
    }

    /// The same context with the partition's stores.
    pub(crate) fn with_stores(mut self, stores: Option<Rc<RefCell<crate::store::StoreSet>>>) -> Self {
        self.stores = stores;
        self
    }

    /// The task's store `def` (declared on the job with [`Job::store`](crate::Job::store)).
    /// Reads and writes hit memory; a callback's writes are undone when it fails, and
    /// are written to the changelog with the next commit, before the inputs they
    /// reflect are acknowledged. After a move or a crash the partition's next owner
    /// restores them before it processes anything.
    ///
    /// # Errors
    /// [`TaskError::Fatal`] when the store is not declared for this task, or declared
    /// with other types.
    pub fn store<K: crate::store::StoreKey, V: crate::store::StoreValue>(
        &self,
        def: &crate::store::StoreDef<K, V>,
    ) -> Result<crate::store::Store<'_, K, V>, TaskError> {
        match &self.stores {
            Some(set) => crate::store::Store::open(set, def),
            None => Err(TaskError::fatal(format!(
                "store {:?} is not declared for this task: add .store(..) after its .task(...) on the job (stores need an ordered input)",
                def.name()
            ))),
        }
    }

    /// The message being processed (`None` in `window`, `commit`, `timer`, …).
    pub fn message(&self) -> Option<&MessageMeta> {
        self.meta.as_ref()
    }

    /// The task's partition (ordered inputs).
    pub fn partition(&self) -> Option<u32> {
        self.partition
    }

    /// The fencing epoch stamped on outputs (the partition lease's revision; 0 without leases).
    pub fn epoch(&self) -> u64 {
        self.outputs.epoch
    }

    /// The job's current run id.
    pub fn run_id(&self) -> &str {
        &self.outputs.env.run_id
    }

    /// Sends an output; see [`Outputs::send`].
    ///
    /// # Errors
    /// As [`Outputs::send`].
    pub async fn send<T: Serialize>(
        &mut self,
        stream: &StreamDef<T>,
        key: &str,
        value: impl std::borrow::Borrow<T>,
    ) -> Result<(), TaskError> {
        self.outputs.send(stream, key, value).await
    }

    /// Sends an output that arrives after `delay`, durably; see [`Outputs::send_after`].
    ///
    /// # Errors
    /// As [`Outputs::send`].
    pub async fn send_after<T: Serialize>(
        &mut self,
        stream: &StreamDef<T>,
        key: &str,
        value: impl std::borrow::Borrow<T>,
        delay: Duration,
    ) -> Result<(), TaskError> {
        self.outputs.send_after(stream, key, value, delay).await
    }

    /// A handle that sends outputs of this message from a deferred future.
    pub fn outputs(&self) -> Outputs {
        self.outputs.clone()
    }

    /// Finishes this message with `fut`, which runs after `process` returns; the task
    /// can process the next message meanwhile (up to `max_concurrency`).
    pub fn defer(&mut self, fut: impl Future<Output = Result<(), TaskError>> + 'static) {
        self.deferred = Some(Box::pin(fut));
    }

    /// Asks for a commit as soon as possible.
    pub fn commit(&mut self) {
        self.requests.commit = true;
    }

    /// Asks to shut down this task or the whole container.
    pub fn shutdown(&mut self, scope: ShutdownScope) {
        self.requests.shutdown = Some(scope);
    }

    /// Calls this task's `timer` hook with `name` after `after`. In memory: such a timer
    /// does not survive the node; for work that must happen later whatever happens, use
    /// [`send_after`](Self::send_after).
    ///
    /// # Errors
    /// [`TaskError::Failed`] for a delay over [`MAX_DELAY`](crate::timer_service::MAX_DELAY).
    pub fn schedule(&mut self, name: impl Into<String>, after: Duration) -> Result<(), TaskError> {
        let name = name.into();
        check_delay(after, &format!("timer {name:?}"))?;
        self.timers.push((name, after));
        Ok(())
    }

    /// Arms the durable timer `name`: after `after`, the task's `timer` hook runs with
    /// `name` on whichever node owns the partition then, in order with its messages
    /// (the timer arrives as a message at the end of the partition). It is armed with
    /// this callback's outputs (only if the callback succeeds) and survives node and
    /// broker restarts. Arming a timer of the same name again replaces it. A timer
    /// that comes due late (the job was down) fires once ([`Misfire::FireLate`]); see
    /// [`schedule_durable_with`](Self::schedule_durable_with).
    ///
    /// # Errors
    /// [`TaskError::Failed`] for a delay over 365 days or a name that cannot travel in
    /// a header.
    pub fn schedule_durable(&mut self, name: &str, after: Duration) -> Result<(), TaskError> {
        self.schedule_durable_with(name, after, Misfire::FireLate)
    }

    /// As [`schedule_durable`](Self::schedule_durable), with a misfire policy.
    ///
    /// # Errors
    /// As [`schedule_durable`](Self::schedule_durable).
    pub fn schedule_durable_with(&mut self, name: &str, after: Duration, misfire: Misfire) -> Result<(), TaskError> {
        let input = self.input_name()?;
        self.outputs.arm_timer((input, self.partition, self.position()), name, after, misfire)
    }

    /// Cancels the durable timer `name` (with this callback's outputs). Cancelling a
    /// timer that is not armed, or already fired, does nothing.
    ///
    /// # Errors
    /// A name that cannot travel in a header.
    pub fn cancel_timer(&mut self, name: &str) -> Result<(), TaskError> {
        let input = self.input_name()?;
        self.outputs.cancel_timer((input, self.partition, self.position()), name)
    }

    fn input_name(&self) -> Result<&'static str, TaskError> {
        self.input.ok_or_else(|| TaskError::fatal("durable timers need a task's context (this one has no input)"))
    }

    /// The stream sequence of the message being processed.
    fn position(&self) -> Option<u64> {
        self.meta.as_ref().map(|m| m.stream_seq)
    }

    /// The task's input stream.
    pub(crate) fn input_stream(&self) -> Option<&'static str> {
        self.input
    }

    /// The environment.
    pub(crate) fn env(&self) -> &TaskEnv {
        &self.outputs.env
    }

    /// Runs blocking work on the blocking pool, off the actor thread.
    ///
    /// # Errors
    /// [`TaskError::Failed`] when the closure panicked.
    pub async fn spawn_blocking<R: Send + 'static>(
        &self,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> Result<R, TaskError> {
        // Supervised on the blocking thread too: a panic there is this task's failure,
        // not the node's (see `supervise`).
        match tokio::task::spawn_blocking(move || crate::supervise::supervised(f)).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(panic)) => {
                Err(TaskError::failed(format!("blocking work panicked: {}", crate::supervise::panic_text(&panic))))
            }
            Err(e) => Err(TaskError::failed(format!("blocking work failed: {e}"))),
        }
    }

    pub(crate) fn outputs_handle(&self) -> &Outputs {
        &self.outputs
    }

    /// The outputs handle, for what remains of the callback once it returned.
    pub(crate) fn into_outputs(self) -> Outputs {
        self.outputs
    }

    /// Decodes a message for `T`, checking its type header. Used by the worker.
    pub(crate) fn decode<T: DeserializeOwned>(
        codec: &Codec,
        headers: &Headers,
        type_name: &str,
        payload: &[u8],
    ) -> Result<T, flotilla_transport::wire::CodecError> {
        codec.decode_message(headers, type_name, payload)
    }
}
