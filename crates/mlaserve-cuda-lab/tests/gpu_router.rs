//! The MoE router's f32 logits (`mlaserve_cuda::router`, kernels `router_f32_tile16`,
//! `router_f32_tile64`, `router_reduce_f32`) on fresh random inputs: against an f64 CPU
//! reference, bit for bit against the same sum done on the CPU in the order the kernels
//! document (per k range of `plan::router_split` an f32 FMA chain in increasing k, the
//! ranges added in order), and bit for bit across batches and tiles. And the timing of
//! both tiles per row count: `RouterTile::Auto` must take the faster one.
//!
//! Tolerance: max|Δ| / max|ref| ≤ 1e-5 against the f64 reference (f32 sums of up to 7168
//! products; a dropped or doubled product is ~1e-3). Output buffers start as NaN, so a
//! logit the kernels fail to write fails the check.
//! Without a GPU the tests print why and pass (`MLASERVE_REQUIRE_GPU=1` makes it fail).
#![cfg(feature = "cuda")]

// The GPU test helpers of mlaserve-cuda's own tests, shared rather than copied.
#[path = "../../mlaserve-cuda/tests/common/mod.rs"]
mod common;

use cudarc::driver::CudaSlice;
use mlaserve_cuda::ops::Ops;
use mlaserve_cuda::plan;
use mlaserve_cuda::router::{Router, RouterTile};
use mlaserve_cuda::Gpu;
use mlaserve_cuda_lab::rng::Rng;

const TILES: [RouterTile; 4] = [RouterTile::Auto, RouterTile::Decode, RouterTile::Mid, RouterTile::Prefill];
const TOL: f64 = 1e-5;

fn rand(rng: &mut Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.uniform(lo, hi)).collect()
}

/// `y = x · wᵀ` in f64, rows spread over the host's threads.
fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut out = vec![0f64; m * n];
    let threads = std::thread::available_parallelism().map_or(4, |p| p.get());
    let rows_per = m.div_ceil(threads).max(1);
    std::thread::scope(|sc| {
        for (t, part) in out.chunks_mut(rows_per * n).enumerate() {
            sc.spawn(move || {
                for (i, o) in part.iter_mut().enumerate() {
                    let (r, c) = (t * rows_per + i / n, i % n);
                    let (xr, wr) = (&x[r * k..(r + 1) * k], &w[c * k..(c + 1) * k]);
                    *o = xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
                }
            });
        }
    });
    out
}

/// One row's logits summed as the kernels document it: per k range an f32 fused
/// multiply-add chain from +0 in increasing k, the ranges' partials added in range order.
fn fixed_order(xr: &[f32], w: &[f32], n: usize, k: usize, num_sms: usize) -> Vec<f32> {
    let (ksplit, kchunk) = plan::router_split(n, k, num_sms);
    (0..n)
        .map(|c| {
            let wr = &w[c * k..(c + 1) * k];
            let part =
                |z: usize| (z * kchunk..((z + 1) * kchunk).min(k)).fold(0f32, |acc, j| xr[j].mul_add(wr[j], acc));
            (1..ksplit).fold(part(0), |y, z| y + part(z))
        })
        .collect()
}

/// max|got − want| / max|want|; NaN when any output is not finite.
fn rel(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    if got.iter().any(|v| !v.is_finite()) {
        return f64::NAN;
    }
    let d = got.iter().zip(want).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
    let m = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
    d / m.max(1e-30)
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
}

/// The logits of `m` rows of `x` through `tile`, into a buffer that starts as NaN.
#[allow(clippy::too_many_arguments)]
fn run(
    g: &Gpu,
    router: &Router,
    x: &[f32],
    w: &CudaSlice<f32>,
    m: usize,
    n: usize,
    k: usize,
    tile: RouterTile,
) -> Vec<f32> {
    let s = &g.stream;
    let xd = s.clone_htod(x).expect("x");
    let mut y = s.clone_htod(&vec![f32::NAN; m * n]).expect("y");
    router.logits_with(s, &mut y, &xd, w, m, n, k, tile).expect("router");
    s.clone_dtoh(&y).expect("dtoh")
}

