//! The fp8 GEMM benchmark (`mlaserve-cuda-check --fp8`): at each of DeepSeek-V3's
//! projection shapes and row counts, the fp8 kernels (`mlaserve_cuda::fp8`: the path
//! `Auto` picks, and each path: `stream`, `portable` (mma.sync), `wgmma`), the activation
//! quantisation, cuBLAS bf16 on the same shape (`linear::Gemm`), and the copy-bandwidth
//! floor of the weight bytes (`bench::measure_copy_bandwidth`, measured in the same run).
//!
//! Timing: the GEMMs as CUDA graphs of one call per weight copy ([`time_graph`]: replays
//! after warm-up, each between two events, median, divided by the calls), as a decode
//! step runs them and as `tools/gpu/fp8_gemm_baseline.py` times torch; the quantisation
//! per call ([`time_calls`]). Each weight is replicated until the copies span 256 MB
//! (at most 64) and a graph's calls cycle through them, so a weight smaller than the L2
//! is still read from HBM, as in a decode step.

use std::fmt;

use half::bf16;

use crate::bench::{measure_copy_bandwidth, time_calls, time_graph};
use crate::check_fp8::{ROWS, V3_SHAPES};
use crate::fp8_ref::Fp8Weight;
use crate::rng::Rng;
use crate::util::Util;
use mlaserve_cuda::fp8::{Fp8Gemm, Fp8Linear};
use mlaserve_cuda::fp8_plan::{Fp8Path, FP8_BLOCK};
use mlaserve_cuda::linear::{Gemm, GemmMode, Linear, TcKernels};
use mlaserve_cuda::{Gpu, Result};

/// Bytes the copies of one weight span (several times the L2 of an H100/H200).
const SPAN: usize = 256 << 20;
/// Fewest calls in a timed graph.
const GRAPH_MIN_CALLS: usize = 8;

#[derive(Debug, Clone)]
pub struct Fp8BenchOpts {
    pub shapes: Vec<(&'static str, usize, usize)>,
    pub rows: Vec<usize>,
    pub warmup: usize,
    pub iters: usize,
}

impl Default for Fp8BenchOpts {
    fn default() -> Self {
        Fp8BenchOpts { shapes: V3_SHAPES.to_vec(), rows: ROWS.to_vec(), warmup: 5, iters: 30 }
    }
}

/// One (shape, rows) of the sweep; times in µs (medians).
#[derive(Debug, Clone)]
pub struct Fp8BenchRow {
    pub name: &'static str,
    pub n: usize,
    pub k: usize,
    pub m: usize,
    pub quant_us: f64,
    pub auto_us: f64,
    pub auto_kernel: &'static str,
    /// [`Fp8Path::Stream`] (the wgmma streaming kernel on Hopper).
    pub stream_us: f64,
    /// [`Fp8Path::Portable`] (the mma.sync streaming kernel), Hopper only.
    pub portable_us: Option<f64>,
    pub wgmma_us: Option<f64>,
    /// [`Fp8Path::Wide`], Hopper only.
    pub wide_us: Option<f64>,
    pub cublas_us: f64,
    /// Weight bytes (fp8 codes + scales).
    pub weight_bytes: usize,
}

#[derive(Debug, Clone)]
pub struct Fp8BenchReport {
    pub device: String,
    pub copy_gbps: f64,
    pub rows: Vec<Fp8BenchRow>,
}

impl fmt::Display for Fp8BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "device: {}; copy bandwidth {:.0} GB/s (read + write)", self.device, self.copy_gbps)?;
        writeln!(
            f,
            "{:<26} {:>5} {:>8} {:>9} {:>10} {:>8} {:>6} {:>8} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7}",
            "shape",
            "m",
            "quant us",
            "fp8 us",
            "kernel",
            "GB/s",
            "%copy",
            "TFLOP/s",
            "stream us",
            "mma us",
            "wgmma us",
            "cublas us",
            "wide us",
            "cb TF/s",
            "vs cb"
        )?;
        for r in &self.rows {
            let flop = 2.0 * (r.m * r.n * r.k) as f64;
            let gbps = r.weight_bytes as f64 / (r.auto_us * 1e-6) / 1e9;
            writeln!(
                f,
                "{:<26} {:>5} {:>8.1} {:>9.1} {:>10} {:>8.0} {:>5.0}% {:>8.1} {:>9.1} {:>9} {:>9} {:>9.1} {:>8} {:>8.1} {:>6.2}x",
                r.name,
                r.m,
                r.quant_us,
                r.auto_us,
                r.auto_kernel,
                gbps,
                100.0 * gbps / self.copy_gbps,
                flop / (r.auto_us * 1e-6) / 1e12,
                r.stream_us,
                r.portable_us.map_or("-".to_string(), |t| format!("{t:.1}")),
                r.wgmma_us.map_or("-".to_string(), |t| format!("{t:.1}")),
                r.cublas_us,
                r.wide_us.map_or("-".to_string(), |t| format!("{t:.1}")),
                flop / (r.cublas_us * 1e-6) / 1e12,
                r.cublas_us / r.auto_us
            )?;
        }
        Ok(())
    }
}

