//! fp8 linears of the reference backend: what the GPU's block-scaled fp8 GEMMs compute,
//! without their rounding.
//!
//! For a weight stored as e4m3 codes `q_w` with block scales `s_w` (128 × 128 in V3),
//! each token's input row is quantised per 128 channels
//! ([`mlaserve_model::fp8::quantize_act_row`]: `s_x = amax / 448`, `q_x = e4m3(x / s_x)`),
//! and
//!
//! `y[o] = Σ_kb (Σ_{k ∈ kb} q_x[k] · q_w[o, k]) · (s_x[kb] · s_w[o/128, kb])`
//!
//! with a well-defined result: each product of two e4m3 values is exact in f32, a block's
//! sum of ≤ 128 of them is exact in f64 (multiples of 2^-18 below 2^25), `s_x · s_w` is
//! exact in f64, each block's term is rounded once in f64, the blocks are summed in
//! ascending order in f64, and `y` is rounded to f32 once. A GPU kernel differs from this
//! only by its accumulator's rounding. With activation quantisation off
//! ([`crate::CpuOptions::fp8_activations`]) the same weights are dequantised to f32
//! (`q · s`, one rounding) and multiplied as every other linear: the "dequantised model".

use crate::ops::Linear;
use mlaserve_core::{Result, KV_FP8_GROUP};
use mlaserve_model::fp8::{fp8_e4m3_to_f32, quantize_act_row};
use mlaserve_model::{Fp8Tensor, Shard, Weights};

/// What an fp8 weight does with its input ([`crate::CpuOptions::fp8_act`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Act {
    /// Dequantise the weight, multiply in f32 (the dequantised model).
    Off,
    /// Quantise the f32 input per 128 channels (the fp8 semantics).
    F32,
    /// Round the input to bf16 first, then quantise it (the CUDA backend's inputs).
    Bf16,
}

/// An fp8 weight held for the fp8 product: code values and block scales.
#[derive(Debug, Clone)]
pub struct Fp8Weight {
    /// e4m3 code values (exact in f32), row-major `[out, inp]`.
    q: Vec<f32>,
    /// `[⌈out/bo⌉, ⌈inp/bi⌉]`.
    scales: Vec<f32>,
    block: [usize; 2],
    /// Round the input to bf16 before quantising it ([`Fp8Act::Bf16`]).
    bf16_input: bool,
}

impl Fp8Weight {
    pub fn new(t: &Fp8Tensor) -> Self {
        Fp8Weight {
            q: t.q.iter().map(|&b| fp8_e4m3_to_f32(b)).collect(),
            scales: t.scales.clone(),
            block: t.block,
            bf16_input: false,
        }
    }

    /// One token: `x` is `[inp]`, `y` gets `[out]`.
    pub(crate) fn forward_row(&self, x: &[f32], y: &mut [f32], out0: usize, inp: usize) {
        let bi = self.block[1];
        let nkb = inp.div_ceil(bi);
        let mut qx = vec![0u8; inp];
        let mut sx = vec![0f32; nkb];
        if self.bf16_input {
            let xb: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
            quantize_act_row(&xb, bi, &mut qx, &mut sx);
        } else {
            quantize_act_row(x, bi, &mut qx, &mut sx);
        }
        let xv: Vec<f32> = qx.iter().map(|&b| fp8_e4m3_to_f32(b)).collect();
        for (i, yo) in y.iter_mut().enumerate() {
            let o = out0 + i;
            let wrow = &self.q[o * inp..(o + 1) * inp];
            let srow = &self.scales[(o / self.block[0]) * nkb..][..nkb];
            let mut acc = 0f64;
            for kb in 0..nkb {
                let (lo, hi) = (kb * bi, ((kb + 1) * bi).min(inp));
                // Exact: every product is exact in f32 and the sum in f64.
                let inner: f64 = xv[lo..hi].iter().zip(&wrow[lo..hi]).map(|(a, b)| (a * b) as f64).sum();
                acc += inner * (sx[kb] as f64 * srow[kb] as f64);
            }
            *yo = acc as f32;
        }
    }
}

