//! The fault matrix, signal rows not covered elsewhere (docs/reliability.md): a queue
//! node frozen with SIGSTOP past its ack-wait. (SIGSTOP past the lease on ordered
//! inputs is `a_paused_node_loses_its_leases_and_publishes_nothing_stale_once_it_notices`
//! in tests/tests/cluster.rs.)
//!
//! CI retries a failed test here once: records lost or stored twice are `safety!`
//! failures, which fail CI even when the retry passes; waits that run out are
//! `LIVENESS:` failures, which a retry may pass (`flotilla_tests::safety`).

use flotilla_tests::relay_cluster::{Launch, Record, RelayCluster, read_stream};
use flotilla_tests::{liveness, safety};
use flotilla_transport::broker::OutboundMessage;
use flotilla_transport::wire::{Codec, headers};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const DONE: &str = "FLOTILLA_relay_relay-done";

/// How often each record id is stored in relay-done.
async fn done_counts(c: &RelayCluster) -> BTreeMap<u64, u32> {
    let mut counts = BTreeMap::new();
    for (_, _, payload, _) in read_stream(&c.broker, DONE).await {
        if let Ok(r) = Codec::default().decode::<Record>(&payload) {
            *counts.entry(r.id).or_default() += 1;
        }
    }
    counts
}

/// Record `id` on the queue input `relay-jobs`.
fn job(id: u64, body: &str) -> OutboundMessage {
    let payload = Codec::default().encode(&Record { id, body: body.to_owned() }).expect("encode");
    OutboundMessage::new("flotilla.relay.relay-jobs", payload)
        .with_id(format!("job-{id}"))
        .with_header(headers::KEY, id.to_string())
        .with_header(headers::TYPE, "Record")
}

/// Queue inputs have no lease: a node frozen past its ack-wait has its claimed
/// messages redelivered to the other node. When it thaws it finishes what it held
/// (its acks are stale by then); the derived output ids make its late outputs
/// duplicates the stream drops. Every record ends in relay-done exactly once.
#[actix_rt::test]
async fn a_queue_node_stopped_past_its_ack_wait_loses_and_duplicates_nothing() {
    let mut c = RelayCluster::start(&[]).await;
    let out = c.relay_cmd(&["--queue", "publish", "--count", "0"]);
    assert!(out.status.success(), "provisioning: {}", String::from_utf8_lossy(&out.stderr));
    let queue = Launch { args: ["--queue", "--ack-wait", "2s"].map(String::from).to_vec(), ..Launch::default() };
    c.add_with("a", queue.clone());
    c.add_with("b", queue);
    for id in ["a", "b"] {
        c.wait_log(id, "job started", Duration::from_secs(30)).await;
    }
    // Slow records first, so that b is frozen with some of them in hand.
    for ack in c.broker.publish_batch((0..200).map(|id| job(id, "sleep:200")).collect()).await {
        ack.expect("publish");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    c.signal("b", "STOP");
    for ack in c.broker.publish_batch((200..3000).map(|id| job(id, &format!("record {id}"))).collect()).await {
        ack.expect("publish");
    }
    // Three ack-waits frozen.
    tokio::time::sleep(Duration::from_secs(6)).await;
    c.signal("b", "CONT");
    let start = Instant::now();
    let counts = loop {
        let counts = done_counts(&c).await;
        if counts.len() == 3000 {
            break counts;
        }
        if start.elapsed() >= Duration::from_secs(60) {
            c.fail_missing(true, &format!("relay-done has {} of 3000 records 60 s after the thaw", counts.len())).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    // Let b's late outputs land, then count again: still once each.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let twice: Vec<(u64, u32)> = done_counts(&c).await.into_iter().filter(|(_, n)| *n > 1).collect();
    safety!(twice.is_empty(), "records stored twice in relay-done: {:?}", &twice[..twice.len().min(20)]);
    assert!(c.is_running("a") && c.is_running("b"), "a node died{}", c.all_logs());
    c.signal("a", "TERM");
    c.wait_exit("a", Duration::from_secs(30));
    let (forwarded, redelivered) = c.summary("a");
    eprintln!(
        "a forwarded {forwarded}, of them {redelivered} redelivered (b's, after its ack-wait) of {}",
        counts.len()
    );
    assert!(redelivered > 0, "nothing b held was redelivered to a: the freeze tested nothing");
}

/// A stop must end: two nodes whose server stops answering (SIGSTOP: connections stay
/// open, every request hangs, and the clients end up reconnecting) are sent SIGTERM. Each exits within its drain timeout
/// plus 10 s (the contract under test; it failed before: the nodes logged "workers did
/// not stop in time" after 60 s and ran on until a second signal), with a non-zero
/// status since it could not hand over, and says what it left undone.
#[actix_rt::test]
async fn a_node_stopped_while_its_server_is_unreachable_exits_within_its_drain_timeout() {
    let mut c = RelayCluster::start(&[]).await;
    let drain = Duration::from_secs(4);
    let launch = Launch { args: ["--drain-timeout", "4s"].map(String::from).to_vec(), ..Launch::default() };
    c.add_with("a", launch.clone());
    c.add_with("b", launch);
    c.wait_balanced(&["a", "b"], Duration::from_secs(60)).await;
    // Slow records, so both nodes hold work in flight when the server goes quiet.
    let out = c.relay_cmd(&["publish", "--count", "0"]);
    assert!(out.status.success(), "provisioning: {}", String::from_utf8_lossy(&out.stderr));
    let batch = (0..64u64)
        .map(|id| {
            let payload = Codec::default().encode(&Record { id, body: "sleep:3000".into() }).expect("encode");
            OutboundMessage::new(format!("flotilla.relay.relay-in.{}", id % 8), payload)
                .with_id(format!("slow-{id}"))
                .with_header(headers::KEY, id.to_string())
                .with_header(headers::TYPE, "Record")
        })
        .collect();
    for ack in c.broker.publish_batch(batch).await {
        ack.expect("publish");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let server = c.server.as_ref().expect("the cluster's own server");
    server.signal("STOP");
    // Past two ping intervals: the clients notice and are reconnecting when asked to stop.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let asked = Instant::now();
    c.signal("a", "TERM");
    c.signal("b", "TERM");
    let bound = drain + Duration::from_secs(10);
    let mut statuses = Vec::new();
    for id in ["a", "b"] {
        let left = bound.saturating_sub(asked.elapsed());
        let status = c.wait_exit_async(id, left).await;
        statuses.push((id, status, asked.elapsed()));
    }
    if let Some(server) = c.server.as_ref() {
        server.signal("CONT");
    }
    for (id, status, took) in statuses {
        liveness!(took <= bound, "node {id} took {took:?} to stop, over {bound:?}{}", c.all_logs());
        assert!(!status.success(), "node {id} could not hand over, yet exited 0 ({status:?}){}", c.all_logs());
        let log = c.log_text(id);
        assert!(
            log.contains("the stop did not finish") || log.contains("were not deleted"),
            "node {id} did not say what it left undone:\n{}",
            flotilla_tests::relay_cluster::tail(&log, 30)
        );
    }
}
