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
//! * **Plan**: [`flotilla_proto::cluster::assignment::plan`] over the live nodes and the current holders,
//!   so every node computes the same fair share. Orphaned partitions are taken at once;
//!   partitions held by a live node move only after membership has been stable for
//!   `settle`, at most `max_moves` per scan, by a graceful hand-over (finish, commit,
//!   delete the lease) so the next owner starts at once and nothing is redelivered.
//! * **Desired state**: every scan reads the CONTROL bucket (paused, drain, shutdown,
//!   stop), so a node that was disconnected catches up; control requests on
//!   `flotilla.<J>._ctl.…` only make it look sooner, and answer `status`.
//!
//! Supervision: started by [`start_node`](super::start_node) on the container's
//! arbiter after the node registered; ticked by the [`TimerService`]. It stops the
//! container to leave; [`Deregister`] then removes the node's leases and key.

mod control;
mod done;
mod leases;
mod messages;
mod scan;

use done::Done;
pub use flotilla_actors::job::{Deregister, Leave, LeaveReason, TakeoverSpec};
use leases::{release_lease, release_membership};
pub use messages::ControlMessage;

use actix::prelude::*;
use bytes::Bytes;
use flotilla_actors::container::{Container, SlotEnded};
use flotilla_actors::fence::Fence;
use flotilla_actors::reaper::Reaper;
use flotilla_actors::task::ParkedKeys;
use flotilla_actors::task_worker::Outcome;
use flotilla_actors::timer_service::{Every, Tick, TimerService};
use flotilla_proto::cluster::control::{
    self as cluster, ClusterConfig, ControlReply, DrainedRecord, LeaseRecord, ParkedRecord, PauseRecord, RequestRecord,
    encode, keys,
};
use flotilla_proto::cluster::run_end::PartitionEnd;
use flotilla_transport::broker::{CoreMessage, KvEntry, SharedBroker};
use flotilla_transport::wire::Subjects;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use tokio::time::Instant;
use tracing::{debug, info, warn};

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
    /// This process's incarnation of the node id ([`NodeRecord::incarnation`](flotilla_proto::cluster::control::NodeRecord::incarnation)).
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
    pub parked: ParkedKeys,
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
    parked: ParkedRecord,
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

    /// What this node knows of `part`'s end in the current run: its records as the last
    /// scan read them, and what this node recorded itself since.
    fn end_of(&self, part: &Part) -> PartitionEnd {
        PartitionEnd { drained: self.drained.contains(part), ended: self.ended.contains(part) }
    }

    /// Whether a drain of the current run is asked.
    fn drain_asked(&self) -> bool {
        self.drain.as_ref().is_some_and(|d| d.run_id == self.s.run_id)
    }

    fn lease_value(&self, epoch: u64) -> Bytes {
        let record = LeaseRecord { node: self.s.node.clone(), epoch, incarnation: self.s.incarnation.clone() };
        Bytes::from(encode(&record))
    }

    /// How long a renewal sent at `sent` keeps the partition ours: two thirds of the
    /// TTL, so we stop well before the server can expire the lease.
    fn valid_after(&self, sent: Instant) -> Instant {
        sent + self.s.config.lease_ttl.mul_f64(2.0 / 3.0)
    }
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
        let value = Bytes::from(encode(&record));
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
