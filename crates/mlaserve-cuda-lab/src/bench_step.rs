//! [`bench_step`]: one decode step of a model with DeepSeek-V3's real dimensions
//! (7168 hidden, 128 heads, 512 + 64 latent, 256 experts top-8, 129280 vocabulary),
//! random weights generated on the device, as many layers as the options ask (one dense
//! layer, `moe_layers` MoE layers, one MTP layer), at several batch sizes and k, beside
//! its roofline: the bytes the step must read (weights touched + latent cache) ÷ the copy
//! bandwidth measured in the same run.
//!
//! A step with k drafts is the target forward over windows of `1 + k` tokens plus the
//! drafter's MTP stages (one over the windows, `k − 1` of one token), each returning its
//! logits to the host as the `Backend` contract says.
//!
//! With `tp > 1` the model is spread over GPUs `ordinal..ordinal + tp`, one rank per GPU,
//! each with its shard and the backend's NCCL communicator: [`bench_step`]
//! runs the ranks as threads of this process, [`bench_step_rank`] is one rank for a
//! caller that runs them as processes (the CLI does, as a worker group does); the
//! roofline is per rank (each reads its shard of the weights and of the heads' work: the
//! latent cache is read whole by every rank). The all-reduce share is the time the step's
//! collectives take alone (the same all-reduces and all-gathers, same sizes, back to back
//! on the same communicators, measured in the same run) over the step's time.

use std::fmt;
use std::time::Instant;

use mlaserve_core::{Backend, Batch, ModelConfig, SeqChunk, BLOCK_SIZE};

use crate::bench::measure_copy_bandwidth;
use crate::random::{random_backend, RandomFill};
use crate::util::Util;
use mlaserve_cuda::TpInit;
use mlaserve_cuda::{CudaBackend, CudaOptions, WeightBytes};
use mlaserve_cuda::{CudaError, Result};

/// What to run.
#[derive(Debug, Clone)]
pub struct StepBenchOpts {
    pub ordinal: usize,
    /// Target dense layers (V3 has 3), before the MoE ones.
    pub dense_layers: usize,
    /// Target MoE layers (each holds 22.5 GB of routed experts in bf16, 11.3 GB in fp8).
    pub moe_layers: usize,
    /// The projections and experts in fp8 with 128 × 128 block scales (V3's checkpoint
    /// precision, on the fp8 GEMMs) instead of bf16.
    pub fp8: bool,
    /// One rank's shard of a tensor-parallel group of this many GPUs, run alone on one
    /// GPU (its weights, heads and KV; no collectives: see `comm_ms` of a real group).
    pub shard_of: usize,
    /// Size the KV cache as a worker does (`CudaOptions::gpu_memory_utilization`) and
    /// report the plan; `None`: just the blocks the sweep needs.
    pub gpu_memory_utilization: Option<f64>,
    /// Cached tokens per request before the step.
    pub context: usize,
    pub batches: Vec<usize>,
    pub ks: Vec<usize>,
    pub iters: usize,
    /// Tensor-parallel ranks (GPUs `ordinal..ordinal + tp`).
    pub tp: usize,
    /// Every row's logits to the host (as a sampling engine needs them); off, only each
    /// row's argmax (greedy verification and drafting, on the device).
    pub host_logits: bool,
    /// After each measurement, one more step with every phase timed (a wait for the stream
    /// after each: the phases add up to more than the unprofiled step).
    pub profile: bool,
    /// Launch every kernel of a step from the host (no CUDA graphs).
    pub eager: bool,
    /// The batch-invariant options ([`CudaOptions::batch_invariant`]) instead of the
    /// defaults.
    pub batch_invariant: bool,
    /// The other backend options (kernel choices, graphs on TP ranks, capture mode); the
    /// benchmark sets the cache size, the device, `graphs` and the preset.
    pub base: CudaOptions,
    /// Prefill chunks to time after the decode sweep: (requests, new tokens each), every
    /// chunk over a cached prefix of `context` tokens, as chunked prefill runs them.
    pub prefill: Vec<(usize, usize)>,
    /// Conditional acceptance per draft position: the report projects each k's tokens per
    /// second at it ([`crate::spec_projection`]).
    pub acceptance: Vec<f64>,
    /// After each batch size's fixed-k steps, this many steps whose k the engine's
    /// adaptive policy chooses (`acceptance` drawn per request; one rank; `ks` must hold
    /// every k up to its largest): [`crate::spec_projection::run_adaptive`].
    pub adaptive_cycles: usize,
}

