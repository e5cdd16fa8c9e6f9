//! Connection cuts under load: two `relay` nodes reach nats-server through a
//! [`FaultProxy`] that cuts all their connections at seeded random moments while records
//! are published (straight to the server) and processed. Afterwards relay-out must
//! hold every record exactly once — nothing lost, nothing stored twice.
//!
//! Environment:
//! * `FLOTILLA_FAULT_SEED` (default [`DEFAULT_SEED`]): the cut schedule; printed at the
//!   start and on failure, so a failing schedule can be replayed;
//! * `FLOTILLA_FAULT_RUNS` (default 1): repeat the scenario with seeds seed, seed+1, …
//!   (a soak run); every run is reported, then the test fails if any run did;
//! * `FLOTILLA_FAULT_CUTS` (default 10): the least number of cuts per run;
//! * `FLOTILLA_FAULT_GAP_MS` (default `300-900`): the range of the pause before each cut;
//! * `FLOTILLA_FAULT_RECORDS` (default 20000): records published per run;
//! * `FLOTILLA_TEST_LOGS=DIR` keeps the nodes' logs there;
//! * `FLOTILLA_RELAY_BIN=PATH` runs that relay binary instead of building the example
//!   (to try another build, e.g. an older commit, against the same schedule).
//!
//! Every wait is bounded and every process is killed by PID when the run ends
//! ([`ProcessGuard`], [`NatsServer`]).
//!
//! CI retries a failed test here once. A record stored twice, or missing once the
//! input has acknowledged everything, is a `safety!` failure, which fails CI even when
//! the retry passes; records still missing while the input holds work when the wait
//! runs out are a `LIVENESS:` failure, which a retry may pass (`flotilla_tests::safety`).

use flotilla_tests::fault_proxy::FaultProxy;
use flotilla_tests::relay_cluster::tail;
use flotilla_tests::{NatsServer, ProcessGuard, Record, example_bin, liveness, safety};
use flotilla_transport::broker::{AckPolicy, ConsumerSpec, OutboundMessage, SharedBroker};
use flotilla_transport::clock::unix_millis;
use flotilla_transport::wire::{Codec, headers, partition_for};
use flotilla_transport::{JetStreamBroker, JetStreamOptions};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

const DEFAULT_SEED: u64 = 0x00F1_07AA_5EED;
const PARTITIONS: u32 = 8;
const NODES: [&str; 2] = ["a", "b"];
/// How long relay-out may take to hold everything once publishing is done.
const SETTLE: Duration = Duration::from_secs(90);
/// Give up early when relay-out has not grown for this long after the cuts ended
/// (longer than two ack-waits, so redeliveries had their chance).
const STALL: Duration = Duration::from_secs(25);

/// Ordered (`relay-in` → `relay-out`, a consumer per partition) or queue
/// (`relay-jobs` → `relay-done`, one shared consumer) input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Ordered,
    Queue,
}

impl Mode {
    fn input(self) -> &'static str {
        match self {
            Mode::Ordered => "relay-in",
            Mode::Queue => "relay-jobs",
        }
    }

    fn in_stream(self) -> String {
        format!("FLOTILLA_relay_{}", self.input())
    }

    fn out_stream(self) -> &'static str {
        match self {
            Mode::Ordered => "FLOTILLA_relay_relay-out",
            Mode::Queue => "FLOTILLA_relay_relay-done",
        }
    }

    fn consumers(self) -> Vec<String> {
        match self {
            Mode::Ordered => (0..PARTITIONS).map(|p| format!("relay-in-p{p}")).collect(),
            Mode::Queue => vec!["relay-jobs-workers".to_owned()],
        }
    }

    /// Relay flags of this mode.
    fn flags(self) -> &'static [&'static str] {
        match self {
            Mode::Ordered => &[],
            Mode::Queue => &["--queue"],
        }
    }

    /// A record as the relay's own publisher writes it, with a deterministic message id.
    fn record(self, id: u64) -> OutboundMessage {
        let key = id.to_string();
        let payload = Codec::default().encode(&Record { id, body: format!("record {id}") }).expect("encode");
        let subject = match self {
            Mode::Ordered => format!("flotilla.relay.relay-in.{}", partition_for(&key, PARTITIONS)),
            Mode::Queue => "flotilla.relay.relay-jobs".to_owned(),
        };
        OutboundMessage::new(subject, payload)
            .with_id(format!("in-{id}"))
            .with_header(headers::KEY, key)
            .with_header(headers::TYPE, "Record")
            .with_header(headers::SENT, unix_millis(SystemTime::now()).to_string())
    }
}

