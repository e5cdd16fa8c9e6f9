//! Seeing a job run, against a real nats-server and real relay nodes: `/metrics`
//! scraped and parsed (counts that must match what the nodes did), `/api/status`
//! against `status --json`, and the dashboard driven by a real headless Chromium
//! (three nodes, one killed, its partitions seen moving, a dead letter replayed by a
//! click). Screenshots go to `target/tmp/dashboard/`.

use flotilla_tests::free_port;
use flotilla_tests::relay_cluster::{Launch, PARTITIONS, RelayCluster, record, tail};
use flotilla_tests::webdriver::{Browser, WebDriverError};
use flotilla_transport::wire::partition_for;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// One sample of a scrape: `name{labels}` → value.
#[derive(Debug, Default)]
struct Scrape {
    samples: Vec<(String, BTreeMap<String, String>, f64)>,
    types: BTreeMap<String, String>,
}

impl Scrape {
    /// Parses Prometheus text exposition format (what the exporter writes).
    fn parse(text: &str) -> Self {
        let mut s = Scrape::default();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut parts = rest.split_whitespace();
                if let (Some(name), Some(kind)) = (parts.next(), parts.next()) {
                    s.types.insert(name.to_owned(), kind.to_owned());
                }
                continue;
            }
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("a sample line: {line:?}"));
            let value: f64 = match value {
                "+Inf" => f64::INFINITY,
                v => v.parse().unwrap_or_else(|_| panic!("a number in {line:?}")),
            };
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => {
                    let body = rest.strip_suffix('}').unwrap_or_else(|| panic!("closed labels in {line:?}"));
                    let mut labels = BTreeMap::new();
                    for pair in body.split("\",").filter(|p| !p.is_empty()) {
                        let (k, v) = pair.split_once("=\"").unwrap_or_else(|| panic!("label in {line:?}"));
                        labels.insert(k.to_owned(), v.trim_end_matches('"').to_owned());
                    }
                    (name.to_owned(), labels)
                }
                None => (series.to_owned(), BTreeMap::new()),
            };
            s.samples.push((name, labels, value));
        }
        s
    }

    /// The sum of `name` over the samples whose labels include `with`.
    fn sum(&self, name: &str, with: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|(n, l, _)| n == name && with.iter().all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v)))
            .map(|(_, _, v)| v)
            .sum()
    }

    fn has(&self, name: &str) -> bool {
        self.samples.iter().any(|(n, _, _)| n == name)
    }
}

fn get(url: &str) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(20)))
        .http_status_as_error(false)
        .build()
        .into();
    match agent.get(url).call() {
        Ok(mut r) => {
            let status = r.status().as_u16();
            (status, r.body_mut().read_to_string().unwrap_or_default())
        }
        Err(e) => (0, e.to_string()),
    }
}

