//! The fault matrix, network rows (docs/reliability.md): replicated streams on a
//! 3-server NATS cluster losing their leader, a node cut off from NATS by a silent
//! blackhole, one NATS server partitioned from its peers, the server killed three
//! times under six nodes, and control requests lost on the way.
//!
//! Each test asserts the matrix's invariants: every record the stream acknowledged is
//! relayed (0 loss), per partition the stored outputs' epochs never go back but for
//! what was in flight when the fault struck (no stale-epoch output after the move),
//! and no node dies of the fault. Every process is killed by PID when a test ends, also
//! on failure.
//!
//! CI retries a failed test here once: the loss, duplicate and epoch invariants are
//! `safety!` assertions, which fail CI even when the retry passes; waits that run out
//! are `LIVENESS:` failures, which a retry may pass (`flotilla_tests::safety`).

use flotilla_tests::fault_proxy::FaultProxy;
use flotilla_tests::relay_cluster::{
    Feed, IN, Launch, OUT, PARTITIONS, RelayCluster, TTL, epoch_regressions, out_id_counts,
};
use flotilla_tests::{NatsCluster, NatsServer, liveness, safety};
use flotilla_transport::broker::{CoreMessage, SharedBroker};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The stream's JetStream info (`$JS.API.STREAM.INFO`), as JSON; `Null` when the
/// request fails (as it may while a leader is elected).
async fn stream_info(b: &SharedBroker, stream: &str) -> serde_json::Value {
    match b.request(CoreMessage::new(format!("$JS.API.STREAM.INFO.{stream}"), ""), Duration::from_secs(2)).await {
        Ok(reply) => serde_json::from_slice(&reply.payload).unwrap_or_default(),
        Err(_) => serde_json::Value::Null,
    }
}

