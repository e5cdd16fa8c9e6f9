//! Running a job as a node process: flags, logging, the broker, signals.
//!
//! `Job::run_from_args()` (through [`JobRunner`]) parses [`NodeArgs`] from the command
//! line, connects the broker (the embedded one when no `--nats` is given), starts the
//! job on an actix system and runs until the job ends or a signal arrives: the first
//! SIGTERM or SIGINT stops the job gracefully (in-flight work finishes, unstarted work
//! is handed back, positions are committed); a second one exits at once.

use crate::client::ControlCommand;
use crate::cluster::JoinCluster;
use crate::config::{ConfigError, ConnectConfig, NodeConfig, Urls};
use crate::connect::{BrokerChoice, connect};
use flotilla_actors::{Job, JobError, JobStopper, Producer, StreamType};
use flotilla_transport::broker::{BrokerError, SharedBroker};
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;
use tracing::{info, warn};

/// Flags every Flotilla node takes (flatten them into a job binary's own flags). Each
/// has a `FLOTILLA_*` environment variable, and all of them can come from a TOML file
/// (`--config`); see [`crate::config`] for the file and the precedence: flags, then
/// environment, then file, then defaults.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "Node and connection options (also FLOTILLA_* variables or --config FILE)")]
pub struct NodeArgs {
    /// A TOML config file (flags and FLOTILLA_* variables override what it says).
    #[arg(long, env = "FLOTILLA_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// NATS server URL(s), comma-separated; without it the embedded broker is used.
    #[arg(long, env = "FLOTILLA_NATS", global = true)]
    pub nats: Option<String>,
    /// This node's id (default: host name and process id).
    #[arg(long, env = "FLOTILLA_NODE_ID", global = true)]
    pub node_id: Option<String>,
    /// Run id for drain markers (default: a new one per start).
    #[arg(long, env = "FLOTILLA_RUN_ID", global = true)]
    pub run_id: Option<String>,
    /// Log filter (tracing env-filter syntax, e.g. `info,flotilla_actors=debug,flotilla_node=debug`; default info).
    #[arg(long, env = "FLOTILLA_LOG", global = true)]
    pub log: Option<String>,
    /// Log as JSON lines.
    #[arg(long, env = "FLOTILLA_LOG_JSON", global = true, num_args = 0..=1, default_missing_value = "true")]
    pub log_json: Option<bool>,
    /// NATS user (with --nats-password).
    #[arg(long, env = "FLOTILLA_NATS_USER", global = true)]
    pub nats_user: Option<String>,
    /// NATS password (with --nats-user).
    #[arg(long, env = "FLOTILLA_NATS_PASSWORD", global = true, hide_env_values = true)]
    pub nats_password: Option<String>,
    /// NATS auth token.
    #[arg(long, env = "FLOTILLA_NATS_TOKEN", global = true, hide_env_values = true)]
    pub nats_token: Option<String>,
    /// NATS credentials file (.creds).
    #[arg(long, env = "FLOTILLA_NATS_CREDS", global = true)]
    pub nats_creds: Option<PathBuf>,
    /// NATS nkey seed.
    #[arg(long, env = "FLOTILLA_NATS_NKEY_SEED", global = true, hide_env_values = true)]
    pub nats_nkey_seed: Option<String>,
    /// CA certificate (PEM) to trust for TLS.
    #[arg(long, env = "FLOTILLA_NATS_TLS_CA", global = true)]
    pub nats_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS (with --nats-tls-key).
    #[arg(long, env = "FLOTILLA_NATS_TLS_CERT", global = true)]
    pub nats_tls_cert: Option<PathBuf>,
    /// Client certificate key (PEM).
    #[arg(long, env = "FLOTILLA_NATS_TLS_KEY", global = true)]
    pub nats_tls_key: Option<PathBuf>,
    /// Partition lease TTL: a dead node's partitions move within about this long (default 6s).
    #[arg(long, env = "FLOTILLA_LEASE_TTL", global = true, value_parser = crate::config::parse_duration)]
    pub lease_ttl: Option<std::time::Duration>,
    /// Copies of every stream and KV bucket the job creates, 1 to 5 (default 1); use 3
    /// on a NATS cluster of 3 or more servers.
    #[arg(long, env = "FLOTILLA_REPLICAS", global = true)]
    pub replicas: Option<usize>,
    /// Serve /metrics (Prometheus), /api/status and the live dashboard on this address
    /// (`host:port`, e.g. 127.0.0.1:9090; port 0 picks a free one).
    #[arg(long, env = "FLOTILLA_HTTP", global = true, value_name = "ADDR")]
    pub http: Option<String>,
    /// The HTTP endpoint's token, sent as `Authorization: Bearer TOKEN`: replaying dead
    /// letters needs it, and once it is set so does every read but the page and
    /// /healthz (16 or more characters; open the dashboard as http://ADDR/#token=TOKEN).
    #[arg(long, env = "FLOTILLA_HTTP_TOKEN", global = true, hide_env_values = true, value_name = "TOKEN")]
    pub http_token: Option<String>,
    /// A file holding the HTTP endpoint's token (read at start, trimmed), instead of --http-token.
    #[arg(long, env = "FLOTILLA_HTTP_TOKEN_FILE", global = true, value_name = "PATH")]
    pub http_token_file: Option<PathBuf>,
    /// A host name the HTTP endpoint answers to besides its address (`name` or
    /// `name:port`; repeat it, or separate with commas). Requests naming another host
    /// are refused, so a page cannot reach the node through a name of its own (DNS rebinding).
    #[arg(long = "http-host", env = "FLOTILLA_HTTP_HOSTS", global = true, value_name = "NAME", value_delimiter = ',')]
    pub http_hosts: Vec<String>,
    /// Export the run loop's spans over OTLP/HTTP to this collector (e.g.
    /// http://127.0.0.1:4318; needs a binary built with the `otlp` cargo feature).
    #[arg(long, env = "FLOTILLA_OTLP_ENDPOINT", global = true, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
}

