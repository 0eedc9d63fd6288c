//! Roofline benchmarks: the MLA decode kernel beside the two ceilings measured in the
//! same run (device copy bandwidth, cuBLAS bf16 GEMM rate).
//!
//! Timing: CUDA events around each call after warm-up, median of many; the stream is
//! synchronised and checked for errors after every timed call. Inputs are random
//! (device-side fills), never zeros, and each configuration's cache is several times
//! the L2.
//!
//! The decode sweep times each configuration twice: once per call as above (the GPU
//! waits for the host's launch, so a call of ~100 µs carries its launch latency), and
//! as the replay of a CUDA graph of [`GRAPH_CALLS`] calls, divided by that count: the
//! way a decode step runs it, inside the step's graph, behind other kernels.

use std::fmt;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use half::bf16;

use crate::rng::Rng;
use crate::util::Util;
use mlaserve_core::KvCacheDtype;
use mlaserve_cuda::dims::DecodeDims;
use mlaserve_cuda::plan::{self, PAGE};
use mlaserve_cuda::Gpu;
use mlaserve_cuda::{CudaError, Result};
use mlaserve_cuda::{MlaDecode, MlaDecodeShape, MlaKernel, SplitMerge};

/// Times `f` (which enqueues work on the GPU's stream): `warmup` untimed calls, then
/// `iters` calls each between two events. Returns the per-call times in ms, sorted.
pub fn time_calls(gpu: &Gpu, warmup: usize, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    for _ in 0..warmup {
        f()?;
    }
    gpu.sync()?;
    let start = gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    let end = gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        start.record(&gpu.stream)?;
        f()?;
        end.record(&gpu.stream)?;
        end.synchronize()?;
        gpu.ctx.check_err()?;
        times.push(start.elapsed_ms(&end)? as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times)
}

/// Calls per captured graph in [`time_graph`].
pub const GRAPH_CALLS: usize = 8;

/// Times `f` as a CUDA graph: `calls` calls of `f` are captured once, the graph is
/// replayed `warmup` times, then `iters` times each between two events. Returns the
/// per-call times (replay time / `calls`) in ms, sorted.
pub fn time_graph(
    gpu: &Gpu,
    calls: usize,
    warmup: usize,
    iters: usize,
    f: impl FnMut() -> Result<()>,
) -> Result<Vec<f64>> {
    time_graph_with(gpu, calls, warmup, iters, || {}, f)
}

/// [`time_graph`], calling `before` ahead of each timed replay (ranks of a collective
/// meet at a barrier there, so each replay starts on every rank together).
pub fn time_graph_with(
    gpu: &Gpu,
    calls: usize,
    warmup: usize,
    iters: usize,
    mut before: impl FnMut(),
    mut f: impl FnMut() -> Result<()>,
) -> Result<Vec<f64>> {
    let s = &gpu.stream;
    gpu.sync()?;
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let mut body = Ok(());
    for _ in 0..calls {
        body = f();
        if body.is_err() {
            break;
        }
    }
    // Always ended, so the stream leaves capture mode whatever happened.
    let graph = s.end_capture(CUgraphInstantiate_flags(0));
    body?;
    let graph = graph?.ok_or_else(|| CudaError::shape("bench", "empty graph capture"))?;
    graph.upload()?;
    for _ in 0..warmup.max(1) {
        graph.launch()?;
    }
    gpu.sync()?;
    gpu.ctx.check_err()?;
    let start = gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    let end = gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        before();
        start.record(s)?;
        graph.launch()?;
        end.record(s)?;
        end.synchronize()?;
        gpu.ctx.check_err()?;
        times.push(start.elapsed_ms(&end)? as f64 / calls as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times)
}

fn median(sorted: &[f64]) -> f64 {
    sorted[sorted.len() / 2]
}

