//! The task's hooks (`init`, `window`, timers, `shutdown`): their ids, their requests
//! and what runs after them.

use super::*;

impl<T: Task> TaskWorker<T> {
    /// The id a hook's outputs derive theirs from, on an ordered partition: from the
    /// partition, the hook, the input position it ran at and how many hooks ran there
    /// before, so that a hook run again at the same position after a crash (on the
    /// same state, restored) sends outputs with the same ids, which the broker drops.
    pub(super) fn hook_cause(&mut self, kind: HookKind) -> Option<MessageId> {
        // Only with stores (the machine numbers hooks only then): the restored state
        // makes a hook at the same position the same hook.
        let partition = self.binding.partition?;
        let (position, n) = self.part.handle(ev::HookStarted { init: kind == HookKind::Init }, now())?;
        let base =
            MessageId::from_wire(format!("hook/{}/{partition}/{}/{position}", self.binding.stream, kind.label()));
        Some(base.derive_output(n))
    }

    pub(super) fn apply_requests(&mut self, tctx: &mut TaskContext) {
        if tctx.requests.commit {
            self.part.handle(ev::CommitRequested, now());
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
    pub(super) fn run_hook(&mut self, hook: Hook, ctx: &mut Context<Self>) {
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
    pub(super) fn hook_done(&mut self, kind: HookKind, ctx: &mut Context<Self>) {
        match kind {
            HookKind::Init => {
                let changed_state = self.durable.as_ref().is_some_and(|d| d.stores.borrow().has_changes());
                self.part.handle(ev::InitRan { changed_state }, now());
                self.commit_hook_changes();
            }
            HookKind::Window => {
                self.part.handle(ev::WindowRan, now());
                self.commit_hook_changes();
            }
            HookKind::Timers => {
                self.part.handle(ev::TimersRan, now());
                self.commit_hook_changes();
            }
            HookKind::Commit => {
                self.commit_then(AfterCommit::Drive, ctx);
                return;
            }
            HookKind::Drain | HookKind::EndOfStream => {
                let then = if kind == HookKind::Drain { AfterCommit::Drained } else { AfterCommit::EndOfStream };
                self.commit_then(then, ctx);
                return;
            }
            HookKind::Shutdown => {
                self.finish(self.stopped_outcome(), ctx);
                return;
            }
        }
        self.drive(ctx);
    }
}
