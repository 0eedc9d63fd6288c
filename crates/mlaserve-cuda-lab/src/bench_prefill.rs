//! [`bench_mla_prefill`]: the expanded-form prefill attention (`kernels/mla_prefill.cu`,
//! [`crate::prefill`]) at DeepSeek-V3's head dimensions (128 + 64 query/key, 128 value,
//! 512 latent; 128 heads, 64/32/16 for TP 2/4/8) beside the cuBLAS bf16 GEMM rate and the
//! copy bandwidth measured in the same run, and the absorbed path it replaces for prefill
//! where that one finishes in reasonable time.
//!
//! Per configuration (heads × batch × prompt length, optionally after a cached prefix):
//! - kernel: the attention kernel alone; TFLOP/s over the visible causal pairs
//!   ([`prefill::flops`]: about half the square, no tile padding or masked work counted);
//! - path: latent gather + the K and V up-projection GEMMs + the kernel (what a layer
//!   runs for its prefill rows); TFLOP/s counting the GEMMs' FLOPs too;
//! - absorbed: query absorption + the varlen absorbed kernel + W_UV (the old path), only
//!   when its work (visible pairs × heads) is at most [`PrefillBenchOpts::absorbed_max`];
//!   its output is compared with the expanded one (relative L2 of the bf16 outputs).
//!
//! Timing as in [`crate::bench`]: CUDA events around each call after warm-up, median of
//! the calls; inputs random (device-side fills), the cache pages in a shuffled order.

use std::fmt;

use cudarc::driver::CudaSlice;
use half::bf16;

use crate::bench::{measure_ceilings, time_calls, Ceilings};
use crate::reference::err_stats;
use crate::rng::Rng;
use crate::util::Util;
use mlaserve_cuda::layout::AttnMeta;
use mlaserve_cuda::linear::{Gemm, GemmMode, Linear, TcKernels};
use mlaserve_cuda::ops::Ops;
use mlaserve_cuda::plan::PAGE;
use mlaserve_cuda::prefill::{self, LatentCache, MlaPrefill, PrefillDims, PrefillKernel, PrefillPlan, PrefillSeq};
use mlaserve_cuda::rope::RopeTables;
use mlaserve_cuda::Gpu;
use mlaserve_cuda::Result;

/// What to sweep: every combination of the lists.
#[derive(Debug, Clone)]
pub struct PrefillBenchOpts {
    pub heads: Vec<usize>,
    /// New tokens per sequence.
    pub prompt_lens: Vec<usize>,
    /// Sequences per call.
    pub batches: Vec<usize>,
    /// Cached tokens before each sequence's new ones (a later chunk of a chunked prefill
    /// when > 0).
    pub prefix: usize,
    pub warmup: usize,
    pub iters: usize,
    /// Time the absorbed path only when visible pairs × heads is at most this (it is a
    /// scalar kernel, one block per (row, head), minutes at the largest sizes).
    pub absorbed_max: u64,
    /// The attention kernel timed (mma.sync where the GPU has no wgmma).
    pub kernel: PrefillKernel,
}

impl Default for PrefillBenchOpts {
    /// 128/64/32/16 heads (TP 1/2/4/8), prompts of 1024/4096/8192 tokens, 1/2/4 per call.
    fn default() -> Self {
        PrefillBenchOpts {
            heads: vec![128, 64, 32, 16],
            prompt_lens: vec![1024, 4096, 8192],
            batches: vec![1, 2, 4],
            prefix: 0,
            warmup: 2,
            iters: 10,
            absorbed_max: 150_000_000,
            kernel: PrefillKernel::default(),
        }
    }
}

/// One configuration's measurement.
#[derive(Debug, Clone)]
pub struct PrefillBenchRow {
    pub heads: usize,
    pub batch: usize,
    pub prompt: usize,
    pub prefix: usize,
    pub kernel_ms: f64,
    pub kernel_tflops: f64,
    pub path_ms: f64,
    pub path_tflops: f64,
    /// The absorbed path's median time and the relative L2 difference of its output from
    /// the expanded one, when it ran.
    pub absorbed: Option<(f64, f64)>,
}

/// A sweep's result; `Display` prints the table beside the ceilings.
#[derive(Debug, Clone)]
pub struct PrefillBenchReport {
    pub device: String,
    pub ceilings: Ceilings,
    pub rows: Vec<PrefillBenchRow>,
}

fn median(sorted: &[f64]) -> f64 {
    sorted[sorted.len() / 2]
}

