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
fn jobs_retries_heartbeats_and_dead_letters() {
    let (ok, out, err) = run("jobs", &["--quick", "5"]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("8 submitted, 7 done, 1 dead-lettered"), "{out}");
    assert!(out.contains("job 1 done on attempt 3"), "{out}");
    assert!(out.contains("job 2 done on attempt 1 (ran 1 times"), "{out}");
    assert!(out.contains("job 3 dead-lettered after 3 runs: max-attempts"), "{out}");
}
