//! GPU-vs-CPU checks of the grouped fp8 expert GEMM (`mlaserve_cuda::fp8_grouped`),
//! shared by the GPU tests (`tests/gpu_fp8.rs`) and the benchmark: routings like a
//! decode step and a prefill (rows sorted by expert, some experts empty, a few hot),
//! experts uploaded as a few distinct random weights replicated on the device (the
//! reference needs only the distinct ones), the f64 reference per expert
//! ([`crate::fp8_ref::fp8_gemm_rows`]) on sampled rows, and batch invariance.
//!
//! Tolerances: those of the dense wgmma kernels ([`check_fp8::rel_l2_tol`] of the
//! `stream` path on Hopper: relative L2 1e-3 with f32 output, 4e-3 with bf16; per
//! output `2^-10 · Σ|terms|` (+ `2^-8 · |ref|` for bf16)). Outputs are NaN-poisoned, and
//! every row of the call must come back finite.

use half::bf16;

use crate::check_fp8::{self, Fp8Report, ABS_TOL};
use crate::fp8_ref::{self, Fp8Weight};
use crate::rng::Rng;
use crate::util::Util;
use mlaserve_cuda::fp8::Fp8Gemm;
use mlaserve_cuda::fp8_grouped::{Fp8Experts, Fp8Grouped};
use mlaserve_cuda::fp8_plan::{self, Fp8Path, FP8_BLOCK};
use mlaserve_cuda::{CudaError, Gpu, Result};

const NAN_BITS: u32 = 0x7fc0_7fc0;

/// The `tile` that selects the 128 × 128 tile kernel ([`Fp8Grouped::forward_tiled`])
/// in [`gpu_grouped`] and the checks (16, 32, 64: the streaming kernel's rows per pass).
pub const TILED: usize = 128;

/// Runs the kernel `tile` selects (see [`TILED`]).
#[allow(clippy::too_many_arguments)]
fn launch<T: mlaserve_cuda::linear::GemmOut>(
    g: &Fp8Grouped,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    w: &Fp8Experts,
    xq: &cudarc::driver::CudaSlice<u8>,
    xs: &cudarc::driver::CudaSlice<f32>,
    off: &cudarc::driver::CudaSlice<i32>,
    act: Option<&cudarc::driver::CudaSlice<i32>>,
    rows: usize,
    y: &mut cudarc::driver::CudaSlice<T>,
    tile: usize,
) -> Result<()> {
    if tile == TILED {
        g.forward_tiled(s, w, xq, xs, off, act, rows, y)
    } else {
        g.forward_tile(s, w, xq, xs, off, act, rows, y, tile)
    }
}

/// Rows sorted by expert: `off[e] .. off[e + 1]` are expert `e`'s.
#[derive(Debug, Clone)]
pub struct Routing {
    pub off: Vec<i32>,
    pub experts: usize,
}

impl Routing {
    pub fn rows(&self) -> usize {
        *self.off.last().unwrap_or(&0) as usize
    }

    /// The expert of sorted row `r`.
    pub fn expert_of(&self, r: usize) -> usize {
        self.off.partition_point(|&o| o as usize <= r) - 1
    }

    /// What `moe_sort` writes as `act`: the experts with rows, ascending, then -1 up to
    /// `min(experts, rows)` entries (at least one).
    pub fn act_list(&self) -> Vec<i32> {
        let mut v: Vec<i32> = (0..self.experts).filter(|&e| self.off[e + 1] > self.off[e]).map(|e| e as i32).collect();
        v.resize(self.experts.min(self.rows()).max(1), -1);
        v
    }

    /// Experts with at least one row.
    pub fn active(&self) -> usize {
        self.off.windows(2).filter(|w| w[1] > w[0]).count()
    }

