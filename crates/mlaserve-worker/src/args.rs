//! Settings of `mlaserve worker` (and the worker half of `mlaserve serve`): the group's
//! server ([`WorkerArgs`]) and its engine ([`EngineArgs`], flattened into both commands
//! so each flag and default is written once).

use std::net::SocketAddr;
use std::path::PathBuf;

/// KV blocks on the CPU backend when `--kv-blocks` is not given.
pub const DEFAULT_KV_BLOCKS: usize = 512;
const DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;
const DEFAULT_MAX_BATCH_TOKENS: usize = 2048;
const DEFAULT_MAX_NUM_SEQS: usize = 256;
const DEFAULT_MAX_QUEUED: usize = 4096;

/// `--speculation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SpeculationMode {
    Adaptive,
    Fixed,
}

/// The engine of a worker group: its KV cache, batching and speculation.
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct EngineArgs {
    /// KV cache blocks (64 tokens each). Default: on the GPU, what
    /// --gpu-memory-utilization leaves after the weights and a profiled step; on the CPU,
    /// 512.
    #[arg(long)]
    pub kv_blocks: Option<usize>,
    /// GPU: the fraction of the device's memory the worker may fill (weights, the largest
    /// step's activations, the decode graphs, and the KV cache, which takes the rest).
    /// Ignored when --kv-blocks is given.
    #[arg(long, default_value_t = DEFAULT_GPU_MEMORY_UTILIZATION)]
    pub gpu_memory_utilization: f64,
    /// Longest sequence (prompt + generated tokens) a request may reach. Default: the
    /// model's `max_position_embeddings` less the drafter's headroom, clipped to what the
    /// KV cache holds for one request. Given explicitly, the worker refuses to start if
    /// one request of this length cannot fit the cache.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Draft tokens per decode step (0..=4), the most with `--speculation adaptive`;
    /// default: 3 when the model has MTP layers.
    #[arg(long)]
    pub speculative_tokens: Option<usize>,
    /// How many drafts each decode step verifies: `adaptive` picks k in
    /// 0..=--speculative-tokens before every step, for the most tokens per second by the
    /// acceptance and step times it measures (output does not depend on it); `fixed`
    /// always drafts --speculative-tokens.
    #[arg(long, value_enum, default_value_t = SpeculationMode::Adaptive)]
    pub speculation: SpeculationMode,
    /// With `--speculation adaptive`: before serving, time every k at 1, 2, 4, … up to
    /// this many decode rows on throwaway requests, so the choice starts from measured
    /// step costs (and the CUDA graphs of those shapes are captured before the first
    /// request). 0: each k is first tried on the traffic. Default: --max-num-seqs on the
    /// GPU (about a second at 256), 0 on the CPU (seconds per 16 rows).
    #[arg(long)]
    pub speculation_calibration_rows: Option<usize>,
    /// Before serving, capture the decode CUDA graphs of every batch size up to
    /// --max-num-seqs at every k the engine takes (every k with `--speculation
    /// adaptive`), on throwaway requests, so that serving replays them instead of
    /// capturing them between its steps. Default: true on the GPU (under 2 s for the
    /// bundled model at 256), false on the CPU (no graphs). No effect without CUDA graphs.
    #[arg(long, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub warm_up_graphs: Option<bool>,
    /// Token budget of one engine step.
    #[arg(long, default_value_t = DEFAULT_MAX_BATCH_TOKENS)]
    pub max_batch_tokens: usize,
    /// Most prompt tokens one step prefills while other requests decode in it (a long
    /// prompt is chunked so their streams keep flowing). Default: 128 on the CPU
    /// backend, the whole step budget on the GPU.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_prefill_tokens: Option<usize>,
    /// Most requests holding cache at once.
    #[arg(long, default_value_t = DEFAULT_MAX_NUM_SEQS)]
    pub max_num_seqs: usize,
    /// Requests waiting in the engine beyond which submissions are refused.
    #[arg(long, default_value_t = DEFAULT_MAX_QUEUED)]
    pub max_queued: usize,
    /// Prefix caching (the default): full KV blocks stay indexed by the tokens before
    /// them, so requests sharing a prefix (a system prompt, a conversation's history)
    /// prefill it once; unreferenced blocks are evicted least recently used first.
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Turns prefix caching off: every request prefills its whole prompt.
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
}

