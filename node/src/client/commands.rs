//! The control commands as subcommands of `flotilla` and of every job binary, how each
//! runs, and its exit code.

use super::{ControlClient, ControlError, print_status};
use flotilla_proto::cluster::control::PauseRecord;
use flotilla_transport::broker::SharedBroker;
use std::time::Duration;

/// A control command (a subcommand of `flotilla` and of every job binary).
#[derive(Debug, Clone, clap::Subcommand)]
pub enum ControlCommand {
    /// Show nodes, leases with their epochs, in-flight work, deliveries, backlog and the DLQ.
    #[command(
        after_help = "Example:\n  flotilla --job relay status\n  flotilla --job relay status --json | jq .partitions"
    )]
    Status {
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Append a drain marker to every ordered partition and wait until all are processed.
    #[command(
        after_help = "Examples:\n  flotilla --job relay drain --deadline 5m\n  flotilla --job relay drain --cancel"
    )]
    Drain {
        /// Give up (exit 1, naming what is stuck) after this long.
        #[arg(long, default_value = "2m", value_parser = crate::config::parse_duration)]
        deadline: Duration,
        /// The run to drain (default: the current one; another one is refused).
        #[arg(long)]
        run: Option<String>,
        /// Cancel a pending drain instead: a new run begins, so nodes started from now
        /// on pass the old run's markers (nodes still running keep draining until restarted).
        #[arg(long, conflicts_with = "run")]
        cancel: bool,
    },
    /// Make one node leave gracefully (its partitions move with no redelivery).
    #[command(after_help = "Example:\n  flotilla --job relay stop --node b")]
    Stop {
        /// The node id (see `status`).
        #[arg(long)]
        node: String,
        /// How long to wait for it to leave.
        #[arg(long, default_value = "60s", value_parser = crate::config::parse_duration)]
        timeout: Duration,
    },
    /// Make every node leave and exit; waits until each has.
    #[command(after_help = "Example:\n  flotilla --job relay shutdown --timeout 2m")]
    Shutdown {
        /// How long to wait for the nodes to leave.
        #[arg(long, default_value = "60s", value_parser = crate::config::parse_duration)]
        timeout: Duration,
    },
    /// Stop intake for the job, a stream or one partition.
    #[command(after_help = "Example:\n  flotilla --job relay pause --stream relay-in --partition 3")]
    Pause {
        /// Only this stream.
        #[arg(long)]
        stream: Option<String>,
        /// Only this partition of --stream.
        #[arg(long, requires = "stream")]
        partition: Option<u32>,
    },
    /// Undo a pause (the same scope that was paused).
    #[command(after_help = "Example:\n  flotilla --job relay resume --stream relay-in --partition 3")]
    Resume {
        /// Only this stream.
        #[arg(long)]
        stream: Option<String>,
        /// Only this partition of --stream.
        #[arg(long, requires = "stream")]
        partition: Option<u32>,
    },
    /// Process exactly one message of a paused partition, or of a parked key.
    #[command(
        after_help = "Examples:\n  flotilla --job relay step --stream relay-in --partition 3\n  flotilla --job shop step --stream refunds --key customer-7"
    )]
    Step {
        /// The stream.
        #[arg(long)]
        stream: String,
        /// The partition (ordered inputs).
        #[arg(long, required_unless_present = "key", conflicts_with = "key")]
        partition: Option<u32>,
        /// The parked key (queue inputs): its oldest message runs.
        #[arg(long)]
        key: Option<String>,
    },
    /// Park one key of a queue input: its messages are set aside, in order, while the
    /// others keep flowing (until `unpark`; `step --key` lets one through).
    #[command(after_help = "Example:\n  flotilla --job shop park --stream refunds --key customer-7")]
    Park {
        /// The queue input.
        #[arg(long)]
        stream: String,
        /// The key.
        #[arg(long)]
        key: String,
    },
    /// Unpark a key: its messages set aside go back to the queue in their order.
    #[command(after_help = "Example:\n  flotilla --job shop unpark --stream refunds --key customer-7")]
    Unpark {
        /// The queue input.
        #[arg(long)]
        stream: String,
        /// The key.
        #[arg(long)]
        key: String,
    },
    /// A live view of the job in the terminal: nodes, partitions with owner, backlog,
    /// age and rate, the DLQ, drains and moves (the dashboard's view; `--http` serves it
    /// as a page).
    #[command(after_help = "Examples:\n  flotilla --job relay top\n  flotilla --job relay top --once --interval 2s")]
    Top {
        /// How often to redraw (rates are over this interval).
        #[arg(long, default_value = "2s", value_parser = crate::config::parse_duration)]
        interval: Duration,
        /// Print one screen (after one interval, for the rates) and exit.
        #[arg(long)]
        once: bool,
    },
    /// Dead letters: list, show, replay, purge.
    Dlq {
        /// What to do.
        #[command(subcommand)]
        command: crate::dlq::DlqCommand,
    },
}