/// Benchmarks the expanded-form prefill attention over `opts` on `gpu`, after measuring
/// the ceilings on the same device in the same run.
pub fn bench_mla_prefill(gpu: &Gpu, opts: &PrefillBenchOpts) -> Result<PrefillBenchReport> {
    let util = Util::new(gpu)?;
    let ceilings = measure_ceilings(gpu, &util)?;
    let pre = MlaPrefill::new(gpu, opts.kernel)?;
    let ops = Ops::new(gpu, TcKernels::Auto)?;
    let gemm = Gemm::new(gpu, GemmMode::Cublas, TcKernels::Auto)?;
    let s = &gpu.stream;
    let (nope, rope, vdim, lora) = (128usize, 64usize, 128usize, 512usize);
    let lat = lora + rope;
    let scale = 1.0 / ((nope + rope) as f32).sqrt();
    let max_len = opts.prefix + opts.prompt_lens.iter().copied().max().unwrap_or(1);
    let inv_freq: Vec<f64> = (0..rope / 2).map(|i| 1.0 / 10000f64.powf((2 * i) as f64 / rope as f64)).collect();
    let rope_t = RopeTables::new(s, &inv_freq, 1.0, max_len.max(1))?;
    let mut seed = 0x5eed_u64;
    let mut next = || {
        seed += 1;
        seed
    };
    let mut rows_out = Vec::new();
    for &heads in &opts.heads {
        let d = PrefillDims { heads, nope, rope, vdim };
        let w = 1.0 / (lora as f32).sqrt();
        let mut w_uk = Linear { w: s.alloc_zeros::<bf16>(heads * nope * lora)?, out: heads * nope, inp: lora };
        let mut w_uv = Linear { w: s.alloc_zeros::<bf16>(heads * vdim * lora)?, out: heads * vdim, inp: lora };
        util.fill_bf16(s, &mut w_uk.w, next(), -w, w)?;
        util.fill_bf16(s, &mut w_uv.w, next(), -w, w)?;
        for &batch in &opts.batches {
            for &len in &opts.prompt_lens {
                let k_len = opts.prefix + len;
                let pages = k_len.div_ceil(PAGE);
                let num_blocks = batch * pages;
                let mut cache = s.alloc_zeros::<bf16>(num_blocks * PAGE * lat)?;
                util.fill_bf16(s, &mut cache, next(), -1.0, 1.0)?;
                let mut perm: Vec<i32> = (0..num_blocks as i32).collect();
                Rng::new(next()).shuffle(&mut perm);
                let tables = s.clone_htod(&perm)?; // sequence b's pages: perm[b*pages ..]
                let seqs: Vec<PrefillSeq> =
                    (0..batch).map(|b| PrefillSeq { q_row0: b * len, q_len: len, k_len, table_row: b }).collect();
                let plan = PrefillPlan::new(s, &seqs)?;
                let rows = batch * len;
                let mut q = s.alloc_zeros::<f32>(rows * heads * d.qk())?;
                util.fill_f32(s, &mut q, next(), -1.0, 1.0)?;
                let mut o = s.alloc_zeros::<bf16>(rows * heads * vdim)?;
                let mut bufs = pre.buffers(s, &plan, &d, lora)?;
                let lc =
                    LatentCache { data: &cache, fp8: false, tables: &tables, bt_stride: pages, num_blocks, lora, rope };
                pre.expand(s, &gemm, (&w_uk, &w_uv), &plan, &d, &lc, &mut bufs)?;
                let tk = time_calls(gpu, opts.warmup, opts.iters, || {
                    pre.attention(s, &plan, &d, scale, &q, &bufs.kn, &bufs.kpe, &bufs.v, &rope_t, &mut o)
                })?;
                let tp = time_calls(gpu, opts.warmup, opts.iters, || {
                    pre.expand(s, &gemm, (&w_uk, &w_uv), &plan, &d, &lc, &mut bufs)?;
                    pre.attention(s, &plan, &d, scale, &q, &bufs.kn, &bufs.kpe, &bufs.v, &rope_t, &mut o)
                })?;
                let f_attn = prefill::flops(&seqs, &d);
                let f_up = 2.0 * plan.keys() as f64 * lora as f64 * (heads * (nope + vdim)) as f64;
                let (km, pm) = (median(&tk), median(&tp));
                let absorbed = if prefill::causal_pairs(&seqs) * heads as u64 <= opts.absorbed_max {
                    Some(absorbed_path(gpu, &ops, (&w_uk, &w_uv), &d, scale, &q, &lc, &seqs, &rope_t, &o)?)
                } else {
                    None
                };
                rows_out.push(PrefillBenchRow {
                    heads,
                    batch,
                    prompt: len,
                    prefix: opts.prefix,
                    kernel_ms: km,
                    kernel_tflops: f_attn / (km * 1e-3) / 1e12,
                    path_ms: pm,
                    path_tflops: (f_attn + f_up) / (pm * 1e-3) / 1e12,
                    absorbed,
                });
            }
        }
    }
    Ok(PrefillBenchReport { device: gpu.name.clone(), ceilings, rows: rows_out })
}