    /// `tokens` tokens, each routed to `top_k` distinct experts of `experts`: every
    /// `cold`-th expert never chosen (empty), and a quarter of the picks from the first
    /// `hot` experts (several passes of a tile), the rest uniform.
    pub fn random(rng: &mut Rng, tokens: usize, top_k: usize, experts: usize, cold: usize, hot: usize) -> Self {
        let allowed: Vec<usize> = (0..experts).filter(|e| cold == 0 || e % cold != cold - 1).collect();
        let hot: Vec<usize> = allowed.iter().copied().take(hot).collect();
        assert!(top_k <= allowed.len());
        let mut counts = vec![0usize; experts];
        for _ in 0..tokens {
            let mut picked: Vec<usize> = Vec::with_capacity(top_k);
            while picked.len() < top_k {
                let e = if !hot.is_empty() && rng.below(4) == 0 {
                    hot[rng.below(hot.len())]
                } else {
                    allowed[rng.below(allowed.len())]
                };
                if !picked.contains(&e) {
                    picked.push(e);
                }
            }
            for e in picked {
                counts[e] += 1;
            }
        }
        let mut off = vec![0i32; experts + 1];
        for e in 0..experts {
            off[e + 1] = off[e] + counts[e] as i32;
        }
        Routing { off, experts }
    }

    /// One row, routed to `expert`.
    pub fn single(experts: usize, expert: usize) -> Self {
        Routing { off: (0..=experts).map(|g| i32::from(g > expert)).collect(), experts }
    }
}

/// The experts on the device (`distinct` random weights, expert `e` a copy of weight
/// `e % distinct`) and the distinct ones on the host.
#[derive(Debug)]
pub struct ExpertSet {
    pub host: Vec<Fp8Weight>,
    pub dev: Fp8Experts,
}

impl ExpertSet {
    pub fn random(gpu: &Gpu, rng: &mut Rng, experts: usize, distinct: usize, n: usize, k: usize) -> Result<Self> {
        let s = &gpu.stream;
        let distinct = distinct.clamp(1, experts);
        let host: Vec<Fp8Weight> = (0..distinct).map(|_| Fp8Weight::random(rng, n, k)).collect();
        let (so, si) = fp8_plan::scale_shape(n, k);
        let (qe, se) = (n * k, so * si);
        // Codes: the distinct weights uploaded once, then copied on the device.
        let mut q = s.alloc_zeros::<u8>(experts * qe)?;
        for (i, h) in host.iter().enumerate() {
            s.memcpy_htod(&h.q, &mut q.slice_mut(i * qe..(i + 1) * qe))?;
        }
        for e in distinct..experts {
            let src = (e % distinct) * qe;
            let (a, mut b) = q.split_at_mut(e * qe);
            s.memcpy_dtod(&a.slice(src..src + qe), &mut b.slice_mut(0..qe))?;
        }
        let scales: Vec<f32> = (0..experts).flat_map(|e| host[e % distinct].s.iter().copied()).collect();
        debug_assert_eq!(scales.len(), experts * se);
        let scale = s.clone_htod(&scales)?;
        fp8_plan::check_experts(experts, n, k, q.len(), scale.len()).map_err(|e| CudaError::shape("ExpertSet", e))?;
        Ok(ExpertSet { host, dev: Fp8Experts { q, scale, experts, out: n, inp: k, x_inp: k } })
    }

    pub fn weight_of(&self, e: usize) -> &Fp8Weight {
        &self.host[e % self.host.len()]
    }
}