/// Waits until `stream` has a cluster leader; its server name (`s0`, `s1`, `s2`).
async fn leader(b: &SharedBroker, stream: &str, within: Duration) -> String {
    let start = Instant::now();
    loop {
        let info = stream_info(b, stream).await;
        if let Some(l) = info.pointer("/cluster/leader").and_then(serde_json::Value::as_str) {
            return l.to_owned();
        }
        liveness!(start.elapsed() < within, "{stream} has no leader after {within:?}: {info}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every record relayed, none twice; the epochs of each partition's outputs go back at
/// most `in_flight` times, and only on `moved` partitions.
async fn assert_invariants(c: &RelayCluster, n: u64, moved: &[u32], in_flight: u64) {
    c.wait_all_out(n, Duration::from_secs(120)).await;
    let twice: Vec<u64> =
        out_id_counts(&c.broker).await.into_iter().filter(|(_, k)| *k > 1).map(|(id, _)| id).collect();
    safety!(twice.is_empty(), "records stored twice in relay-out (first 20): {:?}", &twice[..twice.len().min(20)]);
    let back = epoch_regressions(&c.broker).await;
    safety!(
        back.iter().all(|(p, k)| moved.contains(p) && *k <= in_flight),
        "outputs went back to an older epoch after a newer one: {back:?} (moved partitions: {moved:?}){}",
        c.all_logs()
    );
}

/// `status --json`'s line for relay-in's partition `p`, and the whole status.
fn partition_status(c: &RelayCluster, p: u32) -> (serde_json::Value, serde_json::Value) {
    let status = c.relay_cmd(&["status", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap_or_default();
    let part = json["partitions"]
        .as_array()
        .and_then(|ps| ps.iter().find(|x| x["stream"] == "relay-in" && x["partition"] == p))
        .cloned()
        .unwrap_or_default();
    (part, json)
}

fn held_by(owners: &BTreeMap<u32, String>, node: &str) -> Vec<u32> {
    owners.iter().filter(|(_, o)| *o == node).map(|(p, _)| *p).collect()
}

/// Replicated streams (R3) on three servers; the stream leader of relay-in is killed
/// under load. A new leader is elected, publishers are held up for less than 10 s, the
/// nodes ride it out and nothing is lost. The killed server is not restarted: two of
/// three keep the quorum.
#[actix_rt::test]
async fn a_stream_leader_killed_under_load_on_three_replicated_servers_loses_nothing_and_resumes_within_ten_seconds() {
    let mut cluster = NatsCluster::start();
    let c = RelayCluster::on_with(&cluster.urls(), &["--replicas", "3"], &["a", "b", "c"]).await;
    c.wait_balanced(&["a", "b", "c"], Duration::from_secs(60)).await;
    for stream in [IN, OUT, "FLOTILLA_relay_DLQ", "KV_FLOTILLA_relay_LEASES", "KV_FLOTILLA_relay_CONTROL"] {
        let replicas = stream_info(&c.broker, stream).await.pointer("/config/num_replicas").cloned();
        assert_eq!(replicas, Some(serde_json::json!(3)), "{stream} is not replicated three times");
    }
    let feed = Feed::start(c.broker.clone(), 400);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = feed.longest_gap();
    let name = leader(&c.broker, IN, Duration::from_secs(10)).await;
    let victim: usize = name.trim_start_matches('s').parse().expect("servers are named s0..s2");
    cluster.servers[victim].kill();
    let killed = Instant::now();
    leader(&c.broker, IN, Duration::from_secs(30)).await;
    eprintln!("new leader of {IN} after {:?}", killed.elapsed());
    tokio::time::sleep(Duration::from_secs(12)).await;
    let gap = feed.longest_gap();
    let n = feed.stop().await;
    eprintln!("killed stream leader {name}; longest publish gap {gap:?} (before the kill {before:?})");
    liveness!(gap < Duration::from_secs(10), "publishing stalled {gap:?} after the leader was killed");
    assert_invariants(&c, n, &(0..PARTITIONS).collect::<Vec<_>>(), 1).await;
    let mut c = c;
    for id in ["a", "b", "c"] {
        assert!(c.is_running(id), "node {id} died with the stream leader{}", c.all_logs());
    }
}

/// Node b's connection to NATS goes silent (a blackhole: packets dropped, nothing
/// closed) for four lease TTLs. Its partitions move to the others; when the network
/// heals, what b had in flight may land once, and nothing after; nothing is lost.
#[actix_rt::test]
async fn a_node_blackholed_from_nats_loses_its_partitions_and_stores_nothing_stale() {
    let mut c = RelayCluster::start(&["a", "c"]).await;
    let server_addr = ([127, 0, 0, 1], c.server().port()).into();
    let proxy = FaultProxy::start(server_addr);
    c.add_with("b", Launch { nats: Some(proxy.url()), ..Launch::default() });
    let owners = c.wait_balanced(&["a", "b", "c"], Duration::from_secs(40)).await;
    let lost = held_by(&owners, "b");
    let feed = Feed::start(c.broker.clone(), 300);
    tokio::time::sleep(Duration::from_secs(3)).await;
    proxy.blackhole();
    let moved_after = c.wait_moved_from("b", &lost, TTL * 3 + Duration::from_secs(10)).await;
    eprintln!("blackhole: b's partitions {lost:?} moved after {moved_after:?}");
    tokio::time::sleep(TTL * 4 - moved_after.min(TTL * 4)).await;
    proxy.heal();
    // b notices (fence or refused renewal) and rejoins; the cluster rebalances.
    c.wait_log("b", "partition lost", Duration::from_secs(30)).await;
    c.wait_balanced(&["a", "b", "c"], Duration::from_secs(60)).await;
    let n = feed.stop().await;
    assert_invariants(&c, n, &lost, 2).await;
    assert!(c.is_running("b"), "the blackholed node died{}", c.all_logs());
}

/// One NATS server of three is cut off from its peers (its routes blackholed; its
/// clients still reach it) for five lease TTLs, then joins again. Node c talks only to
/// that server: it cannot renew its leases, its partitions move to a and b on the
/// majority side, and after the heal c rejoins. Nothing is lost; nothing stale is
/// stored after the move. Runs on the current server only (see scripts/test).
#[actix_rt::test]
async fn a_nats_server_partitioned_from_its_peers_and_healed_loses_nothing() {
    let mut cluster = NatsCluster::start_with_route_proxies();
    let urls: Vec<String> = cluster.servers.iter().map(NatsServer::url).collect();
    let majority = format!("{},{}", urls[0], urls[1]);
    let mut c = RelayCluster::on_with(&majority, &["--replicas", "3"], &[]).await;
    for (id, url) in [("a", &urls[0]), ("b", &urls[1]), ("c", &urls[2])] {
        c.add_with(
            id,
            Launch { nats: Some(url.clone()), args: vec!["--replicas".into(), "3".into()], ..Launch::default() },
        );
    }
    let owners = c.wait_balanced(&["a", "b", "c"], Duration::from_secs(60)).await;
    let lost = held_by(&owners, "c");
    let feed = Feed::start(c.broker.clone(), 300);
    tokio::time::sleep(Duration::from_secs(3)).await;
    cluster.isolate(2);
    let moved_after = c.wait_moved_from("c", &lost, Duration::from_secs(45)).await;
    eprintln!("s2 isolated: c's partitions {lost:?} moved after {moved_after:?}");
    tokio::time::sleep(TTL * 5 - moved_after.min(TTL * 5)).await;
    cluster.heal();
    let healed = Instant::now();
    // Liveness: the healed server catches up on 2.15.1 in more than a start's 20 s
    // when the machine is busy (seen once locally); what follows waits 120 s anyway.
    cluster.servers[2].wait_healthy_within(Duration::from_secs(60));
    c.wait_balanced(&["a", "b", "c"], Duration::from_secs(120)).await;
    eprintln!("s2 healed: rebalanced {:?} after the heal", healed.elapsed());
    let gap = feed.longest_gap();
    let n = feed.stop().await;
    eprintln!("longest publish gap on the majority side: {gap:?}");
    assert_invariants(&c, n, &lost, 2).await;
    for id in ["a", "b", "c"] {
        assert!(c.is_running(id), "node {id} died of the partition{}", c.all_logs());
    }
}

/// Six nodes under load; the nats-server is killed with SIGKILL and restarted three
/// times. Every node rides it out and nothing is lost.
#[actix_rt::test]
async fn the_nats_server_killed_three_times_under_six_nodes_loses_nothing() {
    let ids = ["a", "b", "c", "d", "e", "f"];
    let mut c = RelayCluster::start(&ids).await;
    c.wait_balanced(&ids, Duration::from_secs(60)).await;
    let mut published = 0;
    for round in 0..3u64 {
        let from = round * 2000;
        let out = c.relay_cmd(&["publish", "--count", "2000", "--start", &from.to_string()]);
        assert!(out.status.success(), "publish: {}", String::from_utf8_lossy(&out.stderr));
        published += 2000;
        tokio::time::sleep(Duration::from_millis(700)).await;
        c.server().kill();
        tokio::time::sleep(Duration::from_secs(2)).await;
        c.server().restart();
        eprintln!("server killed and restarted ({} of 3)", round + 1);
    }
    c.wait_all_out(published, Duration::from_secs(150)).await;
    for id in ids {
        assert!(c.is_running(id), "node {id} died with the server{}", c.all_logs());
    }
    c.wait_balanced(&ids, Duration::from_secs(60)).await;
}

/// Control requests lost on the way: while node b's connection is blackholed, the
/// operator pauses a partition b holds and asks for status. Status answers without b
/// (reported silent, not an error); the pause is desired state in the CONTROL bucket,
/// so b applies it when it can read again, and a resume lets it flow. Repeated
/// requests with one id are acted on once (`shutdown_makes_every_node_exit_zero_and_bad_control_input_changes_nothing`
/// in tests/tests/cluster.rs).
#[actix_rt::test]
async fn a_pause_whose_request_is_lost_still_takes_effect_and_status_reports_the_silent_node() {
    let mut c = RelayCluster::start(&["a"]).await;
    let proxy = FaultProxy::start(([127, 0, 0, 1], c.server().port()).into());
    c.add_with("b", Launch { nats: Some(proxy.url()), ..Launch::default() });
    let owners = c.wait_balanced(&["a", "b"], Duration::from_secs(40)).await;
    let target = held_by(&owners, "b")[0];
    let feed = Feed::start(c.broker.clone(), 200);
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Shorter than a lease TTL: b keeps its partitions, but hears nothing meanwhile.
    proxy.blackhole();
    let pause = c.relay_cmd(&["pause", "--stream", "relay-in", "--partition", &target.to_string()]);
    let status = c.relay_cmd(&["status", "--json"]);
    proxy.heal();
    assert!(pause.status.success(), "pause: {}", String::from_utf8_lossy(&pause.stderr));
    assert!(status.status.success(), "status with a silent node: {}", String::from_utf8_lossy(&status.stderr));
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status --json is JSON");
    assert_eq!(json["partitions"].as_array().map(Vec::len), Some(PARTITIONS as usize), "{json}");
    // b applies the pause from the desired state: its partition stops moving.
    let start = Instant::now();
    let paused_at = loop {
        let (part, json) = partition_status(&c, target);
        if part["paused"] == true {
            break part["deliveries"].as_u64().unwrap_or(0);
        }
        liveness!(start.elapsed() < Duration::from_secs(20), "b never applied the lost pause: {json}{}", c.all_logs());
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (part, _) = partition_status(&c, target);
    assert_eq!(part["deliveries"].as_u64(), Some(paused_at), "a paused partition took messages: {part}");
    let resume = c.relay_cmd(&["resume", "--stream", "relay-in", "--partition", &target.to_string()]);
    assert!(resume.status.success(), "resume: {}", String::from_utf8_lossy(&resume.stderr));
    let n = feed.stop().await;
    assert_invariants(&c, n, &[], 0).await;
}
