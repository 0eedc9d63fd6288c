//! The CPU reference of the fp8 projections (`kernels/fp8_gemm.cu`, `mlaserve_cuda::fp8`):
//! e4m3 rounding emulated bit-exactly, the per-token per-128-channel activation
//! quantisation in the same f32 operations as the kernel (so its bytes and scales must
//! match exactly), and the block-scaled GEMM summed in f64. Also random fp8 weights in
//! the checkpoint's layout. Built without CUDA (CI runs the unit tests).
//!
//! (The lab has its own encoder: `mlaserve_model::weights::f32_to_fp8_e4m3` picks the
//! nearest code by search and breaks ties toward zero, not to even.)

use crate::rng::Rng;

/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Scale block edge.
pub const BLOCK: usize = 128;

/// The value of an e4m3 byte (0x7f / 0xff are NaN; no infinities).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0xf);
    let man = f32::from(b & 7);
    if exp == 0xf && b & 7 == 7 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man * 2f32.powi(-9)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// e4m3 of `v`: round to nearest, ties to even, saturating to ±448 (CUDA's
/// `__NV_SATFINITE`); NaN gives 0x7f; the sign of zero is kept.
pub fn f32_to_e4m3(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7f;
    }
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = f64::from(v.abs());
    if a >= f64::from(E4M3_MAX) {
        return sign | 0x7e;
    }
    // Subnormals (and zero): steps of 2^-9 below 2^-6; 8 steps is the smallest normal.
    if a < 2f64.powi(-6) {
        let q = (a * 512.0).round_ties_even() as u8; // 0..=8, 8 = 0x08 (exp 1, man 0)
        return sign | q;
    }
    let mut e = a.log2().floor() as i32;
    // log2 can land one off at exact powers of two; fix up so that 2^e <= a < 2^(e+1).
    if 2f64.powi(e) > a {
        e -= 1;
    } else if 2f64.powi(e + 1) <= a {
        e += 1;
    }
    let mut man = ((a / 2f64.powi(e) - 1.0) * 8.0).round_ties_even() as i32;
    if man == 8 {
        man = 0;
        e += 1;
    }
    // a < 448 keeps (e, man) at or below (8, 6): 0x7e.
    sign | (((e + 7) as u8) << 3) | man as u8
}

/// Per-row, per-128-channel quantisation of `x [m][k]` as `act_quant_*` does it, in the
/// same f32 operations: `s = amax / 448` (1 when amax is 0), `q = e4m3(x / s)`.
/// Returns `(q [m][k], s [m][k / 128])`.
pub fn act_quant(x: &[f32], m: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    assert!(k.is_multiple_of(BLOCK) && x.len() == m * k, "act_quant: [{m}, {k}] with {} values", x.len());
    let groups = k / BLOCK;
    let mut q = vec![0u8; m * k];
    let mut s = vec![0f32; m * groups];
    for (i, (xg, qg)) in x.chunks(BLOCK).zip(q.chunks_mut(BLOCK)).enumerate() {
        let amax = xg.iter().fold(0f32, |a, v| if v.abs() > a { v.abs() } else { a });
        let sc = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
        for (o, &v) in qg.iter_mut().zip(xg) {
            *o = f32_to_e4m3(v / sc);
        }
        s[i] = sc;
    }
    (q, s)
}

/// A block-scaled fp8 weight `[n][k]` and its scales `[ceil(n / 128)][k / 128]`.
#[derive(Debug, Clone)]
pub struct Fp8Weight {
    pub q: Vec<u8>,
    pub s: Vec<f32>,
    pub n: usize,
    pub k: usize,
}

impl Fp8Weight {
    /// Random codes (a uniform value in ±448 rounded to e4m3: every exponent occurs,
    /// never NaN) and scales uniform in [0.5, 1.5] · 1e-4 (V3's weights are ~±0.05).
    pub fn random(rng: &mut Rng, n: usize, k: usize) -> Self {
        assert!(k.is_multiple_of(BLOCK));
        const T: usize = 4096;
        let table: Vec<u8> =
            (0..T).map(|j| f32_to_e4m3(((j as f32 + 0.5) / T as f32 * 2.0 - 1.0) * E4M3_MAX)).collect();
        let q = (0..n * k).map(|_| table[(rng.next_u64() >> 52) as usize]).collect();
        let s = (0..n.div_ceil(BLOCK) * (k / BLOCK)).map(|_| rng.uniform(0.5e-4, 1.5e-4)).collect();
        Fp8Weight { q, s, n, k }
    }

    /// The scale of weight row `row`, k block `kb`.
    pub fn scale_at(&self, row: usize, kb: usize) -> f32 {
        self.s[(row / BLOCK) * (self.k / BLOCK) + kb]
    }
}

