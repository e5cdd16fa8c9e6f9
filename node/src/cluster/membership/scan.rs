//! A scan: reading the leases, members and desired state ([`View`]), then applying
//! them: losing what another node holds, following pause, drain, shutdown and stop,
//! and acquiring or handing over partitions as the plan says.

use super::{LeaveReason, Membership, Part, View};
use actix::prelude::*;
use flotilla_actors::reaper::Tidy;
use flotilla_proto::cluster::assignment;
use flotilla_proto::cluster::control::{
    DrainedRecord, EndedRecord, LeaseRecord, ParkedRecord, PauseRecord, RequestRecord, decode, keys,
};
use flotilla_proto::cluster::run_end::run_over;
use flotilla_transport::broker::BrokerError;
use std::collections::{BTreeMap, BTreeSet};
use tokio::time::Instant;
use tracing::{debug, info, warn};

impl Membership {
    pub(super) fn scan(&mut self, ctx: &mut Context<Self>) {
        if self.scanning {
            self.scan_again = true;
            return;
        }
        self.scanning = true;
        let broker = self.s.broker.clone();
        let b = self.buckets.clone();
        let parts = self.partitions();
        let node = self.s.node.clone();
        let run_id = self.s.run_id.clone();
        let started = Instant::now();
        let fut = async move {
            // Leases first, then nodes: a lease seen here was taken by a node that had
            // registered before, so that node is in the list read after.
            let gets = parts.iter().map(|(s, p)| broker.kv_get(&b.leases, &keys::lease(s, *p)));
            let got = futures::future::join_all(gets).await;
            let mut leases = BTreeMap::new();
            for (part, entry) in parts.into_iter().zip(got) {
                let entry = entry?;
                let parsed = entry.map(|e| {
                    let rec = decode::<LeaseRecord>("lease", &e.value).ok();
                    (e, rec)
                });
                leases.insert(part, parsed);
            }
            let nodes = broker.kv_keys(&b.nodes).await?.into_iter().collect();
            let paused = match broker.kv_get(&b.control, keys::PAUSED).await? {
                Some(e) => decode(keys::PAUSED, &e.value).unwrap_or_default(),
                None => PauseRecord::default(),
            };
            let drain = match broker.kv_get(&b.control, keys::DRAIN).await? {
                Some(e) => decode::<RequestRecord>(keys::DRAIN, &e.value).ok(),
                None => None,
            };
            let mut drained = BTreeSet::new();
            if let Some(d) = &drain {
                for key in broker.kv_keys(&b.control).await? {
                    let Some(rest) = key.strip_prefix("drained.") else { continue };
                    let Some((stream, p)) = rest.rsplit_once('.') else { continue };
                    let Ok(p) = p.parse::<u32>() else { continue };
                    if let Some(e) = broker.kv_get(&b.control, &key).await?
                        && decode::<DrainedRecord>(&key, &e.value).is_ok_and(|r| r.run_id == d.run_id)
                    {
                        drained.insert((stream.to_owned(), p));
                    }
                }
            }
            // Only a partition nobody holds can be ended: read those.
            let unleased: Vec<&Part> = leases.iter().filter(|(_, l)| l.is_none()).map(|(p, _)| p).collect();
            let reads = unleased.iter().map(|(s, p)| broker.kv_get(&b.control, &keys::ended(s, *p)));
            let mut ended = BTreeSet::new();
            for (part, entry) in unleased.iter().zip(futures::future::join_all(reads).await) {
                if entry?.is_some_and(|e| decode::<EndedRecord>("ended", &e.value).is_ok_and(|r| r.run_id == run_id)) {
                    ended.insert((*part).clone());
                }
            }
            let parked = match broker.kv_get(&b.control, keys::PARKED).await? {
                Some(e) => decode::<ParkedRecord>(keys::PARKED, &e.value).unwrap_or_default(),
                None => ParkedRecord::default(),
            };
            let shutdown = broker.kv_get(&b.control, keys::SHUTDOWN).await?;
            let stop = broker.kv_get(&b.control, &keys::stop(&node)).await?.is_some();
            Ok::<_, BrokerError>(View { started, leases, nodes, paused, drain, drained, ended, parked, shutdown, stop })
        };
        ctx.spawn(fut.into_actor(self).map(move |view, act, ctx| {
            act.scanning = false;
            let took = started.elapsed();
            if took > act.s.config.scan_interval {
                warn!(?took, "cluster scan was slow: renewals wait for it");
            }
            match view {
                Ok(view) => act.apply(view, ctx),
                Err(e) => debug!(error = %e, "cluster scan failed; retrying at the next tick"),
            }
            if std::mem::take(&mut act.scan_again) {
                act.scan(ctx);
            }
        }));
    }

    /// Sets the partitions-owned gauge of every ordered input.
    pub(super) fn report_owned(&self) {
        for (stream, _) in &self.s.ordered {
            flotilla_actors::metrics::partitions_owned(stream, self.held.keys().filter(|(s, _)| s == stream).count());
        }
    }

