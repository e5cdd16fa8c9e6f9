//! The turn: runs what the readiness machine allows next, arms the ticks, parks keys,
//! counts queue hand-backs and keeps claimed messages alive with in-progress acks.

use super::*;

impl<T: Task> TaskWorker<T> {
    /// Runs the next operations the state machine allows while the task is home, then
    /// sends what the turn queued.
    pub(super) fn drive(&mut self, ctx: &mut Context<Self>) {
        self.resume_waiting_commit(ctx);
        self.drive_ops(ctx);
        self.send_batched(ctx);
        self.arm_ticks();
    }

    /// Arms one tick for the partition's earliest deadline ([`Partition::poll_timeout`]:
    /// retries, the commit interval, keep-alives, the callback check), unless one is on
    /// its way for it already. An idle partition has no deadline and gets no ticks:
    /// ticks every interval for every partition would cost an idle node with thousands
    /// of them more than their claims.
    pub(super) fn arm_ticks(&mut self) {
        if self.part.ended() {
            return;
        }
        let Some(me) = &self.self_recipient else { return };
        let now = Instant::now().into_std();
        let Some(at) = self.part.poll_timeout(now) else { return };
        if self.tick_at.is_some_and(|armed| armed <= at) {
            return;
        }
        self.tick_at = Some(at);
        self.timers.do_send(After {
            delay: at.saturating_duration_since(now),
            target: me.clone(),
            tick: Tick::Deadline,
        });
    }

    pub(super) fn drive_ops(&mut self, ctx: &mut Context<Self>) {
        if self.binding.fenced() {
            self.abort_fenced(ctx);
            return;
        }
        while !self.part.ended() && self.task.is_some() && self.part.readiness().failure().is_none() {
            // Per message, not once per turn: a turn can start many, and the lease's
            // validity is a deadline.
            if self.binding.fenced() {
                self.abort_fenced(ctx);
                return;
            }
            if self.durable.is_some() && !self.part.restored() {
                // Restoring: nothing runs before the state is back.
                if self.part.stopping() {
                    self.part.handle(ev::ReleaseAll { interrupted: true }, now());
                    self.finish(self.stopped_outcome(), ctx);
                }
                return;
            }
            if self.state_busy() {
                // A commit's flush is on its way: what it acknowledges is fixed, and a
                // retry would change the state it writes.
                return;
            }
            if self.part.stopping() && !self.part.retry_waiting() {
                self.try_finish_stop(ctx);
                return;
            }
            match self.part.next(Instant::now().into_std()) {
                Next::Retry(order) => self.start_attempt(order, ctx),
                Next::Begin(order) => self.route(order, ctx),
                Next::Commit => self.run_hook(Hook::Commit, ctx),
                Next::Window => self.run_hook(Hook::Window, ctx),
                Next::Timer => {
                    let due = std::mem::take(&mut self.due_timers);
                    self.run_hook(Hook::Timers(due), ctx);
                }
                Next::Drain => self.run_hook(Hook::Drain, ctx),
                Next::EndOfStream => self.run_hook(Hook::EndOfStream, ctx),
                Next::Idle => return,
            }
        }
    }

    /// A message begins here: what comes before its attempt is the machine's
    /// [`Partition::route`] (a parked key's is set aside, a queue message delivered
    /// before has its hand-backs counted, a suspect its start).
    fn route(&mut self, order: u64, ctx: &mut Context<Self>) {
        let parked = !self.binding.ordered() && self.key_parked(order);
        let route = self.part.route(order, parked);
        if route == Route::Start {
            self.start_attempt(order, ctx);
            return;
        }
        let Some(seq) = self.part.held(order).map(|h| h.msg.delivery.info.stream_seq) else { return };
        match route {
            Route::Park => self.park(order, ctx),
            Route::CountReleases => self.count_releases(order, seq, ctx),
            Route::CountSuspect => self.count_suspect(order, seq, ctx),
            Route::Start => {}
        }
    }

    /// Whether the queue message at `order` has a parked key (and was not let through
    /// by `step --key`).
    pub(super) fn key_parked(&self, order: u64) -> bool {
        if !self.env.parked.any() {
            return false;
        }
        let Some(held) = self.part.held(order) else { return false };
        let h = &held.msg.delivery.headers;
        h.get(headers::STEP).is_none()
            && h.get(headers::KEY).is_some_and(|key| self.env.parked.is_parked(self.binding.stream, key))
    }

    /// Sets a message of a parked key aside in the job's PARKED stream, with its
    /// sequence (so it goes back in order), and takes it off the queue: others keep
    /// flowing. It costs no attempt. If it cannot be stored it is handed back.
    pub(super) fn park(&mut self, order: u64, ctx: &mut Context<Self>) {
        let Some(d) = self.part.held(order).map(|h| &h.msg.delivery) else { return };
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
                    act.part.handle(ev::Forgotten(order), now());
                    // Parked after an unpark's last sweep, nobody would send it back.
                    actix::spawn(recheck);
                }
                Err(e) => {
                    if let Some(held) = act.part.handle(ev::Forgotten(order), now()) {
                        // Not at once: it would come straight back and be refused again,
                        // spending its deliveries in a second.
                        let delivery = held.msg.delivery;
                        let delay = park_retry_delay(delivery.info.delivered, crate::retry::sample());
                        warn!(stream = act.binding.stream, seq = delivery.info.stream_seq, ?delay, error = %e, "could not park a message of a parked key: handing it back for later");
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
    pub(super) fn count_releases(&mut self, order: u64, seq: u64, ctx: &mut Context<Self>) {
        let broker = self.env.broker.clone();
        let bucket = self.env.subjects.bucket_name(RELEASED);
        let key = released::key(self.binding.stream, seq);
        let fut = async move { released::count(&broker, &bucket, &key).await };
        ctx.spawn(fut.into_actor(self).map(move |count, act, ctx| {
            let released = match count {
                Ok(n) => Some(n),
                Err(e) => {
                    debug!(stream = act.binding.stream, seq, error = %e, "hand-backs not read: running it on its last attempt");
                    None
                }
            };
            if act.part.stopping() {
                // A stop came while the count was read: hand it back unstarted.
                if let Some(held) = act.part.handle(ev::Forgotten(order), now()) {
                    act.hand_back(&held.msg.delivery, true);
                }
                act.drive(ctx);
                return;
            }
            act.part.handle(ev::ReleasesCounted { order, released }, now());
            act.drive(ctx);
        }));
    }
}
