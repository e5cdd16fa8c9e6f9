//! Getting data in and dead letters back out, against a real nats-server: the typed
//! `Producer`, partitions a stream does not have, `flotilla publish`, and the DLQ
//! listed, shown, replayed after a fix (each record delivered once) and purged.

use flotilla_actors::{Job, Producer, StreamDef, Task, TaskContext, TaskError};
use flotilla_node::cluster::JoinCluster;
use flotilla_node::dlq::DeadLetters;
use flotilla_tests::{NatsServer, connect, count, flotilla_bin, read_messages, wait_count};
use flotilla_transport::broker::{BrokerError, OutboundMessage, SharedBroker, StreamSpec};
use flotilla_transport::wire::{Codec, partition_for};
use serde::{Deserialize, Serialize};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::process::Command;
use std::rc::Rc;
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Order {
    id: u64,
    note: String,
}

const IN: StreamDef<Order> = StreamDef::ordered("orders", 4);
const OUT: StreamDef<Order> = StreamDef::ordered("shipped", 4);

/// Forwards orders; one with a note starting "bug" fails until the bug is fixed.
struct Ship {
    fixed: Rc<Cell<bool>>,
}

impl Task for Ship {
    type Input = Order;
    async fn process(&mut self, order: Order, ctx: &mut TaskContext) -> Result<(), TaskError> {
        if order.note.starts_with("bug") && !self.fixed.get() {
            return Err(TaskError::failed("the shipping code has a bug"));
        }
        ctx.send(&OUT, &order.id.to_string(), &order).await
    }
}

/// How many times each order id reached `shipped`.
async fn shipped(b: &SharedBroker) -> BTreeMap<u64, u32> {
    let mut out = BTreeMap::new();
    for d in read_messages(b, "FLOTILLA_shop_shipped", None, Duration::from_millis(300)).await {
        let order: Order = Codec::default().decode(&d.payload).expect("an order");
        *out.entry(order.id).or_default() += 1;
    }
    out
}