/// Runs the grouped GEMM (f32 or bf16 out, NaN-poisoned first) on host inputs; returns y
/// as f32. `tile`: `None` for the plan's choice.
#[allow(clippy::too_many_arguments)]
pub fn gpu_grouped(
    gpu: &Gpu,
    g: &Fp8Grouped,
    util: &Util,
    w: &Fp8Experts,
    (xq, xs): (&[u8], &[f32]),
    route: &Routing,
    out_f32: bool,
    tile: Option<usize>,
) -> Result<Vec<f32>> {
    let s = &gpu.stream;
    let m = route.rows();
    let tile = tile.unwrap_or_else(|| fp8_plan::grouped_tile(m, w.experts));
    let (xqd, xsd, offd) = (s.clone_htod(xq)?, s.clone_htod(xs)?, s.clone_htod(&route.off)?);
    // The compact grid the backend launches (moe_sort's list of the experts with rows).
    let actd = s.clone_htod(&route.act_list())?;
    let elems = m * w.out;
    if out_f32 {
        let mut y = s.alloc_zeros::<f32>(elems.max(1))?;
        util.poison_f32(s, &mut y, NAN_BITS)?;
        launch(g, s, w, &xqd, &xsd, &offd, Some(&actd), m, &mut y, tile)?;
        gpu.sync()?;
        Ok(s.clone_dtoh(&y)?[..elems].to_vec())
    } else {
        let mut y = s.alloc_zeros::<bf16>((elems + elems % 2).max(2))?;
        util.poison_bf16(s, &mut y, NAN_BITS)?;
        launch(g, s, w, &xqd, &xsd, &offd, Some(&actd), m, &mut y, tile)?;
        gpu.sync()?;
        Ok(s.clone_dtoh(&y)?[..elems].iter().map(|v| v.to_f32()).collect())
    }
}

/// Sorted rows the reference computes: all for `m ≤ max`, else every row of the first
/// and last active experts and of the largest one, plus random rows up to `max`.
pub fn grouped_checked_rows(route: &Routing, max: usize, rng: &mut Rng) -> Vec<usize> {
    let m = route.rows();
    if m <= max {
        return (0..m).collect();
    }
    let mut rows = Vec::new();
    let act: Vec<usize> = (0..route.experts).filter(|&e| route.off[e + 1] > route.off[e]).collect();
    let largest = (0..route.experts).max_by_key(|&e| route.off[e + 1] - route.off[e]).unwrap_or(0);
    for e in [act[0], act[act.len() - 1], largest] {
        for r in route.off[e] as usize..route.off[e + 1] as usize {
            if rows.len() < max / 2 && !rows.contains(&r) {
                rows.push(r);
            }
        }
    }
    while rows.len() < max {
        let r = rng.below(m);
        if !rows.contains(&r) {
            rows.push(r);
        }
    }
    rows.sort_unstable();
    rows
}

/// The reference of `rows` (each through its expert's weight) against `y`.
pub fn compare(
    set: &ExpertSet,
    route: &Routing,
    (xq, xs): (&[u8], &[f32]),
    y: &[f32],
    rows: &[usize],
    out_f32: bool,
) -> fp8_ref::Fp8Err {
    let n = set.dev.out;
    let (mut want, mut abs, mut got) = (Vec::new(), Vec::new(), Vec::new());
    // Group the rows by distinct weight: one reference call each.
    for d in 0..set.host.len() {
        let rs: Vec<usize> = rows.iter().copied().filter(|&r| route.expert_of(r) % set.host.len() == d).collect();
        if rs.is_empty() {
            continue;
        }
        let (w, a) = fp8_ref::fp8_gemm_rows(xq, xs, &set.host[d], &rs);
        want.extend(w);
        abs.extend(a);
        got.extend(rs.iter().flat_map(|&r| y[r * n..(r + 1) * n].iter().copied()));
    }
    let out_tol = if out_f32 { 0.0 } else { 1.0 / 256.0 };
    let mut err = fp8_ref::fp8_err(&got, &want, &abs, ABS_TOL, out_tol);
    err.all_finite &= y.iter().all(|v| v.is_finite());
    err
}

/// Random activations for `m` sorted rows, quantised on the GPU.
pub fn random_quantised(gpu: &Gpu, fp8: &Fp8Gemm, rng: &mut Rng, m: usize, k: usize) -> Result<(Vec<u8>, Vec<f32>)> {
    let x = check_fp8::random_activation(rng, m.max(1), k);
    let (q, s) = check_fp8::gpu_act_quant(gpu, fp8, &x, m.max(1), k)?;
    Ok((q[..m * k].to_vec(), s[..m * k / FP8_BLOCK].to_vec()))
}

