//! What the cluster layer (`flotilla-node`'s `cluster` module) needs from a [`Job`] to
//! run it as one node of a cluster: the job's inputs as a [`TopologyRecord`], and
//! [`Job::start_member`], which starts the container and the node's services with the
//! queue inputs consuming and the ordered partitions left for the membership to add as
//! it acquires their leases.

use super::{Job, JobError, TaskEntry, node_services, partition_spec, slot};
use crate::container::{Container, PartitionFactory, SlotEnded};
use crate::reaper::Reaper;
use crate::stream::StreamKind;
use crate::task::{ParkedKeys, TaskEnv};
use crate::timer_service::TimerService;
use actix::prelude::*;
use flotilla_proto::cluster::control::{InputRecord, PauseRecord, TopologyRecord};
use flotilla_transport::broker::{ConsumerSpec, SharedBroker};
use flotilla_transport::wire::{StreamName, Subjects};
use std::rc::Rc;
use std::time::Duration;
use tokio::sync::oneshot;

pub use super::running::JobExit;

/// The JetStream stream and consumer of an ordered partition, for taking it over.
pub type TakeoverSpec = Rc<dyn Fn(&str, u32) -> Option<(String, ConsumerSpec)>>;

/// A job started as one node of a cluster ([`Job::start_member`]): what its
/// membership works with.
pub struct Member {
    /// The container; ordered partitions are added to it as their leases are acquired.
    pub container: Addr<Container>,
    /// The node's timer service.
    pub timers: Addr<TimerService>,
    /// The node's reaper.
    pub reaper: Addr<Reaper>,
    /// Ordered inputs: `(stream, partitions)`.
    pub ordered: Vec<(String, u32)>,
    /// Queue inputs' slots in the container: `(slot, stream)`.
    pub queue_slots: Vec<(usize, String)>,
    /// Where each partition's consumer is.
    pub takeover: TakeoverSpec,
    /// The parked keys the node's queue workers check.
    pub parked: ParkedKeys,
    /// How the container reports its end ([`RunningJob::joined`](crate::RunningJob::joined)).
    pub exit: JobExit,
}

impl std::fmt::Debug for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Member").field("ordered", &self.ordered).finish_non_exhaustive()
    }
}

impl Job {
    /// The job's inputs, as the CONTROL bucket's `topology` key holds them.
    pub fn topology(&self) -> TopologyRecord {
        TopologyRecord {
            inputs: self
                .tasks
                .iter()
                .map(|t| InputRecord {
                    stream: t.stream.to_owned(),
                    partitions: match t.kind {
                        StreamKind::Ordered { partitions } => Some(partitions),
                        StreamKind::Queue => None,
                    },
                })
                .collect(),
        }
    }

    /// The run id given with [`run_id`](Self::run_id), if any.
    pub fn requested_run_id(&self) -> Option<&str> {
        self.run_id.as_deref()
    }

    /// Starts the job's container and the node's services on the current arbiter as one
    /// node of a cluster running `run_id`, after the node registered (the job is
    /// provisioned): the queue inputs consume at once (paused as `paused` says), the
    /// ordered partitions wait for the membership (`observer`, told when a slot ends) to
    /// add them. A claim is bounded by a quarter of `lease_ttl`, so one sent just before
    /// a partition's fence closes ends on the server before the lease can expire.
    ///
    /// # Errors
    /// [`JobError::Name`] for a bad stream name.
    pub fn start_member(
        self,
        broker: SharedBroker,
        run_id: String,
        paused: &PauseRecord,
        lease_ttl: Duration,
        observer: Recipient<SlotEnded>,
    ) -> Result<Member, JobError> {
        // A claim sent just before a partition's fence closes must end on the server
        // before the lease can expire (at a third of the TTL after the fence), or it
        // could take messages from the next owner's consumer.
        let mut this = self;
        this.container.claim_wait = this.container.claim_wait.min(lease_ttl / 4);
        // A released partition is handed over only once its claim is back: idle
        // partitions must not wait longer than busy ones.
        this.container.idle_claim_wait = this.container.claim_wait;
        let subjects = Subjects::new(flotilla_transport::wire::JobName::new(this.name.clone())?);
        let env =
            Rc::new(TaskEnv::new(broker.clone(), this.codec, subjects.clone(), run_id).with_replicas(this.replicas));
        let mut slots = Vec::new();
        let mut queue_slots = Vec::new();
        let mut ordered = Vec::new();
        let container_config = this.stopping_config();
        let tasks: Rc<Vec<TaskEntry>> = Rc::new(this.tasks);
        for t in tasks.iter() {
            let name = StreamName::new(t.stream)?;
            match t.kind {
                StreamKind::Ordered { partitions } => ordered.push((t.stream.to_owned(), partitions)),
                StreamKind::Queue => {
                    queue_slots.push((slots.len(), t.stream.to_owned()));
                    let mut spec = slot(
                        t,
                        &env,
                        None,
                        slots.len(),
                        subjects.stream_name(&name).into(),
                        Subjects::queue_consumer(&name).into(),
                        t.config.max_concurrency,
                        None,
                    );
                    spec.paused = paused.covers(t.stream, None);
                    slots.push(spec);
                }
            }
        }
        let factory_env = env.clone();
        let factory_subjects = subjects.clone();
        let factory_tasks = tasks.clone();
        let factory: PartitionFactory = Rc::new(move |stream, p, epoch, fence, paused| {
            let t = factory_tasks.iter().find(|t| t.stream == stream)?;
            let name = StreamName::new(t.stream).ok()?;
            let c = &t.config;
            let mut spec = slot(
                t,
                &factory_env,
                Some(p),
                0,
                factory_subjects.stream_name(&name).into(),
                Subjects::partition_consumer(&name, p).into(),
                c.window as usize,
                Some((epoch, fence)),
            );
            spec.takeover = Some(partition_spec(&factory_subjects, t, &name, p));
            spec.paused = paused;
            Some(spec)
        });
        let takeover_subjects = subjects.clone();
        let takeover: TakeoverSpec = Rc::new(move |stream, p| {
            let t = tasks.iter().find(|t| t.stream == stream)?;
            let name = StreamName::new(t.stream).ok()?;
            Some((takeover_subjects.stream_name(&name), partition_spec(&takeover_subjects, t, &name, p)))
        });
        let (timers, reaper) = node_services(&broker, &subjects);
        let (tx, rx) = oneshot::channel();
        let stop_deadline = container_config.stop_timeout;
        let container = Container::new(broker, subjects, container_config, slots, timers.clone(), reaper.clone(), tx)
            .observed_by(observer, factory)
            .start();
        Ok(Member {
            container,
            timers,
            reaper,
            ordered,
            queue_slots,
            takeover,
            parked: env.parked.clone(),
            exit: JobExit { exit: rx, stop_deadline },
        })
    }
}
