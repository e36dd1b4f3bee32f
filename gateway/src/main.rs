//! The `sluice` command: `sluice bench plugins` measures the Wasm policy host.
//! (`sluice serve` and `sluice worker` come with the gateway and worker.)

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use sluice_gateway::bench::{PluginBenchOptions, run_plugin_bench};

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "An OpenAI-compatible LLM serving gateway with Wasm policy plugins"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a benchmark; prints JSON lines, the last one a summary.
    Bench {
        #[command(subcommand)]
        which: Bench,
    },
}

#[derive(Subcommand)]
enum Bench {
    /// Cost of a KV-aware routing decision through Wasm vs native, and of swaps.
    Plugins {
        /// Folder with the built plugin components (`make plugins`).
        #[arg(long, default_value = "plugins/target/wasm32-wasip2/release")]
        plugins_dir: PathBuf,
        /// Calls per timed round at 64 workers.
        #[arg(long, default_value_t = 200_000)]
        calls: u64,
        /// Timed rounds per figure; the median is reported.
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// A short run (fewer calls and swaps), for smoke checks.
        #[arg(long)]
        quick: bool,
    },
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Bench {
            which:
                Bench::Plugins {
                    plugins_dir,
                    calls,
                    rounds,
                    quick,
                },
        } => {
            let mut options = PluginBenchOptions {
                plugins_dir,
                calls,
                rounds,
                ..PluginBenchOptions::default()
            };
            if quick {
                options.calls = options.calls.min(10_000);
                options.rounds = options.rounds.min(3);
                options.swaps = 3;
            }
            let summary = run_plugin_bench(&options, |line| println!("{line}"))
                .context("sluice bench plugins")?;
            println!("{summary}");
        }
    }
    Ok(())
}
