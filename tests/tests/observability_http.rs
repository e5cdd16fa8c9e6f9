//! The node's HTTP endpoint (`--http`) against what a hostile page or client does, with
//! real relay nodes on a real nats-server and raw TCP clients: a foreign `Host` (DNS
//! rebinding) is refused; replays need the token, and reads too once one is set; a
//! client that sends its request slowly, or nothing, is cut off while others are
//! served; a flood of connections holds no more descriptors than the cap; the
//! dead-letter listing is bounded and pages.
//!
//! Assertions marked SAFETY say what a refused caller must never get (data or a
//! replay); LIVENESS ones are about time (a slow client cut off, a request served).

use flotilla_tests::free_port;
use flotilla_tests::relay_cluster::{Launch, RelayCluster, tail};
use flotilla_transport::broker::OutboundMessage;
use flotilla_transport::wire::headers;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// A response read off a raw connection.
#[derive(Debug)]
struct Reply {
    status: u16,
    head: String,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

fn connect(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap_or_else(|e| panic!("connect to 127.0.0.1:{port}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("read timeout");
    s
}

/// Reads one response (headers, then a body of `Content-Length` bytes).
fn read_reply(s: &mut TcpStream) -> Reply {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = s.read(&mut chunk).unwrap_or_else(|e| panic!("reading a response: {e}"));
        assert!(n > 0, "the connection closed before a response: {:?}", String::from_utf8_lossy(&buf));
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{head}"));
    let mut reply = Reply { status, head, body: String::new() };
    let length: usize = reply.header("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
    while buf.len() < head_end + length {
        let n = s.read(&mut chunk).unwrap_or_else(|e| panic!("reading a body: {e}"));
        assert!(n > 0, "the connection closed inside a body");
        buf.extend_from_slice(&chunk[..n]);
    }
    reply.body = String::from_utf8_lossy(&buf[head_end..head_end + length]).into_owned();
    reply
}

/// One request on a connection of its own, with `Host: host` and extra header lines.
fn request(port: u16, method: &str, path: &str, host: &str, extra: &[&str]) -> Reply {
    let mut s = connect(port);
    let mut text = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: 0\r\n");
    for line in extra {
        text.push_str(line);
        text.push_str("\r\n");
    }
    text.push_str("\r\n");
    s.write_all(text.as_bytes()).expect("send a request");
    read_reply(&mut s)
}

fn get(port: u16, path: &str, extra: &[&str]) -> Reply {
    request(port, "GET", path, &format!("127.0.0.1:{port}"), extra)
}

/// Whether the server closed `s` within `within` (EOF or a reset), and when.
fn closed_within(s: &mut TcpStream, within: Duration) -> Option<Duration> {
    let start = Instant::now();
    s.set_read_timeout(Some(within)).expect("read timeout");
    let mut sink = [0u8; 1024];
    loop {
        match s.read(&mut sink) {
            Ok(0) => return Some(start.elapsed()),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return None,
            Err(_) => return Some(start.elapsed()),
        }
        if start.elapsed() > within {
            return None;
        }
    }
}

fn http_args(port: u16, more: &[&str]) -> Launch {
    let mut args = vec!["--http".to_owned(), format!("127.0.0.1:{port}")];
    args.extend(more.iter().map(|a| (*a).to_owned()));
    Launch { args, ..Launch::default() }
}

async fn serving(c: &RelayCluster, id: &str) {
    c.wait_log(id, "dashboard and metrics", Duration::from_secs(30)).await;
}

/// A page served from another name (DNS rebinding: `evil.example` resolving to the
/// node) is refused whatever it asks for; the bound address, `localhost` on a loopback
/// bind and the names given with `--http-host` are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_for_another_host_are_refused() {
    let mut c = RelayCluster::start(&[]).await;
    let port = free_port();
    c.add_with("host-a", http_args(port, &["--http-host", "dash.example"]));
    serving(&c, "host-a").await;
    tokio::task::spawn_blocking(move || {
        for host in [
            format!("evil.example:{port}"),
            "evil.example".to_owned(),
            format!("127.0.0.1.evil.example:{port}"),
            format!("localhost.evil.example:{port}"),
            format!("127.0.0.1:{}", port.wrapping_add(1)),
            String::new(),
        ] {
            for path in ["/api/dlq", "/api/status", "/metrics", "/", "/healthz"] {
                let r = request(port, "GET", path, &host, &[]);
                assert_eq!(r.status, 403, "SAFETY: GET {path} with Host {host:?} is refused: {r:?}");
                assert!(r.body.contains("--http-host"), "the refusal says what to configure: {}", r.body);
            }
            let r = request(port, "POST", "/api/dlq/1/replay", &host, &["x-flotilla-request: replay"]);
            assert_eq!(r.status, 403, "SAFETY: a replay with Host {host:?} is refused: {r:?}");
        }
        // No Host at all (HTTP/1.0).
        let mut s = connect(port);
        s.write_all(b"GET /api/node HTTP/1.0\r\n\r\n").expect("send");
        assert_eq!(read_reply(&mut s).status, 403, "SAFETY: a request without Host is refused");

        for host in [
            format!("127.0.0.1:{port}"),
            format!("localhost:{port}"),
            format!("LocalHost:{port}"),
            "dash.example".to_owned(),
            "dash.example:8443".to_owned(),
        ] {
            let r = request(port, "GET", "/api/node", &host, &[]);
            assert_eq!(r.status, 200, "Host {host:?} is served: {r:?}");
        }
    })
    .await
    .expect("requests");
}

/// Replays need the token, always: a node without one refuses them and says how to
/// set one; a node with one (here from a file) refuses a missing or wrong token, for
/// replays and for every read but the page and `/healthz`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_need_the_token_and_so_do_reads_once_one_is_set() {
    let mut c = RelayCluster::start(&[]).await;
    let (with, without) = (free_port(), free_port());
    let file = c.dir.path().join("http-token");
    std::fs::write(&file, "  s3cret-token-for-tests\n").expect("token file");
    let file = file.display().to_string();
    c.add_with("tok-a", http_args(with, &["--http-token-file", &file]));
    c.add_with("open-b", http_args(without, &[]));
    serving(&c, "tok-a").await;
    serving(&c, "open-b").await;
    let out = c.relay_cmd(&["publish", "--count", "10", "--poison", "2"]);
    assert!(out.status.success(), "publish: {}", String::from_utf8_lossy(&out.stderr));
    flotilla_tests::wait_count(&c.broker, "FLOTILLA_relay_DLQ", 2, Duration::from_secs(60)).await;
    let letters = flotilla_node::dlq::DeadLetters::new(c.broker.clone(), "relay").expect("dlq");
    let ids: Vec<u64> = letters.list(None, None, 10).await.expect("list").iter().map(|e| e.id).collect();
    assert_eq!(ids.len(), 2, "{ids:?}");

    let (first, second) = (ids[0], ids[1]);
    tokio::task::spawn_blocking(move || {
        let replay = |port: u16, id: u64, extra: &[&str]| {
            request(port, "POST", &format!("/api/dlq/{id}/replay"), &format!("127.0.0.1:{port}"), extra)
        };
        // Without a token configured, reads stay open and replays are refused.
        assert_eq!(get(without, "/api/dlq", &[]).status, 200, "reads without a token configured");
        let r = replay(without, first, &["x-flotilla-request: replay"]);
        assert_eq!(r.status, 401, "SAFETY: no replay on a node without a token: {r:?}");
        assert!(r.body.contains("--http-token"), "says how to set one: {}", r.body);

        // With one: every read but the page and /healthz needs it.
        let good = "Authorization: Bearer s3cret-token-for-tests";
        for path in ["/api/status", "/api/dlq", "/api/events", "/api/node", "/metrics"] {
            for extra in [&[][..], &["Authorization: Bearer wrong"][..], &["Authorization: Basic czNjcmV0"][..]] {
                let r = get(with, path, extra);
                assert_eq!(r.status, 401, "SAFETY: GET {path} with {extra:?} is refused: {r:?}");
                assert!(r.header("www-authenticate").is_some_and(|v| v.starts_with("Bearer")), "{r:?}");
                assert!(!r.body.contains("max-attempts") && !r.body.contains("flotilla_"), "SAFETY: no data: {r:?}");
            }
            assert_eq!(get(with, path, &[good]).status, 200, "GET {path} with the token");
        }
        for path in ["/healthz", "/", "/app.js", "/style.css"] {
            assert_eq!(get(with, path, &[]).status, 200, "{path} needs no token (it holds no job data)");
        }
        for extra in
            [&[][..], &["Authorization: Bearer wrong"][..], &["Authorization: Bearer s3cret-token-for-test"][..]]
        {
            let r = replay(with, first, extra);
            assert_eq!(r.status, 401, "SAFETY: a replay with {extra:?} is refused: {r:?}");
        }
        let r = replay(with, second, &[good]);
        assert_eq!(r.status, 200, "a replay with the token: {r:?}");
    })
    .await
    .expect("requests");
    let left: Vec<u64> = letters.list(None, None, 10).await.expect("list").iter().map(|e| e.id).collect();
    assert!(left.contains(&first), "SAFETY: the refused replays replayed nothing: {left:?}");
    assert!(!left.contains(&second), "the replay with the token went through: {left:?}");

    // An empty token file is a mistake: the node says so and does not start.
    let empty = c.dir.path().join("empty-token");
    std::fs::write(&empty, " \n").expect("token file");
    c.add_with("empty-c", http_args(free_port(), &["--http-token-file", &empty.display().to_string()]));
    let status = c.wait_exit_async("empty-c", Duration::from_secs(30)).await;
    assert!(!status.success());
    let log = c.log_text("empty-c");
    assert!(log.contains("http token file") && log.contains("empty"), "{}", tail(&log, 20));
}

/// A client that sends half a request line and then nothing is cut off after the
/// header timeout (5 s), and so is an idle keep-alive connection; a normal request
/// is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_is_cut_off_while_others_are_served() {
    let mut c = RelayCluster::start(&[]).await;
    let port = free_port();
    c.add_with("slow-a", http_args(port, &[]));
    serving(&c, "slow-a").await;
    tokio::task::spawn_blocking(move || {
        let start = Instant::now();
        let mut slow = connect(port);
        slow.write_all(b"GET /api/node HT").expect("half a request line");
        let mut idle = connect(port);
        idle.write_all(format!("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes()).expect("send");
        assert_eq!(read_reply(&mut idle).status, 200, "a keep-alive request");
        let r = get(port, "/api/node", &[]);
        assert_eq!(r.status, 200, "LIVENESS: a normal request is served while a slow one dawdles: {r:?}");
        let cut = closed_within(&mut slow, Duration::from_secs(15)).map(|_| start.elapsed());
        assert!(cut.is_some(), "LIVENESS: the slow client was still connected 15 s later");
        let idle_cut = closed_within(&mut idle, Duration::from_secs(15)).map(|_| start.elapsed());
        assert!(idle_cut.is_some(), "LIVENESS: the idle keep-alive connection was still open 15 s later");
        for at in [cut, idle_cut].into_iter().flatten() {
            assert!(at >= Duration::from_secs(4), "cut by the 5 s timeout, not at once: {at:?}");
        }
        eprintln!("from the start: slow client cut after {cut:?}, idle keep-alive connection after {idle_cut:?}");
    })
    .await
    .expect("clients");
}

/// The sockets node `pid` holds open.
fn sockets(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.filter_map(Result::ok)
                .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with("socket:")))
                .count()
        })
        .unwrap_or(0)
}

