//! Flotilla's integration-test harness: real `nats-server` processes on loopback.
//!
//! [`NatsServer::start`] runs `nats-server -js` on a free loopback port with a
//! temporary store directory, waits until it answers `/healthz`, and kills it by PID
//! when dropped — also when the test panics. The server is started under
//! `setpriv --pdeathsig KILL` where available, so it dies with the test process even
//! when that process is killed outright. [`NatsCluster::start`] starts three servers
//! routed into one JetStream cluster.
//!
//! The binary is `$NATS_SERVER_BIN`, else `nats-server` on `PATH` (or `/usr/sbin`).
//! When it is missing the harness panics with how to install it: tests never skip.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod fault_proxy;
pub mod record;
pub mod relay_cluster;
pub mod safety;
pub mod webdriver;

pub use record::{Record, read_messages};

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a server may take to become healthy.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Finds the nats-server binary.
///
/// # Panics
/// When it cannot be found, with the command that installs it.
pub fn nats_server_bin() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs: Vec<PathBuf> = std::env::split_paths(&path).chain([PathBuf::from("/usr/sbin")]).collect();
    find_nats_server(std::env::var_os("NATS_SERVER_BIN").map(PathBuf::from), &dirs)
        .unwrap_or_else(|msg| panic!("{msg}"))
}

/// Where nats-server is: `explicit` (from `NATS_SERVER_BIN`) when given, else the first
/// `nats-server` file in `dirs`.
///
/// # Errors
/// A message that says how to install it.
pub fn find_nats_server(explicit: Option<PathBuf>, dirs: &[PathBuf]) -> Result<PathBuf, String> {
    if let Some(bin) = explicit {
        return if bin.is_file() {
            Ok(bin)
        } else {
            Err(format!("NATS_SERVER_BIN={} is not a file: point it at a nats-server binary", bin.display()))
        };
    }
    dirs.iter().map(|dir| dir.join("nats-server")).find(|p| p.is_file()).ok_or_else(|| {
        "nats-server not found on PATH or in /usr/sbin: install it with `apt-get install -y nats-server` \
         (or set NATS_SERVER_BIN to its path). Integration tests need a real server and never skip."
            .to_owned()
    })
}

/// A free TCP port on 127.0.0.1 (free when asked; the server binds it right after).
pub fn free_port() -> u16 {
    // Below Linux's ephemeral range (32768–60999): a port the OS hands out for port 0
    // is also what it hands the next outgoing connection, and a server started a moment
    // later found it taken ("bind: address already in use"). Tests of several processes
    // start at different points of the range (by PID) and step through it.
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    let start = std::process::id().wrapping_mul(7_919) % SPAN;
    for _ in 0..SPAN {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (LOW + (start + n.wrapping_mul(13)) % SPAN) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("cannot find a free loopback port: {e}"))
}

fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(500)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    let status = body.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body))
}

/// Who a signal goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalTarget {
    /// One process, by PID.
    Process(u32),
    /// Every process of a process group, by its ID (the leader's PID).
    Group(u32),
}

/// Sends `signal` (`TERM`, `KILL`, `STOP`, `CONT`, …) with `kill -s SIGNAL -- TARGET`;
/// whether it was delivered.
///
/// The `--` matters: procps' `kill -KILL -16303` reads only the first digit of a
/// negative PID and signals `-1`, every process on the machine. A target of 0 or 1
/// (our own group, or init and with it everyone) is refused for the same reason.
pub fn send_signal(signal: &str, target: SignalTarget) -> bool {
    let Some(args) = kill_args(signal, target) else { return false };
    Command::new("kill").args(&args).stderr(Stdio::null()).status().is_ok_and(|status| status.success())
}

/// The arguments [`send_signal`] gives `kill`, or `None` for a target it refuses.
pub fn kill_args(signal: &str, target: SignalTarget) -> Option<[String; 4]> {
    let target = match target {
        SignalTarget::Process(pid) if pid > 1 => pid.to_string(),
        SignalTarget::Group(pgid) if pgid > 1 => format!("-{pgid}"),
        _ => return None,
    };
    Some(["-s".to_owned(), signal.to_owned(), "--".to_owned(), target])
}

/// One running `nats-server` process.
#[derive(Debug)]
pub struct NatsServer {
    child: Option<Child>,
    port: u16,
    http_port: u16,
    store: PathBuf,
    log: PathBuf,
    args: Vec<String>,
    _dir: Option<tempfile::TempDir>,
}