/// Reference outputs of chosen rows: `y[r][c] = Σ_kb (Σ_k qx·qw) · sx[r][kb] · sw[c/128][kb]`
/// in f64, plus `Σ |terms|` per output (the scale of the rounding error a correct f32
/// kernel may make). Returns `(y, abs)`, each `[rows.len()][n]`. Parallel over rows.
pub fn fp8_gemm_rows(xq: &[u8], xs: &[f32], w: &Fp8Weight, rows: &[usize]) -> (Vec<f64>, Vec<f64>) {
    let (n, k) = (w.n, w.k);
    let kbs = k / BLOCK;
    let lut: Vec<f64> = (0..=255u8).map(|b| f64::from(e4m3_to_f32(b))).collect();
    let mut y = vec![0f64; rows.len() * n];
    let mut abs = vec![0f64; rows.len() * n];
    let threads = std::thread::available_parallelism().map_or(4, |p| p.get()).max(1);
    // Work items are (row index, column range) so that a few rows still use every core.
    let per = n.div_ceil(threads.div_ceil(rows.len().max(1)).max(1)).max(1);
    std::thread::scope(|sc| {
        let mut items: Vec<(usize, usize, &mut [f64], &mut [f64])> = Vec::new();
        for (ri, (yr, ar)) in y.chunks_mut(n).zip(abs.chunks_mut(n)).enumerate() {
            for (ci, (yc, ac)) in yr.chunks_mut(per).zip(ar.chunks_mut(per)).enumerate() {
                items.push((ri, ci * per, yc, ac));
            }
        }
        let chunk = items.len().div_ceil(threads).max(1);
        let mut groups: Vec<Vec<_>> = Vec::new();
        while !items.is_empty() {
            let rest = items.split_off(chunk.min(items.len()));
            groups.push(std::mem::replace(&mut items, rest));
        }
        for group in groups {
            let lut = &lut;
            sc.spawn(move || {
                for (ri, c0, yc, ac) in group {
                    let r = rows[ri];
                    let xr: Vec<f64> = xq[r * k..(r + 1) * k].iter().map(|&b| lut[b as usize]).collect();
                    for (j, (yo, ao)) in yc.iter_mut().zip(ac.iter_mut()).enumerate() {
                        let c = c0 + j;
                        let wr = &w.q[c * k..(c + 1) * k];
                        let (mut tot, mut tabs) = (0f64, 0f64);
                        for kb in 0..kbs {
                            let (mut p, mut pa) = (0f64, 0f64);
                            for i in kb * BLOCK..(kb + 1) * BLOCK {
                                let t = xr[i] * lut[wr[i] as usize];
                                p += t;
                                pa += t.abs();
                            }
                            let s = f64::from(xs[r * kbs + kb]) * f64::from(w.scale_at(c, kb));
                            tot += p * s;
                            tabs += pa * s.abs();
                        }
                        *yo = tot;
                        *ao = tabs;
                    }
                }
            });
        }
    });
    (y, abs)
}

/// How far a kernel's outputs lie from the reference.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8Err {
    /// ‖got − ref‖₂ / ‖ref‖₂.
    pub rel_l2: f64,
    /// max |got − ref| / (abs_tol · Σ|terms| + out_tol · |ref|) over the outputs: ≤ 1 passes.
    pub worst: f64,
    pub all_finite: bool,
}

