//! GPU-vs-CPU checks of the fp8 projections (`mlaserve_cuda::fp8`), shared by the GPU
//! tests and `mlaserve-cuda-check --fp8`: activation quantisation bit-exact against
//! [`crate::fp8_ref::act_quant`], the GEMMs against the f64 reference at DeepSeek-V3's
//! projection shapes, and batch invariance of the streaming kernel.
//!
//! Inputs are fresh random values (bf16 activations U(-2, 2) with a few planted outliers
//! and an all-zero group; random block-scaled weights); outputs are NaN-poisoned before
//! each launch. The reference covers every row for m ≤ 64 and 12 sampled rows (the first
//! and last included) above.
//!
//! Tolerances: an output may miss the f64 reference by `2^-10 · Σ|terms|` (the kernel
//! sums 128 exact products in the tensor core's accumulator, then promotes in f32) plus
//! `2^-8 · |ref|` for a bf16 output; and the relative L2 error must stay below
//! [`rel_l2_tol`]: 1e-5 for the mma.sync kernel (f32 accumulation), 1e-3 for the wgmma
//! kernels (fp8 accumulator), 4e-3 with a bf16 output. A wrong scale or a misplaced k
//! block moves outputs by O(10 %).

use std::fmt;

use half::bf16;

use crate::fp8_ref::{self, Fp8Err, Fp8Weight};
use crate::rng::Rng;
use crate::util::Util;
use mlaserve_cuda::fp8::{Fp8Gemm, Fp8Linear};
use mlaserve_cuda::fp8_plan::Fp8Path;
use mlaserve_cuda::{Gpu, Result};

/// bf16 NaN pairs / an f32 NaN.
const NAN_BITS: u32 = 0x7fc0_7fc0;
/// Per-output tolerance on `Σ|terms|` (see the module doc).
pub const ABS_TOL: f64 = 1.0 / 1024.0;

/// DeepSeek-V3's fp8 projections `(name, out, in)`, unsharded and at TP 8.
pub const V3_SHAPES: &[(&str, usize, usize)] = &[
    ("q_a 7168->1536", 1536, 7168),
    ("q_b 1536->24576", 24576, 1536),
    ("q_b/tp8 1536->3072", 3072, 1536),
    ("kv_a 7168->576", 576, 7168),
    ("o_proj 16384->7168", 7168, 16384),
    ("o_proj/tp8 2048->7168", 7168, 2048),
    ("mlp up 7168->18432", 18432, 7168),
    ("mlp down 18432->7168", 7168, 18432),
    ("mlp up/tp8 7168->2304", 2304, 7168),
    ("mlp down/tp8 2304->7168", 7168, 2304),
    ("expert up 7168->2048", 2048, 7168),
    ("expert down 2048->7168", 7168, 2048),
    ("expert up/tp8 7168->256", 256, 7168),
    ("expert down/tp8 256->7168", 7168, 256),
];

/// The row counts of the checks and the benchmark.
pub const ROWS: &[usize] = &[1, 4, 64, 256, 4096];

/// The outcome of one GEMM check.
#[derive(Debug, Clone)]
pub struct Fp8Report {
    pub name: String,
    pub err: Fp8Err,
    pub tol_rel_l2: f64,
    /// Rows compared with the reference.
    pub rows_checked: usize,
}

impl Fp8Report {
    pub fn passed(&self) -> bool {
        self.err.all_finite && self.err.worst <= 1.0 && self.err.rel_l2 <= self.tol_rel_l2
    }
}

impl fmt::Display for Fp8Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<58} rel_l2={:.2e} (tol {:.0e}) worst={:.3} rows={} {}",
            self.name,
            self.err.rel_l2,
            self.tol_rel_l2,
            self.err.worst,
            self.rows_checked,
            if self.passed() { "PASS" } else { "FAIL" }
        )
    }
}

/// Random bf16 activations `[m][k]`: U(-2, 2), a few ×50 outliers, row 0's first group zero.
pub fn random_activation(rng: &mut Rng, m: usize, k: usize) -> Vec<bf16> {
    let mut x = rng.bf16_vec(m * k, -2.0, 2.0);
    for _ in 0..(m * k / 4096).max(1) {
        let i = rng.below(m * k);
        x[i] = bf16::from_f32(x[i].to_f32() * 50.0);
    }
    x[..fp8_ref::BLOCK.min(k)].iter_mut().for_each(|v| *v = bf16::ZERO);
    x
}

