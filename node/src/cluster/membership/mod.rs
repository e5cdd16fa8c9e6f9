//! `Membership`: this node's place in the cluster (DESIGN §7).
//!
//! * **Membership**: the node's key in the NODES bucket, rewritten by compare-and-set
//!   every third of `node_ttl`; the bucket's expiry is the failure detector. A node
//!   that loses its key stops every partition and registers again.
//! * **Leases**: one key per ordered partition in the LEASES bucket. Absent leases that
//!   the plan gives this node are acquired (through the [`Reaper`], which also takes the
//!   partition's consumer over at the committed position); held ones are renewed by
//!   compare-and-set every third of `lease_ttl`. The revision at acquisition is the
//!   epoch stamped on every output. A partition whose lease could not be renewed within
//!   two thirds of the TTL is fenced (its worker acts no more) before the lease can
//!   expire and be taken by another node.
//! * **Plan**: [`crate::assignment::plan`] over the live nodes and the current holders,
//!   so every node computes the same fair share. Orphaned partitions are taken at once;
//!   partitions held by a live node move only after membership has been stable for
//!   `settle`, at most `max_moves` per scan, by a graceful hand-over (finish, commit,
//!   delete the lease) so the next owner starts at once and nothing is redelivered.
//! * **Desired state**: every scan reads the CONTROL bucket (paused, drain, shutdown,
//!   stop), so a node that was disconnected catches up; control requests on
//!   `flotilla.<J>._ctl.…` only make it look sooner, and answer `status`.
//!
//! Supervision: started by [`Job::start_node`](crate::Job::start_node) on the container's
//! arbiter after the node registered; ticked by the [`TimerService`]. It stops the
//! container to leave; [`Deregister`] then removes the node's leases and key.

mod done;
mod messages;

use done::Done;
pub use messages::{ControlMessage, Deregister, Leave, LeaveReason};

use crate::assignment;
use crate::cluster::{
    self, ClusterConfig, ControlReply, ControlRequest, DrainedRecord, EndedRecord, Fence, LeaseRecord, NodeRecord,
    NodeStatus, PauseRecord, RequestRecord, keys,
};
use crate::container::{AddSlot, Container, ReleaseSlot, SetPaused, SlotEnded, Snapshot, StepSlot, StopContainer};
use crate::events::{Event, emit};
use crate::reaper::{AcquireLease, Reaper, Tidy};
use crate::task_worker::Outcome;
use crate::timer_service::{Every, Tick, TimerService};
use actix::prelude::*;
use bytes::Bytes;
use flotilla_transport::broker::{BrokerError, ConsumerSpec, CoreMessage, KvEntry, SharedBroker};
use flotilla_transport::wire::Subjects;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::rc::Rc;
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// The JetStream stream and consumer of an ordered partition, for taking it over.
pub type TakeoverSpec = Rc<dyn Fn(&str, u32) -> Option<(String, ConsumerSpec)>>;

/// The job's bucket names.
#[derive(Debug, Clone)]
pub struct Buckets {
    /// Membership.
    pub nodes: String,
    /// Partition leases.
    pub leases: String,
    /// Desired state.
    pub control: String,
}

impl Buckets {
    /// The buckets of the job `subjects` names.
    pub fn new(subjects: &Subjects) -> Self {
        Self {
            nodes: subjects.bucket_name(cluster::NODES),
            leases: subjects.bucket_name(cluster::LEASES),
            control: subjects.bucket_name(cluster::CONTROL),
        }
    }
}

/// Everything the actor needs at start.
pub struct MembershipSetup {
    /// The broker.
    pub broker: SharedBroker,
    /// The job's subjects.
    pub subjects: Subjects,
    /// This node.
    pub node: String,
    /// This process's incarnation of the node id ([`NodeRecord::incarnation`](crate::cluster::NodeRecord::incarnation)).
    pub incarnation: String,
    /// The node key's revision after registering.
    pub node_revision: u64,
    /// The node key's value.
    pub node_value: Bytes,
    /// The run.
    pub run_id: String,
    /// Timing.
    pub config: ClusterConfig,
    /// Ordered inputs: `(stream, partitions)`.
    pub ordered: Vec<(String, u32)>,
    /// Queue inputs' slots in the container: `(slot, stream)`.
    pub queue_slots: Vec<(usize, String)>,
    /// Where each partition's consumer is.
    pub takeover: TakeoverSpec,
    /// The container.
    pub container: Addr<Container>,
    /// The timer service.
    pub timers: Addr<TimerService>,
    /// The reaper.
    pub reaper: Addr<Reaper>,
    /// Revision of the `shutdown` key at start (older requests are not for this node).
    pub shutdown_seen: u64,
    /// Tells the node process why it left.
    pub left: tokio::sync::watch::Sender<Option<LeaveReason>>,
    /// The parked keys the node's queue workers check (kept current from CONTROL).
    pub parked: crate::task::ParkedKeys,
}

