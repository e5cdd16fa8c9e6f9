//! The cluster with real processes: `relay` nodes on a real nats-server, started,
//! killed, paused and stopped by signal and by the control plane (DESIGN §7, issue 4).
//!
//! Every test bounds its waits, and every process it starts is killed by PID when the
//! test ends, also on failure ([`ProcessGuard`], [`NatsServer`]). Nodes run with a 3 s
//! lease TTL so failover waits stay short; the closing note reports the default's.
//!
//! CI retries a failed test here once. Assertions about records (lost, stored or
//! processed twice, stale epochs, dead letters, requests acted on twice) are
//! `safety!`: they fail CI even when the retry passes. Waits that run out are
//! `LIVENESS:` failures, which a retry may pass (`flotilla_tests::safety`).

use flotilla_actors::cluster::ControlReply;
use flotilla_tests::relay_cluster::Feed;
use flotilla_tests::relay_cluster::{
    IN, OUT, PARTITIONS, Record, RelayCluster, TTL, out_ids, read_stream, record, tail,
};
use flotilla_tests::{ProcessGuard, liveness, safety, safety_eq};
use flotilla_transport::broker::{CoreMessage, OutboundMessage};
use flotilla_transport::wire::{Codec, MessageKind, headers, partition_for};
use futures::StreamExt;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::rc::Rc;
use std::time::{Duration, Instant};

#[actix_rt::test]
async fn three_nodes_share_eight_partitions_and_a_fourth_joins_moving_only_what_it_needs() {
    let mut c = RelayCluster::start(&["a", "b", "c"]).await;
    let before = c.wait_balanced(&["a", "b", "c"], Duration::from_secs(40)).await;
    let feed = Feed::start(c.broker.clone(), 300);
    c.add("d");
    let after = c.wait_balanced(&["a", "b", "c", "d"], Duration::from_secs(40)).await;
    let moved: Vec<u32> = (0..PARTITIONS).filter(|p| before.get(p) != after.get(p)).collect();
    assert_eq!(moved.len(), 2, "3 → 4 nodes over 8 partitions moves exactly 2: before {before:?}, after {after:?}");
    assert!(moved.iter().all(|p| after[p] == "d"), "only partitions for the new node move: {before:?} → {after:?}");
    let n = feed.stop().await;
    c.wait_all_out(n, Duration::from_secs(60)).await;
    let status = c.relay_cmd(&["status", "--json"]);
    assert!(status.status.success(), "status failed: {}", String::from_utf8_lossy(&status.stderr));
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status --json is JSON");
    assert_eq!(json["nodes"].as_array().map(Vec::len), Some(4), "{json}");
    assert_eq!(json["partitions"].as_array().map(Vec::len), Some(PARTITIONS as usize), "{json}");
    for node in ["a", "b", "c", "d"] {
        c.nodes.get(node).expect("node").signal("TERM");
    }
    for node in ["a", "b", "c", "d"] {
        assert!(c.wait_exit(node, Duration::from_secs(30)).success(), "node {node} exits 0");
    }
}

