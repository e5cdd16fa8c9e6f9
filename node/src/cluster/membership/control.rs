//! Control requests (`flotilla.<J>._ctl.…`): answering `status`, stepping a paused
//! partition, leaving on `stop` and `shutdown`, and applying pause and drain at once;
//! a repeated request gets its first answer again.

use super::{LeaveReason, Membership, SEEN_REQUESTS};
use actix::prelude::*;
use flotilla_actors::container::{SetPaused, Snapshot, StepSlot, StopContainer};
use flotilla_proto::cluster::control::{
    self as cluster, ControlReply, ControlRequest, NodeRecord, NodeStatus, decode, encode,
};
use flotilla_transport::broker::CoreMessage;
use tracing::warn;

impl Membership {
    pub(super) fn apply_pause(&mut self) {
        for (slot, part) in &self.slot_of {
            let paused = self.paused.covers(&part.0, Some(part.1));
            self.s.container.do_send(SetPaused { slot: *slot, paused });
        }
        for (slot, stream) in &self.s.queue_slots {
            self.s.container.do_send(SetPaused { slot: *slot, paused: self.paused.covers(stream, None) });
        }
    }

    pub(super) fn leave(&mut self, reason: LeaveReason, _ctx: &mut Context<Self>) {
        if self.leaving.is_some() {
            return;
        }
        self.leaving = Some(reason);
        let _ = self.s.left.send(Some(reason));
        for h in self.held.values_mut() {
            h.releasing = true;
        }
        self.s.container.do_send(StopContainer);
    }

    pub(super) fn reply(&self, to: Option<String>, reply: ControlReply) {
        let Some(subject) = to else { return };
        if !cluster::reply_subject_allowed(&subject) {
            warn!(reply_to = %subject, request_id = %reply.request_id, "control request with a reply subject that is not an inbox: not answered");
            return;
        }
        let body = encode(&reply);
        let fut = self.s.broker.core_publish(CoreMessage::new(subject, body));
        actix::spawn(async move {
            let _ = fut.await;
        });
    }

    pub(super) fn answer(&self, request_id: &str, ok: bool, message: impl Into<String>) -> ControlReply {
        ControlReply {
            node: self.s.node.clone(),
            request_id: request_id.to_owned(),
            ok,
            message: message.into(),
            duplicate: false,
            acted: false,
            status: None,
        }
    }

    pub(super) fn control(&mut self, msg: CoreMessage, ctx: &mut Context<Self>) {
        let verb = msg.subject.rsplit('.').next().unwrap_or_default().to_owned();
        if verb == "changed" {
            // Another node released a lease: look now rather than at the next tick.
            self.scan(ctx);
            return;
        }
        let request: ControlRequest = match decode("control request", &msg.payload) {
            Ok(r) => r,
            Err(e) => {
                warn!(subject = %msg.subject, error = %e, "malformed control request ignored");
                let reply = self.answer(
                    "",
                    false,
                    format!("malformed request body: {}; send JSON like {{\"request_id\":\"…\"}}", e.reason()),
                );
                self.reply(msg.reply, reply);
                return;
            }
        };
        let id = request.request_id.clone();
        if id.trim().is_empty() {
            let reply = self.answer(&id, false, "request_id is empty: give every request a unique id");
            self.reply(msg.reply, reply);
            return;
        }
        if !cluster::VERBS.contains(&verb.as_str()) {
            let reply =
                self.answer(&id, false, format!("unknown verb {verb:?}; known verbs: {}", cluster::VERBS.join(", ")));
            self.reply(msg.reply, reply);
            return;
        }
        if verb == "stop" && !msg.subject.contains("._ctl.node.") {
            let reply = self.answer(
                &id,
                false,
                format!(
                    "stop is for one node: send it to {} (shutdown stops them all)",
                    self.s.subjects.control(&format!("node.{}.stop", self.s.node))
                ),
            );
            self.reply(msg.reply, reply);
            return;
        }
        if let Some(run) = &request.run_id
            && *run != self.s.run_id
        {
            let reply = self.answer(
                &id,
                false,
                format!("stale run id {run}: the current run is {}; nothing was changed", self.s.run_id),
            );
            self.reply(msg.reply, reply);
            return;
        }
        if verb == "status" {
            let snapshot = self.s.container.send(Snapshot);
            let reply_to = msg.reply;
            let base = self.answer(&id, true, "status");
            let (node, run_id, leaving) = (self.s.node.clone(), self.s.run_id.clone(), self.leaving.is_some());
            let from = usize::try_from(request.offset.unwrap_or(0)).unwrap_or(usize::MAX);
            ctx.spawn(snapshot.into_actor(self).map(move |slots, act, _| {
                let mut reply = base;
                let (slots, more_from) = cluster::status_page(slots.unwrap_or_default(), from);
                let record = decode::<NodeRecord>("node record", &act.s.node_value).ok();
                reply.status = Some(NodeStatus {
                    node,
                    pid: std::process::id(),
                    run_id,
                    leaving,
                    host: record.as_ref().map(|r| r.host.clone()).unwrap_or_default(),
                    version: env!("CARGO_PKG_VERSION").to_owned(),
                    started_ms: record.map_or(0, |r| r.started_ms),
                    slots,
                    more_from,
                });
                act.reply(reply_to, reply);
            }));
            return;
        }
        // A retried request gets the first answer again (with what it did), marked as a
        // duplicate, and is not acted on twice.
        if let Some((_, first)) = self.seen.iter().find(|(seen, _)| *seen == id) {
            let mut reply = first.clone();
            reply.duplicate = true;
            reply.message = format!("request {id} was already handled ({}); nothing done again", first.message);
            self.reply(msg.reply, reply);
            return;
        }
        let reply = match verb.as_str() {
            "pause" | "resume" | "drain" => {
                // The sender wrote the desired state first; read it now.
                self.scan(ctx);
                self.answer(&id, true, format!("{verb}: applying the desired state"))
            }
            "step" => match (request.stream.clone(), request.partition) {
                (Some(stream), Some(p)) => {
                    let part = (stream, p);
                    match self.held.get(&part).and_then(|h| h.slot) {
                        Some(slot) if self.paused.covers(&part.0, Some(p)) => {
                            self.s.container.do_send(StepSlot(slot));
                            let mut r = self.answer(&id, true, format!("stepped {}/{p}: one message", part.0));
                            r.acted = true;
                            r
                        }
                        Some(_) => self.answer(&id, false, format!("{}/{p} is not paused; pause it first", part.0)),
                        None => self.answer(&id, true, format!("{}/{p} is not held here", part.0)),
                    }
                }
                _ => self.answer(&id, false, "step needs a stream and a partition"),
            },
            _ => {
                let mut reply = self.answer(&id, true, "leaving: handing partitions over, then exiting");
                reply.acted = true;
                reply
            }
        };
        self.seen.push_back((id.clone(), reply.clone()));
        if self.seen.len() > SEEN_REQUESTS {
            self.seen.pop_front();
        }
        self.reply(msg.reply, reply);
        if verb == "stop" || verb == "shutdown" {
            let reason = if verb == "stop" { LeaveReason::StopRequested } else { LeaveReason::Shutdown };
            self.leave(reason, ctx);
        }
    }
}
