//! One attempt at a message: check the task out, run `process`, and route what it
//! returned (done, failed, unavailable, restore).

use super::*;

impl<T: Task> TaskWorker<T> {
    /// Starts (or retries) processing of the message at `order`.
    pub(super) fn start_attempt(&mut self, order: u64, ctx: &mut Context<Self>) {
        let at = now();
        if !self.part.handle(ev::Started(order), at) {
            return;
        }
        let Some(d) = self.part.held(order).map(|h| &h.msg.delivery) else { return };
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
                self.part.handle(ev::Poison { order, reason, detail }, now());
                return;
            }
        };
        self.part.handle(ev::Running(order), at);
        let Some((msg, attempt)) = self.part.msg_mut(order) else { return };
        let d = &msg.delivery;
        let span = tracing::debug_span!(
            "process",
            stream = self.binding.stream,
            partition = self.binding.partition,
            seq = d.info.stream_seq,
            attempt,
            trace_id = tracing::field::Empty,
            span_id = tracing::field::Empty,
            parent_id = tracing::field::Empty,
        );
        // Nothing collects the span (the default): no ids, and the context passes the
        // input's traceparent on as it is, without this lookup.
        msg.trace = if span.is_disabled() {
            None
        } else {
            crate::trace::message_context(&span, d.headers.get(headers::TRACEPARENT)).map(Box::new)
        };
        let trace = msg.trace.as_deref().copied();
        let d = &msg.delivery;
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
            attempt,
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
    pub(super) fn processed(&mut self, order: u64, (task, mut tctx, result): Processed<T>, ctx: &mut Context<Self>) {
        self.task = Some(task);
        let now = now();
        if let Some(started) = self.part.held(order).and_then(|h| h.started) {
            let took = now.saturating_duration_since(started);
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
        if ok {
            self.part.handle(ev::ReturnedOk(order), now);
        }
        match result {
            Ok(Ok(())) => {
                let deferred = tctx.deferred.take();
                let outputs = tctx.into_outputs();
                self.after_process(order, deferred, outputs, now, ctx);
            }
            Ok(Err(error)) => self.callback_failed(order, Ok(error), ctx),
            Err(panic) => self.callback_failed(order, Err(panic), ctx),
        }
    }

    /// What a failed callback of the message at `order` (its `process`, or the work it
    /// deferred) leads to: a counted attempt, the task's failure, a retry in place, or
    /// the dead-letter stream.
    fn callback_failed(&mut self, order: u64, failure: Result<TaskError, Panic>, ctx: &mut Context<Self>) {
        match failure {
            Ok(TaskError::Failed(reason)) => self.failed_attempt(order, reason),
            Ok(TaskError::Fatal(reason)) => {
                self.suspect_ended_owner(order);
                self.fail(format!("process: {reason}"), ctx)
            }
            Ok(TaskError::Unavailable(reason)) => self.retry_unavailable(order, reason),
            Ok(TaskError::Permanent { reason, detail }) => {
                self.part.handle(ev::Poison { order, reason, detail }, now());
            }
            Err(panic) => self.failed_attempt(order, format!("handler panicked: {}", panic_text(&panic))),
        }
    }

    /// Something was unreachable: try the message again after a back-off, in place,
    /// without counting an attempt (up to the ceiling, past which it is a failed attempt).
    pub(super) fn retry_unavailable(&mut self, order: u64, reason: String) {
        let Some(seq) = self.part.held(order).map(|h| h.msg.delivery.info.stream_seq) else { return };
        let unavailable = ev::Unavailable { order, reason: &reason, sample: crate::retry::sample() };
        match self.part.handle(unavailable, now()) {
            Some(delay) => {
                warn!(stream = self.binding.stream, partition = self.binding.partition, seq, ?delay, %reason, "unavailable; retrying without counting an attempt");
            }
            None => self.metrics.failed_attempts.increment(1),
        }
    }

    pub(super) fn after_process(
        &mut self,
        order: u64,
        deferred: Option<LocalBoxFuture<'static, Result<(), TaskError>>>,
        outputs: Outputs,
        now: std::time::Instant,
        ctx: &mut Context<Self>,
    ) {
        match deferred {
            None => {
                self.part.handle(ev::CallbacksDone(order), now);
                self.await_effects(order, outputs, now, ctx);
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
                            let now = super::now();
                            act.part.handle(ev::CallbacksDone(order), now);
                            act.await_effects(order, outputs, now, ctx);
                        }
                        Ok(Err(error)) => act.callback_failed(order, Ok(error), ctx),
                        Err(panic) => act.callback_failed(order, Err(panic), ctx),
                    }
                    act.drive(ctx);
                }));
            }
        }
    }

    /// Publishes the message's outputs; it finishes once they are stored.
    pub(super) fn await_effects(
        &mut self,
        order: u64,
        outputs: Outputs,
        now: std::time::Instant,
        ctx: &mut Context<Self>,
    ) {
        let msgs = outputs.take_buffer();
        if msgs.is_empty() {
            // Nothing to publish (most messages of most tasks): no batch to build.
            self.flushed(FlushTarget::Message(order), now, ctx);
            return;
        }
        self.flush(Flush { target: FlushTarget::Message(order), msgs: msgs.into(), attempt: 0 }, ctx);
    }
}