#[actix_rt::test]
async fn a_killed_node_s_partitions_produce_elsewhere_within_two_ttls_and_nothing_is_lost() {
    let c = RelayCluster::start(&["a", "b", "c"]).await;
    let owners = c.wait_balanced(&["a", "b", "c"], Duration::from_secs(40)).await;
    // Watch relay-out as it is written: the first output of each partition per epoch.
    let mut watch = c.broker.subscribe("flotilla.relay.relay-out.*", None).await.expect("watch");
    let seen: Rc<RefCell<Vec<(Instant, u32, u64)>>> = Rc::default();
    // Every publish to relay-out, also those the stream deduplicates: how often each
    // record was processed.
    let published: Rc<RefCell<BTreeMap<String, u32>>> = Rc::default();
    let (s, pubs) = (seen.clone(), published.clone());
    let watcher = tokio::task::spawn_local(async move {
        while let Some(m) = watch.next().await {
            let Some(p) = m.subject.rsplit('.').next().and_then(|p| p.parse().ok()) else { continue };
            let epoch = m.headers.get(headers::EPOCH).and_then(|e| e.parse().ok()).unwrap_or(0);
            s.borrow_mut().push((Instant::now(), p, epoch));
            *pubs.borrow_mut().entry(m.headers.get(headers::KEY).unwrap_or_default().to_owned()).or_default() += 1;
        }
    });
    let feed = Feed::start(c.broker.clone(), 400);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let victim = "b";
    let moved: Vec<u32> = owners.iter().filter(|(_, o)| *o == victim).map(|(p, _)| *p).collect();
    let old_epochs: BTreeMap<u32, u64> = c.owners().await.into_iter().map(|(p, (_, e))| (p, e)).collect();
    c.nodes.get(victim).expect("victim").signal("KILL");
    let killed_at = Instant::now();
    // Each moved partition must produce with a newer epoch within 2 × TTL.
    let mut failover = BTreeMap::new();
    while failover.len() < moved.len() && killed_at.elapsed() < TTL * 2 + Duration::from_secs(10) {
        for (at, p, epoch) in seen.borrow().iter() {
            if moved.contains(p) && *epoch > old_epochs.get(p).copied().unwrap_or(0) && *at > killed_at {
                failover.entry(*p).or_insert(at.duration_since(killed_at));
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for p in &moved {
        let took = failover.get(p).copied();
        liveness!(
            took.is_some_and(|t| t <= TTL * 2),
            "partition {p} of the killed node produced again after {took:?} (limit {:?}); all: {failover:?}{}",
            TTL * 2,
            c.all_logs()
        );
    }
    eprintln!("failover (kill -9 → first output, lease TTL {TTL:?}): {failover:?}");
    let n = feed.stop().await;
    c.wait_all_out(n, Duration::from_secs(90)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    watcher.abort();
    // Reprocessing is bounded by what the killed node had processed but not committed
    // (at most a commit window per partition), never a replay of whole partitions.
    let again: u32 = published.borrow().values().map(|n| n - 1).sum();
    safety!(
        again as usize <= moved.len() * 256,
        "{again} records were processed more than once after killing a node holding {} partitions",
        moved.len()
    );
    eprintln!("records processed twice after the kill: {again}");
}

/// What systemd or a StatefulSet does: kill -9, then the same command again within a
/// second. The new process takes the dead one's node id over at once (same host, its
/// pid gone), takes over that id's leases with new epochs, and nothing is lost.
#[actix_rt::test]
async fn a_node_killed_and_restarted_with_its_id_within_a_second_takes_it_over_and_loses_nothing() {
    let mut c = RelayCluster::start(&["a", "b"]).await;
    let owners = c.wait_balanced(&["a", "b"], Duration::from_secs(40)).await;
    let feed = Feed::start(c.broker.clone(), 400);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let epochs_before: BTreeMap<u32, u64> = c.owners().await.into_iter().map(|(p, (_, e))| (p, e)).collect();
    let held_by_a: Vec<u32> = owners.iter().filter(|(_, o)| *o == "a").map(|(p, _)| *p).collect();
    let mut old = c.nodes.remove("a").expect("node a");
    old.signal("KILL");
    liveness!(old.wait_timeout(Duration::from_secs(5)).is_some(), "a did not die within 5 s of SIGKILL");
    drop(old);
    std::fs::rename(c.log("a"), c.dir.path().join("a-before-kill.log")).expect("keep the first log");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let restarted = Instant::now();
    c.add("a");
    // It starts (does not exit refusing its own id) and holds partitions again, with
    // new epochs, instead of waiting for the dead process's leases to expire.
    let renewed = |owners: &BTreeMap<u32, (String, u64)>| {
        owners.len() == PARTITIONS as usize
            && owners.iter().any(|(_, (o, _))| o == "a")
            && owners.iter().filter(|(_, (o, _))| o == "a").all(|(p, (_, e))| Some(e) > epochs_before.get(p))
    };
    let mut owners_after = c.owners().await;
    while !renewed(&owners_after) {
        liveness!(
            restarted.elapsed() < Duration::from_secs(30),
            "a's partitions not taken over with new epochs: {epochs_before:?} → {owners_after:?}{}",
            c.all_logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        owners_after = c.owners().await;
    }
    let took = restarted.elapsed();
    let log = c.log_text("a");
    assert!(log.contains("took the node id over"), "no take-over in the restarted node's log:{}", tail(&log, 40));
    assert!(
        c.nodes.get_mut("a").expect("a").wait_timeout(Duration::from_millis(10)).is_none(),
        "the restarted node exited:{}",
        tail(&log, 40)
    );
    eprintln!("restart in place: a held {held_by_a:?}; its partitions had new epochs {took:?} after the restart");
    let n = feed.stop().await;
    c.wait_all_out(n, Duration::from_secs(90)).await;
}

/// A record that aborts every node that runs it, with nodes restarted at once as a
/// supervisor would: it ends in the DLQ as `crash-loop` after the crash limit (3
/// counted crashes; the first, before anything is suspect, is not counted), and every
/// other record is relayed.
#[actix_rt::test]
async fn a_record_that_kills_every_node_ends_in_the_dlq_as_a_crash_loop() {
    let mut c = RelayCluster::start(&["a", "b"]).await;
    c.wait_balanced(&["a", "b"], Duration::from_secs(40)).await;
    const N: u64 = 400;
    const CRASHER: u64 = 123;
    let msgs: Vec<OutboundMessage> = (0..N)
        .map(|id| {
            if id != CRASHER {
                return record(id);
            }
            let key = id.to_string();
            let payload = Codec::default().encode(&Record { id, body: "crash".into() }).expect("encode");
            OutboundMessage::new(format!("flotilla.relay.relay-in.{}", partition_for(&key, PARTITIONS)), payload)
                .with_id(format!("in-{id}"))
                .with_header(headers::KEY, key)
        })
        .collect();
    for ack in c.broker.publish_batch(msgs).await {
        ack.expect("publish");
    }
    // The supervisor: a node that died is started again with its id at once.
    let started = Instant::now();
    let mut crashes = 0;
    let dlq_reason = loop {
        liveness!(
            started.elapsed() < Duration::from_secs(120),
            "no crash-loop dead letter after {crashes} crashes{}",
            c.all_logs()
        );
        for id in ["a", "b"] {
            if c.nodes.get_mut(id).expect("node").wait_timeout(Duration::from_millis(1)).is_some() {
                crashes += 1;
                std::fs::rename(c.log(id), c.dir.path().join(format!("{id}-crash-{crashes}.log"))).expect("keep log");
                c.add(id);
            }
        }
        let dead = read_stream(&c.broker, "FLOTILLA_relay_DLQ").await;
        if let Some((_, h, _, _)) = dead.first() {
            break (
                h.get(headers::DLQ_REASON).unwrap_or_default().to_owned(),
                h.get(headers::DLQ_DETAIL).unwrap_or_default().to_owned(),
                h.get(headers::KEY).unwrap_or_default().to_owned(),
                dead.len(),
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let (reason, detail, key, dead) = dlq_reason;
    safety_eq!(
        (reason.as_str(), key.as_str(), dead),
        ("crash-loop", "123", 1),
        "the crasher, once, is a crash-loop dead letter: {detail}"
    );
    safety!(detail.contains("started 3 times"), "{detail}");
    safety!((4..=5).contains(&crashes), "{crashes} crashes before the quarantine (1 uncounted + 3 counted expected)");
    eprintln!("crash loop: {crashes} crashes, then dead-lettered: {detail}");
    let ids = out_ids(&c.broker).await;
    let start = Instant::now();
    let mut ids = ids;
    while ids.len() < (N - 1) as usize && start.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(300)).await;
        ids = out_ids(&c.broker).await;
    }
    let missing: Vec<u64> = (0..N).filter(|i| *i != CRASHER && !ids.contains(i)).take(20).collect();
    if !missing.is_empty() {
        c.fail_missing(false, &format!("records missing from relay-out after 60 s: {missing:?}")).await;
    }
    safety!(!ids.contains(&CRASHER), "the crasher was relayed as well as dead-lettered");
}

#[actix_rt::test]
async fn a_graceful_stop_under_load_delivers_every_record_exactly_once() {
    let mut c = RelayCluster::start(&["a", "b", "c"]).await;
    c.wait_balanced(&["a", "b", "c"], Duration::from_secs(40)).await;
    let feed = Feed::start(c.broker.clone(), 400);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let stop = c.relay_cmd(&["stop", "--node", "b", "--timeout", "30s"]);
    assert!(stop.status.success(), "stop --node b failed: {}{}", String::from_utf8_lossy(&stop.stderr), c.all_logs());
    assert!(c.wait_exit("b", Duration::from_secs(30)).success(), "b exits 0");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let n = feed.stop().await;
    c.wait_all_out(n, Duration::from_secs(90)).await;
    let shutdown = c.relay_cmd(&["shutdown", "--timeout", "30s"]);
    assert!(shutdown.status.success(), "shutdown failed: {}", String::from_utf8_lossy(&shutdown.stderr));
    for id in ["a", "c"] {
        assert!(c.wait_exit(id, Duration::from_secs(30)).success(), "{id} exits 0");
    }
    let mut forwarded = 0;
    for id in ["a", "b", "c"] {
        let (f, redelivered) = c.summary(id);
        safety_eq!(redelivered, 0, "node {id} got redeliveries (records processed twice):{}", c.all_logs());
        forwarded += f;
    }
    safety_eq!(forwarded, n, "every record was processed exactly once across the nodes");
}

#[actix_rt::test]
async fn a_paused_node_loses_its_leases_and_publishes_nothing_stale_once_it_notices() {
    let c = RelayCluster::start(&["a", "b", "c"]).await;
    let owners = c.wait_balanced(&["a", "b", "c"], Duration::from_secs(40)).await;
    let feed = Feed::start(c.broker.clone(), 300);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let victim = "c";
    let lost: Vec<u32> = owners.iter().filter(|(_, o)| *o == victim).map(|(p, _)| *p).collect();
    c.nodes.get(victim).expect("victim").signal("STOP");
    // Past its lease TTL, the others take its partitions.
    let start = Instant::now();
    loop {
        let now = c.owners().await;
        if lost.iter().all(|p| now.get(p).is_some_and(|(o, _)| o != victim)) {
            break;
        }
        liveness!(
            start.elapsed() < TTL * 2 + Duration::from_secs(10),
            "partitions of a paused node never moved: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    c.nodes.get(victim).expect("victim").signal("CONT");
    // It notices (fence or refused renewal), stops those partitions and rejoins.
    let start = Instant::now();
    while !c.log_text(victim).contains("partition lost") {
        liveness!(start.elapsed() < Duration::from_secs(15), "the resumed node never noticed:{}", c.all_logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let n = feed.stop().await;
    c.wait_all_out(n, Duration::from_secs(90)).await;
    // Per partition, in stored order, the epoch never goes back — except outputs that
    // were in flight at the pause (at most one per partition: max_concurrency is 1).
    let mut newest: BTreeMap<u32, u64> = BTreeMap::new();
    let mut stale: BTreeMap<u32, u64> = BTreeMap::new();
    for (subject, h, _, _) in read_stream(&c.broker, OUT).await {
        let p: u32 = subject.rsplit('.').next().and_then(|p| p.parse().ok()).expect("partition subject");
        let epoch: u64 = h.get(headers::EPOCH).and_then(|e| e.parse().ok()).expect("epoch header");
        let top = newest.entry(p).or_default();
        if epoch < *top {
            *stale.entry(p).or_default() += 1;
        }
        *top = (*top).max(epoch);
    }
    safety!(
        stale.values().all(|n| *n <= 1) && stale.keys().all(|p| lost.contains(p)),
        "outputs went back to an older epoch after a newer one: {stale:?} (partitions of the paused node: {lost:?}){}",
        c.all_logs()
    );
}

#[actix_rt::test]
async fn drain_with_traffic_processes_exactly_what_precedes_each_marker() {
    let mut c = RelayCluster::start(&["a", "b", "c"]).await;
    c.wait_balanced(&["a", "b", "c"], Duration::from_secs(40)).await;
    let feed = Feed::start(c.broker.clone(), 400);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let drain = c.relay_cmd(&["drain", "--deadline", "60s"]);
    let text = String::from_utf8_lossy(&drain.stdout).to_string();
    assert!(drain.status.success(), "drain failed: {text}{}{}", String::from_utf8_lossy(&drain.stderr), c.all_logs());
    assert!(text.contains("8/8 partitions drained") && text.contains("done"), "{text}");
    // Traffic goes on after the markers; the drained run processes none of it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let n = feed.stop().await;
    for id in ["a", "b", "c"] {
        assert!(c.wait_exit(id, Duration::from_secs(30)).success(), "{id} exits 0 once the run is drained");
    }
    let out = out_ids(&c.broker).await;
    let input = read_stream(&c.broker, IN).await;
    let mut marker: BTreeMap<String, u64> = BTreeMap::new();
    for (subject, h, _, seq) in &input {
        if h.kind() == Some(MessageKind::Drain) {
            marker.entry(subject.clone()).or_insert(*seq);
        }
    }
    assert_eq!(marker.len(), PARTITIONS as usize, "one marker per partition");
    let (mut before, mut after) = (0, 0);
    for (subject, h, payload, seq) in &input {
        if h.kind() == Some(MessageKind::Drain) {
            continue;
        }
        let id = Codec::default().decode::<Record>(payload).expect("record").id;
        if *seq < marker[subject] {
            before += 1;
            safety!(out.contains(&id), "record {id} precedes its marker ({subject}) but is not in relay-out");
        } else {
            after += 1;
            safety!(!out.contains(&id), "record {id} follows its marker ({subject}) but was processed");
        }
    }
    assert!(
        before > 0 && after > 0,
        "traffic on both sides of the markers: {before} before, {after} after, {n} published"
    );
}

#[actix_rt::test]
async fn shutdown_makes_every_node_exit_zero_and_bad_control_input_changes_nothing() {
    let mut c = RelayCluster::start(&["a", "b", "c"]).await;
    c.wait_balanced(&["a", "b", "c"], Duration::from_secs(40)).await;

    // A second node with a live node's id is refused, saying so.
    let dup_log = c.dir.path().join("dup.log");
    let mut dup = ProcessGuard::spawn(
        "duplicate relay a",
        Command::new(&c.bin)
            .args(["--nats", &c.nats, "--node-id", "a", "--lease-ttl", "3s"])
            .env("FLOTILLA_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&dup_log).expect("log")),
    );
    let status = dup.wait_timeout(Duration::from_secs(20)).expect("LIVENESS: the duplicate node exits within 20 s");
    let text = std::fs::read_to_string(&dup_log).unwrap_or_default();
    assert!(!status.success() && text.contains("already alive"), "duplicate id not refused: {text}");

    // Bad control requests: a clear reply each, no state change.
    let ask = |verb: &'static str, body: &'static str| {
        let broker = c.broker.clone();
        async move {
            let m = broker
                .request(CoreMessage::new(format!("flotilla.relay._ctl.node.b.{verb}"), body), Duration::from_secs(5))
                .await
                .expect("b answers");
            serde_json::from_slice::<ControlReply>(&m.payload).expect("a JSON reply")
        }
    };
    let r = c
        .broker
        .request(CoreMessage::new("flotilla.relay._ctl.all.stop", r#"{"request_id":"r0"}"#), Duration::from_secs(5))
        .await
        .expect("an answer");
    let r: ControlReply = serde_json::from_slice(&r.payload).expect("JSON");
    assert!(!r.ok && r.message.contains("stop is for one node"), "{r:?}");
    let r = ask("explode", r#"{"request_id":"r1"}"#).await;
    assert!(!r.ok && r.message.contains("unknown verb"), "{r:?}");
    let r = ask("pause", "{not json").await;
    assert!(!r.ok && r.message.contains("malformed"), "{r:?}");
    let r = ask("drain", r#"{"request_id":"r2","run_id":"not-the-run"}"#).await;
    assert!(!r.ok && r.message.contains("stale run id"), "{r:?}");
    let r = ask("step", r#"{"request_id":"r3","stream":"relay-in","partition":0}"#).await;
    let again = ask("step", r#"{"request_id":"r3","stream":"relay-in","partition":0}"#).await;
    safety!(again.duplicate && !again.acted, "a repeated request id is not acted on twice: {r:?} then {again:?}");
    // A reply subject is the requester's choice: a node answers only on an inbox, so a
    // request cannot make it publish to the JetStream API (here: purge relay-out, an
    // API that takes a JSON body and ignores fields it does not know).
    for ack in c.broker.publish_batch((0..3).map(record).collect()).await {
        ack.expect("publish");
    }
    c.wait_all_out(3, Duration::from_secs(30)).await;
    let mut sneaky = CoreMessage::new("flotilla.relay._ctl.node.b.status", r#"{"request_id":"r4"}"#);
    sneaky.reply = Some(format!("$JS.API.STREAM.PURGE.{OUT}"));
    c.broker.core_publish(sneaky).await.expect("publish");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let kept = c.broker.stream_state(OUT).await.map(|s| s.messages).unwrap_or(0);
    safety_eq!(kept, 3, "a control reply purged relay-out");
    let bad = c.relay_cmd(&["pause", "--stream", "nope"]);
    assert_eq!(bad.status.code(), Some(2), "an unknown stream is refused");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("no input stream \"nope\""));
    let bad = c.relay_cmd(&["stop", "--node", "zz"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a live member"));
    for (id, node) in c.nodes.iter_mut() {
        assert!(node.wait_timeout(Duration::from_millis(10)).is_none(), "node {id} exited on bad control input");
    }
    c.wait_balanced(&["a", "b", "c"], Duration::from_secs(10)).await;

    let shutdown = c.relay_cmd(&["shutdown", "--timeout", "30s"]);
    let text = String::from_utf8_lossy(&shutdown.stdout).to_string();
    assert!(shutdown.status.success(), "shutdown failed: {text}{}", String::from_utf8_lossy(&shutdown.stderr));
    assert!(text.contains("all 3 node(s) have left"), "{text}");
    for id in ["a", "b", "c"] {
        assert!(c.wait_exit(id, Duration::from_secs(30)).success(), "{id} exits 0");
    }
}

#[actix_rt::test]
async fn pause_step_and_resume_a_partition() {
    let c = RelayCluster::start(&["a", "b"]).await;
    c.wait_balanced(&["a", "b"], Duration::from_secs(40)).await;
    let paused = c.relay_cmd(&["pause", "--stream", "relay-in", "--partition", "3"]);
    assert!(paused.status.success(), "pause failed: {}", String::from_utf8_lossy(&paused.stderr));
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Records for partition 3 and for another partition.
    let ids3: Vec<u64> = (0..200).filter(|i| partition_for(&i.to_string(), PARTITIONS) == 3).take(3).collect();
    let other: Vec<u64> = (0..200).filter(|i| partition_for(&i.to_string(), PARTITIONS) == 4).take(3).collect();
    for id in ids3.iter().chain(&other) {
        c.broker.publish(record(*id)).await.expect("publish");
    }
    let count_in = |ids: Vec<u64>| {
        let b = c.broker.clone();
        async move {
            let out = out_ids(&b).await;
            ids.iter().filter(|i| out.contains(i)).count()
        }
    };
    let start = Instant::now();
    while count_in(other.clone()).await < 3 {
        liveness!(start.elapsed() < Duration::from_secs(20), "the unpaused partition is stuck{}", c.all_logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(count_in(ids3.clone()).await, 0, "the paused partition processed nothing");
    let step = c.relay_cmd(&["step", "--stream", "relay-in", "--partition", "3"]);
    assert!(step.status.success(), "step failed: {}", String::from_utf8_lossy(&step.stderr));
    let start = Instant::now();
    while count_in(ids3.clone()).await < 1 {
        liveness!(start.elapsed() < Duration::from_secs(20), "step processed nothing{}", c.all_logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    safety_eq!(count_in(ids3.clone()).await, 1, "a step processes exactly one message");
    // The same step request sent twice (a retry) steps once; the retry gets the first
    // answer again, marked as a duplicate.
    let holder = c.owners().await.get(&3).map(|(n, _)| n.clone()).expect("partition 3 is held");
    let step_twice = || {
        let (broker, subject) = (c.broker.clone(), format!("flotilla.relay._ctl.node.{holder}.step"));
        async move {
            let body = r#"{"request_id":"step-twice","stream":"relay-in","partition":3}"#;
            let m =
                broker.request(CoreMessage::new(subject, body), Duration::from_secs(5)).await.expect("holder answers");
            serde_json::from_slice::<ControlReply>(&m.payload).expect("a JSON reply")
        }
    };
    let first = step_twice().await;
    assert!(first.ok && first.acted && !first.duplicate, "{first:?}");
    let again = step_twice().await;
    safety!(again.duplicate && again.acted, "a retried step reports what the first did: {again:?}");
    let start = Instant::now();
    while count_in(ids3.clone()).await < 2 {
        liveness!(start.elapsed() < Duration::from_secs(20), "the second step processed nothing{}", c.all_logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    safety_eq!(count_in(ids3.clone()).await, 2, "a step request retried with its id steps once");
    let resumed = c.relay_cmd(&["resume", "--stream", "relay-in", "--partition", "3"]);
    assert!(resumed.status.success());
    let start = Instant::now();
    while count_in(ids3.clone()).await < 3 {
        liveness!(start.elapsed() < Duration::from_secs(20), "resume did not restart intake{}", c.all_logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A drain that cannot finish (a paused partition never reaches its marker) ends at
    // its deadline, names what is stuck and exits 1.
    let paused = c.relay_cmd(&["pause", "--stream", "relay-in", "--partition", "3"]);
    assert!(paused.status.success(), "pause failed: {}", String::from_utf8_lossy(&paused.stderr));
    // Pause stops intake; a claim already out when it lands may still deliver.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let drain = c.relay_cmd(&["drain", "--deadline", "4s"]);
    let text = format!("{}{}", String::from_utf8_lossy(&drain.stdout), String::from_utf8_lossy(&drain.stderr));
    assert_eq!(drain.status.code(), Some(1), "a drain past its deadline exits 1: {text}");
    assert!(text.contains("deadline") && text.contains("relay-in/3 (held by"), "the stuck partition is named: {text}");
}

#[actix_rt::test]
async fn nodes_ride_out_a_nats_server_restart_under_load_and_lose_nothing() {
    let mut c = RelayCluster::start(&["a", "b", "c"]).await;
    c.wait_balanced(&["a", "b", "c"], Duration::from_secs(40)).await;
    let out = c.relay_cmd(&["publish", "--count", "6000", "--start", "0"]);
    assert!(out.status.success(), "publish: {}", String::from_utf8_lossy(&out.stderr));
    tokio::time::sleep(Duration::from_secs(2)).await;
    c.server().kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    c.server().restart();
    c.wait_all_out(6000, Duration::from_secs(120)).await;
    for id in ["a", "b", "c"] {
        let guard = c.nodes.get_mut(id).expect("node");
        assert!(guard.wait_timeout(Duration::from_millis(10)).is_none(), "node {id} died with the server");
    }
    c.wait_balanced(&["a", "b", "c"], Duration::from_secs(40)).await;
}
