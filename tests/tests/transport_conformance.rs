//! The transport conformance suite: every case runs against the embedded broker (on
//! tokio's paused clock) and against a real nats-server (real time), so the two
//! backends cannot drift apart. Test names show the backend:
//! `embedded::ack_wait_redelivery`, `jetstream::ack_wait_redelivery`.

use bytes::Bytes;
use flotilla_tests::NatsServer;
use flotilla_transport::broker::{
    AckKind, AckPolicy, BrokerError, ConsumerSpec, CoreMessage, KvEntry, KvOperation, KvSpec, OutboundMessage,
    Retention, StreamSpec,
};
use flotilla_transport::{EmbeddedBroker, JetStreamBroker, JetStreamOptions, SharedBroker};
use futures::StreamExt;
use std::time::Duration;
use tokio::time::{Instant, sleep, timeout};

/// Runs each named case on both backends.
macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod embedded {
            $(
                #[tokio::test(start_paused = true)]
                async fn $case() {
                    super::cases::$case(flotilla_transport::EmbeddedBroker::new().shared()).await;
                }
            )*
        }
        mod jetstream {
            $(
                #[tokio::test]
                async fn $case() {
                    let server = flotilla_tests::NatsServer::start();
                    let broker = super::connect(&server).await;
                    super::cases::$case(broker).await;
                    drop(server);
                }
            )*
        }
    };
}

conformance!(
    safe_differences_are_kept,
    a_bucket_that_keeps_all_refuses_limits_that_lose_records,
    a_partition_whose_consumer_is_gone_is_taken_over_from_the_start,
    publish_claim_ack,
    claim_never_exceeds_max,
    claim_waits_for_the_first_message,
    ack_wait_redelivery_counts_deliveries,
    nak_with_delay,
    in_progress_extends_ack_wait,
    max_deliveries_strands_the_message,
    term_removes_from_work_queue,
    dedupe_by_message_id,
    ack_all_acks_the_prefix,
    explicit_acks_out_of_order_move_the_floor_over_the_acked_prefix,
    reset_consumer_resumes_at_the_committed_position,
    publish_batch_is_ordered,
    pipelined_publishes_keep_call_order,
    pipelined_batches_keep_order_and_report_the_first_refusal,
    headers_nats_cannot_carry_are_refused,
    publish_expectation_is_checked,
    publish_expectation_headers_are_checked,
    publish_without_stream_is_refused,
    oversize_publish_is_refused,
    get_and_delete_by_sequence,
    get_next_skips_gaps_and_other_subjects,
    kv_create_race_has_one_winner,
    kv_compare_and_set,
    kv_expiry,
    kv_watch_sees_current_then_changes,
    typed_keys_modify_by_compare_and_set_and_watch_a_pattern,
    kv_scan_reads_the_current_values_and_ends,
    request_reply,
    request_with_no_responders,
    request_timeout,
    provisioning_twice_is_a_no_op,
    mismatching_config_is_refused,
    missing_objects_are_typed_errors,
    filtered_consumers_see_only_their_subjects,
);

async fn connect(server: &NatsServer) -> SharedBroker {
    JetStreamBroker::connect(JetStreamOptions::new(server.url())).await.expect("connect to test nats-server").shared()
}

/// Each backend says what it is; a JetStream broker also reports the version and
/// payload limit of the server it is connected to, as the server's `/varz` gives them
/// (features are gated on that version).
#[tokio::test]
async fn embedded_and_jetstream_report_their_kind() {
    use flotilla_transport::broker::{BrokerKind, Version};
    let embedded = flotilla_transport::Broker::server(&EmbeddedBroker::new());
    assert_eq!((embedded.kind, embedded.name.as_str()), (BrokerKind::Embedded, "embedded"));
    let server = NatsServer::start();
    let varz = server.monitor("/varz").expect("the server's /varz");
    let varz: serde_json::Value = serde_json::from_str(&varz).expect("/varz is JSON");
    let info = connect(&server).await.server();
    assert_eq!(info.kind, BrokerKind::JetStream, "a broker connected to nats-server: {info:?}");
    let version = varz["version"].as_str().and_then(Version::parse);
    assert_eq!(Some(info.version), version, "the version /varz reports: {varz}");
    assert_eq!(Some(info.max_payload as u64), varz["max_payload"].as_u64(), "the payload limit /varz reports");
    assert_eq!(Some(info.name.as_str()), varz["server_name"].as_str(), "the server's name");
}

mod cases {
    use super::*;

    const WAIT: Duration = Duration::from_secs(5);

    fn queue_spec() -> StreamSpec {
        StreamSpec::new("Q", vec!["q.>".into()], Retention::WorkQueue)
    }

    fn consumer(name: &str, ack_wait_ms: u64) -> ConsumerSpec {
        ConsumerSpec { ack_wait: Duration::from_millis(ack_wait_ms), ..ConsumerSpec::new(name) }
    }

    async fn queue(b: &SharedBroker, ack_wait_ms: u64) {
        b.ensure_stream(queue_spec()).await.expect("stream");
        b.ensure_consumer("Q", consumer("w", ack_wait_ms)).await.expect("consumer");
    }

    async fn publish(b: &SharedBroker, subject: &str, body: &str) -> u64 {
        b.publish(OutboundMessage::new(subject, Bytes::from(body.to_owned()))).await.expect("publish").seq
    }

    pub async fn publish_claim_ack(b: SharedBroker) {
        queue(&b, 30_000).await;
        for i in 0..3 {
            let msg = OutboundMessage::new("q.a", Bytes::from(format!("m{i}")))
                .with_id(format!("id-{i}"))
                .with_header("Flotilla-Key", format!("k{i}"));
            let ack = b.publish(msg).await.expect("publish");
            assert_eq!((ack.stream.as_str(), ack.seq, ack.duplicate), ("Q", i + 1, false));
        }
        let got = b.claim("Q", "w", 10, WAIT).await.expect("claim");
        assert_eq!(got.len(), 3);
        for (i, d) in got.iter().enumerate() {
            assert_eq!(d.payload, Bytes::from(format!("m{i}")));
            assert_eq!(&*d.subject, "q.a");
            assert_eq!(d.headers.msg_id(), Some(format!("id-{i}").as_str()));
            assert_eq!(d.headers.get("Flotilla-Key"), Some(format!("k{i}").as_str()));
            assert_eq!((d.info.stream_seq, d.info.delivered), (i as u64 + 1, 1));
            assert_eq!(d.info.pending, 2 - i as u64);
            assert_eq!(&*d.info.stream, "Q");
        }
        for d in &got {
            b.ack_confirmed(&d.token, AckKind::Ack).await.expect("ack");
        }
        let c = b.consumer_state("Q", "w").await.expect("state");
        assert_eq!((c.num_pending, c.num_ack_pending, c.ack_floor), (0, 0, 3));
        assert_eq!(b.stream_state("Q").await.expect("stream").messages, 0, "work queue removes acked messages");
        assert!(b.claim("Q", "w", 10, Duration::from_millis(200)).await.expect("claim").is_empty());
    }