impl Default for StepBenchOpts {
    fn default() -> Self {
        StepBenchOpts {
            ordinal: 0,
            dense_layers: 1,
            moe_layers: 2,
            fp8: false,
            shard_of: 1,
            gpu_memory_utilization: None,
            context: 1024,
            batches: vec![1, 8, 64],
            ks: vec![0, 3],
            iters: 5,
            tp: 1,
            profile: false,
            host_logits: false,
            eager: false,
            batch_invariant: false,
            base: CudaOptions::new(0, 0),
            prefill: vec![(1, 2048), (4, 512), (16, 128)],
            acceptance: Vec::new(),
            adaptive_cycles: 0,
        }
    }
}

/// One (batch, k) measurement; times are medians in milliseconds.
#[derive(Debug, Clone)]
pub struct StepBenchRow {
    pub batch: usize,
    pub k: usize,
    pub target_ms: f64,
    pub draft_ms: f64,
    /// Bytes the step must read (weights touched + cache).
    pub bytes: f64,
    pub roofline_ms: f64,
    /// The step's collectives alone (0 for one rank).
    pub comm_ms: f64,
    /// Milliseconds per phase of one profiled step (empty unless asked for).
    pub profile: Vec<(&'static str, f64)>,
}

/// One prefill measurement: a forward over `batch` chunks of `tokens` new tokens each
/// (argmax of each chunk's last row on the device), then the drafter's first MTP stage
/// over the same rows (what a step with k > 0 runs); medians in milliseconds.
#[derive(Debug, Clone)]
pub struct PrefillStepRow {
    pub batch: usize,
    pub tokens: usize,
    pub target_ms: f64,
    pub mtp_ms: f64,
    /// Milliseconds per phase of one profiled target forward (empty unless asked for).
    pub profile: Vec<(&'static str, f64)>,
}

#[derive(Debug, Clone)]
pub struct StepBenchReport {
    pub gpu: String,
    pub copy_gbps: f64,
    pub layers: String,
    pub context: usize,
    pub tp: usize,
    /// "default" or "batch-invariant" ([`CudaOptions::batch_invariant`]).
    pub options: &'static str,
    pub rows: Vec<StepBenchRow>,
    pub prefill: Vec<PrefillStepRow>,
    /// This rank's weight bytes on the device (of which in fp8).
    pub weight_bytes: (u64, u64),
    /// The memory plan, when the cache was sized from the device's memory.
    pub memory: Option<mlaserve_core::memory::MemoryPlan>,
    /// Conditional acceptance per draft position to project tokens per second at (none:
    /// no projection).
    pub acceptance: Vec<f64>,
    /// The adaptive policy's runs, one per batch size (empty unless asked for).
    pub adaptive: Vec<crate::spec_projection::AdaptiveRun>,
}

impl fmt::Display for StepBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "bench step on {} × {}: {}; context {} tokens/request; TP {}; {} options",
            self.tp, self.gpu, self.layers, self.context, self.tp, self.options
        )?;
        writeln!(f, "ceiling: copy {:.0} GB/s per GPU (read + write, measured in this run)", self.copy_gbps)?;
        let (all, fp8) = self.weight_bytes;
        writeln!(f, "weights on the device: {:.2} GiB per rank ({:.2} GiB of it fp8)", gib(all), gib(fp8))?;
        if let Some(m) = &self.memory {
            writeln!(f, "memory plan: {m}")?;
        }
        writeln!(
            f,
            "{:>6} {:>3} {:>11} {:>10} {:>10} {:>9} {:>12} {:>8} {:>9} {:>7}",
            "batch", "k", "target_ms", "draft_ms", "step_ms", "GB_read", "roofline_ms", "%roof", "comm_ms", "%comm"
        )?;
        for r in &self.rows {
            let step = r.target_ms + r.draft_ms;
            writeln!(
                f,
                "{:>6} {:>3} {:>11.3} {:>10.3} {:>10.3} {:>9.2} {:>12.3} {:>7.1}% {:>9.3} {:>6.1}%",
                r.batch,
                r.k,
                r.target_ms,
                r.draft_ms,
                step,
                r.bytes / 1e9,
                r.roofline_ms,
                100.0 * r.roofline_ms / step,
                r.comm_ms,
                100.0 * r.comm_ms / step
            )?;
        }
        for r in &self.rows {
            write_profile(f, &format!("batch {} k {}", r.batch, r.k), &r.profile)?;
        }
        if !self.acceptance.is_empty() {
            let rates: Vec<String> = self.acceptance.iter().map(|a| format!("{a:.3}")).collect();
            writeln!(
                f,
                "speculation at acceptance {} per draft position: tokens/s = batch x expected tokens per step / \
                 step time (* the best k)",
                rates.join(" / ")
            )?;
            writeln!(
                f,
                "{:>6} {:>3} {:>12} {:>10} {:>11} {:>8}",
                "batch", "k", "tokens/step", "step_ms", "tokens/s", "x k=0"
            )?;
            let steps: Vec<_> = self.rows.iter().map(|r| (r.batch, r.k, r.target_ms + r.draft_ms)).collect();
            for p in crate::spec_projection::project(&steps, &self.acceptance) {
                let k0 = p.per_k.iter().find(|r| r.0 == 0).map(|r| r.3);
                for &(k, ms, tokens, tps) in &p.per_k {
                    let star = if k == p.best { "*" } else { "" };
                    let ratio = k0.map_or(String::from("-"), |z| format!("{:.3}", tps / z));
                    writeln!(
                        f,
                        "{:>6} {:>3} {:>12.2} {:>10.3} {:>10.0}{star:1} {:>8}",
                        p.batch, k, tokens, ms, tps, ratio
                    )?;
                }
            }
        }
        if !self.adaptive.is_empty() {
            writeln!(
                f,
                "adaptive k (the engine's policy choosing each step's k, acceptance drawn per request at the rates \
                 above): decisions per k; tokens/s measured, and projected at its decisions by the fixed steps' \
                 times; the best fixed k's projection"
            )?;
            writeln!(
                f,
                "{:>6} {:>22} {:>10} {:>10} {:>7} {:>10} {:>9}",
                "batch", "decisions k=0/1/2/..", "measured", "projected", "best k", "best tok/s", "meas/best"
            )?;
            let steps: Vec<_> = self.rows.iter().map(|r| (r.batch, r.k, r.target_ms + r.draft_ms)).collect();
            let proj = crate::spec_projection::project(&steps, &self.acceptance);
            for run in &self.adaptive {
                let Some(p) = proj.iter().find(|p| p.batch == run.batch) else { continue };
                let best = p.per_k.iter().find(|r| r.0 == p.best).map_or(f64::NAN, |r| r.3);
                let decisions: Vec<String> = run.decisions.iter().map(|n| n.to_string()).collect();
                writeln!(
                    f,
                    "{:>6} {:>22} {:>10.0} {:>10.0} {:>7} {:>10.0} {:>9.3}",
                    run.batch,
                    decisions.join("/"),
                    run.tokens_per_s(),
                    run.projected(p, &self.acceptance).unwrap_or(f64::NAN),
                    p.best,
                    best,
                    run.tokens_per_s() / best
                )?;
            }
        }
        if !self.prefill.is_empty() {
            writeln!(f, "prefill: chunks over a cached prefix of {} tokens each", self.context)?;
            writeln!(
                f,
                "{:>6} {:>7} {:>11} {:>10} {:>10} {:>12} {:>12}",
                "batch", "tokens", "target_ms", "mtp_ms", "total_ms", "target_tok/s", "total_tok/s"
            )?;
        }
        for r in &self.prefill {
            let n = (r.batch * r.tokens) as f64;
            let total = r.target_ms + r.mtp_ms;
            writeln!(
                f,
                "{:>6} {:>7} {:>11.3} {:>10.3} {:>10.3} {:>12.0} {:>12.0}",
                r.batch,
                r.tokens,
                r.target_ms,
                r.mtp_ms,
                total,
                n / r.target_ms * 1e3,
                n / total * 1e3
            )?;
        }
        for r in &self.prefill {
            write_profile(f, &format!("prefill {} x {}", r.batch, r.tokens), &r.profile)?;
        }
        Ok(())
    }
}