#[actix_rt::test]
async fn a_producer_feeds_a_job_and_dead_letters_replayed_after_the_fix_arrive_once() {
    let server = NatsServer::start();
    let b = connect(&server).await;
    // Records sent before any node ran: the producer creates the stream.
    let producer = Producer::new(b.clone(), "shop").expect("producer");
    let orders: Vec<(String, Order)> = (0..100)
        .map(|id| {
            let note = if id % 40 == 7 { format!("bug-{id}") } else { "ok".into() };
            (id.to_string(), Order { id, note })
        })
        .collect();
    let sent = producer.send_batch(&IN, orders.iter().map(|(k, o)| (k.as_str(), o))).await.expect("batch");
    assert_eq!(sent.len(), 100);
    for (s, (key, _)) in sent.iter().zip(&orders) {
        let p = flotilla_transport::wire::partition_for(key, 4);
        assert_eq!((s.partition, s.subject.as_str()), (Some(p), format!("flotilla.shop.orders.{p}").as_str()));
        assert!(!s.duplicate);
    }
    // The same id again is stored once.
    let again = producer.send_with_id(&IN, &sent[0].id, "0", &orders[0].1).await.expect("resend");
    assert!(again.duplicate, "{again:?}");
    // A partition the stream does not have is refused at publish time.
    let stray = OutboundMessage::new("flotilla.shop.orders.99", Codec::default().encode(&orders[1].1).expect("enc"));
    match b.publish(stray).await {
        Err(BrokerError::NoStream { subject }) => assert_eq!(subject, "flotilla.shop.orders.99"),
        other => panic!("a record for partition 99 of 4 was not refused: {other:?}"),
    }

    let fixed = Rc::new(Cell::new(false));
    let f = fixed.clone();
    let job = Job::new("shop")
        .task(IN, move |_| Ship { fixed: f.clone() })
        .max_attempts(2)
        .retry(flotilla_actors::RetryPolicy {
            max_attempts: 2,
            initial_backoff: Duration::from_millis(50),
            ..Default::default()
        })
        .output(OUT)
        .start(b.clone())
        .await
        .expect("start");
    // A delayed record goes through the timer stream.
    let later = producer
        .send_after(&IN, "1000", Order { id: 1000, note: "later".into() }, Duration::from_millis(500))
        .await
        .expect("delayed");
    assert!(later.subject.starts_with("flotilla.shop.orders."), "{later:?}");
    wait_count(&b, "FLOTILLA_shop_shipped", 98, Duration::from_secs(30)).await;
    wait_count(&b, "FLOTILLA_shop_DLQ", 3, Duration::from_secs(30)).await;

    let dlq = DeadLetters::new(b.clone(), "shop").expect("dlq");
    let entries = dlq.list(Some("orders"), Some("max-attempts"), 100).await.expect("list");
    let mut keys: Vec<_> = entries.iter().filter_map(|e| e.key.clone()).collect();
    keys.sort();
    assert_eq!(keys, ["47", "7", "87"], "{entries:?}");
    assert!(entries.iter().all(|e| e.attempts == 2 && e.subject.starts_with("flotilla.shop.orders.")), "{entries:?}");
    assert!(dlq.list(None, Some("malformed"), 100).await.expect("list").is_empty());

    // The bug is fixed; the dead letters go back, each once, even when replayed twice.
    fixed.set(true);
    assert_eq!(dlq.replay(&[], true, Some("orders"), None, false).await.expect("replay"), 3);
    assert_eq!(dlq.replay(&[], true, None, None, false).await.expect("nothing left"), 0);
    let gone = dlq.replay(&[entries[0].id], false, None, None, false).await.expect_err("gone");
    assert!(gone.to_string().contains("no dead letter"), "{gone}");
    wait_count(&b, "FLOTILLA_shop_shipped", 101, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let counts = shipped(&b).await;
    assert_eq!(counts.len(), 101, "every order and the delayed one: {counts:?}");
    assert!(counts.values().all(|&n| n == 1), "each shipped once: {counts:?}");
    assert_eq!(count(&b, "FLOTILLA_shop_DLQ").await, 0);
    job.stop();
    job.wait().await.expect("clean stop");
}

fn flotilla(server: &NatsServer, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(flotilla_bin())
        .args(["--nats", &server.url(), "--job", "shop"])
        .args(args)
        .env_remove("FLOTILLA_JOB")
        .env_remove("FLOTILLA_NATS")
        .output()
        .expect("run flotilla");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[actix_rt::test]
async fn flotilla_publish_and_the_dlq_commands_work_from_the_command_line() {
    let server = NatsServer::start();
    let b = connect(&server).await;
    // A stream made before streams listed their partitions, holding a stray record.
    b.ensure_stream(StreamSpec::new(
        "FLOTILLA_shop_orders",
        vec!["flotilla.shop.orders.*".into()],
        flotilla_transport::broker::Retention::Limits,
    ))
    .await
    .expect("old stream");
    b.publish(OutboundMessage::new("flotilla.shop.orders.99", &b"stray"[..])).await.expect("stray");
    let job = Job::new("shop")
        .task(IN, |_| Ship { fixed: Rc::new(Cell::new(true)) })
        .max_attempts(2)
        .output(OUT)
        .start_node(b.clone(), "cli-node", flotilla_actors::cluster::ClusterConfig::default())
        .await
        .expect("start on the old stream");

    // An empty dead-letter stream lists as empty.
    let (code, out, err) = flotilla(&server, &["dlq", "list", "--json"]);
    assert_eq!((code, out.as_str()), (0, ""), "{err}");
    // Raw bytes are not an Order: the node dead-letters them as malformed.
    let (code, _, err) = flotilla(&server, &["publish", "--stream", "orders", "--key", "k1", "--data", "not an order"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("published 1 of 1"), "{err}");
    let (code, _, err) = flotilla(&server, &["publish", "--stream", "orders", "--partition", "9", "--data", "x"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("4 partition(s), 0 to 3"), "{err}");
    let (code, _, err) = flotilla(&server, &["publish", "--stream", "orders", "--json", "{\"id\": 1}"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("use the job's binary"), "{err}");
    wait_count(&b, "FLOTILLA_shop_DLQ", 1, Duration::from_secs(30)).await;

    let (code, out, err) = flotilla(&server, &["dlq", "list", "--json"]);
    assert_eq!(code, 0, "{err}");
    let entries: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).expect("json line")).collect();
    assert_eq!(entries.len(), 1, "{out}");
    assert_eq!(entries[0]["reason"], "malformed", "{out}");
    assert_eq!(entries[0]["key"], "k1", "{out}");
    assert_eq!(entries[0]["attempts"], 0, "a malformed record never ran: {out}");
    let id = entries[0]["id"].as_u64().expect("id").to_string();
    let (code, out, err) = flotilla(&server, &["dlq", "show", &id]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("reason:   malformed") && out.contains("not an order"), "{out}");
    let (code, _, err) = flotilla(&server, &["dlq", "purge"]);
    assert_eq!(code, 2, "purge needs ids or --all: {err}");
    let (code, _, err) = flotilla(&server, &["dlq", "purge", &id]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("purged 1 of 1"), "{err}");
    assert_eq!(count(&b, "FLOTILLA_shop_DLQ").await, 0);

    let (code, out, err) = flotilla(&server, &["status", "--json"]);
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).expect("status json");
    assert_eq!(status["dlq"], 0, "{out}");
    assert_eq!(status["unreachable"]["flotilla.shop.orders.99"], 1, "{out}");
    job.stop();
    job.wait().await.expect("clean stop");
}

/// A drain that timed out stays pending (status shows it) until `drain --cancel`
/// begins a new run; a node started after that passes the old markers and keeps going.
#[actix_rt::test]
async fn a_pending_drain_shows_in_status_and_cancelling_it_lets_the_next_node_run_on() {
    let server = NatsServer::start();
    let b = connect(&server).await;
    let node = |b: &SharedBroker, id: &'static str| {
        Job::new("shop").task(IN, |_| Ship { fixed: Rc::new(Cell::new(true)) }).output(OUT).start_node(
            b.clone(),
            id,
            flotilla_actors::cluster::ClusterConfig::default(),
        )
    };
    let first = node(&b, "n1").await.expect("n1");
    let old_run = first.run_id().to_owned();
    let control = flotilla_node::ControlClient::new(b.clone(), "shop").await.expect("control");
    let producer = Producer::new(b.clone(), "shop").expect("producer");
    // One paused partition never reaches its marker: an order waits there before it, so
    // the drain times out. (With nothing before it, a marker that a claim already out
    // delivers is reached even while paused: nothing before it is left undone. On
    // 2.15.1 a claim was always out, and the drain ended.)
    control.set_paused(Some("orders"), Some(0), true).await.expect("pause");
    // The pause is desired state, which the holder applies on its next read of it: an
    // order sent before that may still be processed.
    let applied = async {
        loop {
            let status = control.status().await.expect("status");
            let slots = status.nodes.iter().flat_map(|n| &n.slots);
            if slots.filter(|s| s.stream == "orders" && s.partition == Some(0)).any(|s| s.paused) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), applied).await.expect("n1 applies the pause of orders/0");
    let key = (0..).map(|k: u64| k.to_string()).find(|k| partition_for(k, 4) == 0).expect("a key of orders/0");
    producer.send(&IN, &key, Order { id: 1000, note: "waits".into() }).await.expect("send");
    let err = control.drain(None, Duration::from_secs(20), false).await.expect_err("a paused partition stays");
    assert!(err.to_string().contains("orders/0"), "{err}");
    let status = control.status().await.expect("status");
    let pending = status.pending_drain.expect("the drain is pending");
    assert_eq!((pending.run_id.as_str(), pending.drained, pending.partitions), (old_run.as_str(), 3, 4));
    first.stop();
    first.wait().await.expect("n1 stops");

    let outcome = control.cancel_drain().await.expect("cancel");
    assert!(outcome.contains("cancelled"), "{outcome}");
    let status = control.status().await.expect("status");
    assert!(status.pending_drain.is_none(), "{:?}", status.pending_drain);
    assert_ne!(status.run_id.as_deref(), Some(old_run.as_str()), "a new run began");
    assert!(control.cancel_drain().await.expect("again").contains("no drain is pending"));
    control.set_paused(Some("orders"), Some(0), false).await.expect("resume");

    let second = node(&b, "n2").await.expect("n2");
    assert_ne!(second.run_id(), old_run);
    let orders: Vec<(String, Order)> = (0..40).map(|id| (id.to_string(), Order { id, note: "ok".into() })).collect();
    producer.send_batch(&IN, orders.iter().map(|(k, o)| (k.as_str(), o))).await.expect("send");
    // The 40, and the order that waited before the old marker.
    wait_count(&b, "FLOTILLA_shop_shipped", 41, Duration::from_secs(60)).await;
    second.stop();
    second.wait().await.expect("n2 stops");
}

/// End of stream on every partition completes the job across nodes: each node leaves
/// once every partition (its own and the others') processed its marker, and the next
/// start begins a new run that goes on after the markers.
#[actix_rt::test]
async fn end_of_stream_on_every_partition_ends_the_run_on_every_node() {
    let server = NatsServer::start();
    let b = connect(&server).await;
    let node = |b: &SharedBroker, id: &'static str| {
        Job::new("shop").task(IN, |_| Ship { fixed: Rc::new(Cell::new(true)) }).output(OUT).start_node(
            b.clone(),
            id,
            flotilla_actors::cluster::ClusterConfig::default(),
        )
    };
    let (a, c) = (node(&b, "a").await.expect("a"), node(&b, "c").await.expect("c"));
    let run = a.run_id().to_owned();
    assert_eq!(c.run_id(), run, "one run");
    let producer = Producer::new(b.clone(), "shop").expect("producer");
    let orders: Vec<(String, Order)> = (0..40).map(|id| (id.to_string(), Order { id, note: "ok".into() })).collect();
    producer.send_batch(&IN, orders.iter().map(|(k, o)| (k.as_str(), o))).await.expect("send");
    for p in 0..4 {
        let marker = OutboundMessage::new(format!("flotilla.shop.orders.{p}"), bytes::Bytes::new())
            .with_id(format!("eos-{p}"))
            .with_header(flotilla_transport::wire::headers::KIND, "end-of-stream");
        b.publish(marker).await.expect("marker");
    }
    let ended = tokio::time::timeout(Duration::from_secs(60), async {
        a.wait().await.expect("a ends cleanly");
        c.wait().await.expect("c ends cleanly");
    })
    .await;
    assert!(ended.is_ok(), "both nodes left once every partition ended");
    assert_eq!(count(&b, "FLOTILLA_shop_shipped").await, 40, "everything before the markers was processed");

    let next = node(&b, "a").await.expect("a again");
    assert_ne!(next.run_id(), run, "the ended run is over: a new one begins");
    producer.send(&IN, "41", Order { id: 41, note: "ok".into() }).await.expect("after the markers");
    wait_count(&b, "FLOTILLA_shop_shipped", 41, Duration::from_secs(60)).await;
    next.stop();
    next.wait().await.expect("stops");
}

