//! The task's hooks (`init`, `window`, timers, `shutdown`): their ids, their requests
//! and what runs after them.

use super::*;

impl<T: Task> TaskWorker<T> {
    /// The id a hook's outputs derive theirs from, on an ordered partition: from the
    /// partition, the hook, the input position it ran at and how many hooks ran there
    /// before, so that a hook run again at the same position after a crash (on the
    /// same state, restored) sends outputs with the same ids, which the broker drops.
    pub(super) fn hook_cause(&mut self, kind: HookKind) -> Option<MessageId> {
        // Only with stores: the restored state makes a hook at the same position the
        // same hook. Without, a restarted worker's hooks would reuse ids of outputs
        // that said something else, and the broker would drop them.
        self.durable.as_ref()?;
        let partition = self.binding.partition?;
        let position = self.part.applied_through();
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

    pub(super) fn apply_requests(&mut self, tctx: &mut TaskContext) {
        if tctx.requests.commit {
            self.part.handle(ev::CommitWanted, now());
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
                if self.hook_at.0 == self.part.applied_through()
                    && self.durable.as_ref().is_some_and(|d| d.stores.borrow().has_changes())
                {
                    self.hook_at.1 += 1;
                }
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
}