/// One line of phase times (`what` names the measurement); nothing for an empty profile.
fn write_profile(f: &mut fmt::Formatter<'_>, what: &str, profile: &[(&'static str, f64)]) -> fmt::Result {
    if profile.is_empty() {
        return Ok(());
    }
    let total: f64 = profile.iter().map(|p| p.1).sum();
    write!(f, "profile {what} ({total:.2} ms, each phase waited for):")?;
    for (name, ms) in profile {
        write!(f, " {name} {ms:.2};")?;
    }
    writeln!(f)
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// DeepSeek-V3's configuration with `1 + moe_layers` target layers (the first dense) and
/// one MTP layer; positions up to 8192.
pub fn v3_config(moe_layers: usize) -> Result<ModelConfig> {
    v3_config_with(1, moe_layers)
}

/// DeepSeek-V3's configuration with `dense + moe` target layers (the first `dense`
/// dense; V3 itself is 3 + 58) and one MTP layer; positions up to 8192.
pub fn v3_config_with(dense: usize, moe_layers: usize) -> Result<ModelConfig> {
    let json = format!(
        r#"{{"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": {}, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "moe_layer_freq": 1, "first_k_dense_replace": {}, "norm_topk_prob": true,
        "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": {{"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
        "tie_word_embeddings": false, "num_nextn_predict_layers": 1,
        "bos_token_id": 0, "eos_token_id": 1}}"#,
        dense + moe_layers,
        dense
    );
    ModelConfig::from_json_str(&json).map_err(|e| CudaError::Shape { kernel: "bench_step", msg: e.to_string() })
}

/// Expected distinct experts among `picks` draws of top-k of E (uniform routing).
fn distinct(w: &WeightBytes, tokens: usize) -> f64 {
    let e = w.experts_per_layer as f64;
    e * (1.0 - (1.0 - w.top_k as f64 / e).powi(tokens as i32))
}

fn core_err(e: mlaserve_core::Error) -> CudaError {
    CudaError::Shape { kernel: "bench_step", msg: e.to_string() }
}

/// `b` sequences of `len` made-up tokens at positions `start..`, sequence i on blocks
/// `i·per..(i + 1)·per`.
fn chunks(b: usize, len: usize, start: usize, per: usize, vocab: usize, prefill: bool) -> Vec<SeqChunk> {
    (0..b)
        .map(|i| SeqChunk {
            tokens: (0..len).map(|j| ((i * 7919 + j * 131) % vocab) as u32).collect(),
            start_pos: start,
            block_table: (i * per..(i + 1) * per).map(|x| x as u32).collect(),
            prefill,
        })
        .collect()
}

/// A decode window of `len` tokens for each of `b` requests after `start` cached ones:
/// every row's logits to the host, or only each row's argmax.
fn window(b: usize, len: usize, start: usize, per_seq: usize, cfg: &ModelConfig, host_logits: bool) -> Batch {
    let all = (0..(b * len) as u32).collect::<Vec<u32>>();
    let (argmax_rows, logit_rows) = if host_logits { (vec![], all) } else { (all, vec![]) };
    Batch {
        argmax_rows,
        sample_rows: vec![],
        seqs: chunks(b, len, start, per_seq, cfg.vocab_size, false),
        logit_rows,
        ..Default::default()
    }
}

/// One decode step of `b` requests with `k` drafts: the target forward over windows of
/// `1 + k` tokens, then the drafter's k MTP stages (the first over the windows, the rest
/// one token each). Returns the two parts' wall times in ms.
fn one_step(
    be: &mut CudaBackend,
    cfg: &ModelConfig,
    b: usize,
    k: usize,
    context: usize,
    per_seq: usize,
    host_logits: bool,
) -> Result<(f64, f64)> {
    let s = 1 + k;
    let target = window(b, s, context, per_seq, cfg, host_logits);
    let t0 = Instant::now();
    let out = be.forward(&target).map_err(core_err)?;
    let t1 = Instant::now();
    if k > 0 {
        let ident: Vec<u32> = (0..(b * s) as u32).collect();
        let mut prev = be.mtp_forward(0, &target, &out.hidden, &ident).map_err(core_err)?.hidden;
        for d in 1..k {
            let one = window(b, 1, context + d, per_seq, cfg, host_logits);
            let rows: Vec<u32> = (0..b).map(|i| (i * if d == 1 { s } else { 1 }) as u32).collect();
            prev = be.mtp_forward(0, &one, &prev, &rows).map_err(core_err)?.hidden;
        }
    }
    Ok(((t1 - t0).as_secs_f64() * 1e3, t1.elapsed().as_secs_f64() * 1e3))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the sweep (see the module docs).
pub fn bench_step(opts: &StepBenchOpts) -> Result<StepBenchReport> {
    if opts.tp <= 1 {
        return bench_step_rank(opts, None);
    }
    let id = TpInit::new_id()?;
    let mut results = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..opts.tp)
            .map(|rank| {
                let init =
                    TpInit { rank, world: opts.tp, id: id.clone(), timeout: std::time::Duration::from_secs(120) };
                s.spawn(move || bench_step_rank(opts, Some(&init)))
            })
            .collect();
        ranks
            .into_iter()
            .map(|r| r.join().unwrap_or_else(|_| Err(CudaError::shape("bench_step", "a rank's thread panicked"))))
            .collect::<Vec<_>>()
    });
    // Every rank timed the same steps (they wait for each other); rank 0 reports.
    for r in results.iter().skip(1) {
        if let Err(e) = r {
            return Err(CudaError::shape("bench_step", format!("a follower rank failed: {e}")));
        }
    }
    results.swap_remove(0)
}

