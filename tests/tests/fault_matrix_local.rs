//! Fault-matrix rows that need only one machine and a real nats-server: a crash between
//! effect and ack, a full server store, a drain that never ends, and skewed clocks
//! (`notes/reliability.md` §2.3).
//!
//! Each test asserts the row's invariant: every record the input stream acknowledged
//! ends in the output stream exactly once (outputs have ids derived from their input,
//! so a replay is deduplicated), poison ends in the dead-letter stream and nothing else
//! does, and no output carries a stale ownership epoch. Every wait is bounded, and every
//! process a test starts is killed by PID when it ends, also on failure.
//!
//! CI retries a failed test here once: those invariants are `safety!` assertions, which
//! fail CI even when the retry passes; waits that run out are `LIVENESS:` failures,
//! which a retry may pass (`flotilla_tests::safety`).

use flotilla_actors::failpoint;
use flotilla_tests::relay_cluster::{
    DLQ, Feed, Launch, OUT, PARTITIONS, QUEUE_OUT, RelayCluster, TTL, id_counts, queue_record, record, record_with,
    stale_outputs, tail,
};
use flotilla_tests::{NatsServer, liveness, safety, safety_eq};
use flotilla_transport::BrokerError;
use flotilla_transport::wire::partition_for;
use futures::StreamExt;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

/// Counts every publish on `subject` by record key, also those the stream deduplicates:
/// how often each record's output was produced.
async fn watch_outputs(
    c: &RelayCluster,
    subject: &str,
) -> (Rc<RefCell<BTreeMap<String, u32>>>, tokio::task::JoinHandle<()>) {
    let mut watch = c.broker.subscribe(subject, None).await.expect("watch outputs");
    let seen: Rc<RefCell<BTreeMap<String, u32>>> = Rc::default();
    let s = seen.clone();
    let task = tokio::task::spawn_local(async move {
        while let Some(m) = watch.next().await {
            let key = m.headers.get(flotilla_transport::wire::headers::KEY).unwrap_or_default().to_owned();
            *s.borrow_mut().entry(key).or_default() += 1;
        }
    });
    (seen, task)
}

/// Asserts that `stream` holds each of records `0..n` exactly once.
async fn assert_each_once(c: &RelayCluster, stream: &str, n: u64) {
    assert_each_once_with(c, stream, n, &[]).await;
}

/// Asserts that `stream` holds each of records `0..n` and `also` exactly once, and
/// nothing else.
async fn assert_each_once_with(c: &RelayCluster, stream: &str, n: u64, also: &[u64]) {
    let counts = id_counts(&c.broker, stream).await;
    let missing: Vec<u64> = (0..n).chain(also.iter().copied()).filter(|i| !counts.contains_key(i)).take(20).collect();
    let doubled: Vec<(u64, u32)> = counts.iter().filter(|(_, k)| **k > 1).map(|(i, k)| (*i, *k)).take(20).collect();
    let extra: Vec<u64> = counts.keys().filter(|i| **i >= n && !also.contains(i)).copied().take(20).collect();
    safety!(
        missing.is_empty() && doubled.is_empty() && extra.is_empty(),
        "{stream}: missing {missing:?}, stored more than once {doubled:?}, never published {extra:?}{}",
        c.all_logs()
    );
}

