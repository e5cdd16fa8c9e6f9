//! A cluster of `relay` example nodes on real nats-servers, for the multi-process
//! tests: start nodes (each with its own flags, environment or wrapper such as
//! `faketime`), feed them records, read what they stored, and find what went wrong.
//!
//! Every process started here is killed by PID when the cluster is dropped, also when
//! the test panics ([`ProcessGuard`], [`NatsServer`]). Nodes run with a 3 s lease TTL
//! (see [`TTL`]) so failover waits stay short.

use crate::{NatsServer, ProcessGuard, example_bin};
use flotilla_actors::cluster::{LeaseRecord, keys};
use flotilla_transport::broker::{AckPolicy, ConsumerSpec, OutboundMessage, SharedBroker};
use flotilla_transport::clock::unix_millis;
use flotilla_transport::wire::{Codec, Headers, MessageId, headers, partition_for};
use flotilla_transport::{JetStreamBroker, JetStreamOptions};
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::rc::Rc;
use std::time::{Duration, Instant, SystemTime};

/// The lease TTL nodes of a test cluster run with.
pub const TTL: Duration = Duration::from_secs(3);
/// Partitions of `relay-in` and `relay-out`.
pub const PARTITIONS: u32 = 8;
/// The relay's output stream.
pub const OUT: &str = "FLOTILLA_relay_relay-out";
/// The relay's ordered input stream.
pub const IN: &str = "FLOTILLA_relay_relay-in";
/// The relay job's dead-letter stream.
pub const DLQ: &str = "FLOTILLA_relay_DLQ";
/// The relay's queue input stream (`--queue`).
pub const QUEUE_IN: &str = "FLOTILLA_relay_relay-jobs";
/// The relay's queue output stream (`--queue`).
pub const QUEUE_OUT: &str = "FLOTILLA_relay_relay-done";

pub use crate::record::Record;

/// How to start one node, beyond the cluster's defaults.
#[derive(Debug, Clone, Default)]
pub struct Launch {
    /// The NATS URL(s) for this node, when not the cluster's.
    pub nats: Option<String>,
    /// A command the node runs under, e.g. `["faketime", "-f", "+90s"]`. The node is
    /// killed when the wrapper dies; a wrapper that forks it (faketime does) gets the
    /// node's signals itself, so use SIGKILL, not SIGTERM or SIGSTOP, on such nodes.
    pub wrapper: Vec<String>,
    /// Extra flags; one given here replaces the cluster's default for it (`--lease-ttl`,
    /// `--ack-wait`).
    pub args: Vec<String>,
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
}

/// A test cluster of relay nodes; see the [module docs](self).
pub struct RelayCluster {
    /// The relay binary.
    pub bin: PathBuf,
    /// The server the cluster started itself, when it did (see [`RelayCluster::start`]).
    pub server: Option<NatsServer>,
    /// The NATS URL(s) nodes and commands use by default.
    pub nats: String,
    /// Where node logs go.
    pub dir: tempfile::TempDir,
    /// The running nodes, by id.
    pub nodes: BTreeMap<String, ProcessGuard>,
    /// A JetStream connection of the test's own.
    pub broker: SharedBroker,
    /// The example's job and ordered input (`relay`/`relay-in`, `tally`/`tally-in`).
    pub job: (&'static str, &'static str),
}

impl RelayCluster {
    /// Starts a nats-server of its own and nodes `ids` on it.
    pub async fn start(ids: &[&str]) -> Self {
        let server = NatsServer::start();
        let mut c = Self::on(&server.url(), ids).await;
        c.server = Some(server);
        c
    }

    /// Starts nodes `ids` against the server(s) at `nats` (comma-separated URLs),
    /// provisioning the job's streams first as an operator would with `relay publish`.
    pub async fn on(nats: &str, ids: &[&str]) -> Self {
        Self::on_with(nats, &[], ids).await
    }

    /// As [`on`](Self::on), with `common` flags (e.g. `--replicas 3`) given to the
    /// provisioning command too.
    pub async fn on_with(nats: &str, common: &[&str], ids: &[&str]) -> Self {
        Self::example_on(("relay", "relay-in"), nats, common, ids).await
    }