/// Device-to-device copy bandwidth in GB/s (bytes read + bytes written), through a
/// grid-stride float4 copy of `bytes` bytes.
pub fn measure_copy_bandwidth(gpu: &Gpu, util: &Util, bytes: usize) -> Result<f64> {
    let n = bytes / 16 * 4;
    let s = &gpu.stream;
    let mut src = s.alloc_zeros::<f32>(n)?;
    util.fill_f32(s, &mut src, 7, -1.0, 1.0)?;
    let mut dst = s.alloc_zeros::<f32>(n)?;
    let t = time_calls(gpu, 3, 20, || util.copy(s, &src, &mut dst))?;
    Ok(2.0 * (n * 4) as f64 / (median(&t) * 1e-3) / 1e9)
}

/// cuBLAS bf16 GEMM rate (f32 accumulation) at n×n×n, in TFLOP/s, on random inputs.
pub fn measure_gemm_bf16(gpu: &Gpu, util: &Util, n: usize) -> Result<f64> {
    let s = &gpu.stream;
    let blas = CudaBlas::new(s.clone())?;
    let mut a = s.alloc_zeros::<bf16>(n * n)?;
    let mut b = s.alloc_zeros::<bf16>(n * n)?;
    let mut c = s.alloc_zeros::<bf16>(n * n)?;
    util.fill_bf16(s, &mut a, 11, -1.0, 1.0)?;
    util.fill_bf16(s, &mut b, 12, -1.0, 1.0)?;
    let ni = n as i32;
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: ni,
        n: ni,
        k: ni,
        alpha: bf16::ONE,
        lda: ni,
        ldb: ni,
        beta: bf16::ZERO,
        ldc: ni,
    };
    let t = time_calls(gpu, 3, 20, || {
        // SAFETY: column-major n×n operands, each buffer holds n*n elements, lda = ldb =
        // ldc = n.
        unsafe { blas.gemm(cfg, &a, &b, &mut c) }?;
        Ok(())
    })?;
    Ok(2.0 * (n as f64).powi(3) / (median(&t) * 1e-3) / 1e12)
}

/// The ceilings every figure is printed beside.
#[derive(Debug, Clone, Copy)]
pub struct Ceilings {
    /// Device copy bandwidth, GB/s (read + write).
    pub copy_gbps: f64,
    /// cuBLAS bf16 GEMM 8192³, TFLOP/s.
    pub gemm_tflops: f64,
}

pub fn measure_ceilings(gpu: &Gpu, util: &Util) -> Result<Ceilings> {
    Ok(Ceilings {
        copy_gbps: measure_copy_bandwidth(gpu, util, 2 << 30)?,
        gemm_tflops: measure_gemm_bf16(gpu, util, 8192)?,
    })
}

/// What to sweep. Every combination of the lists runs (uniform seq_len per batch).
#[derive(Debug, Clone)]
pub struct MlaDecodeBenchOpts {
    pub batches: Vec<usize>,
    pub seq_lens: Vec<usize>,
    pub heads: Vec<usize>,
    pub q_lens: Vec<usize>,
    pub warmup: usize,
    pub iters: usize,
    /// Tensor-core kernels to compare; `None` = the production choice, [`MlaKernel::Auto`].
    pub kernels: Option<Vec<MlaKernel>>,
    /// Split-KV counts to time each configuration with (tuning the planner); `None` =
    /// the planner's choice.
    pub splits: Option<Vec<usize>>,
    /// Split merges to time each configuration with ([`MlaDecode::set_split_merge`]);
    /// `None` = the default, [`SplitMerge::Cluster`].
    pub merges: Option<Vec<SplitMerge>>,
    /// Latent-cache layouts to time each configuration over (bf16 = `Auto`, fp8).
    pub kv_dtypes: Vec<KvCacheDtype>,
}

impl Default for MlaDecodeBenchOpts {
    /// The sweep: batch 64/128, cache 4096/8192, 16/32/64/128 heads (TP8..TP1),
    /// q_len 1/2/4.
    fn default() -> Self {
        MlaDecodeBenchOpts {
            batches: vec![64, 128],
            seq_lens: vec![4096, 8192],
            heads: vec![16, 32, 64, 128],
            q_lens: vec![1, 2, 4],
            warmup: 3,
            iters: 30,
            kernels: None,
            splits: None,
            merges: None,
            kv_dtypes: vec![KvCacheDtype::Auto],
        }
    }
}

