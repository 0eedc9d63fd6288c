//! GPU kernel tests against the CPU reference (needs the `cuda` feature and a GPU).
//!
//! Without a usable GPU the tests print why and pass, so `cargo test --features cuda`
//! stays green on the CPU machines; `MLASERVE_REQUIRE_GPU=1` (set by tools/gpu/check.sh)
//! turns a missing GPU into a failure.
#![cfg(feature = "cuda")]

// The GPU test helpers of mlaserve-cuda's own tests, shared rather than copied.
#[path = "../../mlaserve-cuda/tests/common/mod.rs"]
mod common;

use mlaserve_cuda::linear::TcKernels;
use mlaserve_cuda::ops::Ops;
use mlaserve_cuda::MlaDecode;
use mlaserve_cuda_lab::check::{run_decode_case, run_op_checks, run_window_invariance, standard_cases};
use mlaserve_cuda_lab::util::Util;

#[test]
fn mla_decode_matches_reference() {
    let Some(gpu) = common::gpu() else { return };
    let util = Util::new(&gpu).expect("load bench_util");
    let mut mla = MlaDecode::new(&gpu).expect("load mla_decode");
    let mut failures = Vec::new();
    for kernel in mla.available_kernels() {
        mla.set_kernel(kernel).expect("kernel available");
        for (i, case) in standard_cases().iter().enumerate() {
            let r = run_decode_case(&gpu, &mla, &util, case, 42 + i as u64).expect("case ran");
            println!("{r}");
            if !r.passed() {
                failures.push(r.to_string());
            }
        }
    }
    assert!(failures.is_empty(), "failed:\n{}", failures.join("\n"));
}

/// Same inputs twice give bit-identical outputs (no race between warps or splits).
#[test]
fn mla_decode_is_deterministic() {
    let Some(gpu) = common::gpu() else { return };
    let util = Util::new(&gpu).expect("load bench_util");
    let mla = MlaDecode::new(&gpu).expect("load mla_decode"); // wgmma where available
    let case = &standard_cases()[6]; // forced uneven splits
    let a = run_decode_case(&gpu, &mla, &util, case, 7).expect("run a");
    let b = run_decode_case(&gpu, &mla, &util, case, 7).expect("run b");
    assert!(a.passed() && b.passed(), "{a}\n{b}");
    assert_eq!(a.out.rel_l2.to_bits(), b.out.rel_l2.to_bits(), "{a}\n{b}");
    assert_eq!(a.lse_max_abs.to_bits(), b.lse_max_abs.to_bits());
}

/// RMSNorm (plain, fused add), SiLU-mul, argmax and its vocabulary-parallel form against the
/// CPU reference.
#[test]
fn small_kernels_match_reference() {
    let Some(gpu) = common::gpu() else { return };
    let reports = run_op_checks(&gpu, 99).expect("op checks ran");
    let failed: Vec<String> = reports.iter().filter(|r| !r.passed()).map(|r| r.to_string()).collect();
    for r in &reports {
        println!("{r}");
    }
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}

/// Fixed-size splits (`MlaDecode::set_fixed_splits`, the exact options): a token's
/// attention is bit-identical as a row of a 4-token window, in a batch of 1-token steps
/// and alone, with windows that cross pages and split boundaries (2 pages per split:
/// many splits on short contexts; 16: the exact options' size), at 16 and 128 heads.
/// The fixed splits also pass every standard case against the reference.
#[test]
fn fixed_splits_decode_is_batch_and_window_invariant() {
    let Some(gpu) = common::gpu() else { return };
    let util = Util::new(&gpu).expect("load bench_util");
    let mut mla = MlaDecode::new(&gpu).expect("load mla_decode");
    if mla.set_fixed_splits(Some(2)).is_err() {
        eprintln!("skipping: fixed splits need the seesaw kernel (sm_90)");
        return;
    }
    let mut failures = Vec::new();
    for (i, case) in standard_cases().iter().enumerate() {
        let r = run_decode_case(&gpu, &mla, &util, case, 300 + i as u64).expect("case ran");
        println!("fixed 2: {r}");
        if !r.passed() {
            failures.push(r.to_string());
        }
    }
    let ctx: &[usize] = &[0, 60, 61, 124, 127, 252, 255, 1021, 3000];
    for blocks in [2, 16] {
        mla.set_fixed_splits(Some(blocks)).expect("seesaw");
        for heads in [16, 128] {
            let r = run_window_invariance(&gpu, &mla, heads, ctx, 4, 77 + heads as u64).expect("ran");
            println!("fixed {blocks}: {r}");
            if !r.passed() {
                failures.push(format!("fixed {blocks}: {r}"));
            }
            // Prefill-length windows (the batch-invariant options run prompt chunks through
            // this kernel): each tile skips the blocks past its last row's keys, so tiles of
            // one window cover different block ranges.
            let r = run_window_invariance(&gpu, &mla, heads, &[0, 61, 200, 1021], 70, 55 + heads as u64).expect("ran");
            println!("fixed {blocks}: {r}");
            if !r.passed() {
                failures.push(format!("fixed {blocks}: {r}"));
            }
        }
    }
    // The default plan, for the record: its splits depend on the batch.
    mla.set_fixed_splits(None).expect("off");
    let r = run_window_invariance(&gpu, &mla, 16, ctx, 4, 93).expect("ran");
    println!("default plan (not asserted): {r}");
    assert!(failures.is_empty(), "failed:\n{}", failures.join("\n"));
}