/// A small deterministic generator (xorshift64*): the cut schedule of a seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        // Never zero (xorshift's fixed point), and nearby seeds diverge at once.
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..=hi`.
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => {
            let v = v.trim();
            let parsed = match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => v.parse(),
            };
            parsed.unwrap_or_else(|e| panic!("{name}={v:?}: {e}"))
        }
        Err(_) => default,
    }
}

/// The pause before each cut, from `FLOTILLA_FAULT_GAP_MS=LO-HI`.
fn gap_ms() -> (u64, u64) {
    let text = std::env::var("FLOTILLA_FAULT_GAP_MS").unwrap_or_else(|_| "300-900".to_owned());
    let parse = |s: &str| s.trim().parse::<u64>().ok();
    match text.split_once('-').map(|(lo, hi)| (parse(lo), parse(hi))) {
        Some((Some(lo), Some(hi))) if lo <= hi => (lo, hi),
        _ => panic!("FLOTILLA_FAULT_GAP_MS={text:?}: write LO-HI in milliseconds, e.g. 300-900"),
    }
}

/// Cuts every connection through the proxy at seeded random moments until stopped.
struct Chaos {
    stop: Arc<AtomicBool>,
    cuts: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<usize>>,
}

impl Chaos {
    fn start(proxy: Arc<FaultProxy>, seed: u64, (lo, hi): (u64, u64)) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let cuts = Arc::new(AtomicUsize::new(0));
        let (s, c) = (stop.clone(), cuts.clone());
        let thread = std::thread::spawn(move || {
            let mut rng = Rng::new(seed);
            let mut connections_cut = 0;
            while !s.load(Ordering::SeqCst) {
                let until = Instant::now() + Duration::from_millis(rng.between(lo, hi));
                while Instant::now() < until && !s.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                if s.load(Ordering::SeqCst) {
                    break;
                }
                connections_cut += proxy.cut_all();
                c.fetch_add(1, Ordering::SeqCst);
            }
            connections_cut
        });
        Self { stop, cuts, thread: Some(thread) }
    }

    fn cuts(&self) -> usize {
        self.cuts.load(Ordering::SeqCst)
    }

    /// Stops cutting; (cuts, connections cut).
    fn stop(mut self) -> (usize, usize) {
        self.stop.store(true, Ordering::SeqCst);
        let cut = self.thread.take().map(|t| t.join().expect("chaos thread")).unwrap_or(0);
        (self.cuts(), cut)
    }
}

impl Drop for Chaos {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// One run: a nats-server, a proxy in front of it, two relay nodes behind the proxy.
struct Run {
    mode: Mode,
    bin: PathBuf,
    server: NatsServer,
    proxy: Arc<FaultProxy>,
    dir: tempfile::TempDir,
    nodes: BTreeMap<String, ProcessGuard>,
    broker: SharedBroker,
}

/// What a run saw.
#[derive(Debug)]
struct Outcome {
    seed: u64,
    published: u64,
    cuts: usize,
    connections_cut: usize,
    stored: usize,
    unique: usize,
    missing: usize,
    duplicates: usize,
    took: Duration,
    report: String,
    /// A safety failure (records stored twice or unknown, or missing though the input
    /// acknowledged everything), not only a late one.
    unsafe_outcome: bool,
}

impl Run {
    async fn start(mode: Mode, seed: u64, bin: &Path) -> Self {
        let server = NatsServer::start();
        let proxy = Arc::new(FaultProxy::start(([127, 0, 0, 1], server.port()).into()));
        let broker = JetStreamBroker::connect(JetStreamOptions::new(server.url())).await.expect("connect").shared();
        let dir = match std::env::var_os("FLOTILLA_TEST_LOGS") {
            Some(root) => {
                std::fs::create_dir_all(&root).expect("log dir");
                tempfile::Builder::new()
                    .prefix(&format!("fault-{mode:?}-{seed}-"))
                    .disable_cleanup(true)
                    .tempdir_in(root)
                    .expect("log dir")
            }
            None => tempfile::tempdir().expect("tmp"),
        };
        let mut run = Self { mode, bin: bin.to_owned(), server, proxy, dir, nodes: BTreeMap::new(), broker };
        // Provision the streams first, straight to the server, as an operator would.
        let out = Command::new(&run.bin)
            .args(["--nats", &run.server.url()])
            .args(mode.flags())
            .args(["publish", "--count", "0"])
            .env("FLOTILLA_LOG", "warn")
            .output()
            .expect("relay publish");
        assert!(out.status.success(), "provisioning failed: {}", String::from_utf8_lossy(&out.stderr));
        for id in NODES {
            run.add(id);
        }
        run
    }

    fn log(&self, id: &str) -> PathBuf {
        self.dir.path().join(format!("{id}.log"))
    }

    fn logs(&self, lines: usize) -> String {
        NODES
            .iter()
            .map(|id| {
                let text = std::fs::read_to_string(self.log(id)).unwrap_or_default();
                format!("\n----- node {id} (last {lines} lines) -----\n{}", tail(&text, lines))
            })
            .collect()
    }

    /// Starts node `id` connecting through the proxy (its output into its log).
    fn add(&mut self, id: &str) {
        let log = std::fs::File::create(self.log(id)).expect("log file");
        let err = log.try_clone().expect("log file");
        let mut cmd = if Path::new("/usr/bin/setpriv").is_file() {
            let mut c = Command::new("/usr/bin/setpriv");
            c.args(["--pdeathsig", "KILL", "--"]).arg(&self.bin);
            c
        } else {
            Command::new(&self.bin)
        };
        cmd.args(["--nats", &self.proxy.url(), "--node-id", id, "--lease-ttl", "3s", "--ack-wait", "10s"])
            .args(self.mode.flags())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .env("FLOTILLA_LOG", "info")
            .env("RUST_BACKTRACE", "0");
        self.nodes.insert(id.to_owned(), ProcessGuard::spawn(format!("relay {id}"), &mut cmd));
    }

    /// Waits until both nodes are members and, for ordered input, every partition is held.
    async fn wait_ready(&mut self, within: Duration) {
        let start = Instant::now();
        loop {
            let members = self.broker.kv_keys("FLOTILLA_relay_NODES").await.unwrap_or_default();
            let mut held = 0;
            if self.mode == Mode::Ordered {
                for p in 0..PARTITIONS {
                    if let Ok(Some(_)) = self.broker.kv_get("FLOTILLA_relay_LEASES", &format!("relay-in.{p}")).await {
                        held += 1;
                    }
                }
            }
            let partitions_ready = self.mode == Mode::Queue || held == PARTITIONS;
            if NODES.iter().all(|n| members.iter().any(|m| m == n)) && partitions_ready {
                return;
            }
            let exited: Vec<String> = self
                .nodes
                .iter_mut()
                .filter_map(|(id, node)| node.wait_timeout(Duration::from_millis(5)).map(|st| format!("{id} ({st})")))
                .collect();
            assert!(exited.is_empty(), "node(s) exited at start: {exited:?}{}", self.logs(40));
            liveness!(
                start.elapsed() < within,
                "nodes not ready within {within:?}: members {members:?}, {held} partitions held{}",
                self.logs(40)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Publishes records `0..count` straight to the server in batches of `batch`, one
    /// batch every `every`, retrying a batch that fails (ids make retries idempotent).
    async fn publish(&self, count: u64, batch: u64, every: Duration) {
        let mut from = 0;
        while from < count {
            let to = (from + batch).min(count);
            let mut tries = 0;
            loop {
                let acks = self.broker.publish_batch((from..to).map(|id| self.mode.record(id)).collect()).await;
                let failed: Vec<String> = acks.iter().filter_map(|a| a.as_ref().err().map(|e| e.to_string())).collect();
                if failed.is_empty() {
                    break;
                }
                tries += 1;
                assert!(tries < 5, "publishing {from}..{to} failed {tries} times: {:?}", &failed[..1]);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            from = to;
            tokio::time::sleep(every).await;
        }
    }

    /// Every message of a stream through a fresh consumer: (stream seq, record id).
    async fn read_ids(&self, stream: &str) -> Vec<(u64, Option<u64>)> {
        let name = format!("check{}", flotilla_transport::wire::MessageId::new_v7().as_str().replace('-', ""));
        let spec =
            ConsumerSpec { ack_policy: AckPolicy::Explicit, max_ack_pending: None, ..ConsumerSpec::new(name.clone()) };
        self.broker.ensure_consumer(stream, spec).await.expect("checker consumer");
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let got = self.broker.claim(stream, &name, 1000, Duration::from_millis(300)).await.expect("claim");
            if got.is_empty() {
                break;
            }
            for d in got {
                out.push((d.info.stream_seq, Codec::default().decode::<Record>(&d.payload).ok().map(|r| r.id)));
            }
            liveness!(Instant::now() < deadline, "reading {stream} takes over a minute");
        }
        let _ = self.broker.delete_consumer(stream, &name).await;
        out
    }

    /// The input consumers with messages pending or unacknowledged (empty: all done).
    async fn input_open(&self) -> Vec<String> {
        let input = self.mode.in_stream();
        let mut open = Vec::new();
        for consumer in self.mode.consumers() {
            match self.broker.consumer_state(&input, &consumer).await {
                Ok(c) if c.num_pending == 0 && c.num_ack_pending == 0 => {}
                Ok(c) => open.push(format!("{consumer}: {} pending, {} unacked", c.num_pending, c.num_ack_pending)),
                Err(e) => open.push(format!("{consumer}: {e}")),
            }
        }
        open
    }

    async fn stored(&self) -> u64 {
        self.broker.stream_state(self.mode.out_stream()).await.map(|s| s.messages).unwrap_or(0)
    }

    /// What a failure needs: the input consumers' state, where the missing records sit,
    /// and the tails of the nodes' logs.
    async fn diagnose(&self, missing: &[u64]) -> String {
        let mut text = String::new();
        let input = self.mode.in_stream();
        if let Ok(s) = self.broker.stream_state(&input).await {
            text += &format!("\n{input}: {} messages, seq {}..={}", s.messages, s.first_seq, s.last_seq);
        }
        for consumer in self.mode.consumers() {
            match self.broker.consumer_state(&input, &consumer).await {
                Ok(c) => {
                    text += &format!(
                        "\n  {consumer}: ack_floor {}, delivered {}, num_ack_pending {}, num_pending {}, num_redelivered {}",
                        c.ack_floor, c.delivered, c.num_ack_pending, c.num_pending, c.num_redelivered
                    );
                }
                Err(e) => text += &format!("\n  {consumer}: {e}"),
            }
        }
        if !missing.is_empty() {
            // Where the first missing records are in the input (a work queue forgets acked ones).
            let seqs: BTreeMap<u64, u64> =
                self.read_ids(&input).await.into_iter().filter_map(|(seq, id)| id.map(|id| (id, seq))).collect();
            let first: Vec<String> = missing
                .iter()
                .take(20)
                .map(|id| {
                    let p = partition_for(&id.to_string(), PARTITIONS);
                    match seqs.get(id) {
                        Some(seq) => format!("{id} (p{p}, seq {seq})"),
                        None => format!("{id} (p{p}, not in the input any more)"),
                    }
                })
                .collect();
            text += &format!("\nfirst missing: {}", first.join(", "));
            let mut per_partition: BTreeMap<u32, usize> = BTreeMap::new();
            for id in missing {
                *per_partition.entry(partition_for(&id.to_string(), PARTITIONS)).or_default() += 1;
            }
            text += &format!("\nmissing per partition: {per_partition:?}");
        }
        for (id, node) in &self.nodes {
            if let Some(pid) = node.pid() {
                text += &format!("\nnode {id}: pid {pid}");
            }
        }
        text + &self.logs(40)
    }

    /// Asks every node to stop (SIGTERM) and collects their summary lines.
    fn stop_nodes(&mut self) -> Vec<String> {
        for node in self.nodes.values() {
            node.signal("TERM");
        }
        for node in self.nodes.values_mut() {
            if node.wait_timeout(Duration::from_secs(15)).is_none() {
                node.kill();
            }
        }
        NODES
            .iter()
            .filter_map(|id| {
                let text = std::fs::read_to_string(self.log(id)).unwrap_or_default();
                text.lines().find(|l| l.starts_with(&format!("relay node {id}:"))).map(str::to_owned)
            })
            .collect()
    }
}

/// One scenario: publish `count` records while the connections of the nodes are cut.
async fn scenario(mode: Mode, seed: u64, bin: &Path) -> Outcome {
    let count = env_u64("FLOTILLA_FAULT_RECORDS", 20_000);
    let min_cuts = env_u64("FLOTILLA_FAULT_CUTS", 10) as usize;
    let gaps = gap_ms();
    eprintln!(
        "== {mode:?} input, FLOTILLA_FAULT_SEED={seed}: {count} records, at least {min_cuts} cuts {}-{} ms apart",
        gaps.0, gaps.1
    );
    let started = Instant::now();
    let mut run = Run::start(mode, seed, bin).await;
    run.wait_ready(Duration::from_secs(40)).await;
    eprintln!(
        "   nodes ready after {:.1?}; {} connections through the proxy",
        started.elapsed(),
        run.proxy.connections()
    );

    let chaos = Chaos::start(run.proxy.clone(), seed, gaps);
    // About 2500 records/s, so the cuts land while publishing and processing.
    run.publish(count, 250, Duration::from_millis(100)).await;
    eprintln!("   published {count} in {:.1?} ({} cuts so far)", started.elapsed(), chaos.cuts());
    // Keep cutting until the minimum is reached and a first part of the backlog is done.
    let cut_deadline = Instant::now() + Duration::from_secs(30);
    while (chaos.cuts() < min_cuts || run.stored().await < count / 2) && Instant::now() < cut_deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (cuts, connections_cut) = chaos.stop();
    eprintln!(
        "   cuts over after {:.1?}: {cuts} cuts, {connections_cut} connections cut, relay-out holds {}",
        started.elapsed(),
        run.stored().await
    );

    // Bounded: all there, or no progress for STALL, or SETTLE passed.
    let wait_start = Instant::now();
    let (mut last, mut last_change) = (run.stored().await, Instant::now());
    while last < count && wait_start.elapsed() < SETTLE && last_change.elapsed() < STALL {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = run.stored().await;
        if now != last {
            (last, last_change) = (now, Instant::now());
        }
    }
    if last < count {
        eprintln!("   relay-out stopped at {last} of {count} ({:.1?} after the cuts)", wait_start.elapsed());
    }
    // Each record once: by the record id in the payload, over every stored message.
    let out = run.read_ids(mode.out_stream()).await;
    let mut seen: BTreeMap<u64, usize> = BTreeMap::new();
    for id in out.iter().filter_map(|(_, id)| *id) {
        *seen.entry(id).or_default() += 1;
    }
    let unreadable = out.iter().filter(|(_, id)| id.is_none()).count();
    let missing: Vec<u64> = (0..count).filter(|i| !seen.contains_key(i)).collect();
    let duplicates = seen.values().map(|n| n - 1).sum::<usize>() + unreadable;
    let strays: BTreeSet<u64> = seen.keys().copied().filter(|id| *id >= count).collect();
    // Missing while the input has acknowledged everything is a loss (outputs are stored
    // before their input is acknowledged); while it still holds work, only late.
    let input_open = if missing.is_empty() { Vec::new() } else { run.input_open().await };
    let unsafe_outcome = duplicates > 0 || !strays.is_empty() || (!missing.is_empty() && input_open.is_empty());
    let report = if missing.is_empty() && duplicates == 0 && strays.is_empty() {
        String::new()
    } else {
        format!(
            "FLOTILLA_FAULT_SEED={seed} ({mode:?}): {} missing, {duplicates} duplicates ({unreadable} unreadable), \
             {} unknown ids, {} of {count} stored; input not done: {input_open:?}{}",
            missing.len(),
            strays.len(),
            out.len(),
            run.diagnose(&missing).await
        )
    };
    let summaries = run.stop_nodes();
    let outcome = Outcome {
        seed,
        published: count,
        cuts,
        connections_cut,
        stored: out.len(),
        unique: seen.len(),
        missing: missing.len(),
        duplicates,
        took: started.elapsed(),
        report,
        unsafe_outcome,
    };
    eprintln!(
        "   seed {seed}: {} stored, {} unique, {} missing, {} duplicates, {cuts} cuts, in {:.1?}",
        outcome.stored, outcome.unique, outcome.missing, outcome.duplicates, outcome.took
    );
    for line in summaries {
        eprintln!("   {line}");
    }
    if !outcome.report.is_empty() {
        eprintln!("{}", outcome.report);
    }
    outcome
}

/// Runs the scenario `FLOTILLA_FAULT_RUNS` times and fails when any run lost or
/// duplicated a record.
async fn soak(mode: Mode) {
    let seed = env_u64("FLOTILLA_FAULT_SEED", DEFAULT_SEED);
    let runs = env_u64("FLOTILLA_FAULT_RUNS", 1).max(1);
    eprintln!("fault seed {seed} ({runs} run(s); FLOTILLA_FAULT_SEED={seed} replays this schedule)");
    let bin = std::env::var_os("FLOTILLA_RELAY_BIN").map_or_else(|| example_bin("relay"), PathBuf::from);
    let mut outcomes = Vec::new();
    for i in 0..runs {
        outcomes.push(scenario(mode, seed.wrapping_add(i), &bin).await);
    }
    let summary: Vec<String> = outcomes
        .iter()
        .map(|o| {
            format!(
                "seed {}: {} missing, {} duplicates of {} ({} cuts, {} connections cut, {:.0?})",
                o.seed, o.missing, o.duplicates, o.published, o.cuts, o.connections_cut, o.took
            )
        })
        .collect();
    eprintln!("{mode:?} summary:\n  {}", summary.join("\n  "));
    for o in &outcomes {
        assert!(o.cuts >= env_u64("FLOTILLA_FAULT_CUTS", 10) as usize, "seed {}: only {} cuts", o.seed, o.cuts);
    }
    // Each failed run printed its consumers and logs above; the first line says what.
    let first_lines = |unsafe_outcome: bool| -> Vec<&str> {
        outcomes
            .iter()
            .filter(|o| !o.report.is_empty() && o.unsafe_outcome == unsafe_outcome)
            .filter_map(|o| o.report.lines().next())
            .collect()
    };
    let lost = first_lines(true);
    safety!(lost.is_empty(), "{} of {runs} run(s) lost or duplicated records: {}", lost.len(), lost.join("; "));
    let late = first_lines(false);
    liveness!(late.is_empty(), "{} of {runs} run(s) had records still on their way: {}", late.len(), late.join("; "));
}

#[actix_rt::test]
async fn ordered_input_loses_and_duplicates_nothing_when_node_connections_are_cut_under_load() {
    soak(Mode::Ordered).await;
}

#[actix_rt::test]
async fn queue_input_loses_and_duplicates_nothing_when_node_connections_are_cut_under_load() {
    soak(Mode::Queue).await;
}