impl NodeArgs {
    /// What the flags and environment variables say (without the file).
    pub fn layer(&self) -> NodeConfig {
        NodeConfig {
            nats: self.nats.clone().map(Urls::One),
            node_id: self.node_id.clone(),
            run_id: self.run_id.clone(),
            log: self.log.clone(),
            log_json: self.log_json,
            replicas: self.replicas,
            http: self.http.clone(),
            http_token: self.http_token.clone(),
            http_token_file: self.http_token_file.clone(),
            http_hosts: (!self.http_hosts.is_empty()).then(|| self.http_hosts.clone()),
            otlp_endpoint: self.otlp_endpoint.clone(),
            connect: ConnectConfig {
                user: self.nats_user.clone(),
                password: self.nats_password.clone(),
                token: self.nats_token.clone(),
                credentials: self.nats_creds.clone(),
                nkey_seed: self.nats_nkey_seed.clone(),
                tls_ca: self.nats_tls_ca.clone(),
                tls_cert: self.nats_tls_cert.clone(),
                tls_key: self.nats_tls_key.clone(),
                ..ConnectConfig::default()
            },
            cluster: crate::config::ClusterSettings { lease_ttl: self.lease_ttl, ..Default::default() },
        }
    }

    /// The effective configuration: flags and environment over the config file.
    ///
    /// # Errors
    /// [`ConfigError`] when the file cannot be read or is invalid.
    pub fn resolve(&self) -> Result<NodeConfig, ConfigError> {
        let file = match &self.config {
            Some(path) => NodeConfig::from_file(path)?,
            None => NodeConfig::default(),
        };
        Ok(self.layer().over(file))
    }

    /// The broker choice these flags make (URLs only; see [`NodeArgs::connect`] for
    /// the whole configuration).
    pub fn broker(&self) -> BrokerChoice {
        BrokerChoice::from_url(self.nats.as_deref())
    }

    /// The node id: `--node-id`, else `<hostname>-<pid>`.
    pub fn node_id(&self) -> String {
        self.node_id.clone().unwrap_or_else(default_node_id)
    }

    /// Resolves the configuration and connects the broker it names.
    ///
    /// # Errors
    /// [`NodeError`] for a bad configuration or an unreachable broker.
    pub async fn connect(&self, client_name: &str) -> Result<SharedBroker, NodeError> {
        let config = self.resolve()?;
        connect_config(&config, client_name).await
    }

