//! GPU tests of the fp8 projections (`mlaserve_cuda::fp8`) against the f64 reference
//! (`mlaserve_cuda_lab::fp8_ref`). Needs the `cuda` feature and a GPU; without one the
//! tests print why and pass, unless `MLASERVE_REQUIRE_GPU=1` (set by tools/gpu/check.sh).
#![cfg(feature = "cuda")]

use mlaserve_cuda::fp8::{Fp8Gemm, Fp8Linear};
use mlaserve_cuda::fp8_plan::Fp8Path;
use mlaserve_cuda::Gpu;
use mlaserve_cuda_lab::check_fp8::{self, Fp8Pair};
use mlaserve_cuda_lab::rng::Rng;
use mlaserve_cuda_lab::util::Util;

fn gpu() -> Option<Gpu> {
    match Gpu::new(0) {
        Ok(g) => Some(g),
        Err(e) if std::env::var_os("MLASERVE_REQUIRE_GPU").is_none() => {
            eprintln!("skipping GPU test: {e}");
            None
        }
        Err(e) => panic!("MLASERVE_REQUIRE_GPU is set but no GPU: {e}"),
    }
}

/// act_quant's bytes and scales equal the reference's bit for bit (bf16 and f32 input).
#[test]
fn act_quant_is_bit_exact() {
    let Some(gpu) = gpu() else { return };
    let fp8 = Fp8Gemm::new(&gpu, Fp8Path::Auto).expect("load fp8_gemm");
    let r = check_fp8::check_act_quant(&gpu, &fp8, 21).expect("ran");
    assert!(r.is_none(), "{}", r.unwrap_or_default());
}

/// Every V3 projection shape at m = 1, 4, 64, 256, 4096 through each kernel.
#[test]
fn fp8_gemm_matches_reference_at_v3_shapes() {
    let Some(gpu) = gpu() else { return };
    let util = Util::new(&gpu).expect("util");
    let reports = check_fp8::run_fp8_checks(&gpu, &util, 22, check_fp8::ROWS).expect("checks ran");
    let mut failures = Vec::new();
    for r in &reports {
        println!("{r}");
        if !r.passed() {
            failures.push(r.to_string());
        }
    }
    assert!(failures.is_empty(), "failed:\n{}", failures.join("\n"));
}

/// Odd shapes: out not a multiple of 128 (or of 2), one k block, rows past a 64-row tile.
#[test]
fn fp8_gemm_odd_shapes() {
    let Some(gpu) = gpu() else { return };
    let util = Util::new(&gpu).expect("util");
    let mut fp8 = Fp8Gemm::new(&gpu, Fp8Path::Auto).expect("load");
    let mut rng = Rng::new(23);
    let paths = check_fp8::fp8_paths(&fp8);
    let mut failures = Vec::new();
    for (n, k) in [(1, 128), (129, 256), (333, 384), (200, 1280)] {
        let w = Fp8Pair::random(&gpu, &mut rng, n, k).expect("weight");
        for m in [1, 3, 17, 33, 65, 130] {
            for &p in &paths {
                for out_f32 in [true, false] {
                    let r = check_fp8::run_fp8_case(&gpu, &mut fp8, &util, "odd", &w, m, p, out_f32, &mut rng)
                        .expect("case ran");
                    if !r.passed() {
                        failures.push(format!("[{n}, {k}] {r}"));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "failed:\n{}", failures.join("\n"));
}

/// The streaming kernels are batch-invariant: a row alone, inside a batch of 64 or 300,
/// or among 5 other rows gives the same bits (`stream`, and `portable` where it differs).
#[test]
fn fp8_stream_is_batch_invariant() {
    let Some(gpu) = gpu() else { return };
    let util = Util::new(&gpu).expect("util");
    let fp8 = Fp8Gemm::new(&gpu, Fp8Path::Auto).expect("load");
    let mut rng = Rng::new(24);
    let mut bad = Vec::new();
    for (n, k) in [(576, 7168), (7168, 2048), (3072, 1536), (200, 1280)] {
        let w = Fp8Pair::random(&gpu, &mut rng, n, k).expect("weight");
        for path in check_fp8::fp8_paths(&fp8).into_iter().filter(|p| p.batch_invariant()) {
            for m in [64, 300] {
                let r = check_fp8::run_fp8_invariance(&gpu, &util, path, &w, m, 25).expect("ran");
                bad.extend(r.into_iter().map(|e| format!("{} [{n}, {k}]: {e}", path.name())));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Shape errors are typed and raised before any launch.
#[test]
fn fp8_rejects_bad_shapes() {
    let Some(gpu) = gpu() else { return };
    let s = &gpu.stream;
    let fp8 = Fp8Gemm::new(&gpu, Fp8Path::Auto).expect("load");
    assert!(Fp8Linear::from_raw(s, &[0u8; 100 * 100], &[1.0; 1], 100, 100).is_err(), "k % 128");
    assert!(Fp8Linear::from_raw(s, &[0u8; 128 * 256], &[1.0; 1], 128, 256).is_err(), "scale count");
    let x = s.alloc_zeros::<half::bf16>(2 * 100).expect("alloc");
    let mut q = s.alloc_zeros::<u8>(2 * 100).expect("alloc");
    let mut sc = s.alloc_zeros::<f32>(2).expect("alloc");
    let e = fp8.act_quant(s, &x, 2, 100, &mut q, &mut sc).expect_err("k = 100");
    assert!(e.to_string().contains("multiple of 128"), "{e}");
    let w = Fp8Linear::from_raw(s, &[0u8; 256 * 128], &[1.0; 2], 256, 128).expect("weight");
    let xb = s.alloc_zeros::<half::bf16>(3 * 128).expect("alloc");
    let mut y = s.alloc_zeros::<f32>(2 * 256).expect("alloc");
    assert!(fp8.forward(s, &w, &xb, 3, &mut y).is_err(), "y too short");
    if !fp8.has_wgmma() {
        assert!(Fp8Gemm::new(&gpu, Fp8Path::Wgmma).is_err());
    }
}