/// Ships orders; an order with the note "close" asks to shut its task down.
struct Closer;

impl Task for Closer {
    type Input = Order;
    async fn process(&mut self, order: Order, ctx: &mut TaskContext) -> Result<(), TaskError> {
        if order.note == "close" {
            ctx.shutdown(flotilla_actors::ShutdownScope::CurrentTask);
        }
        ctx.send(&OUT, &order.id.to_string(), &order).await
    }
}

/// A task's `shutdown(CurrentTask)` acts across nodes, as the reference run loop's
/// coordinator requests do: the partition is done for the run (no other node takes it
/// up), and once every partition's task asked, every node leaves.
#[actix_rt::test]
async fn shutdown_requests_of_every_task_end_the_run_on_every_node() {
    let server = NatsServer::start();
    let b = connect(&server).await;
    let node = |b: &SharedBroker, id: &'static str| {
        Job::new("shop").task(IN, |_| Closer).output(OUT).start_node(
            b.clone(),
            id,
            flotilla_actors::cluster::ClusterConfig::default(),
        )
    };
    let (a, c) = (node(&b, "a").await.expect("a"), node(&b, "c").await.expect("c"));
    let run = a.run_id().to_owned();
    let producer = Producer::new(b.clone(), "shop").expect("producer");
    // One "close" per partition: a key of each.
    let mut closes = std::collections::BTreeMap::new();
    for id in 0u64.. {
        closes.entry(flotilla_transport::wire::partition_for(&id.to_string(), 4)).or_insert(id);
        if closes.len() == 4 {
            break;
        }
    }
    for &id in closes.values() {
        producer.send(&IN, &id.to_string(), Order { id, note: "close".into() }).await.expect("close");
    }
    let ended = tokio::time::timeout(Duration::from_secs(60), async {
        a.wait().await.expect("a ends cleanly");
        c.wait().await.expect("c ends cleanly");
    })
    .await;
    assert!(ended.is_ok(), "both nodes left once every task asked to shut down");
    assert_eq!(count(&b, "FLOTILLA_shop_shipped").await, 4);
    let next = node(&b, "a").await.expect("a again");
    assert_ne!(next.run_id(), run, "the run is over: a new one begins");
    next.stop();
    next.wait().await.expect("stops");
}