    /// A [`Producer`] for `job` on the NATS server these flags name, with the job's
    /// replicas for the streams it has to create.
    ///
    /// # Errors
    /// [`NodeError::NeedsNats`] without `--nats` (records sent to an embedded broker of
    /// their own would vanish with the process), else as [`connect`](Self::connect).
    pub async fn producer(&self, job: &str) -> Result<Producer, NodeError> {
        let config = self.resolve()?;
        if config.urls().is_empty() {
            return Err(NodeError::NeedsNats("sending records"));
        }
        let broker = connect_config(&config, &format!("{job}-producer")).await?;
        Ok(Producer::new(broker, job)
            .map_err(|e| NodeError::Producer(e.to_string()))?
            .with_replicas(config.replicas()?))
    }
}

fn default_node_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_owned()).unwrap_or_else(|_| "node".into());
    // Node ids go into subjects and keys: keep letters, digits, '-' and '_'.
    let host: String = host.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '-' }).collect();
    format!("{host}-{}", std::process::id())
}

/// Connects the broker a resolved configuration names: JetStream with its URLs and
/// connection settings, or the embedded broker.
///
/// # Errors
/// [`NodeError`] for settings that do not go together or an unreachable broker.
pub async fn connect_config(config: &NodeConfig, client_name: &str) -> Result<SharedBroker, NodeError> {
    match config.jetstream_options(client_name)? {
        Some(opts) => Ok(flotilla_transport::JetStreamBroker::connect(opts).await?.shared()),
        None => Ok(connect(&BrokerChoice::Embedded, client_name).await?),
    }
}