    /// As [`on_with`](Self::on_with), for another example with `relay`'s node flags and
    /// `publish --count N`: `job` is its job and ordered input (`("tally", "tally-in")`).
    pub async fn example_on(job: (&'static str, &'static str), nats: &str, common: &[&str], ids: &[&str]) -> Self {
        let bin = example_bin(job.0);
        let mut options = JetStreamOptions::new(nats);
        options.urls = nats.split(',').map(str::to_owned).collect();
        let broker = JetStreamBroker::connect(options).await.expect("connect").shared();
        // FLOTILLA_TEST_LOGS=DIR keeps the nodes' logs there (a subdirectory per test).
        let dir = match std::env::var_os("FLOTILLA_TEST_LOGS") {
            Some(root) => {
                std::fs::create_dir_all(&root).expect("log dir");
                tempfile::Builder::new().prefix("cluster-").disable_cleanup(true).tempdir_in(root).expect("log dir")
            }
            None => tempfile::tempdir().expect("tmp"),
        };
        let mut c = Self { bin, server: None, nats: nats.to_owned(), dir, nodes: BTreeMap::new(), broker, job };
        let mut args = vec!["publish", "--count", "0"];
        args.extend_from_slice(common);
        let out = c.relay_cmd(&args);
        assert!(out.status.success(), "provisioning failed: {}", String::from_utf8_lossy(&out.stderr));
        let launch = Launch { args: common.iter().map(|a| (*a).to_owned()).collect(), ..Launch::default() };
        for id in ids {
            c.add_with(id, launch.clone());
        }
        c
    }

    /// The server the cluster started.
    ///
    /// # Panics
    /// When it was started on servers of the test's own ([`on`](Self::on)).
    pub fn server(&mut self) -> &mut NatsServer {
        self.server.as_mut().expect("this cluster runs on servers the test owns")
    }

    /// Node `id`'s log file.
    pub fn log(&self, id: &str) -> PathBuf {
        self.dir.path().join(format!("{id}.log"))
    }

    /// What node `id` logged so far.
    pub fn log_text(&self, id: &str) -> String {
        std::fs::read_to_string(self.log(id)).unwrap_or_default()
    }

    /// The last 40 lines of every node's log, for failure messages.
    pub fn all_logs(&self) -> String {
        self.nodes.keys().map(|id| format!("\n----- node {id} -----\n{}", tail(&self.log_text(id), 40))).collect()
    }

    /// Starts node `id` with the defaults (stdout and stderr into its log).
    pub fn add(&mut self, id: &str) {
        self.add_with(id, Launch::default());
    }