/// 100 connections that send nothing: the node holds at most its cap of them (64),
/// the rest wait in the listen queue holding none of its descriptors, and a normal
/// request is still served once the idle ones are cut off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_idle_connections_holds_no_more_than_the_cap() {
    let mut c = RelayCluster::start(&[]).await;
    let port = free_port();
    c.add_with("flood-a", http_args(port, &[]));
    serving(&c, "flood-a").await;
    let pid = c.nodes["flood-a"].pid().expect("pid");
    let before = sockets(pid);
    let served = tokio::task::spawn_blocking(move || {
        let flood: Vec<TcpStream> = (0..100).filter_map(|_| TcpStream::connect(("127.0.0.1", port)).ok()).collect();
        assert_eq!(flood.len(), 100, "the listen queue takes them all");
        std::thread::sleep(Duration::from_millis(1500));
        let held = sockets(pid);
        assert!(
            held <= before + 64,
            "LIVENESS: the node holds {held} sockets with 100 idle clients ({before} before): at most 64 more"
        );
        let start = Instant::now();
        let r = get(port, "/api/node", &[]);
        assert_eq!(r.status, 200, "LIVENESS: a normal request is served behind the flood: {r:?}");
        let waited = start.elapsed();
        drop(flood);
        (held - before, waited)
    })
    .await
    .expect("clients");
    eprintln!("HTTP connections held during the flood: {}; a normal request waited {:?}", served.0, served.1);
    let (code, body) = {
        let r = tokio::task::spawn_blocking(move || get(port, "/api/status", &[])).await.expect("status");
        (r.status, r.body)
    };
    assert_eq!(code, 200, "the node still answers for the job: {body}");
}