impl std::fmt::Debug for MembershipSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MembershipSetup").field("node", &self.node).finish_non_exhaustive()
    }
}

type Part = (String, u32);

struct Held {
    /// When the lease was acquired: views read before say nothing about it.
    acquired: Instant,
    revision: u64,
    epoch: u64,
    slot: Option<usize>,
    fence: Fence,
    renewing: bool,
    releasing: bool,
    /// Drained or at its end of stream in this run: no worker runs for it any more, and
    /// the lease is kept (and renewed) until the record saying so is stored, so that no
    /// node takes the partition up again in the run.
    done: Option<Done>,
}

/// What one scan read.
struct View {
    /// When the reading began.
    started: Instant,
    leases: BTreeMap<Part, Option<(KvEntry, Option<LeaseRecord>)>>,
    nodes: BTreeSet<String>,
    paused: PauseRecord,
    drain: Option<RequestRecord>,
    drained: BTreeSet<Part>,
    /// Partitions at their end of stream in this node's run.
    ended: BTreeSet<Part>,
    parked: cluster::ParkedRecord,
    shutdown: Option<KvEntry>,
    stop: bool,
}

/// The membership actor.
pub struct Membership {
    s: MembershipSetup,
    buckets: Buckets,
    held: BTreeMap<Part, Held>,
    slot_of: HashMap<usize, Part>,
    members: BTreeSet<String>,
    members_changed: Instant,
    unleased_since: HashMap<Part, Instant>,
    acquiring: HashSet<Part>,
    scanning: bool,
    scan_again: bool,
    beating: bool,
    registered: bool,
    leaving: Option<LeaveReason>,
    paused: PauseRecord,
    drain: Option<RequestRecord>,
    drained: BTreeSet<Part>,
    ended: BTreeSet<Part>,
    /// Control requests handled lately, with the first answer to each.
    seen: VecDeque<(String, ControlReply)>,
    tidy_at: Instant,
    /// Deregistered: the node is gone from the cluster; nothing more to do.
    gone: bool,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership").field("node", &self.s.node).field("held", &self.held.len()).finish_non_exhaustive()
    }
}

const SEEN_REQUESTS: usize = 1024;

/// How long a stopping node tries once more to store a done record it could not store.
const RECORD_AT_STOP: std::time::Duration = std::time::Duration::from_secs(1);

impl Membership {
    /// The actor for a node that has registered.
    pub fn new(setup: MembershipSetup) -> Self {
        let now = Instant::now();
        let buckets = Buckets::new(&setup.subjects);
        Self {
            buckets,
            held: BTreeMap::new(),
            slot_of: HashMap::new(),
            members: BTreeSet::new(),
            members_changed: now,
            unleased_since: HashMap::new(),
            acquiring: HashSet::new(),
            scanning: false,
            scan_again: false,
            beating: false,
            registered: true,
            leaving: None,
            paused: PauseRecord::default(),
            drain: None,
            drained: BTreeSet::new(),
            ended: BTreeSet::new(),
            seen: VecDeque::new(),
            tidy_at: now,
            gone: false,
            s: setup,
        }
    }

    fn partitions(&self) -> Vec<Part> {
        self.s.ordered.iter().flat_map(|(s, n)| (0..*n).map(move |p| (s.clone(), p))).collect()
    }

    fn lease_value(&self, epoch: u64) -> Bytes {
        let record = LeaseRecord { node: self.s.node.clone(), epoch, incarnation: self.s.incarnation.clone() };
        Bytes::from(serde_json::to_vec(&record).unwrap_or_default())
    }

    /// How long a renewal sent at `sent` keeps the partition ours: two thirds of the
    /// TTL, so we stop well before the server can expire the lease.
    fn valid_after(&self, sent: Instant) -> Instant {
        sent + self.s.config.lease_ttl.mul_f64(2.0 / 3.0)
    }

