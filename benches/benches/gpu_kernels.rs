//! Kernel timings on the GPU (`cargo bench --features cuda --bench gpu_kernels`), each
//! beside the ceiling measured in the same run (copy bandwidth, cuBLAS rate): the grouped
//! MoE experts, the batch-invariant projections, the router's logits, the sampling rule.
//! Arguments select benchmarks by name (`grouped`, `gemm`, `router`, `sample`); none runs
//! all. Needs a GPU (device 0).

use cudarc::driver::CudaSlice;
use half::bf16;
use mlaserve_cuda::linear::{Gemm, GemmMode, Linear, TcKernels};
use mlaserve_cuda::ops::{ExpertWeights, GroupedVariant, Ops};
use mlaserve_cuda::plan;
use mlaserve_cuda::router::{Router, RouterTile};
use mlaserve_cuda::Gpu;
use mlaserve_cuda_lab::bench::{measure_copy_bandwidth, measure_gemm_bf16, time_calls};
use mlaserve_cuda_lab::bench_sample::bench_sample;
use mlaserve_cuda_lab::util::Util;

/// One timed router call: (y, the weight copy of this call).
type Call<'a> = dyn Fn(&mut CudaSlice<f32>, &CudaSlice<f32>) -> mlaserve_cuda::Result<()> + 'a;

fn main() {
    let only: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let on = |name: &str| only.is_empty() || only.iter().any(|o| o == name);
    let gpu = Gpu::new(0).expect("a GPU (device 0)");
    if on("grouped") {
        grouped_experts_tensor_core(&gpu);
    }
    if on("gemm") {
        gemm_invariant_tc(&gpu);
    }
    if on("router") {
        router(&gpu);
    }
    if on("sample") {
        sample_kernel(&gpu);
    }
}

/// Timings of the grouped expert kernels at V3 shapes (a separate test so that memcheck
/// can run the correctness test above without them).
fn grouped_experts_tensor_core(gpu: &Gpu) {
    let g = gpu;
    let s = &g.stream;
    let ops = Ops::new(g, TcKernels::Auto).expect("ops");
    let util = Util::new(g).expect("util");
    // Timings at V3 shapes: 64 experts (5.6 GB of weights, far past L2), every one touched.
    let copy_gbps = measure_copy_bandwidth(g, &util, 1 << 30).expect("copy");
    let experts = 64;
    for (what, n, k, out_f32) in [("gate_up", 4096usize, 7168usize, false), ("down", 7168, 2048, true)] {
        let lins: Vec<Linear> = (0..experts)
            .map(|i| {
                let mut w = s.alloc_zeros::<bf16>(n * k).expect("w");
                util.fill_bf16(s, &mut w, 5000 + i as u64, -0.05, 0.05).expect("fill");
                Linear { w, out: n, inp: k }
            })
            .collect();
        let table = ExpertWeights::new(s, &lins.iter().collect::<Vec<_>>()).expect("table");
        let read_us = (experts * n * k * 2) as f64 / (copy_gbps * 1e9) * 1e6;
        // Rows per expert: even, and uneven around 64 (40 to 88, as a prefill's routing
        // spreads them: experts past 64 rows take a second 64-row chunk).
        let cases: Vec<(String, Vec<usize>)> = [8usize, 64, 128, 256]
            .iter()
            .map(|&per| (format!("{per} rows"), vec![per; experts]))
            .chain(std::iter::once((
                "40-88 rows (mean 64)".to_string(),
                (0..experts).map(|e| 40 + (e * 37) % 49).collect(),
            )))
            .collect();
        for (label, counts) in cases {
            let rows: usize = counts.iter().sum();
            let mut off = vec![0i32];
            for c in &counts {
                off.push(off.last().copied().unwrap_or(0) + *c as i32);
            }
            let offd = s.clone_htod(&off).expect("off");
            let mut x = s.alloc_zeros::<bf16>(rows * k).expect("x");
            util.fill_bf16(s, &mut x, 77, -1.0, 1.0).expect("fill");
            let mut yf = s.alloc_zeros::<f32>(rows * n).expect("y");
            let mut yb = s.alloc_zeros::<bf16>(rows * n).expect("y");
            let mut time = |v: GroupedVariant| -> f64 {
                let t = time_calls(g, 3, 25, || {
                    if out_f32 {
                        ops.moe_grouped_sorted(s, &mut yf, &x, &table, &offd, rows, v)
                    } else {
                        ops.moe_grouped_sorted(s, &mut yb, &x, &table, &offd, rows, v)
                    }
                })
                .expect("time");
                t[t.len() / 2] * 1e3
            };
            // The CUDA-core kernels only where they are candidates (few rows per expert).
            let few = rows <= 64 * experts;
            let (direct, staged) =
                if few { (time(GroupedVariant::Direct), time(GroupedVariant::Staged)) } else { (f64::NAN, f64::NAN) };
            let tc = time(GroupedVariant::TensorCore);
            let hopper = g.compute_capability == (9, 0);
            let wgt = if hopper { time(GroupedVariant::WgmmaTma) } else { f64::NAN };
            let tflops = |us: f64| (2 * rows * n * k) as f64 / (us * 1e-6) / 1e12;
            println!(
                "grouped {what} [{n}×{k}] {experts} experts × {label}, median of 25 (µs): CUDA cores direct \
                 {direct:.0}, staged {staged:.0}; tensor cores {tc:.0}, wgmma + TMA {wgt:.0} \
                 ({:.0} TFLOP/s); weights once at copy bandwidth ({copy_gbps:.0} GB/s) {read_us:.0}",
                tflops(wgt)
            );
        }
    }
}