/// Every tile at each shape against the f64 reference (tolerance) and the documented
/// order (bits, on the rows in `exact_rows` of each shape, all when None).
fn check_shapes(shapes: &[(usize, usize, usize)], exact_rows: Option<&[usize]>, seed: u64) {
    let Some(g) = common::gpu() else { return };
    let router = Router::new(&g).expect("router");
    let mut rng = Rng::new(seed);
    let mut fails = Vec::new();
    for &(m, n, k) in shapes {
        let x = rand(&mut rng, m * k, -1.0, 1.0);
        let w = rand(&mut rng, n * k, -0.05, 0.05);
        let wd = g.stream.clone_htod(&w).expect("w");
        let want = reference(&x, &w, m, n, k);
        let mut rows: Vec<usize> = match exact_rows {
            Some(r) => r.iter().map(|&r| r.min(m - 1)).collect(),
            None => (0..m).collect(),
        };
        rows.dedup();
        let exact: Vec<(usize, Vec<f32>)> =
            rows.iter().map(|&r| (r, fixed_order(&x[r * k..(r + 1) * k], &w, n, k, g.num_sms))).collect();
        let (ksplit, kchunk) = plan::router_split(n, k, g.num_sms);
        // One line per shape (Auto, Decode, Prefill): rel error, bits equal to the order.
        let (mut rels, mut bits, mut ok) = (Vec::new(), Vec::new(), true);
        for tile in TILES {
            let got = run(&g, &router, &x, &wd, m, n, k, tile);
            let (r, b) = (rel(&got, &want), exact.iter().all(|(r, e)| same_bits(&got[r * n..(r + 1) * n], e)));
            if !(r <= TOL && b) {
                ok = false;
                fails.push(format!("{tile:?} m={m} n={n} k={k}: rel {r:.3e}, documented order {b}"));
            }
            rels.push(format!("{r:.2e}"));
            bits.push(b);
        }
        println!(
            "router m={m} n={n} k={k} ({ksplit} k ranges of {kchunk}), tiles auto/decode/mid/prefill: rel {} (tol \
             {TOL:.0e}); {} rows == the documented order: {bits:?} {}",
            rels.join(" "),
            rows.len(),
            if ok { "ok" } else { "FAIL" }
        );
    }
    assert!(fails.is_empty(), "failed: {fails:?}");
}

/// Small and odd shapes: one row tile or a partial one, n not a multiple of 16 or 64,
/// k not a multiple of 4 (4-byte loads) or of the k tiles (a short last tile), a single
/// k range (the kernel writes y) and several; every row checked bit for bit.
#[test]
fn router_logits_small_shapes_match_reference() {
    check_shapes(&[(3, 16, 36), (5, 160, 5120), (130, 64, 1000), (67, 40, 1001), (40, 4100, 256), (1, 1, 3)], None, 21);
}

/// DeepSeek-V3's gate (256 experts × 7168) at decode and prefill row counts.
#[test]
fn router_logits_deepseek_shapes_match_reference() {
    check_shapes(
        &[(1, 256, 7168), (8, 256, 7168), (256, 256, 7168), (2048, 256, 7168)],
        Some(&[0, 1, 7, 63, 64, 255, 1000, 2047]),
        22,
    );
}