    /// Starts node `id` as `launch` says.
    pub fn add_with(&mut self, id: &str, launch: Launch) {
        let log = std::fs::File::create(self.log(id)).expect("log file");
        let err = log.try_clone().expect("log file");
        let mut chain: Vec<PathBuf> = launch.wrapper.iter().map(PathBuf::from).collect();
        if !chain.is_empty() && Path::new("/usr/bin/setpriv").is_file() {
            // A wrapper may fork the node rather than exec it (faketime does): the node
            // must die with the wrapper, which is the process the guard kills.
            chain.extend(["/usr/bin/setpriv", "--pdeathsig", "KILL", "--"].map(PathBuf::from));
        }
        chain.push(self.bin.clone());
        let mut cmd = if Path::new("/usr/bin/setpriv").is_file() {
            let mut c = Command::new("/usr/bin/setpriv");
            c.args(["--pdeathsig", "KILL", "--"]).args(&chain);
            c
        } else {
            let mut c = Command::new(&chain[0]);
            c.args(&chain[1..]);
            c
        };
        let nats = launch.nats.clone().unwrap_or_else(|| self.nats.clone());
        cmd.args(["--nats", &nats, "--node-id", id]);
        // Defaults the launch does not set itself (clap refuses a flag given twice).
        for (flag, value) in [("--lease-ttl", "3s"), ("--ack-wait", "10s")] {
            if !launch.args.iter().any(|a| a == flag || a.starts_with(&format!("{flag}="))) {
                cmd.args([flag, value]);
            }
        }
        cmd.args(&launch.args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .env("FLOTILLA_LOG", "info,flotilla_node::cluster::membership=debug")
            // A node's error must stay in the 40 log lines a failure shows, not be
            // pushed out by a backtrace.
            .env("RUST_BACKTRACE", "0");
        for (k, v) in &launch.env {
            cmd.env(k, v);
        }
        self.nodes.insert(id.to_owned(), ProcessGuard::spawn(format!("{} {id}", self.job.0), &mut cmd));
    }

    /// Sends `signal` to node `id`.
    pub fn signal(&self, id: &str, signal: &str) {
        self.nodes.get(id).unwrap_or_else(|| panic!("no node {id}")).signal(signal);
    }

    /// Runs a relay subcommand (control or publish) to completion.
    pub fn relay_cmd(&self, args: &[&str]) -> std::process::Output {
        Command::new(&self.bin)
            .args(["--nats", &self.nats])
            .args(args)
            .env("FLOTILLA_LOG", "warn")
            .output()
            .expect("relay command")
    }

    /// The current lease holder and epoch of each partition.
    pub async fn owners(&self) -> BTreeMap<u32, (String, u64)> {
        let mut out = BTreeMap::new();
        for p in 0..PARTITIONS {
            let bucket = format!("FLOTILLA_{}_LEASES", self.job.0);
            if let Ok(Some(e)) = self.broker.kv_get(&bucket, &keys::lease(self.job.1, p)).await
                && let Ok(rec) = serde_json::from_slice::<LeaseRecord>(&e.value)
            {
                out.insert(p, (rec.node, rec.epoch));
            }
        }
        out
    }

    /// Waits until every partition is leased to one of `nodes`, each holding its fair
    /// share, and the assignment has not changed for two seconds.
    pub async fn wait_balanced(&self, nodes: &[&str], within: Duration) -> BTreeMap<u32, String> {
        let start = Instant::now();
        let mut last = BTreeMap::new();
        let mut stable_since = Instant::now();
        loop {
            let owners: BTreeMap<u32, String> = self.owners().await.into_iter().map(|(p, (n, _))| (p, n)).collect();
            let mut counts: BTreeMap<&str, usize> = nodes.iter().map(|n| (*n, 0)).collect();
            for o in owners.values() {
                if let Some(c) = counts.get_mut(o.as_str()) {
                    *c += 1;
                }
            }
            let lo = PARTITIONS as usize / nodes.len();
            let hi = lo + usize::from(!(PARTITIONS as usize).is_multiple_of(nodes.len()));
            let fair = owners.len() == PARTITIONS as usize
                && counts.values().sum::<usize>() == PARTITIONS as usize
                && counts.values().all(|c| (lo..=hi).contains(c));
            if owners != last {
                last = owners.clone();
                stable_since = Instant::now();
            }
            if fair && stable_since.elapsed() >= Duration::from_secs(2) {
                return owners;
            }
            crate::liveness!(
                start.elapsed() < within,
                "partitions not shared fairly by {nodes:?} within {within:?}: {owners:?}{}",
                self.all_logs()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until none of `partitions` is held by `node` any more and each is held by
    /// someone else; how long that took.
    pub async fn wait_moved_from(&self, node: &str, partitions: &[u32], within: Duration) -> Duration {
        let start = Instant::now();
        loop {
            let owners = self.owners().await;
            if partitions.iter().all(|p| owners.get(p).is_some_and(|(o, _)| o != node)) {
                return start.elapsed();
            }
            crate::liveness!(
                start.elapsed() < within,
                "partitions {partitions:?} still held by {node} after {within:?}: {owners:?}{}",
                self.all_logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until node `id`'s log contains `text`.
    pub async fn wait_log(&self, id: &str, text: &str, within: Duration) {
        let start = Instant::now();
        while !self.log_text(id).contains(text) {
            crate::liveness!(
                start.elapsed() < within,
                "node {id} never logged {text:?} within {within:?}{}",
                self.all_logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until node `id` exits; returns its status.
    pub fn wait_exit(&mut self, id: &str, within: Duration) -> std::process::ExitStatus {
        let guard = self.nodes.get_mut(id).expect("known node");
        match guard.wait_timeout(within) {
            Some(status) => status,
            None => panic!("LIVENESS: node {id} did not exit within {within:?}{}", self.all_logs()),
        }
    }

    /// As [`wait_exit`](Self::wait_exit), but waiting asynchronously, so tasks of the
    /// test (a [`Feed`], a watcher) keep running meanwhile.
    pub async fn wait_exit_async(&mut self, id: &str, within: Duration) -> std::process::ExitStatus {
        let start = Instant::now();
        loop {
            let guard = self.nodes.get_mut(id).unwrap_or_else(|| panic!("no node {id}"));
            if let Some(status) = guard.wait_timeout(Duration::from_millis(1)) {
                return status;
            }
            crate::liveness!(start.elapsed() < within, "node {id} did not exit within {within:?}{}", self.all_logs());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether node `id` is still running.
    pub fn is_running(&mut self, id: &str) -> bool {
        self.nodes.get_mut(id).is_some_and(|g| g.wait_timeout(Duration::from_millis(1)).is_none())
    }

    /// The summary line a node printed when it exited: (forwarded, redelivered).
    pub fn summary(&self, id: &str) -> (u64, u64) {
        let text = self.log_text(id);
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("relay node {id}: forwarded")))
            .unwrap_or_else(|| panic!("node {id} printed no summary:\n{}", tail(&text, 30)));
        let number_before = |word: &str| -> u64 {
            let i = line.find(word).unwrap_or_else(|| panic!("no {word:?} in {line:?}"));
            line[..i].split_whitespace().last().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{line:?}"))
        };
        (number_before(" records to relay-"), number_before(" redelivered records"))
    }

    /// What of the input is not acknowledged yet: one line per consumer with messages
    /// pending or unacknowledged (empty when all of it is done). The ordered input is
    /// the job's (`relay-in`, `tally-in`): its partition consumers; with `queue`, the
    /// `relay-jobs` workers' consumer.
    pub async fn input_open(&self, queue: bool) -> Vec<String> {
        let (stream, consumers): (String, Vec<String>) = if queue {
            (QUEUE_IN.to_owned(), vec!["relay-jobs-workers".to_owned()])
        } else {
            let (job, input) = self.job;
            (format!("FLOTILLA_{job}_{input}"), (0..PARTITIONS).map(|p| format!("{input}-p{p}")).collect())
        };
        let mut open = Vec::new();
        for name in &consumers {
            match self.broker.consumer_state(&stream, name).await {
                Ok(s) if s.num_pending == 0 && s.num_ack_pending == 0 => {}
                Ok(s) => open.push(format!("{name}: {} pending, {} unacked", s.num_pending, s.num_ack_pending)),
                Err(e) => open.push(format!("{name}: {e}")),
            }
        }
        open
    }

    /// Fails a test whose output still misses records after its wait (`what` says
    /// which): a safety failure (records lost) when the input has acknowledged
    /// everything, since outputs are stored before their input is acknowledged; a
    /// liveness failure while the input still holds work. `queue` as for
    /// [`input_open`](Self::input_open).
    ///
    /// # Panics
    /// Always.
    pub async fn fail_missing(&self, queue: bool, what: &str) -> ! {
        let open = self.input_open(queue).await;
        crate::safety!(
            !open.is_empty(),
            "{what}, though the input acknowledged everything: records lost{}",
            self.all_logs()
        );
        panic!("LIVENESS: {what}; the input is not done: {open:?}{}", self.all_logs());
    }

    /// Waits until the input (`relay-in`'s partition consumers, or with `queue` the
    /// `relay-jobs` workers' consumer) has delivered and had acknowledged everything:
    /// the work is done, including redeliveries of what a dead node held.
    pub async fn wait_input_acked(&self, queue: bool, within: Duration) {
        let start = Instant::now();
        loop {
            let open = self.input_open(queue).await;
            if open.is_empty() {
                return;
            }
            crate::liveness!(start.elapsed() < within, "input not done after {within:?}: {open:?}{}", self.all_logs());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until relay-out holds records `0..n`; panics naming the first missing.
    pub async fn wait_all_out(&self, n: u64, within: Duration) {
        self.wait_all_in(OUT, n, within).await;
    }

    /// Waits until `stream` (an output: [`OUT`], [`QUEUE_OUT`]) holds records `0..n`;
    /// panics naming the first missing.
    ///
    /// Running out of time is a liveness or a safety failure as
    /// [`fail_missing`](Self::fail_missing) decides; records missing once `n` are
    /// stored (the count made up by duplicates) are a safety failure.
    pub async fn wait_all_in(&self, stream: &str, n: u64, within: Duration) {
        let start = Instant::now();
        loop {
            let stored = self.broker.stream_state(stream).await.map(|s| s.messages).unwrap_or(0);
            if stored >= n {
                break;
            }
            if start.elapsed() >= within {
                let ids = id_counts(&self.broker, stream).await;
                let missing: Vec<u64> = (0..n).filter(|i| !ids.contains_key(i)).take(20).collect();
                let what =
                    format!("{stream} has {stored} of {n} records after {within:?} (first 20 missing: {missing:?})");
                self.fail_missing(stream == QUEUE_OUT, &what).await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let ids = id_counts(&self.broker, stream).await;
        let missing: Vec<u64> = (0..n).filter(|i| !ids.contains_key(i)).take(20).collect();
        crate::safety!(missing.is_empty(), "{stream} misses records (first 20): {missing:?}{}", self.all_logs());
    }
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Record `id` as the relay's own publisher writes it.
pub fn record(id: u64) -> OutboundMessage {
    record_with(id, &format!("record {id}"))
}

/// Record `id` with `body` (`poison`, `sleep:MS`, `later:MS`, … as the relay reads them).
pub fn record_with(id: u64, body: &str) -> OutboundMessage {
    let key = id.to_string();
    let payload = Codec::default().encode(&Record { id, body: body.to_owned() }).expect("encode");
    OutboundMessage::new(format!("flotilla.relay.relay-in.{}", partition_for(&key, PARTITIONS)), payload)
        .with_id(format!("in-{id}"))
        .with_header(headers::KEY, key)
        .with_header(headers::TYPE, "Record")
        .with_header(headers::SENT, unix_millis(SystemTime::now()).to_string())
}

/// Record `id` for the queue input (`--queue`), as [`record`] is for the ordered one.
pub fn queue_record(id: u64) -> OutboundMessage {
    queue_record_with(id, &format!("record {id}"))
}

/// Record `id` with `body` for the queue input (`--queue`).
pub fn queue_record_with(id: u64, body: &str) -> OutboundMessage {
    let payload = Codec::default().encode(&Record { id, body: body.to_owned() }).expect("encode");
    OutboundMessage::new("flotilla.relay.relay-jobs", payload)
        .with_id(format!("in-{id}"))
        .with_header(headers::KEY, id.to_string())
        .with_header(headers::TYPE, "Record")
        .with_header(headers::SENT, unix_millis(SystemTime::now()).to_string())
}

/// Publishes records `0..` in batches until stopped, counting only batches the stream
/// acknowledged whole, and the longest time between two acknowledged batches (how long
/// publishers were held up by a fault).
pub struct Feed {
    stop: Rc<Cell<bool>>,
    published: Rc<Cell<u64>>,
    longest_gap: Rc<Cell<Duration>>,
    done: tokio::task::JoinHandle<()>,
}

impl Feed {
    /// About `per_second` records a second. Must run inside a `LocalSet` (as
    /// `#[actix_rt::test]` tests do).
    pub fn start(broker: SharedBroker, per_second: u64) -> Self {
        Self::start_with(broker, per_second, record)
    }

    /// As [`start`](Self::start), building record `id` with `make` (e.g. [`queue_record`]).
    pub fn start_with(broker: SharedBroker, per_second: u64, make: fn(u64) -> OutboundMessage) -> Self {
        let stop = Rc::new(Cell::new(false));
        let published = Rc::new(Cell::new(0));
        let longest_gap = Rc::new(Cell::new(Duration::ZERO));
        let (s, p, g) = (stop.clone(), published.clone(), longest_gap.clone());
        let done = tokio::task::spawn_local(async move {
            let batch = (per_second / 20).max(1);
            let mut last_ok = Instant::now();
            while !s.get() {
                let from = p.get();
                let msgs: Vec<OutboundMessage> = (from..from + batch).map(make).collect();
                let acks = broker.publish_batch(msgs).await;
                if acks.iter().all(Result::is_ok) {
                    p.set(from + batch);
                    g.set(g.get().max(last_ok.elapsed()));
                    last_ok = Instant::now();
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        Self { stop, published, longest_gap, done }
    }

    /// Records published so far.
    pub fn published(&self) -> u64 {
        self.published.get()
    }

    /// The longest time between two acknowledged batches so far.
    pub fn longest_gap(&self) -> Duration {
        self.longest_gap.get()
    }

    /// Stops publishing; how many records were published (ids `0..n`).
    pub async fn stop(self) -> u64 {
        self.stop.set(true);
        let _ = self.done.await;
        self.published.get()
    }
}

/// Every message of a stream, in stream order: (subject, headers, payload, stream
/// sequence), read through a fresh consumer that is deleted afterwards.
pub async fn read_stream(b: &SharedBroker, stream: &str) -> Vec<(String, Headers, bytes::Bytes, u64)> {
    let name = format!("check{}", MessageId::new_v7().as_str().replace('-', ""));
    let spec =
        ConsumerSpec { ack_policy: AckPolicy::Explicit, max_ack_pending: None, ..ConsumerSpec::new(name.clone()) };
    // A replicated stream that lost a server may take a while to place a consumer:
    // transient errors are retried for up to 30 s.
    let patience = Instant::now();
    while let Err(e) = b.ensure_consumer(stream, spec.clone()).await {
        assert!(e.is_transient() && patience.elapsed() < Duration::from_secs(30), "checker consumer: {e}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // What the stream holds now is read whole: an empty claim ends the read only
    // once that much has come (a new consumer of a replicated stream may deliver
    // nothing for a moment while its leader is elected), or after 30 s.
    let held = b.stream_state(stream).await.map(|s| s.messages).unwrap_or(0);
    let mut out = Vec::new();
    let reading = Instant::now();
    loop {
        let got = match b.claim(stream, &name, 1000, Duration::from_millis(300)).await {
            Ok(got) => got,
            Err(e) if e.is_transient() && patience.elapsed() < Duration::from_secs(60) => {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            Err(e) => panic!("reading {stream}: {e}"),
        };
        if got.is_empty() {
            if out.len() as u64 >= held || reading.elapsed() > Duration::from_secs(30) {
                break;
            }
            continue;
        }
        for d in got {
            out.push((d.subject.to_string(), d.headers, d.payload, d.info.stream_seq));
        }
    }
    let _ = b.delete_consumer(stream, &name).await;
    out
}

/// The record ids in relay-out.
pub async fn out_ids(b: &SharedBroker) -> BTreeSet<u64> {
    out_id_counts(b).await.into_keys().collect()
}

/// How often each record id is stored in relay-out (more than once is a duplicate the
/// stream's deduplication window did not catch).
pub async fn out_id_counts(b: &SharedBroker) -> BTreeMap<u64, u32> {
    id_counts(b, OUT).await
}

/// How often each record id is stored in `stream`.
pub async fn id_counts(b: &SharedBroker, stream: &str) -> BTreeMap<u64, u32> {
    let mut counts = BTreeMap::new();
    for (_, _, payload, _) in read_stream(b, stream).await {
        if let Ok(r) = Codec::default().decode::<Record>(&payload) {
            *counts.entry(r.id).or_default() += 1;
        }
    }
    counts
}

/// Per partition of relay-out, how many outputs were stored with an older epoch than
/// one stored before them: a writer whose lease had moved on storing after the new
/// owner. What it had in flight when it lost the lease may land so; nothing after.
pub async fn epoch_regressions(b: &SharedBroker) -> BTreeMap<u32, u64> {
    let mut newest: BTreeMap<u32, u64> = BTreeMap::new();
    let mut back: BTreeMap<u32, u64> = BTreeMap::new();
    for (subject, h, _, _) in read_stream(b, OUT).await {
        let Some(p) = subject.rsplit('.').next().and_then(|p| p.parse::<u32>().ok()) else { continue };
        let epoch: u64 = h.get(headers::EPOCH).and_then(|e| e.parse().ok()).unwrap_or(0);
        let top = newest.entry(p).or_default();
        if epoch < *top {
            *back.entry(p).or_default() += 1;
        }
        *top = (*top).max(epoch);
    }
    back
}

/// Outputs stored after stream sequence `after_seq` with an epoch older than `newer`
/// gives for their partition: (subject, epoch).
pub async fn stale_outputs(b: &SharedBroker, after_seq: u64, newer: &BTreeMap<u32, u64>) -> Vec<(String, u64)> {
    read_stream(b, OUT)
        .await
        .into_iter()
        .filter(|(_, _, _, seq)| *seq > after_seq)
        .filter_map(|(subject, h, _, _)| {
            let p: u32 = subject.rsplit('.').next()?.parse().ok()?;
            let epoch: u64 = h.get(headers::EPOCH)?.parse().ok()?;
            (epoch < *newer.get(&p)?).then_some((subject, epoch))
        })
        .collect()
}