    fn scan(&mut self, ctx: &mut Context<Self>) {
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
                    let rec = serde_json::from_slice::<LeaseRecord>(&e.value).ok();
                    (e, rec)
                });
                leases.insert(part, parsed);
            }
            let nodes = broker.kv_keys(&b.nodes).await?.into_iter().collect();
            let paused = match broker.kv_get(&b.control, keys::PAUSED).await? {
                Some(e) => serde_json::from_slice(&e.value).unwrap_or_default(),
                None => PauseRecord::default(),
            };
            let drain = match broker.kv_get(&b.control, keys::DRAIN).await? {
                Some(e) => serde_json::from_slice::<RequestRecord>(&e.value).ok(),
                None => None,
            };
            let mut drained = BTreeSet::new();
            if let Some(d) = &drain {
                for key in broker.kv_keys(&b.control).await? {
                    let Some(rest) = key.strip_prefix("drained.") else { continue };
                    let Some((stream, p)) = rest.rsplit_once('.') else { continue };
                    let Ok(p) = p.parse::<u32>() else { continue };
                    if let Some(e) = broker.kv_get(&b.control, &key).await?
                        && serde_json::from_slice::<DrainedRecord>(&e.value).is_ok_and(|r| r.run_id == d.run_id)
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
                if entry?
                    .is_some_and(|e| serde_json::from_slice::<EndedRecord>(&e.value).is_ok_and(|r| r.run_id == run_id))
                {
                    ended.insert((*part).clone());
                }
            }
            let parked = match broker.kv_get(&b.control, keys::PARKED).await? {
                Some(e) => serde_json::from_slice::<cluster::ParkedRecord>(&e.value).unwrap_or_default(),
                None => cluster::ParkedRecord::default(),
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
    fn report_owned(&self) {
        for (stream, _) in &self.s.ordered {
            crate::metrics::partitions_owned(stream, self.held.keys().filter(|(s, _)| s == stream).count());
        }
    }

    fn apply(&mut self, view: View, ctx: &mut Context<Self>) {
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
        if let Some(d) = &self.drain
            && d.run_id == self.s.run_id
            && self.leaving.is_none()
        {
            let all = self.partitions();
            if !all.is_empty() && all.iter().all(|p| self.drained.contains(p) || self.ended.contains(p)) {
                info!(run = %d.run_id, "every partition is drained (or ended): the run is over, leaving");
                self.leave(LeaveReason::Drained, ctx);
            }
        }
        if self.leaving.is_none() {
            let all = self.partitions();
            if !all.is_empty() && all.iter().all(|p| self.ended.contains(p)) {
                info!(run = %self.s.run_id, "every partition reached its end of stream: the run is over, leaving");
                self.leave(LeaveReason::Ended, ctx);
            }
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
                if leased
                    || self.drained.contains(&part) && self.drain.as_ref().is_some_and(|d| d.run_id == self.s.run_id)
                    || self.ended.contains(&part)
                {
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

    fn heartbeat(&mut self, ctx: &mut Context<Self>) {
        if self.beating {
            return;
        }
        self.beating = true;
        let broker = self.s.broker.clone();
        let (bucket, node, value) = (self.buckets.nodes.clone(), self.s.node.clone(), self.s.node_value.clone());
        let registered = self.registered;
        let revision = self.s.node_revision;
        let fut = async move {
            if registered {
                broker.kv_update(&bucket, &node, value, revision).await.map(|r| (r, false))
            } else {
                broker.kv_create(&bucket, &node, value).await.map(|r| (r, true))
            }
        };
        ctx.spawn(fut.into_actor(self).map(move |result, act, _| {
            act.beating = false;
            match result {
                Ok((rev, rejoined)) => {
                    act.s.node_revision = rev;
                    if rejoined {
                        info!(node = %act.s.node, "registered again");
                        act.registered = true;
                    }
                }
                Err(BrokerError::KvWrongRevision { .. } | BrokerError::KvKeyExists { .. }) if registered => {
                    warn!(node = %act.s.node, "membership lost (heartbeat refused): stopping every partition and registering again");
                    act.registered = false;
                    let parts: Vec<Part> = act.held.keys().cloned().collect();
                    for part in parts {
                        act.lose(&part, "membership lost");
                    }
                }
                Err(e) => debug!(error = %e, "heartbeat failed; retrying"),
            }
        }));
    }

    /// Renews every held lease (on each renewal tick, a quarter of the TTL).
    fn renew_all(&mut self, ctx: &mut Context<Self>) {
        let due: Vec<Part> = self.held.iter().filter(|(_, h)| !h.renewing).map(|(p, _)| p.clone()).collect();
        for part in due {
            self.renew(part, ctx);
        }
    }

    /// Renews one lease by compare-and-set. A renewal that takes longer than a sixth of
    /// the TTL is abandoned and tried again on the next beat, so one lost request does
    /// not let the fence run out. A refused one whose write did land (the reply was
    /// lost) is recognised by re-reading the key: it still names this node and epoch.
    fn renew(&mut self, part: Part, ctx: &mut Context<Self>) {
        let Some(h) = self.held.get_mut(&part) else { return };
        h.renewing = true;
        let epoch = h.epoch;
        let value = self.lease_value(epoch);
        let Some(h) = self.held.get_mut(&part) else { return };
        let (broker, bucket, key) = (self.s.broker.clone(), self.buckets.leases.clone(), keys::lease(&part.0, part.1));
        let (node, incarnation) = (self.s.node.clone(), self.s.incarnation.clone());
        let update = broker.kv_update(&bucket, &key, value, h.revision);
        let limit = self.s.config.lease_ttl / 6;
        let fut = async move {
            match tokio::time::timeout(limit, update).await {
                Err(_) => Err(BrokerError::TimedOut { operation: format!("renew lease {key}"), after: limit }),
                Ok(Err(BrokerError::KvWrongRevision { .. })) => match broker.kv_get(&bucket, &key).await {
                    Ok(Some(e))
                        if serde_json::from_slice::<LeaseRecord>(&e.value)
                            .is_ok_and(|r| r.held_by(&node, &incarnation) && r.epoch == epoch) =>
                    {
                        Ok((e.revision, false))
                    }
                    Ok(_) => Err(BrokerError::KvWrongRevision { bucket, key, expected: 0 }),
                    Err(e) => Err(e),
                },
                Ok(result) => result.map(|rev| (rev, true)),
            }
        };
        let sent = Instant::now();
        ctx.spawn(fut.into_actor(self).map(move |result, act, _| {
            let until = act.valid_after(sent);
            let took = sent.elapsed();
            if took > act.s.config.lease_ttl / 6 {
                warn!(stream = %part.0, partition = part.1, ?took, "lease renewal was slow");
            }
            let Some(h) = act.held.get_mut(&part) else { return };
            h.renewing = false;
            match result {
                Ok((rev, renewed)) => {
                    h.revision = rev;
                    if renewed {
                        h.fence.extend(until);
                    }
                }
                Err(BrokerError::KvWrongRevision { .. } | BrokerError::KvKeyExists { .. }) => {
                    act.lose(&part, "lease renewal refused");
                }
                Err(e) => {
                    debug!(stream = %part.0, partition = part.1, error = %e, "lease renewal failed; retrying")
                }
            }
        }));
    }

    /// Partitions whose fence ran out (no renewal for two thirds of the TTL): stop them.
    fn fence_expired(&mut self, _ctx: &mut Context<Self>) {
        let expired: Vec<Part> = self.held.iter().filter(|(_, h)| !h.fence.valid()).map(|(p, _)| p.clone()).collect();
        for part in expired {
            self.lose(&part, "the lease could not be renewed in time (self-fencing)");
        }
    }

    /// The lease is gone: revoke the fence (the worker acts no more) and stop the slot.
    fn lose(&mut self, part: &Part, why: &str) {
        if let Some(h) = self.held.remove(part) {
            warn!(stream = %part.0, partition = part.1, epoch = h.epoch, why, "partition lost");
            crate::metrics::lease_lost(&part.0);
            let event = Event::PartitionLost {
                stream: part.0.clone(),
                partition: part.1,
                node: self.s.node.clone(),
                why: why.to_owned(),
            };
            emit(&self.s.broker, &self.s.subjects, event);
            self.report_owned();
            h.fence.revoke();
            if let Some(slot) = h.slot {
                self.slot_of.remove(&slot);
                self.s.container.do_send(ReleaseSlot(slot));
            }
        }
    }

    fn release(&mut self, part: &Part) {
        if let Some(h) = self.held.get_mut(part) {
            h.releasing = true;
            match h.slot {
                Some(slot) => self.s.container.do_send(ReleaseSlot(slot)),
                None => {
                    let part = part.clone();
                    self.delete_lease(&part);
                }
            }
        }
    }

    /// Acquires `part`'s lease: creates it, or replaces it at `replace` (a lease a
    /// dead incarnation of this node left).
    fn acquire(&mut self, part: Part, replace: Option<u64>, how: &'static str, ctx: &mut Context<Self>) {
        if !self.acquiring.insert(part.clone()) {
            return;
        }
        let Some((js_stream, consumer)) = (self.s.takeover)(&part.0, part.1) else {
            self.acquiring.remove(&part);
            return;
        };
        let msg = AcquireLease {
            bucket: self.buckets.leases.clone(),
            key: keys::lease(&part.0, part.1),
            value: self.lease_value(0),
            replace,
            js_stream,
            consumer: Some(consumer),
        };
        let sent = Instant::now();
        let fut = self.s.reaper.send(msg);
        ctx.spawn(fut.into_actor(self).map(move |result, act, ctx| {
            act.acquiring.remove(&part);
            let acquired = match result {
                Ok(Ok(Some(acquired))) => acquired,
                Ok(Ok(None)) => return,
                Ok(Err(e)) => {
                    debug!(stream = %part.0, partition = part.1, error = %e, "could not acquire the lease");
                    return;
                }
                Err(_) => return,
            };
            let revision = acquired.revision;
            let fence = Fence::until(act.valid_after(sent));
            if act.leaving.is_some() || !act.registered {
                // Too late: give it back.
                act.held.insert(part.clone(), Held::new(revision, fence));
                act.delete_lease(&part);
                return;
            }
            let paused = act.paused.covers(&part.0, Some(part.1));
            let spec = AddSlot {
                stream: part.0.clone(),
                partition: part.1,
                epoch: revision,
                fence: fence.clone(),
                paused,
                start: acquired.start,
            };
            info!(stream = %part.0, partition = part.1, epoch = revision, how, "lease acquired");
            crate::metrics::lease_acquired(&part.0, how);
            emit(
                &act.s.broker,
                &act.s.subjects,
                Event::PartitionAcquired {
                    stream: part.0.clone(),
                    partition: part.1,
                    node: act.s.node.clone(),
                    epoch: revision,
                    how: how.to_owned(),
                },
            );
            act.unleased_since.remove(&part);
            act.held.insert(part.clone(), Held::new(revision, fence));
            act.report_owned();
            // The record was created before its revision was known: write the epoch
            // into it now, so readers of LEASES see it at once.
            act.renew(part.clone(), ctx);
            let add = act.s.container.send(spec);
            ctx.spawn(add.into_actor(act).map(move |slot, act, _| {
                let Ok(Some(slot)) = slot else { return };
                match act.held.get_mut(&part) {
                    Some(h) => {
                        h.slot = Some(slot);
                        act.slot_of.insert(slot, part.clone());
                        if h.releasing {
                            act.s.container.do_send(ReleaseSlot(slot));
                        }
                    }
                    // Lost while the slot was being added.
                    None => act.s.container.do_send(ReleaseSlot(slot)),
                }
            }));
        }));
    }

    /// Deletes a held lease (only if it is still at our revision) and tells the others.
    fn delete_lease(&mut self, part: &Part) {
        let Some(h) = self.held.remove(part) else { return };
        h.fence.revoke();
        crate::metrics::lease_released(&part.0);
        let event = Event::PartitionReleased { stream: part.0.clone(), partition: part.1, node: self.s.node.clone() };
        emit(&self.s.broker, &self.s.subjects, event);
        self.report_owned();
        if let Some(slot) = h.slot {
            self.slot_of.remove(&slot);
        }
        let del = release_lease(
            self.s.broker.clone(),
            self.buckets.leases.clone(),
            keys::lease(&part.0, part.1),
            (self.s.node.clone(), self.s.incarnation.clone()),
            h.revision,
        );
        let notify = self.s.broker.core_publish(CoreMessage::new(self.s.subjects.control("all.changed"), Bytes::new()));
        let part = part.clone();
        actix::spawn(async move {
            match del.await {
                Ok(()) => {
                    info!(stream = %part.0, partition = part.1, "lease released");
                    let _ = notify.await;
                }
                Err(e) => {
                    warn!(stream = %part.0, partition = part.1, error = %e, "could not delete the lease; it expires on its own")
                }
            }
        });
    }

    fn apply_pause(&mut self) {
        for (slot, part) in &self.slot_of {
            let paused = self.paused.covers(&part.0, Some(part.1));
            self.s.container.do_send(SetPaused { slot: *slot, paused });
        }
        for (slot, stream) in &self.s.queue_slots {
            self.s.container.do_send(SetPaused { slot: *slot, paused: self.paused.covers(stream, None) });
        }
    }

    fn leave(&mut self, reason: LeaveReason, _ctx: &mut Context<Self>) {
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

    fn reply(&self, to: Option<String>, reply: ControlReply) {
        let Some(subject) = to else { return };
        if !cluster::reply_subject_allowed(&subject) {
            warn!(reply_to = %subject, request_id = %reply.request_id, "control request with a reply subject that is not an inbox: not answered");
            return;
        }
        let body = serde_json::to_vec(&reply).unwrap_or_default();
        let fut = self.s.broker.core_publish(CoreMessage::new(subject, body));
        actix::spawn(async move {
            let _ = fut.await;
        });
    }

    fn answer(&self, request_id: &str, ok: bool, message: impl Into<String>) -> ControlReply {
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

    fn control(&mut self, msg: CoreMessage, ctx: &mut Context<Self>) {
        let verb = msg.subject.rsplit('.').next().unwrap_or_default().to_owned();
        if verb == "changed" {
            // Another node released a lease: look now rather than at the next tick.
            self.scan(ctx);
            return;
        }
        let request: ControlRequest = match serde_json::from_slice(&msg.payload) {
            Ok(r) => r,
            Err(e) => {
                warn!(subject = %msg.subject, error = %e, "malformed control request ignored");
                let reply = self.answer(
                    "",
                    false,
                    format!("malformed request body: {e}; send JSON like {{\"request_id\":\"…\"}}"),
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
                let record = serde_json::from_slice::<NodeRecord>(&act.s.node_value).ok();
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

/// Deletes this process's membership key, compare-and-set, unless another process
/// holds the id by now.
async fn release_membership(
    broker: &SharedBroker,
    bucket: &str,
    (node, incarnation): &(String, String),
) -> Result<(), BrokerError> {
    for _ in 0..5 {
        let Some(e) = broker.kv_get(bucket, node).await? else { return Ok(()) };
        let mine = serde_json::from_slice::<crate::cluster::NodeRecord>(&e.value)
            .is_ok_and(|r| &r.node == node && &r.incarnation == incarnation);
        if !mine {
            return Ok(());
        }
        match broker.kv_delete(bucket, node, Some(e.revision)).await {
            Err(BrokerError::KvWrongRevision { .. }) => {}
            other => return other,
        }
    }
    Ok(())
}

/// Deletes a lease this node holds. A renewal may have moved its revision since we
/// last looked: re-read, and delete only while the record still names this node.
async fn release_lease(
    broker: SharedBroker,
    bucket: String,
    key: String,
    (node, incarnation): (String, String),
    mut revision: u64,
) -> Result<(), BrokerError> {
    for _ in 0..5 {
        match broker.kv_delete(&bucket, &key, Some(revision)).await {
            Err(BrokerError::KvWrongRevision { .. }) => {}
            other => return other,
        }
        match broker.kv_get(&bucket, &key).await? {
            Some(e)
                if serde_json::from_slice::<LeaseRecord>(&e.value).is_ok_and(|r| r.held_by(&node, &incarnation)) =>
            {
                revision = e.revision;
            }
            // Gone, or someone else's by now: nothing of ours to delete.
            _ => return Ok(()),
        }
    }
    Err(BrokerError::KvWrongRevision { bucket, key, expected: revision })
}

impl Held {
    fn new(revision: u64, fence: Fence) -> Self {
        Self {
            acquired: Instant::now(),
            revision,
            epoch: revision,
            slot: None,
            fence,
            renewing: false,
            releasing: false,
            done: None,
        }
    }
}

impl Actor for Membership {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let period = self.s.config.scan_interval;
        self.s.timers.do_send(Every { period, target: ctx.address().recipient(), tick: Tick::Scan });
        // Renewals keep their own beat, a quarter of the TTL, whatever scans do: a lease
        // is renewed at least once a quarter TTL, well inside the two thirds it stays
        // valid locally.
        let period = self.s.config.lease_ttl.min(self.s.config.node_ttl) / 4;
        self.s.timers.do_send(Every { period, target: ctx.address().recipient(), tick: Tick::Renew });
        self.scan(ctx);
    }
}

impl Handler<Tick> for Membership {
    type Result = ();

    fn handle(&mut self, tick: Tick, ctx: &mut Context<Self>) {
        if self.gone {
            return;
        }
        match tick {
            Tick::Scan => self.scan(ctx),
            Tick::Renew => {
                self.heartbeat(ctx);
                self.renew_all(ctx);
                self.fence_expired(ctx);
            }
            _ => {}
        }
    }
}

impl Handler<SlotEnded> for Membership {
    type Result = ();

    fn handle(&mut self, ended: SlotEnded, ctx: &mut Context<Self>) {
        let Some(part) = self.slot_of.remove(&ended.slot) else { return };
        // A partition drained or at its end of stream is done for this run: record it
        // before the lease goes, so no node starts it again in the run.
        let done = match ended.outcome {
            Outcome::EndOfStream => {
                info!(stream = %part.0, partition = part.1, "partition reached its end of stream");
                Done::Ended
            }
            Outcome::Drained => {
                info!(stream = %part.0, partition = part.1, "partition drained");
                Done::Drained
            }
            _ => {
                if self.held.contains_key(&part) {
                    self.delete_lease(&part);
                }
                return;
            }
        };
        if let Some(h) = self.held.get_mut(&part) {
            h.slot = None;
            h.done = Some(done);
        }
        self.record_done(part, done, 0, ctx);
    }
}

impl Handler<Leave> for Membership {
    type Result = ();

    fn handle(&mut self, Leave(reason): Leave, ctx: &mut Context<Self>) {
        self.leave(reason, ctx);
    }
}

impl Handler<Deregister> for Membership {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, _: Deregister, _: &mut Context<Self>) -> Self::Result {
        self.gone = true;
        let broker = self.s.broker.clone();
        let record = DrainedRecord { run_id: self.s.run_id.clone(), node: self.s.node.clone() };
        let value = Bytes::from(serde_json::to_vec(&record).unwrap_or_default());
        let leases: Vec<(String, u64, Option<String>)> = std::mem::take(&mut self.held)
            .into_iter()
            .map(|(part, h)| {
                h.fence.revoke();
                (keys::lease(&part.0, part.1), h.revision, h.done.map(|d| d.key(&part)))
            })
            .collect();
        let b = self.buckets.clone();
        let holder = (self.s.node.clone(), self.s.incarnation.clone());
        let node = holder.0.clone();
        let registered = self.registered;
        let changed = self.s.subjects.control("all.changed");
        Box::pin(
            async move {
                // Done for the run, their records not stored yet: once more, briefly (a
                // stop is bounded), then the leases go anyway.
                let records: Vec<&String> = leases.iter().filter_map(|(_, _, done)| done.as_ref()).collect();
                if !records.is_empty() {
                    let puts = records.iter().map(|key| broker.kv_put(&b.control, key, value.clone()));
                    let stored = tokio::time::timeout(RECORD_AT_STOP, futures::future::join_all(puts)).await;
                    for (i, record) in records.iter().enumerate() {
                        if !stored.as_ref().is_ok_and(|results| results.get(i).is_some_and(Result::is_ok)) {
                            warn!(%record, "stopping before the partition was recorded as done for the run: another node will take it up again in this run");
                        }
                    }
                }
                for (key, rev, _) in leases {
                    if let Err(e) =
                        release_lease(broker.clone(), b.leases.clone(), key.clone(), holder.clone(), rev).await
                    {
                        debug!(%key, error = %e, "lease not deleted; it expires on its own");
                    }
                }
                // Our own key, and only while it is still this process's: after a long
                // pause a new process may have registered the same id.
                if registered && let Err(e) = release_membership(&broker, &b.nodes, &holder).await {
                    debug!(error = %e, "membership not deleted; it expires on its own");
                }
                let _ = broker.core_publish(CoreMessage::new(changed, Bytes::new())).await;
                let _ = broker.flush().await;
                info!(%node, "left the cluster");
            }
            .into_actor(self)
            // Nothing is left to do: stop, letting go of the container, the timer
            // service, the reaper and the control subscriptions.
            .map(|(), _, ctx| ctx.stop()),
        )
    }
}

impl Handler<ControlMessage> for Membership {
    type Result = ();

    fn handle(&mut self, ControlMessage(msg): ControlMessage, ctx: &mut Context<Self>) {
        self.control(msg, ctx);
    }
}