fn median_us(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2] * 1e3
}

/// Runs the sweep on `gpu`.
pub fn bench_fp8(gpu: &Gpu, opts: &Fp8BenchOpts) -> Result<Fp8BenchReport> {
    let s = &gpu.stream;
    let util = Util::new(gpu)?;
    let copy_gbps = measure_copy_bandwidth(gpu, &util, 2 << 30)?;
    let mut fp8 = Fp8Gemm::new(gpu, Fp8Path::Auto)?;
    let mut gemm = Gemm::new(gpu, GemmMode::Cublas, TcKernels::Auto)?;
    gemm.mode = GemmMode::Cublas;
    let mut rng = Rng::new(77);
    let mut rows = Vec::new();
    for &(name, n, k) in &opts.shapes {
        let host = Fp8Weight::random(&mut rng, n, k);
        let copies = SPAN.div_ceil(n * k).clamp(1, 64);
        let ws: Vec<Fp8Linear> =
            (0..copies).map(|_| Fp8Linear::from_raw(s, &host.q, &host.s, n, k)).collect::<Result<_>>()?;
        let bcopies = SPAN.div_ceil(2 * n * k).clamp(1, 64);
        let mut bw = Vec::with_capacity(bcopies);
        for c in 0..bcopies {
            let mut w = s.alloc_zeros::<bf16>(n * k)?;
            util.fill_bf16(s, &mut w, 1000 + c as u64, -0.05, 0.05)?;
            bw.push(Linear { w, out: n, inp: k });
        }
        for &m in &opts.rows {
            // Fewer replays of the long graphs (4096 rows: milliseconds a call).
            let iters = if m >= 4096 { opts.iters.min(5) } else { opts.iters };
            let mut x = s.alloc_zeros::<bf16>(m * k)?;
            util.fill_bf16(s, &mut x, 5, -2.0, 2.0)?;
            let mut xq = s.alloc_zeros::<u8>(m * k)?;
            let mut xs = s.alloc_zeros::<f32>(m * k / FP8_BLOCK)?;
            let mut y = s.alloc_zeros::<bf16>(m * n)?;
            let quant = time_calls(gpu, opts.warmup, iters, || fp8.act_quant(s, &x, m, k, &mut xq, &mut xs))?;
            // The wide tile kernel must give the narrow one's bits (the same sums).
            let wide_check = fp8.has_wgmma();
            if wide_check {
                let mut bits = Vec::new();
                for path in [Fp8Path::Wgmma, Fp8Path::Wide] {
                    fp8.path = path;
                    s.memset_zeros(&mut y)?;
                    fp8.forward_quantized(s, &ws[0], &xq, &xs, m, &mut y)?;
                    bits.push(s.clone_dtoh(&y)?);
                }
                if let Some(j) = bits[0].iter().zip(&bits[1]).position(|(a, b)| a.to_bits() != b.to_bits()) {
                    return Err(mlaserve_cuda::CudaError::shape(
                        "bench fp8",
                        format!("{name} m={m}: the wide tile kernel differs from the narrow one at output {j}"),
                    ));
                }
            }
            let calls = copies.max(GRAPH_MIN_CALLS);
            let mut time_path = |fp8: &mut Fp8Gemm, path: Fp8Path| -> Result<f64> {
                fp8.path = path;
                let mut i = 0;
                let t = time_graph(gpu, calls, opts.warmup, iters, || {
                    i += 1;
                    fp8.forward_quantized(s, &ws[i % copies], &xq, &xs, m, &mut y)
                })?;
                Ok(median_us(t))
            };
            let auto_us = time_path(&mut fp8, Fp8Path::Auto)?;
            let stream_us = time_path(&mut fp8, Fp8Path::Stream)?;
            let portable_us = if fp8.has_wgmma() { Some(time_path(&mut fp8, Fp8Path::Portable)?) } else { None };
            let wgmma_us = if fp8.has_wgmma() { Some(time_path(&mut fp8, Fp8Path::Wgmma)?) } else { None };
            let wide_us = if wide_check { Some(time_path(&mut fp8, Fp8Path::Wide)?) } else { None };
            fp8.path = Fp8Path::Auto;
            let auto_kernel =
                Fp8Path::Auto.kernel(m, n, k, gpu.num_sms, fp8.has_wgmma()).map_or("-", |kind| kind.name());
            let mut i = 0;
            let cb = time_graph(gpu, bcopies.max(GRAPH_MIN_CALLS), opts.warmup, iters, || {
                i += 1;
                gemm.forward(s, &bw[i % bcopies], &x, m, &mut y)
            })?;
            rows.push(Fp8BenchRow {
                name,
                n,
                k,
                m,
                quant_us: median_us(quant),
                auto_us,
                auto_kernel,
                stream_us,
                portable_us,
                wgmma_us,
                wide_us,
                cublas_us: median_us(cb),
                weight_bytes: ws[0].bytes(),
            });
        }
    }
    Ok(Fp8BenchReport { device: gpu.name.clone(), copy_gbps, rows })
}

