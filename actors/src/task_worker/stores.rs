//! Restoring a partition's stores from the changelog, and commits that persist store
//! changes before the input position moves (DESIGN §5).

use super::*;

impl<T: Task> TaskWorker<T> {
    /// Reads the partition's stores back from the changelog and claims it, then runs
    /// `init`. Until then nothing is processed. A failure holds the partition (retried
    /// with backoff, an event each time) and never starts it empty; a changelog that
    /// does not decode (a type changed) fails the task, naming the store and key.
    pub(super) fn restore(&mut self, ctx: &mut Context<Self>) {
        if self.part.ended() {
            return;
        }
        let Some(partition) = self.binding.partition else { return };
        let bucket = self.env.subjects.bucket_name(crate::store::STATE);
        let prefix = format!("{}.{partition}", self.binding.stream);
        let started = Instant::now();
        let fut = changelog::restore(self.env.broker.clone(), bucket, prefix, self.binding.epoch);
        ctx.spawn(fut.into_actor(self).map(move |result, act, ctx| {
            if act.part.ended() {
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
    pub(super) fn restore_failed(&mut self, partition: u32, error: String, ctx: &mut Context<Self>) {
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

    pub(super) fn restored(
        &mut self,
        partition: u32,
        restored: changelog::Restored,
        started: Instant,
        ctx: &mut Context<Self>,
    ) {
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
        self.part.handle(ev::Restored { position, hooks }, now());
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

    /// Commits, then does `then`, in the order the machine plans ([`CommitPlan`]). With
    /// stores, the commit first writes what changed to the changelog (records, then
    /// the commit record) and acknowledges the inputs only once that is stored; it
    /// first waits for messages whose changes are applied but whose outputs are not
    /// stored yet, so the state it writes is that of exactly the inputs it
    /// acknowledges.
    pub(super) fn commit_then(&mut self, then: AfterCommit, ctx: &mut Context<Self>) {
        if self.commit_started.is_none() {
            let span = tracing::debug_span!(
                "commit",
                stream = self.binding.stream,
                partition = self.binding.partition,
                uncommitted = self.part.readiness().uncommitted_count(0),
            );
            self.commit_started = Some((Instant::now(), span));
        }
        match self.part.handle(ev::CommitStarts(then), now()) {
            CommitPlan::Ack(positions, then) => {
                self.commit_positions(positions);
                self.after_commit(then, ctx);
            }
            CommitPlan::Nothing(then) => self.after_commit(then, ctx),
            CommitPlan::Wait => {}
            CommitPlan::Flush { position, hooks, moved } => self.write_state(position, hooks, moved, ctx),
        }
    }

    /// Writes what changed in the stores with a commit record at `position` (counting
    /// `hooks` hooks run there), then acknowledges ([`state_stored`](Self::state_stored)).
    fn write_state(&mut self, position: u64, hooks: u32, moved: bool, ctx: &mut Context<Self>) {
        let Some((d, log)) = self.durable.as_ref().and_then(|d| Some((d, d.changelog.as_ref()?))) else {
            // The machine counts the stores as restored only once the changelog is read.
            self.part.handle(ev::StateRefused, now());
            self.fail("state not stored: the changelog was never read".to_owned(), ctx);
            return;
        };
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
            None if changes.is_empty() && !moved => {
                self.state_stored(ctx);
                return;
            }
            None => changelog::build_flush(log, changes, position, hooks, self.binding.epoch),
        };
        match flush {
            Ok(flush) => self.persist(Arc::new(flush), 0, ctx),
            Err(e) => {
                self.part.handle(ev::StateRefused, now());
                self.fail(format!("state not stored: {e}"), ctx);
            }
        }
    }

    /// The commit's state is stored: acknowledge what it covers, then go on.
    fn state_stored(&mut self, ctx: &mut Context<Self>) {
        if let Some((positions, then)) = self.part.handle(ev::StateStored, now()) {
            self.commit_positions(positions);
            self.after_commit(then, ctx);
        }
    }

    pub(super) fn persist(&mut self, flush: Arc<changelog::Flush>, attempt: u32, ctx: &mut Context<Self>) {
        if self.part.ended() {
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
            if act.part.ended() {
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
                    crate::failpoint::hit(crate::failpoint::Point::StateCommittedBeforeAck);
                    act.state_stored(ctx);
                }
                Err(changelog::StateError::Broker(e))
                    if e.class() == ErrorClass::Transient && attempt < act.config.unavailable_retries =>
                {
                    let delay = unavailable_backoff(attempt + 1);
                    warn!(stream = act.binding.stream, partition = act.binding.partition, error = %e, ?delay, "state not stored; writing it again");
                    ctx.run_later(delay, move |act, ctx| act.persist(flush, attempt + 1, ctx));
                }
                Err(changelog::StateError::Conflict(e)) => {
                    act.part.handle(ev::StateRefused, now());
                    if act.binding.fenced() {
                        act.abort_fenced(ctx);
                    } else {
                        act.restart_from_changelog(format!("state not stored: {e}"), ctx);
                    }
                }
                Err(e) => {
                    act.part.handle(ev::StateRefused, now());
                    act.fail(format!("state not stored: {e}; the partition restarts from its last commit"), ctx);
                }
            }
        }));
    }

    /// The state in memory cannot be committed as it is (a message whose changes are
    /// applied cannot finish, or someone else wrote the partition's changelog): hand
    /// everything back without committing and end asking for a reset, whatever the
    /// failure policy. The next worker restores the last commit and goes on from there.
    pub(super) fn restart_from_changelog(&mut self, reason: String, ctx: &mut Context<Self>) {
        self.end_for_restore(reason, None, ctx);
    }

    /// [`restart_from_changelog`](Self::restart_from_changelog) because of the message
    /// at `order`: the restore counts as one of its attempts, so one that keeps forcing
    /// restores is dead-lettered like one that keeps failing.
    pub(super) fn restore_blaming(&mut self, order: u64, reason: String, ctx: &mut Context<Self>) {
        let blame = self.part.held(order).map(|h| h.msg.delivery.info.stream_seq);
        self.end_for_restore(reason, blame, ctx);
    }

    pub(super) fn end_for_restore(&mut self, reason: String, blame: Option<u64>, ctx: &mut Context<Self>) {
        if self.part.ended() {
            return;
        }
        warn!(stream = self.binding.stream, partition = self.binding.partition, %reason, ?blame, "restarting the partition from its last commit");
        self.part.handle(ev::ReleaseAll { interrupted: true }, now());
        self.finish(Outcome::Restore { reason, blame }, ctx);
    }

    /// The message at `order` failed after its `process` returned: undoes its store
    /// changes, if it had any kept. `false` when they cannot be undone alone (a later
    /// callback changed one of its keys): then only a restore takes them back.
    pub(super) fn undo_applied(&mut self, order: u64) -> bool {
        if !self.part.held(order).is_some_and(Held::applied) {
            return true;
        }
        let Some(d) = &self.durable else { return true };
        if !d.stores.borrow_mut().undo(order) {
            return false;
        }
        self.part.handle(ev::Unapplied(order), now());
        true
    }

    pub(super) fn after_commit(&mut self, then: AfterCommit, ctx: &mut Context<Self>) {
        if let Some((started, span)) = self.commit_started.take() {
            self.metrics.commit.record(started.elapsed().as_secs_f64());
            // The span closes here: its duration is the commit's.
            drop(span);
        }
        match then {
            AfterCommit::Drive => self.drive(ctx),
            AfterCommit::Drained | AfterCommit::EndOfStream => {
                self.part.handle(ev::HandBackUnstarted, now());
                let outcome = if then == AfterCommit::Drained { Outcome::Drained } else { Outcome::EndOfStream };
                self.finish(outcome, ctx);
            }
            AfterCommit::Shutdown => self.run_hook(Hook::Shutdown, ctx),
        }
    }

    /// A hook changed the stores: commit soon, also on a partition with no new input
    /// (its outputs are out; what they report must not be reported again).
    pub(super) fn commit_hook_changes(&mut self) {
        if self.durable.as_ref().is_some_and(|d| d.stores.borrow().has_changes()) {
            self.part.handle(ev::CommitRequested, now());
        }
    }

    /// Whether a commit of a task with stores is on its way.
    pub(super) fn state_busy(&self) -> bool {
        self.part.commit_in_progress()
    }

    /// A commit that waited for applied messages goes on once none is left.
    pub(super) fn resume_waiting_commit(&mut self, ctx: &mut Context<Self>) {
        if let Some(then) = self.part.resume_commit() {
            self.commit_then(then, ctx);
        }
    }
}
