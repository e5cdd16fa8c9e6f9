//! Running a job as a node process: flags, logging, the broker, signals.
//!
//! `Job::run_from_args()` (through [`JobRunner`]) parses [`NodeArgs`] from the command
//! line, connects the broker (the embedded one when no `--nats` is given), starts the
//! job on an actix system and runs until the job ends or a signal arrives: the first
//! SIGTERM or SIGINT stops the job gracefully (in-flight work finishes, unstarted work
//! is handed back, positions are committed); a second one exits at once.

use crate::connect::{BrokerChoice, connect};
use flotilla_actors::{Job, JobError, JobStopper};
use flotilla_transport::broker::{BrokerError, SharedBroker};
use std::future::Future;
use tracing::{info, warn};

/// Flags every Flotilla node takes (flatten them into a job binary's own flags).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct NodeArgs {
    /// NATS server URL(s), comma-separated; without it the embedded broker is used.
    #[arg(long, env = "FLOTILLA_NATS", global = true)]
    pub nats: Option<String>,
    /// This node's id (default: host name and process id).
    #[arg(long, env = "FLOTILLA_NODE_ID", global = true)]
    pub node_id: Option<String>,
    /// Run id for drain markers (default: a new one per start).
    #[arg(long, env = "FLOTILLA_RUN_ID", global = true)]
    pub run_id: Option<String>,
    /// Log filter (tracing env-filter syntax, e.g. `info,flotilla_actors=debug`).
    #[arg(long, env = "FLOTILLA_LOG", default_value = "info", global = true)]
    pub log: String,
    /// Log as JSON lines.
    #[arg(long, env = "FLOTILLA_LOG_JSON", global = true)]
    pub log_json: bool,
}

impl NodeArgs {
    /// The broker choice these flags make.
    pub fn broker(&self) -> BrokerChoice {
        BrokerChoice::from_url(self.nats.as_deref())
    }

    /// The node id: `--node-id`, else `<hostname>-<pid>`.
    pub fn node_id(&self) -> String {
        self.node_id.clone().unwrap_or_else(|| {
            let host =
                std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_owned()).unwrap_or_else(|_| "node".into());
            format!("{host}-{}", std::process::id())
        })
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
    /// The runtime could not start.
    #[error("cannot start the runtime: {0}")]
    Runtime(String),
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
pub fn init_logging(args: &NodeArgs) -> Result<(), NodeError> {
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log)
        .map_err(|e| NodeError::LogFilter { filter: args.log.clone(), reason: e.to_string() })?;
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if args.log_json { builder.json().try_init() } else { builder.try_init() };
    Ok(())
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
    init_logging(&args)?;
    let system = actix::System::new();
    system.block_on(async move {
        let choice = args.broker();
        let node_id = args.node_id();
        let broker = connect(&choice, &node_id).await?;
        let job = match &args.run_id {
            Some(id) => job.run_id(id.clone()),
            None => job,
        };
        let name = job.name().to_owned();
        let running = job.start(broker.clone()).await?;
        let info = broker.server();
        info!(job = %name, node = %node_id, broker = ?info.kind, server = %info.version, run = %running.run_id(), "job started");
        let handle = NodeHandle {
            broker,
            stopper: running.stopper(),
            embedded: matches!(choice, BrokerChoice::Embedded),
            run_id: running.run_id().to_owned(),
            node_id,
        };
        let stopper = running.stopper();
        actix::spawn(async move {
            wait_for_signal().await;
            warn!("signal received: stopping gracefully (send another to exit at once)");
            stopper.stop();
            wait_for_signal().await;
            warn!("second signal: exiting now");
            std::process::exit(130);
        });
        actix::spawn(driver(handle));
        running.wait().await.map_err(NodeError::from)
    })
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
        }
        let cli = <Cli as clap::Parser>::parse();
        run(self, cli.node, |_| async {})
    }
}
