//! The `flotilla` command-line tool.

use anyhow::Context;
use clap::{Parser, Subcommand};
use flotilla_node::NodeArgs;
use flotilla_transport::broker::Feature;

#[derive(Parser)]
#[command(name = "flotilla", version, about = "Operate Flotilla jobs on NATS JetStream")]
struct Cli {
    #[command(flatten)]
    node: NodeArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Connect and show the broker's kind, version and the features Flotilla may use.
    Info,
    /// Show the effective configuration (flags over FLOTILLA_* variables over the file), secrets redacted.
    Config,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
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
    }
    Ok(())
}
