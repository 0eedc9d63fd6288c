//! fp8 e4m3 ("e4m3fn": no infinities, `0x7f`/`0xff` are NaN, largest finite ±448) and
//! DeepSeek's block-scaled layout.
//!
//! A weight is stored as e4m3 codes `q` `[out, inp]` beside f32 block scales `s`
//! `[⌈out/bo⌉, ⌈inp/bi⌉]` (`weight_scale_inv`, 128 × 128 blocks in V3): `w = q · s`.
//! Activations are quantised dynamically per token and per `bi` input channels
//! ([`quantize_act_row`]). This module is the one definition both backends follow: the
//! conversions, the shard rules ([`Fp8Tensor`] from [`crate::Weights::fp8_shard`]) and the
//! activation scheme.

use std::borrow::Cow;

/// Largest finite e4m3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// The 256 code values (NaN for `0x7f` and `0xff`).
static E4M3_TABLE: [f32; 256] = e4m3_table();

const fn e4m3_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut b = 0usize;
    while b < 256 {
        let exp = (b >> 3) & 0xf;
        let man = (b & 7) as u32;
        let sign = ((b as u32) >> 7) << 31;
        let mag = if exp == 0xf && man == 7 {
            0x7fc0_0000
        } else if exp == 0 {
            // man · 2^-9: exact in f32 (normalise the mantissa into f32's exponent).
            if man == 0 {
                0
            } else {
                let lz = man.leading_zeros() - 29; // man has 3 bits: shift to the implicit one
                let e = 127 - 9 + (2 - lz); // value = 1.xx · 2^(msb - 9), msb = 2 - lz
                let frac = (man << (lz + 1)) & 0x7; // bits after the leading one
                (e << 23) | (frac << 20)
            }
        } else {
            (((exp as u32) + 127 - 7) << 23) | (man << 20)
        };
        t[b] = f32::from_bits(sign | mag);
        b += 1;
    }
    t
}

/// e4m3 code to f32 (exact).
#[inline]
pub fn fp8_e4m3_to_f32(x: u8) -> f32 {
    E4M3_TABLE[x as usize]
}

/// f32 to the nearest e4m3 code, ties to even, saturating to ±448 (infinities too);
/// NaN gives `0x7f` with the sign of the input. `-0.0` keeps its sign (`0x80`).
pub fn f32_to_fp8_e4m3(v: f32) -> u8 {
    let sign = ((v.to_bits() >> 31) as u8) << 7;
    if v.is_nan() {
        return sign | 0x7f;
    }
    let a = v.abs().min(E4M3_MAX);
    if a < 2f32.powi(-6) {
        // Subnormal range: multiples of 2^-9 (exact scaling by a power of two).
        let q = (a * 512.0).round_ties_even() as u8; // 0..=8; 8 is the smallest normal
        return sign | q;
    }
    let bits = a.to_bits();
    let e = ((bits >> 23) & 0xff) as i32 - 127; // -6..=8
    let m = f32::from_bits((bits & 0x7f_ffff) | (127 << 23)); // in [1, 2)
    let mut q = ((m - 1.0) * 8.0).round_ties_even() as i32; // 0..=8
    let mut e = e;
    if q == 8 {
        q = 0;
        e += 1;
    }
    // a <= 448 = 1.75 · 2^8, so (e, q) never passes (8, 6).
    sign | (((e + 7) as u8) << 3) | q as u8
}

/// One weight's fp8 codes and block scales as stored (or a tensor-parallel rank's slice).
#[derive(Debug, Clone)]
pub struct Fp8Tensor<'a> {
    /// e4m3 codes, row-major `[out, inp]`; borrowed from the memory map when the slice is
    /// contiguous in the file (the whole tensor or a row shard).
    pub q: Cow<'a, [u8]>,
    /// Block scales `[⌈out/bo⌉, ⌈inp/bi⌉]`, row-major: `w[r][c] = q[r][c] · s[r/bo][c/bi]`.
    pub scales: Vec<f32>,
    pub out: usize,
    pub inp: usize,
    /// `[bo, bi]`: rows and columns per scale.
    pub block: [usize; 2],
}