/// Why a node could not run its job.
#[derive(thiserror::Error)]
pub enum NodeError {
    /// The broker could not be reached or refused.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// The job was refused or failed.
    #[error(transparent)]
    Job(#[from] JobError),
    /// The log filter does not parse.
    #[error("invalid --log filter {filter:?}: {reason}")]
    LogFilter {
        /// The filter given.
        filter: String,
        /// Why it does not parse.
        reason: String,
    },
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The runtime could not start.
    #[error("cannot start the runtime: {0}")]
    Runtime(String),
    /// Something that must reach other processes was asked of the embedded broker.
    #[error(
        "{0} needs --nats URL (or FLOTILLA_NATS): the embedded broker lives inside one process, so nothing outside it would see the records"
    )]
    NeedsNats(&'static str),
    /// A producer could not be made.
    #[error("{0}")]
    Producer(String),
    /// The HTTP endpoint could not start.
    #[error(transparent)]
    Http(#[from] crate::http::HttpError),
    /// Spans cannot be exported as asked.
    #[error("{0}")]
    Otlp(String),
}

// `main` prints a returned error with `Debug`: make that the readable message.
impl std::fmt::Debug for NodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// Sets up the tracing subscriber (once per process; later calls keep the first).
///
/// # Errors
/// [`NodeError::LogFilter`] when the filter does not parse.
pub fn init_logging(config: &NodeConfig) -> Result<(), NodeError> {
    // Commands and tools log; only a node exports spans.
    init_telemetry(&NodeConfig { otlp_endpoint: None, ..config.clone() }, "", "").map(drop)
}

/// Keeps span export running; dropping it flushes what is left (the end of a run).
#[derive(Debug, Default)]
pub struct TelemetryGuard {
    #[cfg(feature = "otlp")]
    _otlp: Option<crate::otlp::OtlpGuard>,
}

/// Sets up logging and, with `otlp_endpoint` (and the `otlp` feature), span export
/// for node `node` of `job`. Once per process; later calls keep the first.
///
/// # Errors
/// [`NodeError::LogFilter`] when the filter does not parse; [`NodeError::Otlp`] when
/// spans cannot be exported as asked.
pub fn init_telemetry(config: &NodeConfig, job: &str, node: &str) -> Result<TelemetryGuard, NodeError> {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::EnvFilter::try_new(config.log_filter())
        .map_err(|e| NodeError::LogFilter { filter: config.log_filter().to_owned(), reason: e.to_string() })?;
    // Colour only on a terminal: escapes in a log file or a pipe are noise.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(ansi);
    let fmt = if config.log_json.unwrap_or(false) { fmt.json().boxed() } else { fmt.boxed() };
    // The log filter applies to the log only: an exporter takes the spans it wants.
    let registry = tracing_subscriber::registry().with(fmt.with_filter(filter));
    #[cfg(feature = "otlp")]
    {
        let (otlp, guard) = match &config.otlp_endpoint {
            Some(endpoint) => {
                let (layer, guard) = crate::otlp::layer(endpoint, job, node).map_err(NodeError::Otlp)?;
                (Some(layer), Some(guard))
            }
            None => (None, None),
        };
        let _ = registry.with(otlp).try_init();
        Ok(TelemetryGuard { _otlp: guard })
    }
    #[cfg(not(feature = "otlp"))]
    {
        let _ = (job, node);
        if let Some(endpoint) = &config.otlp_endpoint {
            return Err(NodeError::Otlp(format!(
                "--otlp-endpoint {endpoint}: this binary was built without span export; build it with the `otlp` cargo feature (`flotilla = {{ features = [\"otlp\"] }}`, or `--features flotilla/otlp`), or drop the setting"
            )));
        }
        let _ = registry.try_init();
        Ok(TelemetryGuard::default())
    }
}

/// What a driver gets while the job runs.
#[derive(Debug, Clone)]
pub struct NodeHandle {
    /// The broker the job uses.
    pub broker: SharedBroker,
    /// Stops the job gracefully.
    pub stopper: JobStopper,
    /// Whether the broker is the embedded one (nothing outside this process can feed it).
    pub embedded: bool,
    /// The job's run id.
    pub run_id: String,
    /// This node's id.
    pub node_id: String,
}

/// Runs `job` with `args`; `driver` runs beside it (it may feed the embedded broker
/// and stop the job). Returns when the job ends.
///
/// # Errors
/// [`NodeError`] when the broker or job fails.
pub fn run<F, Fut>(job: Job, args: NodeArgs, driver: F) -> Result<(), NodeError>
where
    F: FnOnce(NodeHandle) -> Fut + 'static,
    Fut: Future<Output = ()> + 'static,
{
    let config = args.resolve()?;
    let node_id = config.node_id.clone().unwrap_or_else(default_node_id);
    let _telemetry = init_telemetry(&config, job.name(), &node_id)?;
    exit_on_panic_outside_tasks();
    // A token file that cannot be used stops the node before it connects.
    let http_settings = crate::http::Settings {
        token: if config.http.is_some() { config.http_token()? } else { None },
        hosts: config.http_hosts.clone().unwrap_or_default(),
    };
    // Installed before the job starts: the actors' metric handles are made then.
    let recorder = match &config.http {
        Some(_) => Some(crate::http::install_recorder()?),
        None => None,
    };
    let system = actix::System::new();
    system.block_on(async move {
        let broker = connect_config(&config, &node_id).await?;
        let embedded = config.urls().is_empty();
        let job = match &config.run_id {
            Some(id) => job.run_id(id.clone()),
            None => job,
        };
        let job = job.replicas(config.replicas()?);
        let name = job.name().to_owned();
        // Listening before the job starts: an address that cannot be served stops the
        // node before it takes any partition.
        if let (Some(addr), Some(recorder)) = (&config.http, recorder) {
            let served = crate::http::Served { job: name.clone(), node: node_id.clone(), broker: broker.clone() };
            let endpoint = crate::http::serve(addr, served, recorder, http_settings)?;
            // One line a script can read to find a port chosen with :0.
            info!(addr = %endpoint.addr, url = %format!("http://{}/", endpoint.addr), "dashboard and metrics");
        }
        let running = if embedded {
            // One process holds the whole embedded broker: no cluster to join.
            job.start(broker.clone()).await?
        } else {
            job.start_node(broker.clone(), &node_id, config.cluster_config()?).await?
        };
        let info = broker.server();
        info!(job = %name, node = %node_id, broker = ?info.kind, server = %info.version, run = %running.run_id(), "job started");
        let handle = NodeHandle {
            broker,
            stopper: running.stopper(),
            embedded,
            run_id: running.run_id().to_owned(),
            node_id: node_id.clone(),
        };
        let stopper = running.stopper();
        // A stop ends in time whatever the network does: the job bounds each step, and
        // a watchdog ends the process if it still runs a little after that.
        let watchdog = StopWatchdog::new(running.stop_deadline() + WATCHDOG_GRACE);
        let on_signal = watchdog.clone();
        actix::spawn(async move {
            wait_for_signal().await;
            warn!("signal received: stopping gracefully (send another to exit at once)");
            on_signal.arm();
            stopper.stop();
            wait_for_signal().await;
            warn!("second signal: exiting now");
            std::process::exit(130);
        });
        if let Some(mut left) = running.left() {
            // Leaving the cluster (stop, shutdown, drain, end): the same bound.
            let on_leave = watchdog.clone();
            actix::spawn(async move {
                if left.wait_for(Option::is_some).await.is_ok() {
                    on_leave.arm();
                }
            });
        }
        actix::spawn(driver(handle));
        let left = running.left();
        let result = running.wait().await;
        if let Some(reason) = left.and_then(|rx| *rx.borrow()) {
            info!(node = %node_id, ?reason, "node left the cluster");
        }
        result.map_err(NodeError::from)
    })
}

/// How long past its job's stop deadline a stopping node may still run before the
/// watchdog ends it.
const WATCHDOG_GRACE: Duration = Duration::from_secs(2);

/// The exit status of a node whose stop did not finish in time.
pub const STOP_TIMED_OUT_STATUS: i32 = 75;

/// Ends the process once a stop has taken longer than it can (its steps are bounded;
/// this is the backstop for one that is not, such as a broker call that never answers).
#[derive(Clone)]
struct StopWatchdog {
    after: Duration,
    armed: std::sync::Arc<std::sync::Once>,
}

impl StopWatchdog {
    fn new(after: Duration) -> Self {
        Self { after, armed: std::sync::Arc::new(std::sync::Once::new()) }
    }

    /// Starts the countdown (once): a thread of its own, so a wedged runtime cannot
    /// hold it up.
    fn arm(&self) {
        let after = self.after;
        self.armed.call_once(|| {
            std::thread::spawn(move || {
                std::thread::sleep(after);
                tracing::error!(
                    after = ?after,
                    status = STOP_TIMED_OUT_STATUS,
                    "the stop did not finish in time: exiting without handing over what is left (unacknowledged messages come again after ack-wait, leases expire on their own)"
                );
                eprintln!("flotilla: the stop did not finish within {after:?}; exiting with status {STOP_TIMED_OUT_STATUS}");
                std::process::exit(STOP_TIMED_OUT_STATUS);
            });
        });
    }
}

/// The exit status of a node that panicked outside a task's code (EX_SOFTWARE).
pub const PANIC_EXIT_STATUS: i32 = 70;

/// Makes a panic outside a task's own code end the process with
/// [`PANIC_EXIT_STATUS`]: the actor it happened in is gone, and a node that kept
/// running would keep renewing leases it no longer serves (a zombie). Its partitions
/// move once the leases expire. Panics in task code (`process`, hooks, deferred and
/// blocking work, `Deserialize`) are caught and handled by the task's failure policy
/// ([`flotilla_actors::supervise`]); they are only logged here.
pub fn exit_on_panic_outside_tasks() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        if flotilla_actors::supervise::in_task_code() {
            // Caught where it happened and handled there (a failed attempt or task).
            return;
        }
        let thread = std::thread::current();
        tracing::error!(
            thread = thread.name().unwrap_or("unnamed"),
            panic = %info,
            "panic outside task code: the node exits so that its partitions move to live nodes"
        );
        std::process::exit(PANIC_EXIT_STATUS);
    }));
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// `run_from_args` for [`Job`].
pub trait JobRunner {
    /// Parses [`NodeArgs`] from the command line and runs the job until it ends or a
    /// signal stops it.
    ///
    /// # Errors
    /// [`NodeError`] when the broker or job fails.
    fn run_from_args(self) -> Result<(), NodeError>;
}

