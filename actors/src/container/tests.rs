use super::*;

/// How many slots the container holds (tests).
#[derive(Debug, Message)]
#[rtype(result = "usize")]
struct SlotCount;

impl Handler<SlotCount> for Container {
    type Result = usize;

    fn handle(&mut self, _: SlotCount, _: &mut Context<Self>) -> usize {
        self.slots.len()
    }
}

/// A worker that takes nothing and stops when told, ending as `stops_as` (or fails at
/// once).
struct Idle {
    slot: usize,
    container: Recipient<WorkerReport>,
    fail: bool,
    stops_as: Outcome,
}
impl Actor for Idle {
    type Context = Context<Self>;
    fn started(&mut self, ctx: &mut Context<Self>) {
        if self.fail {
            self.container.do_send(WorkerReport::Finished { slot: self.slot, outcome: Outcome::Failed("boom".into()) });
            ctx.stop();
        }
    }
}
impl Handler<WorkerControl> for Idle {
    type Result = ();
    fn handle(&mut self, _: WorkerControl, _: &mut Context<Self>) {}
}
impl Handler<StopWorker> for Idle {
    type Result = ();
    fn handle(&mut self, _: StopWorker, ctx: &mut Context<Self>) {
        self.container.do_send(WorkerReport::Finished { slot: self.slot, outcome: self.stops_as.clone() });
        ctx.stop();
    }
}

struct Ends(std::sync::Arc<std::sync::Mutex<Vec<usize>>>);
impl Actor for Ends {
    type Context = Context<Self>;
}
impl Handler<SlotEnded> for Ends {
    type Result = ();
    fn handle(&mut self, ended: SlotEnded, _: &mut Context<Self>) {
        self.0.lock().expect("lock").push(ended.slot);
    }
}

