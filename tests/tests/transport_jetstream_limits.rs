//! JetStream-only behaviour the conformance suite cannot express on the embedded broker.

use bytes::Bytes;
use flotilla_tests::NatsServer;
use flotilla_transport::broker::{ConsumerSpec, Retention, StreamSpec};
use flotilla_transport::{JetStreamBroker, JetStreamOptions};
use std::time::{Duration, Instant};

/// More concurrent claims than the consumer's `max_waiting` (512): on 2.9 the extra pull
/// requests get `409 Exceeded MaxWaiting`. A claim that gets one must wait out its window
/// instead of returning (and being re-issued) at once, which would spin.
#[tokio::test]
async fn claims_beyond_max_waiting_back_off_instead_of_spinning() {
    let server = NatsServer::start();
    let broker = JetStreamBroker::connect(JetStreamOptions::new(server.url())).await.expect("connect").shared();
    broker.ensure_stream(StreamSpec::new("W", vec!["w.>".into()], Retention::WorkQueue)).await.expect("stream");
    broker.ensure_consumer("W", ConsumerSpec::new("w")).await.expect("consumer");
    let window = Duration::from_secs(2);
    let started = Instant::now();
    let claims = (0..600).map(|_| {
        let b = broker.clone();
        tokio::spawn(async move {
            let t = Instant::now();
            let got = b.claim("W", "w", 1, window).await;
            (got.map(|v| v.len()), t.elapsed())
        })
    });
    let results = futures::future::join_all(claims).await;
    let mut early = 0;
    for r in results {
        let (got, took) = r.expect("task");
        assert_eq!(got.expect("claim is not an error"), 0, "nothing was published");
        if took < window.mul_f64(0.8) {
            early += 1;
        }
    }
    assert_eq!(early, 0, "{early} of 600 claims returned before their window: a caller looping on them would spin");
    assert!(started.elapsed() < Duration::from_secs(20), "took {:?}", started.elapsed());
    // And the consumer still works afterwards.
    broker.publish(flotilla_transport::broker::OutboundMessage::new("w.a", Bytes::from("x"))).await.expect("publish");
    assert_eq!(broker.claim("W", "w", 1, Duration::from_secs(5)).await.expect("claim").len(), 1);
}

/// Queueing more than `max_ack_inflight` publishes before awaiting any (a task that
/// sends more outputs for one message than the window, or a large `publish_batch`) must
/// not wait forever for a permit: acks free permits as they arrive, whoever awaits them.
/// (With async-nats' JetStream publish, a permit came back only once its ack future was
/// polled, and this hung.)
#[tokio::test]
async fn more_pipelined_publishes_than_the_ack_window_complete() {
    let server = NatsServer::start();
    let mut opts = JetStreamOptions::new(server.url());
    opts.max_ack_inflight = 16;
    let broker = JetStreamBroker::connect(opts).await.expect("connect").shared();
    broker.ensure_stream(StreamSpec::new("P", vec!["p.>".into()], Retention::Limits)).await.expect("stream");
    let msgs: Vec<_> = (0..200)
        .map(|i| flotilla_transport::broker::OutboundMessage::new(format!("p.{i}"), Bytes::from("x")))
        .collect();
    let acks = tokio::time::timeout(Duration::from_secs(20), broker.publish_batch(msgs))
        .await
        .expect("200 publishes through a window of 16 complete");
    assert!(acks.iter().all(Result::is_ok), "{acks:?}");
    let mut pending = Vec::new();
    for i in 0..200 {
        let msg = flotilla_transport::broker::OutboundMessage::new(format!("p.q{i}"), Bytes::from("y"));
        let queued = tokio::time::timeout(Duration::from_secs(10), broker.publish_pipelined(msg))
            .await
            .expect("queueing does not wait for acks nobody polls yet");
        pending.push(queued.expect("queued"));
    }
    for p in pending {
        p.await.expect("stored");
    }
    // One pipelined batch of 200 through the window of 16: queueing takes in the acks
    // that arrive meanwhile, so it cannot wait forever for a permit.
    let batch: std::sync::Arc<[_]> = (0..200)
        .map(|i| flotilla_transport::broker::OutboundMessage::new(format!("p.b{i}"), Bytes::from("z")))
        .collect();
    let stored = tokio::time::timeout(Duration::from_secs(20), broker.publish_pipelined_batch(batch))
        .await
        .expect("a batch larger than the ack window is queued")
        .expect("queued");
    tokio::time::timeout(Duration::from_secs(20), stored).await.expect("acked in time").expect("stored");
    assert_eq!(broker.stream_state("P").await.expect("state").messages, 600);
}