/// One configuration's measurement.
#[derive(Debug, Clone)]
pub struct MlaDecodeBenchRow {
    /// The cache layout read.
    pub kv: KvCacheDtype,
    /// The kernel asked for.
    pub kernel: MlaKernel,
    /// The kernel that ran (`Auto` resolved; a kernel that does not cover the shape
    /// falls back, printed with a `*`).
    pub ran: MlaKernel,
    pub batch: usize,
    pub seq_len: usize,
    pub heads: usize,
    pub q_len: usize,
    pub num_splits: usize,
    /// The merge that ran (`None`: one split).
    pub merge: Option<SplitMerge>,
    pub median_us: f64,
    pub min_us: f64,
    pub gbps: f64,
    pub tflops: f64,
    /// Median per call of a replayed graph of [`GRAPH_CALLS`] calls, and its rates.
    pub graph_us: f64,
    pub graph_gbps: f64,
    pub graph_tflops: f64,
}

/// A sweep's result; `Display` prints the table with the ceilings.
#[derive(Debug, Clone)]
pub struct MlaDecodeBenchReport {
    pub device: String,
    pub ceilings: Ceilings,
    pub rows: Vec<MlaDecodeBenchRow>,
}

/// Benchmarks the decode kernel (bf16 output, DeepSeek dims 512 + 64, scale 1/sqrt(192))
/// over `opts`, after measuring the ceilings on the same device in the same run.
pub fn bench_mla_decode(gpu: &Gpu, opts: &MlaDecodeBenchOpts) -> Result<MlaDecodeBenchReport> {
    let util = Util::new(gpu)?;
    let mut mla = MlaDecode::new(gpu)?;
    let ceilings = measure_ceilings(gpu, &util)?;
    let s = &gpu.stream;
    let (dlat, drope) = (512usize, 64usize);
    let dqk = dlat + drope;
    let max_b = opts.batches.iter().copied().max().unwrap_or(1);
    let max_l = opts.seq_lens.iter().copied().max().unwrap_or(1);
    let max_rows = opts.heads.iter().max().unwrap_or(&1) * opts.q_lens.iter().max().unwrap_or(&1);

    // One cache for the largest configuration, pages in a random order.
    let pages_per_req = max_l.div_ceil(PAGE);
    let num_blocks = max_b * pages_per_req;
    let mut cache = s.alloc_zeros::<bf16>(num_blocks * PAGE * dqk)?;
    util.fill_bf16(s, &mut cache, 21, -1.0, 1.0)?;
    // The fp8 layout's cache (656-byte entries), when asked for.
    let cache_fp8 = if opts.kv_dtypes.contains(&KvCacheDtype::Fp8) {
        let ops = mlaserve_cuda::ops::Ops::new(gpu, mlaserve_cuda::linear::TcKernels::Auto)?;
        let mut c = s.alloc_zeros::<bf16>(
            num_blocks
                * PAGE
                * mlaserve_cuda::layout::kv_entry_elems(true, dlat, drope).map_err(|e| CudaError::shape("bench", e))?,
        )?;
        ops.fill_kv_fp8(s, &mut c, dlat, drope, 21)?;
        Some(c)
    } else {
        None
    };
    let mut perm: Vec<i32> = (0..num_blocks as i32).collect();
    Rng::new(22).shuffle(&mut perm);
    let bt = s.clone_htod(&perm)?; // request b's pages: perm[b*pages_per_req ..]
    let mut q_all = s.alloc_zeros::<bf16>(max_b * max_rows * dqk)?;
    util.fill_bf16(s, &mut q_all, 23, -1.0, 1.0)?;

    let mut rows_out = Vec::new();
    let kernels = opts.kernels.clone().unwrap_or_else(|| vec![MlaKernel::Auto]);
    let merges = opts.merges.clone().unwrap_or_else(|| vec![SplitMerge::Cluster]);
    let mut combos = Vec::new();
    for &kv in &opts.kv_dtypes {
        for &k in &kernels {
            combos.extend(merges.iter().map(|&m| (kv, k, m)));
        }
    }
    for (kv, kernel, merge) in combos {
        mla.set_kernel(kernel)?;
        mla.set_split_merge(merge);
        mla.set_kv_cache_dtype(kv)?;
        let cache = if kv == KvCacheDtype::Fp8 { cache_fp8.as_ref().expect("allocated") } else { &cache };
        for &batch in &opts.batches {
            for &seq_len in &opts.seq_lens {
                for &heads in &opts.heads {
                    for &q_len in &opts.q_lens {
                        let dims = DecodeDims { batch, heads, q_len, dlat, drope, bt_stride: pages_per_req };
                        let rows = dims.rows();
                        let q = q_all.slice(0..batch * rows * dqk);
                        let q = s.clone_dtod(&q)?;
                        let bt_b = s.clone_dtod(&bt.slice(0..batch * pages_per_req))?;
                        let sl = s.clone_htod(&vec![seq_len as i32; batch])?;
                        let mut out = s.alloc_zeros::<bf16>(batch * rows * dlat)?;
                        let mut lse = s.alloc_zeros::<f32>(batch * rows)?;
                        let planned = mla.num_splits(&dims, seq_len);
                        let chunks = seq_len.div_ceil(plan::CHUNK_TOKENS).clamp(1, plan::MAX_SPLITS);
                        let mut tries: Vec<usize> = match &opts.splits {
                            // The fast kernels split; the others run one split only.
                            Some(v) if planned > 1 || mla.num_splits(&dims, 1 << 20) > 1 => {
                                v.iter().map(|&x| x.clamp(1, chunks)).collect()
                            }
                            _ => vec![planned],
                        };
                        tries.dedup();
                        for splits in tries {
                            // Timed once per merge that runs: under the first listed
                            // merge that resolves to it here.
                            let ran_merge = mla.merge_with(merge, &dims, splits);
                            if merges.iter().find(|&&m| mla.merge_with(m, &dims, splits) == ran_merge) != Some(&merge) {
                                continue;
                            }
                            let mut ws = mla.workspace(s, &dims, splits)?;
                            let shape =
                                MlaDecodeShape { dims, num_blocks, num_splits: splits, scale: 1.0 / (192f32).sqrt() };
                            let t = time_calls(gpu, opts.warmup, opts.iters, || {
                                mla.launch(s, &shape, &q, cache, &bt_b, &sl, &mut out, &mut lse, &mut ws)
                            })?;
                            let tg = time_graph(gpu, GRAPH_CALLS, opts.warmup, opts.iters, || {
                                mla.launch(s, &shape, &q, cache, &bt_b, &sl, &mut out, &mut lse, &mut ws)
                            })?;
                            let (med, gmed) = (median(&t), median(&tg));
                            let lens = vec![seq_len; batch];
                            let mut bytes = plan::min_bytes(rows, &lens, dqk, dlat, 2);
                            if kv == KvCacheDtype::Fp8 {
                                // 656 bytes a cached token instead of 1152.
                                bytes -= (batch * seq_len * (2 * dqk - 656)) as f64;
                            }
                            let flops = plan::flops(rows, &lens, dqk, dlat);
                            rows_out.push(MlaDecodeBenchRow {
                                kv,
                                kernel,
                                ran: mla.effective_kernel(&dims),
                                batch,
                                seq_len,
                                heads,
                                q_len,
                                num_splits: splits,
                                merge: ran_merge,
                                median_us: med * 1e3,
                                min_us: t[0] * 1e3,
                                gbps: bytes / (med * 1e-3) / 1e9,
                                tflops: flops / (med * 1e-3) / 1e12,
                                graph_us: gmed * 1e3,
                                graph_gbps: bytes / (gmed * 1e-3) / 1e9,
                                graph_tflops: flops / (gmed * 1e-3) / 1e12,
                            });
                        }
                    }
                }
            }
        }
    }
    Ok(MlaDecodeBenchReport { device: gpu.name.clone(), ceilings, rows: rows_out })
}