impl NatsServer {
    /// Starts a standalone JetStream server on a free loopback port.
    ///
    /// # Panics
    /// When nats-server is missing or does not become healthy (the panic shows its log).
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a standalone JetStream server with extra command-line arguments (for
    /// example `["--user", "u", "--pass", "p"]`).
    ///
    /// # Panics
    /// As [`NatsServer::start`].
    pub fn start_with(extra: &[&str]) -> Self {
        let dir = tempfile::Builder::new().prefix("flotilla-nats-").tempdir().expect("temp dir for nats-server");
        let port = free_port();
        let http_port = free_port();
        let mut server = Self::spawn(dir.path(), port, http_port, extra.iter().map(|a| (*a).to_owned()).collect());
        server._dir = Some(dir);
        server.wait_healthy();
        server
    }

    /// Starts a standalone JetStream server that also reads the configuration file
    /// `config` (for example `jetstream { max_file_store: 4MB }`); command-line settings
    /// (port, store directory, log) win over the file's.
    ///
    /// # Panics
    /// As [`NatsServer::start`].
    pub fn start_with_config(config: &str) -> Self {
        let dir = tempfile::Builder::new().prefix("flotilla-nats-").tempdir().expect("temp dir for nats-server");
        let file = dir.path().join("nats.conf");
        std::fs::write(&file, config).expect("write nats-server config");
        let port = free_port();
        let http_port = free_port();
        let mut server = Self::spawn(dir.path(), port, http_port, vec!["-c".to_owned(), file.display().to_string()]);
        server._dir = Some(dir);
        server.wait_healthy();
        server
    }

    fn spawn(dir: &Path, port: u16, http_port: u16, extra: Vec<String>) -> Self {
        let store = dir.join("store");
        let log = dir.join(format!("nats-{port}.log"));
        let mut args = vec![
            "-js".to_owned(),
            "-a".into(),
            "127.0.0.1".into(),
            "-p".into(),
            port.to_string(),
            "-m".into(),
            http_port.to_string(),
            "-sd".into(),
            store.display().to_string(),
            "-l".into(),
            log.display().to_string(),
        ];
        args.extend(extra);
        let mut server = Self { child: None, port, http_port, store, log, args, _dir: None };
        server.launch();
        server
    }

    fn launch(&mut self) {
        let bin = nats_server_bin();
        let mut cmd = if Path::new("/usr/bin/setpriv").is_file() {
            let mut c = Command::new("/usr/bin/setpriv");
            c.args(["--pdeathsig", "KILL", "--"]).arg(&bin);
            c
        } else {
            Command::new(&bin)
        };
        cmd.args(&self.args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        let child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        self.child = Some(child);
    }

    /// A monitoring endpoint's body (`/jsz?leader-only=true`, `/routez`, …), when the
    /// server answers 200.
    pub fn monitor(&self, path: &str) -> Option<String> {
        match http_get(self.http_port, path) {
            Some((200, text)) => text.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()),
            _ => None,
        }
    }

    /// Blocks until `/healthz` answers 200 (JetStream ready).
    ///
    /// # Panics
    /// When the server exits or is not healthy within 20 s; the panic includes its log.
    pub fn wait_healthy(&mut self) {
        self.wait_healthy_within(READY_TIMEOUT);
    }

    /// [`wait_healthy`](Self::wait_healthy) with another bound: a server that was cut
    /// off from its peers for a while reports healthy only once its JetStream caught
    /// up, which can take longer than a start.
    ///
    /// # Panics
    /// When the server exits or is not healthy within `within`; the panic includes its
    /// log.
    pub fn wait_healthy_within(&mut self, within: Duration) {
        let start = Instant::now();
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!("nats-server exited at start ({status}); log:\n{}", self.log_text());
            }
            if let Some((200, _)) = http_get(self.http_port, "/healthz") {
                return;
            }
            if start.elapsed() > within {
                panic!("nats-server on port {} not healthy after {within:?}; log:\n{}", self.port, self.log_text());
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// The client URL, `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's PID while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The store directory (JetStream data).
    pub fn store_dir(&self) -> &Path {
        &self.store
    }

    /// What the server logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_else(|e| format!("(no log at {}: {e})", self.log.display()))
    }

    /// Kills the server with SIGKILL and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends a signal (`TERM`, `STOP`, `CONT`, …) to the server.
    pub fn signal(&self, signal: &str) {
        if let Some(pid) = self.pid() {
            send_signal(signal, SignalTarget::Process(pid));
        }
    }

    /// Starts the server again on the same port and store after [`kill`](Self::kill).
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
        self.wait_healthy();
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Three nats-servers routed into one JetStream cluster on loopback.
#[derive(Debug)]
pub struct NatsCluster {
    /// The servers, in start order.
    pub servers: Vec<NatsServer>,
    /// With [`start_with_route_proxies`](Self::start_with_route_proxies): the proxy each
    /// route from server `.0` to server `.1` goes through.
    routes: Vec<(usize, usize, fault_proxy::FaultProxy)>,
    _dir: tempfile::TempDir,
}

impl NatsCluster {
    /// Starts a 3-server cluster and waits until every server reports JetStream healthy
    /// (a meta leader elected).
    ///
    /// # Panics
    /// As [`NatsServer::start`].
    pub fn start() -> Self {
        let dir = tempfile::Builder::new().prefix("flotilla-cluster-").tempdir().expect("temp dir for cluster");
        let ports: Vec<(u16, u16, u16)> = (0..3).map(|_| (free_port(), free_port(), free_port())).collect();
        let routes = ports.iter().map(|(_, _, c)| format!("nats://127.0.0.1:{c}")).collect::<Vec<_>>().join(",");
        let servers = ports
            .iter()
            .enumerate()
            .map(|(i, (port, http, cport))| {
                let sub = dir.path().join(format!("s{i}"));
                std::fs::create_dir_all(&sub).expect("server dir");
                NatsServer::spawn(
                    &sub,
                    *port,
                    *http,
                    vec![
                        "-n".into(),
                        format!("s{i}"),
                        "--cluster_name".into(),
                        "flotilla-test".into(),
                        "--cluster".into(),
                        format!("nats://127.0.0.1:{cport}"),
                        "--routes".into(),
                        routes.clone(),
                    ],
                )
            })
            .collect::<Vec<_>>();
        let mut cluster = Self { servers, routes: Vec::new(), _dir: dir };
        for s in &mut cluster.servers {
            s.wait_healthy();
        }
        cluster
    }

    /// Starts a 3-server cluster whose routes all go through fault proxies the test
    /// owns, one per direction and pair, so [`isolate`](Self::isolate) can cut one
    /// server off from its peers (its clients still reach it) and
    /// [`heal`](Self::heal) can join it again. Servers ping their routes every second
    /// and give a route up after two missed pings, so a cut is noticed in about 3 s.
    /// Each server advertises an address nobody listens on, so servers never route
    /// to each other directly around the proxies.
    ///
    /// # Panics
    /// As [`NatsServer::start`].
    pub fn start_with_route_proxies() -> Self {
        let dir = tempfile::Builder::new().prefix("flotilla-cluster-").tempdir().expect("temp dir for cluster");
        let ports: Vec<(u16, u16, u16)> = (0..3).map(|_| (free_port(), free_port(), free_port())).collect();
        let mut routes = Vec::new();
        for from in 0..3 {
            for to in (0..3).filter(|to| *to != from) {
                let upstream = ([127, 0, 0, 1], ports[to].2).into();
                routes.push((from, to, fault_proxy::FaultProxy::start(upstream)));
            }
        }
        let servers = ports
            .iter()
            .enumerate()
            .map(|(i, (port, http, cport))| {
                let sub = dir.path().join(format!("s{i}"));
                std::fs::create_dir_all(&sub).expect("server dir");
                let mine: Vec<String> = routes
                    .iter()
                    .filter(|(from, _, _)| *from == i)
                    .map(|(_, _, p)| format!("\"{}\"", p.url()))
                    .collect();
                let conf = sub.join("cluster.conf");
                std::fs::write(
                    &conf,
                    format!(
                        "server_name: s{i}\nping_interval: \"1s\"\nping_max: 2\nwrite_deadline: \"2s\"\n\
                         cluster {{\n  name: flotilla-test\n  listen: \"127.0.0.1:{cport}\"\n  \
                         advertise: \"127.0.0.1:1\"\n  routes: [{}]\n}}\n",
                        mine.join(", ")
                    ),
                )
                .expect("cluster config");
                NatsServer::spawn(&sub, *port, *http, vec!["-c".into(), conf.display().to_string()])
            })
            .collect::<Vec<_>>();
        let mut cluster = Self { servers, routes, _dir: dir };
        for s in &mut cluster.servers {
            s.wait_healthy();
        }
        cluster
    }

    /// Cuts server `i` off from its peers: every route to or from it is blackholed
    /// (see [`FaultProxy::blackhole`](fault_proxy::FaultProxy::blackhole)).
    ///
    /// # Panics
    /// When the cluster was not started with route proxies.
    pub fn isolate(&self, i: usize) {
        assert!(!self.routes.is_empty(), "start the cluster with start_with_route_proxies to isolate a server");
        for (from, to, proxy) in &self.routes {
            if *from == i || *to == i {
                proxy.blackhole();
            }
        }
    }

    /// Ends every isolation: held route traffic flows again.
    pub fn heal(&self) {
        for (_, _, proxy) in &self.routes {
            proxy.heal();
        }
    }

    /// All client URLs, comma-separated.
    pub fn urls(&self) -> String {
        self.servers.iter().map(NatsServer::url).collect::<Vec<_>>().join(",")
    }
}

/// A child process killed (SIGKILL) and reaped when dropped — also when the test panics.
#[derive(Debug)]
pub struct ProcessGuard {
    child: Option<Child>,
    name: String,
}

impl ProcessGuard {
    /// Spawns `cmd`, naming it `name` in messages.
    ///
    /// # Panics
    /// When the process cannot start.
    pub fn spawn(name: impl Into<String>, cmd: &mut Command) -> Self {
        let name = name.into();
        let child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Self { child: Some(child), name }
    }

    /// The PID while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends a signal (`TERM`, `KILL`, `STOP`, `CONT`, …).
    pub fn signal(&self, signal: &str) {
        if let Some(pid) = self.pid() {
            send_signal(signal, SignalTarget::Process(pid));
        }
    }

    /// Waits up to `timeout` for the process to exit; `None` if it is still running.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Kills it now (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The name given at spawn.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for ProcessGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Builds an example of the `flotilla` package (debug profile) and returns its path.
///
/// # Panics
/// When the build fails.
pub fn example_bin(name: &str) -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(&workspace)
        .args(["build", "--quiet", "--example", name])
        .status()
        .unwrap_or_else(|e| panic!("cannot run cargo build --example {name}: {e}"));
    assert!(status.success(), "cargo build --example {name} failed");
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace.join("target"));
    let bin = target.join("debug").join("examples").join(name);
    assert!(bin.is_file(), "{} was not built", bin.display());
    bin
}

/// Builds the `flotilla` command-line tool (debug profile) and returns its path.
///
/// # Panics
/// When the build fails.
pub fn flotilla_bin() -> PathBuf {
    static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(build_flotilla).clone()
}

fn build_flotilla() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(&workspace)
        .args(["build", "--quiet", "-p", "flotilla-node", "--bin", "flotilla"])
        .status()
        .unwrap_or_else(|e| panic!("cannot run cargo build --bin flotilla: {e}"));
    assert!(status.success(), "cargo build --bin flotilla failed");
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace.join("target"));
    let bin = target.join("debug").join("flotilla");
    assert!(bin.is_file(), "{} was not built", bin.display());
    bin
}

/// Connects a JetStream broker to `server`.
///
/// # Panics
/// When the server cannot be reached.
pub async fn connect(server: &NatsServer) -> flotilla_transport::SharedBroker {
    let opts = flotilla_transport::JetStreamOptions::new(server.url());
    flotilla_transport::JetStreamBroker::connect(opts).await.expect("connect").shared()
}

/// Messages stored in `stream` now (0 when it does not exist).
pub async fn count(b: &flotilla_transport::SharedBroker, stream: &str) -> u64 {
    b.stream_state(stream).await.map(|s| s.messages).unwrap_or(0)
}

/// Waits until `stream` holds at least `n` messages.
///
/// # Panics
/// When it does not within `within`.
pub async fn wait_count(b: &flotilla_transport::SharedBroker, stream: &str, n: u64, within: Duration) {
    let start = Instant::now();
    while start.elapsed() < within {
        if count(b, stream).await >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{stream} has {} messages after {within:?}, expected {n}", count(b, stream).await);
}
