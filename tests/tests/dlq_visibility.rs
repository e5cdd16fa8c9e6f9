//! The dead-letter stream is visible and bounded by the operator: its size and the age
//! of its oldest entry are metrics and part of `status`, and limits an operator sets on
//! the stream (`nats stream edit`) are kept by every node that starts (real relay nodes,
//! a real nats-server).

use flotilla_tests::relay_cluster::{Launch, Record, RelayCluster, tail};
use flotilla_tests::{count, free_port};
use flotilla_transport::broker::OutboundMessage;
use flotilla_transport::wire::{Codec, headers};
use std::time::{Duration, Instant};

const DLQ: &str = "FLOTILLA_relay_DLQ";

/// Record `id` for partition `id % 8` of relay-in.
fn record(id: u64, body: &str) -> OutboundMessage {
    let payload = Codec::default().encode(&Record { id, body: body.to_owned() }).expect("encode");
    OutboundMessage::new(
        format!("flotilla.relay.relay-in.{}", flotilla_transport::wire::partition_for(&id.to_string(), 8)),
        payload,
    )
    .with_id(format!("dlqv-{id}"))
    .with_header(headers::KEY, id.to_string())
    .with_header(headers::TYPE, "Record")
}

/// The value of the unlabelled gauge `name` in a Prometheus scrape.
fn gauge(body: &str, name: &str) -> Option<f64> {
    body.lines().find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')).and_then(|v| v.parse().ok()))
}

fn scrape(port: u16) -> String {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(10)))
        .http_status_as_error(false)
        .build()
        .into();
    match agent.get(&format!("http://127.0.0.1:{port}/metrics")).call() {
        Ok(mut r) => r.body_mut().read_to_string().unwrap_or_default(),
        Err(e) => e.to_string(),
    }
}

async fn wait_dlq(c: &RelayCluster, n: u64) {
    let start = Instant::now();
    while count(&c.broker, DLQ).await < n {
        assert!(start.elapsed() < Duration::from_secs(60), "LIVENESS: {n} dead letters within 60 s{}", c.all_logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letter_stream_shows_its_size_and_age_and_keeps_an_operators_limits() {
    let mut c = RelayCluster::start(&[]).await;
    let port = free_port();
    c.add_with("a", Launch { args: vec!["--http".into(), format!("127.0.0.1:{port}")], ..Launch::default() });
    c.wait_log("a", "dashboard and metrics", Duration::from_secs(30)).await;
    c.wait_balanced(&["a"], Duration::from_secs(60)).await;
    let batch = (0..40).map(|id| record(id, if id % 10 == 3 { "poison" } else { "ok" })).collect();
    for ack in c.broker.publish_batch(batch).await {
        ack.expect("publish");
    }
    wait_dlq(&c, 4).await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    // The metrics: read at each backlog check (every 5 s).
    let start = Instant::now();
    let body = loop {
        let body = tokio::task::spawn_blocking(move || scrape(port)).await.expect("scrape");
        if gauge(&body, "flotilla_dlq_messages") == Some(4.0) {
            break body;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "LIVENESS: flotilla_dlq_messages never 4:\n{}",
            tail(&body, 60)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(gauge(&body, "flotilla_dlq_bytes").is_some_and(|b| b > 100.0), "the DLQ's bytes:\n{}", tail(&body, 60));
    assert!(
        gauge(&body, "flotilla_dlq_oldest_age_seconds").is_some_and(|a| a >= 1.0),
        "the oldest dead letter's age:\n{}",
        tail(&body, 60)
    );

    // `status`: the same, as JSON and as text.
    let out = c.relay_cmd(&["status", "--json"]);
    assert!(out.status.success(), "status: {}", String::from_utf8_lossy(&out.stderr));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status JSON");
    assert_eq!(status["dlq"], 4);
    assert!(status["dlq_bytes"].as_u64().is_some_and(|b| b > 100), "{status}");
    assert!(status["dlq_oldest_age_ms"].as_u64().is_some_and(|ms| ms >= 1000), "{status}");
    let out = c.relay_cmd(&["status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("DLQ 4 message(s) (") && text.contains("bytes, oldest"), "{text}");

    // An operator bounds the DLQ (as `nats stream edit FLOTILLA_relay_DLQ --max-msgs 5`
    // would); a node started after keeps the limit, and the stream holds no more.
    c.signal("a", "TERM");
    let status = c.wait_exit_async("a", Duration::from_secs(60)).await;
    assert!(status.success(), "a's graceful stop: {status:?}{}", c.all_logs());
    let client = async_nats::connect(c.nats.as_str()).await.expect("connect");
    let js = async_nats::jetstream::new(client);
    let mut stream = js.get_stream(DLQ).await.expect("the DLQ");
    let mut config = stream.info().await.expect("info").config.clone();
    config.max_messages = 5;
    js.update_stream(config).await.expect("an operator's limit");
    c.add("b");
    c.wait_balanced(&["b"], Duration::from_secs(60)).await;
    let batch = (100..140).map(|id| record(id, if id % 10 == 3 { "poison" } else { "ok" })).collect();
    for ack in c.broker.publish_batch(batch).await {
        ack.expect("publish");
    }
    flotilla_tests::wait_count(&c.broker, "FLOTILLA_relay_relay-out", 72, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(count(&c.broker, DLQ).await, 5, "the operator's limit holds: 8 dead letters, the oldest 3 gone");
    assert_eq!(stream.info().await.expect("info").config.max_messages, 5, "the node kept the operator's limit");
    assert!(c.log_text("b").contains("kept the operator's setting"), "{}", tail(&c.log_text("b"), 30));
}
