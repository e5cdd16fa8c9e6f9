//! The examples run as a newcomer runs them: on the embedded broker, each printing its
//! summary, and `relay`'s flags refuse bad input with a message that says what to fix.

use flotilla_tests::example_bin;
use std::process::Command;

fn run(name: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(example_bin(name)).args(args).env("FLOTILLA_LOG", "error").output().expect("run example");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn relay_runs_on_the_embedded_broker() {
    let (ok, out, err) = run("relay", &[]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("published 1000 records, 998 in relay-out, 2 in the DLQ"), "{out}");
    assert!(out.contains("forwarded 998 records"), "{out}");
}

#[test]
fn relay_queue_mode_runs_on_the_embedded_broker() {
    let (ok, out, err) = run("relay", &["--queue"]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("998 in relay-done, 2 in the DLQ"), "{out}");
}

#[test]
fn relay_refuses_bad_flags_saying_what_to_fix() {
    let (ok, _, err) = run("relay", &["--ack-wait", "soon"]);
    assert!(!ok);
    assert!(err.contains("--ack-wait") && err.contains("30s"), "{err}");
    let (ok, _, err) = run("relay", &["--partitions", "0"]);
    assert!(!ok);
    assert!(err.contains("--partitions"), "{err}");
    let (ok, _, err) = run("relay", &["publish", "--count", "3", "--log", "warn"]);
    assert!(!ok);
    assert!(err.contains("publish needs --nats"), "{err}");
    let (ok, _, err) = run("relay", &["--nats", "nats://127.0.0.1:1"]);
    assert!(!ok);
    assert!(err.contains("apt-get install nats-server") && err.contains("127.0.0.1:1"), "{err}");
}

#[test]
fn wordcount_counts_every_word() {
    let (ok, out, err) = run("wordcount", &["--repeat", "20"]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("sum of latest counts 1320 (expected 1320)"), "{out}");
    assert!(out.contains("the          120"), "{out}");
}

#[test]
fn tally_counts_votes_in_stores_and_refuses_bad_flags() {
    for concurrency in ["1", "4"] {
        let (ok, out, err) = run("tally", &["--demo", "2000", "--window", "200ms", "--concurrency", concurrency]);
        assert!(ok, "{out}\n{err}");
        assert!(
            out.contains("published 2000 votes (3 poison, 3 flaky) over 7 choices; last totals match the votes"),
            "{out}"
        );
        // 3 poison votes fail 3 attempts each, 3 flaky ones their first.
        assert!(out.contains("counted 1997 votes; 12 failed attempts"), "--concurrency {concurrency}: {out}");
    }
    let (ok, _, err) = run("tally", &["--window", "often"]);
    assert!(!ok);
    assert!(err.contains("write a duration like 30s"), "{err}");
    let (ok, _, err) = run("tally", &["publish", "--count", "5"]);
    assert!(!ok);
    assert!(err.contains("publish needs --nats"), "{err}");
}

#[test]
fn jobs_retries_heartbeats_and_dead_letters() {
    let (ok, out, err) = run("jobs", &["--quick", "5"]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("8 submitted, 7 done, 1 dead-lettered"), "{out}");
    assert!(out.contains("job 1 done on attempt 3"), "{out}");
    assert!(out.contains("job 2 done on attempt 1 (ran 1 times"), "{out}");
    assert!(out.contains("job 3 dead-lettered after 3 runs: max-attempts"), "{out}");
}

/// The README's cluster walk-through, as `scripts/cluster-demo` runs it: three relay
/// nodes, publish, status, a rolling restart, drain, a new run, shutdown. The script
/// runs in its own process group, killed whole if it overruns or the test fails.
#[test]
fn the_cluster_demo_script_runs_end_to_end() {
    use std::os::unix::process::CommandExt;
    use std::time::{Duration, Instant};
    struct Group(u32);
    impl Drop for Group {
        fn drop(&mut self) {
            flotilla_tests::send_signal("KILL", flotilla_tests::SignalTarget::Group(self.0));
        }
    }
    example_bin("relay");
    let server = flotilla_tests::NatsServer::start();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace").to_path_buf();
    let dir = tempfile::tempdir().expect("tmp");
    let log = dir.path().join("demo.log");
    let mut child = Command::new("bash")
        .arg(root.join("scripts/cluster-demo"))
        .arg(server.url())
        .env("COUNT", "3000")
        .env_remove("FLOTILLA_NATS")
        .stdout(std::fs::File::create(&log).expect("log"))
        .stderr(std::fs::File::create(dir.path().join("demo.err")).expect("log"))
        .process_group(0)
        .spawn()
        .expect("start the demo");
    let _group = Group(child.id());
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(150),
            "the demo overran 150 s:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = std::fs::read_to_string(&log).unwrap_or_default();
    let err = std::fs::read_to_string(dir.path().join("demo.err")).unwrap_or_default();
    assert!(status.success(), "the demo failed:\n{out}\n{err}");
    for expected in ["all 1 node(s) have left", "drain: done", "all 3 node(s) have left", "node c exited 0", "== done"]
    {
        assert!(out.contains(expected), "no {expected:?} in the demo's output:\n{out}");
    }
    // Every record but the 3 poison ones was forwarded exactly once, never redelivered.
    let forwarded: u64 = out
        .lines()
        .filter(|l| l.starts_with("relay node"))
        .filter_map(|l| l.split("forwarded ").nth(1)?.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    assert_eq!(forwarded, 2997, "{out}");
    assert!(out.lines().filter(|l| l.starts_with("relay node")).all(|l| l.ends_with("0 redelivered records")), "{out}");
}
