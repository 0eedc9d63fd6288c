//! `mlaserve bench <what>`: benchmarks that print a figure beside what bounds it.

use anyhow::Context;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, clap::Subcommand)]
enum What {
    /// Host time per engine step (scheduling, verification, drafting bookkeeping) with a
    /// synthetic backend, so the figure is the engine's own cost.
    Engine(EngineArgs),
    /// Greedy draft acceptance per draft position on a prompt set (CPU backend).
    Acceptance(AcceptanceArgs),
    /// Concurrent streaming clients against a running router: TTFT, inter-token and
    /// end-to-end latency percentiles, throughput.
    Serve(super::bench_serve::Args),
    /// The padded MLA decode kernel against the copy bandwidth and the cuBLAS GEMM rate
    /// measured in the same run (needs `--features cuda` and a GPU).
    MlaDecode(MlaArgs),
    /// The expanded-form MLA prefill attention (and the whole prefill path: latent gather,
    /// K/V up-projection, kernel) against the cuBLAS GEMM rate measured in the same run,
    /// beside the absorbed path where it is not too slow (needs `--features cuda` and a GPU).
    MlaPrefill(PrefillArgs),
    /// One decode step at DeepSeek-V3's dimensions (random weights) against its roofline,
    /// on one GPU or a tensor-parallel group (needs `--features cuda` and the GPUs).
    Step(StepArgs),
    /// The tensor-parallel all-reduce inside a CUDA graph (the one-shot kernels over peer
    /// memory and NCCL's) beside a copy kernel of the same size, on GPUs of one process
    /// (needs `--features cuda` and the GPUs).
    AllReduce(AllReduceArgs),
    /// How fast a checkpoint loads onto a GPU, beside the disk's and the page cache's
    /// read rates of the same files, measured in the same run.
    Load(super::bench_load::Args),
}

#[derive(Debug, clap::Args)]
struct AllReduceArgs {
    /// First CUDA device (the ranks use `device..device + tp`).
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Ranks, one GPU (and thread) each.
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Message sizes in floats (a decode step sends rows × hidden).
    #[arg(long, value_delimiter = ',', default_values_t = [256, 1024, 4096, 7168, 28672, 65536, 131072, 458752])]
    floats: Vec<usize>,
    /// Timed replays per size.
    #[arg(long, default_value_t = 50)]
    iters: usize,
    /// The lines kernel up to this many bytes (the backend's `--peer-lines-bytes`);
    /// the flag-barrier kernel at every size.
    #[arg(long, value_name = "BYTES", default_value_t = 2 << 20)]
    peer_lines_bytes: usize,
}

#[derive(Debug, clap::Args)]
struct StepArgs {
    /// First CUDA device (a group uses `device..device + tp`).
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Tensor-parallel ranks, one GPU (and thread) each, NCCL between them.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Target dense layers, first (V3 has 3).
    #[arg(long, default_value_t = 1)]
    dense_layers: usize,
    /// Target MoE layers (after the dense ones; plus one MTP layer). V3 has 58.
    #[arg(long, default_value_t = 2)]
    moe_layers: usize,
    /// Projections and experts in fp8 with 128 × 128 block scales, on the fp8 GEMMs
    /// (V3's checkpoint precision) instead of bf16.
    #[arg(long)]
    fp8: bool,
    /// Run one rank's shard of a tensor-parallel group of N GPUs alone on one GPU (its
    /// weights and KV, without the collectives), e.g. `--shard-of 8` for TP 8's memory.
    #[arg(long, default_value_t = 1, conflicts_with = "tp")]
    shard_of: usize,
    /// Size the KV cache from the device's memory as a worker does and print the plan.
    #[arg(long)]
    gpu_memory_utilization: Option<f64>,
    /// Batch sizes (requests per step), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 8, 64])]
    batches: Vec<usize>,
    /// Drafts per step to time (k; each step then runs k MTP stages), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [0, 3])]
    ks: Vec<usize>,
    /// Conditional acceptance per draft position (e.g. the bundled model's, as the engine
    /// measures it on its held-out prompts: 0.907,0.930,0.912): the report adds each k's
    /// projected tokens per second per batch size and the best k.
    #[arg(long, value_delimiter = ',')]
    acceptance: Vec<f64>,
    /// After each batch size's fixed-k steps, run this many steps whose k the engine's
    /// adaptive policy chooses, accepting drafts at `--acceptance`: the k it chooses and
    /// its tokens/s beside the best fixed k's (one rank; `--ks` must list 0 ..= the max).
    #[arg(long, default_value_t = 0, requires = "acceptance")]
    adaptive: usize,
    /// Cached tokens per request before the step.
    #[arg(long, default_value_t = 1024)]
    context: usize,
    /// Run the ranks as threads of one process instead of one process per rank.
    #[arg(long)]
    threads: bool,
    /// Also time each phase of one step (target forward and the first MTP stage).
    #[arg(long)]
    profile: bool,
    /// Copy every row's logits to the host (what sampled requests need) instead of only
    /// each row's argmax, computed on the device (greedy verification and drafting).
    #[arg(long)]
    host_logits: bool,
    /// Launch every kernel from the host: no CUDA graphs for the decode steps.
    #[arg(long)]
    eager: bool,
    /// The batch-invariant options (`--batch-invariant` of serve): tensor-core invariant
    /// GEMMs, fixed-size decode splits.
    #[arg(long)]
    batch_invariant: bool,
    #[command(flatten)]
    cuda: super::backend::CudaFlags,
    /// Prefill chunks to time after the decode steps, as REQUESTSxTOKENS (each chunk over
    /// the cached `--context`), comma-separated; `none` times none. Default 1x2048,4x512,16x128.
    #[arg(long, value_delimiter = ',')]
    prefill: Vec<String>,
    /// (Internal) this process is rank R of a `--tp` group started by rank 0.
    #[arg(long, hide = true, requires = "nccl_id")]
    rank: Option<usize>,
    /// (Internal) the group's NCCL id, hex.
    #[arg(long, hide = true)]
    nccl_id: Option<String>,
}