impl JobRunner for Job {
    fn run_from_args(self) -> Result<(), NodeError> {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            node: NodeArgs,
            /// Without a command the binary runs a node of the job; with one it controls
            /// the job's running nodes or feeds its streams.
            #[command(subcommand)]
            command: Option<JobCommand>,
        }
        #[derive(clap::Subcommand)]
        enum JobCommand {
            /// Publish records into one of the job's streams (values as JSON, typed).
            Publish(crate::publish::PublishArgs),
            #[command(flatten)]
            Control(ControlCommand),
        }
        let cli = <Cli as clap::Parser>::parse();
        match cli.command {
            Some(JobCommand::Control(command)) => {
                std::process::exit(control_typed(&cli.node, self.name(), command, self.stream_types()))
            }
            Some(JobCommand::Publish(args)) => {
                std::process::exit(publish(&cli.node, self.name(), &args, self.stream_types()))
            }
            None => run(self, cli.node, |_| async {}),
        }
    }
}

/// Runs a control command against the running nodes of `job` and returns the exit code
/// (0 done, 1 not done in time, 2 refused or bad input). Prints what happens.
pub fn control(args: &NodeArgs, job: &str, command: ControlCommand) -> i32 {
    control_typed(args, job, command, &[])
}

/// As [`control`], in a binary that knows the job's stream types.
pub fn control_typed(args: &NodeArgs, job: &str, command: ControlCommand, types: &[StreamType]) -> i32 {
    with_nats(args, "control commands", move |broker, _| async move {
        crate::client::run_command_typed(broker, job, command, types).await
    })
}

