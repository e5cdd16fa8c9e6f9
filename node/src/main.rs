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
    /// Show the effective configuration (flags over FLOTILLA_* variables over the file), secrets redacted.
    Config,
    /// Control a running job's nodes (status, drain, stop, shutdown, pause, resume, step).
    #[command(flatten)]
    Control(ControlCommand),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Command::Control(command) = cli.command {
        let Some(job) = cli.job else {
            eprintln!("error: control commands need --job NAME (or FLOTILLA_JOB): the job whose nodes to control");
            std::process::exit(2);
        };
        std::process::exit(flotilla_node::runner::control(&cli.node, &job, command));
    }
    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(tools(cli))
}

async fn tools(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Info => {
            let broker = cli.node.connect("flotilla-cli").await.context("connecting to the broker")?;
            let info = broker.server();
            println!("broker:      {:?}", info.kind);
            println!("server:      {} {}", info.name, info.version);
            println!("max payload: {} bytes", info.max_payload);
            for f in Feature::ALL {
                let state = if info.supports(f) { "yes" } else { "no" };
                println!("  {:<24} {state:<4} (nats-server {}+)", f.name(), f.min_version());
            }
        }
        Command::Config => {
            let config = cli.node.resolve()?;
            print!("{}", config.to_toml_redacted());
        }
        Command::Control(_) => unreachable!("handled in main"),
    }
    Ok(())
}
