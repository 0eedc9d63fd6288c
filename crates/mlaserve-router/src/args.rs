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
    #[arg(long, default_value_t = 2048)]
    pub queue_size: usize,
    /// Largest request message in bytes; larger ones get RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 4 << 20)]
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