/// One grouped check: `route` over `set`, f32 or bf16 out, `tile` (None: the plan's),
/// the reference on at most `max_rows` sorted rows.
#[allow(clippy::too_many_arguments)]
pub fn run_grouped_case(
    gpu: &Gpu,
    fp8: &Fp8Gemm,
    g: &Fp8Grouped,
    util: &Util,
    name: &str,
    set: &ExpertSet,
    route: &Routing,
    out_f32: bool,
    tile: Option<usize>,
    max_rows: usize,
    rng: &mut Rng,
) -> Result<Fp8Report> {
    let (m, k) = (route.rows(), set.dev.inp);
    let (xq, xs) = random_quantised(gpu, fp8, rng, m, k)?;
    let y = gpu_grouped(gpu, g, util, &set.dev, (&xq, &xs), route, out_f32, tile)?;
    let rows = grouped_checked_rows(route, max_rows, rng);
    let err = compare(set, route, (&xq, &xs), &y, &rows, out_f32);
    let t = tile.unwrap_or_else(|| fp8_plan::grouped_tile(m, set.dev.experts));
    Ok(Fp8Report {
        name: format!(
            "{name} [{}x{}x{}] rows={m} active={} tile={t} {}",
            set.dev.experts,
            set.dev.out,
            k,
            route.active(),
            if out_f32 { "f32" } else { "bf16" }
        ),
        err,
        tol_rel_l2: check_fp8::rel_l2_tol(true, Fp8Path::Stream, out_f32),
        rows_checked: rows.len(),
    })
}

/// Batch invariance: rows of the full call (the plan's tile, and tile 64) run again
/// alone (tile 16) must give bit-identical f32 outputs; with `tiled`, the tile kernel in
/// all three. Returns the mismatches.
#[allow(clippy::too_many_arguments)]
pub fn run_grouped_invariance(
    gpu: &Gpu,
    fp8: &Fp8Gemm,
    g: &Fp8Grouped,
    util: &Util,
    set: &ExpertSet,
    route: &Routing,
    tiled: bool,
    rng: &mut Rng,
) -> Result<Vec<String>> {
    let pick = |t: Option<usize>| if tiled { Some(TILED) } else { t };
    let (m, k, n) = (route.rows(), set.dev.inp, set.dev.out);
    let kb = k / FP8_BLOCK;
    let (xq, xs) = random_quantised(gpu, fp8, rng, m, k)?;
    let full = gpu_grouped(gpu, g, util, &set.dev, (&xq, &xs), route, true, pick(None))?;
    let full64 = gpu_grouped(gpu, g, util, &set.dev, (&xq, &xs), route, true, pick(Some(64)))?;
    let mut bad = Vec::new();
    let largest = (0..route.experts).max_by_key(|&e| route.off[e + 1] - route.off[e]).unwrap_or(0);
    let last_of_largest = route.off[largest + 1] as usize - 1;
    for r in [0, m / 3, m / 2, last_of_largest, m - 1] {
        let e = route.expert_of(r);
        let alone = gpu_grouped(
            gpu,
            g,
            util,
            &set.dev,
            (&xq[r * k..(r + 1) * k], &xs[r * kb..(r + 1) * kb]),
            &Routing::single(route.experts, e),
            true,
            pick(Some(16)),
        )?;
        let want = &full[r * n..(r + 1) * n];
        if alone.iter().zip(want).any(|(a, b)| a.to_bits() != b.to_bits()) {
            bad.push(format!("row {r} (expert {e}) of {m}: alone differs from the full call"));
        }
        if full64[r * n..(r + 1) * n].iter().zip(want).any(|(a, b)| a.to_bits() != b.to_bits()) {
            bad.push(format!("row {r} (expert {e}) of {m}: tile 64 differs from the plan's tile"));
        }
    }
    Ok(bad)
}
