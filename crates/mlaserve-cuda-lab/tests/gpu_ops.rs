//! The forward pass's kernels (`backend_ops.cu`, `linear.rs`) against CPU references on
//! fresh random inputs, at tiny shapes and DeepSeek-V3's real ones (7168 hidden, 128
//! heads, 512 + 64 latent, 256 experts top-8).
//!
//! Tolerance: max|Δ| / max|ref| ≤ 1e-2 for bf16 outputs, ≤ 2e-3 for f32 outputs of bf16
//! inputs (the reference rounds the same inputs to bf16 first); routing ids exact.
//! Without a GPU the tests print why and pass (`MLASERVE_REQUIRE_GPU=1` makes it fail).
#![cfg(feature = "cuda")]

// The GPU test helpers of mlaserve-cuda's own tests, shared rather than copied.
#[path = "../../mlaserve-cuda/tests/common/mod.rs"]
mod common;

use cudarc::driver::CudaSlice;
use half::bf16;
use mlaserve_core::config::Arch;
use mlaserve_core::{MoeConfig, ScoringFunc, TopkMethod};
use mlaserve_cuda::dims::DecodeDims;
use mlaserve_cuda::layout::AttnMeta;
use mlaserve_cuda::linear::{Gemm, GemmMode, Linear, TcKernels};
use mlaserve_cuda::ops::{GroupedVariant, Ops, RouteParams};
use mlaserve_cuda::rope::RopeTables;
use mlaserve_cuda_lab::reference;
use mlaserve_cuda_lab::rng::Rng;

/// max|got − want| / max|want|; NaN when any output is not finite.
fn rel(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    if got.iter().any(|v| !v.is_finite()) {
        return f64::NAN;
    }
    let d = got.iter().zip(want).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
    let m = want.iter().map(|v| v.abs() as f64).fold(0.0, f64::max);
    d / m.max(1e-30)
}

fn check(name: &str, got: &[f32], want: &[f32], tol: f64, fails: &mut Vec<String>) {
    let r = rel(got, want);
    let ok = r <= tol;
    println!("{:<58} rel {r:.2e} (tol {tol:.0e}) {}", name, if ok { "ok" } else { "FAIL" });
    if !ok {
        fails.push(format!("{name}: {r:.3e}"));
    }
}

fn rounded(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}
fn to_bf(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}
fn rand(rng: &mut Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.uniform(lo, hi)).collect()
}

#[test]
fn gemm_matches_reference_and_invariant_mode_is_batch_invariant() {
    let Some(g) = common::gpu() else { return };
    let s = &g.stream;
    let mut rng = Rng::new(11);
    let mut fails = Vec::new();
    // linear_tc twice: its 128 × 128 tile above 64 rows, and at every row count (the same
    // bits either way); then the same on the warpgroup-MMA kernels (Hopper).
    let hopper = g.compute_capability == (9, 0);
    let mma = Gemm::new(&g, GemmMode::InvariantTc, TcKernels::MmaSync).expect("gemm");
    use TcKernels::{MmaSync, WgmmaTma};
    for (mode, large_from, kind) in [
        (GemmMode::Cublas, 64, MmaSync),
        (GemmMode::BatchInvariant, 64, MmaSync),
        (GemmMode::InvariantTc, 64, MmaSync),
        (GemmMode::InvariantTc, 0, MmaSync),
        (GemmMode::InvariantTc, 64, WgmmaTma),
        (GemmMode::InvariantTc, 0, WgmmaTma),
        (GemmMode::InvariantTc, 64, TcKernels::Auto),
    ] {
        if kind != MmaSync && !hopper {
            continue;
        }
        let mut gemm = Gemm::new(&g, mode, kind).expect("gemm");
        gemm.large_from = large_from;
        let mode_name = match (mode, large_from) {
            (GemmMode::InvariantTc, 0) => format!("InvariantTc/{kind:?}/128-row tile at every m"),
            (GemmMode::InvariantTc, _) => format!("InvariantTc/{kind:?}"),
            _ => format!("{mode:?}"),
        };
        for (m, n, k) in [
            (1, 2048, 7168),
            (8, 576, 7168),
            (64, 256, 7168),
            (4, 7168, 2048),
            (1, 4096, 2560),
            (5, 40, 64),
            (3, 24, 36),
            // More than 64 rows: linear_tc's 128 × 128 tile, a partial last row tile and
            // column block, k not a multiple of 64; with and without split-K.
            (130, 576, 1000),
            (300, 200, 7168),
        ] {
            let w = rounded(&rand(&mut rng, n * k, -0.05, 0.05));
            let x = rounded(&rand(&mut rng, m * k, -1.0, 1.0));
            let lin = Linear::from_f32(s, &w, n, k).expect("upload");
            let xd = s.clone_htod(&to_bf(&x)).expect("x");
            let mut y = s.alloc_zeros::<f32>(m * n).expect("y");
            gemm.forward(s, &lin, &xd, m, &mut y).expect("gemm");
            let mut yb = s.alloc_zeros::<bf16>(m * n).expect("y");
            gemm.forward(s, &lin, &xd, m, &mut yb).expect("gemm");
            let want: Vec<f32> = (0..m * n)
                .map(|i| (0..k).map(|j| x[(i / n) * k + j] as f64 * w[(i % n) * k + j] as f64).sum::<f64>() as f32)
                .collect();
            let got = s.clone_dtoh(&y).expect("dtoh");
            let gotb: Vec<f32> = s.clone_dtoh(&yb).expect("dtoh").iter().map(|v| v.to_f32()).collect();
            check(&format!("gemm {mode_name} m={m} n={n} k={k} f32 out"), &got, &want, 2e-3, &mut fails);
            check(&format!("gemm {mode_name} m={m} n={n} k={k} bf16 out"), &gotb, &want, 1e-2, &mut fails);
        }
        // A row's result alone vs inside 64 rows (cuBLAS: reported), and for the invariant
        // modes, bit for bit, rows of m (several 128-row tiles of linear_tc_big; its 768-row
        // slabs at 4096 × 2560) alone and in a block of 7 from row 60 (linear_tc's 64-row
        // tile), on weights with and without linear_tc's split-K.
        for (n, k, m) in [(1024, 7168, 200), (576, 7168, 200), (18432, 512, 200), (4096, 2560, 800)] {
            let lin = Linear::from_f32(s, &rand(&mut rng, n * k, -0.05, 0.05), n, k).expect("upload");
            let x = to_bf(&rand(&mut rng, m * k, -1.0, 1.0));
            let xd = s.clone_htod(&x).expect("x");
            let mut ym = s.alloc_zeros::<f32>(m * n).expect("y");
            gemm.forward(s, &lin, &xd, m, &mut ym).expect("gemm");
            let all = s.clone_dtoh(&ym).expect("dtoh");
            let alone = |r: usize| {
                let x1 = s.clone_htod(&x[r * k..(r + 1) * k]).expect("x1");
                let mut y1 = s.alloc_zeros::<f32>(n).expect("y");
                gemm.forward(s, &lin, &x1, 1, &mut y1).expect("gemm");
                s.clone_dtoh(&y1).expect("dtoh")
            };
            let bits = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
            let rows = [0, 63, 64, 130, m - 1, 767.min(m - 1), 768.min(m - 1)];
            let mut same = rows.iter().all(|&r| bits(&all[r * n..(r + 1) * n], &alone(r)));
            let x7 = s.clone_htod(&x[60 * k..67 * k]).expect("x7");
            let mut y7 = s.alloc_zeros::<f32>(7 * n).expect("y");
            gemm.forward(s, &lin, &x7, 7, &mut y7).expect("gemm");
            same &= bits(&all[60 * n..67 * n], &s.clone_dtoh(&y7).expect("dtoh"));
            println!("gemm {mode_name} n={n} k={k}: rows alone / of 7 == the same rows of 200: {same}");
            if mode.batch_invariant() && !same {
                fails.push(format!("{mode_name} GEMM depends on the batch (n={n} k={k})"));
            }
            // wgmma's k16 sums must round as mma.sync's do: TcKernels::Auto picks one or
            // the other by row count.
            if mode == GemmMode::InvariantTc && kind != MmaSync && large_from > 0 {
                mma.forward(s, &lin, &xd, m, &mut ym).expect("gemm");
                let other = s.clone_dtoh(&ym).expect("dtoh");
                let differ = all.iter().zip(&other).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
                println!(
                    "gemm n={n} k={k} m={m}: {kind:?} vs mma.sync, {differ} of {} outputs differ in bits",
                    all.len()
                );
                if differ > 0 {
                    fails.push(format!("{kind:?} and mma.sync round differently (n={n} k={k})"));
                }
            }
        }
    }
    assert!(fails.is_empty(), "failed: {fails:?}");
}

