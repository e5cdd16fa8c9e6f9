//! The test harness itself: servers die with their test, a cluster forms, a restart
//! keeps the store, and a missing binary is a loud error.

use bytes::Bytes;
use flotilla_tests::{NatsCluster, NatsServer, SignalTarget, find_nats_server, kill_args, send_signal};
use flotilla_transport::broker::{ConnectionEvent, ConsumerSpec, OutboundMessage, Retention, StreamSpec};
use flotilla_transport::{JetStreamBroker, JetStreamOptions};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn alive(pid: u32) -> bool {
    // A reaped process has no /proc entry; a zombie would still show as 'Z'.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.split_whitespace().nth(2).is_none_or(|state| state != "Z"))
        .unwrap_or(false)
}

/// A signal to a process group reaches that group and nothing else. (Without `--`,
/// procps' `kill -KILL -16303` signals -1, every process on the machine: that is what
/// took whole CI runs down. The arguments are checked before anything is sent.)
#[test]
fn a_group_signal_reaches_only_that_group() {
    use std::os::unix::process::CommandExt;
    use std::process::Command;
    assert_eq!(kill_args("KILL", SignalTarget::Group(16303)).expect("args"), ["-s", "KILL", "--", "-16303"]);
    assert_eq!(kill_args("TERM", SignalTarget::Process(16303)).expect("args"), ["-s", "TERM", "--", "16303"]);
    for refused in [SignalTarget::Group(0), SignalTarget::Group(1), SignalTarget::Process(0), SignalTarget::Process(1)]
    {
        assert_eq!(kill_args("KILL", refused), None, "{refused:?} means more than one process");
        assert!(!send_signal("0", refused));
    }
    let spawn = || Command::new("sleep").arg("30").process_group(0).spawn().expect("sleep");
    let (mut target, mut bystander) = (spawn(), spawn());
    let gone = spawn();
    let gone_pgid = gone.id();
    let mut gone = gone;
    let _ = gone.kill();
    let _ = gone.wait();
    // Signal 0 only checks: a live group answers, a dead one does not (the old parsing
    // turned `-0 -99999` into kill(-9, 0)).
    assert!(send_signal("0", SignalTarget::Group(target.id())));
    assert!(!send_signal("0", SignalTarget::Group(gone_pgid)));
    assert!(send_signal("KILL", SignalTarget::Group(target.id())));
    let status = target.wait().expect("wait");
    assert!(!status.success(), "the group's process was killed: {status}");
    assert!(matches!(bystander.try_wait(), Ok(None)), "a process of another group was hit");
    assert!(alive(std::process::id()));
    let _ = bystander.kill();
    let _ = bystander.wait();
}

#[test]
fn server_is_killed_on_drop() {
    let server = NatsServer::start();
    let pid = server.pid().expect("pid");
    assert!(alive(pid));
    drop(server);
    assert!(!alive(pid), "nats-server {pid} outlived its harness");
}

#[test]
fn server_is_killed_when_the_test_panics() {
    let pid = std::sync::Mutex::new(None);
    let result = std::panic::catch_unwind(|| {
        let server = NatsServer::start();
        *pid.lock().expect("lock") = server.pid();
        panic!("a failing test");
    });
    assert!(result.is_err());
    let pid = pid.lock().expect("lock").expect("pid recorded");
    assert!(!alive(pid), "nats-server {pid} outlived a panicking test");
}

#[test]
fn missing_binary_is_a_loud_error_naming_the_install() {
    let err = find_nats_server(None, &[PathBuf::from("/nonexistent")]).expect_err("not found");
    assert!(err.contains("apt-get install -y nats-server") && err.contains("never skip"), "{err}");
    let err = find_nats_server(Some(PathBuf::from("/nonexistent/nats-server")), &[]).expect_err("bad env");
    assert!(err.contains("NATS_SERVER_BIN"), "{err}");
    let found = find_nats_server(None, &[PathBuf::from("/nonexistent"), PathBuf::from("/usr/sbin")]);
    if Path::new("/usr/sbin/nats-server").is_file() {
        assert_eq!(found, Ok(PathBuf::from("/usr/sbin/nats-server")));
    }
}

#[tokio::test]
async fn restart_keeps_the_store_and_raises_connection_events() {
    let mut server = NatsServer::start();
    let broker = JetStreamBroker::connect(JetStreamOptions::new(server.url())).await.expect("connect").shared();
    let mut events = broker.events();
    broker.ensure_stream(StreamSpec::new("R", vec!["r.>".into()], Retention::WorkQueue)).await.expect("stream");
    broker.ensure_consumer("R", ConsumerSpec::new("w")).await.expect("consumer");
    broker.publish(OutboundMessage::new("r.a", Bytes::from("kept")).with_id("r1")).await.expect("publish");
    server.restart();
    let mut seen = Vec::new();
    let waited = tokio::time::timeout(Duration::from_secs(20), async {
        while let Ok(ev) = events.recv().await {
            seen.push(ev.clone());
            if ev == ConnectionEvent::Connected && seen.contains(&ConnectionEvent::Disconnected) {
                break;
            }
        }
    })
    .await;
    assert!(waited.is_ok(), "no disconnect/reconnect events within 20 s: {seen:?}");
    let got = broker.claim("R", "w", 10, Duration::from_secs(5)).await.expect("claim after restart");
    assert_eq!(got.len(), 1, "the stored message survived the restart");
    assert_eq!(got[0].payload, Bytes::from("kept"));
}

#[tokio::test]
async fn three_server_cluster_replicates_and_survives_one_loss() {
    let mut cluster = NatsCluster::start();
    assert_eq!(cluster.servers.len(), 3);
    let mut opts = JetStreamOptions::new(cluster.servers[0].url());
    opts.urls = cluster.servers.iter().map(NatsServer::url).collect();
    let broker = JetStreamBroker::connect(opts).await.expect("connect").shared();
    let mut spec = StreamSpec::new("C", vec!["c.>".into()], Retention::WorkQueue);
    spec.replicas = 3;
    // Right after the meta leader is elected, stream creation may still be refused briefly.
    let mut created = Err(None);
    for _ in 0..40 {
        match broker.ensure_stream(spec.clone()).await {
            Ok(s) => {
                created = Ok(s);
                break;
            }
            Err(e) => created = Err(Some(e)),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    created.expect("R3 stream on the cluster");
    broker.ensure_consumer("C", ConsumerSpec::new("w")).await.expect("consumer");
    broker.publish(OutboundMessage::new("c.a", Bytes::from("one"))).await.expect("publish");
    cluster.servers[2].kill();
    let mut published = None;
    for _ in 0..40 {
        if let Ok(ack) = broker.publish(OutboundMessage::new("c.a", Bytes::from("two")).with_id("c2")).await {
            published = Some(ack);
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(published.is_some(), "publish with 2 of 3 servers up");
    let mut got = Vec::new();
    for _ in 0..10 {
        got.extend(broker.claim("C", "w", 10, Duration::from_secs(1)).await.unwrap_or_default());
        if got.len() >= 2 {
            break;
        }
    }
    let bodies: Vec<_> = got.iter().map(|d| d.payload.clone()).collect();
    assert_eq!(bodies, vec![Bytes::from("one"), Bytes::from("two")]);
}
