//! Durable task state under faults, with real `tally` node processes on a real
//! nats-server (docs/state.md): the last total of every choice must equal the votes
//! published for it, exactly, after kill -9 of a holder mid-window, a graceful stop, a
//! join, a same-id restart, and a crash injected at each step of a flush.
//!
//! CI retries a failed test here once: wrong totals and wrong dead letters are
//! `safety!` failures, which fail CI even when the retry passes; waits that run out
//! while votes are still unacknowledged are `LIVENESS:` failures, which a retry may
//! pass (`flotilla_tests::safety`).

use flotilla_tests::relay_cluster::{Launch, RelayCluster, read_stream};
use flotilla_tests::{NatsServer, liveness, safety, safety_eq};
use flotilla_transport::wire::Codec;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const OUT: &str = "FLOTILLA_tally_tally-out";
const DLQ: &str = "FLOTILLA_tally_DLQ";
const CHOICES: u64 = 7;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Total {
    choice: String,
    count: u64,
}

/// The votes per choice `tally publish --count N --choices 7 --poison P --start S`
/// publishes (the same rule as examples/tally.rs).
fn expected(chunks: &[(u64, u64, u64)], into: &mut BTreeMap<String, u64>) {
    for &(start, count, poison) in chunks {
        expected_with_flaky(start, count, poison, 0, into);
    }
}

/// The same with `--flaky F`: F votes `flaky-<voter mod 7>`, each counted once.
fn expected_with_flaky(start: u64, count: u64, poison: u64, flaky: u64, into: &mut BTreeMap<String, u64>) {
    let every = count.checked_div(poison).map_or(u64::MAX, |n| n.max(1));
    let every_flaky = count.checked_div(flaky).map_or(u64::MAX, |n| n.max(1));
    let (mut poisoned, mut flaked) = (0, 0);
    for i in 0..count {
        if poison > poisoned && i % every == every / 2 {
            poisoned += 1;
            continue;
        }
        let choice = if flaky > flaked && i % every_flaky == every_flaky / 3 {
            flaked += 1;
            format!("flaky-{}", (start + i) % CHOICES)
        } else {
            format!("choice-{}", (start + i) % CHOICES)
        };
        *into.entry(choice).or_default() += 1;
    }
}

fn publish(c: &RelayCluster, start: u64, count: u64, poison: u64) {
    publish_flaky(c, start, count, poison, 0);
}

fn publish_flaky(c: &RelayCluster, start: u64, count: u64, poison: u64, flaky: u64) {
    let (s, n, p, f) = (start.to_string(), count.to_string(), poison.to_string(), flaky.to_string());
    let out = c.relay_cmd(&["publish", "--count", &n, "--choices", "7", "--poison", &p, "--flaky", &f, "--start", &s]);
    assert!(out.status.success(), "publish failed: {}", String::from_utf8_lossy(&out.stderr));
}

/// The last total of each choice in tally-out.
async fn last_totals(c: &RelayCluster) -> BTreeMap<String, u64> {
    let mut last = BTreeMap::new();
    for (_, _, payload, _) in read_stream(&c.broker, OUT).await {
        let t: Total = Codec::default().decode(&payload).expect("a Total");
        last.insert(t.choice, t.count);
    }
    last
}