/// The MoE expert path without the host (`Ops::moe_sort`, `gather_bf16_sorted`,
/// `moe_grouped_sorted`) against an f64 reference and, bit for bit, against the
/// batch-invariant GEMM of the same token row and expert: random routing of `tokens × k`
/// slots over `experts` (some untouched, some with more than one 8-row pass), widths not
/// multiples of 32; V3's expert shapes (2·2048 × 7168 and 7168 × 2048) and small ones;
/// f32 and bf16 outputs. Also checks the sort itself (offsets, perm, inv consistent).
#[test]
fn sorted_grouped_experts_match_reference_and_invariant_gemm() {
    let Some(g) = common::gpu() else { return };
    let s = &g.stream;
    let ops = Ops::new(&g, TcKernels::Auto).expect("ops");
    let inv_gemm = Gemm::new(&g, GemmMode::BatchInvariant, TcKernels::Auto).expect("gemm");
    let mut rng = Rng::new(29);
    let mut fails = Vec::new();
    for (experts, n, k, tokens, topk) in
        [(6usize, 40usize, 64usize, 13usize, 3usize), (6, 4096, 7168, 5, 4), (5, 7168, 2048, 9, 2), (3, 100, 24, 7, 2)]
    {
        let ws: Vec<Vec<f32>> = (0..experts).map(|_| rounded(&rand(&mut rng, n * k, -0.05, 0.05))).collect();
        let lins: Vec<Linear> = ws.iter().map(|w| Linear::from_f32(s, w, n, k).expect("upload")).collect();
        let table = mlaserve_cuda::ops::ExpertWeights::new(s, &lins.iter().collect::<Vec<_>>()).expect("table");
        // Expert 1 stays untouched; the rest drawn at random (repeats allowed).
        let ids: Vec<i32> = (0..tokens * topk)
            .map(|_| {
                let e = (rng.uniform(0.0, experts as f32 - 1.0) as usize).min(experts - 2);
                (if e >= 1 { e + 1 } else { e }) as i32
            })
            .collect();
        let slots = tokens * topk;
        let x = rounded(&rand(&mut rng, tokens * k, -1.0, 1.0));
        let xd = s.clone_htod(&to_bf(&x)).expect("x");
        let idd = s.clone_htod(&ids).expect("ids");
        let (mut off, mut perm, mut inv) = (
            s.alloc_zeros::<i32>(experts + 1).expect("off"),
            s.alloc_zeros::<i32>(slots).expect("perm"),
            s.alloc_zeros::<i32>(slots).expect("inv"),
        );
        let mut act = s.clone_htod(&vec![i32::MIN; experts.min(slots)]).expect("act");
        ops.moe_sort(s, &idd, tokens, topk, experts, &mut off, &mut perm, &mut inv, &mut act).expect("sort");
        let mut xs = s.alloc_zeros::<bf16>(slots * k).expect("xs");
        ops.gather_sorted(s, &mut xs, &xd, &perm, slots, k).expect("gather");
        let mut y = s.alloc_zeros::<f32>(slots * n).expect("y");
        ops.moe_grouped_sorted(s, &mut y, &xs, &table, &off, slots, GroupedVariant::Direct).expect("grouped");
        let mut yb = s.alloc_zeros::<bf16>(slots * n).expect("y");
        ops.moe_grouped_sorted(s, &mut yb, &xs, &table, &off, slots, GroupedVariant::Direct).expect("grouped");
        // The staged entry points: the same bits.
        let mut ys = s.alloc_zeros::<f32>(slots * n).expect("y");
        ops.moe_grouped_sorted(s, &mut ys, &xs, &table, &off, slots, GroupedVariant::Staged).expect("grouped");
        let mut ysb = s.alloc_zeros::<bf16>(slots * n).expect("y");
        ops.moe_grouped_sorted(s, &mut ysb, &xs, &table, &off, slots, GroupedVariant::Staged).expect("grouped");
        let bits = |a: &CudaSlice<f32>, b: &CudaSlice<f32>| {
            s.clone_dtoh(a)
                .expect("a")
                .iter()
                .zip(&s.clone_dtoh(b).expect("b"))
                .all(|(p, q)| p.to_bits() == q.to_bits())
        };
        let bits16 =
            |a: &CudaSlice<bf16>, b: &CudaSlice<bf16>| s.clone_dtoh(a).expect("a") == s.clone_dtoh(b).expect("b");
        let staged_same = bits(&y, &ys) && bits16(&yb, &ysb);
        println!("staged == direct, bit for bit: {staged_same}");
        if !staged_same {
            fails.push(format!("staged grouped [{n}x{k}] differs from direct"));
        }
        let (offh, permh, invh) =
            (s.clone_dtoh(&off).expect("o"), s.clone_dtoh(&perm).expect("p"), s.clone_dtoh(&inv).expect("i"));
        let (got, gotb) = (s.clone_dtoh(&y).expect("y"), s.clone_dtoh(&yb).expect("y"));
        // The sort: each slot's row lies in its expert's range and maps back to its token.
        for (sl, &e) in ids.iter().enumerate() {
            let row = invh[sl] as usize;
            let (a, b) = (offh[e as usize] as usize, offh[e as usize + 1] as usize);
            assert!(a <= row && row < b, "slot {sl} (expert {e}) sorted to row {row} outside {a}..{b}");
            assert_eq!(permh[row] as usize, sl / topk, "row {row} names the wrong token");
        }
        assert_eq!(offh[experts] as usize, slots);
        // The active list: the experts with rows, ascending, then -1 up to min(experts, slots).
        let mut want_act: Vec<i32> = (0..experts as i32).filter(|&e| ids.contains(&e)).collect();
        want_act.resize(experts.min(slots), -1);
        assert_eq!(s.clone_dtoh(&act).expect("act"), want_act, "moe_sort's active experts");
        // Per slot: the reference, and the invariant GEMM of the token row alone.
        let (mut want, mut same) = (Vec::new(), true);
        let (mut gf, mut gb) = (Vec::new(), Vec::new());
        for (sl, &e) in ids.iter().enumerate() {
            let (t, row) = (sl / topk, invh[sl] as usize);
            let w = &ws[e as usize];
            want.extend((0..n).map(|c| (0..k).map(|j| x[t * k + j] as f64 * w[c * k + j] as f64).sum::<f64>() as f32));
            gf.extend_from_slice(&got[row * n..(row + 1) * n]);
            gb.extend(gotb[row * n..(row + 1) * n].iter().map(|v| v.to_f32()));
            let mut one = s.alloc_zeros::<f32>(n).expect("one");
            inv_gemm.forward(s, &lins[e as usize], &xd.slice(t * k..(t + 1) * k), 1, &mut one).expect("inv");
            let one = s.clone_dtoh(&one).expect("one");
            same &= got[row * n..(row + 1) * n].iter().zip(&one).all(|(p, q)| p.to_bits() == q.to_bits());
        }
        let name = format!("sorted grouped experts {experts}×[{n}×{k}], {tokens} tokens × top-{topk}");
        check(&format!("{name} f32 out"), &gf, &want, 2e-3, &mut fails);
        check(&format!("{name} bf16 out"), &gb, &want, 1e-2, &mut fails);
        println!("{name}: bit-identical to the invariant GEMM per row: {same}");
        if !same {
            fails.push(format!("grouped [{n}x{k}] differs from the invariant GEMM"));
        }
    }
    assert!(fails.is_empty(), "failed: {fails:?}");
}