/// `act_quant` of `x` on the GPU: `(q, s)` on the host.
pub fn gpu_act_quant(gpu: &Gpu, fp8: &Fp8Gemm, x: &[bf16], m: usize, k: usize) -> Result<(Vec<u8>, Vec<f32>)> {
    let s = &gpu.stream;
    let xd = s.clone_htod(x)?;
    let mut q = s.clone_htod(&vec![0x7fu8; m * k])?; // NaN codes: unwritten bytes show
    let mut sc = s.clone_htod(&vec![f32::NAN; m * k / fp8_ref::BLOCK])?;
    fp8.act_quant(s, &xd, m, k, &mut q, &mut sc)?;
    gpu.sync()?;
    Ok((s.clone_dtoh(&q)?, s.clone_dtoh(&sc)?))
}

/// The GPU's quantisation of random activations against the reference, bit for bit
/// (bf16 and f32 inputs). Returns a description of the first mismatch, if any.
pub fn check_act_quant(gpu: &Gpu, fp8: &Fp8Gemm, seed: u64) -> Result<Option<String>> {
    let mut rng = Rng::new(seed);
    let s = &gpu.stream;
    for (m, k) in [(1, 128), (5, 7168), (64, 1536), (33, 18432)] {
        let x = random_activation(&mut rng, m, k);
        let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        let (want_q, want_s) = fp8_ref::act_quant(&xf, m, k);
        let (q, sc) = gpu_act_quant(gpu, fp8, &x, m, k)?;
        if let Some(i) = (0..q.len()).find(|&i| q[i] != want_q[i]) {
            return Ok(Some(format!("act_quant bf16 [{m}, {k}]: byte {i} = {:#04x}, want {:#04x}", q[i], want_q[i])));
        }
        if let Some(i) = (0..sc.len()).find(|&i| sc[i].to_bits() != want_s[i].to_bits()) {
            return Ok(Some(format!("act_quant bf16 [{m}, {k}]: scale {i} = {}, want {}", sc[i], want_s[i])));
        }
        // f32 input: values off the bf16 grid, and tiny ones (subnormal e4m3 codes).
        let xf: Vec<f32> = (0..m * k).map(|i| rng.uniform(-1.0, 1.0) * if i % 7 == 0 { 1e-3 } else { 1.0 }).collect();
        let (want_q, want_s) = fp8_ref::act_quant(&xf, m, k);
        let xd = s.clone_htod(&xf)?;
        let mut qd = s.clone_htod(&vec![0x7fu8; m * k])?;
        let mut sd = s.clone_htod(&vec![f32::NAN; m * k / fp8_ref::BLOCK])?;
        fp8.act_quant(s, &xd, m, k, &mut qd, &mut sd)?;
        gpu.sync()?;
        let (q, sc) = (s.clone_dtoh(&qd)?, s.clone_dtoh(&sd)?);
        if let Some(i) = (0..q.len()).find(|&i| q[i] != want_q[i]) {
            return Ok(Some(format!("act_quant f32 [{m}, {k}]: byte {i} = {:#04x}, want {:#04x}", q[i], want_q[i])));
        }
        if let Some(i) = (0..sc.len()).find(|&i| sc[i].to_bits() != want_s[i].to_bits()) {
            return Ok(Some(format!("act_quant f32 [{m}, {k}]: scale {i} = {}, want {}", sc[i], want_s[i])));
        }
    }
    Ok(None)
}

/// The rows the reference computes for a call of `m` rows.
pub fn checked_rows(m: usize, rng: &mut Rng) -> Vec<usize> {
    if m <= 64 {
        return (0..m).collect();
    }
    let mut rows = vec![0, m - 1];
    while rows.len() < 12 {
        let r = rng.below(m);
        if !rows.contains(&r) {
            rows.push(r);
        }
    }
    rows
}

/// A weight on the host and the device.
#[derive(Debug)]
pub struct Fp8Pair {
    pub host: Fp8Weight,
    pub dev: Fp8Linear,
}

impl Fp8Pair {
    pub fn random(gpu: &Gpu, rng: &mut Rng, n: usize, k: usize) -> Result<Self> {
        let host = Fp8Weight::random(rng, n, k);
        let dev = Fp8Linear::from_raw(&gpu.stream, &host.q, &host.s, n, k)?;
        Ok(Fp8Pair { host, dev })
    }
}

