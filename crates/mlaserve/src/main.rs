//! `mlaserve`: one binary, one subcommand per job.

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
    /// Router and one worker group in one process, on the bundled model.
    Serve(cmd::serve::Args),
    /// The public gRPC router in front of worker groups (static list or etcd).
    Router(cmd::router::Args),
    /// One worker group's leader.
    Worker(cmd::worker::Args),
    /// Stream a completion from a running server.
    Generate(cmd::generate::Args),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let result = match Cli::parse().command {
        Command::GenModel(a) => cmd::gen_model::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Router(a) => cmd::router::run(a),
        Command::Worker(a) => cmd::worker::run(a),
        Command::Generate(a) => cmd::generate::run(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line: the error and its causes, each said once (no debug dump, no
            // backtrace; RUST_LOG=debug shows more).
            eprintln!("error: {}", one_line(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// `e` and its causes joined by ": ", leaving out a cause whose text the message above
/// it already contains (thiserror's `{0}` wrappers repeat their source).
fn one_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if !out.contains(&c) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&c);
        }
    }
    out
}