    pub async fn filtered_consumers_see_only_their_subjects(b: SharedBroker) {
        b.ensure_stream(StreamSpec::new("F", vec!["f.>".into()], Retention::Limits)).await.expect("stream");
        let filtered = |name: &str, filter: Option<&str>| ConsumerSpec {
            filter_subject: filter.map(str::to_owned),
            ..ConsumerSpec::new(name)
        };
        for (name, filter) in [("a", Some("f.a")), ("b", Some("f.b")), ("wild", Some("f.*")), ("all", None)] {
            b.ensure_consumer("F", filtered(name, filter)).await.expect("consumer");
        }
        publish(&b, "f.a", "a1").await;
        publish(&b, "f.a", "a2").await;
        publish(&b, "f.b", "b1").await;
        publish(&b, "f.c.deep", "c1").await;
        let pending = |c: flotilla_transport::broker::ConsumerState| c.num_pending;
        for (name, want) in [("a", 2), ("b", 1), ("wild", 3), ("all", 4)] {
            assert_eq!(pending(b.consumer_state("F", name).await.expect("state")), want, "consumer {name}");
        }
        let got = b.claim("F", "a", 10, WAIT).await.expect("claim");
        assert_eq!(got.iter().map(|d| d.payload.clone()).collect::<Vec<_>>(), vec!["a1", "a2"]);
        // Deleted and created again: it counts what is stored, and a publish after the
        // delete reaches the others only.
        assert!(b.delete_consumer("F", "b").await.expect("delete"));
        publish(&b, "f.b", "b2").await;
        assert_eq!(pending(b.consumer_state("F", "wild").await.expect("state")), 4);
        b.ensure_consumer("F", filtered("b", Some("f.b"))).await.expect("again");
        assert_eq!(pending(b.consumer_state("F", "b").await.expect("state")), 2);
        let got = b.claim("F", "b", 10, WAIT).await.expect("claim");
        assert_eq!(got.iter().map(|d| d.payload.clone()).collect::<Vec<_>>(), vec!["b1", "b2"]);
    }

    pub async fn claim_never_exceeds_max(b: SharedBroker) {
        queue(&b, 30_000).await;
        let msgs: Vec<_> = (0..10).map(|i| OutboundMessage::new("q.a", Bytes::from(vec![i]))).collect();
        assert!(b.publish_batch(msgs).await.iter().all(Result::is_ok));
        let mut seen = Vec::new();
        for _ in 0..4 {
            let got = b.claim("Q", "w", 3, WAIT).await.expect("claim");
            assert!(got.len() <= 3, "claimed {} with max 3", got.len());
            seen.extend(got.iter().map(|d| d.info.stream_seq));
        }
        assert_eq!(seen, (1..=10).collect::<Vec<_>>());
        assert!(b.claim("Q", "w", 0, WAIT).await.expect("claim 0").is_empty());
    }

    pub async fn claim_waits_for_the_first_message(b: SharedBroker) {
        queue(&b, 30_000).await;
        let started = Instant::now();
        let got = b.claim("Q", "w", 5, Duration::from_millis(500)).await.expect("claim");
        assert!(got.is_empty());
        assert!(started.elapsed() >= Duration::from_millis(450), "returned after {:?}", started.elapsed());
        let b2 = b.clone();
        let publisher = tokio::spawn(async move {
            sleep(Duration::from_millis(300)).await;
            publish(&b2, "q.a", "late").await
        });
        let started = Instant::now();
        let got = b.claim("Q", "w", 5, Duration::from_secs(10)).await.expect("claim");
        assert_eq!(got.len(), 1, "returns once one message is there");
        assert!(started.elapsed() < Duration::from_secs(5), "waited {:?}", started.elapsed());
        publisher.await.expect("publisher");
    }

    pub async fn ack_wait_redelivery_counts_deliveries(b: SharedBroker) {
        queue(&b, 1_000).await;
        publish(&b, "q.a", "x").await;
        let first = b.claim("Q", "w", 1, WAIT).await.expect("claim");
        assert_eq!(first[0].info.delivered, 1);
        let started = Instant::now();
        let again = b.claim("Q", "w", 1, WAIT).await.expect("claim");
        assert_eq!(again.len(), 1, "redelivered after ack-wait");
        assert_eq!(again[0].info.stream_seq, first[0].info.stream_seq);
        assert_eq!(again[0].info.delivered, 2);
        assert!(started.elapsed() >= Duration::from_millis(700), "too early: {:?}", started.elapsed());
        let c = b.consumer_state("Q", "w").await.expect("state");
        assert_eq!((c.num_ack_pending, c.num_redelivered), (1, 1));
        b.ack_confirmed(&again[0].token, AckKind::Ack).await.expect("ack");
        assert!(b.claim("Q", "w", 1, Duration::from_millis(1500)).await.expect("claim").is_empty());
    }

