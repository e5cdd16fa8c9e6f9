//! A container claims only what its task can start (DESIGN §3, "claim bound"): a queue
//! input pulls `max_concurrency - in_flight`, so the backlog stays in the broker and
//! other nodes can take it. On the embedded broker and tokio's paused clock, where the
//! broker's count of delivered, unacknowledged messages is exact at any moment.
//!
//! The queue consumer's own `max_ack_pending` is 10,000 (it is shared by every node),
//! so nothing but the container keeps a node from taking the whole backlog.

use flotilla_actors::{Job, StreamDef, Task, TaskContext, TaskError};
use flotilla_transport::EmbeddedBroker;
use flotilla_transport::broker::{OutboundMessage, SharedBroker};
use flotilla_transport::wire::{Codec, headers};
use serde::{Deserialize, Serialize};
use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Job10s {
    id: u64,
}

const JOBS: StreamDef<Job10s> = StreamDef::queue("jobs");
const MAX_CONCURRENCY: usize = 3;

/// Works 10 s on each job, counting the jobs it started.
struct Slow {
    started: Rc<Cell<u64>>,
}

impl Task for Slow {
    type Input = Job10s;

    async fn process(&mut self, _job: Job10s, ctx: &mut TaskContext) -> Result<(), TaskError> {
        self.started.set(self.started.get() + 1);
        ctx.defer(async {
            tokio::time::sleep(Duration::from_secs(10)).await;
            Ok(())
        });
        Ok(())
    }
}

async fn publish(b: &SharedBroker, id: u64) {
    let payload = Codec::default().encode(&Job10s { id }).expect("encode");
    let msg = OutboundMessage::new("flotilla.t.jobs", payload)
        .with_id(format!("job-{id}"))
        .with_header(headers::KEY, id.to_string());
    b.publish(msg).await.expect("publish");
}

/// (delivered and unacknowledged, not yet delivered) of the queue consumer.
async fn claimed_and_waiting(b: &SharedBroker) -> (u64, u64) {
    let c = b.consumer_state("FLOTILLA_t_jobs", "jobs-workers").await.expect("consumer");
    (c.num_ack_pending, c.num_pending)
}

/// 20 jobs of 10 s each, three at a time: at every moment between completions the node
/// holds exactly the three it is working on and the other 17, 14, 11 … wait in the
/// broker; none is claimed ahead of a free slot.
#[actix_rt::test]
async fn a_queue_node_claims_only_as_many_messages_as_it_has_free_slots() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let started: Rc<Cell<u64>> = Rc::default();
    let s = started.clone();
    let job = Job::new("t")
        .task(JOBS, move |_| Slow { started: s.clone() })
        .max_concurrency(MAX_CONCURRENCY)
        .ack_wait(Duration::from_secs(60))
        .start(b.clone())
        .await
        .expect("start");
    for id in 0..20 {
        publish(&b, id).await;
    }
    // Mid-way through each round of three (the jobs of round r end at about 10·r s).
    for round in 0..5u64 {
        tokio::time::sleep(if round == 0 { Duration::from_secs(5) } else { Duration::from_secs(10) }).await;
        let (claimed, waiting) = claimed_and_waiting(&b).await;
        let running = MAX_CONCURRENCY as u64;
        assert_eq!(
            (claimed, waiting, started.get()),
            (running, 20 - running * (round + 1), running * (round + 1)),
            "round {round}: (claimed, waiting in the broker, started) with {MAX_CONCURRENCY} slots"
        );
    }
    job.stop();
    job.wait().await.expect("stop");
}