impl Default for EngineArgs {
    fn default() -> Self {
        EngineArgs {
            kv_blocks: None,
            gpu_memory_utilization: DEFAULT_GPU_MEMORY_UTILIZATION,
            max_model_len: None,
            speculative_tokens: None,
            speculation: SpeculationMode::Adaptive,
            speculation_calibration_rows: None,
            warm_up_graphs: None,
            max_batch_tokens: DEFAULT_MAX_BATCH_TOKENS,
            max_prefill_tokens: None,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
            max_queued: DEFAULT_MAX_QUEUED,
            enable_prefix_caching: false,
            no_enable_prefix_caching: false,
        }
    }
}

impl EngineArgs {
    /// The KV blocks of a backend that does not plan its memory (the CPU).
    pub fn kv_blocks_or_default(&self) -> usize {
        self.kv_blocks.unwrap_or(DEFAULT_KV_BLOCKS)
    }

    /// The engine configuration these settings describe.
    pub fn engine_config(&self) -> mlaserve_engine::EngineConfig {
        mlaserve_engine::EngineConfig {
            num_speculative_tokens: self.speculative_tokens,
            speculation: match self.speculation {
                SpeculationMode::Adaptive => mlaserve_engine::Speculation::Adaptive,
                SpeculationMode::Fixed => mlaserve_engine::Speculation::Fixed,
            },
            max_batch_tokens: self.max_batch_tokens,
            max_prefill_tokens: self.max_prefill_tokens,
            max_num_seqs: self.max_num_seqs,
            max_model_len: self.max_model_len,
            max_queued: self.max_queued,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            calibration_rows: self.speculation_calibration_rows.unwrap_or(0),
            warm_up_graphs: self.warm_up_graphs.unwrap_or(false),
            ..Default::default()
        }
    }

    /// [`EngineArgs::engine_config`] for a GPU backend: adaptive speculation is
    /// calibrated up to `--max-num-seqs` rows and the CUDA graphs of every batch size
    /// are captured before serving, unless the flags say otherwise (one H200 timed every
    /// k at 1 .. 256 rows of the bundled model in 0.6–1.5 s and captured its 421 graphs
    /// in 1.7 s; two CPU cores take 7.8 s for 1 .. 16 rows, so the CPU measures on the
    /// traffic).
    pub fn gpu_engine_config(&self) -> mlaserve_engine::EngineConfig {
        let adaptive = self.speculation == SpeculationMode::Adaptive && self.speculative_tokens != Some(0);
        let default = if adaptive { self.max_num_seqs } else { 0 };
        mlaserve_engine::EngineConfig {
            calibration_rows: self.speculation_calibration_rows.unwrap_or(default),
            warm_up_graphs: self.warm_up_graphs.unwrap_or(true),
            ..self.engine_config()
        }
    }
}

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
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address of the Prometheus `/metrics` endpoint; none when unset.
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// On SIGTERM/Ctrl-C: seconds to let in-flight requests finish (no new ones are
    /// taken meanwhile) before stopping.
    #[arg(long, default_value_t = 30)]
    pub drain_timeout_s: u64,
    #[command(flatten)]
    pub access: WorkerAccess,
}