/// A partition's new owner resets its consumer (delete, then create at the committed
/// position) while other nodes, starting up, provision the same consumer (create it if
/// missing). A provisioning create that lands between the delete and the create used
/// to make the reset fail, and the owner then consumed the partition from sequence 1:
/// everything processed again. The reset must win, and start where it was asked to.
#[tokio::test]
async fn a_reset_racing_provisioning_nodes_still_starts_at_its_sequence() {
    let server = NatsServer::start();
    let broker = JetStreamBroker::connect(JetStreamOptions::new(server.url())).await.expect("connect").shared();
    broker.ensure_stream(StreamSpec::new("R", vec!["r.>".into()], Retention::Limits)).await.expect("stream");
    let msgs: Vec<_> =
        (0..10).map(|i| flotilla_transport::broker::OutboundMessage::new("r.0", Bytes::from(format!("{i}")))).collect();
    assert!(broker.publish_batch(msgs).await.iter().all(Result::is_ok));
    let spec = ConsumerSpec { ack_policy: flotilla_transport::broker::AckPolicy::All, ..ConsumerSpec::new("p0") };
    broker.ensure_consumer("R", spec.clone()).await.expect("consumer");
    for round in 0..15 {
        // Two other "nodes" provisioning in a loop, on their own connections.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut provisioners = Vec::new();
        for _ in 0..2 {
            let other = JetStreamBroker::connect(JetStreamOptions::new(server.url())).await.expect("connect").shared();
            let (spec, stop) = (spec.clone(), stop.clone());
            provisioners.push(tokio::spawn(async move {
                // A provisioning every few milliseconds: far more than nodes starting
                // up do (once each), so the reset has to win against real contention.
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = other.ensure_consumer("R", spec.clone()).await;
                    n += 1;
                    tokio::time::sleep(Duration::from_millis(1 + n % 4)).await;
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        let reset = broker.reset_consumer("R", spec.clone(), 8).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for p in provisioners {
            p.await.expect("provisioner");
        }
        reset.unwrap_or_else(|e| panic!("round {round}: reset failed: {e}"));
        let first = broker.claim("R", "p0", 1, Duration::from_secs(5)).await.expect("claim");
        assert_eq!(first.first().map(|d| d.info.stream_seq), Some(8), "round {round}: the consumer starts at 8");
    }
}

/// Publish acks that never come (the server is frozen) fail their batch with a timeout,
/// a transient error after which the worker publishes the same messages again (their
/// ids deduplicate). The batch gives its window permits back, and so does a batch whose
/// future is dropped: once the server answers again, a batch far larger than the window
/// still goes through, which it could not if a permit had leaked (nor if one taken by a
/// batch dropped halfway through sending had).
#[tokio::test]
async fn a_batch_whose_acks_do_not_come_times_out_and_gives_its_window_back() {
    use flotilla_transport::broker::{BrokerError, OutboundMessage};
    let server = NatsServer::start();
    let mut opts = JetStreamOptions::new(server.url());
    opts.max_ack_inflight = 16;
    opts.request_timeout = Duration::from_secs(1);
    let broker = JetStreamBroker::connect(opts).await.expect("connect").shared();
    broker.ensure_stream(StreamSpec::new("T", vec!["t.>".into()], Retention::Limits)).await.expect("stream");
    let batch = |tag: &str, n: usize| -> std::sync::Arc<[OutboundMessage]> {
        (0..n)
            .map(|i| OutboundMessage::new(format!("t.{tag}"), Bytes::from("x")).with_id(format!("{tag}-{i}")))
            .collect()
    };
    server.signal("STOP");
    let queued = tokio::time::timeout(Duration::from_secs(5), broker.publish_pipelined_batch(batch("a", 10)))
        .await
        .expect("ten messages fit in the window of 16")
        .expect("queued");
    let started = Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(10), queued).await.expect("the batch resolves");
    match outcome {
        Err(e @ BrokerError::TimedOut { .. }) => assert!(e.is_transient(), "{e}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_millis(900), "timed out after {:?}", started.elapsed());
    // Ten more (the first ten's permits are back), whose future is dropped unawaited.
    let dropped = tokio::time::timeout(Duration::from_secs(5), broker.publish_pipelined_batch(batch("b", 10)))
        .await
        .expect("the timed-out batch gave its permits back")
        .expect("queued");
    drop(dropped);
    // A batch larger than the window, dropped while it waits for permits halfway
    // through sending: what it took comes back too.
    let halfway =
        tokio::time::timeout(Duration::from_millis(500), broker.publish_pipelined_batch(batch("h", 40))).await;
    assert!(halfway.is_err(), "40 messages cannot all be sent through 16 permits while no ack comes");
    server.signal("CONT");
    let stored = tokio::time::timeout(Duration::from_secs(20), broker.publish_pipelined_batch(batch("c", 200)))
        .await
        .expect("200 through a window of 16: no permit leaked")
        .expect("queued");
    tokio::time::timeout(Duration::from_secs(20), stored).await.expect("acked in time").expect("stored");
    // Publishing the timed-out batch again stores nothing twice.
    let again = broker.publish_pipelined_batch(batch("a", 10)).await.expect("queued");
    again.await.expect("stored");
    // a, b and c, and the 16 of h that went out before it was dropped.
    assert_eq!(broker.stream_state("T").await.expect("state").messages, 236);
}
