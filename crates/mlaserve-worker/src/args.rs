//! Settings of `mlaserve worker` (and the worker half of `mlaserve serve`).

use std::net::SocketAddr;
use std::path::PathBuf;

/// Worker group (leader) settings.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// Address of the worker API for routers (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:50061")]
    pub listen: SocketAddr,
    /// Address routers should dial (`http://host:port`), advertised in etcd; default:
    /// the listen address.
    #[arg(long)]
    pub advertise: Option<String>,
    /// Model directory (HF layout: config.json, safetensors, tokenizer.json).
    #[arg(long)]
    pub model: PathBuf,
    /// Group name (the etcd key); default: `group-<port>`.
    #[arg(long)]
    pub group: Option<String>,
    /// etcd endpoints (`host:port`, comma separated): register the group there.
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Cluster name: the group registers under `/mlaserve/<cluster>/groups/<group>`.
    #[arg(long, default_value = "default")]
    pub cluster: String,
    /// Lease TTL in seconds: how long a dead group stays registered at most.
    #[arg(long, default_value_t = 3)]
    pub lease_ttl_s: u64,
    /// KV cache blocks (64 tokens each).
    #[arg(long, default_value_t = 512)]
    pub kv_blocks: usize,
    /// Draft tokens per decode step (0..=4); default: 3 when the model has MTP layers.
    #[arg(long)]
    pub speculative_tokens: Option<usize>,
    /// Token budget of one engine step.
    #[arg(long, default_value_t = 2048)]
    pub max_batch_tokens: usize,
    /// Most requests holding cache at once.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Requests waiting in the engine beyond which submissions are refused.
    #[arg(long, default_value_t = 4096)]
    pub max_queued: usize,
    /// Address of the Prometheus `/metrics` endpoint; none when unset.
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
}

impl WorkerArgs {
    /// Defaults for a worker of `model` (tests and `serve` start from this).
    pub fn new(model: impl Into<PathBuf>) -> Self {
        WorkerArgs {
            listen: SocketAddr::from(([127, 0, 0, 1], 50061)),
            advertise: None,
            model: model.into(),
            group: None,
            etcd: Vec::new(),
            cluster: "default".into(),
            lease_ttl_s: 3,
            kv_blocks: 512,
            speculative_tokens: None,
            max_batch_tokens: 2048,
            max_num_seqs: 256,
            max_queued: 4096,
            metrics_listen: None,
        }
    }

    /// The engine configuration these settings describe.
    pub fn engine_config(&self) -> mlaserve_engine::EngineConfig {
        mlaserve_engine::EngineConfig {
            num_speculative_tokens: self.speculative_tokens,
            max_batch_tokens: self.max_batch_tokens,
            max_num_seqs: self.max_num_seqs,
            max_queued: self.max_queued,
            ..Default::default()
        }
    }
}