/// Bit for bit: 200 rows in one call (the prefill tile, and the decode tile), each of
/// rows {0, 63, 64, 130, 199} alone, and rows 60..67 as a call of 7 (across a 64-row
/// tile boundary), through both tiles and the backend's `Ops::router_logits`; plus a call
/// of 4200 rows (two slabs of partials at V3's shape) against rows 4095, 4096, 4199 alone.
#[test]
fn router_logits_are_batch_invariant() {
    let Some(g) = common::gpu() else { return };
    let s = &g.stream;
    let router = Router::new(&g).expect("router");
    let ops = Ops::new(&g, mlaserve_cuda::linear::TcKernels::Auto).expect("ops");
    let mut rng = Rng::new(23);
    let mut fails = Vec::new();
    for (n, k, m) in [(256, 7168, 200), (160, 5120, 200), (40, 1001, 200), (4100, 256, 200), (256, 7168, 4200)] {
        let x = rand(&mut rng, m * k, -1.0, 1.0);
        let wd = s.clone_htod(&rand(&mut rng, n * k, -0.05, 0.05)).expect("w");
        let all = run(&g, &router, &x, &wd, m, n, k, RouterTile::Auto);
        let mut same = all.iter().all(|v| v.is_finite());
        if m <= 200 {
            same &= same_bits(&all, &run(&g, &router, &x, &wd, m, n, k, RouterTile::Decode));
            same &= same_bits(&all, &run(&g, &router, &x, &wd, m, n, k, RouterTile::Prefill));
            let xd = s.clone_htod(&x).expect("x");
            let mut y = s.clone_htod(&vec![f32::NAN; m * n]).expect("y");
            ops.router_logits(s, &mut y, &xd, &wd, m, n, k).expect("router");
            same &= same_bits(&all, &s.clone_dtoh(&y).expect("dtoh"));
            for tile in TILES {
                let y7 = run(&g, &router, &x[60 * k..67 * k], &wd, 7, n, k, tile);
                same &= same_bits(&all[60 * n..67 * n], &y7);
            }
        }
        let rows: Vec<usize> = [0, 63, 64, 130, 4095, 4096, m - 1].into_iter().filter(|&r| r < m).collect();
        for &r in &rows {
            for tile in TILES {
                same &=
                    same_bits(&all[r * n..(r + 1) * n], &run(&g, &router, &x[r * k..(r + 1) * k], &wd, 1, n, k, tile));
            }
        }
        let (ksplit, _) = plan::router_split(n, k, g.num_sms);
        println!(
            "router n={n} k={k} ({ksplit} k ranges): rows {rows:?} alone == in {m} rows{}: {same}",
            if m <= 200 { " == rows 60..67 as 7 rows, every tile and Ops::router_logits" } else { "" }
        );
        if !same {
            fails.push(format!("router logits depend on the batch (n={n} k={k} m={m})"));
        }
    }
    assert!(fails.is_empty(), "failed: {fails:?}");
}

/// [`RouterTile::Auto`]'s choice of tile at V3's router shape (256 experts × 7168):
/// graph-replay times of the three tiles and of Auto per row count; Auto must run within
/// 15% of the fastest tile at every m.
#[test]
fn router_auto_takes_the_faster_tile() {
    use mlaserve_cuda_lab::bench::{time_graph, GRAPH_CALLS};
    let Some(g) = common::gpu() else { return };
    let router = Router::new(&g).expect("router");
    let (n, k) = (256, 7168);
    let mut rng = Rng::new(17);
    let wd = g.stream.clone_htod(&rand(&mut rng, n * k, -1.0, 1.0)).expect("w");
    let mut fails = Vec::new();
    for m in [1usize, 8, 16, 32, 48, 64, 96, 128, 256, 1024] {
        let x = g.stream.clone_htod(&rand(&mut rng, m * k, -1.0, 1.0)).expect("x");
        let mut y = g.stream.alloc_zeros::<f32>(m * n).expect("y");
        let mut us = Vec::new();
        for tile in [RouterTile::Decode, RouterTile::Mid, RouterTile::Prefill, RouterTile::Auto] {
            let t =
                time_graph(&g, GRAPH_CALLS, 3, 30, || router.logits_with(&g.stream, &mut y, &x, &wd, m, n, k, tile))
                    .expect("time");
            us.push(t[t.len() / 2] * 1e3);
        }
        let best = us[0].min(us[1]).min(us[2]);
        println!(
            "router m={m:5}: decode tile {:7.1} us, middle tile {:7.1} us, prefill tile {:7.1} us, auto {:7.1} us",
            us[0], us[1], us[2], us[3]
        );
        if us[3] > 1.15 * best {
            fails.push(format!("m = {m}: auto {:.1} us, the fastest tile {best:.1} us", us[3]));
        }
    }
    assert!(fails.is_empty(), "failed: {fails:?}");
}