/// Times the absorbed path (q absorption, varlen attention, W_UV) over the same inputs and
/// weights and compares its output with the expanded one (`o_exp`): (median ms, relative
/// L2 difference).
#[allow(clippy::too_many_arguments)]
fn absorbed_path(
    gpu: &Gpu,
    ops: &Ops,
    (w_uk, w_uv): (&Linear, &Linear),
    d: &PrefillDims,
    scale: f32,
    q: &CudaSlice<f32>,
    c: &LatentCache,
    seqs: &[PrefillSeq],
    rope_t: &RopeTables,
    o_exp: &CudaSlice<bf16>,
) -> Result<(f64, f64)> {
    let s = &gpu.stream;
    let (heads, nope, rope, vdim, lora) = (d.heads, d.nope, d.rope, d.vdim, c.lora);
    let lat = lora + rope;
    let rows: usize = seqs.iter().map(|q| q.q_len).sum();
    let (mut pos, mut row_seq) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
    for sq in seqs {
        for i in 0..sq.q_len {
            pos.push((sq.k_len - sq.q_len + i) as i32);
            row_seq.push(sq.table_row as i32);
        }
    }
    let max_pos = seqs.iter().map(|q| q.k_len - 1).max().unwrap_or(0);
    let meta = AttnMeta { n: rows, seqs: seqs.len(), bt_stride: c.bt_stride, max_pos, max_block: c.num_blocks - 1 };
    let (pos_d, row_seq_d) = (s.clone_htod(&pos)?, s.clone_htod(&row_seq)?);
    let mut qa = s.alloc_zeros::<f32>(rows * heads * lat)?;
    let mut qa_bf16 = s.alloc_zeros::<bf16>(rows * heads * lat)?;
    let mut o_lat = s.alloc_zeros::<f32>(rows * heads * lora)?;
    let mut o = s.alloc_zeros::<bf16>(rows * heads * vdim)?;
    let t = time_calls(gpu, 1, 3, || {
        ops.q_absorb(s, &mut qa, &mut qa_bf16, q, &w_uk.w, rope_t, &pos_d, rows, heads, nope, lora)?;
        ops.attn_varlen(s, &mut o_lat, &qa, c.data, c.tables, &row_seq_d, &pos_d, &meta, heads, lora, rope, scale)?;
        ops.wuv(s, &mut o, &o_lat, &w_uv.w, rows, heads, lora, vdim)
    })?;
    let a: Vec<f32> = s.clone_dtoh(&o)?.iter().map(|v| v.to_f32()).collect();
    let e: Vec<f32> = s.clone_dtoh(o_exp)?.iter().map(|v| v.to_f32()).collect();
    gpu.sync()?;
    Ok((median(&t), err_stats(&e, &a).rel_l2))
}

impl fmt::Display for PrefillBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.ceilings;
        writeln!(f, "device: {}", self.device)?;
        writeln!(
            f,
            "ceilings (same run): copy {:.0} GB/s (read+write), cuBLAS bf16 GEMM 8192^3 {:.0} TFLOP/s",
            c.copy_gbps, c.gemm_tflops
        )?;
        writeln!(
            f,
            "expanded MLA prefill, qk 128+64, v 128, lora 512; causal FLOPs (visible pairs only); \
             path = latent gather + K/V up-projection GEMMs + kernel; absorbed = q_absorb + varlen + W_UV"
        )?;
        writeln!(
            f,
            "{:>5} {:>5} {:>6} {:>6} {:>10} {:>8} {:>6} {:>10} {:>8} {:>12} {:>8} {:>9}",
            "heads",
            "batch",
            "prompt",
            "prefix",
            "kernel_ms",
            "TFLOP/s",
            "%gemm",
            "path_ms",
            "TFLOP/s",
            "absorbed_ms",
            "speedup",
            "rel_diff"
        )?;
        for r in &self.rows {
            let (abs_ms, speedup, diff) = match r.absorbed {
                Some((t, d)) => (format!("{t:.2}"), format!("{:.1}x", t / r.path_ms), format!("{d:.1e}")),
                None => ("-".into(), "-".into(), "-".into()),
            };
            writeln!(
                f,
                "{:>5} {:>5} {:>6} {:>6} {:>10.3} {:>8.1} {:>5.0}% {:>10.3} {:>8.1} {:>12} {:>8} {:>9}",
                r.heads,
                r.batch,
                r.prompt,
                r.prefix,
                r.kernel_ms,
                r.kernel_tflops,
                100.0 * r.kernel_tflops / c.gemm_tflops,
                r.path_ms,
                r.path_tflops,
                abs_ms,
                speedup,
                diff
            )?;
        }
        Ok(())
    }
}

/// Convenience for callers that hold no [`Gpu`] yet (the CLI): opens device `ordinal`.
pub fn bench_mla_prefill_on(ordinal: usize, opts: &PrefillBenchOpts) -> Result<PrefillBenchReport> {
    let gpu = Gpu::new(ordinal)?;
    bench_mla_prefill(&gpu, opts)
}