/// Scrapes until `check` holds (counters settle once the work is done).
fn scrape_until(url: &str, within: Duration, what: &str, check: impl Fn(&Scrape) -> bool) -> Scrape {
    let deadline = Instant::now() + within;
    loop {
        let (status, body) = get(url);
        if status == 200 {
            let s = Scrape::parse(&body);
            if check(&s) {
                return s;
            }
            if Instant::now() > deadline {
                let backlog: Vec<&str> = body.lines().filter(|l| l.starts_with("flotilla_backlog_messages")).collect();
                panic!("{what} never held; last scrape:\n{}\nbacklog gauges:\n{}", tail(&body, 80), backlog.join("\n"));
            }
        } else if Instant::now() > deadline {
            panic!("{url} answered {status}: {body}");
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// `flotilla_backlog_messages` of relay-in, by partition.
fn backlog(s: &Scrape) -> BTreeMap<String, f64> {
    s.samples
        .iter()
        .filter(|(n, l, _)| n == "flotilla_backlog_messages" && l.get("stream").is_some_and(|x| x == "relay-in"))
        .filter_map(|(_, l, v)| Some((l.get("partition")?.clone(), *v)))
        .collect()
}

/// Whether relay-in's backlog gauges read `on3` for partition 3 and 0 for the other 7.
fn backlog_is(on3: f64) -> impl Fn(&Scrape) -> bool {
    move |s| {
        let b = backlog(s);
        b.len() == 8 && b.iter().all(|(p, v)| *v == if p == "3" { on3 } else { 0.0 })
    }
}

fn http_launch(port: u16) -> Launch {
    Launch { args: vec!["--http".into(), format!("127.0.0.1:{port}")], ..Launch::default() }
}

/// One node with `--http`: 100 records, 2 of them poison (3 attempts each). The
/// scrape's counts are exactly what the node did, and its backlog gauges exactly what
/// waits in each partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_scraped_and_count_exactly_what_the_node_did() {
    let mut c = RelayCluster::start(&[]).await;
    let port = free_port();
    c.add_with("metrics-a", http_launch(port));
    c.wait_log("metrics-a", "dashboard and metrics", Duration::from_secs(30)).await;
    let out = c.relay_cmd(&["publish", "--count", "100", "--poison", "2"]);
    assert!(out.status.success(), "publish: {}", String::from_utf8_lossy(&out.stderr));
    flotilla_tests::wait_count(&c.broker, "FLOTILLA_relay_relay-out", 98, Duration::from_secs(60)).await;

    let url = format!("http://127.0.0.1:{port}/metrics");
    let s = tokio::task::spawn_blocking(move || {
        scrape_until(&url, Duration::from_secs(30), "2 dead letters and 98 outputs counted", |s| {
            s.sum("flotilla_dead_letters_total", &[]) >= 2.0 && s.sum("flotilla_published_messages_total", &[]) >= 98.0
        })
    })
    .await
    .expect("scrape");
    let all = |name: &str| s.sum(name, &[]);
    // Every record was handed to its task once; the poison ones were retried in place.
    assert_eq!(all("flotilla_envelopes_total"), 100.0, "envelopes");
    assert_eq!(all("flotilla_redeliveries_total"), 0.0, "redeliveries");
    assert_eq!(s.sum("flotilla_dead_letters_total", &[("stream", "relay-in"), ("reason", "max-attempts")]), 2.0);
    assert_eq!(all("flotilla_failed_attempts_total"), 6.0, "3 failed attempts per poison record");
    // 98 successes and 6 failures: one `process` each.
    assert_eq!(all("flotilla_process_seconds_count"), 104.0, "process calls");
    assert_eq!(all("flotilla_published_messages_total"), 98.0, "outputs stored");
    assert!(all("flotilla_acks_total") >= 8.0, "commits acknowledge every partition's inputs");
    assert_eq!(s.sum("flotilla_acks_total", &[("kind", "nak")]), 0.0, "ordered inputs never nak");
    assert!(all("flotilla_commit_seconds_count") >= 8.0, "a commit per partition at least");
    assert!(all("flotilla_hook_seconds_count") >= 8.0, "init ran on every partition");
    assert_eq!(s.sum("flotilla_leases_acquired_total", &[("stream", "relay-in")]), 8.0, "8 leases");
    assert_eq!(s.sum("flotilla_partitions_owned", &[("stream", "relay-in")]), 8.0);
    assert_eq!(all("flotilla_nats_connected"), 1.0);
    assert_eq!(s.sum("flotilla_node_info", &[("node", "metrics-a"), ("flotilla_job", "relay")]), 1.0);
    assert!(all("flotilla_node_start_time_seconds") > 1.7e9);
    for p in 0..8 {
        let p = p.to_string();
        assert!(
            s.samples.iter().any(|(n, l, _)| n == "flotilla_backlog_messages"
                && l.get("partition") == Some(&p)
                && l.get("stream").is_some_and(|x| x == "relay-in")),
            "a backlog gauge for partition {p}"
        );
    }
    assert!(s.has("flotilla_oldest_message_age_seconds") && s.has("flotilla_utilization_ratio"));
    // Prometheus conventions: histograms with buckets, counters typed as counters.
    assert_eq!(s.types.get("flotilla_process_seconds").map(String::as_str), Some("histogram"));
    assert_eq!(s.types.get("flotilla_envelopes_total").map(String::as_str), Some("counter"));
    assert_eq!(s.types.get("flotilla_backlog_messages").map(String::as_str), Some("gauge"));
    assert!(
        s.samples.iter().any(|(n, l, v)| n == "flotilla_process_seconds_bucket"
            && l.get("le").map(String::as_str) == Some("+Inf")
            && *v > 0.0),
        "an +Inf bucket"
    );

    // /api/status is `status --json`: the same job, members and owners.
    let status_url = format!("http://127.0.0.1:{port}/api/status");
    let (code, body) = tokio::task::spawn_blocking(move || get(&status_url)).await.expect("get");
    assert_eq!(code, 200, "{body}");
    let api: serde_json::Value = serde_json::from_str(&body).expect("status JSON");
    let out = c.relay_cmd(&["status", "--json"]);
    assert!(out.status.success(), "status: {}", String::from_utf8_lossy(&out.stderr));
    let cli: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status --json");
    let keys = |v: &serde_json::Value| v.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>()).unwrap_or_default();
    assert_eq!(keys(&api), keys(&cli), "the same fields");
    for field in ["job", "members", "dlq", "run_id"] {
        assert_eq!(api[field], cli[field], "{field}");
    }
    let owners = |v: &serde_json::Value| {
        v["partitions"]
            .as_array()
            .map(|ps| ps.iter().map(|p| p["owner"].clone()).collect::<Vec<_>>())
            .unwrap_or_default()
    };
    assert_eq!(owners(&api), owners(&cli));
    assert_eq!(api["nodes"][0]["host"].as_str().map(str::is_empty), Some(false), "the node says its host");
    assert!(api["nodes"][0]["started_ms"].as_u64().is_some_and(|ms| ms > 0), "and when it started");

    // `top --once`: the same view in a terminal (one screen, rates over an interval).
    let out = c.relay_cmd(&["top", "--once", "--interval", "1s"]);
    let screen = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "top: {}", String::from_utf8_lossy(&out.stderr));
    assert!(screen.contains("flotilla top — job relay") && screen.contains("dead letters 2"), "{screen}");
    assert!((0..8).all(|p| screen.contains(&format!("relay-in/{p}"))), "every partition: {screen}");
    assert!(screen.contains("metrics-a") && !screen.contains('\x1b'), "no escapes in a pipe: {screen}");

    // The dead letters, as `dlq list --json` lists them.
    let dlq_url = format!("http://127.0.0.1:{port}/api/dlq");
    let (code, body) = tokio::task::spawn_blocking(move || get(&dlq_url)).await.expect("get");
    assert_eq!(code, 200, "{body}");
    let entries: serde_json::Value = serde_json::from_str(&body).expect("dlq JSON");
    assert_eq!(entries.as_array().map(Vec::len), Some(2), "{entries}");
    assert_eq!(entries[0]["reason"], "max-attempts");

    // The backlog gauges say what waits: 0 everywhere once the work is done; with
    // relay-in/3 paused and 7 records published to it, 7 there and 0 elsewhere; 0 again
    // once it is resumed and has caught up. (Checked every 5 s: scraped until it holds.)
    let url = format!("http://127.0.0.1:{port}/metrics");
    let u = url.clone();
    tokio::task::spawn_blocking(move || {
        scrape_until(&u, Duration::from_secs(30), "a backlog of 0 everywhere", backlog_is(0.0))
    })
    .await
    .expect("scrape");
    let paused = c.relay_cmd(&["pause", "--stream", "relay-in", "--partition", "3"]);
    assert!(paused.status.success(), "pause: {}", String::from_utf8_lossy(&paused.stderr));
    // A claim already out when the pause lands may still deliver (claims wait 1 s).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let on3: Vec<u64> = (1000..2000).filter(|i| partition_for(&i.to_string(), PARTITIONS) == 3).take(7).collect();
    for ack in c.broker.publish_batch(on3.iter().map(|i| record(*i)).collect()).await {
        ack.expect("publish");
    }
    let u = url.clone();
    let s = tokio::task::spawn_blocking(move || {
        scrape_until(&u, Duration::from_secs(30), "a backlog of 7 on relay-in/3 and 0 elsewhere", backlog_is(7.0))
    })
    .await
    .expect("scrape");
    assert_eq!(backlog(&s).values().sum::<f64>(), 7.0, "{:?}", backlog(&s));
    let resumed = c.relay_cmd(&["resume", "--stream", "relay-in", "--partition", "3"]);
    assert!(resumed.status.success(), "resume: {}", String::from_utf8_lossy(&resumed.stderr));
    flotilla_tests::wait_count(&c.broker, "FLOTILLA_relay_relay-out", 105, Duration::from_secs(30)).await;
    tokio::task::spawn_blocking(move || {
        scrape_until(&url, Duration::from_secs(30), "a backlog of 0 again once resumed", backlog_is(0.0))
    })
    .await
    .expect("scrape");
}