#[derive(Debug, clap::Args)]
struct MlaArgs {
    /// CUDA device.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Only these head counts (comma-separated; default 16,32,64,128).
    #[arg(long, value_delimiter = ',')]
    heads: Vec<usize>,
    /// Only these query lengths (comma-separated; default 1,2,4).
    #[arg(long, value_delimiter = ',')]
    q_len: Vec<usize>,
    /// Time every configuration with each of these split-KV counts instead of the
    /// planner's choice (tuning the planner).
    #[arg(long, value_delimiter = ',')]
    splits: Vec<usize>,
    /// Compare these tensor-core kernels (comma-separated: mma.sync, wgmma-ss, wgmma-t,
    /// auto; default auto, the production choice).
    #[arg(long, value_delimiter = ',')]
    kernel: Vec<String>,
    /// Only these batch sizes (comma-separated; default 64,128).
    #[arg(long, value_delimiter = ',')]
    batch: Vec<usize>,
    /// Only these cached lengths in tokens (comma-separated; default 4096,8192).
    #[arg(long, value_delimiter = ',')]
    seq: Vec<usize>,
    /// How the 64-token kernels (wgmma-ss, wgmma-t) merge split-KV partials, each timed
    /// (comma-separated): cluster (default; two splits as a CTA pair), last-cta, kernel
    /// (the combine kernel).
    #[arg(long, value_delimiter = ',')]
    merge: Vec<String>,
    /// Time every configuration over each of these latent-cache layouts
    /// (comma-separated: auto = bf16, fp8 = 656-byte fp8 entries; default auto); with
    /// both, the table ends with the fp8 cache's speedup per configuration.
    #[arg(long, value_delimiter = ',', value_enum)]
    kv_cache_dtype: Vec<super::backend::KvCacheDtypeArg>,
}

#[derive(Debug, clap::Args)]
struct PrefillArgs {
    /// CUDA device.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Only these head counts (comma-separated; default 128,64,32,16: TP 1/2/4/8).
    #[arg(long, value_delimiter = ',')]
    heads: Vec<usize>,
    /// Only these prompt lengths in tokens (comma-separated; default 1024,4096,8192).
    #[arg(long, value_delimiter = ',')]
    lens: Vec<usize>,
    /// Only these numbers of sequences per call (comma-separated; default 1,2,4).
    #[arg(long, value_delimiter = ',')]
    batch: Vec<usize>,
    /// Cached tokens before each prompt (times a later chunk of a chunked prefill).
    #[arg(long, default_value_t = 0)]
    prefix: usize,
    /// Timed calls per configuration (the median is reported).
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Time the old absorbed path only up to this many visible (query, key) pairs × heads.
    #[arg(long, default_value_t = 150_000_000)]
    absorbed_max: u64,
    /// The attention kernel timed (mma.sync where the GPU has no wgmma).
    #[arg(long, value_enum, default_value_t = super::backend::PrefillKernelArg::Tma)]
    prefill_kernel: super::backend::PrefillKernelArg,
}

