//! The turn: runs what the readiness machine allows next, arms the ticks, parks keys,
//! counts queue hand-backs and keeps claimed messages alive with in-progress acks.

use super::*;

impl<T: Task> TaskWorker<T> {
    /// Runs the next operations the state machine allows while the task is home, then
    /// sends what the turn queued.
    pub(super) fn drive(&mut self, ctx: &mut Context<Self>) {
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
    pub(super) fn arm_ticks(&mut self) {
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

    pub(super) fn drive_ops(&mut self, ctx: &mut Context<Self>) {
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
    pub(super) fn restores_forced_by(&self, seq: u64) -> u32 {
        let blamed = self.binding.start.as_ref().map_or(&[][..], |s| &s.blamed);
        blamed.iter().find(|(at, _)| *at == seq).map_or(0, |(_, n)| *n)
    }

    /// Whether the queue message at `order` has a parked key (and was not let through
    /// by `step --key`).
    pub(super) fn key_parked(&self, order: u64) -> bool {
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
    pub(super) fn park(&mut self, order: u64, ctx: &mut Context<Self>) {
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
                        let delay = park_retry_delay(delivery.info.delivered, crate::retry::sample());
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
    pub(super) fn count_releases(&mut self, order: u64, seq: u64, delivered: u64, ctx: &mut Context<Self>) {
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

    pub(super) fn heartbeat(&mut self) {
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
