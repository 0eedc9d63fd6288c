//! Settings of `mlaserve router` (and the router half of `mlaserve serve`).

use std::net::SocketAddr;
use std::path::PathBuf;

/// Router settings (clap derives the CLI flags; defaults suit one node).
#[derive(Debug, Clone, clap::Args)]
pub struct RouterArgs {
    /// Address of the public gRPC API (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Address of the Prometheus `/metrics` endpoint; none when unset.
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// Model directory: the router reads `tokenizer.json` and `config.json` from it.
    #[arg(long)]
    pub model: PathBuf,
    /// A worker group leader's address (`host:port`); repeat for several groups.
    #[arg(long = "worker")]
    pub workers: Vec<String>,
    /// etcd endpoints (`host:port`, comma separated): discover groups there.
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Cluster name: groups are watched under `/mlaserve/<cluster>/groups/`.
    #[arg(long, default_value = "default")]
    pub cluster: String,
    /// Requests admitted at once (queued in groups or running); the next one gets
    /// RESOURCE_EXHAUSTED at once.
    #[arg(long, default_value_t = 2048, value_parser = at_least_one())]
    pub queue_size: usize,
    /// Largest request message in bytes; larger ones get RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 4 << 20, value_parser = at_least_one())]
    pub max_message_bytes: usize,
    /// On SIGTERM/Ctrl-C: seconds to let in-flight requests finish before stopping.
    #[arg(long, default_value_t = 30)]
    pub drain_timeout_s: u64,
}

impl RouterArgs {
    /// Defaults for a router of `model` (tests and `serve` start from this).
    pub fn new(model: impl Into<PathBuf>) -> Self {
        RouterArgs {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            metrics_listen: None,
            model: model.into(),
            workers: Vec::new(),
            etcd: Vec::new(),
            cluster: "default".into(),
            queue_size: 2048,
            max_message_bytes: 4 << 20,
            drain_timeout_s: 30,
        }
    }
}

/// A count flag that must be at least 1 (0 would start a server that refuses everything
/// while its health says SERVING): clap refuses it at start, naming the flag.
pub fn at_least_one() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        r: RouterArgs,
    }

    #[test]
    fn zero_limits_are_refused_naming_the_flag() {
        for flag in ["--queue-size", "--max-message-bytes"] {
            let e = Cli::try_parse_from(["router", "--model", "m", flag, "0"]).expect_err("0 refused").to_string();
            assert!(e.contains(flag), "{e}");
        }
        let ok = Cli::try_parse_from(["router", "--model", "m", "--queue-size", "1"]).expect("1 is fine");
        assert_eq!(ok.r.queue_size, 1);
    }
}
