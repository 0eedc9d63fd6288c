//! `mlaserve`: one binary, one subcommand per job (DESIGN §1).

mod cmd;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "mlaserve", version, about = "Serve DeepSeek-style models (MLA, DeepSeekMoE, MTP)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write a deterministic random-weight checkpoint in HF layout.
    GenModel(cmd::gen_model::Args),
    /// Benchmarks (engine, ...).
    Bench(cmd::bench::Args),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::GenModel(a) => cmd::gen_model::run(a),
        Command::Bench(a) => cmd::bench::run(a),
    }
}