/// A bad `--http` address is refused at start with what to fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_that_cannot_be_served_is_refused_at_start() {
    let mut c = RelayCluster::start(&[]).await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    c.add_with("busy", http_launch(port));
    let status = c.wait_exit_async("busy", Duration::from_secs(30)).await;
    assert!(!status.success());
    let log = c.log_text("busy");
    assert!(log.contains(&format!("cannot listen on --http 127.0.0.1:{port}")), "{}", tail(&log, 20));
}

/// What the page's partition table shows: partition key → owner.
fn page_owners(b: &Browser) -> Result<BTreeMap<String, String>, WebDriverError> {
    let rows = b.eval(
        "return [...document.querySelectorAll('#partitions tbody tr')].map(r => [r.dataset.key, r.querySelector('.owner').textContent]);",
    )?;
    Ok(rows
        .as_array()
        .map(|rows| rows.iter().filter_map(|r| Some((r[0].as_str()?.to_owned(), r[1].as_str()?.to_owned()))).collect())
        .unwrap_or_default())
}

fn dlq_ids(b: &Browser) -> Result<Vec<String>, WebDriverError> {
    let ids = b.eval("return [...document.querySelectorAll('#dlq tbody tr')].map(r => r.dataset.id);")?;
    Ok(ids.as_array().map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect()).unwrap_or_default())
}