/// Cluster mode: a partition that comes and goes a hundred times leaves no slot
/// behind, and no slot id is used twice.
#[actix_rt::test]
async fn slots_of_released_partitions_are_freed() {
    let broker = flotilla_transport::EmbeddedBroker::new().shared();
    let subjects = Subjects::new(flotilla_transport::wire::JobName::new("j").expect("name"));
    let timers = TimerService::default().start();
    let reaper = Reaper::new(broker.clone(), subjects.clone()).start();
    let factory: PartitionFactory = std::rc::Rc::new(|stream: &str, p, epoch, fence, paused| {
        Some(SlotSpec {
            stream: stream.to_owned(),
            partition: Some(p),
            js_stream: "FLOTILLA_j_in".into(),
            consumer: format!("in-p{p}").into(),
            capacity: 1,
            policy: FailurePolicy::FailContainer,
            sweep: false,
            takeover: None,
            start: None,
            epoch,
            fence: Some(fence),
            paused,
            spawn: Box::new(|sc: SlotContext| {
                let idle =
                    Idle { slot: sc.slot, container: sc.container, fail: false, stops_as: Outcome::Stopped }.start();
                WorkerHandle { stop: idle.clone().recipient(), control: idle.recipient() }
            }),
        })
    });
    let ended = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let observer = Ends(ended.clone()).start();
    let (tx, _rx) = oneshot::channel();
    let container = Container::new(broker, subjects, ContainerConfig::default(), Vec::new(), timers, reaper, tx)
        .observed_by(observer.recipient(), factory)
        .start();
    let mut ids = Vec::new();
    for _ in 0..100 {
        let fence = crate::fence::Fence::until(tokio::time::Instant::now() + Duration::from_secs(60));
        let add = AddSlot { stream: "in".into(), partition: 3, epoch: 1, fence, paused: false, start: None };
        let id = container.send(add).await.expect("container").expect("a slot");
        ids.push(id);
        container.send(ReleaseSlot(id)).await.expect("container");
        for _ in 0..200 {
            if ended.lock().expect("lock").contains(&id) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(ended.lock().expect("lock").contains(&id), "slot {id} never ended");
    }
    let held = container.send(SlotCount).await.expect("container");
    assert_eq!(held, 0, "slots left behind");
    ids.dedup();
    assert_eq!(ids.len(), 100, "slot ids are not reused");
}

/// Cluster mode: a failed task whose partition cannot be reset (its stream is gone)
/// starts no worker, and after a few tries the partition is handed back.
#[actix_rt::test]
async fn a_partition_that_cannot_be_reset_is_handed_back_not_run() {
    tokio::time::pause();
    let broker = flotilla_transport::EmbeddedBroker::new().shared();
    let subjects = Subjects::new(flotilla_transport::wire::JobName::new("j").expect("name"));
    let timers = TimerService::default().start();
    let reaper = Reaper::new(broker.clone(), subjects.clone()).start();
    let starts = std::rc::Rc::new(std::cell::Cell::new(0));
    let counted = starts.clone();
    let factory: PartitionFactory = std::rc::Rc::new(move |stream: &str, p, epoch, fence, paused| {
        let counted = counted.clone();
        Some(SlotSpec {
            stream: stream.to_owned(),
            partition: Some(p),
            js_stream: "FLOTILLA_j_gone".into(),
            consumer: format!("in-p{p}").into(),
            capacity: 1,
            policy: FailurePolicy::RestartTask,
            sweep: false,
            takeover: Some(flotilla_transport::broker::ConsumerSpec::new(format!("in-p{p}"))),
            start: None,
            epoch,
            fence: Some(fence),
            paused,
            spawn: Box::new(move |sc: SlotContext| {
                counted.set(counted.get() + 1);
                let idle =
                    Idle { slot: sc.slot, container: sc.container, fail: true, stops_as: Outcome::Stopped }.start();
                WorkerHandle { stop: idle.clone().recipient(), control: idle.recipient() }
            }),
        })
    });
    let ended = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let observer = Ends(ended.clone()).start();
    let (tx, _rx) = oneshot::channel();
    let container = Container::new(broker, subjects, ContainerConfig::default(), Vec::new(), timers, reaper, tx)
        .observed_by(observer.recipient(), factory)
        .start();
    let fence = crate::fence::Fence::until(tokio::time::Instant::now() + Duration::from_secs(3600));
    let add = AddSlot { stream: "in".into(), partition: 0, epoch: 1, fence, paused: false, start: None };
    let id = container.send(add).await.expect("container").expect("a slot");
    for _ in 0..600 {
        if ended.lock().expect("lock").contains(&id) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ended.lock().expect("lock").contains(&id), "the partition was never handed back");
    assert_eq!(starts.get(), 1, "no worker started after a failed reset");
}

/// Cluster mode: a partition being handed over whose worker fails on its way out, under
/// `policy`. Returns how many workers started, whether the partition ended, and how
/// the container exited (if it did).
async fn hand_over_a_failing_worker(policy: FailurePolicy) -> (u32, bool, usize, Option<ContainerExit>) {
    tokio::time::pause();
    let broker = flotilla_transport::EmbeddedBroker::new().shared();
    let subjects = Subjects::new(flotilla_transport::wire::JobName::new("j").expect("name"));
    let timers = TimerService::default().start();
    let reaper = Reaper::new(broker.clone(), subjects.clone()).start();
    let starts = std::rc::Rc::new(std::cell::Cell::new(0));
    let counted = starts.clone();
    let factory: PartitionFactory = std::rc::Rc::new(move |stream: &str, p, epoch, fence, paused| {
        let counted = counted.clone();
        Some(SlotSpec {
            stream: stream.to_owned(),
            partition: Some(p),
            js_stream: "FLOTILLA_j_in".into(),
            consumer: format!("in-p{p}").into(),
            capacity: 1,
            policy,
            sweep: false,
            takeover: None,
            start: None,
            epoch,
            fence: Some(fence),
            paused,
            spawn: Box::new(move |sc: SlotContext| {
                counted.set(counted.get() + 1);
                let stops_as = Outcome::Failed("failed on the way out".into());
                let idle = Idle { slot: sc.slot, container: sc.container, fail: false, stops_as }.start();
                WorkerHandle { stop: idle.clone().recipient(), control: idle.recipient() }
            }),
        })
    });
    let ended = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let observer = Ends(ended.clone()).start();
    let (tx, mut rx) = oneshot::channel();
    let container = Container::new(broker, subjects, ContainerConfig::default(), Vec::new(), timers, reaper, tx)
        .observed_by(observer.recipient(), factory)
        .start();
    let fence = crate::fence::Fence::until(tokio::time::Instant::now() + Duration::from_secs(3600));
    let add = AddSlot { stream: "in".into(), partition: 0, epoch: 1, fence, paused: false, start: None };
    let id = container.send(add).await.expect("container").expect("a slot");
    container.send(ReleaseSlot(id)).await.expect("container");
    for _ in 0..600 {
        if ended.lock().expect("lock").contains(&id) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let was_ended = ended.lock().expect("lock").contains(&id);
    // Longer than any restart back-off.
    tokio::time::sleep(Duration::from_secs(120)).await;
    let held = container.send(SlotCount).await.unwrap_or(0);
    (starts.get(), was_ended, held, rx.try_recv().ok())
}

/// A worker told to stop is never restarted: the partition being handed over ends (its
/// lease goes).
#[actix_rt::test]
async fn a_worker_failing_while_handed_over_ends_and_is_not_restarted() {
    let (starts, ended, held, exit) = hand_over_a_failing_worker(FailurePolicy::RestartTask).await;
    assert!(ended, "the partition was never handed back");
    assert_eq!(starts, 1, "a worker told to stop was restarted");
    assert_eq!(held, 0, "the slot is gone");
    assert_eq!(exit, None, "a restartable task's failure does not end the container");
}

/// Under `FailContainer` the same failure still fails the container.
#[actix_rt::test]
async fn a_worker_failing_while_handed_over_fails_a_fail_container_task() {
    let (starts, ended, _, exit) = hand_over_a_failing_worker(FailurePolicy::FailContainer).await;
    assert!(ended, "the partition was never handed back");
    assert_eq!(starts, 1);
    assert!(matches!(exit, Some(ContainerExit::Failed(ref why)) if why.contains("failed on the way out")), "{exit:?}");
}