fn moe_cfg(e: usize, k: usize, g: usize, tg: usize, m: TopkMethod, sf: ScoringFunc, norm: bool, f: f64) -> MoeConfig {
    MoeConfig {
        n_routed_experts: e,
        n_shared_experts: 1,
        num_experts_per_tok: k,
        moe_intermediate_size: 8,
        n_group: g,
        topk_group: tg,
        topk_method: m,
        scoring_func: sf,
        norm_topk_prob: norm,
        routed_scaling_factor: f,
        first_k_dense_replace: 0,
        moe_layer_freq: 1,
    }
}

#[test]
fn routing_matches_reference_every_variant() {
    let Some(g) = common::gpu() else { return };
    let s = &g.stream;
    let ops = Ops::new(&g, TcKernels::Auto).expect("ops");
    let mut rng = Rng::new(5);
    let mut fails = Vec::new();
    let cases = [
        (
            "V3 256e top8 noaux_tc sigmoid",
            moe_cfg(256, 8, 8, 4, TopkMethod::NoauxTc, ScoringFunc::Sigmoid, true, 2.5),
            Arch::DeepseekV3,
        ),
        (
            "V2 160e top6 group_limited softmax",
            moe_cfg(160, 6, 8, 3, TopkMethod::GroupLimitedGreedy, ScoringFunc::Softmax, false, 16.0),
            Arch::DeepseekV2,
        ),
        (
            "V2-lite 64e top6 greedy softmax norm",
            moe_cfg(64, 6, 1, 1, TopkMethod::Greedy, ScoringFunc::Softmax, true, 1.0),
            Arch::DeepseekV2,
        ),
        (
            "tiny 16e top4 noaux_tc",
            moe_cfg(16, 4, 4, 2, TopkMethod::NoauxTc, ScoringFunc::Sigmoid, true, 2.5),
            Arch::DeepseekV3,
        ),
        (
            "greedy sigmoid top1 norm (V2 rule: no norm)",
            moe_cfg(32, 1, 1, 1, TopkMethod::Greedy, ScoringFunc::Sigmoid, true, 1.0),
            Arch::DeepseekV2,
        ),
    ];
    // Each case also with coarse logits and bias (steps of 1/2 and 1/4): many exact ties,
    // which must go to the lower index as the CPU's serial scan sends them.
    for ((name, c, arch), coarse) in cases.iter().flat_map(|cs| [(cs.clone(), false), (cs.clone(), true)]) {
        let name = format!("{name}{}", if coarse { ", tied" } else { "" });
        let (e, k, n) = (c.n_routed_experts, c.num_experts_per_tok, 64);
        let step = |v: Vec<f32>, q: f32| if coarse { v.into_iter().map(|x| (x * q).round() / q).collect() } else { v };
        let logits = step(rand(&mut rng, n * e, -4.0, 4.0), 2.0);
        let bias = step(rand(&mut rng, e, 0.0, 0.5), 4.0);
        let has_bias = c.topk_method == TopkMethod::NoauxTc;
        let p = RouteParams {
            experts: e,
            k,
            n_group: c.n_group,
            topk_group: c.topk_group,
            method: match c.topk_method {
                TopkMethod::Greedy => 0,
                TopkMethod::GroupLimitedGreedy => 1,
                TopkMethod::NoauxTc => 2,
            },
            scoring: if c.scoring_func == ScoringFunc::Sigmoid { 0 } else { 1 },
            normalise: c.norm_topk_prob && (arch == Arch::DeepseekV3 || k > 1),
            scale: c.routed_scaling_factor as f32,
        };
        let ld = s.clone_htod(&logits).expect("logits");
        let bd = s.clone_htod(&bias).expect("bias");
        let mut ids = s.alloc_zeros::<i32>(n * k).expect("ids");
        let mut w = s.alloc_zeros::<f32>(n * k).expect("w");
        ops.route(s, &mut ids, &mut w, &ld, has_bias.then_some(&bd), n, &p).expect("route");
        let (ids, w) = (s.clone_dtoh(&ids).expect("ids"), s.clone_dtoh(&w).expect("w"));
        let (mut want_w, mut id_ok) = (Vec::new(), true);
        for t in 0..n {
            let r = mlaserve_cpu::moe::route(&c, arch, &logits[t * e..(t + 1) * e], has_bias.then_some(&bias[..]));
            id_ok &= r.experts.iter().zip(&ids[t * k..(t + 1) * k]).all(|(a, &b)| *a == b as usize);
            want_w.extend(r.weights);
        }
        println!("route {name}: ids {}", if id_ok { "exact" } else { "DIFFER" });
        if !id_ok {
            fails.push(format!("{name}: ids differ"));
        }
        check(&format!("route {name} weights"), &w, &want_w, 1e-5, &mut fails);
    }
    assert!(fails.is_empty(), "failed: {fails:?}");
}

