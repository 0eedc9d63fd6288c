//! The fp8 latent cache's write kernel against the CPU backend's rounding (the decode
//! kernel's fp8 path is checked in gpu_kernels, the readers end to end in mlaserve-cuda's
//! gpu_backend). Without a GPU the test prints why and passes (`MLASERVE_REQUIRE_GPU=1`
//! makes it fail).
#![cfg(feature = "cuda")]

// The GPU test helpers of mlaserve-cuda's own tests, shared rather than copied.
#[path = "../../mlaserve-cuda/tests/common/mod.rs"]
mod common;

use half::bf16;
use mlaserve_cuda::linear::TcKernels;
use mlaserve_cuda::ops::Ops;
use mlaserve_cuda::rope::RopeTables;
use mlaserve_cuda_lab::rng::Rng;

fn rand(rng: &mut Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.uniform(lo, hi)).collect()
}

/// max|got − want| / max|want|.
fn rel(got: &[f32], want: &[f32]) -> f64 {
    let d = got.iter().zip(want).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
    d / want.iter().map(|v| v.abs() as f64).fold(0.0, f64::max).max(1e-30)
}

/// The fp8 cache's write (`kv_cache_write_fp8`) against the CPU backend's rounding of the
/// same entries (RMSNorm, RoPE, then `kv_fp8_round`), read back from the entries' bytes
/// (codes × scale, k_pe bf16), at V3's widths (four 128-channel groups), the bundled
/// model's (one) and tiny-v3's (a partial group). The two f32 RMSNorms differ in their
/// last bits, so a code (or a bf16 k_pe) can land on the other side of a rounding
/// boundary: at most 1 in 1,000 channels may differ by more than 1e-5 relative, and
/// none by more than one e4m3 step.
#[test]
fn kv_write_fp8_matches_cpu_rounding() {
    let Some(g) = common::gpu() else { return };
    let s = &g.stream;
    let mut ops = Ops::new(&g, TcKernels::Auto).expect("ops");
    ops.set_kv_cache_dtype(mlaserve_core::KvCacheDtype::Fp8);
    let mut rng = Rng::new(0xf8ca);
    let mut fails = Vec::new();
    for (lora, rope, n) in [(512usize, 64usize, 300usize), (128, 16, 200), (32, 8, 130)] {
        let (dqk, half) = (lora + rope, rope / 2);
        let inv_freq: Vec<f64> = (0..half).map(|i| 1.0 / 10000f64.powf(2.0 * i as f64 / rope as f64)).collect();
        let tabs = RopeTables::new(s, &inv_freq, 1.0, 1024).expect("rope");
        let host_rope = mlaserve_cpu::ops::Rope::new(&inv_freq, 1.0, 1024);
        let entry = mlaserve_cuda::layout::kv_entry_elems(true, lora, rope).expect("entry");
        let slots = n + 7;
        let kv = rand(&mut rng, n * dqk, -2.0, 2.0);
        let norm_w = rand(&mut rng, lora, 0.5, 1.5);
        let pos: Vec<i32> = (0..n).map(|r| (r * 3 % 1000) as i32).collect();
        let mut perm: Vec<i64> = (0..slots as i64).collect();
        rng.shuffle(&mut perm);
        let slot = perm[..n].to_vec();
        let mut cache = s.alloc_zeros::<bf16>(slots * entry).expect("cache");
        let (kvd, nwd) = (s.clone_htod(&kv).expect("kv"), s.clone_htod(&norm_w).expect("nw"));
        let (posd, slotd) = (s.clone_htod(&pos).expect("pos"), s.clone_htod(&slot).expect("slot"));
        ops.kv_write(s, &mut cache, &kvd, &nwd, &tabs, &posd, &slotd, n, 1e-6).expect("kv_write");
        let words = s.clone_dtoh(&cache).expect("cache");
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_bits().to_le_bytes()).collect();
        let groups = lora.div_ceil(128);
        let (mut differ, mut worst) = (0usize, 0f64);
        let mut got_all = Vec::new();
        let mut want_all = Vec::new();
        for r in 0..n {
            let mut want = kv[r * dqk..(r + 1) * dqk].to_vec();
            mlaserve_cpu::ops::rms_norm(&mut want[..lora], &norm_w, 1e-6);
            host_rope.apply(&mut want[lora..], pos[r] as usize);
            mlaserve_cpu::fp8::kv_fp8_round(&mut want, lora);
            let e = &bytes[slot[r] as usize * entry * 2..][..entry * 2];
            let sc: Vec<f32> = (0..groups)
                .map(|k| f32::from_le_bytes(e[lora + 4 * k..lora + 4 * k + 4].try_into().unwrap()))
                .collect();
            let mut got: Vec<f32> =
                (0..lora).map(|c| mlaserve_cuda_lab::fp8_ref::e4m3_to_f32(e[c]) * sc[c / 128]).collect();
            got.extend((0..rope).map(|c| {
                let at = lora + 4 * groups + 2 * c;
                bf16::from_bits(u16::from_le_bytes([e[at], e[at + 1]])).to_f32()
            }));
            for (a, b) in got.iter().zip(&want) {
                // The two f32 RMSNorms differ in their last bits, and so do the group
                // scales: a relative 1e-5 is the same code.
                let d = ((a - b).abs() / b.abs().max(1e-30)) as f64;
                if d > 1e-5 {
                    differ += 1;
                    worst = worst.max(d);
                }
            }
            got_all.extend(got);
            want_all.extend(want);
        }
        let name = format!("kv_write fp8 lora {lora} + rope {rope}, {n} rows");
        println!("{name}: {differ} of {} channels differ from the CPU's (largest relative step {worst:.3})", n * dqk);
        let r = rel(&got_all, &want_all);
        if !r.is_finite() || r > 2e-2 {
            fails.push(format!("{name}: rel {r:.3e}"));
        }
        if differ * 1000 > n * dqk || worst > 0.13 {
            fails.push(format!("{name}: {differ} channels differ, largest {worst:.3}"));
        }
    }
    assert!(fails.is_empty(), "{fails:?}");
}