/// Row 2 of the matrix: each node aborts the moment its outputs are stored and before
/// it acknowledges the input. Restarted (one armed again at a later hit), the nodes
/// process those inputs again; their outputs carry the same ids, so the output stream
/// holds every record exactly once.
async fn crash_between_effect_and_ack(queue: bool) {
    let started = Instant::now();
    let server = NatsServer::start();
    let flags: &[&str] = if queue { &["--queue"] } else { &[] };
    let mut c = RelayCluster::on_with(&server.url(), flags, &[]).await;
    c.server = Some(server);
    let (out_stream, out_subject, make): (_, _, fn(u64) -> _) = if queue {
        (QUEUE_OUT, "flotilla.relay.relay-done", queue_record)
    } else {
        (OUT, "flotilla.relay.relay-out.*", record)
    };
    let launch = |fail_at: Option<u64>| Launch {
        args: flags.iter().map(|f| (*f).to_owned()).collect(),
        env: fail_at
            .map(|n| (failpoint::ENV.to_owned(), format!("{}:{n}", failpoint::Point::EffectsStoredBeforeAck.name())))
            .into_iter()
            .collect(),
        ..Launch::default()
    };
    c.add_with("a", launch(Some(3)));
    c.add_with("b", launch(Some(5)));
    if !queue {
        c.wait_balanced(&["a", "b"], Duration::from_secs(30)).await;
    }
    let (produced, watcher) = watch_outputs(&c, out_subject).await;
    let feed = Feed::start_with(c.broker.clone(), 300, make);
    for (id, n) in [("a", 3), ("b", 5)] {
        let status = c.wait_exit_async(id, Duration::from_secs(30)).await;
        assert!(!status.success(), "node {id} was to abort at its failpoint: {status}");
        let log = c.log_text(id);
        assert!(log.contains(&format!("failpoint effects-stored-before-ack:{n} fired")), "{id}: {}", tail(&log, 20));
    }
    let crashed_at = feed.published();
    // Restarted as a supervisor would: a without the failpoint, b armed at a later hit.
    c.add_with("a", launch(None));
    c.add_with("b", launch(Some(40)));
    let status = c.wait_exit_async("b", Duration::from_secs(40)).await;
    assert!(!status.success(), "b was to abort again at its 40th hit: {status}");
    c.add_with("b", launch(None));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let n = feed.stop().await;
    assert!(n > crashed_at, "the feed went on after the crashes");
    c.wait_all_in(out_stream, n, Duration::from_secs(45)).await;
    // Redeliveries of what the aborted nodes held unacknowledged (queue: after ack_wait).
    c.wait_input_acked(queue, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    watcher.abort();
    assert_each_once(&c, out_stream, n).await;
    let replayed = produced.borrow().values().filter(|k| **k > 1).count();
    assert!(replayed >= 1, "no output was produced twice: the crash between effect and ack did not happen");
    for id in ["a", "b"] {
        assert!(c.is_running(id), "node {id} died after its restart{}", c.all_logs());
    }
    eprintln!(
        "crash between effect and ack ({}): {n} records, {replayed} outputs produced again and deduplicated, {:.1?}",
        if queue { "queue" } else { "ordered" },
        started.elapsed()
    );
}

#[actix_rt::test]
async fn crash_between_effect_and_ack_ordered_stores_every_record_once() {
    crash_between_effect_and_ack(false).await;
}

#[actix_rt::test]
async fn crash_between_effect_and_ack_queue_stores_every_record_once() {
    crash_between_effect_and_ack(true).await;
}

/// Row: the server's store fills up. Publishers and nodes get a typed error that says
/// the store is full (retried with backoff, no attempt spent); nothing crashes; once
/// space returns everything resumes and every record the input acknowledged is in
/// relay-out exactly once.
#[actix_rt::test]
async fn a_full_server_store_holds_work_with_a_typed_error_and_loses_nothing_once_space_returns() {
    let started = Instant::now();
    let server = NatsServer::start_with_config("jetstream {\n  max_file_store: 8MB\n}\n");
    let mut c = RelayCluster::on(&server.url(), &["a", "b"]).await;
    c.server = Some(server);
    c.wait_balanced(&["a", "b"], Duration::from_secs(30)).await;
    let feed = Feed::start(c.broker.clone(), 300);
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Another tenant fills the store.
    let client = async_nats::connect(c.nats.as_str()).await.expect("connect");
    let js = async_nats::jetstream::new(client);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "FILLER".into(),
        subjects: vec!["filler.>".into()],
        ..Default::default()
    })
    .await
    .expect("filler stream");
    let chunk = bytes::Bytes::from(vec![b'x'; 64 * 1024]);
    let mut filled = 0u64;
    let fill_error = loop {
        let ack = js.publish("filler.x", chunk.clone()).await.expect("publish sent");
        match ack.await {
            Ok(_) => filled += chunk.len() as u64,
            Err(e) => break e.to_string(),
        }
        assert!(filled < 64 << 20, "64 MB went into a store limited to 8 MB");
    };
    let full_at = Instant::now();
    eprintln!("store full after {} KB of filler: {fill_error}", filled / 1024);

    // The publisher: a typed error, the relay's publish command says why.
    let refused = c.broker.publish(record(1 << 40)).await;
    let err = refused.expect_err("a publish into a full store is refused");
    assert!(matches!(err, BrokerError::StorageFull { .. }) && err.is_transient(), "{err:?}");
    assert!(err.to_string().contains("store is full"), "{err}");
    let cmd = c.relay_cmd(&["publish", "--count", "3", "--start", &(1u64 << 41).to_string()]);
    let text = String::from_utf8_lossy(&cmd.stderr).to_string();
    assert!(!cmd.status.success() && text.contains("store is full"), "relay publish into a full store: {text}");
    // The nodes: they log the same kind of error (their outputs or lease renewals are
    // refused) and stay up.
    for id in ["a", "b"] {
        c.wait_log(id, "store is full", Duration::from_secs(20)).await;
    }
    let stalled = feed.published();
    tokio::time::sleep(Duration::from_secs(3)).await;
    for id in ["a", "b"] {
        assert!(c.is_running(id), "node {id} died on a full store{}", c.all_logs());
    }

    // Space returns.
    js.delete_stream("FILLER").await.expect("delete filler");
    let freed_at = Instant::now();
    let start = Instant::now();
    while feed.published() <= stalled + 300 {
        liveness!(start.elapsed() < Duration::from_secs(20), "the feed did not resume{}", c.all_logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let resumed = freed_at.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let gap = feed.longest_gap();
    let n = feed.stop().await;
    c.wait_all_out(n, Duration::from_secs(60)).await;
    c.wait_input_acked(false, Duration::from_secs(30)).await;
    assert_each_once(&c, OUT, n).await;
    let dead = c.broker.stream_state(DLQ).await.map(|s| s.messages).unwrap_or(0);
    safety_eq!(dead, 0, "nothing was poison, so nothing is dead-lettered{}", c.all_logs());
    for id in ["a", "b"] {
        assert!(c.is_running(id), "node {id} died after the store emptied{}", c.all_logs());
    }
    eprintln!(
        "full store: held {:.1?}, publishing resumed {resumed:.1?} after space returned; {n} records, longest publish gap {:.1?}; test {:.1?}",
        freed_at - full_at,
        gap,
        started.elapsed()
    );
}

/// Row: a drain that never ends. A handler hangs on one partition; `drain --deadline 4s`
/// exits 1 naming that partition while the other partitions go on to their markers;
/// SIGTERM stops the hung node within its drain timeout (10 s), handing the record back;
/// restarted with the hang fixed (`--max-sleep`), the old run drains and a new one
/// takes the rest: every record once, nothing dead-lettered.
#[actix_rt::test]
async fn a_drain_that_never_ends_names_the_stuck_partition_and_loses_nothing_after_restart() {
    let started = Instant::now();
    let server = NatsServer::start();
    let mut c = RelayCluster::on(&server.url(), &[]).await;
    c.server = Some(server);
    let drain_timeout = Launch { args: vec!["--drain-timeout".into(), "10s".into()], ..Launch::default() };
    c.add_with("a", drain_timeout.clone());
    c.add_with("b", drain_timeout);
    let owners = c.wait_balanced(&["a", "b"], Duration::from_secs(30)).await;
    let (produced, watcher) = watch_outputs(&c, "flotilla.relay.relay-out.*").await;
    let feed = Feed::start(c.broker.clone(), 200);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stuck = 1u64 << 30;
    let p = partition_for(&stuck.to_string(), PARTITIONS);
    let holder = owners.get(&p).cloned().expect("the stuck partition is held");
    let other = if holder == "a" { "b" } else { "a" };
    c.broker.publish(record_with(stuck, "sleep:600000")).await.expect("publish the hanging record");
    // The other partitions keep flowing past it (watched as they are published: reading
    // relay-out while it grows chases its tail).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let upto = feed.published();
    let others: Vec<String> =
        (0..upto).filter(|i| partition_for(&i.to_string(), PARTITIONS) != p).map(|i| i.to_string()).collect();
    let start = Instant::now();
    while !others.iter().all(|i| produced.borrow().contains_key(i)) {
        liveness!(
            start.elapsed() < Duration::from_secs(20),
            "other partitions stalled behind the hung one{}",
            c.all_logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!produced.borrow().contains_key(&stuck.to_string()), "the hung record was forwarded");
    let drain = c.relay_cmd(&["drain", "--deadline", "4s"]);
    let text = format!("{}{}", String::from_utf8_lossy(&drain.stdout), String::from_utf8_lossy(&drain.stderr));
    assert_eq!(drain.status.code(), Some(1), "a drain past its deadline exits 1: {text}");
    assert!(
        text.contains("deadline") && text.contains(&format!("relay-in/{p} (held by {holder}")),
        "the stuck partition relay-in/{p} held by {holder} is named: {text}"
    );
    eprintln!("drain past its deadline said: {}", text.trim());
    // SIGTERM: the hung node waits out its drain timeout, hands the record back, exits.
    let term = Instant::now();
    c.signal(&holder, "TERM");
    c.signal(other, "TERM");
    let status = c.wait_exit_async(other, Duration::from_secs(30)).await;
    assert!(status.success(), "{other} exits 0 on SIGTERM: {status}");
    let status = c.wait_exit_async(&holder, Duration::from_secs(25)).await;
    let stop_took = term.elapsed();
    assert!(status.success(), "{holder} exits 0 on SIGTERM: {status}{}", c.all_logs());
    liveness!(stop_took <= Duration::from_secs(18), "{holder} took {stop_took:?} to stop (drain timeout 10 s)");
    assert!(c.log_text(&holder).contains("drain timeout: handing back in-flight messages"), "{}", c.all_logs());
    let n = feed.stop().await;
    watcher.abort();
    // The hang fixed: the old run finishes draining (the node exits 0), then a new run
    // takes what followed the markers. One node finishes the old run: a second one
    // started beside it may join only after the first drained everything, find the old
    // run over and begin a new one, which no drain ends (seen once in CI).
    let fixed = Launch { args: vec!["--max-sleep".into(), "10ms".into()], ..Launch::default() };
    c.add_with("a", fixed);
    let status = c.wait_exit_async("a", Duration::from_secs(40)).await;
    assert!(status.success(), "a exits 0 once the old run is drained: {status}{}", c.all_logs());
    c.add("a");
    c.add("b");
    c.wait_all_out(n, Duration::from_secs(40)).await;
    c.wait_input_acked(false, Duration::from_secs(20)).await;
    assert_each_once_with(&c, OUT, n, &[stuck]).await;
    let dead = c.broker.stream_state(DLQ).await.map(|s| s.messages).unwrap_or(0);
    safety_eq!(dead, 0, "nothing was poison{}", c.all_logs());
    eprintln!(
        "drain that never ends: relay-in/{p} stuck on {holder}; SIGTERM → exit {stop_took:.1?}; {n} records (+1 hung); test {:.1?}",
        started.elapsed()
    );
}

/// Debian's libfaketime (package `faketime`). Clock-skew rows never skip: without it
/// they fail, saying how to install it (`scripts/test` installs it).
///
/// The library is preloaded into the node directly rather than through the
/// `faketime` wrapper: the wrapper forks the node (so signals reach the wrapper, not
/// the node) and names a semaphore after its own PID, which a wrapper killed earlier
/// leaves behind in /dev/shm, so a later wrapper with a reused PID fails with
/// "sem_open: File exists".
fn libfaketime() -> String {
    let found = ["/usr/lib/x86_64-linux-gnu/faketime", "/usr/lib/aarch64-linux-gnu/faketime", "/usr/lib/faketime"]
        .iter()
        .map(|d| std::path::Path::new(d).join("libfaketime.so.1"))
        .find(|p| p.is_file());
    let Some(lib) = found else {
        panic!(
            "libfaketime not found (CI={}): install it with `apt-get install -y faketime` (scripts/test does); \
             the clock-skew tests never skip",
            std::env::var("CI").unwrap_or_default()
        );
    };
    lib.display().to_string()
}

/// A node whose wall clock is `offset` off (`+90s`, `-90s`); its monotonic clock is
/// left alone, as on a real machine with a wrong time.
fn skewed(offset: &str) -> Launch {
    Launch {
        env: vec![
            ("LD_PRELOAD".into(), libfaketime()),
            ("FAKETIME".into(), offset.into()),
            ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
        ],
        ..Launch::default()
    }
}

/// `line` without terminal colour sequences (`ESC [ … m`), which node logs carry.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Waits until node `id` logged its estimate of the server clock, and checks that it
/// runs `offset` off (`+90s` ahead: the server is 90 s behind it): the skew really is
/// in effect, so a pass is not a node on the true clock.
async fn assert_skewed(c: &RelayCluster, id: &str, offset: &str) {
    c.wait_log(id, "delayed messages are timed on the server's", Duration::from_secs(20)).await;
    let log = c.log_text(id);
    let measured: i64 = log
        .lines()
        .find(|l| l.contains("delayed messages are timed on the server's"))
        .map(strip_ansi)
        .and_then(|l| l.split("offset_ms=").nth(1).map(str::to_owned))
        .and_then(|v| v.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or_else(|| panic!("node {id} logged no offset_ms:{}", c.all_logs()));
    let want: i64 = if offset.starts_with('+') { -90_000 } else { 90_000 };
    assert!(
        (measured - want).abs() < 2_000,
        "node {id} under FAKETIME={offset} measured a server-clock offset of {measured} ms, not about {want} ms"
    );
}

/// Row: clocks 90 s off either way. One node runs 90 s ahead, one 90 s behind, one
/// right. Leases expire by the server's clock, so they still move only when a holder
/// dies: after the skewed node is killed its partitions move within two TTLs, no
/// output carries a stale epoch, and nothing is lost.
#[actix_rt::test]
async fn clock_skew_of_90s_either_way_moves_leases_correctly_and_loses_nothing() {
    let started = Instant::now();
    let server = NatsServer::start();
    let mut c = RelayCluster::on(&server.url(), &[]).await;
    c.server = Some(server);
    c.add("n");
    c.add_with("ahead", skewed("+90s"));
    c.add_with("behind", skewed("-90s"));
    let owners = c.wait_balanced(&["n", "ahead", "behind"], Duration::from_secs(40)).await;
    assert_skewed(&c, "ahead", "+90s").await;
    assert_skewed(&c, "behind", "-90s").await;
    let feed = Feed::start(c.broker.clone(), 300);
    tokio::time::sleep(Duration::from_secs(3)).await;
    // The balance held under load: no lease moved between nodes that are all alive.
    let before = c.owners().await;
    let moved: Vec<u32> = before.iter().filter(|(p, (o, _))| owners.get(p) != Some(o)).map(|(p, _)| *p).collect();
    assert!(moved.is_empty(), "leases moved between live skewed nodes: {owners:?} → {before:?}{}", c.all_logs());
    // After each kill: (relay-out's last sequence once the partitions moved, the
    // epochs then). Checked once the feed stops: reading relay-out while it grows
    // chases its tail.
    let mut moves = Vec::new();
    for victim in ["ahead", "behind"] {
        let held: Vec<u32> = c.owners().await.iter().filter(|(_, (o, _))| o == victim).map(|(p, _)| *p).collect();
        c.signal(victim, "KILL");
        let took = c.wait_moved_from(victim, &held, TTL * 2 + Duration::from_secs(5)).await;
        liveness!(took <= TTL * 2 + Duration::from_secs(1), "{victim}'s partitions moved after {took:?}");
        let out_seq = c.broker.stream_state(OUT).await.map(|s| s.last_seq).unwrap_or(0);
        let newer: BTreeMap<u32, u64> = c.owners().await.into_iter().map(|(p, (_, e))| (p, e)).collect();
        moves.push((victim, out_seq, newer));
        eprintln!("clock skew: {victim}'s partitions {held:?} moved in {took:.1?}");
        tokio::time::sleep(Duration::from_secs(2)).await;
        c.add_with(victim, skewed(if victim == "ahead" { "+90s" } else { "-90s" }));
        c.wait_balanced(&["n", "ahead", "behind"], Duration::from_secs(40)).await;
    }
    let n = feed.stop().await;
    for (victim, out_seq, newer) in &moves {
        let stale = stale_outputs(&c.broker, *out_seq, newer).await;
        safety!(stale.is_empty(), "outputs with a stale epoch after {victim} died: {stale:?}");
    }
    c.wait_all_out(n, Duration::from_secs(60)).await;
    c.wait_input_acked(false, Duration::from_secs(30)).await;
    assert_each_once(&c, OUT, n).await;
    let dead = c.broker.stream_state(DLQ).await.map(|s| s.messages).unwrap_or(0);
    safety_eq!(dead, 0, "nothing was poison{}", c.all_logs());
    eprintln!("clock skew ±90 s: {n} records; test {:.1?}", started.elapsed());
}

/// Row: a delayed output (`later:<ms>`, `ctx.send_after`) promoted by a node whose
/// clock is 90 s off fires on time: due `delay` after the server stored it, judged on
/// the server's clock as the node estimates it, not 90 s early or late.
#[actix_rt::test]
async fn delayed_outputs_fire_on_time_on_a_node_whose_clock_is_90s_off() {
    let started = Instant::now();
    let server = NatsServer::start();
    let mut c = RelayCluster::on(&server.url(), &[]).await;
    c.server = Some(server);
    let delay = Duration::from_secs(4);
    let mut watch = c.broker.subscribe("flotilla.relay.relay-out.*", None).await.expect("watch outputs");
    let fired: Rc<RefCell<BTreeMap<u64, Instant>>> = Rc::default();
    let f = fired.clone();
    let watcher = tokio::task::spawn_local(async move {
        while let Some(m) = watch.next().await {
            if let Some(id) = m.headers.get(flotilla_transport::wire::headers::KEY).and_then(|k| k.parse().ok()) {
                f.borrow_mut().entry(id).or_insert_with(Instant::now);
            }
        }
    });
    let mut ids = Vec::new();
    let mut report = Vec::new();
    for (round, offset) in ["+90s", "-90s"].into_iter().enumerate() {
        let id = format!("skewed{round}");
        c.add_with(&id, skewed(offset));
        c.wait_balanced(&[&id], Duration::from_secs(30)).await;
        assert_skewed(&c, &id, offset).await;
        let sent: Vec<(u64, Instant)> = (0..5u64).map(|k| (1000 * (round as u64 + 1) + k, Instant::now())).collect();
        for (id, _) in &sent {
            c.broker.publish(record_with(*id, &format!("later:{}", delay.as_millis()))).await.expect("publish");
        }
        let start = Instant::now();
        while !sent.iter().all(|(i, _)| fired.borrow().contains_key(i)) {
            liveness!(
                start.elapsed() < delay + Duration::from_secs(15),
                "delayed outputs of a node {offset} off did not fire within {:?}{}",
                delay + Duration::from_secs(15),
                c.all_logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let took: Vec<Duration> = sent.iter().map(|(i, at)| fired.borrow()[i].duration_since(*at)).collect();
        let (early, late) = (took.iter().min().copied(), took.iter().max().copied());
        report.push(format!("{offset}: fired after {early:.2?}..{late:.2?} (delay {delay:?})"));
        safety!(
            took.iter().all(|t| *t >= delay - Duration::from_millis(500)),
            "a node {offset} off fired delayed outputs early, after {took:?}, wanted {delay:?}{}",
            c.all_logs()
        );
        liveness!(
            took.iter().all(|t| *t <= delay + Duration::from_secs(3)),
            "a node {offset} off fired delayed outputs late, after {took:?}, wanted {delay:?}{}",
            c.all_logs()
        );
        ids.extend(sent.iter().map(|(i, _)| *i));
        c.signal(&id, "KILL");
    }
    watcher.abort();
    let counts = id_counts(&c.broker, OUT).await;
    for id in &ids {
        safety_eq!(counts.get(id), Some(&1), "delayed output {id} stored once: {counts:?}");
    }
    eprintln!("delayed outputs on skewed nodes: {}; test {:.1?}", report.join("; "), started.elapsed());
}