/// Runs `y = x Wᵀ` from a quantised activation with `path`, f32 or bf16 output
/// (NaN-poisoned first); returns y as f32 on the host.
#[allow(clippy::too_many_arguments)]
pub fn gpu_fp8_gemm(
    gpu: &Gpu,
    fp8: &mut Fp8Gemm,
    util: &Util,
    w: &Fp8Linear,
    (xq, xs): (&[u8], &[f32]),
    m: usize,
    path: Fp8Path,
    out_f32: bool,
) -> Result<Vec<f32>> {
    let s = &gpu.stream;
    let (xqd, xsd) = (s.clone_htod(xq)?, s.clone_htod(xs)?);
    let elems = m * w.out;
    let saved = fp8.path;
    fp8.path = path;
    let res = (|| -> Result<Vec<f32>> {
        if out_f32 {
            let mut y = s.alloc_zeros::<f32>(elems)?;
            util.poison_f32(s, &mut y, NAN_BITS)?;
            fp8.forward_quantized(s, w, &xqd, &xsd, m, &mut y)?;
            gpu.sync()?;
            Ok(s.clone_dtoh(&y)?)
        } else {
            let mut y = s.alloc_zeros::<bf16>(elems + elems % 2)?;
            util.poison_bf16(s, &mut y, NAN_BITS)?;
            fp8.forward_quantized(s, w, &xqd, &xsd, m, &mut y)?;
            gpu.sync()?;
            Ok(s.clone_dtoh(&y)?[..elems].iter().map(|v| v.to_f32()).collect())
        }
    })();
    fp8.path = saved;
    res
}

#[allow(clippy::too_many_arguments)]
/// One GEMM check: weight `w`, `m` random rows, kernel `path`, f32 or bf16 output.
pub fn run_fp8_case(
    gpu: &Gpu,
    fp8: &mut Fp8Gemm,
    util: &Util,
    name: &str,
    w: &Fp8Pair,
    m: usize,
    path: Fp8Path,
    out_f32: bool,
    rng: &mut Rng,
) -> Result<Fp8Report> {
    let k = w.host.k;
    let x = random_activation(rng, m, k);
    let (xq, xs) = gpu_act_quant(gpu, fp8, &x, m, k)?;
    let y = gpu_fp8_gemm(gpu, fp8, util, &w.dev, (&xq, &xs), m, path, out_f32)?;
    let rows = checked_rows(m, rng);
    let (want, abs) = fp8_ref::fp8_gemm_rows(&xq, &xs, &w.host, &rows);
    let n = w.host.n;
    let got: Vec<f32> = rows.iter().flat_map(|&r| y[r * n..(r + 1) * n].iter().copied()).collect();
    // Every output must be written (finite), not only the compared rows.
    let all_finite = y.iter().all(|v| v.is_finite());
    let out_tol = if out_f32 { 0.0 } else { 1.0 / 256.0 };
    let mut err = fp8_ref::fp8_err(&got, &want, &abs, ABS_TOL, out_tol);
    err.all_finite &= all_finite;
    Ok(Fp8Report {
        name: format!("{name} m={m} {} {}", path.name(), if out_f32 { "f32" } else { "bf16" }),
        err,
        tol_rel_l2: rel_l2_tol(fp8.has_wgmma(), path, out_f32),
        rows_checked: rows.len(),
    })
}

/// The paths that run distinct kernels here: `stream`, and on Hopper also `portable`
/// (the mma.sync streaming kernel), `wgmma` and `wide`.
pub fn fp8_paths(fp8: &Fp8Gemm) -> Vec<Fp8Path> {
    if fp8.has_wgmma() {
        vec![Fp8Path::Stream, Fp8Path::Portable, Fp8Path::Wgmma, Fp8Path::Wide]
    } else {
        vec![Fp8Path::Stream]
    }
}

/// The relative-L2 tolerance of a check: the mma.sync streaming kernel accumulates in
/// f32 (measured ~1e-7 against the f64 reference), wgmma's fp8 accumulator keeps fewer
/// bits (measured up to 2.2e-4), a bf16 output adds its own rounding (~1.7e-3 measured).
pub fn rel_l2_tol(hopper: bool, path: Fp8Path, out_f32: bool) -> f64 {
    let exact = path == Fp8Path::Portable || (path == Fp8Path::Stream && !hopper);
    match (out_f32, exact) {
        (true, true) => 1e-5,
        (true, false) => 1e-3,
        (false, _) => 4e-3,
    }
}