#[derive(Debug, clap::Args)]
struct AcceptanceArgs {
    /// Model directory (HF layout).
    #[arg(long)]
    model: std::path::PathBuf,
    /// JSON Lines, one prompt per line: `{"prompt": "text"}` or `{"prompt_ids": [..]}`.
    #[arg(long)]
    prompts: std::path::PathBuf,
    /// Draft tokens per step.
    #[arg(long, default_value_t = 3)]
    k: usize,
    /// New tokens per prompt (generation ignores EOS so every prompt yields this many).
    #[arg(long, default_value_t = 64)]
    max_new_tokens: u32,
    /// Use at most this many prompts.
    #[arg(long)]
    limit: Option<usize>,
}

#[derive(Debug, clap::Args)]
struct EngineArgs {
    /// Running (decoding) requests.
    #[arg(long, default_value_t = 256)]
    running: usize,
    /// Draft tokens per step (0..=4).
    #[arg(long, default_value_t = 3)]
    k: usize,
    /// Vocabulary of the synthetic model.
    #[arg(long, default_value_t = 16)]
    vocab: usize,
    /// Measured steps.
    #[arg(long, default_value_t = 500)]
    steps: usize,
    /// Sample with temperature 1 instead of greedy decoding.
    #[arg(long)]
    sampled: bool,
    /// MTP layers of the synthetic model (default: k; DeepSeek-V3 has 1).
    #[arg(long)]
    mtp_layers: Option<usize>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    match a.what {
        What::Engine(e) => {
            let cfg = mlaserve_engine::BenchConfig {
                running: e.running,
                k: e.k,
                vocab: e.vocab,
                steps: e.steps,
                sampled: e.sampled,
                mtp_layers: e.mtp_layers,
                ..Default::default()
            };
            let report = mlaserve_engine::bench_engine(&cfg).context("bench engine")?;
            println!("{report}");
            Ok(())
        }
        What::Acceptance(a) => acceptance(a),
        What::Serve(a) => super::bench_serve::run(a),
        What::MlaDecode(g) => mla_decode_bench(g),
        What::MlaPrefill(p) => mla_prefill_bench(p),
        What::Step(a) => step_bench(a),
        What::AllReduce(a) => all_reduce_bench(a),
        What::Load(a) => super::bench_load::run(a),
    }
}