/// `Router::logits_split` (the partials the routing kernel sums itself) and
/// `Ops::route_split`: the partials added in range order on the host are the bits of
/// `Router::logits`, and routing from the partials picks the same experts with the same
/// weights, bit for bit, as routing from the logits. At 1, 64 and 300 rows of V3's router
/// (16 k ranges) and at 5,000 rows (more partials than one launch holds: the logits).
#[test]
fn split_logits_route_as_the_logits() {
    use mlaserve_cuda::ops::RouteParams;
    let Some(g) = common::gpu() else { return };
    let s = &g.stream;
    let router = Router::new(&g).expect("router");
    let ops = Ops::new(&g, mlaserve_cuda::linear::TcKernels::Auto).expect("ops");
    let mut rng = Rng::new(29);
    let (n, k) = (256, 7168);
    let wd = s.clone_htod(&rand(&mut rng, n * k, -0.05, 0.05)).expect("w");
    let bias = s.clone_htod(&rand(&mut rng, n, 0.0, 0.1)).expect("bias");
    let p =
        RouteParams { experts: n, k: 8, n_group: 8, topk_group: 4, method: 2, scoring: 0, normalise: true, scale: 2.5 };
    let mut fails = Vec::new();
    for m in [1usize, 64, 300, 5000] {
        let xd = s.clone_htod(&rand(&mut rng, m * k, -1.0, 1.0)).expect("x");
        let logits = run(&g, &router, &s.clone_dtoh(&xd).expect("x"), &wd, m, n, k, RouterTile::Auto);
        let (part, ksplit) = router.logits_split(s, &xd, &wd, m, n, k).expect("split");
        let ph = s.clone_dtoh(&part).expect("part");
        let summed: Vec<f32> = (0..m * n).map(|i| (1..ksplit).fold(ph[i], |acc, z| acc + ph[z * m * n + i])).collect();
        let route = |buf: &CudaSlice<f32>, ks: usize| {
            let mut ids = s.alloc_zeros::<i32>(m * p.k).expect("ids");
            let mut w = s.alloc_zeros::<f32>(m * p.k).expect("w");
            ops.route_split(s, &mut ids, &mut w, (buf, ks), Some(&bias), m, &p).expect("route");
            (s.clone_dtoh(&ids).expect("ids"), s.clone_dtoh(&w).expect("w"))
        };
        let (ids_l, w_l) = route(&s.clone_htod(&logits).expect("logits"), 1);
        let (ids_p, w_p) = route(&part, ksplit);
        let same_sum = same_bits(&summed, &logits);
        let same_route = ids_l == ids_p && same_bits(&w_l, &w_p);
        println!(
            "router m={m}: {ksplit} k ranges handed over; summed == logits: {same_sum}; route equal: {same_route}"
        );
        if !same_sum || !same_route {
            fails.push(format!("m = {m}: sums {same_sum}, routes {same_route}"));
        }
        if m == 5000 && ksplit != 1 {
            fails.push("5,000 rows: partials past one launch's bound".into());
        }
        if m < 5000 && ksplit != plan::router_split(n, k, g.num_sms).0 {
            fails.push(format!("m = {m}: {ksplit} ranges handed over"));
        }
    }
    assert!(fails.is_empty(), "failed: {fails:?}");
}