/// Every V3 shape at `rows`, through each kernel ([`fp8_paths`]), f32 out, plus bf16-out
/// cases per shape.
pub fn run_fp8_checks(gpu: &Gpu, util: &Util, seed: u64, rows: &[usize]) -> Result<Vec<Fp8Report>> {
    let mut fp8 = Fp8Gemm::new(gpu, Fp8Path::Auto)?;
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    let paths = fp8_paths(&fp8);
    for &(name, n, k) in V3_SHAPES {
        let w = Fp8Pair::random(gpu, &mut rng, n, k)?;
        for &m in rows {
            for &p in &paths {
                out.push(run_fp8_case(gpu, &mut fp8, util, name, &w, m, p, true, &mut rng)?);
            }
        }
        out.push(run_fp8_case(gpu, &mut fp8, util, name, &w, 64, Fp8Path::Stream, false, &mut rng)?);
        if fp8.has_wgmma() {
            out.push(run_fp8_case(gpu, &mut fp8, util, name, &w, 256, Fp8Path::Wgmma, false, &mut rng)?);
            out.push(run_fp8_case(gpu, &mut fp8, util, name, &w, 256, Fp8Path::Wide, false, &mut rng)?);
        }
    }
    Ok(out)
}

/// Batch invariance of `path`: rows of a batch of `m` run again alone and inside a batch
/// of 5 other random rows (at position 3) must give bit-identical f32 outputs. Returns
/// the mismatching `(row, context)` descriptions.
pub fn run_fp8_invariance(
    gpu: &Gpu,
    util: &Util,
    path: Fp8Path,
    w: &Fp8Pair,
    m: usize,
    seed: u64,
) -> Result<Vec<String>> {
    let mut fp8 = Fp8Gemm::new(gpu, path)?;
    let mut rng = Rng::new(seed);
    let k = w.host.k;
    let n = w.host.n;
    let x = random_activation(&mut rng, m, k);
    let (xq, xs) = gpu_act_quant(gpu, &fp8, &x, m, k)?;
    let kb = k / fp8_ref::BLOCK;
    let full = gpu_fp8_gemm(gpu, &mut fp8, util, &w.dev, (&xq, &xs), m, path, true)?;
    let mut bad = Vec::new();
    for r in [0, m / 3, m / 2, m - 1] {
        let row_q = &xq[r * k..(r + 1) * k];
        let row_s = &xs[r * kb..(r + 1) * kb];
        let alone = gpu_fp8_gemm(gpu, &mut fp8, util, &w.dev, (row_q, row_s), 1, path, true)?;
        if alone.iter().zip(&full[r * n..(r + 1) * n]).any(|(a, b)| a.to_bits() != b.to_bits()) {
            bad.push(format!("row {r} of {m}: alone differs"));
        }
        let others = random_activation(&mut rng, 5, k);
        let (mut bq, mut bs) = gpu_act_quant(gpu, &fp8, &others, 5, k)?;
        bq[3 * k..4 * k].copy_from_slice(row_q);
        bs[3 * kb..4 * kb].copy_from_slice(row_s);
        let five = gpu_fp8_gemm(gpu, &mut fp8, util, &w.dev, (&bq, &bs), 5, path, true)?;
        if five[3 * n..4 * n].iter().zip(&full[r * n..(r + 1) * n]).any(|(a, b)| a.to_bits() != b.to_bits()) {
            bad.push(format!("row {r} of {m}: in a batch of 5 differs"));
        }
    }
    Ok(bad)
}

/// The Hopper streaming kernel's two split-K reductions ([`Fp8Gemm::cluster_split`]) on
/// the same inputs: the mismatching `m` and element, if any (f32 out, bit for bit).
pub fn run_fp8_cluster_vs_global(
    gpu: &Gpu,
    util: &Util,
    w: &Fp8Pair,
    rows: &[usize],
    seed: u64,
) -> Result<Vec<String>> {
    let mut fp8 = Fp8Gemm::new(gpu, Fp8Path::Stream)?;
    let mut rng = Rng::new(seed);
    let (n, k) = (w.host.n, w.host.k);
    let mut bad = Vec::new();
    for &m in rows {
        let x = random_activation(&mut rng, m, k);
        let (xq, xs) = gpu_act_quant(gpu, &fp8, &x, m, k)?;
        fp8.cluster_split = true;
        let a = gpu_fp8_gemm(gpu, &mut fp8, util, &w.dev, (&xq, &xs), m, Fp8Path::Stream, true)?;
        fp8.cluster_split = false;
        let b = gpu_fp8_gemm(gpu, &mut fp8, util, &w.dev, (&xq, &xs), m, Fp8Path::Stream, true)?;
        if let Some(i) = (0..m * n).find(|&i| a[i].to_bits() != b[i].to_bits()) {
            bad.push(format!("[{n}, {k}] m = {m}: element ({}, {}) {} against {}", i / n, i % n, a[i], b[i]));
        }
    }
    Ok(bad)
}