/// Latent write (RMSNorm + YaRN RoPE into a shuffled paged cache), query absorption,
/// varlen attention (vs `reference::mla_decode` on uniform windows) and W_UV.
#[test]
fn mla_pieces_match_reference() {
    let Some(g) = common::gpu() else { return };
    let s = &g.stream;
    let ops = Ops::new(&g, TcKernels::Auto).expect("ops");
    let mut rng = Rng::new(9);
    let mut fails = Vec::new();
    // (heads, nope, rope, lora, vdim, batch, q_len, seq_len)
    for (heads, nope, rope, lora, vdim, batch, q_len, seq) in [
        (128usize, 128usize, 64usize, 512usize, 128usize, 2usize, 4usize, 300usize),
        (16, 128, 64, 512, 128, 3, 1, 1000),
        (8, 16, 8, 32, 24, 4, 3, 70),
        (8, 16, 8, 32, 24, 2, 1, 1),
        // 140 rows: three 64-row chunks of the per-head tensor-core projections.
        (16, 128, 64, 512, 128, 35, 4, 100),
        // 160 rows of 128 heads: W_UV's split-K partials in two slabs of rows.
        (128, 128, 64, 512, 128, 40, 4, 70),
    ] {
        let tag = format!("h={heads} lora={lora}+{rope} b={batch} s={q_len} len={seq}");
        let (dqk, half) = (lora + rope, rope / 2);
        let inv_freq: Vec<f64> = (0..half).map(|i| 1.0 / 10000f64.powf(2.0 * i as f64 / rope as f64)).collect();
        let tabs = RopeTables::new(s, &inv_freq, 1.2, 2048).expect("rope");
        let host_rope = mlaserve_cpu::ops::Rope::new(&inv_freq, 1.2, 2048);
        let bt = seq.div_ceil(64);
        let num_blocks = batch * bt + 3;
        let mut pages: Vec<i32> = (0..num_blocks as i32).collect();
        rng.shuffle(&mut pages);
        let tables: Vec<i32> = pages[..batch * bt].to_vec();
        // 1. Write the whole context through kv_write (rows: every position of every seq).
        let n_all = batch * seq;
        let kv = rand(&mut rng, n_all * dqk, -2.0, 2.0);
        let norm_w = rand(&mut rng, lora, 0.5, 1.5);
        let (mut pos, mut slot) = (Vec::new(), Vec::new());
        for b in 0..batch {
            for p in 0..seq {
                pos.push(p as i32);
                slot.push(tables[b * bt + p / 64] as i64 * 64 + (p % 64) as i64);
            }
        }
        let mut cache = s.alloc_zeros::<bf16>(num_blocks * 64 * dqk).expect("cache");
        let (kvd, nwd) = (s.clone_htod(&kv).expect("kv"), s.clone_htod(&norm_w).expect("nw"));
        let (posd, slotd) = (s.clone_htod(&pos).expect("pos"), s.clone_htod(&slot).expect("slot"));
        ops.kv_write(s, &mut cache, &kvd, &nwd, &tabs, &posd, &slotd, n_all, 1e-6).expect("kv_write");
        let cache_h: Vec<f32> = s.clone_dtoh(&cache).expect("cache").iter().map(|v| v.to_f32()).collect();
        let mut want_c = Vec::new();
        let mut got_c = Vec::new();
        for r in 0..n_all {
            let mut row = kv[r * dqk..(r + 1) * dqk].to_vec();
            mlaserve_cpu::ops::rms_norm(&mut row[..lora], &norm_w, 1e-6);
            host_rope.apply(&mut row[lora..], pos[r] as usize);
            want_c.extend(row);
            got_c.extend_from_slice(&cache_h[slot[r] as usize * dqk..][..dqk]);
        }
        check(&format!("kv_write {tag}"), &got_c, &want_c, 1e-2, &mut fails);
        // A padding row (slot -1, as CUDA-graph buckets pad) and a slot past the cache
        // write nothing.
        let (pad_slot, pad_pos) =
            (s.clone_htod(&[-1i64, (num_blocks * 64) as i64]).expect("slot"), s.clone_htod(&[0i32, 1]).expect("pos"));
        ops.kv_write(s, &mut cache, &kvd, &nwd, &tabs, &pad_pos, &pad_slot, 2, 1e-6).expect("kv_write padding");
        let after: Vec<f32> = s.clone_dtoh(&cache).expect("cache").iter().map(|v| v.to_f32()).collect();
        if after != cache_h {
            fails.push(format!("kv_write {tag}: a padding or out-of-range slot changed the cache"));
        }

        // 2. Absorb the window's queries.
        let n = batch * q_len;
        let q = rand(&mut rng, n * heads * (nope + rope), -1.0, 1.0);
        let wuk = rounded(&rand(&mut rng, heads * nope * lora, -0.1, 0.1));
        let qpos: Vec<i32> = (0..n).map(|r| (seq - q_len + r % q_len) as i32).collect();
        let (qd, wukd, qposd) =
            (s.clone_htod(&q).expect("q"), s.clone_htod(&to_bf(&wuk)).expect("wuk"), s.clone_htod(&qpos).expect("p"));
        let mut qa = s.alloc_zeros::<f32>(n * heads * dqk).expect("qa");
        let mut qab = s.alloc_zeros::<bf16>(n * heads * dqk).expect("qab");
        ops.q_absorb(s, &mut qa, &mut qab, &qd, &wukd, &tabs, &qposd, n, heads, nope, lora).expect("q_absorb");
        let qa_h = s.clone_dtoh(&qa).expect("qa");
        let mut want_qa = Vec::with_capacity(n * heads * dqk);
        for r in 0..n {
            for h in 0..heads {
                let qr = &q[(r * heads + h) * (nope + rope)..][..nope + rope];
                for c in 0..lora {
                    want_qa.push((0..nope).map(|i| qr[i] * wuk[(h * nope + i) * lora + c]).sum::<f32>());
                }
                let mut pe = qr[nope..].to_vec();
                host_rope.apply(&mut pe, qpos[r] as usize);
                want_qa.extend(pe);
            }
        }
        check(&format!("q_absorb {tag}"), &qa_h, &want_qa, 2e-3, &mut fails);
        let qab_h: Vec<f32> = s.clone_dtoh(&qab).expect("qab").iter().map(|v| v.to_f32()).collect();
        check(&format!("q_absorb bf16 {tag}"), &qab_h, &want_qa, 1e-2, &mut fails);
        // The last row alone: the same bits (a row's projection ignores the others).
        {
            let w = heads * (nope + rope);
            let (q1, p1) = (s.clone_htod(&q[(n - 1) * w..]).expect("q1"), s.clone_htod(&qpos[n - 1..]).expect("p1"));
            let mut qa1 = s.alloc_zeros::<f32>(heads * dqk).expect("qa1");
            let mut qab1 = s.alloc_zeros::<bf16>(heads * dqk).expect("qab1");
            ops.q_absorb(s, &mut qa1, &mut qab1, &q1, &wukd, &tabs, &p1, 1, heads, nope, lora).expect("q_absorb");
            let alone = s.clone_dtoh(&qa1).expect("qa1");
            let same = alone.iter().zip(&qa_h[(n - 1) * heads * dqk..]).all(|(a, b)| a.to_bits() == b.to_bits());
            if !same {
                fails.push(format!("q_absorb {tag}: the last row alone differs from the same row among {n}"));
            }
        }

        // 3. Varlen attention over the cache vs the decode reference (same windows).
        let dims = DecodeDims { batch, heads, q_len, dlat: lora, drope: rope, bt_stride: bt };
        let scale = 1.0 / ((nope + rope) as f32).sqrt();
        let seq_lens = vec![seq as i32; batch];
        let (want_o, _) = reference::mla_decode(&dims, &qa_h, &cache_h, &tables, &seq_lens, scale);
        let row_seq: Vec<i32> = (0..n).map(|r| (r / q_len) as i32).collect();
        let (td, rsd) = (s.clone_htod(&tables).expect("t"), s.clone_htod(&row_seq).expect("rs"));
        let mut o_lat = s.alloc_zeros::<f32>(n * heads * lora).expect("o");
        let meta = AttnMeta { n, seqs: batch, bt_stride: bt, max_pos: seq - 1, max_block: num_blocks - 1 };
        ops.attn_varlen(s, &mut o_lat, &qa, &cache, &td, &rsd, &qposd, &meta, heads, lora, rope, scale).expect("attn");
        let o_h = s.clone_dtoh(&o_lat).expect("o");
        check(&format!("attn_varlen {tag}"), &o_h, &want_o, 2e-3, &mut fails);

        // 4. W_UV.
        let wuv = rounded(&rand(&mut rng, heads * vdim * lora, -0.1, 0.1));
        let wuvd = s.clone_htod(&to_bf(&wuv)).expect("wuv");
        let mut out = s.alloc_zeros::<bf16>(n * heads * vdim).expect("out");
        ops.wuv(s, &mut out, &o_lat, &wuvd, n, heads, lora, vdim).expect("wuv");
        let got: Vec<f32> = s.clone_dtoh(&out).expect("out").iter().map(|v| v.to_f32()).collect();
        let mut want = Vec::with_capacity(n * heads * vdim);
        for r in 0..n {
            for h in 0..heads {
                for v in 0..vdim {
                    let ol = &o_h[(r * heads + h) * lora..][..lora];
                    want.push((0..lora).map(|c| ol[c] * wuv[(h * vdim + v) * lora + c]).sum::<f32>());
                }
            }
        }
        check(&format!("wuv {tag}"), &got, &want, 1e-2, &mut fails);
        // The last row alone: the same bits (W_UV's k ranges come from its width alone).
        let o1 = s.clone_htod(&o_h[(n - 1) * heads * lora..]).expect("o1");
        let mut out1 = s.alloc_zeros::<bf16>(heads * vdim).expect("out1");
        ops.wuv(s, &mut out1, &o1, &wuvd, 1, heads, lora, vdim).expect("wuv 1");
        let alone = s.clone_dtoh(&out1).expect("out1");
        let full = s.clone_dtoh(&out).expect("out");
        if alone.iter().zip(&full[(n - 1) * heads * vdim..]).any(|(a, b)| a.to_bits() != b.to_bits()) {
            fails.push(format!("wuv {tag}: the last row alone differs from the same row among {n}"));
        }
    }
    assert!(fails.is_empty(), "failed: {fails:?}");
}

