//! Durable timers whose fire was already promoted into a paused (or lagging) partition
//! when the task cancelled or re-armed them: the stale fire is dropped, on the node that
//! made the change and on a partition's next owner. Embedded broker on tokio's paused
//! clock (and the next owner's case once more on a real nats-server), nodes of a
//! cluster in one process.

use flotilla_actors::cluster::ClusterConfig;
use flotilla_actors::{Job, RunningJob, StreamDef, Task, TaskContext, TaskError};
use flotilla_node::ControlClient;
use flotilla_node::cluster::JoinCluster;
use flotilla_tests::Record;
use flotilla_transport::EmbeddedBroker;
use flotilla_transport::broker::{OutboundMessage, SharedBroker};
use flotilla_transport::wire::{Codec, headers, partition_for};
use std::cell::RefCell;
use std::time::Duration;
use tokio::time::{Instant, sleep};

const IN: StreamDef<Record> = StreamDef::ordered("in", 4);
const OUT: StreamDef<Record> = StreamDef::ordered("out", 4);

thread_local! {
    /// Commands processed and timers fired, in order (each test runs on its own thread).
    static SEEN: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
    /// When each timer fired.
    static FIRED_AT: RefCell<Vec<(String, Instant)>> = const { RefCell::new(Vec::new()) };
}

fn seen() -> Vec<String> {
    SEEN.with(|s| s.borrow().clone())
}

fn fired() -> Vec<String> {
    FIRED_AT.with(|f| f.borrow().iter().map(|(name, _)| name.clone()).collect())
}

/// Arms and cancels durable timers as its records say (`arm:<name>:<secs>`,
/// `cancel:<name>`); a timer that fires sends `fired <name>`.
struct Alarm;

impl Task for Alarm {
    type Input = Record;
    async fn process(&mut self, r: Record, ctx: &mut TaskContext) -> Result<(), TaskError> {
        SEEN.with(|s| s.borrow_mut().push(r.body.clone()));
        match r.body.split(':').collect::<Vec<_>>().as_slice() {
            ["arm", name, secs] => ctx.schedule_durable(name, Duration::from_secs(secs.parse().unwrap_or(0))),
            ["cancel", name] => ctx.cancel_timer(name),
            _ => Err(TaskError::failed(format!("unknown command {}", r.body))),
        }
    }
    async fn timer(&mut self, name: String, ctx: &mut TaskContext) -> Result<(), TaskError> {
        SEEN.with(|s| s.borrow_mut().push(format!("fired {name}")));
        FIRED_AT.with(|f| f.borrow_mut().push((name.clone(), Instant::now())));
        ctx.send(&OUT, "alarm", Record { id: 0, body: format!("fired {name}") }).await
    }
}

/// The partition every command goes to (one key).
fn partition() -> u32 {
    partition_for("alarm", 4)
}

async fn command(b: &SharedBroker, id: u64, body: &str) {
    let payload = Codec::default().encode(&Record { id, body: body.into() }).expect("encode");
    let subject = format!("flotilla.t.in.{}", partition());
    let msg = OutboundMessage::new(subject, payload).with_id(format!("alarm-{id}")).with_header(headers::KEY, "alarm");
    b.publish(msg).await.expect("publish");
}

async fn node(b: &SharedBroker, id: &str) -> RunningJob {
    Job::new("t").task(IN, |_| Alarm).output(OUT).start_node(b.clone(), id, ClusterConfig::default()).await.expect(id)
}

/// Waits until `what` holds; a LIVENESS failure naming it after 10 min (of paused time;
/// 10 s on a real server: each wait is short there).
async fn until(what: &str, check: impl Fn() -> bool) {
    for _ in 0..6000 {
        if check() {
            return;
        }
        sleep(Duration::from_millis(100)).await;
    }
    panic!("LIVENESS: {what} did not happen within 10 minutes; seen {:?}", seen());
}

/// Messages in the partition's input (commands and promoted fires).
async fn in_partition(b: &SharedBroker) -> u64 {
    let counts = b.subject_counts("FLOTILLA_t_in", &format!("flotilla.t.in.{}", partition())).await.expect("counts");
    counts.values().sum()
}

