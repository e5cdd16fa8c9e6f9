//! Joining a cluster: [`start_node`] registers the node in the NODES bucket (taking its
//! id over from a previous process that is provably gone), agrees on the current run,
//! starts the job's container ([`Job::start_member`]) and the node's [`Membership`].

use super::host;
use super::membership::{Buckets, ControlMessage, Membership, MembershipSetup};
use actix::prelude::*;
use bytes::Bytes;
use flotilla_actors::cluster::now_ms;
use flotilla_actors::job::{NodeLink, patiently};
use flotilla_actors::{Job, JobError, RunningJob};
use flotilla_proto::cluster::control::{
    self as cluster, ClusterConfig, NodeRecord, PauseRecord, RequestRecord, RunRecord, TopologyRecord, decode, encode,
    keys,
};
use flotilla_proto::cluster::run_end::run_over;
use flotilla_transport::broker::{BrokerError, SharedBroker};
use flotilla_transport::topology;
use flotilla_transport::wire::{JobName, MessageId, Subjects};
use futures::StreamExt;
use std::time::Duration;
use tracing::info;

/// Starts a job as one node of a cluster: `job.start_node(broker, node, config)`.
pub trait JoinCluster {
    /// Provisions and starts the job as one node of a cluster (DESIGN §7); see
    /// [`start_node`].
    ///
    /// # Errors
    /// As [`start_node`].
    fn start_node(
        self,
        broker: SharedBroker,
        node: &str,
        config: ClusterConfig,
    ) -> impl Future<Output = Result<RunningJob, JobError>>;
}

impl JoinCluster for Job {
    fn start_node(
        self,
        broker: SharedBroker,
        node: &str,
        config: ClusterConfig,
    ) -> impl Future<Output = Result<RunningJob, JobError>> {
        start_node(self, broker, node, config)
    }
}