/// Embedding gather (with the MTP position-0 zeroing), strided RMSNorm and the MoE combine.
/// The routed experts' gather of quantised rows: codes and scales of `rows[i]` into row
/// i, byte for byte, at V3's width and a one-block one, with repeated and skipped rows.
#[test]
fn quantised_rows_gather_exactly() {
    let Some(g) = common::gpu() else { return };
    let s = &g.stream;
    let ops = Ops::new(&g, TcKernels::Auto).expect("ops");
    let mut rng = Rng::new(17);
    for (n_in, n, k) in [(64usize, 512usize, 7168usize), (5, 9, 128), (3, 1, 256)] {
        let q: Vec<u8> = (0..n_in * k).map(|_| rng.below(256) as u8).collect();
        let sc: Vec<f32> = (0..n_in * k / 128).map(|_| rng.uniform(0.001, 1.0)).collect();
        let rows: Vec<i32> = (0..n).map(|_| rng.below(n_in) as i32).collect();
        let (qd, sd, rd) =
            (s.clone_htod(&q).expect("q"), s.clone_htod(&sc).expect("s"), s.clone_htod(&rows).expect("r"));
        let mut qo = s.alloc_zeros::<u8>(n * k).expect("qo");
        let mut so = s.alloc_zeros::<f32>(n * k / 128).expect("so");
        ops.gather_q8_sorted(s, &mut qo, &mut so, &qd, &sd, &rd, n, k).expect("gather");
        let (qh, sh) = (s.clone_dtoh(&qo).expect("qo"), s.clone_dtoh(&so).expect("so"));
        let g8 = k / 128;
        for (i, &r) in rows.iter().enumerate() {
            let r = r as usize;
            assert_eq!(qh[i * k..(i + 1) * k], q[r * k..(r + 1) * k], "codes of row {i} (input {r}), k = {k}");
            assert_eq!(sh[i * g8..(i + 1) * g8], sc[r * g8..(r + 1) * g8], "scales of row {i} (input {r}), k = {k}");
        }
    }
    assert!(
        ops.gather_q8_sorted(
            s,
            &mut s.alloc_zeros::<u8>(100).unwrap(),
            &mut s.alloc_zeros::<f32>(1).unwrap(),
            &s.alloc_zeros::<u8>(100).unwrap(),
            &s.alloc_zeros::<f32>(1).unwrap(),
            &s.alloc_zeros::<i32>(1).unwrap(),
            1,
            100
        )
        .is_err(),
        "k not a multiple of 128 is refused"
    );
}