/// Times of the dense projections at DeepSeek-V3's shapes: cuBLAS against `linear_tc`
/// (the batch-invariant tensor-core GEMM, 64-row tiles up to 64 rows, 128 × 128 above),
/// beside the time to read the weight once at the copy bandwidth and the cuBLAS 8192³ rate
/// of the same run (printed, not asserted).
fn gemm_invariant_tc(gpu: &Gpu) {
    let g = gpu;
    let s = &g.stream;
    let util = Util::new(g).expect("util");
    let copy_gbps = measure_copy_bandwidth(g, &util, 1 << 30).expect("copy");
    let peak = measure_gemm_bf16(g, &util, 8192).expect("gemm rate");
    println!("ceilings: copy {copy_gbps:.0} GB/s, cuBLAS bf16 8192³ {peak:.0} TFLOP/s");
    let mut gemms: Vec<Gemm> = [
        (GemmMode::Cublas, TcKernels::Auto),
        (GemmMode::InvariantTc, TcKernels::MmaSync),
        (GemmMode::InvariantTc, TcKernels::MmaSync),
    ]
    .map(|(m, k)| Gemm::new(g, m, k).expect("gemm"))
    .into();
    gemms[2].large_from = 0;
    if g.compute_capability == (9, 0) {
        gemms.push(Gemm::new(g, GemmMode::InvariantTc, TcKernels::WgmmaTma).expect("gemm"));
    }
    for (what, n, k) in [
        ("q_a", 1536usize, 7168usize),
        ("q_b", 24576, 1536),
        ("kv_a", 576, 7168),
        ("o_proj", 7168, 16384),
        ("gate_up", 36864, 7168),
        ("down", 7168, 18432),
        ("head", 129280, 7168),
    ] {
        let mut w = s.alloc_zeros::<bf16>(n * k).expect("w");
        util.fill_bf16(s, &mut w, 900 + n as u64, -0.05, 0.05).expect("fill");
        let lin = Linear { w, out: n, inp: k };
        let read_ms = (n * k * 2) as f64 / (copy_gbps * 1e9) * 1e3;
        for m in [8usize, 64, 256, 2048] {
            let mut x = s.alloc_zeros::<bf16>(m * k).expect("x");
            util.fill_bf16(s, &mut x, 31, -1.0, 1.0).expect("fill");
            let mut y = s.alloc_zeros::<f32>(m * n).expect("y");
            let ms: Vec<f64> = gemms
                .iter()
                .map(|gm| {
                    let t = time_calls(g, 3, 15, || gm.forward(s, &lin, &x, m, &mut y)).expect("time");
                    t[t.len() / 2] // ms
                })
                .collect();
            let tf = |ms: f64| 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;
            println!(
                "gemm {what:>7} [{n}×{k}] m={m:>4}: cuBLAS {:.3} ms ({:.0} TFLOP/s), linear_tc {:.3} ms ({:.0} \
                 TFLOP/s, {:.2}x cuBLAS), its 128-row tile at this m {:.3} ms ({:.0} TFLOP/s); weight once at copy \
                 bandwidth {read_ms:.3} ms",
                ms[0],
                tf(ms[0]),
                ms[1],
                tf(ms[1]),
                ms[1] / ms[0],
                ms[2],
                tf(ms[2]),
            );
            if let Some(&t) = ms.get(3) {
                println!(
                    "gemm {what:>7} [{n}×{k}] m={m:>4}: wgmma+TMA {t:.3} ms ({:.0} TFLOP/s, {:.2}x cuBLAS)",
                    tf(t),
                    t / ms[0]
                );
            }
        }
    }
}