const REFUNDS: StreamDef<Order> = StreamDef::queue("refunds");
const REFUNDED: StreamDef<Order> = StreamDef::queue("refunded");

/// Forwards refunds.
struct Refund;

impl Task for Refund {
    type Input = Order;
    async fn process(&mut self, order: Order, ctx: &mut TaskContext) -> Result<(), TaskError> {
        ctx.send(&REFUNDED, &order.id.to_string(), &order).await
    }
}

/// Park one key of a queue input: its messages are set aside while the others flow;
/// `step --key` lets the oldest through; `unpark` sends the rest back in order.
#[actix_rt::test]
async fn a_parked_key_waits_while_others_flow_and_step_and_unpark_let_it_through() {
    let server = NatsServer::start();
    let b = connect(&server).await;
    let job = Job::new("shop")
        .task(REFUNDS, |_| Refund)
        .output(REFUNDED)
        .start_node(b.clone(), "n1", flotilla_actors::cluster::ClusterConfig::default())
        .await
        .expect("node");
    let control = flotilla_node::ControlClient::new(b.clone(), "shop").await.expect("control");
    assert!(control.park("orders", "k1", true).await.is_err(), "an ordered input's keys are not parked");
    control.park("refunds", "k1", true).await.expect("park");
    tokio::time::sleep(Duration::from_secs(4)).await; // the node's next scans see it
    let producer = Producer::new(b.clone(), "shop").expect("producer");
    for id in 0..6u64 {
        let key = if id % 2 == 0 { "k1" } else { "k2" };
        producer.send(&REFUNDS, key, Order { id, note: "refund".into() }).await.expect("send");
    }
    wait_count(&b, "FLOTILLA_shop_refunded", 3, Duration::from_secs(30)).await;
    wait_count(&b, "FLOTILLA_shop_PARKED", 3, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(count(&b, "FLOTILLA_shop_refunded").await, 3, "k2 flowed, k1 waits");
    let status = control.status().await.expect("status");
    assert_eq!(status.parked_messages, 3, "{status:?}");
    assert!(status.parked_keys.get("refunds").is_some_and(|k| k.contains("k1")));

    let seq = control.step_key("refunds", "k1").await.expect("step");
    wait_count(&b, "FLOTILLA_shop_refunded", 4, Duration::from_secs(30)).await;
    assert_eq!(count(&b, "FLOTILLA_shop_PARKED").await, 2);
    let moved = control.park("refunds", "k1", false).await.expect("unpark");
    assert_eq!(moved, 2);
    wait_count(&b, "FLOTILLA_shop_refunded", 6, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(count(&b, "FLOTILLA_shop_refunded").await, 6, "each refund once");
    assert_eq!(count(&b, "FLOTILLA_shop_PARKED").await, 0);
    assert!(seq > 0);
    job.stop();
    job.wait().await.expect("stop");
}

/// A drain after some partitions ended counts them as done: it completes and the node
/// leaves (an ended partition never reaches a drain marker).
#[actix_rt::test]
async fn a_drain_after_some_partitions_ended_completes() {
    let server = NatsServer::start();
    let b = connect(&server).await;
    let job = Job::new("shop")
        .task(IN, |_| Ship { fixed: Rc::new(Cell::new(true)) })
        .output(OUT)
        .start_node(b.clone(), "n1", flotilla_actors::cluster::ClusterConfig::default())
        .await
        .expect("node");
    for p in 0..2 {
        let marker = OutboundMessage::new(format!("flotilla.shop.orders.{p}"), bytes::Bytes::new())
            .with_id(format!("eos-{p}"))
            .with_header(flotilla_transport::wire::headers::KIND, "end-of-stream");
        b.publish(marker).await.expect("marker");
    }
    let control = flotilla_node::ControlClient::new(b.clone(), "shop").await.expect("control");
    control.drain(None, Duration::from_secs(60), false).await.expect("the drain completes");
    tokio::time::timeout(Duration::from_secs(30), job.wait()).await.expect("the node leaves").expect("cleanly");
}

/// Waits until `stream` holds at least `n` messages; a LIVENESS failure naming `what`
/// when it does not within `within`.
async fn await_count(b: &SharedBroker, stream: &str, n: u64, within: Duration, what: &str) {
    let start = std::time::Instant::now();
    while start.elapsed() < within {
        if count(b, stream).await >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("LIVENESS: {what}: {stream} has {} messages after {within:?}, expected {n}", count(b, stream).await);
}

/// A record as a producer in another language might publish it: with JetStream's
/// publish expectations (`Nats-Expected-Stream`, `Nats-Expected-Last-Subject-Sequence`)
/// beside Flotilla's headers.
fn expecting(
    subject: &str,
    stream: &str,
    last_subject_seq: u64,
    id: &str,
    key: &str,
    order: &Order,
) -> OutboundMessage {
    OutboundMessage::new(subject, Codec::default().encode(order).expect("encode"))
        .with_id(id)
        .with_header(flotilla_transport::wire::headers::KEY, key)
        .with_header("Nats-Expected-Stream", stream)
        .with_header("Nats-Expected-Last-Subject-Sequence", last_subject_seq.to_string())
}

/// A producer's publish expectations belong to its own publish: the dead letter of its
/// poison record and its promoted delayed record are published without them (JetStream
/// refuses a copy that still expects the producer's stream and sequence, and the record
/// was retried every second for ever, holding its partition).
#[actix_rt::test]
async fn a_producers_publish_expectations_do_not_wedge_its_dead_letter_or_its_delayed_record() {
    let server = NatsServer::start();
    let b = connect(&server).await;
    let job = Job::new("shop")
        .task(IN, |_| Ship { fixed: Rc::new(Cell::new(false)) })
        .retry(flotilla_actors::RetryPolicy {
            max_attempts: 2,
            initial_backoff: Duration::from_millis(50),
            ..Default::default()
        })
        .output(OUT)
        .start(b.clone())
        .await
        .expect("start");
    // Three records of one key (one partition), in order: the middle one is poison.
    let p = flotilla_transport::wire::partition_for("k", 4);
    let subject = format!("flotilla.shop.orders.{p}");
    let mut last = 0;
    for (id, note) in [(1, "ok"), (2, "bug"), (3, "ok")] {
        let order = Order { id, note: note.into() };
        let msg = expecting(&subject, "FLOTILLA_shop_orders", last, &format!("foreign-{id}"), "k", &order);
        last = b.publish(msg).await.expect("the producer's expectations hold for its own publish").seq;
    }
    await_count(&b, "FLOTILLA_shop_DLQ", 1, Duration::from_secs(30), "the poison record reaches the DLQ").await;
    await_count(&b, "FLOTILLA_shop_shipped", 2, Duration::from_secs(30), "the partition flows past the poison record")
        .await;
    let entries = DeadLetters::new(b.clone(), "shop").expect("dlq").list(None, None, 10).await.expect("list");
    assert_eq!(entries.len(), 1, "SAFETY: one dead letter for one poison record: {entries:?}");
    let names: Vec<&str> = entries[0].headers.iter().map(|(k, _)| k.as_str()).collect();
    assert!(
        !names.iter().any(|n| n.starts_with("Nats-Expected")),
        "the dead letter carries no publish expectation: {names:?}"
    );
    assert_eq!(entries[0].key.as_deref(), Some("k"), "the producer's own headers travel: {names:?}");

    // A delayed record scheduled by a foreign producer in the timer stream, with its
    // expectations for the timer stream: promoted into the partition when due.
    let order = Order { id: 4, note: "later".into() };
    let delayed =
        expecting("flotilla.shop._timer.foreign-4", "FLOTILLA_shop_TIMERS", 0, "timer-foreign-4", "k", &order)
            .with_header(flotilla_transport::wire::headers::DELAY, "300")
            .with_header(flotilla_transport::wire::headers::TARGET, subject.clone());
    b.publish(delayed).await.expect("scheduled");
    await_count(&b, "FLOTILLA_shop_shipped", 3, Duration::from_secs(30), "the delayed record is promoted and runs")
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let counts = shipped(&b).await;
    assert_eq!(counts, BTreeMap::from([(1, 1), (3, 1), (4, 1)]), "SAFETY: each good record shipped once");
    job.stop();
    job.wait().await.expect("clean stop");
}

/// The parked copy of a queue record of a parked key is published without the
/// producer's publish expectations (they named the queue stream; the copy goes to
/// PARKED), and it goes back to the queue on unpark.
#[actix_rt::test]
async fn a_producers_publish_expectations_do_not_wedge_parking_its_record() {
    let server = NatsServer::start();
    let b = connect(&server).await;
    let job = Job::new("shop")
        .task(REFUNDS, |_| Refund)
        .output(REFUNDED)
        .start_node(b.clone(), "n1", flotilla_actors::cluster::ClusterConfig::default())
        .await
        .expect("node");
    let control = flotilla_node::ControlClient::new(b.clone(), "shop").await.expect("control");
    control.park("refunds", "k1", true).await.expect("park");
    tokio::time::sleep(Duration::from_secs(4)).await; // the node's next scans see it
    let order = Order { id: 1, note: "refund".into() };
    let msg = expecting("flotilla.shop.refunds", "FLOTILLA_shop_refunds", 0, "foreign-refund-1", "k1", &order);
    b.publish(msg).await.expect("the producer's expectations hold for its own publish");
    let other = OutboundMessage::new(
        "flotilla.shop.refunds",
        Codec::default().encode(&Order { id: 2, note: "refund".into() }).expect("encode"),
    )
    .with_id("foreign-refund-2")
    .with_header(flotilla_transport::wire::headers::KEY, "k2")
    .with_header("Nats-Expected-Stream", "FLOTILLA_shop_refunds");
    b.publish(other).await.expect("k2");
    await_count(&b, "FLOTILLA_shop_PARKED", 1, Duration::from_secs(30), "the record of the parked key is parked").await;
    await_count(&b, "FLOTILLA_shop_refunded", 1, Duration::from_secs(30), "the other key flows").await;
    assert_eq!(control.park("refunds", "k1", false).await.expect("unpark"), 1, "one record sent back");
    await_count(&b, "FLOTILLA_shop_refunded", 2, Duration::from_secs(30), "the unparked record runs").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(count(&b, "FLOTILLA_shop_refunded").await, 2, "SAFETY: each refund once");
    assert_eq!(count(&b, "FLOTILLA_shop_PARKED").await, 0, "SAFETY: nothing left parked");
    job.stop();
    job.wait().await.expect("stop");
}