#[test]
fn small_backend_ops_match_reference() {
    let Some(g) = common::gpu() else { return };
    let s = &g.stream;
    let ops = Ops::new(&g, TcKernels::Auto).expect("ops");
    let mut rng = Rng::new(3);
    let mut fails = Vec::new();
    // Rows up to 8192 wide normalise from registers, wider ones (9216) in two passes.
    for (h, vocab, n) in [(7168, 1000, 9), (7168, 1000, 64), (64, 512, 33), (70, 300, 5), (9216, 50, 3)] {
        let table = rounded(&rand(&mut rng, vocab * h, -1.0, 1.0));
        let tokens: Vec<i32> = (0..n).map(|_| rng.below(vocab) as i32).collect();
        let pos: Vec<i32> = (0..n as i32).map(|i| i % 4).collect();
        let td = s.clone_htod(&to_bf(&table)).expect("t");
        let (tokd, posd) = (s.clone_htod(&tokens).expect("tok"), s.clone_htod(&pos).expect("pos"));
        let mut x = s.alloc_zeros::<f32>(n * h).expect("x");
        ops.embed(s, &mut x, &td, &tokd, &posd, h, 0, vocab, true).expect("embed");
        let want: Vec<f32> = (0..n)
            .flat_map(|r| {
                let t = tokens[r] as usize;
                let z = pos[r] == 0;
                table[t * h..(t + 1) * h].iter().map(move |&v| if z { 0.0 } else { v }).collect::<Vec<_>>()
            })
            .collect();
        let xh = s.clone_dtoh(&x).expect("x");
        check(&format!("embed h={h} n={n} (pos 0 zeroed)"), &xh, &want, 0.0, &mut fails);

        // RMSNorm into the second half of [n][2h] rows.
        let w = rand(&mut rng, h, 0.5, 1.5);
        let wd = s.clone_htod(&w).expect("w");
        let mut out = s.alloc_zeros::<f32>(n * 2 * h).expect("out");
        ops.rmsnorm(s, &mut out.slice_mut(h..), 2 * h, &x, h, &wd, n, 1e-6).expect("norm");
        let got: Vec<f32> = s.clone_dtoh(&out).expect("out").chunks(2 * h).flat_map(|r| r[h..].to_vec()).collect();
        let mut want = xh.clone();
        for row in want.chunks_mut(h) {
            if row.iter().any(|v| *v != 0.0) {
                mlaserve_cpu::ops::rms_norm(row, &w, 1e-6);
            }
        }
        check(&format!("rmsnorm_f32 strided h={h} n={n}"), &got, &want, 1e-5, &mut fails);
    }
    // The fused residual add + RMSNorm: the bits of add then rmsnorm (f32 and bf16 out),
    // x updated in place; vector widths and a scalar one.
    for (h, n) in [(7168usize, 64usize), (7168, 1), (70, 9), (9216, 3)] {
        let x0 = rand(&mut rng, n * h, -2.0, 2.0);
        let a = rand(&mut rng, n * h, -2.0, 2.0);
        let w = rand(&mut rng, h, 0.5, 1.5);
        let (ad, wd) = (s.clone_htod(&a).expect("a"), s.clone_htod(&w).expect("w"));
        let mut x1 = s.clone_htod(&x0).expect("x");
        ops.add(s, &mut x1, &ad).expect("add");
        let mut f1 = s.alloc_zeros::<f32>(n * h).expect("f1");
        let mut b1 = s.alloc_zeros::<bf16>(n * h).expect("b1");
        ops.rmsnorm(s, &mut f1, h, &x1, h, &wd, n, 1e-6).expect("norm f32");
        ops.rmsnorm(s, &mut b1, h, &x1, h, &wd, n, 1e-6).expect("norm bf16");
        let mut x2 = s.clone_htod(&x0).expect("x");
        let mut f2 = s.alloc_zeros::<f32>(n * h).expect("f2");
        let mut b2 = s.alloc_zeros::<bf16>(n * h).expect("b2");
        ops.add_rmsnorm(s, &mut x2, &ad, Some(&mut f2), Some(&mut b2), &wd, n, 1e-6).expect("add_rmsnorm");
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        let same = bits(s.clone_dtoh(&x1).expect("x1")) == bits(s.clone_dtoh(&x2).expect("x2"))
            && bits(s.clone_dtoh(&f1).expect("f1")) == bits(s.clone_dtoh(&f2).expect("f2"))
            && s.clone_dtoh(&b1).expect("b1") == s.clone_dtoh(&b2).expect("b2");
        println!("add_rmsnorm h={h} n={n}: the bits of add + rmsnorm: {same}");
        if !same {
            fails.push(format!("add_rmsnorm h={h} n={n}: differs from add + rmsnorm"));
        }
        let mut x3 = s.clone_htod(&x0).expect("x");
        let mut b3 = s.alloc_zeros::<bf16>(n * h).expect("b3");
        ops.add_rmsnorm(s, &mut x3, &ad, None, Some(&mut b3), &wd, n, 1e-6).expect("add_rmsnorm bf16 only");
        if s.clone_dtoh(&b1).expect("b1") != s.clone_dtoh(&b3).expect("b3") {
            fails.push(format!("add_rmsnorm h={h} n={n}: bf16 alone differs"));
        }
    }
    // Combine: k = 8 slots per token, rows of y in a random permutation; widths with the
    // kernel's float4 path (h % 4 == 0) and without.
    for (h, n) in [(7168usize, 9usize), (7168, 64), (64, 33), (70, 5)] {
        let k = 8;
        let y = rand(&mut rng, n * k * h, -1.0, 1.0);
        let wts = rand(&mut rng, n * k, 0.0, 1.0);
        let mut ids = Vec::new();
        for _ in 0..n {
            let mut e: Vec<i32> = (0..256).collect();
            rng.shuffle(&mut e);
            ids.extend_from_slice(&e[..k]);
        }
        let mut inv: Vec<i32> = (0..(n * k) as i32).collect();
        rng.shuffle(&mut inv);
        let base = rand(&mut rng, n * h, -1.0, 1.0);
        let mut od = s.clone_htod(&base).expect("o");
        let (yd, idd, wd2, invd) = (
            s.clone_htod(&y).expect("y"),
            s.clone_htod(&ids).expect("ids"),
            s.clone_htod(&wts).expect("w"),
            s.clone_htod(&inv).expect("inv"),
        );
        ops.combine(s, &mut od, &yd, &idd, &wd2, &invd, n, k, h).expect("combine");
        let mut want = base.clone();
        for t in 0..n {
            let mut order: Vec<usize> = (0..k).collect();
            order.sort_by_key(|&j| ids[t * k + j]);
            for c in 0..h {
                let acc: f32 = order.iter().map(|&j| wts[t * k + j] * y[inv[t * k + j] as usize * h + c]).sum::<f32>();
                want[t * h + c] += acc;
            }
        }
        check(&format!("moe_combine h={h} n={n} k={k}"), &s.clone_dtoh(&od).expect("o"), &want, 1e-5, &mut fails);
    }
    // Row gathers, exact: 16-byte copies (h a multiple of the vector), scalar ones (h = 70),
    // an output row start that is not 16-byte aligned (written one element in), repeats.
    for (h, n) in [(7168usize, 64usize), (70, 9), (64, 33)] {
        let src_rows = 40;
        let x = rounded(&rand(&mut rng, src_rows * h, -1.0, 1.0));
        let rows: Vec<u32> = (0..n).map(|i| if i % 5 == 4 { 3 } else { rng.below(src_rows) as u32 }).collect();
        let want: Vec<f32> = rows.iter().flat_map(|&r| x[r as usize * h..(r as usize + 1) * h].to_vec()).collect();
        let rowsd = s.clone_htod(&rows.iter().map(|&r| r as i32).collect::<Vec<_>>()).expect("rows");
        let xd = s.clone_htod(&x).expect("x");
        let xbd = s.clone_htod(&to_bf(&x)).expect("xb");
        for shift in [0usize, 1] {
            let mut of = s.alloc_zeros::<f32>(n * h + 1).expect("of");
            ops.gather(s, &mut of.slice_mut(shift..shift + n * h), &xd, &rowsd, &rows, h).expect("gather f32");
            let got = s.clone_dtoh(&of).expect("of");
            check(&format!("gather f32 h={h} n={n} +{shift}"), &got[shift..shift + n * h], &want, 0.0, &mut fails);
            let mut ob = s.alloc_zeros::<bf16>(n * h + 1).expect("ob");
            ops.gather(s, &mut ob.slice_mut(shift..shift + n * h), &xd, &rowsd, &rows, h).expect("gather f32->bf16");
            let got: Vec<f32> = s.clone_dtoh(&ob).expect("ob").iter().map(|v| v.to_f32()).collect();
            check(
                &format!("gather f32->bf16 h={h} n={n} +{shift}"),
                &got[shift..shift + n * h],
                &want,
                0.0,
                &mut fails,
            );
            let mut ob = s.alloc_zeros::<bf16>(n * h + 1).expect("ob");
            ops.gather(s, &mut ob.slice_mut(shift..shift + n * h), &xbd, &rowsd, &rows, h).expect("gather bf16");
            let got: Vec<f32> = s.clone_dtoh(&ob).expect("ob").iter().map(|v| v.to_f32()).collect();
            check(&format!("gather bf16 h={h} n={n} +{shift}"), &got[shift..shift + n * h], &want, 0.0, &mut fails);
        }
    }
    assert!(fails.is_empty(), "failed: {fails:?}");
}