/// Median of 20 event-timed calls at V3's gate (256 × 7168): the first router kernel
/// (`linear_f32_of32`, one warp per logit) against the tiled one (its pick, and each tile
/// forced), with GFLOP/s and GB/s (W, x and y once), beside the copy bandwidth measured
/// in the same run and W's read time at it. Calls cycle through 8 copies of W (59 MB,
/// more than the L2), so that each reads its weight from memory as a layer of the forward
/// pass does. Printed, not asserted.
fn router(gpu: &Gpu) {
    let g = gpu;
    let s = &g.stream;
    let util = Util::new(g).expect("util");
    let router = Router::new(g).expect("router");
    let copy_gbps = measure_copy_bandwidth(g, &util, 1 << 30).expect("copy");
    let (n, k) = (256usize, 7168usize);
    let ws: Vec<CudaSlice<f32>> = (0..8)
        .map(|i| {
            let mut w = s.alloc_zeros::<f32>(n * k).expect("w");
            util.fill_f32(s, &mut w, 77 + i, -0.05, 0.05).expect("fill");
            w
        })
        .collect();
    let read_us = (n * k * 4) as f64 / (copy_gbps * 1e9) * 1e6;
    let (ksplit, kchunk) = plan::router_split(n, k, g.num_sms);
    println!(
        "router timing [{n}×{k}] f32, {ksplit} k ranges of {kchunk} on {} SMs; copy {copy_gbps:.0} GB/s, W once at \
         it {read_us:.1} µs; median of 20 (µs, GFLOP/s, GB/s)",
        g.num_sms
    );
    for m in [1usize, 8, 32, 64, 256, 2048] {
        let mut x = s.alloc_zeros::<f32>(m * k).expect("x");
        util.fill_f32(s, &mut x, 31 + m as u64, -1.0, 1.0).expect("fill");
        let mut y = s.alloc_zeros::<f32>(m * n).expect("y");
        let mut time = |f: &Call| {
            let mut i = 0;
            let t = time_calls(g, 3, 20, || {
                i += 1;
                f(&mut y, &ws[i % ws.len()])
            })
            .expect("time");
            t[t.len() / 2] * 1e3 // µs
        };
        let warp = time(&|y, w| router.logits_warp(s, y, &x, w, m, n, k));
        let auto = time(&|y, w| router.logits(s, y, &x, w, m, n, k));
        let t16 = time(&|y, w| router.logits_with(s, y, &x, w, m, n, k, RouterTile::Decode));
        let t64 = time(&|y, w| router.logits_with(s, y, &x, w, m, n, k, RouterTile::Prefill));
        let gflops = |us: f64| 2.0 * (m * n * k) as f64 / (us * 1e-6) / 1e9;
        let gbps = |us: f64| ((n * k + m * k + m * n) * 4) as f64 / (us * 1e-6) / 1e9;
        let fig = |us: f64| format!("{us:8.1} µs {:7.0} GFLOP/s {:5.0} GB/s", gflops(us), gbps(us));
        println!(
            "router m={m:>4}: warp kernel {}; tiled (auto) {} ({:.1}x); decode tile {}; prefill tile {}",
            fig(warp),
            fig(auto),
            warp / auto,
            fig(t16),
            fig(t64)
        );
    }
}

fn sample_kernel(gpu: &Gpu) {
    let report = bench_sample(gpu, 129280, &[1, 64, 256]).expect("bench");
    print!("{report}");
}