    pub(super) fn apply(&mut self, view: View, ctx: &mut Context<Self>) {
        self.report_owned();
        let now = Instant::now();
        let cfg = self.s.config.clone();
        if view.nodes != self.members {
            info!(members = ?view.nodes, "membership changed");
            self.members = view.nodes.clone();
            self.members_changed = now;
        }
        self.fence_expired(ctx);

        // Held partitions whose lease someone else holds now, or that vanished while
        // no renewal was under way: lost.
        let lost: Vec<Part> = self
            .held
            .iter()
            .filter(|(_, h)| view.started > h.acquired)
            .filter(|(part, h)| match view.leases.get(*part) {
                Some(Some((_, Some(rec)))) => !rec.held_by(&self.s.node, &self.s.incarnation),
                Some(Some((_, None))) => true,
                Some(None) => !h.renewing && !h.releasing,
                None => false,
            })
            .map(|(p, _)| p.clone())
            .collect();
        for part in lost {
            self.lose(&part, "the lease is held by another node or expired");
        }

        // Desired state.
        if view.paused != self.paused {
            self.paused = view.paused.clone();
            self.apply_pause();
        }
        self.drain = view.drain.clone();
        self.drained = view.drained.clone();
        self.s.parked.set(view.parked.keys.clone());
        // What this node recorded may not be in the view yet.
        self.ended.extend(view.ended.iter().cloned());
        if let Some(e) = &view.shutdown
            && e.revision > self.s.shutdown_seen
            && self.leaving.is_none()
        {
            info!("shutdown requested: leaving");
            self.leave(LeaveReason::Shutdown, ctx);
        }
        if view.stop && self.leaving.is_none() {
            info!("stop requested for this node: leaving");
            self.leave(LeaveReason::StopRequested, ctx);
        }
        if self.leaving.is_none()
            && self.drain_asked()
            && run_over(self.partitions().iter().map(|p| self.end_of(p)), true)
        {
            info!(run = %self.s.run_id, "every partition is drained (or ended): the run is over, leaving");
            self.leave(LeaveReason::Drained, ctx);
        }
        if self.leaving.is_none() && run_over(self.partitions().iter().map(|p| self.end_of(p)), false) {
            info!(run = %self.s.run_id, "every partition reached its end of stream: the run is over, leaving");
            self.leave(LeaveReason::Ended, ctx);
        }
        if self.leaving.is_some() || !self.registered {
            return;
        }

        // The plan.
        let mut live = self.members.clone();
        live.insert(self.s.node.clone());
        let settled = now.saturating_duration_since(self.members_changed) >= cfg.settle;
        let releasing = self.held.values().filter(|h| h.releasing).count();
        let mut budget = cfg.max_moves.saturating_sub(releasing);
        for (stream, n) in self.s.ordered.clone() {
            let current: assignment::Assignment = (0..n)
                .filter_map(|p| match view.leases.get(&(stream.clone(), p)) {
                    Some(Some((_, Some(rec)))) => Some((p, rec.node.clone())),
                    _ => None,
                })
                .collect();
            let plan = assignment::plan(n, &live, &current);
            for p in 0..n {
                let part = (stream.clone(), p);
                let target = plan.get(&p);
                let leased = matches!(view.leases.get(&part), Some(Some(_)));
                if let Some(h) = self.held.get(&part) {
                    // A partition done for the run goes once its record is stored.
                    if settled
                        && !h.releasing
                        && h.done.is_none()
                        && target.is_some_and(|t| *t != self.s.node)
                        && budget > 0
                    {
                        budget -= 1;
                        info!(stream = %part.0, partition = p, to = ?target, "rebalancing: handing the partition over");
                        self.release(&part);
                    }
                    continue;
                }
                if let Some(Some((entry, Some(rec)))) = view.leases.get(&part)
                    && rec.left_by_earlier(&self.s.node, &self.s.incarnation)
                {
                    // A lease of the process that had this node id before this one (it
                    // is gone: this one took the id over). Take it over at once, with a
                    // new epoch, rather than wait out its TTL.
                    info!(stream = %part.0, partition = p, "taking over a lease of this node id's previous process");
                    self.acquire(part, Some(entry.revision), "takeover", ctx);
                    continue;
                }
                if leased || self.end_of(&part).done(self.drain_asked()) {
                    self.unleased_since.remove(&part);
                    continue;
                }
                let since = *self.unleased_since.entry(part.clone()).or_insert(now);
                let mine = target.is_some_and(|t| *t == self.s.node);
                // A partition nobody took for a whole TTL goes to whoever gets it first.
                if mine || now.saturating_duration_since(since) >= cfg.lease_ttl {
                    self.acquire(part, None, if mine { "assigned" } else { "unclaimed" }, ctx);
                }
            }
        }
        if now >= self.tidy_at {
            self.tidy_at = now + cfg.node_ttl * 5;
            let fut = self.s.reaper.send(Tidy { control: self.buckets.control.clone(), live: self.members.clone() });
            actix::spawn(async move {
                if let Ok(Err(e)) = fut.await {
                    debug!(error = %e, "tidying the control bucket failed");
                }
            });
        }
    }
}