/// Runs a control command for `job` over `broker`, printing what happens. Returns the
/// process exit code (0 done, 1 not done, 2 refused).
pub async fn run_command(broker: SharedBroker, job: &str, command: ControlCommand) -> i32 {
    run_command_typed(broker, job, command, &[]).await
}

/// As [`run_command`], in a binary that knows the job's stream types (`dlq show`
/// decodes payloads with them).
pub async fn run_command_typed(
    broker: SharedBroker,
    job: &str,
    command: ControlCommand,
    types: &[flotilla_actors::StreamType],
) -> i32 {
    if let ControlCommand::Dlq { command } = command {
        return crate::dlq::run(broker, job, command, types).await;
    }
    let client = match ControlClient::new(broker, job).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let result = match command {
        ControlCommand::Status { json } => client.status().await.map(|s| {
            if json {
                crate::outln!("{}", serde_json::to_string_pretty(&s).unwrap_or_default());
            } else {
                print_status(&s);
            }
        }),
        ControlCommand::Top { interval, once } => crate::top::run(&client, interval, once).await,
        ControlCommand::Drain { cancel: true, .. } => {
            client.cancel_drain().await.map(|outcome| crate::outln!("{outcome}"))
        }
        ControlCommand::Drain { deadline, run, cancel: false } => client.drain(run, deadline, true).await,
        ControlCommand::Stop { node, timeout } => client.stop(&node, timeout, true).await,
        ControlCommand::Shutdown { timeout } => client.shutdown(timeout, true).await,
        ControlCommand::Pause { stream, partition } => client
            .set_paused(stream.as_deref(), partition, true)
            .await
            .map(|r| crate::outln!("paused: {}", describe(&r))),
        ControlCommand::Resume { stream, partition } => client
            .set_paused(stream.as_deref(), partition, false)
            .await
            .map(|r| crate::outln!("paused now: {}", describe(&r))),
        ControlCommand::Step { stream, key: Some(key), .. } => client
            .step_key(&stream, &key)
            .await
            .map(|seq| crate::outln!("stepped {stream} key {key:?}: its message of sequence {seq} runs")),
        ControlCommand::Park { stream, key } => client
            .park(&stream, &key, true)
            .await
            .map(|n| crate::outln!("parked {stream} key {key:?}; {n} message(s) of it set aside so far")),
        ControlCommand::Unpark { stream, key } => client
            .park(&stream, &key, false)
            .await
            .map(|n| crate::outln!("unparked {stream} key {key:?}: {n} message(s) back in the queue, in order")),
        ControlCommand::Step { stream, partition: None, .. } => {
            Err(ControlError::Refused(format!("step --stream {stream} needs --partition P or --key K")))
        }
        ControlCommand::Step { stream, partition: Some(partition), .. } => client
            .step(&stream, partition)
            .await
            .map(|node| crate::outln!("stepped {stream}/{partition} on node {node}")),
        ControlCommand::Dlq { .. } => unreachable!("handled above"),
    };
    exit_code(result)
}

/// Prints a command's error, if any, and returns its exit code: 0 done, 2 refused (bad
/// input, unknown job), 1 not done (the broker failed, or the goal was not reached).
pub fn exit_code(result: Result<(), ControlError>) -> i32 {
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            match e {
                ControlError::Refused(_) | ControlError::UnknownJob(_) => 2,
                ControlError::Broker(_) | ControlError::Incomplete(_) => 1,
            }
        }
    }
}

fn describe(r: &PauseRecord) -> String {
    let mut parts = Vec::new();
    if r.job {
        parts.push("the whole job".to_owned());
    }
    parts.extend(r.streams.iter().map(|s| format!("stream {s}")));
    parts.extend(r.partitions.iter().cloned());
    if parts.is_empty() { "nothing".to_owned() } else { parts.join(", ") }
}