/// Loads linear `name` of full shape `full` (`[out, inp]`), this rank's `shard` of it: an
/// fp8 linear ([`Fp8Weight`]) when the checkpoint stores it as fp8 and `act` is not
/// [`Fp8Act::Off`], else f32 weights (dequantised if fp8) and the plain product.
pub fn load_linear(w: &Weights, name: &str, full: [usize; 2], shard: Option<Shard>, act: Fp8Act) -> Result<Linear> {
    let (mut out, mut inp) = (full[0], full[1]);
    if let Some(s) = shard.filter(|s| s.world > 1) {
        if s.dim == 0 {
            out /= s.world;
        } else {
            inp /= s.world;
        }
    }
    if act != Fp8Act::Off && w.is_fp8(name) {
        let t = w.fp8_shard(name, full, shard)?;
        let f = Fp8Weight { bf16_input: act == Fp8Act::Bf16, ..Fp8Weight::new(&t) };
        return Ok(Linear::fp8(f, out, inp));
    }
    Ok(Linear::new(w.f32_shard(name, &full, shard)?, out, inp))
}

/// Rounds one latent cache entry (`[c_kv (lora), k_pe]`) in place to what the fp8 cache
/// layout ([`mlaserve_core::KvCacheDtype::Fp8`]) stores and reads back: `c_kv` quantised
/// per [`KV_FP8_GROUP`] channels exactly as an fp8 linear's input
/// ([`quantize_act_row`]: `s = amax / 448`, `q = e4m3(x / s)`) and read as `q · s` (one
/// f32 rounding), `k_pe` rounded to bf16 (nearest even).
pub fn kv_fp8_round(entry: &mut [f32], lora: usize) {
    let (ckv, kpe) = entry.split_at_mut(lora);
    let mut q = vec![0u8; lora];
    let mut s = vec![0f32; lora.div_ceil(KV_FP8_GROUP)];
    quantize_act_row(ckv, KV_FP8_GROUP, &mut q, &mut s);
    for (i, (x, &qi)) in ckv.iter_mut().zip(&q).enumerate() {
        *x = fp8_e4m3_to_f32(qi) * s[i / KV_FP8_GROUP];
    }
    for x in kpe {
        *x = half::bf16::from_f32(*x).to_f32();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlaserve_model::fp8::f32_to_fp8_e4m3;
    use std::borrow::Cow;

    fn weight(out: usize, inp: usize) -> Fp8Tensor<'static> {
        let q: Vec<u8> = (0..out * inp).map(|i| f32_to_fp8_e4m3(((i * 13 % 29) as f32 - 14.0) * 0.61)).collect();
        let sc: Vec<f32> =
            (0..out.div_ceil(128) * inp.div_ceil(128)).map(|i| 0.003 * (1.0 + i as f32 * 0.37)).collect();
        Fp8Tensor { q: Cow::Owned(q), scales: sc, out, inp, block: [128, 128] }
    }

    fn input(n: usize, inp: usize) -> Vec<f32> {
        (0..n * inp).map(|i| ((i * 7 % 31) as f32 - 15.0) * 0.21 + (i % 5) as f32 * 1e-3).collect()
    }

    #[test]
    fn fp8_product_is_the_block_formula() {
        // 300 inputs: two full 128-blocks and a 44-wide tail; 130 outputs: two scale rows.
        let (out, inp) = (130, 300);
        let t = weight(out, inp);
        let lin = Linear::fp8(Fp8Weight::new(&t), out, inp);
        let x = input(3, inp);
        let y = lin.forward(&x);
        for r in 0..3 {
            let xr = &x[r * inp..(r + 1) * inp];
            let mut qx = vec![0u8; inp];
            let mut sx = vec![0f32; 3];
            quantize_act_row(xr, 128, &mut qx, &mut sx);
            for o in 0..out {
                // Independent form: dequantise both sides in f64, sum per block.
                let mut acc = 0f64;
                for kb in 0..3 {
                    let mut blk = 0f64;
                    for k in kb * 128..((kb + 1) * 128).min(inp) {
                        blk += fp8_e4m3_to_f32(qx[k]) as f64 * fp8_e4m3_to_f32(t.q[o * inp + k]) as f64;
                    }
                    acc += blk * (sx[kb] as f64 * t.scale_at(o, kb * 128) as f64);
                }
                assert_eq!(y[r * out + o], acc as f32, "row {r} out {o}");
            }
        }
    }

    #[test]
    fn fp8_product_depends_on_the_row_alone_and_is_close_to_f32() {
        let (out, inp) = (64, 256);
        let t = weight(out, inp);
        let lin = Linear::fp8(Fp8Weight::new(&t), out, inp);
        let deq = Linear::new(t.dequantize(), out, inp);
        let x = input(40, inp);
        let all = lin.forward(&x);
        let reference = deq.forward(&x);
        let (mut worst, mut scale) = (0f32, 0f32);
        for r in 0..40 {
            // Batch-invariant: the same row alone gives the same bits.
            assert_eq!(lin.forward(&x[r * inp..(r + 1) * inp]), all[r * out..(r + 1) * out].to_vec());
        }
        for (a, b) in all.iter().zip(&reference) {
            worst = worst.max((a - b).abs());
            scale = scale.max(b.abs());
        }
        // Activation rounding to 3 mantissa bits: a few percent of the largest output.
        assert!(worst > 0.0 && worst / scale < 0.05, "{worst} / {scale}");
    }

    #[test]
    fn representable_activations_give_the_dequantised_product() {
        // Each group's amax is 448 · 2^-4, every value a code times 2^-4: quantisation is
        // exact, so the fp8 product equals the f64 product of the dequantised sides.
        let (out, inp) = (8, 256);
        let t = weight(out, inp);
        let lin = Linear::fp8(Fp8Weight::new(&t), out, inp);
        let mut x: Vec<f32> = (0..inp).map(|i| fp8_e4m3_to_f32((i * 5 % 0x7e) as u8) / 16.0).collect();
        x[0] = 28.0;
        x[128] = -28.0;
        let y = lin.forward(&x);
        for o in 0..out {
            let want: f64 = (0..inp)
                .map(|k| x[k] as f64 * fp8_e4m3_to_f32(t.q[o * inp + k]) as f64 * t.scale_at(o, k) as f64)
                .sum();
            assert!(((y[o] as f64) - want).abs() <= want.abs() * 1e-7 + 1e-12, "{} vs {want}", y[o]);
        }
    }

    /// The latent channels read back as their fp8 codes times the group's scale, each
    /// within half an e4m3 step of the input; the RoPE channels as bf16.
    #[test]
    fn kv_fp8_round_is_the_fp8_layout() {
        let lora = 320; // two whole groups and a partial one
        let x: Vec<f32> = (0..lora + 64).map(|i| (i as f32 * 0.37).sin() * (1.0 + i as f32 / 50.0)).collect();
        let mut e = x.clone();
        kv_fp8_round(&mut e, lora);
        let mut q = vec![0u8; lora];
        let mut s = vec![0f32; 3];
        quantize_act_row(&x[..lora], KV_FP8_GROUP, &mut q, &mut s);
        for i in 0..lora {
            let g = i / KV_FP8_GROUP;
            assert_eq!(e[i], fp8_e4m3_to_f32(q[i]) * s[g], "channel {i}");
            // 3 mantissa bits: within 1/16 of the value, or half the subnormal step.
            let tol = (x[i].abs() / 16.0).max(s[g] * 2f32.powi(-10));
            assert!((e[i] - x[i]).abs() <= tol, "channel {i}: {} -> {}", x[i], e[i]);
        }
        for i in lora..lora + 64 {
            assert_eq!(e[i], half::bf16::from_f32(x[i]).to_f32(), "RoPE channel {i}");
        }
        assert_ne!(e[..lora], x[..lora], "the latent channels were not quantised");
    }
}