/// Provisions and starts `job` as one node of a cluster (DESIGN §7): registers `node`
/// in the NODES bucket (refusing a node id that is alive), joins the cluster's run,
/// consumes the queue inputs at once and the ordered partitions whose leases it
/// acquires, and follows the desired state and control requests.
///
/// # Errors
/// [`JobError::NodeIdTaken`] when another live node has this id,
/// [`JobError::NodeIdInvalid`] for an id unfit for subjects and keys, and whatever
/// [`Job::start`] refuses.
pub async fn start_node(
    job: Job,
    broker: SharedBroker,
    node: &str,
    config: ClusterConfig,
) -> Result<RunningJob, JobError> {
    if node.is_empty() || !node.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        return Err(JobError::NodeIdInvalid(node.to_owned()));
    }
    job.provision(broker.clone()).await?;
    let subjects = Subjects::new(JobName::new(job.name().to_owned())?);
    let b = Buckets::new(&subjects);
    for (bucket, ttl) in [(cluster::NODES, config.node_ttl), (cluster::LEASES, config.lease_ttl)] {
        let spec = topology::bucket(&subjects, bucket, Some(ttl)).with_replicas(job.replica_count());
        match patiently("create the cluster's buckets", || async { Ok(broker.ensure_kv(spec.clone()).await?) }).await {
            Ok(()) => {}
            Err(JobError::Broker(BrokerError::ConfigMismatch { field, existing, .. })) if field == "max_age" => {
                return Err(JobError::Misconfigured {
                    job: job.name().to_owned(),
                    problem: format!(
                        "the cluster runs with a lease TTL of {} (bucket KV_{}), this node asks for {ttl:?}: every node of a job must use the same TTL. Start it with --lease-ttl matching the others, or stop every node and delete the buckets KV_{} and KV_{} to change it",
                        existing.trim_start_matches("Some(").trim_end_matches(')'),
                        subjects.bucket_name(bucket),
                        subjects.bucket_name(cluster::NODES),
                        subjects.bucket_name(cluster::LEASES),
                    ),
                });
            }
            Err(e) => return Err(e),
        }
    }
    let control = topology::bucket(&subjects, cluster::CONTROL, None).with_replicas(job.replica_count());
    patiently("create the cluster's buckets", || async { Ok(broker.ensure_kv(control.clone()).await?) }).await?;

    let record = NodeRecord {
        node: node.to_owned(),
        pid: std::process::id(),
        host: host::host_name(),
        started_ms: now_ms(),
        incarnation: MessageId::new_v7().to_string(),
    };
    let incarnation = record.incarnation.clone();
    let node_value = Bytes::from(encode(&record));
    let register = || async {
        match broker.kv_create(&b.nodes, node, node_value.clone()).await {
            // A create whose reply was lost may have been stored: ours, if it
            // holds this incarnation.
            Err(BrokerError::KvKeyExists { .. }) => match broker.kv_get(&b.nodes, node).await? {
                Some(entry) if entry.value == node_value => Ok(entry.revision),
                _ => Err(BrokerError::KvKeyExists { bucket: b.nodes.clone(), key: node.to_owned() }.into()),
            },
            other => Ok(other?),
        }
    };
    let node_revision = match patiently("register the node", register).await {
        Ok(rev) => rev,
        Err(JobError::Broker(BrokerError::KvKeyExists { .. })) => {
            // Restart in place: the id is this node's again if its holder is gone.
            let beat = config.lease_ttl.min(config.node_ttl) / 4;
            match take_over_node_id(&broker, &b.nodes, &record, node_value.clone(), beat).await? {
                Ok(rev) => rev,
                Err(holder) => {
                    return Err(JobError::NodeIdTaken {
                        job: job.name().to_owned(),
                        node: node.to_owned(),
                        holder,
                        ttl: config.node_ttl,
                    });
                }
            }
        }
        Err(e) => return Err(e),
    };
    match join(job, broker.clone(), &subjects, &b, (node, incarnation), node_value, node_revision, config).await {
        Ok(running) => Ok(running),
        Err(e) => {
            // Do not block a restart with this id for a whole TTL.
            let _ = broker.kv_delete(&b.nodes, node, Some(node_revision)).await;
            Err(e)
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn join(
    job: Job,
    broker: SharedBroker,
    subjects: &Subjects,
    b: &Buckets,
    (node, incarnation): (&str, String),
    node_value: Bytes,
    node_revision: u64,
    config: ClusterConfig,
) -> Result<RunningJob, JobError> {
    let topology = job.topology();
    let read_control_state = || async {
        let run_id = current_run(&broker, b, &topology, job.requested_run_id().map(str::to_owned)).await?;
        broker.kv_put(&b.control, keys::TOPOLOGY, Bytes::from(encode(&topology))).await?;
        // A stop request for an earlier process with this id is not for this one.
        if broker.kv_get(&b.control, &keys::stop(node)).await?.is_some() {
            broker.kv_delete(&b.control, &keys::stop(node), None).await?;
        }
        let shutdown_seen = broker.kv_get(&b.control, keys::SHUTDOWN).await?.map_or(0, |e| e.revision);
        // An unreadable record pauses nothing, as a missing one.
        let paused: PauseRecord = match broker.kv_get(&b.control, keys::PAUSED).await? {
            Some(e) => decode(keys::PAUSED, &e.value).unwrap_or_default(),
            None => PauseRecord::default(),
        };
        Ok((run_id, shutdown_seen, paused))
    };
    let (run_id, shutdown_seen, paused) = patiently("read the cluster's desired state", read_control_state).await?;

    // Control requests reach the membership actor as messages; the subscriptions
    // live in its context, so they end when it stops.
    let mut control = Vec::new();
    for pattern in [subjects.control("all.*"), subjects.control(&format!("node.{node}.*"))] {
        control.push(broker.subscribe(&pattern, None).await?);
    }
    let mut membership_ctx = Context::<Membership>::new();
    for requests in control {
        membership_ctx.add_message_stream(requests.map(ControlMessage));
    }
    let membership = membership_ctx.address();
    let member =
        job.start_member(broker.clone(), run_id.clone(), &paused, config.lease_ttl, membership.clone().recipient())?;
    let (left, _) = tokio::sync::watch::channel(None);
    membership_ctx.run(Membership::new(MembershipSetup {
        broker: broker.clone(),
        subjects: subjects.clone(),
        node: node.to_owned(),
        incarnation,
        node_revision,
        node_value,
        run_id: run_id.clone(),
        config,
        ordered: member.ordered,
        queue_slots: member.queue_slots,
        takeover: member.takeover,
        container: member.container.clone(),
        timers: member.timers,
        reaper: member.reaper,
        shutdown_seen,
        left: left.clone(),
        parked: member.parked,
    }));
    let link = NodeLink { leave: membership.clone().recipient(), deregister: membership.recipient(), left };
    Ok(RunningJob::joined(member.container, member.exit, run_id, link))
}

/// Takes over the node id `record.node` whose registration exists: at once when its
/// holder is provably gone (same host, process gone), else after watching it for two
/// heartbeats and a half without a renewal. Returns the new revision of the
/// registration, or who holds it (`Err`) when the holder is alive.
///
/// # Errors
/// Whatever the broker returns.
async fn take_over_node_id(
    broker: &SharedBroker,
    bucket: &str,
    record: &NodeRecord,
    value: Bytes,
    beat: Duration,
) -> Result<Result<u64, String>, BrokerError> {
    let node = record.node.as_str();
    let Some(found) = broker.kv_get(bucket, node).await? else {
        // It expired meanwhile.
        return Ok(broker
            .kv_create(bucket, node, value)
            .await
            .map_err(|_| "a node registering at the same moment".to_owned()));
    };
    let previous = decode::<NodeRecord>(node, &found.value).ok();
    let holder = previous
        .as_ref()
        .map_or_else(|| "an entry this version cannot read".to_owned(), |r| format!("pid {} on {}", r.pid, r.host));
    let gone = previous.as_ref().is_some_and(|r| r.provably_gone(&record.host, record.pid, host::process_alive));
    if !gone {
        // Maybe alive (another host, or a live pid): a live node renews every beat.
        info!(%node, %holder, wait = ?beat.mul_f64(2.5), "node id registered by another process: waiting to see whether it is alive");
        tokio::time::sleep(beat.mul_f64(2.5)).await;
        match broker.kv_get(bucket, node).await? {
            Some(now) if now.revision == found.revision => {}
            None => {
                return Ok(broker.kv_create(bucket, node, value).await.map_err(|_| holder));
            }
            Some(_) => return Ok(Err(holder)),
        }
    }
    match broker.kv_update(bucket, node, value, found.revision).await {
        Ok(revision) => {
            info!(%node, previous = %holder, "restart in place: took the node id over from its previous process, which is gone");
            Ok(Ok(revision))
        }
        Err(BrokerError::KvWrongRevision { .. }) => Ok(Err(holder)),
        Err(e) => Err(e),
    }
}

/// The cluster's current run: the one in the CONTROL bucket, unless it was drained to
/// the end (then a new one begins); created when there is none.
async fn current_run(
    broker: &SharedBroker,
    b: &Buckets,
    topology: &TopologyRecord,
    wanted: Option<String>,
) -> Result<String, JobError> {
    for _ in 0..5 {
        let fresh = RunRecord {
            run_id: wanted.clone().unwrap_or_else(|| MessageId::new_v7().to_string()),
            started_ms: now_ms(),
        };
        let Some(entry) = broker.kv_get(&b.control, keys::RUN).await? else {
            match broker.kv_create(&b.control, keys::RUN, Bytes::from(encode(&fresh))).await {
                Ok(_) => return Ok(fresh.run_id),
                Err(BrokerError::KvKeyExists { .. } | BrokerError::KvWrongRevision { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        let Ok(current) = decode::<RunRecord>(keys::RUN, &entry.value) else {
            broker.kv_update(&b.control, keys::RUN, Bytes::from(encode(&fresh)), entry.revision).await?;
            return Ok(fresh.run_id);
        };
        if !run_drained(broker, b, topology, &current.run_id).await? {
            return Ok(current.run_id);
        }
        match broker.kv_update(&b.control, keys::RUN, Bytes::from(encode(&fresh)), entry.revision).await {
            Ok(_) => {
                tracing::info!(previous = %current.run_id, run = %fresh.run_id, "the previous run was drained or ended: a new run begins");
                return Ok(fresh.run_id);
            }
            Err(BrokerError::KvWrongRevision { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(JobError::Misconfigured {
        job: String::new(),
        problem: "could not agree on the current run with the other nodes after 5 tries".into(),
    })
}

/// Whether `run` is over: every ordered partition reached its end of stream in it, or
/// a drain was requested for it and every ordered partition recorded its drain.
async fn run_drained(
    broker: &SharedBroker,
    b: &Buckets,
    topology: &TopologyRecord,
    run: &str,
) -> Result<bool, JobError> {
    // Drained partitions count only when a drain of the run was asked.
    let drain_asked = match broker.kv_get(&b.control, keys::DRAIN).await? {
        Some(d) => decode::<RequestRecord>(keys::DRAIN, &d.value).is_ok_and(|d| d.run_id == run),
        None => false,
    };
    let mut ends = Vec::new();
    for (stream, p) in topology.partitions() {
        ends.push(super::read_end(broker, &b.control, &stream, p, run).await?);
    }
    Ok(run_over(ends, drain_asked))
}