/// Seconds the collectives of a forward over `rows` tokens take alone on `be`'s
/// communicator: one embedding all-reduce and two per block over `rows × hidden` f32, and
/// the head's all-gather for `head_rows` rows (`vocab/tp` f32 each with host logits, an
/// argmax pair each without); median of `iters`.
fn comm_seconds(
    be: &CudaBackend,
    blocks: usize,
    rows: usize,
    head_rows: usize,
    host_logits: bool,
    iters: usize,
) -> Result<f64> {
    let Some(c) = be.comm() else { return Ok(0.0) };
    let cfg = be.config();
    let s = &be.gpu().stream;
    let mut buf = s.alloc_zeros::<f32>(rows * cfg.hidden_size)?;
    let part = if host_logits { head_rows * cfg.vocab_size / c.world } else { 2 * head_rows };
    let local = s.alloc_zeros::<f32>(part)?;
    let mut all = s.alloc_zeros::<f32>(part * c.world)?;
    let mut t = Vec::new();
    for it in 0..iters + 1 {
        c.wait("comm bench")?;
        let t0 = Instant::now();
        for _ in 0..1 + 2 * blocks {
            be.all_reduce(&mut buf)?;
        }
        c.all_gather(&local, &mut all)?;
        c.wait("comm bench")?;
        if it > 0 {
            t.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(median(t))
}

/// One rank's share of the sweep (all of it for a single GPU): every rank of a group runs
/// it with the same options and its own `tp.rank`, on GPU `opts.ordinal + tp.rank`;
/// rank 0's report is the group's.
pub fn bench_step_rank(opts: &StepBenchOpts, tp: Option<&TpInit>) -> Result<StepBenchReport> {
    let cfg = v3_config_with(opts.dense_layers, opts.moe_layers)?;
    let max_b = opts.batches.iter().copied().max().unwrap_or(1);
    let per_seq = (opts.context + 8).div_ceil(BLOCK_SIZE);
    // Prefill chunks use their own blocks (after the decode sweep's), sized for the chunk.
    let prefill_blocks =
        opts.prefill.iter().map(|&(b, t)| b * (opts.context + t).div_ceil(BLOCK_SIZE)).max().unwrap_or(0);
    let ordinal = opts.ordinal + tp.map_or(0, |t| t.rank);
    let need_blocks = (max_b * per_seq).max(prefill_blocks);
    let max_k = opts.ks.iter().copied().max().unwrap_or(0);
    let profile_tokens = (max_b * (1 + max_k)).max(opts.prefill.iter().map(|&(b, t)| b * t).max().unwrap_or(0)).max(1);
    let o = CudaOptions {
        num_blocks: need_blocks,
        ordinal,
        graphs: !opts.eager,
        synthetic_fp8: opts.fp8,
        gpu_memory_utilization: opts.gpu_memory_utilization,
        profile_tokens,
        ..opts.base
    };
    let o = if opts.batch_invariant { o.batch_invariant() } else { o };
    if opts.shard_of > 1 && tp.is_some() {
        return Err(CudaError::shape("bench_step", "one rank's shard (shard_of) runs without a group"));
    }
    let mut be = if opts.shard_of > 1 {
        CudaBackend::synthetic_shard(cfg.clone(), o, &RandomFill::new(1), 0, opts.shard_of)?
    } else {
        random_backend(cfg.clone(), o, 1, tp)?
    };
    use mlaserve_core::Backend as _;
    if be.num_blocks() < need_blocks {
        return Err(CudaError::shape(
            "bench_step",
            format!(
                "the memory plan leaves {} KV blocks, the sweep needs {need_blocks}: {}",
                be.num_blocks(),
                be.memory_plan().map(|m| m.to_string()).unwrap_or_default()
            ),
        ));
    }
    be.fill_caches(&RandomFill::new(2))?;
    let util = Util::new(be.gpu())?;
    let copy_gbps = measure_copy_bandwidth(be.gpu(), &util, 1 << 30)?;
    let wb = be.weight_bytes();
    let layer_cache = (cfg.latent_dim() * 2) as f64;
    let target_layers = cfg.num_hidden_layers as f64;
    let every_k_timed = (0..=max_k).all(|k| opts.ks.contains(&k));
    if opts.adaptive_cycles > 0 && (tp.is_some() || opts.acceptance.is_empty() || !every_k_timed) {
        return Err(CudaError::shape(
            "bench_step",
            "adaptive cycles need one rank, the acceptance rates and every k from 0 to the largest timed first \
             (its graphs captured before the policy times them)",
        ));
    }
    let mut rows = Vec::new();
    let mut adaptive = Vec::new();
    for &b in &opts.batches {
        for &k in &opts.ks {
            let s = 1 + k;
            let (mut tt, mut td) = (Vec::new(), Vec::new());
            for it in 0..opts.iters + 1 {
                let (t, d) = one_step(&mut be, &cfg, b, k, opts.context, per_seq, opts.host_logits)?;
                if it > 0 {
                    tt.push(t);
                    td.push(d);
                }
            }
            let mut profile = Vec::new();
            if opts.profile {
                let target = window(b, s, opts.context, per_seq, &cfg, opts.host_logits);
                be.set_profile(true);
                let out = be.forward(&target).map_err(core_err)?;
                if k > 0 {
                    let ident: Vec<u32> = (0..(b * s) as u32).collect();
                    be.mtp_forward(0, &target, &out.hidden, &ident).map_err(core_err)?;
                }
                profile = be.set_profile(false).into_iter().map(|(n, t)| (n, t * 1e3)).collect();
            }
            let ctx = (opts.context + s) as f64;
            let mut bytes = (wb.target_dense + wb.head) as f64
                + wb.moe_layers as f64 * distinct(&wb, b * s) * wb.expert as f64
                + target_layers * b as f64 * ctx * layer_cache;
            if k > 0 {
                let mtp_moe = |t: usize| if wb.mtp_moe { distinct(&wb, t) * wb.expert as f64 } else { 0.0 };
                bytes += (wb.mtp_dense + wb.head) as f64 * k as f64 + mtp_moe(b * s) + (k - 1) as f64 * mtp_moe(b);
                bytes += b as f64 * ctx * layer_cache * k as f64;
            }
            let roofline_ms = bytes / (copy_gbps * 1e9) * 1e3;
            let hl = opts.host_logits;
            let mut comm = comm_seconds(&be, 1 + opts.moe_layers, b * s, b * s, hl, opts.iters)?;
            if k > 0 {
                comm += comm_seconds(&be, 1, b * s, b * s, hl, opts.iters)?;
                comm += (k - 1) as f64 * comm_seconds(&be, 1, b, b, hl, opts.iters)?;
            }
            rows.push(StepBenchRow {
                batch: b,
                k,
                target_ms: median(tt),
                draft_ms: if k > 0 { median(td) } else { 0.0 },
                bytes,
                roofline_ms,
                comm_ms: comm * 1e3,
                profile,
            });
        }
        if opts.adaptive_cycles > 0 {
            let run = crate::spec_projection::run_adaptive(b, max_k, &opts.acceptance, opts.adaptive_cycles, 3, |k| {
                one_step(&mut be, &cfg, b, k, opts.context, per_seq, opts.host_logits)
            })?;
            adaptive.push(run);
        }
    }
    let mut prefill = Vec::new();
    for &(b, len) in &opts.prefill {
        let per = (opts.context + len).div_ceil(BLOCK_SIZE);
        let chunk = Batch {
            argmax_rows: (0..b).map(|i| (i * len + len - 1) as u32).collect(),
            sample_rows: vec![],
            seqs: chunks(b, len, opts.context, per, cfg.vocab_size, true),
            logit_rows: vec![],
            ..Default::default()
        };
        let ident: Vec<u32> = (0..(b * len) as u32).collect();
        let (mut tt, mut tm) = (Vec::new(), Vec::new());
        for it in 0..opts.iters + 1 {
            let t0 = Instant::now();
            let out = be.forward(&chunk).map_err(core_err)?;
            let t1 = Instant::now();
            be.mtp_forward(0, &chunk, &out.hidden, &ident).map_err(core_err)?;
            if it > 0 {
                tt.push((t1 - t0).as_secs_f64() * 1e3);
                tm.push(t1.elapsed().as_secs_f64() * 1e3);
            }
        }
        let mut profile = Vec::new();
        if opts.profile {
            be.set_profile(true);
            be.forward(&chunk).map_err(core_err)?;
            profile = be.set_profile(false).into_iter().map(|(n, t)| (n, t * 1e3)).collect();
        }
        prefill.push(PrefillStepRow { batch: b, tokens: len, target_ms: median(tt), mtp_ms: median(tm), profile });
    }
    Ok(StepBenchReport {
        gpu: be.gpu().name.clone(),
        copy_gbps,
        layers: format!(
            "{} dense + {} MoE target layers + 1 MTP layer (MoE), V3 dims, {}{}; {}; {}",
            opts.dense_layers,
            opts.moe_layers,
            if opts.fp8 { "fp8 projections and experts" } else { "bf16" },
            if opts.shard_of > 1 { format!(", one rank's TP-{} shard alone", opts.shard_of) } else { String::new() },
            if opts.host_logits { "every row's logits to the host" } else { "greedy: argmax rows on the device" },
            match be.graph_stats() {
                g if g.steps == 0 => "eager (no CUDA graph)".to_string(),
                g => format!("decode steps as CUDA graphs ({} launches of {} graphs)", g.launches, g.graphs),
            }
        ),
        context: opts.context,
        tp: opts.tp.max(1),
        options: if opts.batch_invariant { "batch-invariant" } else { "default" },
        rows,
        prefill,
        weight_bytes: {
            let (fp8, all) = be.fp8_bytes();
            (all, fp8)
        },
        memory: be.memory_plan(),
        acceptance: opts.acceptance.clone(),
        adaptive,
    })
}