/// Waits until the last totals equal `want`; fails showing both (and the logs) after
/// `within`: a safety failure when a total is over its votes (counted twice) or every
/// vote is acknowledged (a total is wrong for good), else a liveness failure.
async fn wait_totals(c: &RelayCluster, want: &BTreeMap<String, u64>, within: Duration) {
    let start = Instant::now();
    loop {
        let got = last_totals(c).await;
        if &got == want {
            return;
        }
        if start.elapsed() >= within {
            let over: Vec<(&String, &u64)> = got.iter().filter(|(k, n)| want.get(*k).is_none_or(|w| *n > w)).collect();
            let open = c.input_open(false).await;
            safety!(
                over.is_empty() && !open.is_empty(),
                "last totals {got:?} do not match the votes {want:?} after {within:?}: counted twice {over:?}, \
                 votes not acknowledged {open:?}{}",
                c.all_logs()
            );
            panic!(
                "LIVENESS: last totals {got:?} never matched the votes {want:?} within {within:?}; votes not \
                 acknowledged yet: {open:?}{}",
                c.all_logs()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn tally_cluster(ids: &[&str]) -> (NatsServer, RelayCluster) {
    let server = NatsServer::start();
    let c = RelayCluster::example_on(("tally", "tally-in"), &server.url(), &["--window", "300ms"], ids).await;
    (server, c)
}

/// Three nodes count votes while one holder is killed mid-window and restarted with
/// its id, another leaves gracefully and a fourth joins: every total ends exact.
#[actix_rt::test]
async fn tally_totals_are_exact_after_a_kill_a_restart_a_stop_and_a_join() {
    let (_server, mut c) = tally_cluster(&["a", "b", "c"]).await;
    c.wait_balanced(&["a", "b", "c"], Duration::from_secs(60)).await;
    let mut want = BTreeMap::new();
    let chunks = [(0, 10_000, 3), (10_000, 10_000, 0), (20_000, 10_000, 0)];
    expected(&chunks, &mut want);

    publish(&c, chunks[0].0, chunks[0].1, chunks[0].2);
    // Mid-window, mid-stream: a's partitions hold counted, uncommitted votes.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let held: Vec<u32> = c.owners().await.into_iter().filter(|(_, (n, _))| n == "a").map(|(p, _)| p).collect();
    c.signal("a", "KILL");
    publish(&c, chunks[1].0, chunks[1].1, chunks[1].2);
    // A same-id restart takes its partitions back at once, restoring their stores.
    c.add("a");
    c.wait_log("a", "state_restored", Duration::from_secs(30)).await;
    // b leaves gracefully (its stores are committed and handed over), d joins.
    c.signal("b", "TERM");
    let status = c.wait_exit_async("b", Duration::from_secs(60)).await;
    liveness!(status.success(), "b's graceful stop failed: {status:?}{}", c.all_logs());
    c.add("d");
    publish(&c, chunks[2].0, chunks[2].1, chunks[2].2);
    c.wait_balanced(&["a", "c", "d"], Duration::from_secs(60)).await;
    wait_totals(&c, &want, Duration::from_secs(120)).await;
    let dead = read_stream(&c.broker, DLQ).await.len();
    safety_eq!(dead, 3, "the 3 poison votes, and nothing else, are dead letters{}", c.all_logs());
    assert!(!held.is_empty(), "a held partitions when it was killed");
}

/// `tally --concurrency 4`: votes run four at a time through `defer`, flaky ones fail
/// their first attempt after their writes, poison ones every attempt. Through a kill -9
/// with a same-id restart and a graceful stop, every total ends exact (safety: no vote
/// lost or counted twice, a flaky vote counted once) and only the poison votes are dead
/// letters (safety); the waits are liveness.
#[actix_rt::test]
async fn tally_with_concurrency_counts_flaky_votes_once_through_a_kill_and_a_stop() {
    let server = NatsServer::start();
    let mut c = RelayCluster::example_on(
        ("tally", "tally-in"),
        &server.url(),
        &["--window", "300ms", "--concurrency", "4"],
        &["a", "b", "c"],
    )
    .await;
    c.wait_balanced(&["a", "b", "c"], Duration::from_secs(60)).await;
    let mut want = BTreeMap::new();
    expected_with_flaky(0, 6_000, 3, 40, &mut want);
    expected_with_flaky(6_000, 6_000, 0, 40, &mut want);
    publish_flaky(&c, 0, 6_000, 3, 40);
    tokio::time::sleep(Duration::from_millis(500)).await;
    c.signal("a", "KILL");
    publish_flaky(&c, 6_000, 6_000, 0, 40);
    c.add("a");
    c.signal("b", "TERM");
    let status = c.wait_exit_async("b", Duration::from_secs(60)).await;
    liveness!(status.success(), "b's graceful stop failed: {status:?}{}", c.all_logs());
    wait_totals(&c, &want, Duration::from_secs(180)).await;
    let dead = read_stream(&c.broker, DLQ).await.len();
    safety_eq!(dead, 3, "the 3 poison votes, and nothing else, are dead letters{}", c.all_logs());
}

// A node is crashed (abort, as kill -9) at each step of a flush, then restarted with
// its id: the restored state reflects exactly the acknowledged inputs, so no vote is
// lost or counted twice.

#[actix_rt::test]
async fn a_flush_interrupted_after_its_records_restores_to_exactly_the_acked_inputs() {
    crash_at_and_restart("state-records-stored").await;
}

#[actix_rt::test]
async fn a_flush_interrupted_after_its_commit_record_restores_to_exactly_the_acked_inputs() {
    crash_at_and_restart("state-committed-before-ack").await;
}

#[actix_rt::test]
async fn a_crash_after_outputs_are_stored_restores_to_exactly_the_acked_inputs() {
    crash_at_and_restart("effects-stored-before-ack").await;
}

async fn crash_at_and_restart(point: &str) {
    {
        let (_server, mut c) = tally_cluster(&[]).await;
        c.add_with("a", Launch { env: vec![("FLOTILLA_FAILPOINT".into(), format!("{point}:5"))], ..Launch::default() });
        c.wait_balanced(&["a"], Duration::from_secs(60)).await;
        let mut want = BTreeMap::new();
        expected(&[(0, 8_000, 0)], &mut want);
        publish(&c, 0, 8_000, 0);
        let status = c.wait_exit_async("a", Duration::from_secs(60)).await;
        assert!(!status.success(), "{point}: the failpoint did not end the node{}", c.all_logs());
        let crashed = c.log_text("a");
        c.add("a");
        wait_totals(&c, &want, Duration::from_secs(120)).await;
        let restored = c.log_text("a");
        assert!(restored.contains("state_restored"), "{point}: no restore logged{}", c.all_logs());
        if point == "state-records-stored" {
            // The interrupted flush's records were there and were not taken.
            assert!(
                restored.lines().any(|l| l.contains(r#""type":"state_restored""#) && !l.contains(r#""incomplete":0"#)),
                "{point}: no restore found an incomplete flush:\n{}\n--- before the crash ---\n{}",
                flotilla_tests::relay_cluster::tail(&restored, 30),
                flotilla_tests::relay_cluster::tail(&crashed, 10)
            );
        }
    }
}