/// V3's routed-expert projections for the grouped benchmark `(name, out, in)`: gate_up
/// fused (2 · 2048) and down, unsharded and at TP 8.
pub const V3_EXPERT_SHAPES: &[(&str, usize, usize)] = &[
    ("expert gate_up 7168->2x2048", 4096, 7168),
    ("expert down 2048->7168", 7168, 2048),
    ("expert gate_up/tp8 7168->2x256", 512, 7168),
    ("expert down/tp8 256->7168", 7168, 256),
];

/// One (shape, routing) of the grouped sweep; times in µs (medians).
#[derive(Debug, Clone)]
pub struct GroupedBenchRow {
    pub name: &'static str,
    pub routing: &'static str,
    pub n: usize,
    pub k: usize,
    pub rows: usize,
    pub active: usize,
    pub tile: usize,
    pub fp8_us: f64,
    /// The other kernels `(tile, µs)`: the streaming kernel's other tiles, and 128 the
    /// tile kernel (`forward_tiled`).
    pub other_tiles: Vec<(usize, f64)>,
    /// The bf16 experts (`moe_grouped_sorted`, fast mode) on the same routing.
    pub bf16_us: Option<f64>,
    /// Codes + scales of the experts with at least one row.
    pub touched_bytes: usize,
}

#[derive(Debug, Clone)]
pub struct GroupedBenchReport {
    pub device: String,
    pub copy_gbps: f64,
    pub rows: Vec<GroupedBenchRow>,
}

impl fmt::Display for GroupedBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "device: {}; copy bandwidth {:.0} GB/s (read + write)", self.device, self.copy_gbps)?;
        writeln!(
            f,
            "{:<32} {:>8} {:>6} {:>6} {:>4} {:>9} {:>8} {:>6} {:>8} {:>22} {:>9}",
            "shape",
            "routing",
            "rows",
            "active",
            "tile",
            "fp8 us",
            "GB/s",
            "%copy",
            "TFLOP/s",
            "other tiles us",
            "bf16 us"
        )?;
        for r in &self.rows {
            let flop = 2.0 * (r.rows * r.n * r.k) as f64;
            let gbps = r.touched_bytes as f64 / (r.fp8_us * 1e-6) / 1e9;
            let others: Vec<String> = r.other_tiles.iter().map(|(t, us)| format!("{t}:{us:.1}")).collect();
            writeln!(
                f,
                "{:<32} {:>8} {:>6} {:>6} {:>4} {:>9.1} {:>8.0} {:>5.0}% {:>8.1} {:>22} {:>9}",
                r.name,
                r.routing,
                r.rows,
                r.active,
                r.tile,
                r.fp8_us,
                gbps,
                100.0 * gbps / self.copy_gbps,
                flop / (r.fp8_us * 1e-6) / 1e12,
                others.join(" "),
                r.bf16_us.map_or("-".to_string(), |t| format!("{t:.1}")),
            )?;
        }
        Ok(())
    }
}