impl Fp8Tensor<'_> {
    /// Columns of the scale matrix.
    pub fn scale_cols(&self) -> usize {
        self.inp.div_ceil(self.block[1])
    }

    /// Rows of the scale matrix.
    pub fn scale_rows(&self) -> usize {
        self.out.div_ceil(self.block[0])
    }

    /// The scale of element `(r, c)`.
    #[inline]
    pub fn scale_at(&self, r: usize, c: usize) -> f32 {
        self.scales[(r / self.block[0]) * self.scale_cols() + c / self.block[1]]
    }

    /// `q · s` in f32 (each product rounded once), row-major `[out, inp]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut w = Vec::with_capacity(self.out * self.inp);
        for r in 0..self.out {
            let row = &self.q[r * self.inp..(r + 1) * self.inp];
            w.extend(row.iter().enumerate().map(|(c, &b)| fp8_e4m3_to_f32(b) * self.scale_at(r, c)));
        }
        w
    }

    /// Whether `q` borrows the memory map (no copy was made).
    pub fn is_borrowed(&self) -> bool {
        matches!(self.q, Cow::Borrowed(_))
    }
}

/// Dynamic activation quantisation of one token's row `x` in groups of `group` channels
/// (the last group may be shorter): per group `s = amax / 448` (f32 division) and
/// `q = e4m3(x / s)` (f32 division, round to nearest even, saturating at ±448).
///
/// A group whose scale is 0 (all zeros, or `amax` below 448 × the smallest f32
/// subnormal) is stored as zeros with `s = 1`, so it contributes exactly 0 and no
/// division by zero happens. `q` gets `x.len()` codes, `s` `⌈x.len()/group⌉` scales.
pub fn quantize_act_row(x: &[f32], group: usize, q: &mut [u8], s: &mut [f32]) {
    debug_assert_eq!(q.len(), x.len());
    debug_assert_eq!(s.len(), x.len().div_ceil(group));
    for ((xg, qg), sg) in x.chunks(group).zip(q.chunks_mut(group)).zip(s.iter_mut()) {
        let amax = xg.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / E4M3_MAX;
        if scale == 0.0 || !scale.is_finite() {
            // Zeros (or a non-finite row, which no finite scale can represent: saturate
            // by the largest finite value instead of producing NaN codes).
            if scale == 0.0 {
                qg.fill(0);
                *sg = 1.0;
            } else {
                *sg = f32::MAX / E4M3_MAX;
                for (qi, &xi) in qg.iter_mut().zip(xg) {
                    *qi = f32_to_fp8_e4m3(xi / *sg);
                }
            }
            continue;
        }
        *sg = scale;
        for (qi, &xi) in qg.iter_mut().zip(xg) {
            *qi = f32_to_fp8_e4m3(xi / scale);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nearest finite code by exhaustive search; ties to the even code (mantissa LSB 0).
    fn reference(v: f32) -> u8 {
        let sign = if v.is_sign_negative() { 0x80 } else { 0 };
        let a = (v.abs() as f64).min(448.0);
        let mut best = 0u8;
        for b in 0..=0x7eu8 {
            let (d, db) = ((fp8_e4m3_to_f32(b) as f64 - a).abs(), (fp8_e4m3_to_f32(best) as f64 - a).abs());
            if d < db || (d == db && b & 1 == 0) {
                best = b;
            }
        }
        sign | best
    }

    #[test]
    fn decoding_matches_the_format_definition() {
        for b in 0..=255u8 {
            let (exp, man) = (((b >> 3) & 0xf) as i32, (b & 7) as f64);
            let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
            let want = if exp == 0xf && man == 7.0 {
                f64::NAN
            } else if exp == 0 {
                sign * man / 8.0 * 2f64.powi(-6)
            } else {
                sign * (1.0 + man / 8.0) * 2f64.powi(exp - 7)
            };
            let got = fp8_e4m3_to_f32(b) as f64;
            assert!(got == want || (got.is_nan() && want.is_nan()), "{b:#04x}: {got} vs {want}");
            if want == 0.0 {
                assert_eq!(got.is_sign_negative(), b == 0x80, "{b:#04x} keeps the zero's sign");
            }
        }
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0);
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(fp8_e4m3_to_f32(0x08), 2f32.powi(-6));
    }

    #[test]
    fn every_code_round_trips() {
        for b in 0..=255u8 {
            let f = fp8_e4m3_to_f32(b);
            if f.is_nan() {
                assert_eq!(f32_to_fp8_e4m3(f) & 0x7f, 0x7f);
            } else {
                assert_eq!(f32_to_fp8_e4m3(f), b, "{b:#04x} -> {f}");
            }
        }
    }

    #[test]
    fn ties_go_to_even_and_neighbours_to_the_nearest() {
        // Every midpoint between adjacent finite codes, and values just either side.
        for b in 0..0x7eu8 {
            let (lo, hi) = (fp8_e4m3_to_f32(b), fp8_e4m3_to_f32(b + 1));
            let mid = (lo + hi) / 2.0; // exact: both have few mantissa bits
            let even = if b & 1 == 0 { b } else { b + 1 };
            assert_eq!(f32_to_fp8_e4m3(mid), even, "tie between {lo} and {hi}");
            assert_eq!(f32_to_fp8_e4m3(-mid), 0x80 | even);
            let below = f32::from_bits(mid.to_bits() - 1);
            let above = f32::from_bits(mid.to_bits() + 1);
            assert_eq!(f32_to_fp8_e4m3(below), b, "just below the tie {mid}");
            assert_eq!(f32_to_fp8_e4m3(above), b + 1, "just above the tie {mid}");
        }
        // Subnormal ties: 0.5 · 2^-9 goes to 0, 1.5 · 2^-9 to 2 · 2^-9.
        assert_eq!(f32_to_fp8_e4m3(0.5 * 2f32.powi(-9)), 0);
        assert_eq!(f32_to_fp8_e4m3(1.5 * 2f32.powi(-9)), 2);
        assert_eq!(f32_to_fp8_e4m3(1e-30), 0);
        assert_eq!(f32_to_fp8_e4m3(f32::from_bits(1)), 0);
        assert_eq!(f32_to_fp8_e4m3(-0.0), 0x80);
    }

    #[test]
    fn saturates_and_keeps_nan() {
        for v in [448.0, 449.0, 464.0, 480.0, 1e6, f32::MAX, f32::INFINITY] {
            assert_eq!(f32_to_fp8_e4m3(v), 0x7e, "{v}");
            assert_eq!(f32_to_fp8_e4m3(-v), 0xfe, "-{v}");
        }
        assert_eq!(f32_to_fp8_e4m3(f32::NAN), 0x7f);
        assert_eq!(f32_to_fp8_e4m3(-f32::NAN), 0xff);
    }

    #[test]
    fn agrees_with_exhaustive_search_on_a_sweep() {
        // Every f32 bit pattern with the low 12 mantissa bits fixed, over the e4m3 range
        // and past it: 2^20 values covering all exponents from 2^-12 to 2^10.
        let lo = (2f32.powi(-12)).to_bits();
        let hi = (1024f32).to_bits();
        let mut bits = lo;
        while bits < hi {
            let v = f32::from_bits(bits | 0x5a5);
            assert_eq!(f32_to_fp8_e4m3(v), reference(v), "{v:e}");
            bits += 1 << 12;
        }
    }

    #[test]
    fn activation_groups_use_amax_over_448() {
        let x: Vec<f32> = (0..300).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
        let mut q = vec![0u8; 300];
        let mut s = vec![0f32; 3];
        quantize_act_row(&x, 128, &mut q, &mut s);
        for (g, xg) in x.chunks(128).enumerate() {
            let amax = xg.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(s[g], amax / 448.0);
            for (i, &xi) in xg.iter().enumerate() {
                let qi = q[g * 128 + i];
                assert_eq!(qi, f32_to_fp8_e4m3(xi / s[g]));
                // The amax element lands on ±448 (saturation absorbs the division's rounding).
                if xi.abs() == amax {
                    assert_eq!(qi & 0x7f, 0x7e);
                }
                // Relative error of an e4m3 normal: at most 2^-4.
                let back = fp8_e4m3_to_f32(qi) * s[g];
                assert!((back - xi).abs() <= amax / 448.0 * 2f32.powi(-9) + xi.abs() / 16.0, "{xi} -> {back}");
            }
        }
        // An all-zero group: zeros with scale 1, the other groups unaffected.
        let mut x2 = x.clone();
        x2[128..256].fill(0.0);
        quantize_act_row(&x2, 128, &mut q, &mut s);
        assert_eq!(s[1], 1.0);
        assert!(q[128..256].iter().all(|&b| b == 0));
        assert_eq!(s[0], x[..128].iter().fold(0f32, |m, v| m.max(v.abs())) / 448.0);
    }
}