#[cfg(feature = "cuda")]
fn mla_decode_bench(g: MlaArgs) -> anyhow::Result<()> {
    let mut opts = mlaserve_cuda_lab::bench::MlaDecodeBenchOpts::default();
    if !g.heads.is_empty() {
        opts.heads = g.heads;
    }
    if !g.q_len.is_empty() {
        anyhow::ensure!(g.q_len.iter().all(|&q| (1..=4).contains(&q)), "--q-len: each must be 1..=4");
        opts.q_lens = g.q_len;
    }
    if !g.splits.is_empty() {
        anyhow::ensure!(g.splits.iter().all(|&x| x >= 1), "--splits: each must be at least 1");
        opts.splits = Some(g.splits);
    }
    if !g.merge.is_empty() {
        let merges = g
            .merge
            .iter()
            .map(|m| {
                mlaserve_cuda::SplitMerge::from_name(m)
                    .ok_or_else(|| anyhow::anyhow!("--merge: unknown merge {m:?} (cluster, last-cta, kernel)"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        opts.merges = Some(merges);
    }
    if !g.batch.is_empty() {
        anyhow::ensure!(g.batch.iter().all(|&x| x >= 1), "--batch: each must be at least 1");
        opts.batches = g.batch;
    }
    if !g.seq.is_empty() {
        anyhow::ensure!(g.seq.iter().all(|&x| x >= 1), "--seq: each must be at least 1");
        opts.seq_lens = g.seq;
    }
    if !g.kernel.is_empty() {
        let kernels = g
            .kernel
            .iter()
            .map(|k| {
                mlaserve_cuda::MlaKernel::from_name(k).ok_or_else(|| {
                    anyhow::anyhow!("--kernel: unknown kernel {k:?} (mma.sync, wgmma-ss, wgmma-t, auto)")
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        opts.kernels = Some(kernels);
    }
    if !g.kv_cache_dtype.is_empty() {
        opts.kv_dtypes = g
            .kv_cache_dtype
            .iter()
            .map(|&k| match k {
                super::backend::KvCacheDtypeArg::Auto => mlaserve_core::KvCacheDtype::Auto,
                super::backend::KvCacheDtypeArg::Fp8 => mlaserve_core::KvCacheDtype::Fp8,
            })
            .collect();
    }
    println!("{}", mlaserve_cuda_lab::bench::bench_mla_decode_on(g.device, &opts)?);
    Ok(())
}

#[cfg(feature = "cuda")]
fn mla_prefill_bench(p: PrefillArgs) -> anyhow::Result<()> {
    let mut opts = mlaserve_cuda_lab::bench_prefill::PrefillBenchOpts::default();
    for (name, list, dst) in [
        ("--heads", p.heads, &mut opts.heads),
        ("--lens", p.lens, &mut opts.prompt_lens),
        ("--batch", p.batch, &mut opts.batches),
    ] {
        if !list.is_empty() {
            anyhow::ensure!(list.iter().all(|&x| x >= 1), "{name}: each must be at least 1");
            *dst = list;
        }
    }
    anyhow::ensure!(p.iters >= 1, "--iters must be at least 1");
    opts.prefix = p.prefix;
    opts.iters = p.iters;
    opts.absorbed_max = p.absorbed_max;
    opts.kernel = super::backend::CudaFlags { prefill_kernel: p.prefill_kernel, ..Default::default() }
        .apply(mlaserve_cuda::CudaOptions::new(0, 0))
        .prefill_kernel;
    println!("{}", mlaserve_cuda_lab::bench_prefill::bench_mla_prefill_on(p.device, &opts)?);
    Ok(())
}

/// `--prefill`'s REQUESTSxTOKENS.
#[cfg(feature = "cuda")]
fn parse_chunk(p: &str) -> anyhow::Result<(usize, usize)> {
    let (b, t) = p
        .split_once('x')
        .and_then(|(b, t)| Some((b.trim().parse::<usize>().ok()?, t.trim().parse::<usize>().ok()?)))
        .with_context(|| format!("--prefill: {p:?} is not REQUESTSxTOKENS (e.g. 4x512)"))?;
    anyhow::ensure!(b >= 1 && t >= 1, "--prefill: {p:?} needs at least 1 request of 1 token");
    Ok((b, t))
}

#[cfg(feature = "cuda")]
fn step_bench(a: StepArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.tp >= 1, "--tp must be at least 1");
    let cfg = mlaserve_cuda_lab::bench_step::v3_config_with(a.dense_layers, a.moe_layers)?;
    cfg.check_tp(a.tp).with_context(|| format!("--tp {}", a.tp))?;
    cfg.check_tp(a.shard_of).with_context(|| format!("--shard-of {}", a.shard_of))?;
    if let Some(u) = a.gpu_memory_utilization {
        anyhow::ensure!(u > 0.0 && u <= 1.0, "--gpu-memory-utilization {u} is not in (0, 1]");
    }
    anyhow::ensure!(a.batches.iter().all(|&b| b > 0), "--batches: every batch size must be positive");
    let kmax = mlaserve_engine::MAX_SPECULATIVE_TOKENS;
    anyhow::ensure!(!a.ks.is_empty() && a.ks.iter().all(|&k| k <= kmax), "--ks: each k must be 0 ..= {kmax}");
    anyhow::ensure!(a.acceptance.iter().all(|r| (0.0..=1.0).contains(r)), "--acceptance: each rate must be in [0, 1]");
    let top = a.ks.iter().copied().max().unwrap_or(0);
    anyhow::ensure!(
        a.adaptive == 0 || (a.tp == 1 && (0..=top).all(|k| a.ks.contains(&k))),
        "--adaptive runs one rank (not --tp) and needs --ks to list every k from 0 to {top}"
    );
    let defaults = mlaserve_cuda_lab::bench_step::StepBenchOpts::default();
    let prefill = match a.prefill.as_slice() {
        [] => defaults.prefill.clone(),
        [none] if none == "none" => Vec::new(),
        list => list.iter().map(|p| parse_chunk(p)).collect::<anyhow::Result<Vec<_>>>()?,
    };
    let opts = mlaserve_cuda_lab::bench_step::StepBenchOpts {
        ordinal: a.device,
        tp: a.tp,
        dense_layers: a.dense_layers,
        moe_layers: a.moe_layers,
        fp8: a.fp8,
        shard_of: a.shard_of,
        gpu_memory_utilization: a.gpu_memory_utilization,
        batches: a.batches.clone(),
        ks: a.ks.clone(),
        acceptance: a.acceptance.clone(),
        adaptive_cycles: a.adaptive,
        context: a.context,
        profile: a.profile,
        host_logits: a.host_logits,
        eager: a.eager,
        batch_invariant: a.batch_invariant,
        base: a.cuda.apply(mlaserve_cuda::CudaOptions::new(0, 0)),
        prefill,
        ..defaults
    };
    let prefill_arg = if opts.prefill.is_empty() {
        "none".to_string()
    } else {
        opts.prefill.iter().map(|(b, t)| format!("{b}x{t}")).collect::<Vec<_>>().join(",")
    };
    if a.tp == 1 || a.threads {
        let how = if a.tp > 1 { "ranks: threads of one process" } else { "one rank" };
        println!("{}({how})", mlaserve_cuda_lab::bench_step::bench_step(&opts)?);
        return Ok(());
    }
    let timeout = std::time::Duration::from_secs(300);
    let init = |rank, id| mlaserve_cuda::TpInit { rank, world: a.tp, id, timeout };
    if let (Some(rank), Some(hex)) = (a.rank, &a.nccl_id) {
        let id = (0..hex.len())
            .step_by(2)
            .map(|i| hex.get(i..i + 2).and_then(|b| u8::from_str_radix(b, 16).ok()))
            .collect::<Option<Vec<u8>>>()
            .context("--nccl-id is not hex")?;
        mlaserve_cuda_lab::bench_step::bench_step_rank(&opts, Some(&init(rank, id)))?;
        return Ok(());
    }
    // Rank 0 here, ranks 1.. as processes of this same command, one GPU each.
    let id = mlaserve_cuda::TpInit::new_id()?;
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    let exe = std::env::current_exe().context("locating this executable")?;
    let mut children = (1..a.tp)
        .map(|r| {
            std::process::Command::new(&exe)
                .args(["bench", "step", "--device", &a.device.to_string(), "--tp", &a.tp.to_string()])
                .args(["--moe-layers", &a.moe_layers.to_string(), "--context", &a.context.to_string()])
                .args(["--dense-layers", &a.dense_layers.to_string()])
                .args(a.fp8.then_some("--fp8"))
                .args(a.gpu_memory_utilization.map(|u| format!("--gpu-memory-utilization={u}")))
                .args(["--batches", &a.batches.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(",")])
                .args(["--ks", &a.ks.iter().map(|k| k.to_string()).collect::<Vec<_>>().join(",")])
                .args(["--rank", &r.to_string(), "--nccl-id", &hex])
                .args(a.profile.then_some("--profile"))
                .args(a.host_logits.then_some("--host-logits"))
                .args(a.eager.then_some("--eager"))
                .args(a.batch_invariant.then_some("--batch-invariant"))
                .args(a.cuda.to_args())
                .args(["--prefill", &prefill_arg])
                .spawn()
                .with_context(|| format!("starting rank {r}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let report = mlaserve_cuda_lab::bench_step::bench_step_rank(&opts, Some(&init(0, id)));
    if report.is_err() {
        // The others may wait for rank 0 forever (NCCL init): stop them.
        for c in &mut children {
            let _ = c.kill();
        }
    }
    for (r, c) in children.iter_mut().enumerate() {
        let st = c.wait()?;
        anyhow::ensure!(st.success(), "rank {} exited with {st}", r + 1);
    }
    println!("{}(ranks: one process each)", report?);
    Ok(())
}

#[cfg(not(feature = "cuda"))]
const NO_CUDA: &str = "GPU benchmarks need a build with CUDA: `cargo build --release -p mlaserve --features cuda`";

#[cfg(not(feature = "cuda"))]
fn mla_decode_bench(g: MlaArgs) -> anyhow::Result<()> {
    anyhow::bail!("bench mla-decode --device {}: {NO_CUDA}", g.device)
}

#[cfg(not(feature = "cuda"))]
fn mla_prefill_bench(p: PrefillArgs) -> anyhow::Result<()> {
    anyhow::bail!("bench mla-prefill --device {}: {NO_CUDA}", p.device)
}

#[cfg(feature = "cuda")]
fn all_reduce_bench(a: AllReduceArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.tp >= 2, "--tp: an all-reduce needs at least 2 ranks");
    anyhow::ensure!(a.floats.iter().all(|&n| n >= 1), "--floats: each must be at least 1");
    anyhow::ensure!(a.iters >= 1, "--iters: at least 1");
    let r = mlaserve_cuda_lab::bench_comm::bench_all_reduce(a.device, a.tp, &a.floats, a.peer_lines_bytes, a.iters)?;
    print!("{r}");
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn all_reduce_bench(a: AllReduceArgs) -> anyhow::Result<()> {
    anyhow::bail!("bench all-reduce --tp {} --device {}: {NO_CUDA}", a.tp, a.device)
}

#[cfg(not(feature = "cuda"))]
fn step_bench(a: StepArgs) -> anyhow::Result<()> {
    anyhow::bail!("bench step --tp {} --device {}: {NO_CUDA}", a.tp, a.device)
}

fn read_prompts(a: &AcceptanceArgs, tok: &mlaserve_model::Tokenizer) -> anyhow::Result<Vec<Vec<u32>>> {
    let text = std::fs::read_to_string(&a.prompts).with_context(|| format!("--prompts {}", a.prompts.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("--prompts {}: line {} is not JSON", a.prompts.display(), i + 1))?;
        let ids = if let Some(ids) = v.get("prompt_ids").and_then(|x| x.as_array()) {
            ids.iter().map(|x| x.as_u64().map(|n| n as u32)).collect::<Option<Vec<u32>>>()
        } else {
            v.get("prompt").and_then(|x| x.as_str()).and_then(|t| tok.encode(t, true).ok())
        };
        let ids = ids.with_context(|| {
            format!("--prompts {}: line {} needs \"prompt\" (text) or \"prompt_ids\"", a.prompts.display(), i + 1)
        })?;
        out.push(ids);
    }
    if let Some(n) = a.limit {
        out.truncate(n);
    }
    anyhow::ensure!(!out.is_empty(), "--prompts {}: no prompts", a.prompts.display());
    Ok(out)
}

/// Runs every prompt greedily with `k` drafts and reports, per draft position `d`, the
/// conditional acceptance `P(draft d accepted | drafts 1..d-1 accepted)`.
fn acceptance(a: AcceptanceArgs) -> anyhow::Result<()> {
    use mlaserve_engine::{Engine, EngineConfig, Event, Request, SamplingParams};
    let cfg = mlaserve_model::load_config(&a.model).with_context(|| format!("--model {}", a.model.display()))?;
    let tok = mlaserve_model::Tokenizer::from_dir(&a.model, &cfg)?;
    let prompts = read_prompts(&a, &tok)?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) + a.max_new_tokens as usize;
    let blocks = prompts.len() * longest.div_ceil(mlaserve_core::BLOCK_SIZE) + 16;
    let backend = mlaserve_cpu::CpuBackend::load(&a.model, blocks)?;
    let ecfg = EngineConfig { num_speculative_tokens: Some(a.k), max_num_seqs: 64, ..Default::default() };
    let mut e = Engine::new(backend, ecfg)?;
    let params = SamplingParams { max_new_tokens: a.max_new_tokens, ignore_eos: true, ..Default::default() };
    for p in &prompts {
        e.add_request(Request::new(p.clone(), params.clone()))?;
    }
    let t0 = std::time::Instant::now();
    let mut total = mlaserve_engine::Usage::default();
    while e.has_work() {
        for (_, ev) in e.step() {
            if let Event::Finished { usage, .. } = ev {
                total.accumulate(&usage);
            }
        }
    }
    println!(
        "{} prompts, {} new tokens each, k = {}: {} generated in {:.1} s, {} decode steps",
        prompts.len(),
        a.max_new_tokens,
        a.k,
        total.generated_tokens,
        t0.elapsed().as_secs_f64(),
        total.decode_steps
    );
    // Verification outcomes (also where max_new_tokens then cut the run).
    let mut reached = total.decode_steps;
    for (d, &acc) in total.verified_per_position.iter().enumerate() {
        let p = if reached == 0 { 0.0 } else { acc as f64 / reached as f64 };
        println!("draft position {}: accepted {acc} of {reached} reached ({:.1}%)", d + 1, 100.0 * p);
        reached = acc;
    }
    println!("mean acceptance length: {:.3}", total.mean_acceptance_length());
    Ok(())
}