    pub async fn nak_with_delay(b: SharedBroker) {
        queue(&b, 30_000).await;
        publish(&b, "q.a", "x").await;
        let d = b.claim("Q", "w", 1, WAIT).await.expect("claim").remove(0);
        let naked = Instant::now();
        b.ack_confirmed(&d.token, AckKind::Nak(Some(Duration::from_millis(1500)))).await.expect("nak");
        assert!(b.claim("Q", "w", 1, Duration::from_millis(700)).await.expect("claim").is_empty(), "too early");
        let again = b.claim("Q", "w", 1, WAIT).await.expect("claim");
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].info.delivered, 2);
        let after = naked.elapsed();
        assert!(after >= Duration::from_millis(1400) && after < Duration::from_secs(4), "redelivered after {after:?}");
        // A nak without delay redelivers at once.
        b.ack_confirmed(&again[0].token, AckKind::Nak(None)).await.expect("nak");
        let third = b.claim("Q", "w", 1, Duration::from_secs(1)).await.expect("claim");
        assert_eq!(third.first().map(|d| d.info.delivered), Some(3));
    }

    pub async fn in_progress_extends_ack_wait(b: SharedBroker) {
        queue(&b, 1_000).await;
        publish(&b, "q.a", "x").await;
        let d = b.claim("Q", "w", 1, WAIT).await.expect("claim").remove(0);
        for _ in 0..4 {
            sleep(Duration::from_millis(500)).await;
            b.ack_confirmed(&d.token, AckKind::InProgress).await.expect("wpi");
        }
        // 2 s after delivery with a 1 s ack-wait: still ours.
        assert!(b.claim("Q", "w", 1, Duration::from_millis(400)).await.expect("claim").is_empty(), "redelivered");
        let again = b.claim("Q", "w", 1, WAIT).await.expect("claim");
        assert_eq!(again.first().map(|d| d.info.delivered), Some(2), "redelivered once progress stops");
    }

    pub async fn max_deliveries_strands_the_message(b: SharedBroker) {
        b.ensure_stream(queue_spec()).await.expect("stream");
        let spec = ConsumerSpec { max_deliver: Some(2), ..consumer("w", 500) };
        b.ensure_consumer("Q", spec).await.expect("consumer");
        let mut advisories =
            b.subscribe("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.Q.w", None).await.expect("subscribe advisories");
        publish(&b, "q.a", "poison").await;
        assert_eq!(b.claim("Q", "w", 1, WAIT).await.expect("claim")[0].info.delivered, 1);
        assert_eq!(b.claim("Q", "w", 1, WAIT).await.expect("claim")[0].info.delivered, 2);
        assert!(b.claim("Q", "w", 1, Duration::from_secs(2)).await.expect("claim").is_empty(), "a third delivery");
        let advisory = timeout(WAIT, advisories.next()).await.expect("advisory in time").expect("advisory");
        let v: serde_json::Value = serde_json::from_slice(&advisory.payload).expect("advisory json");
        assert_eq!(v["stream_seq"], 1);
        assert_eq!(v["deliveries"], 2);
        let s = b.stream_state("Q").await.expect("stream");
        assert_eq!(s.messages, 1, "the message stays in the stream (the DLQ move is ours)");
        let c = b.consumer_state("Q", "w").await.expect("consumer");
        assert_eq!((c.num_pending, c.num_ack_pending, c.ack_floor), (0, 0, 0));
        assert!(b.get_message("Q", 1).await.expect("get").is_some());
    }

    pub async fn term_removes_from_work_queue(b: SharedBroker) {
        queue(&b, 500).await;
        publish(&b, "q.a", "x").await;
        let d = b.claim("Q", "w", 1, WAIT).await.expect("claim").remove(0);
        b.ack_confirmed(&d.token, AckKind::Term).await.expect("term");
        assert!(b.claim("Q", "w", 1, Duration::from_millis(1500)).await.expect("claim").is_empty());
        assert_eq!(b.stream_state("Q").await.expect("stream").messages, 0);
    }

    pub async fn dedupe_by_message_id(b: SharedBroker) {
        queue(&b, 30_000).await;
        let first = b.publish(OutboundMessage::new("q.a", "one").with_id("same")).await.expect("publish");
        let again = b.publish(OutboundMessage::new("q.a", "two").with_id("same")).await.expect("publish");
        assert!(!first.duplicate);
        assert!(again.duplicate);
        assert_eq!(again.seq, first.seq);
        let other = b.publish(OutboundMessage::new("q.a", "three").with_id("other")).await.expect("publish");
        assert_eq!(other.seq, first.seq + 1);
        let got = b.claim("Q", "w", 10, WAIT).await.expect("claim");
        let bodies: Vec<_> = got.iter().map(|d| d.payload.clone()).collect();
        assert_eq!(bodies, vec![Bytes::from("one"), Bytes::from("three")]);
    }

    pub async fn explicit_acks_out_of_order_move_the_floor_over_the_acked_prefix(b: SharedBroker) {
        b.ensure_stream(StreamSpec::new("E", vec!["e.>".into()], Retention::Limits)).await.expect("stream");
        b.ensure_consumer("E", ConsumerSpec { max_deliver: None, ..consumer("x", 30_000) }).await.expect("consumer");
        for i in 0..5 {
            publish(&b, "e.a", &format!("{i}")).await;
        }
        let got = b.claim("E", "x", 5, WAIT).await.expect("claim");
        assert_eq!(got.len(), 5);
        let floor = |b: SharedBroker| async move {
            let c = b.consumer_state("E", "x").await.expect("state");
            (c.ack_floor, c.num_ack_pending)
        };
        for (ack, want) in [(1, (0, 4)), (3, (0, 3)), (0, (2, 2)), (4, (2, 1)), (2, (5, 0))] {
            b.ack_confirmed(&got[ack].token, AckKind::Ack).await.expect("ack");
            assert_eq!(floor(b.clone()).await, want, "after acking seq {}", ack + 1);
        }
        // In order from here on: the floor follows each ack.
        for i in 5..8 {
            publish(&b, "e.a", &format!("{i}")).await;
        }
        let more = b.claim("E", "x", 3, WAIT).await.expect("claim");
        for (i, d) in more.iter().enumerate() {
            b.ack_confirmed(&d.token, AckKind::Ack).await.expect("ack");
            assert_eq!(floor(b.clone()).await, (6 + i as u64, 2 - i as u64));
        }
    }

    pub async fn ack_all_acks_the_prefix(b: SharedBroker) {
        b.ensure_stream(StreamSpec::new("O", vec!["o.*".into()], Retention::Limits)).await.expect("stream");
        let spec = ConsumerSpec {
            filter_subject: Some("o.1".into()),
            ack_policy: AckPolicy::All,
            max_deliver: None,
            ..consumer("p1", 1_000)
        };
        b.ensure_consumer("O", spec).await.expect("consumer");
        for i in 0..5 {
            publish(&b, "o.1", &format!("{i}")).await;
            publish(&b, "o.2", "other partition").await;
        }
        let got = b.claim("O", "p1", 10, WAIT).await.expect("claim");
        let seqs: Vec<u64> = got.iter().map(|d| d.info.stream_seq).collect();
        assert_eq!(seqs, vec![1, 3, 5, 7, 9], "filter keeps to one partition, in order");
        b.ack_confirmed(&got[2].token, AckKind::Ack).await.expect("ack third");
        let c = b.consumer_state("O", "p1").await.expect("state");
        assert_eq!((c.ack_floor, c.num_ack_pending), (5, 2));
        let again = b.claim("O", "p1", 10, WAIT).await.expect("claim");
        let seqs: Vec<u64> = again.iter().map(|d| d.info.stream_seq).collect();
        assert_eq!(seqs, vec![7, 9], "only the unacked suffix comes back");
        assert_eq!(b.stream_state("O").await.expect("stream").messages, 10, "limits retention keeps everything");
    }

    pub async fn reset_consumer_resumes_at_the_committed_position(b: SharedBroker) {
        b.ensure_stream(StreamSpec::new("O", vec!["o.*".into()], Retention::Limits)).await.expect("stream");
        let spec = ConsumerSpec {
            filter_subject: Some("o.1".into()),
            ack_policy: AckPolicy::All,
            max_deliver: None,
            ..consumer("p1", 30_000)
        };
        b.ensure_consumer("O", spec.clone()).await.expect("consumer");
        for i in 0..4 {
            publish(&b, "o.1", &format!("{i}")).await; // seqs 1, 3, 5, 7
            publish(&b, "o.2", "other").await;
        }
        let got = b.claim("O", "p1", 2, WAIT).await.expect("claim");
        b.ack_confirmed(&got[0].token, AckKind::Ack).await.expect("commit seq 1");
        // The owner dies holding seq 3. A new owner must not be handed 5 and 7 first.
        let state = b.consumer_state("O", "p1").await.expect("state");
        assert_eq!((state.ack_floor, state.num_ack_pending), (1, 1));
        let reset = b.reset_consumer("O", spec.clone(), state.ack_floor + 1).await.expect("reset");
        assert_eq!((reset.num_ack_pending, reset.num_pending), (0, 3));
        let again = b.claim("O", "p1", 10, WAIT).await.expect("claim");
        let seqs: Vec<u64> = again.iter().map(|d| d.info.stream_seq).collect();
        assert_eq!(seqs, vec![3, 5, 7], "resumes at the first unacked message, in order, at once");
        assert_eq!(again[0].info.delivered, 1);
        // The new owner dies too, before acking anything: the committed position is
        // still 1 (a recreated consumer reports no acks of its own yet; JetStream 2.9
        // says ack floor 0 there, which must not send the partition back to the start).
        let state = b.consumer_state("O", "p1").await.expect("state");
        assert_eq!((state.ack_floor, state.num_ack_pending), (1, 3), "{state:?}");
        let reset = b.reset_consumer("O", spec.clone(), state.ack_floor + 1).await.expect("reset");
        assert_eq!((reset.ack_floor, reset.num_pending), (1, 3), "{reset:?}");
        let seqs: Vec<u64> =
            b.claim("O", "p1", 10, WAIT).await.expect("claim").iter().map(|d| d.info.stream_seq).collect();
        assert_eq!(seqs, vec![3, 5, 7]);
    }

    pub async fn publish_batch_is_ordered(b: SharedBroker) {
        queue(&b, 30_000).await;
        let msgs: Vec<_> = (0..200u32)
            .map(|i| OutboundMessage::new("q.a", Bytes::from(i.to_be_bytes().to_vec())).with_id(format!("b{i}")))
            .collect();
        let acks = b.publish_batch(msgs).await;
        let seqs: Vec<u64> = acks.into_iter().map(|a| a.expect("ack").seq).collect();
        assert_eq!(seqs, (1..=200).collect::<Vec<_>>());
        let mixed = vec![OutboundMessage::new("q.a", "ok"), OutboundMessage::new("nowhere", "lost")];
        let acks = b.publish_batch(mixed).await;
        assert!(acks[0].is_ok());
        assert!(matches!(acks[1], Err(BrokerError::NoStream { .. })), "{:?}", acks[1]);
    }

    pub async fn pipelined_publishes_keep_call_order(b: SharedBroker) {
        queue(&b, 30_000).await;
        let mut pending = Vec::new();
        for i in 0..100u32 {
            let msg = OutboundMessage::new("q.a", Bytes::from(i.to_be_bytes().to_vec())).with_id(format!("pp{i}"));
            pending.push(b.publish_pipelined(msg).await.expect("queued"));
        }
        let acks = futures::future::join_all(pending).await;
        let seqs: Vec<u64> = acks.into_iter().map(|a| a.expect("ack").seq).collect();
        assert_eq!(seqs, (1..=100).collect::<Vec<_>>(), "stored in call order");
        let late = b.publish_pipelined(OutboundMessage::new("nowhere.at.all", "x")).await;
        match late {
            Ok(fut) => assert!(matches!(fut.await, Err(BrokerError::NoStream { .. }))),
            Err(e) => assert!(matches!(e, BrokerError::NoStream { .. }), "{e}"),
        }
    }

    pub async fn pipelined_batches_keep_order_and_report_the_first_refusal(b: SharedBroker) {
        queue(&b, 30_000).await;
        let batch = |from: u32| -> std::sync::Arc<[OutboundMessage]> {
            (from..from + 50)
                .map(|i| OutboundMessage::new("q.a", Bytes::from(i.to_be_bytes().to_vec())).with_id(format!("pb{i}")))
                .collect()
        };
        // Two batches queued before either is awaited: stored in call order.
        let first = b.publish_pipelined_batch(batch(0)).await.expect("queued");
        let second = b.publish_pipelined_batch(batch(50)).await.expect("queued");
        second.await.expect("stored");
        first.await.expect("stored");
        let got = b.claim("Q", "w", 100, WAIT).await.expect("claim");
        let order: Vec<u32> =
            got.iter().map(|d| u32::from_be_bytes(d.payload[..4].try_into().expect("4 bytes"))).collect();
        assert_eq!(order, (0..100).collect::<Vec<_>>());
        // A refused message fails the batch; the others are still stored.
        let mixed: std::sync::Arc<[OutboundMessage]> = vec![
            OutboundMessage::new("q.a", "before").with_id("m1"),
            OutboundMessage::new("nowhere.at.all", "lost").with_id("m2"),
            OutboundMessage::new("q.a", "after").with_id("m3"),
        ]
        .into();
        let outcome = match b.publish_pipelined_batch(mixed).await {
            Ok(stored) => stored.await,
            Err(e) => Err(e),
        };
        assert!(matches!(outcome, Err(BrokerError::NoStream { .. })), "{outcome:?}");
        let state = b.stream_state("Q").await.expect("state");
        assert_eq!(state.last_seq, 102, "both good messages of the mixed batch are stored");
    }

    pub async fn headers_nats_cannot_carry_are_refused(b: SharedBroker) {
        queue(&b, 30_000).await;
        let line_break = OutboundMessage::new("q.a", "x").with_header("Flotilla-Key", "a\r\nInjected: yes");
        match b.publish(line_break.clone()).await {
            Err(BrokerError::InvalidHeader { name, .. }) => assert_eq!(name, "Flotilla-Key"),
            other => panic!("a value with a line break must be refused, got {other:?}"),
        }
        let batch: std::sync::Arc<[OutboundMessage]> = vec![line_break].into();
        let outcome = match b.publish_pipelined_batch(batch).await {
            Ok(stored) => stored.await,
            Err(e) => Err(e),
        };
        assert!(matches!(outcome, Err(BrokerError::InvalidHeader { .. })), "{outcome:?}");
        let bad_name = OutboundMessage::new("q.a", "x").with_header("Bad Name:", "v".to_owned());
        assert!(matches!(b.publish(bad_name).await, Err(BrokerError::InvalidHeader { .. })));
        let core = CoreMessage {
            subject: "core.x".into(),
            reply: None,
            headers: flotilla_transport::wire::Headers::new().with("X", "a\nb"),
            payload: Bytes::new(),
        };
        assert!(matches!(b.core_publish(core).await, Err(BrokerError::InvalidHeader { .. })));
        assert_eq!(b.stream_state("Q").await.expect("state").messages, 0, "nothing was stored");
        // The connection is still fine.
        b.publish(OutboundMessage::new("q.a", "ok")).await.expect("publish after the refusals");
    }

    pub async fn publish_expectation_is_checked(b: SharedBroker) {
        queue(&b, 30_000).await;
        let mut m = OutboundMessage::new("q.x", "first");
        m.expected_last_subject_seq = Some(0);
        assert_eq!(b.publish(m.clone()).await.expect("first").seq, 1);
        let err = b.publish(m).await.expect_err("second with expectation 0");
        assert!(matches!(err, BrokerError::WrongLastSequence { expected: 0, .. }), "{err}");
    }

    /// A producer's `Nats-Expected-*` headers are publish expectations, checked as
    /// JetStream checks them: the stream's name, the subject's and the stream's last
    /// sequence.
    pub async fn publish_expectation_headers_are_checked(b: SharedBroker) {
        queue(&b, 30_000).await;
        let expecting = |name: &'static str, value: &str| OutboundMessage::new("q.x", "m").with_header(name, value);
        let err = b.publish(expecting("Nats-Expected-Stream", "OTHER")).await.expect_err("another stream");
        assert!(err.to_string().contains("expected stream does not match"), "{err}");
        let err =
            b.publish(expecting("Nats-Expected-Last-Subject-Sequence", "3")).await.expect_err("wrong subject seq");
        assert!(matches!(err, BrokerError::WrongLastSequence { .. }), "{err}");
        let err = b.publish(expecting("Nats-Expected-Last-Sequence", "3")).await.expect_err("wrong stream seq");
        assert!(matches!(err, BrokerError::WrongLastSequence { .. }), "{err}");
        assert_eq!(b.stream_state("Q").await.expect("state").messages, 0, "nothing was stored");
        let ok = expecting("Nats-Expected-Stream", "Q").with_header("Nats-Expected-Last-Subject-Sequence", "0");
        assert_eq!(b.publish(ok).await.expect("the expectations hold").seq, 1);
        publish(&b, "q.y", "other subject").await;
        let ok = expecting("Nats-Expected-Last-Subject-Sequence", "1").with_header("Nats-Expected-Last-Sequence", "2");
        assert_eq!(b.publish(ok).await.expect("the expectations hold").seq, 3);
    }

    pub async fn publish_without_stream_is_refused(b: SharedBroker) {
        let err = b.publish(OutboundMessage::new("nobody.listens", "x")).await.expect_err("no stream");
        assert!(matches!(err, BrokerError::NoStream { .. }), "{err}");
        assert!(err.to_string().contains("nobody.listens"));
    }

    pub async fn oversize_publish_is_refused(b: SharedBroker) {
        queue(&b, 30_000).await;
        let limit = b.server().max_payload;
        let err =
            b.publish(OutboundMessage::new("q.a", Bytes::from(vec![0u8; limit + 1]))).await.expect_err("too large");
        assert!(
            matches!(err, BrokerError::PayloadTooLarge { size, limit: l } if size == limit + 1 && l == limit),
            "{err}"
        );
        assert!(err.to_string().contains("max_payload"), "{err}");
        assert_eq!(b.stream_state("Q").await.expect("stream").messages, 0);
        b.publish(OutboundMessage::new("q.a", Bytes::from(vec![0u8; 1024]))).await.expect("a normal one still works");
    }

    pub async fn get_and_delete_by_sequence(b: SharedBroker) {
        queue(&b, 30_000).await;
        let seq =
            b.publish(OutboundMessage::new("q.a", "keep").with_id("g1").with_header("X-A", "1")).await.expect("p").seq;
        let m = b.get_message("Q", seq).await.expect("get").expect("present");
        assert_eq!(
            (m.subject.as_str(), m.payload.clone(), m.headers.get("X-A")),
            ("q.a", Bytes::from("keep"), Some("1"))
        );
        assert!(b.delete_message("Q", seq).await.expect("delete"));
        assert!(b.get_message("Q", seq).await.expect("get").is_none());
        assert!(!b.delete_message("Q", seq).await.expect("delete again"));
        assert!(b.get_message("Q", 999).await.expect("get").is_none());
    }

    /// What a listing reads: the next stored message of a subject at or after a
    /// sequence, without a read per deleted sequence or per message of another subject.
    pub async fn get_next_skips_gaps_and_other_subjects(b: SharedBroker) {
        queue(&b, 30_000).await;
        for (subject, body) in [("q.a", "1"), ("q.b", "2"), ("q.a", "3"), ("q.a", "4"), ("q.b", "5")] {
            publish(&b, subject, body).await;
        }
        assert!(b.delete_message("Q", 3).await.expect("delete"));
        let next = async |seq: u64, subject: &str| {
            b.get_next_message("Q", seq, subject).await.expect("get next").map(|m| (m.seq, m.subject, m.payload))
        };
        assert_eq!(next(0, "q.>").await, Some((1, "q.a".into(), Bytes::from("1"))), "0 reads from the first");
        assert_eq!(next(2, "q.>").await.map(|m| m.0), Some(2));
        assert_eq!(next(2, "q.a").await.map(|m| m.0), Some(4), "past another subject's message and a deleted one");
        assert_eq!(next(5, "q.a").await, None);
        assert_eq!(next(5, "q.*").await.map(|m| m.0), Some(5));
        assert_eq!(next(6, "q.>").await, None, "past the end");
        assert!(matches!(b.get_next_message("NOPE", 1, "q.>").await, Err(BrokerError::StreamNotFound { .. })));
    }

    async fn bucket(b: &SharedBroker, ttl: Option<Duration>) {
        b.ensure_kv(KvSpec::new("LEASES", ttl)).await.expect("bucket");
    }

    pub async fn kv_create_race_has_one_winner(b: SharedBroker) {
        bucket(&b, None).await;
        for round in 0..5 {
            let key = format!("p.{round}");
            let (x, y) = tokio::join!(
                b.kv_create("LEASES", &key, Bytes::from("node-a")),
                b.kv_create("LEASES", &key, Bytes::from("node-b"))
            );
            let wins = [&x, &y].iter().filter(|r| r.is_ok()).count();
            assert_eq!(wins, 1, "round {round}: {x:?} {y:?}");
            let loser = if x.is_ok() { y } else { x };
            assert!(matches!(loser, Err(BrokerError::KvKeyExists { .. })), "{loser:?}");
        }
    }

    pub async fn kv_compare_and_set(b: SharedBroker) {
        bucket(&b, None).await;
        let r1 = b.kv_create("LEASES", "p.0", Bytes::from("a")).await.expect("create");
        let r2 = b.kv_update("LEASES", "p.0", Bytes::from("b"), r1).await.expect("update");
        assert!(r2 > r1);
        let stale = b.kv_update("LEASES", "p.0", Bytes::from("c"), r1).await.expect_err("stale revision");
        assert!(matches!(stale, BrokerError::KvWrongRevision { expected, .. } if expected == r1), "{stale}");
        let e = b.kv_get("LEASES", "p.0").await.expect("get").expect("entry");
        assert_eq!((e.value, e.revision, e.operation), (Bytes::from("b"), r2, KvOperation::Put));
        let wrong = b.kv_delete("LEASES", "p.0", Some(r1)).await.expect_err("delete at stale revision");
        assert!(matches!(wrong, BrokerError::KvWrongRevision { .. }), "{wrong}");
        b.kv_delete("LEASES", "p.0", Some(r2)).await.expect("delete");
        assert!(b.kv_get("LEASES", "p.0").await.expect("get").is_none());
        assert!(b.kv_keys("LEASES").await.expect("keys").is_empty());
        let r3 = b.kv_create("LEASES", "p.0", Bytes::from("again")).await.expect("create over a delete");
        assert!(r3 > r2);
        let r4 = b.kv_put("LEASES", "p.1", Bytes::from("x")).await.expect("put");
        assert!(r4 > r3);
        assert_eq!(b.kv_keys("LEASES").await.expect("keys"), vec!["p.0".to_string(), "p.1".to_string()]);
        assert!(b.kv_get("LEASES", "bad key").await.is_err(), "invalid keys are refused");
    }

    pub async fn kv_expiry(b: SharedBroker) {
        bucket(&b, Some(Duration::from_secs(1))).await;
        let r1 = b.kv_create("LEASES", "p.0", Bytes::from("a")).await.expect("create");
        assert!(b.kv_create("LEASES", "p.0", Bytes::from("b")).await.is_err(), "held");
        sleep(Duration::from_millis(2500)).await;
        assert!(b.kv_get("LEASES", "p.0").await.expect("get").is_none(), "expired");
        let renew = b.kv_update("LEASES", "p.0", Bytes::from("a"), r1).await;
        assert!(
            matches!(renew, Err(BrokerError::KvWrongRevision { .. })),
            "an expired lease cannot be renewed: {renew:?}"
        );
        let r2 = b.kv_create("LEASES", "p.0", Bytes::from("b")).await.expect("create after expiry");
        assert!(r2 > r1, "revisions keep growing: {r1} then {r2}");
    }

    pub async fn kv_watch_sees_current_then_changes(b: SharedBroker) {
        bucket(&b, None).await;
        b.kv_put("LEASES", "p.0", Bytes::from("a")).await.expect("put");
        let mut w = b.kv_watch("LEASES", ">").await.expect("watch");
        let first = timeout(WAIT, w.next()).await.expect("in time").expect("entry").expect("ok");
        assert_eq!((first.key.as_str(), first.value.clone()), ("p.0", Bytes::from("a")));
        b.kv_put("LEASES", "p.1", Bytes::from("b")).await.expect("put");
        let second = timeout(WAIT, w.next()).await.expect("in time").expect("entry").expect("ok");
        assert_eq!((second.key.as_str(), second.operation), ("p.1", KvOperation::Put));
        b.kv_delete("LEASES", "p.0", None).await.expect("delete");
        let third = timeout(WAIT, w.next()).await.expect("in time").expect("entry").expect("ok");
        assert_eq!((third.key.as_str(), third.operation), ("p.0", KvOperation::Delete));
    }

    pub async fn typed_keys_modify_by_compare_and_set_and_watch_a_pattern(b: SharedBroker) {
        use flotilla_transport::kv::{Edit, TypedKey};
        bucket(&b, None).await;
        let count = |key: &str| TypedKey::<u64>::new(b.clone(), "LEASES", key);
        // Two writers add to one count, each from what it read: neither addition is lost.
        // Each writes fewer times than a modify's tries, so no modify can lose them all.
        let (x, y) = (count("done.in.0"), count("done.in.0"));
        let add = |k: TypedKey<u64>| async move {
            for _ in 0..5 {
                k.modify(|n| Edit::Write(n.unwrap_or(0) + 1, ())).await.expect("modify");
            }
        };
        tokio::join!(add(x), add(y));
        assert_eq!(count("done.in.0").get().await.expect("get").map(|v| v.value), Some(10));
        let mut changes = count("done.>").watch_keys().await.expect("watch");
        let first = timeout(WAIT, changes.next()).await.expect("in time").expect("open").expect("ok");
        assert_eq!(first, ("done.in.0".to_owned(), Some(10)));
        count("other").modify(|_| Edit::Write(1, ())).await.expect("other key");
        count("done.in.1").modify(|_| Edit::Write(5, ())).await.expect("second key");
        let second = timeout(WAIT, changes.next()).await.expect("in time").expect("open").expect("ok");
        assert_eq!(second, ("done.in.1".to_owned(), Some(5)), "keys outside the pattern are not seen");
        count("done.in.0").modify(|_| Edit::<u64, ()>::Delete(())).await.expect("delete");
        let third = timeout(WAIT, changes.next()).await.expect("in time").expect("open").expect("ok");
        assert_eq!(third, ("done.in.0".to_owned(), None));
    }

    pub async fn kv_scan_reads_the_current_values_and_ends(b: SharedBroker) {
        bucket(&b, None).await;
        // Nothing matches: the scan ends at once.
        let empty: Vec<_> = timeout(WAIT, b.kv_scan("LEASES", "in.0.>").await.expect("scan").collect::<Vec<_>>())
            .await
            .expect("an empty scan ends");
        assert!(empty.is_empty(), "{empty:?}");
        for i in 0..300u32 {
            b.kv_put("LEASES", &format!("in.0.s.{i:04}"), Bytes::from(format!("v{i}"))).await.expect("put");
        }
        b.kv_put("LEASES", "in.0.s.0007", Bytes::from("again")).await.expect("put");
        b.kv_put("LEASES", "in.1.s.0001", Bytes::from("other partition")).await.expect("put");
        b.kv_delete("LEASES", "in.0.s.0009", None).await.expect("delete");
        let got: Vec<KvEntry> = timeout(WAIT, b.kv_scan("LEASES", "in.0.>").await.expect("scan").collect::<Vec<_>>())
            .await
            .expect("the scan ends")
            .into_iter()
            .map(|e| e.expect("entry"))
            .collect();
        assert_eq!(got.len(), 300, "one entry per key of the partition, the delete included");
        let by_key: std::collections::BTreeMap<&str, &KvEntry> = got.iter().map(|e| (e.key.as_str(), e)).collect();
        assert_eq!(by_key["in.0.s.0007"].value, Bytes::from("again"), "the latest value");
        assert_eq!(by_key["in.0.s.0009"].operation, KvOperation::Delete);
        assert_eq!(by_key["in.0.s.0299"].value, Bytes::from("v299"));
        assert!(got.windows(2).all(|w| w[0].revision < w[1].revision), "in revision order");
    }

    pub async fn request_reply(b: SharedBroker) {
        let mut sub = b.subscribe("svc.echo", Some("nodes")).await.expect("subscribe");
        b.flush().await.expect("flush");
        let responder = b.clone();
        let task = tokio::spawn(async move {
            let req = sub.next().await.expect("request");
            let reply = req.reply.expect("reply subject");
            let mut out = CoreMessage::new(reply, Bytes::from([b"echo:".as_slice(), &req.payload].concat()));
            out.headers.insert("X-Req", req.headers.get("X-Req").unwrap_or("?"));
            responder.core_publish(out).await.expect("reply");
        });
        let mut req = CoreMessage::new("svc.echo", "hi");
        req.headers.insert("X-Req", "7");
        let reply = b.request(req, WAIT).await.expect("reply");
        assert_eq!(reply.payload, Bytes::from("echo:hi"));
        assert_eq!(reply.headers.get("X-Req"), Some("7"));
        task.await.expect("responder");
    }

    pub async fn request_with_no_responders(b: SharedBroker) {
        let started = Instant::now();
        let err = b.request(CoreMessage::new("svc.nobody", "x"), WAIT).await.expect_err("no responders");
        assert!(matches!(err, BrokerError::NoResponders { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(2), "no-responders is immediate, took {:?}", started.elapsed());
    }

    pub async fn request_timeout(b: SharedBroker) {
        let _silent = b.subscribe("svc.silent", None).await.expect("subscribe");
        b.flush().await.expect("flush");
        let started = Instant::now();
        let err =
            b.request(CoreMessage::new("svc.silent", "x"), Duration::from_millis(500)).await.expect_err("timeout");
        assert!(matches!(err, BrokerError::TimedOut { .. }), "{err}");
        assert!(started.elapsed() >= Duration::from_millis(450), "{:?}", started.elapsed());
    }

    pub async fn provisioning_twice_is_a_no_op(b: SharedBroker) {
        let first = b.ensure_stream(queue_spec()).await.expect("stream");
        b.ensure_consumer("Q", consumer("w", 30_000)).await.expect("consumer");
        publish(&b, "q.a", "kept").await;
        let second = b.ensure_stream(queue_spec()).await.expect("stream again");
        assert_eq!((first.messages, second.messages, second.last_seq), (0, 1, 1));
        let c = b.ensure_consumer("Q", consumer("w", 30_000)).await.expect("consumer again");
        assert_eq!(c.num_pending, 1);
        assert_eq!(c.spec, consumer("w", 30_000), "read back equals what was asked");
        b.ensure_kv(KvSpec::new("NODES", Some(Duration::from_secs(15)))).await.expect("kv");
        b.ensure_kv(KvSpec::new("NODES", Some(Duration::from_secs(15)))).await.expect("kv again");
    }

    pub async fn mismatching_config_is_refused(b: SharedBroker) {
        b.ensure_stream(queue_spec()).await.expect("stream");
        b.ensure_consumer("Q", consumer("w", 30_000)).await.expect("consumer");
        let mut other = queue_spec();
        other.max_age = Some(Duration::from_secs(3600));
        let err = b.ensure_stream(other).await.expect_err("max_age differs");
        assert!(matches!(&err, BrokerError::ConfigMismatch { field, .. } if field == "max_age"), "{err}");
        assert!(err.to_string().contains("stream Q") && err.to_string().contains("nothing was changed"), "{err}");
        let mut other = queue_spec();
        other.retention = Retention::Limits;
        assert!(matches!(b.ensure_stream(other).await, Err(BrokerError::ConfigMismatch { .. })));
        let explicit_to_all = ConsumerSpec { ack_policy: AckPolicy::All, ..consumer("w", 30_000) };
        let err = b.ensure_consumer("Q", explicit_to_all).await.expect_err("ack policy differs");
        assert!(matches!(&err, BrokerError::ConfigMismatch { field, .. } if field == "ack_policy"), "{err}");
        let refiltered = ConsumerSpec { filter_subject: Some("q.other".into()), ..consumer("w", 30_000) };
        let err = b.ensure_consumer("Q", refiltered).await.expect_err("filter differs");
        assert!(matches!(&err, BrokerError::ConfigMismatch { field, .. } if field == "filter_subject"), "{err}");
        // Nothing changed: the original configuration is still accepted.
        b.ensure_stream(queue_spec()).await.expect("original stream");
        let c = b.ensure_consumer("Q", consumer("w", 30_000)).await.expect("original consumer");
        assert_eq!(c.spec, consumer("w", 30_000));
        // Settings a live consumer can change are updated in place.
        let c = b.ensure_consumer("Q", consumer("w", 5_000)).await.expect("ack_wait updated");
        assert_eq!(c.spec.ack_wait, Duration::from_secs(5));
        assert_eq!(b.consumer_state("Q", "w").await.expect("state").spec.ack_wait, Duration::from_secs(5));
        b.ensure_kv(KvSpec::new("NODES", Some(Duration::from_secs(15)))).await.expect("kv");
        let err = b.ensure_kv(KvSpec::new("NODES", Some(Duration::from_secs(60)))).await.expect_err("kv ttl differs");
        assert!(err.to_string().contains("KV bucket NODES"), "{err}");
    }

    /// Limits an operator added (an age, a count, a size) change how long data is
    /// kept, not what Flotilla reads: such a stream or bucket is accepted as it is.
    pub async fn safe_differences_are_kept(b: SharedBroker) {
        let mut limited = queue_spec();
        limited.max_age = Some(Duration::from_secs(3600));
        limited.max_msgs = Some(100_000);
        limited.max_bytes = Some(64 * 1024 * 1024);
        b.ensure_stream(limited).await.expect("stream with an operator's limits");
        publish(&b, "q.a", "kept").await;
        let state = b.ensure_stream(queue_spec()).await.expect("the limits are safe to keep");
        assert_eq!(state.messages, 1, "nothing was changed or lost");
        b.ensure_kv(KvSpec::new("CONTROL", Some(Duration::from_secs(86_400)))).await.expect("bucket with a max age");
        b.ensure_kv(KvSpec::new("CONTROL", None)).await.expect("a max age Flotilla does not set is kept");
        // A TTL Flotilla sets (leases, liveness) must still match.
        b.ensure_kv(KvSpec::new("LEASES", Some(Duration::from_secs(6)))).await.expect("leases");
        let err = b.ensure_kv(KvSpec::new("LEASES", Some(Duration::from_secs(9)))).await.expect_err("TTL differs");
        assert!(matches!(&err, BrokerError::ConfigMismatch { field, .. } if field == "max_age"), "{err}");
    }

    /// A bucket every record of which is needed (the STATE changelog) refuses the limits
    /// other buckets keep: a max age, a message count or a byte size.
    pub async fn a_bucket_that_keeps_all_refuses_limits_that_lose_records(b: SharedBroker) {
        b.ensure_kv(KvSpec::new("STATE", Some(Duration::from_secs(3600)))).await.expect("bucket with a max age");
        let err = b.ensure_kv(KvSpec::new("STATE", None).keeping_all()).await.expect_err("expiring records");
        assert!(matches!(&err, BrokerError::LosesRecords { field, .. } if *field == "max_age"), "{err}");
        assert!(err.to_string().contains("KV bucket STATE has max_age"), "{err}");
        let mut sized = StreamSpec::new("KV_LOG", vec!["$KV.LOG.>".into()], Retention::Limits);
        sized.max_msgs_per_subject = Some(1);
        sized.discard = flotilla_transport::broker::Discard::New;
        sized.max_bytes = Some(1 << 20);
        b.ensure_stream(sized).await.expect("a bucket's stream with a size limit");
        let err = b.ensure_kv(KvSpec::new("LOG", None).keeping_all()).await.expect_err("a size limit");
        assert!(matches!(&err, BrokerError::LosesRecords { field, .. } if *field == "max_bytes"), "{err}");
        b.ensure_kv(KvSpec::new("LOG", None)).await.expect("elsewhere the same limit is safe to keep");
        b.ensure_kv(KvSpec::new("KEPT", None).keeping_all()).await.expect("a new bucket");
        b.ensure_kv(KvSpec::new("KEPT", None).keeping_all()).await.expect("again");
    }

    /// A partition whose consumer is gone (a reset interrupted between delete and
    /// create) is taken over from the stream's start: nothing skipped.
    pub async fn a_partition_whose_consumer_is_gone_is_taken_over_from_the_start(b: SharedBroker) {
        use flotilla_transport::topology;
        use flotilla_transport::wire::{JobName, StreamName, Subjects};
        let subjects = Subjects::new(JobName::new("j").expect("job"));
        let input = StreamName::new("in").expect("stream");
        topology::provision_ordered(&b, &subjects, &input, 1, Duration::from_secs(30), 16, 1).await.expect("provision");
        let js = subjects.stream_name(&input);
        for i in 0..3 {
            publish(&b, &subjects.ordered_partition(&input, 0), &format!("m{i}")).await;
        }
        let spec = topology::partition_consumer(&subjects, &input, 0, Duration::from_secs(30), 16);
        assert!(b.delete_consumer(&js, &spec.name).await.expect("delete"));
        let resumed = topology::take_over_partition(&b, &js, spec.clone()).await.expect("taken over");
        assert_eq!((resumed.state.num_pending, resumed.state.delivered), (3, 0), "{resumed:?}");
        let got = b.claim(&js, &spec.name, 10, Duration::from_millis(500)).await.expect("claim");
        assert_eq!(got.iter().map(|d| d.info.stream_seq).collect::<Vec<_>>(), vec![1, 2, 3]);
    }

    pub async fn missing_objects_are_typed_errors(b: SharedBroker) {
        assert!(matches!(b.stream_state("NOPE").await, Err(BrokerError::StreamNotFound { .. })));
        assert!(matches!(
            b.claim("NOPE", "w", 1, Duration::from_millis(100)).await,
            Err(BrokerError::StreamNotFound { .. })
        ));
        b.ensure_stream(queue_spec()).await.expect("stream");
        assert!(matches!(b.consumer_state("Q", "nope").await, Err(BrokerError::ConsumerNotFound { .. })));
        assert!(matches!(
            b.claim("Q", "nope", 1, Duration::from_millis(100)).await,
            Err(BrokerError::ConsumerNotFound { .. })
        ));
        assert!(matches!(b.kv_get("NOBUCKET", "k").await, Err(BrokerError::BucketNotFound { .. })));
        assert!(matches!(
            b.ensure_consumer("NOPE", consumer("w", 1000)).await,
            Err(BrokerError::StreamNotFound { .. })
        ));
    }
}