/// The tensor-core grouped expert GEMM (`GroupedVariant::TensorCore`, fast mode) against
/// the f64 reference of `sorted_grouped_experts_match_reference_and_invariant_gemm` and
/// against the CUDA-core kernel: experts with 0, 1, 7, 16, 17, 100, 150 and 300 rows (empty
/// ones first, between and last; 100 rows take two 64-row chunks, 150 three, and 300 two
/// passes of the TMA kernel: 192 rows, then 108), V3's expert shapes and small
/// ones (k a multiple of 8 but not of 64, n not a multiple of the 64-column tile, odd n),
/// bf16 and f32 outputs. Rows past `off[E]` belong to no group and must keep their NaN
/// poison. At V3 shapes the reference covers every row and the columns c % 13 == 0 plus
/// the last 64 (every residue of the tile), the CUDA-core comparison every output. On
/// Hopper the wgmma kernels (cp.async and TMA) must give mma.sync's bits.
#[test]
fn grouped_experts_tensor_core_match_reference() {
    use mlaserve_cuda::ops::ExpertWeights;
    use mlaserve_cuda_lab::util::Util;
    let Some(g) = common::gpu() else { return };
    let s = &g.stream;
    let ops = Ops::new(&g, TcKernels::Auto).expect("ops");
    let util = Util::new(&g).expect("util");
    let mut fails = Vec::new();
    let counts = [0usize, 1, 7, 16, 0, 17, 100, 150, 300, 0];
    let mut off = vec![0i32];
    for c in counts {
        off.push(off.last().copied().unwrap_or(0) + c as i32);
    }
    let total = counts.iter().sum::<usize>();
    let rows = total + 5; // 5 rows past off[E]: outside every group
    let offd = s.clone_htod(&off).expect("off");
    let mut seed = 1000u64;
    for (n, k) in [(4096usize, 7168usize), (7168, 2048), (40, 72), (37, 200), (130, 24)] {
        let mut lins = Vec::new();
        let mut wh = Vec::new();
        for _ in &counts {
            let mut w = s.alloc_zeros::<bf16>(n * k).expect("w");
            seed += 1;
            util.fill_bf16(s, &mut w, seed, -0.05, 0.05).expect("fill");
            wh.push(s.clone_dtoh(&w).expect("w"));
            lins.push(Linear { w, out: n, inp: k });
        }
        let table = ExpertWeights::new(s, &lins.iter().collect::<Vec<_>>()).expect("table");
        let mut xd = s.alloc_zeros::<bf16>(rows * k).expect("x");
        seed += 1;
        util.fill_bf16(s, &mut xd, seed, -1.0, 1.0).expect("fill");
        let xh: Vec<f64> = s.clone_dtoh(&xd).expect("x").iter().map(|v| v.to_f64()).collect();
        let len = (rows * n).next_multiple_of(2);
        let mut yc = s.alloc_zeros::<f32>(len).expect("y");
        ops.moe_grouped_sorted(s, &mut yc, &xd, &table, &offd, rows, GroupedVariant::Direct).expect("cc");
        let cuda_cores = s.clone_dtoh(&yc).expect("y");
        let mut tc_bits: Option<Vec<f32>> = None;
        let hopper = g.compute_capability == (9, 0);
        // The f64 reference, once per shape.
        let cols: Vec<usize> = (0..n).filter(|&c| n <= 256 || c % 13 == 0 || c + 64 >= n).collect();
        let mut want = Vec::new();
        for (e, w) in wh.iter().enumerate() {
            for r in off[e] as usize..off[e + 1] as usize {
                let xr = &xh[r * k..(r + 1) * k];
                for &c in &cols {
                    let wr = &w[c * k..(c + 1) * k];
                    want.push(xr.iter().zip(wr).map(|(a, b)| a * b.to_f64()).sum::<f64>() as f32);
                }
            }
        }
        for variant in [GroupedVariant::TensorCore, GroupedVariant::WgmmaTma] {
            if variant != GroupedVariant::TensorCore && !hopper {
                continue;
            }
            let mut yf = s.alloc_zeros::<f32>(len).expect("y");
            util.poison_f32(s, &mut yf, 0x7fc0_0000).expect("poison");
            let mut yb = s.alloc_zeros::<bf16>(len).expect("y");
            util.poison_bf16(s, &mut yb, 0x7fc0_7fc0).expect("poison");
            ops.moe_grouped_sorted(s, &mut yf, &xd, &table, &offd, rows, variant).expect("tc");
            ops.moe_grouped_sorted(s, &mut yb, &xd, &table, &offd, rows, variant).expect("tc");
            let got = s.clone_dtoh(&yf).expect("y");
            let gotb: Vec<f32> = s.clone_dtoh(&yb).expect("y").iter().map(|v| v.to_f32()).collect();

            let (mut gf, mut gb) = (Vec::new(), Vec::new());
            for e in 0..wh.len() {
                for r in off[e] as usize..off[e + 1] as usize {
                    for &c in &cols {
                        gf.push(got[r * n + c]);
                        gb.push(gotb[r * n + c]);
                    }
                }
            }
            let name = format!("{variant:?} grouped {}×[{n}×{k}], rows {counts:?}", counts.len());
            check(&format!("{name} f32 out"), &gf, &want, 2e-3, &mut fails);
            check(&format!("{name} bf16 out"), &gb, &want, 1e-2, &mut fails);
            let (a, b) = (&got[..total * n], &cuda_cores[..total * n]);
            check(&format!("{name} f32 out vs CUDA cores, every output"), a, b, 2e-3, &mut fails);
            let untouched = got[total * n..rows * n].iter().chain(&gotb[total * n..rows * n]).all(|v| v.is_nan());
            println!("{name}: rows outside every group untouched: {untouched}");
            if !untouched {
                fails.push(format!("{variant:?} grouped [{n}x{k}] wrote rows outside every group"));
            }
            // wgmma's sums (with cp.async or TMA) must round as mma.sync's (`Auto` picks by
            // rows per expert).
            match &tc_bits {
                None => tc_bits = Some(got[..total * n].to_vec()),
                Some(t) => {
                    let differ = t.iter().zip(&got[..total * n]).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
                    println!("{name}: vs mma.sync, {differ} of {} outputs differ in bits", total * n);
                    if differ > 0 {
                        fails.push(format!("{name}: rounds differently from mma.sync"));
                    }
                }
            }
        }
    }

    assert!(fails.is_empty(), "failed: {fails:?}");
}