/// Arms `a` (due in `due` s), pauses the partition, sends `change` behind the pause and
/// waits until the timer was promoted into the paused partition, behind `change`.
async fn promote_into_a_paused_partition(b: &SharedBroker, control: &ControlClient, change: &str, due: u64) {
    let arm = format!("arm:a:{due}");
    command(b, 1, &arm).await;
    until("the timer is armed", || seen() == [arm.as_str()]).await;
    control.set_paused(Some("in"), Some(partition()), true).await.expect("pause");
    sleep(Duration::from_secs(3)).await;
    command(b, 2, change).await;
    for _ in 0..600 {
        if in_partition(b).await == 3 {
            break;
        }
        sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(in_partition(b).await, 3, "LIVENESS: the fire was promoted behind the change");
    let last = b.stream_state("FLOTILLA_t_in").await.expect("input").last_seq;
    let fire = b.get_message("FLOTILLA_t_in", last).await.expect("read").expect("the last message");
    assert_eq!(fire.headers.get(headers::KIND), Some("timer"), "the fire came after the change (else raise `due`)");
    assert_eq!(seen(), [arm.as_str()], "the paused partition ran nothing more");
}

/// A timer cancelled by a message that was already in its partition when the fire was
/// promoted behind it (the partition paused) never fires.
#[actix_rt::test]
async fn a_timer_cancelled_before_its_promoted_fire_runs_does_not_fire() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let n1 = node(&b, "n1").await;
    let control = ControlClient::new(b.clone(), "t").await.expect("control");
    promote_into_a_paused_partition(&b, &control, "cancel:a", 10).await;
    control.set_paused(Some("in"), Some(partition()), false).await.expect("resume");
    until("the cancel runs", || seen().len() >= 2).await;
    sleep(Duration::from_secs(60)).await;
    assert_eq!(seen(), ["arm:a:10", "cancel:a"], "SAFETY: the cancelled timer's stale fire never reached the hook");
    assert_eq!(b.stream_state("FLOTILLA_t_DLQ").await.expect("dlq").messages, 0, "the stale fire is dropped quietly");
    n1.stop();
    n1.wait().await.expect("stop");
}

/// A timer re-armed by a message that was already in its partition when the old fire
/// was promoted behind it fires once, at its new time, not at the old one.
#[actix_rt::test]
async fn a_timer_re_armed_before_its_promoted_fire_runs_fires_once_at_its_new_time() {
    tokio::time::pause();
    let b = EmbeddedBroker::new().shared();
    let n1 = node(&b, "n1").await;
    let control = ControlClient::new(b.clone(), "t").await.expect("control");
    let start = Instant::now();
    promote_into_a_paused_partition(&b, &control, "arm:a:60", 10).await;
    control.set_paused(Some("in"), Some(partition()), false).await.expect("resume");
    let resumed = Instant::now();
    until("the re-armed timer fires", || !fired().is_empty()).await;
    sleep(Duration::from_secs(120)).await;
    assert_eq!(fired(), ["a"], "SAFETY: one fire, the re-armed one's (the stale one dropped): {:?}", seen());
    let at = FIRED_AT.with(|f| f.borrow()[0].1);
    assert!(
        at >= resumed + Duration::from_secs(60),
        "SAFETY: it fired at its new time, 60 s after the re-arm ran, not at the old one: after {:?}, resumed after {:?}",
        at - start,
        resumed - start
    );
    n1.stop();
    n1.wait().await.expect("stop");
}

/// The change ran on one node, the stale fire reaches the partition's next owner (which
/// made no change of its own): it is dropped there too.
#[actix_rt::test]
async fn a_stale_fire_is_dropped_by_the_partitions_next_owner() {
    tokio::time::pause();
    next_owner_drops_the_stale_fire(EmbeddedBroker::new().shared(), 10).await;
}

/// As [`a_stale_fire_is_dropped_by_the_partitions_next_owner`], on a real nats-server:
/// the next owner reads the timer's last change from the ARMINGS bucket there.
#[actix_rt::test]
async fn a_stale_fire_is_dropped_by_the_partitions_next_owner_on_nats_server() {
    let server = flotilla_tests::NatsServer::start();
    next_owner_drops_the_stale_fire(flotilla_tests::connect(&server).await, 6).await;
}

async fn next_owner_drops_the_stale_fire(b: SharedBroker, due: u64) {
    let n1 = node(&b, "n1").await;
    let control = ControlClient::new(b.clone(), "t").await.expect("control");
    promote_into_a_paused_partition(&b, &control, "cancel:a", due).await;
    // n1 runs the cancel alone, then leaves; the fire waits in the paused partition.
    control.step("in", partition()).await.expect("step");
    until("the cancel runs on n1", || seen().len() >= 2).await;
    n1.stop();
    n1.wait().await.expect("n1 leaves");
    let n2 = node(&b, "n2").await;
    control.set_paused(Some("in"), Some(partition()), false).await.expect("resume");
    for _ in 0..600 {
        let c = b.consumer_state("FLOTILLA_t_in", &format!("in-p{}", partition())).await.expect("consumer");
        if c.ack_floor >= 3 {
            break;
        }
        sleep(Duration::from_millis(100)).await;
    }
    sleep(Duration::from_secs(3)).await;
    assert_eq!(seen()[1..], ["cancel:a"], "SAFETY: the next owner dropped the cancelled timer's stale fire");
    let c = b.consumer_state("FLOTILLA_t_in", &format!("in-p{}", partition())).await.expect("consumer");
    assert_eq!(c.ack_floor, 3, "LIVENESS: the stale fire was consumed, not left in the partition");
    n2.stop();
    n2.wait().await.expect("stop");
}