fn dead_letter(n: u64) -> OutboundMessage {
    let reason = if n.is_multiple_of(2) { "max-attempts" } else { "handler" };
    OutboundMessage::new("flotilla.relay._dlq.relay-in", vec![b'x'; 1024])
        .with_id(format!("test-dlq-{n}"))
        .with_header(headers::KEY, n.to_string())
        .with_header(headers::DLQ_REASON, reason)
        .with_header(headers::DLQ_DETAIL, "a test entry")
        .with_header(headers::DLQ_SUBJECT, "flotilla.relay.relay-in.0")
        .with_header(headers::DLQ_ATTEMPTS, "3")
}

fn ids(r: &Reply) -> Vec<u64> {
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("{e}: {r:?}"));
    v.as_array().map(|a| a.iter().filter_map(|e| e["id"].as_u64()).collect()).unwrap_or_default()
}

/// `/api/dlq` lists 50 entries unless asked for fewer, at most 100, and says where the
/// next page starts (`x-flotilla-dlq-next`, for `?after=`); deleted entries and
/// filters are skipped by the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letter_listing_is_bounded_and_pages() {
    let mut c = RelayCluster::start(&[]).await;
    let port = free_port();
    c.add_with("dlq-a", http_args(port, &[]));
    serving(&c, "dlq-a").await;
    for r in c.broker.publish_batch((1..=130).map(dead_letter).collect()).await {
        r.expect("a dead letter stored");
    }
    for seq in 1..=10 {
        assert!(c.broker.delete_message("FLOTILLA_relay_DLQ", seq).await.expect("delete"));
    }
    tokio::task::spawn_blocking(move || {
        let r = get(port, "/api/dlq", &[]);
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(ids(&r), (11..=60).collect::<Vec<_>>(), "50 by default, oldest first, past the deleted ones");
        assert_eq!(r.header("x-flotilla-dlq-next"), Some("60"), "{r:?}");
        assert!(!r.body.contains("\"payload\""), "a listing holds no payloads: {}", tail(&r.body, 3));
        let r = get(port, "/api/dlq?limit=1000", &[]);
        assert_eq!(ids(&r), (11..=110).collect::<Vec<_>>(), "at most 100");
        assert_eq!(r.header("x-flotilla-dlq-next"), Some("110"), "{r:?}");
        let r = get(port, "/api/dlq?limit=1000&after=110", &[]);
        assert_eq!(ids(&r), (111..=130).collect::<Vec<_>>(), "the last page");
        assert_eq!(r.header("x-flotilla-dlq-next"), None, "nothing after the last page: {r:?}");
        let r = get(port, "/api/dlq?reason=handler&limit=5", &[]);
        assert_eq!(ids(&r), vec![11, 13, 15, 17, 19], "filtered by reason");
        let r = get(port, "/api/dlq?stream=relay-in&limit=3", &[]);
        assert_eq!(ids(&r), vec![11, 12, 13], "filtered by stream");
        assert_eq!(ids(&get(port, "/api/dlq?stream=other", &[])), Vec::<u64>::new());
        let r = get(port, "/api/dlq?stream=a.%3E", &[]);
        assert_eq!(r.status, 400, "not a stream name: {r:?}");
    })
    .await
    .expect("requests");
}