/// Who may act as this group's router: TLS (mutual with a client CA) and a shared
/// group secret.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct WorkerAccess {
    /// PEM certificate chain: serve routers over TLS (needs --tls-key).
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificate(s): accept only routers presenting a certificate it signed
    /// (mutual TLS); others are refused at the handshake and logged.
    #[arg(long)]
    pub tls_client_ca: Option<PathBuf>,
    /// A file holding the group secret routers must send (`authorization: Bearer
    /// <secret>`); calls without it are refused with UNAUTHENTICATED and logged.
    #[arg(long)]
    pub router_secret_file: Option<PathBuf>,
    /// The secret itself (set by `serve` for its embedded group; no flag).
    #[arg(skip)]
    pub router_secret: Option<String>,
    /// Also serve gRPC health alone, without TLS or secret, here (for probes that
    /// cannot speak TLS, such as Kubernetes' gRPC probes).
    #[arg(long)]
    pub health_listen: Option<SocketAddr>,
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
            engine: EngineArgs::default(),
            metrics_listen: None,
            drain_timeout_s: 30,
            access: WorkerAccess::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        e: EngineArgs,
    }

    #[test]
    fn flag_defaults_are_the_struct_defaults() {
        let parsed = Cli::try_parse_from(["mlaserve"]).expect("parses").e;
        assert_eq!(parsed, EngineArgs::default());
        let set = Cli::try_parse_from(["mlaserve", "--max-model-len", "1000", "--kv-blocks", "7"]).expect("parses").e;
        assert_eq!((set.max_model_len, set.kv_blocks), (Some(1000), Some(7)));
        assert_eq!(parsed.kv_blocks_or_default(), DEFAULT_KV_BLOCKS);
        assert_eq!(set.engine_config().max_model_len, Some(1000));
    }

    /// Prefix caching is on unless turned off; the last of the two flags wins.
    #[test]
    fn prefix_caching_flags() {
        let on = |args: &[&str]| {
            Cli::try_parse_from([&["mlaserve"], args].concat()).expect("parses").e.engine_config().enable_prefix_caching
        };
        assert!(on(&[]));
        assert!(on(&["--enable-prefix-caching"]));
        assert!(!on(&["--no-enable-prefix-caching"]));
        assert!(!on(&["--enable-prefix-caching", "--no-enable-prefix-caching"]));
        assert!(on(&["--no-enable-prefix-caching", "--enable-prefix-caching"]));
    }

    /// Adaptive speculation is calibrated at start-up on a GPU (up to --max-num-seqs
    /// rows), not on the CPU, and never where k is fixed or 0, unless the flag says so;
    /// the graphs are warmed up on a GPU, whatever k, unless `--warm-up-graphs false`.
    #[test]
    fn start_up_defaults_by_backend() {
        let rows = |args: &[&str]| {
            let e = Cli::try_parse_from([&["mlaserve"], args].concat()).expect("parses").e;
            (e.engine_config().calibration_rows, e.gpu_engine_config().calibration_rows)
        };
        assert_eq!(rows(&[]), (0, DEFAULT_MAX_NUM_SEQS));
        assert_eq!(rows(&["--max-num-seqs", "64"]), (0, 64));
        assert_eq!(rows(&["--speculation", "fixed"]), (0, 0));
        assert_eq!(rows(&["--speculative-tokens", "0"]), (0, 0));
        assert_eq!(rows(&["--speculation-calibration-rows", "8"]), (8, 8));
        assert_eq!(rows(&["--speculation-calibration-rows", "0"]), (0, 0));
        let warm = |args: &[&str]| {
            let e = Cli::try_parse_from([&["mlaserve"], args].concat()).expect("parses").e;
            (e.engine_config().warm_up_graphs, e.gpu_engine_config().warm_up_graphs)
        };
        assert_eq!(warm(&[]), (false, true));
        assert_eq!(warm(&["--warm-up-graphs"]), (true, true));
        assert_eq!(warm(&["--warm-up-graphs", "true"]), (true, true));
        assert_eq!(warm(&["--warm-up-graphs", "false"]), (false, false));
        assert_eq!(warm(&["--warm-up-graphs=false", "--speculation", "fixed"]), (false, false));
    }
}
