//! Row-wise f32 kernels of the reference backend.
//!
//! Every reduction runs in a fixed order that depends only on the row's own data, never
//! on how many rows share the call: a token's result is bit-identical whatever batch it
//! is in. The engine's "speculation on equals speculation off" tests rely on that.

use crate::fp8::Fp8Weight;
use rayon::prelude::*;

/// A dense layer `y = W x` with `W` row-major `[out, inp]`: f32 weights, or an fp8
/// weight whose product quantises the activations ([`crate::fp8`]).
#[derive(Debug, Clone)]
pub struct Linear {
    /// f32 weights; empty for an fp8 linear.
    pub w: Vec<f32>,
    pub out: usize,
    pub inp: usize,
    fp8: Option<Box<Fp8Weight>>,
}

impl Linear {
    pub fn new(w: Vec<f32>, out: usize, inp: usize) -> Self {
        debug_assert_eq!(w.len(), out * inp);
        Linear { w, out, inp, fp8: None }
    }

    /// An fp8 linear (activations quantised per token per 128 channels).
    pub fn fp8(w: Fp8Weight, out: usize, inp: usize) -> Self {
        Linear { w: Vec::new(), out, inp, fp8: Some(Box::new(w)) }
    }

    /// Whether this linear computes in fp8.
    pub fn is_fp8(&self) -> bool {
        self.fp8.is_some()
    }

    /// `x` is `[n, inp]`; returns `[n, out]`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let n = x.len() / self.inp;
        let mut y = vec![0f32; n * self.out];
        let work = n * self.out * self.inp;
        if let Some(f) = &self.fp8 {
            // Each row is quantised and multiplied on its own: the result never depends
            // on the batch or on how the outputs are split between threads.
            if work > 1 << 16 && n > 1 {
                y.par_chunks_mut(self.out)
                    .enumerate()
                    .for_each(|(t, yr)| f.forward_row(&x[t * self.inp..(t + 1) * self.inp], yr, 0, self.inp));
            } else if work > 1 << 16 {
                y.par_chunks_mut(64)
                    .enumerate()
                    .for_each(|(c, ys)| f.forward_row(&x[..self.inp], ys, c * 64, self.inp));
            } else {
                for (t, yr) in y.chunks_mut(self.out).enumerate() {
                    f.forward_row(&x[t * self.inp..(t + 1) * self.inp], yr, 0, self.inp);
                }
            }
            return y;
        }
        let row = |(t, yr): (usize, &mut [f32])| {
            let xr = &x[t * self.inp..(t + 1) * self.inp];
            for (o, yo) in yr.iter_mut().enumerate() {
                *yo = dot(xr, &self.w[o * self.inp..(o + 1) * self.inp]);
            }
        };
        if work > 1 << 16 && n > 1 {
            y.par_chunks_mut(self.out).enumerate().for_each(row);
        } else if work > 1 << 16 {
            // One row, many outputs: split the outputs (each dot product is unchanged).
            let xr = &x[..self.inp];
            y.par_chunks_mut(64).enumerate().for_each(|(c, ys)| {
                for (i, yo) in ys.iter_mut().enumerate() {
                    let o = c * 64 + i;
                    *yo = dot(xr, &self.w[o * self.inp..(o + 1) * self.inp]);
                }
            });
        } else {
            y.chunks_mut(self.out).enumerate().for_each(row);
        }
        y
    }
}

/// Dot product with eight fixed lanes, reduced in a fixed order.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0f32; 8];
    let chunks = n / 8;
    for i in 0..chunks {
        let (pa, pb) = (&a[i * 8..i * 8 + 8], &b[i * 8..i * 8 + 8]);
        for j in 0..8 {
            acc[j] += pa[j] * pb[j];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..n {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// RMSNorm of each `dim`-wide row of `x`, in place.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    for row in x.chunks_mut(dim) {
        let ss = dot(row, row) / dim as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for (v, g) in row.iter_mut().zip(w) {
            *v = *v * inv * g;
        }
    }
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `out[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter().zip(up).map(|(g, u)| silu(*g) * u).collect()
}

/// Precomputed RoPE cos/sin (YaRN-blended frequencies, scaled by the attention factor).
#[derive(Debug, Clone)]
pub struct Rope {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    pub fn new(inv_freq: &[f64], attention_factor: f64, max_pos: usize) -> Self {
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for f in inv_freq {
                // f32 angle, as transformers computes it, then cos/sin in f64.
                let ang = (p as f32 * *f as f32) as f64;
                cos.push((ang.cos() * attention_factor) as f32);
                sin.push((ang.sin() * attention_factor) as f32);
            }
        }
        Rope { half, cos, sin }
    }

    /// Rotates interleaved pairs `(x[2i], x[2i+1])` of one vector at position `pos`.
    /// (DeepSeek's complex-number form; transformers' `rope_interleave` permutes the
    /// pairs first, which changes the layout but not any dot product.)
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let (c, s) = (&self.cos[pos * self.half..], &self.sin[pos * self.half..]);
        for i in 0..self.half {
            let (a, b) = (x[2 * i], x[2 * i + 1]);
            x[2 * i] = a * c[i] - b * s[i];
            x[2 * i + 1] = a * s[i] + b * c[i];
        }
    }
}

/// Index of the largest value; the lowest index wins ties.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best
}