/// The fp8 cache's decode kernel (`--kv-cache-dtype fp8`: entries of e4m3 codes with
/// per-128 scales and bf16 k_pe, widened in the kernel) against the reference over the
/// entries' own values, on every standard case at DeepSeek's dims with the planner's
/// splits and with fixed ones; and the fixed splits' batch and window invariance.
#[test]
fn mla_decode_fp8_cache_matches_reference() {
    let Some(gpu) = common::gpu() else { return };
    let util = Util::new(&gpu).expect("load bench_util");
    let mut mla = MlaDecode::new(&gpu).expect("load mla_decode");
    if mla.set_kv_cache_dtype(mlaserve_core::KvCacheDtype::Fp8).is_err() {
        eprintln!("skipping: the fp8 cache's decode kernel needs sm_90");
        return;
    }
    let mut failures = Vec::new();
    for fixed in [None, Some(2)] {
        mla.set_fixed_splits(fixed).expect("sm_90");
        for (i, case) in standard_cases().iter().enumerate().filter(|(_, c)| MlaDecode::is_fast_path(&c.dims())) {
            let r = run_decode_case(&gpu, &mla, &util, case, 500 + i as u64).expect("case ran");
            println!("fp8 cache, fixed {fixed:?}: {r}");
            if !r.passed() {
                failures.push(r.to_string());
            }
        }
    }
    for blocks in [2, 16] {
        mla.set_fixed_splits(Some(blocks)).expect("sm_90");
        for heads in [16, 128] {
            for (ctx, window) in
                [(&[0usize, 60, 61, 124, 127, 252, 255, 1021, 3000][..], 4), (&[0, 61, 200, 1021][..], 70)]
            {
                let r = run_window_invariance(&gpu, &mla, heads, ctx, window, 81 + heads as u64).expect("ran");
                println!("fp8 cache, fixed {blocks}: {r}");
                if !r.passed() {
                    failures.push(format!("fixed {blocks}: {r}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "failed:\n{}", failures.join("\n"));
}

/// `copy_ids` (the kept drafts' moves: a slot into a token row, an argmax id into its
/// slot) against the host rule on random pairs, a repeated source included; a pair
/// outside either buffer is refused before the launch.
#[test]
fn copy_ids_moves_ids_by_pairs() {
    let Some(g) = common::gpu() else { return };
    let s = &g.stream;
    let ops = Ops::new(&g, TcKernels::Auto).expect("ops");
    let mut x = 0x9e37_79b9_u64;
    let mut next = move |m: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % m as u64) as u32
    };
    for (n_dst, n_src, n) in [(1usize, 1usize, 1usize), (64, 300, 40), (1024, 65536, 1000)] {
        let dst0: Vec<i32> = (0..n_dst as i32).map(|i| -1 - i).collect();
        let src: Vec<i32> = (0..n_src).map(|_| next(4096) as i32).collect();
        // Distinct destinations (a stage writes each row or slot once), any sources.
        let mut dsts: Vec<u32> = (0..n_dst as u32).collect();
        for i in (1..dsts.len()).rev() {
            dsts.swap(i, next(i + 1) as usize);
        }
        let pairs: Vec<(u32, u32)> = dsts[..n].iter().map(|&d| (d, next(n_src))).collect();
        let mut want = dst0.clone();
        for &(d, x) in &pairs {
            want[d as usize] = src[x as usize];
        }
        let mut dst = s.clone_htod(&dst0).expect("upload");
        let src_d = s.clone_htod(&src).expect("upload");
        let up = s.clone_htod(&pairs.iter().flat_map(|&(d, x)| [d as i32, x as i32]).collect::<Vec<_>>()).expect("up");
        ops.copy_ids(s, &mut dst, &src_d, &up, &pairs).expect("copy_ids");
        assert_eq!(s.clone_dtoh(&dst).expect("download"), want, "{n} pairs into {n_dst} from {n_src}");
        let bad = [(n_dst as u32, 0)];
        let up = s.clone_htod(&[0i32, 0]).expect("up");
        assert!(ops.copy_ids(s, &mut dst, &src_d, &up, &bad).is_err(), "a destination outside is refused");
        let bad = [(0, n_src as u32)];
        assert!(ops.copy_ids(s, &mut dst, &src_d, &up, &bad).is_err(), "a source outside is refused");
    }
}
