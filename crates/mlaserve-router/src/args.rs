//! Settings of `mlaserve router` (and the router half of `mlaserve serve`).

use crate::balance::RoutingPolicy;
use std::net::SocketAddr;
use std::path::PathBuf;

/// `--affinity-slack-tokens` by default: a few long prompts' worth.
pub const DEFAULT_AFFINITY_SLACK_TOKENS: u64 = 8192;

/// Router settings (clap derives the CLI flags; defaults suit one node).
#[derive(Debug, Clone, clap::Args)]
pub struct RouterArgs {
    /// Address of the public gRPC API (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Address of the Prometheus `/metrics` endpoint; none when unset.
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// Address of the OpenAI-compatible HTTP API (`/v1/chat/completions`,
    /// `/v1/completions`, `/v1/models`, `/health`, `/ready`); none when unset.
    #[arg(long)]
    pub http_listen: Option<SocketAddr>,
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
    /// How a request's group is chosen: `prefix-affinity` sends it where this router
    /// sent the longest prefix of its prompt (that group's prefix cache likely holds
    /// it) unless that group is overloaded; `least-loaded`, the fewest outstanding
    /// tokens.
    #[arg(long, value_enum, default_value_t = RoutingPolicy::PrefixAffinity)]
    pub routing_policy: RoutingPolicy,
    /// Prefix affinity's load bound: a group holding the prefix is passed over when
    /// its outstanding tokens exceed twice the least loaded group's plus this many.
    #[arg(long, default_value_t = DEFAULT_AFFINITY_SLACK_TOKENS)]
    pub affinity_slack_tokens: u64,
    #[command(flatten)]
    pub access: PublicAccess,
    #[command(flatten)]
    pub link: WorkerLink,
}

/// Who may use the public API, and over what (shared by `router` and `serve`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct PublicAccess {
    /// An API key clients must send as `authorization: Bearer <key>` (repeatable; also
    /// read from MLASERVE_API_KEY). Health checks and `/metrics` stay open.
    #[arg(long = "api-key", env = "MLASERVE_API_KEY", hide_env_values = true)]
    pub api_keys: Vec<String>,
    /// A file of API keys, one per line (`#` comments); repeatable.
    #[arg(long = "api-key-file")]
    pub api_key_files: Vec<PathBuf>,
    /// PEM certificate chain: serve the public API over TLS (needs --tls-key).
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificate(s): require clients to present a certificate it signed (mutual TLS).
    #[arg(long)]
    pub tls_client_ca: Option<PathBuf>,
    /// Also serve gRPC health alone, without TLS or key, here (for probes that cannot
    /// speak TLS, such as Kubernetes' gRPC probes).
    #[arg(long)]
    pub health_listen: Option<SocketAddr>,
}

/// How the router reaches its workers: TLS (mutual when given a certificate) and the
/// group secret the workers require.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct WorkerLink {
    /// PEM CA certificate(s) that signed the workers' certificates: connect to workers
    /// over TLS (`http://` worker addresses become `https://`).
    #[arg(long)]
    pub worker_tls_ca: Option<PathBuf>,
    /// PEM certificate the router presents to workers (mutual TLS; needs --worker-tls-key).
    #[arg(long)]
    pub worker_tls_cert: Option<PathBuf>,
    /// PEM private key of --worker-tls-cert.
    #[arg(long)]
    pub worker_tls_key: Option<PathBuf>,
    /// The name the workers' certificates carry, when it is not the host of their address.
    #[arg(long)]
    pub worker_tls_server_name: Option<String>,
    /// A file holding the group secret the workers require (their --router-secret-file).
    #[arg(long)]
    pub worker_secret_file: Option<PathBuf>,
    /// The group secret itself (set by `serve` for its embedded group; no flag).
    #[arg(skip)]
    pub worker_secret: Option<String>,
}

impl RouterArgs {
    /// Defaults for a router of `model` (tests and `serve` start from this).
    pub fn new(model: impl Into<PathBuf>) -> Self {
        RouterArgs {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            metrics_listen: None,
            http_listen: None,
            model: model.into(),
            workers: Vec::new(),
            etcd: Vec::new(),
            cluster: "default".into(),
            queue_size: 2048,
            max_message_bytes: 4 << 20,
            drain_timeout_s: 30,
            routing_policy: RoutingPolicy::PrefixAffinity,
            affinity_slack_tokens: DEFAULT_AFFINITY_SLACK_TOKENS,
            access: PublicAccess::default(),
            link: WorkerLink::default(),
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