fn screenshots() -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard");
    std::fs::create_dir_all(&dir).expect("screenshot dir");
    dir
}

/// The dashboard test's token (`FLOTILLA_HTTP_TOKEN`).
const TOKEN: &str = "dashboard-test-token-0123456789";

/// Three relay nodes, each serving `--http` with a token; the page of one of them, in a
/// real headless Chromium: without the token it says how to give it; opened with
/// `#token=…` (which it drops from the address) it shows every partition and node, sees
/// a killed node's partitions move to the others, and replays a dead letter when its
/// button is clicked (the entry leaves the list, on the page and in the stream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_partitions_moving_and_replays_a_dead_letter_in_a_real_browser() {
    let mut c = RelayCluster::start(&[]).await;
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    for (id, port) in ["dash-a", "dash-b", "dash-c"].into_iter().zip(&ports) {
        let env = vec![("FLOTILLA_HTTP_TOKEN".to_owned(), TOKEN.to_owned())];
        c.add_with(id, Launch { env, ..http_launch(*port) });
    }
    let owners = c.wait_balanced(&["dash-a", "dash-b", "dash-c"], Duration::from_secs(60)).await;
    let out = c.relay_cmd(&["publish", "--count", "200", "--poison", "2"]);
    assert!(out.status.success(), "publish: {}", String::from_utf8_lossy(&out.stderr));
    flotilla_tests::wait_count(&c.broker, "FLOTILLA_relay_relay-out", 198, Duration::from_secs(60)).await;
    flotilla_tests::wait_count(&c.broker, "FLOTILLA_relay_DLQ", 2, Duration::from_secs(30)).await;
    let victim: Vec<u32> = owners.iter().filter(|(_, n)| *n == "dash-c").map(|(p, _)| *p).collect();
    assert!(!victim.is_empty(), "dash-c owns partitions: {owners:?}");

    let dir = screenshots();
    let url = format!("http://127.0.0.1:{}/", ports[0]);
    let browser = tokio::task::spawn_blocking(move || {
        let b = Browser::start(&dir).unwrap_or_else(|e| panic!("a real browser for the dashboard test: {e}"));
        b.goto(&url).expect("open the dashboard");
        b.wait_for("the page says it needs the token", Duration::from_secs(30), |b| {
            let conn = b.texts("#conn")?;
            Ok(conn.iter().any(|t| t.contains("needs its token") && t.contains("#token=")).then_some(()))
        })
        .expect("without the token the page says how to give it");
        b.screenshot("0-token-needed").expect("screenshot");
        b.goto(&format!("{url}#token={TOKEN}")).expect("open the dashboard with the token");
        b.wait_for("every partition owned, three nodes listed", Duration::from_secs(30), |b| {
            let owners = page_owners(b)?;
            let nodes = b.texts("#nodes tbody tr td:first-child")?;
            Ok((owners.len() == 8 && owners.values().all(|o| o.starts_with("dash-")) && nodes.len() == 3).then_some(()))
        })
        .expect("the page shows the cluster");
        let shown = page_owners(&b).expect("owners");
        let href = b.eval("return location.href;").expect("href");
        assert!(!href.to_string().contains(TOKEN), "the token is dropped from the address: {href}");
        let shot = b.screenshot("1-three-nodes").expect("screenshot");
        eprintln!("screenshot: {}", shot.display());
        (b, shown)
    })
    .await
    .expect("browser");
    let (b, shown) = browser;
    for p in &victim {
        assert_eq!(shown.get(&format!("relay-in/{p}")).map(String::as_str), Some("dash-c"), "{shown:?}");
    }

    // kill -9 dash-c: its partitions move once its leases run out (3 s here).
    c.signal("dash-c", "KILL");
    let victim_seen = victim.clone();
    let b = tokio::task::spawn_blocking(move || {
        let victim = victim_seen;
        // The page shows the partitions on the live nodes, the moves among the events,
        // and dash-c gone (each can come a poll after the other).
        let (moved, events) = b
            .wait_for(
                "dash-c's partitions owned by the live nodes, and the moves listed",
                Duration::from_secs(60),
                |b| {
                    let owners = page_owners(b)?;
                    if owners.len() != 8 || !owners.values().all(|o| o == "dash-a" || o == "dash-b") {
                        return Ok(None);
                    }
                    let events = b.texts("#events li")?;
                    let listed = victim.iter().all(|p| {
                        let taken = format!("relay-in/{p} taken by {}", owners[&format!("relay-in/{p}")]);
                        events.iter().any(|e| e.contains("partition_acquired") && e.contains(&taken))
                    });
                    let left = events.iter().any(|e| e.contains("node dash-c left"));
                    Ok((listed && left).then_some((owners, events)))
                },
            )
            .expect("the page shows the partitions moved");
        let shot = b.screenshot("2-partitions-moved").expect("screenshot");
        eprintln!("screenshot: {}", shot.display());
        (b, moved, events)
    })
    .await
    .expect("browser");
    let (b, moved, events) = b;
    let live = c.owners().await;
    for p in &victim {
        let owner = &moved[&format!("relay-in/{p}")];
        assert_eq!(live.get(p).map(|(n, _)| n), Some(owner), "the page shows the lease's owner");
    }
    eprintln!("events on the page: {events:?}");

    // Replay one dead letter by clicking its button.
    let (b, clicked) = tokio::task::spawn_blocking(move || {
        let ids = b
            .wait_for("two dead letters listed", Duration::from_secs(30), |b| {
                let ids = dlq_ids(b)?;
                Ok((ids.len() >= 2).then_some(ids))
            })
            .expect("the DLQ on the page");
        let clicked = ids[0].clone();
        let buttons = b.find_all(&format!("#dlq tbody tr[data-id='{clicked}'] button.replay")).expect("button");
        assert_eq!(buttons.len(), 1, "one replay button for entry {clicked}");
        b.click(&buttons[0]).expect("click replay");
        // Gone from the page, and still gone after the next polls re-read the stream.
        b.wait_for("the replayed entry gone", Duration::from_secs(10), |b| {
            Ok((!dlq_ids(b)?.contains(&clicked)).then_some(()))
        })
        .expect("the entry leaves the list");
        std::thread::sleep(Duration::from_millis(2500));
        assert!(!dlq_ids(&b).expect("ids").contains(&clicked), "the stream no longer holds entry {clicked}");
        let shot = b.screenshot("3-dead-letter-replayed").expect("screenshot");
        eprintln!("screenshot: {}", shot.display());
        (b, clicked)
    })
    .await
    .expect("browser");
    drop(b);
    // The replayed record went back to its partition (it is poison, so it fails its
    // attempts again and comes back as a new entry with a new id).
    let id: u64 = clicked.parse().expect("a numeric id");
    let letters = flotilla_node::dlq::DeadLetters::new(c.broker.clone(), "relay").expect("dlq");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = letters.list(None, None, 100).await.expect("list");
        assert!(now.iter().all(|e| e.id != id), "entry {id} was replayed and deleted");
        if now.iter().any(|e| e.id > 2) {
            break;
        }
        assert!(Instant::now() < deadline, "the replayed record never ran again: {now:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// On a node that collects spans (here: logs them at debug), a record that carries a
/// W3C `traceparent` is processed in a span of its trace: its output carries the same
/// trace id with the `process` span as its parent (so the next task, on any node,
/// continues the trace), and a poison record's dead letter continues it too (a replay
/// starts from there). A record without one starts a trace of its own. (Where nothing
/// collects spans, the header is passed on unchanged: `flotilla_actors::trace`'s tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_continues_from_a_record_to_its_output_and_its_dead_letter() {
    use flotilla_actors::trace::TraceContext;
    use flotilla_tests::relay_cluster::{read_stream, record, record_with};
    use flotilla_transport::wire::headers;
    let mut c = RelayCluster::start(&[]).await;
    // The spans are collected (logged at debug): the node continues traces with its own.
    let env = vec![("FLOTILLA_LOG".to_owned(), "info,flotilla_actors=debug".to_owned())];
    c.add_with("trace-a", Launch { env, ..Launch::default() });
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    let traced = |m: flotilla_transport::broker::OutboundMessage| {
        m.with_header(headers::TRACEPARENT, format!("00-{trace}-{parent}-01"))
    };
    let batch = vec![traced(record(1)), record(2), traced(record_with(3, "poison"))];
    for r in c.broker.publish_batch(batch).await {
        r.expect("published");
    }
    flotilla_tests::wait_count(&c.broker, "FLOTILLA_relay_relay-out", 2, Duration::from_secs(60)).await;
    flotilla_tests::wait_count(&c.broker, "FLOTILLA_relay_DLQ", 1, Duration::from_secs(60)).await;

    let out = read_stream(&c.broker, "FLOTILLA_relay_relay-out").await;
    let by_key: BTreeMap<String, Option<String>> = out
        .iter()
        .map(|(_, h, _, _)| {
            (h.get(headers::KEY).unwrap_or_default().to_owned(), h.get(headers::TRACEPARENT).map(str::to_owned))
        })
        .collect();
    let continued = by_key["1"].as_deref().and_then(TraceContext::parse).expect("record 1's output is traced");
    assert_eq!(format!("{:032x}", continued.trace_id), trace, "the same trace");
    assert_ne!(format!("{:016x}", continued.span_id), parent, "its parent is the process span, not the producer");
    let started =
        by_key["2"].as_deref().and_then(TraceContext::parse).expect("a trace starts where spans are collected");
    assert_ne!(started.trace_id, continued.trace_id, "a trace of its own");

    let dead = read_stream(&c.broker, "FLOTILLA_relay_DLQ").await;
    let letter = dead[0].1.get(headers::TRACEPARENT).and_then(TraceContext::parse).expect("the dead letter is traced");
    assert_eq!(format!("{:032x}", letter.trace_id), trace);
    assert_ne!(letter.span_id, continued.span_id);
}