/// The grouped fp8 experts (`mlaserve_cuda::fp8_grouped`) at V3's expert shapes, 256
/// experts, with a decode routing (64 sequences × 4 tokens, top-8: 2048 rows) and a
/// prefill one (4096 tokens × top-8), uniform random; each beside the streaming
/// kernel's other row tiles, the tile kernel (`tile 128`) and (with `bf16`) the bf16
/// experts on the same routing. Timed as CUDA graphs of 8
/// calls (the experts' bytes exceed the L2 many times over).
pub fn bench_fp8_grouped(gpu: &Gpu, iters: usize, bf16_too: bool) -> Result<GroupedBenchReport> {
    use crate::check_fp8_grouped::{ExpertSet, Routing, TILED};
    use mlaserve_cuda::fp8_grouped::Fp8Grouped;
    use mlaserve_cuda::fp8_plan::grouped_tile;
    use mlaserve_cuda::ops::{ExpertWeights, GroupedVariant, Ops};
    const E: usize = 256;
    let s = &gpu.stream;
    let util = Util::new(gpu)?;
    let copy_gbps = measure_copy_bandwidth(gpu, &util, 2 << 30)?;
    let g = Fp8Grouped::new(gpu)?;
    let ops = if bf16_too { Some(Ops::new(gpu, TcKernels::Auto)?) } else { None };
    let mut rng = Rng::new(78);
    let routings = [
        ("decode", Routing::random(&mut rng, 64 * 4, 8, E, 0, 0)),
        ("prefill", Routing::random(&mut rng, 4096, 8, E, 0, 0)),
    ];
    let mut out = Vec::new();
    for &(name, n, k) in V3_EXPERT_SHAPES {
        let set = ExpertSet::random(gpu, &mut rng, E, 1, n, k)?;
        let bw: Option<Vec<Linear>> = match ops {
            Some(_) => {
                let mut v = Vec::with_capacity(E);
                for e in 0..E {
                    let mut w = s.alloc_zeros::<bf16>(n * k)?;
                    util.fill_bf16(s, &mut w, 2000 + e as u64, -0.05, 0.05)?;
                    v.push(Linear { w, out: n, inp: k });
                }
                Some(v)
            }
            None => None,
        };
        let table = match &bw {
            Some(v) => Some(ExpertWeights::new(s, &v.iter().collect::<Vec<_>>())?),
            None => None,
        };
        for (rname, route) in &routings {
            let m = route.rows();
            let mut x = s.alloc_zeros::<bf16>(m * k)?;
            util.fill_bf16(s, &mut x, 6, -2.0, 2.0)?;
            let fp8 = Fp8Gemm::new(gpu, Fp8Path::Auto)?;
            let mut xq = s.alloc_zeros::<u8>(m * k)?;
            let mut xs = s.alloc_zeros::<f32>(m * k / FP8_BLOCK)?;
            fp8.act_quant(s, &x, m, k, &mut xq, &mut xs)?;
            let off = s.clone_htod(&route.off)?;
            let act = s.clone_htod(&route.act_list())?;
            let mut y = s.alloc_zeros::<bf16>(m * n)?;
            let mut time_tile = |t: usize| -> Result<f64> {
                let v = time_graph(gpu, GRAPH_MIN_CALLS, 2, iters, || {
                    if t == TILED {
                        g.forward_tiled(s, &set.dev, &xq, &xs, &off, Some(&act), m, &mut y)
                    } else {
                        g.forward_tile(s, &set.dev, &xq, &xs, &off, Some(&act), m, &mut y, t)
                    }
                })?;
                Ok(median_us(v))
            };
            let tile = grouped_tile(m, E);
            let fp8_us = time_tile(tile)?;
            let mut other_tiles = Vec::new();
            for t in [16, 32, 64, TILED] {
                if t != tile {
                    other_tiles.push((t, time_tile(t)?));
                }
            }
            let bf16_us = match (&ops, &table) {
                (Some(o), Some(tb)) => {
                    let v = time_graph(gpu, GRAPH_MIN_CALLS, 2, iters, || {
                        o.moe_grouped_sorted(s, &mut y, &x, tb, &off, m, GroupedVariant::Auto(GemmMode::Cublas))
                    })?;
                    Some(median_us(v))
                }
                _ => None,
            };
            out.push(GroupedBenchRow {
                name,
                routing: rname,
                n,
                k,
                rows: m,
                active: route.active(),
                tile,
                fp8_us,
                other_tiles,
                bf16_us,
                touched_bytes: route.active() * set.dev.expert_bytes(),
            });
        }
    }
    Ok(GroupedBenchReport { device: gpu.name.clone(), copy_gbps, rows: out })
}