/// Publishes records into `job`'s stream as `publish` describes (see
/// [`crate::publish`]); returns the exit code (0 sent, 1 broker failure, 2 bad input).
pub fn publish(args: &NodeArgs, job: &str, publish: &crate::publish::PublishArgs, types: &[StreamType]) -> i32 {
    with_nats(args, "publish", move |broker, replicas| async move {
        crate::client::exit_code(crate::publish::publish(&broker, job, publish, types, replicas).await.map(drop))
    })
}

/// Connects to the NATS server `args` name (refusing the embedded broker: `what` must
/// reach other processes) and runs `body` on a current-thread runtime; returns its
/// exit code.
fn with_nats<'a, F, Fut>(args: &NodeArgs, what: &str, body: F) -> i32
where
    F: FnOnce(SharedBroker, usize) -> Fut + 'a,
    Fut: Future<Output = i32> + 'a,
{
    let config = match args.resolve() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    if config.urls().is_empty() {
        eprintln!(
            "error: {what} needs --nats URL (or FLOTILLA_NATS): it talks to the job through NATS, and the embedded broker lives inside one process"
        );
        return 2;
    }
    let replicas = match config.replicas() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let _ =
        init_logging(&NodeConfig { log: Some(config.log.clone().unwrap_or_else(|| "warn".into())), ..config.clone() });
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return 1;
        }
    };
    runtime.block_on(async move {
        let broker = match connect_config(&config, "flotilla-control").await {
            Ok(b) => b,
            Err(e) => {
                eprintln!("error: {e}");
                return 1;
            }
        };
        body(broker, replicas).await
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs in a child process (this test binary again, with `FLOTILLA_PANIC_CHILD`):
    /// a panic in task code is survived, one outside it ends the process with 70.
    #[test]
    fn a_panic_outside_task_code_ends_the_process_and_one_inside_does_not() {
        if std::env::var_os("FLOTILLA_PANIC_CHILD").is_some() {
            exit_on_panic_outside_tasks();
            let caught = flotilla_actors::supervise::supervised(|| panic!("in a handler"));
            assert!(caught.is_err());
            eprintln!("survived the handler's panic");
            let _ =
                std::thread::Builder::new().name("timers".into()).spawn(|| panic!("in the run loop")).map(|t| t.join());
            eprintln!("still running after a panic outside task code");
            std::process::exit(0);
        }
        let exe = std::env::current_exe().expect("test binary");
        let out = std::process::Command::new(exe)
            .args(["--exact", "runner::tests::a_panic_outside_task_code_ends_the_process_and_one_inside_does_not"])
            .args(["--nocapture", "--test-threads=1"])
            .env("FLOTILLA_PANIC_CHILD", "1")
            .output()
            .expect("run the child");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(PANIC_EXIT_STATUS), "{stderr}");
        assert!(stderr.contains("survived the handler's panic"), "{stderr}");
        assert!(!stderr.contains("still running"), "{stderr}");
    }
}