/// Compares `got` with `(want, abs)` of [`fp8_gemm_rows`]: an output may miss by
/// `abs_tol · Σ|terms| + out_tol · |ref|` (the kernel's f32/fp8-accumulator rounding,
/// and the output's own rounding: 2^-8 for bf16, 0 for f32).
pub fn fp8_err(got: &[f32], want: &[f64], abs: &[f64], abs_tol: f64, out_tol: f64) -> Fp8Err {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den, mut worst, mut all_finite) = (0f64, 0f64, 0f64, true);
    for ((&g, &w), &a) in got.iter().zip(want).zip(abs) {
        all_finite &= g.is_finite();
        let d = (f64::from(g) - w).abs();
        num += d * d;
        den += w * w;
        let tol = abs_tol * a + out_tol * w.abs() + 1e-30;
        worst = worst.max(if d.is_nan() { f64::INFINITY } else { d / tol });
    }
    let rel_l2 = if den > 0.0 { (num / den).sqrt() } else { num.sqrt() };
    Fp8Err { rel_l2, worst, all_finite }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every non-NaN code decodes and re-encodes to itself (±0 included).
    #[test]
    fn codes_round_trip() {
        for b in 0..=255u8 {
            let f = e4m3_to_f32(b);
            if f.is_nan() {
                assert!(b & 0x7f == 0x7f);
                continue;
            }
            assert_eq!(f32_to_e4m3(f), b, "{b:#04x} = {f}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
    }

    /// Midpoints between neighbouring codes go to the even mantissa; a hair off a
    /// midpoint goes to the nearer code.
    #[test]
    fn rounding_is_nearest_even() {
        for b in 0..0x7eu8 {
            let (lo, hi) = (e4m3_to_f32(b), e4m3_to_f32(b + 1));
            let mid = (lo + hi) / 2.0; // exact in f32
            let even = if b & 1 == 0 { b } else { b + 1 };
            assert_eq!(f32_to_e4m3(mid), even, "mid of {b:#04x} {lo} and {hi}");
            assert_eq!(f32_to_e4m3(-mid), 0x80 | even);
            let eps = (hi - lo) / 64.0;
            assert_eq!(f32_to_e4m3(mid - eps), b);
            assert_eq!(f32_to_e4m3(mid + eps), b + 1);
        }
        // 1.1875 lies between 1.125 (odd mantissa 1) and 1.25 (even 2).
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.1875)), 1.25);
        // Half the smallest subnormal rounds to zero (even), 1.5 of it to 2 steps.
        assert_eq!(f32_to_e4m3(2f32.powi(-10)), 0);
        assert_eq!(f32_to_e4m3(1.5 * 2f32.powi(-9)), 2);
    }

    #[test]
    fn saturates_and_handles_specials() {
        for v in [448.0f32, 449.0, 464.0, 480.0, 1e9, f32::INFINITY] {
            assert_eq!(f32_to_e4m3(v), 0x7e, "{v}");
            assert_eq!(f32_to_e4m3(-v), 0xfe, "-{v}");
        }
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7f);
        assert_eq!(f32_to_e4m3(0.0), 0x00);
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
        assert_eq!(f32_to_e4m3(1e-30), 0x00);
    }

    /// The scale rule: s = amax / 448 per row and group; the group's amax element maps
    /// to ±448 exactly; an all-zero group gets scale 1 and zero bytes.
    #[test]
    fn act_quant_scale_rules() {
        let (m, k) = (3, 256);
        let mut rng = Rng::new(5);
        let mut x: Vec<f32> = (0..m * k).map(|_| rng.uniform(-3.0, 3.0)).collect();
        x[k..k + BLOCK].iter_mut().for_each(|v| *v = 0.0); // row 1, group 0: zeros
        x[5] = 10.0; // row 0 group 0 amax
        x[2 * k + 200] = -7.5; // row 2 group 1 amax (negative)
        let (q, s) = act_quant(&x, m, k);
        assert_eq!(s.len(), m * 2);
        assert_eq!(s[0], 10.0 / 448.0);
        assert_eq!(q[5], 0x7e);
        assert_eq!(s[2], 1.0);
        assert!(q[k..k + BLOCK].iter().all(|&b| b == 0));
        assert_eq!(s[5], 7.5 / 448.0);
        assert_eq!(q[2 * k + 200], 0xfe);
        // Every quantised value lies within half an e4m3 step (relative 2^-4) of x / s.
        for (i, (&b, &v)) in q.iter().zip(&x).enumerate() {
            let sc = s[i / BLOCK];
            let back = e4m3_to_f32(b) * sc;
            assert!((back - v).abs() <= v.abs() / 16.0 + sc * 2f32.powi(-10), "{i}: {v} -> {back}");
        }
    }

    /// The f64 GEMM reference against a direct dequantise-and-multiply on a small case.
    #[test]
    fn gemm_reference_matches_dequantised_product() {
        let (m, n, k) = (3, 200, 384);
        let mut rng = Rng::new(9);
        let w = Fp8Weight::random(&mut rng, n, k);
        let x: Vec<f32> = (0..m * k).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let (xq, xs) = act_quant(&x, m, k);
        let (y, abs) = fp8_gemm_rows(&xq, &xs, &w, &[2, 0]);
        for (ri, &r) in [2usize, 0].iter().enumerate() {
            for c in 0..n {
                let mut want = 0f64;
                for i in 0..k {
                    let xv = f64::from(e4m3_to_f32(xq[r * k + i])) * f64::from(xs[r * (k / BLOCK) + i / BLOCK]);
                    let wv = f64::from(e4m3_to_f32(w.q[c * k + i])) * f64::from(w.scale_at(c, i / BLOCK));
                    want += xv * wv;
                }
                let got = y[ri * n + c];
                assert!((got - want).abs() <= 1e-12 * abs[ri * n + c], "({r}, {c}): {got} vs {want}");
                // And the quantised product is close to the unquantised one (fp8 error).
                let exact: f64 = (0..k)
                    .map(|i| {
                        f64::from(x[r * k + i])
                            * f64::from(e4m3_to_f32(w.q[c * k + i]))
                            * f64::from(w.scale_at(c, i / BLOCK))
                    })
                    .sum();
                assert!((got - exact).abs() <= 0.08 * abs[ri * n + c], "({r}, {c}): {got} vs {exact}");
            }
        }
        let e = fp8_err(&y.iter().map(|&v| v as f32).collect::<Vec<_>>(), &y, &abs, 1e-6, 2f64.powi(-24));
        assert!(e.worst <= 1.0 && e.rel_l2 < 1e-7 && e.all_finite, "{e:?}");
        let bad: Vec<f32> = y.iter().map(|&v| v as f32 * 1.01).collect();
        assert!(fp8_err(&bad, &y, &abs, 1e-4, 0.0).rel_l2 > 5e-3);
    }
}
