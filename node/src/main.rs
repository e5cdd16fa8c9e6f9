//! The `flotilla` command-line tool.

use anyhow::Context;
use clap::{Parser, Subcommand};
use flotilla_node::{ControlCommand, NodeArgs};
use flotilla_transport::broker::Feature;

#[derive(Parser)]
#[command(name = "flotilla", version, about = "Operate Flotilla jobs on NATS JetStream")]
struct Cli {
    #[command(flatten)]
    node: NodeArgs,
    /// The job to control (control commands only).
    #[arg(long, env = "FLOTILLA_JOB", global = true)]
    job: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Connect and show the broker's kind, version and the features Flotilla may use.
    Info,
    /// Show the effective configuration (flags over FLOTILLA_* variables over the file, then defaults), secrets redacted.
    Config,
    /// Print a shell completion script.
    #[command(
        after_help = "Examples:\n  flotilla completions bash > ~/.local/share/bash-completion/completions/flotilla\n  flotilla completions zsh > ~/.zfunc/_flotilla"
    )]
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Publish records into a job's stream (payloads as given; job binaries take typed JSON).
    Publish(flotilla_node::publish::PublishArgs),
    /// Control a running job's nodes (status, drain, stop, shutdown, pause, resume, step, dlq).
    #[command(flatten)]
    Control(ControlCommand),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Command::Control(_) | Command::Publish(_) = cli.command {
        let Some(job) = cli.job else {
            eprintln!(
                "error: this command needs --job NAME (or FLOTILLA_JOB): the job whose nodes or streams it works on"
            );
            std::process::exit(2);
        };
        std::process::exit(match cli.command {
            Command::Publish(args) => flotilla_node::runner::publish(&cli.node, &job, &args, &[]),
            Command::Control(command) => flotilla_node::runner::control(&cli.node, &job, command),
            _ => unreachable!("matched above"),
        });
    }
    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(tools(cli))
}

async fn tools(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Info => {
            let broker = cli.node.connect("flotilla-cli").await.context("connecting to the broker")?;
            let info = broker.server();
            flotilla_node::outln!("broker:      {:?}", info.kind);
            flotilla_node::outln!("server:      {} {}", info.name, info.version);
            flotilla_node::outln!("max payload: {} bytes", info.max_payload);
            for f in Feature::ALL {
                let state = if info.supports(f) { "yes" } else { "no" };
                flotilla_node::outln!("  {:<24} {state:<4} (nats-server {}+)", f.name(), f.min_version());
            }
        }
        Command::Config => {
            let config = cli.node.resolve()?;
            flotilla_node::outln!("{}", config.to_toml_effective().trim_end());
        }
        Command::Completions { shell } => {
            let mut command = <Cli as clap::CommandFactory>::command();
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut command, "flotilla", &mut script);
            flotilla_node::outln!("{}", String::from_utf8_lossy(&script).trim_end());
        }
        Command::Control(_) | Command::Publish(_) => unreachable!("handled in main"),
    }
    Ok(())
}