impl fmt::Display for MlaDecodeBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.ceilings;
        writeln!(f, "device: {}", self.device)?;
        writeln!(
            f,
            "ceilings (same run): copy {:.0} GB/s (read+write, float4 grid-stride), cuBLAS bf16 GEMM 8192^3 {:.0} TFLOP/s",
            c.copy_gbps, c.gemm_tflops
        )?;
        writeln!(
            f,
            "(per call: events around one call, launch latency included; graph: replay of {GRAPH_CALLS} calls)"
        )?;
        writeln!(
            f,
            "{:>9} {:>5} {:>5} {:>5} {:>3} {:>4} {:>6} {:>8} {:>10} {:>8} {:>6} {:>8} {:>6} {:>9} {:>8} {:>6} {:>8} {:>6}  bound",
            "kernel",
            "batch",
            "seq",
            "heads",
            "s",
            "rows",
            "splits",
            "merge",
            "median_us",
            "GB/s",
            "%copy",
            "TFLOP/s",
            "%gemm",
            "graph_us",
            "GB/s",
            "%copy",
            "TFLOP/s",
            "%gemm"
        )?;
        for r in &self.rows {
            // FLOP per byte ≈ 1.89 × rows; the ridge is gemm / copy.
            let intensity = r.tflops * 1e12 / (r.gbps * 1e9);
            let ridge = c.gemm_tflops * 1e12 / (c.copy_gbps * 1e9);
            writeln!(
                f,
                "{:>9} {:>5} {:>5} {:>5} {:>3} {:>4} {:>6} {:>8} {:>10.1} {:>8.0} {:>5.0}% {:>8.1} {:>5.0}% {:>9.1} {:>8.0} {:>5.0}% {:>8.1} {:>5.0}%  {}",
                {
                    let k = if r.kernel == MlaKernel::Auto || r.ran == r.kernel {
                        r.kernel.name().to_string()
                    } else {
                        format!("{}*", r.ran.name())
                    };
                    if r.kv == KvCacheDtype::Fp8 {
                        format!("fp8/{k}")
                    } else {
                        k
                    }
                },
                r.batch,
                r.seq_len,
                r.heads,
                r.q_len,
                r.heads * r.q_len,
                r.num_splits,
                r.merge.map_or("-", |m| m.name()),
                r.median_us,
                r.gbps,
                100.0 * r.gbps / c.copy_gbps,
                r.tflops,
                100.0 * r.tflops / c.gemm_tflops,
                r.graph_us,
                r.graph_gbps,
                100.0 * r.graph_gbps / c.copy_gbps,
                r.graph_tflops,
                100.0 * r.graph_tflops / c.gemm_tflops,
                if intensity < ridge { "memory" } else { "compute" }
            )?;
        }
        // The fp8 cache against bf16, per configuration timed both ways (the kernel asked
        // for; each layout's own splits and merge): time ratios of graph replays = tokens/s
        // ratios.
        let key = |r: &MlaDecodeBenchRow| (r.kernel, r.batch, r.seq_len, r.heads, r.q_len);
        let pairs: Vec<(&MlaDecodeBenchRow, &MlaDecodeBenchRow)> = self
            .rows
            .iter()
            .filter(|r| r.kv == KvCacheDtype::Fp8)
            .filter_map(|f| self.rows.iter().find(|b| b.kv == KvCacheDtype::Auto && key(b) == key(f)).map(|b| (b, f)))
            .collect();
        if !pairs.is_empty() {
            writeln!(f, "fp8 cache speedup over bf16 (graph replays, bf16 us / fp8 us):")?;
            for (b, p) in pairs {
                writeln!(
                    f,
                    "  batch {:>4} seq {:>5} heads {:>3} s {} : {:>7.1} / {:>7.1} us = {:.2}x",
                    b.batch,
                    b.seq_len,
                    b.heads,
                    b.q_len,
                    b.graph_us,
                    p.graph_us,
                    b.graph_us / p.graph_us
                )?;
            }
        }
        Ok(())
    }
}

/// Convenience for callers that hold no [`Gpu`] yet (the CLI): opens device `ordinal`.
pub fn bench_mla_decode_on(ordinal: usize, opts: &MlaDecodeBenchOpts) -> Result<MlaDecodeBenchReport> {
    let gpu = Gpu::new(ordinal)?;
    bench_mla_decode(&gpu, opts)
}
