//! Straightforward CPU references of the kernels, the oracle of the GPU checks: MLA
//! decode attention, the expanded-form prefill attention, RMSNorm (plain and fused with the residual add), SiLU-mul, argmax.
//!
//! Inputs are f32 holding the exact values the GPU sees (bf16-rounded where the kernel
//! reads bf16); accumulation is in f64, so the reference is well below the kernels'
//! own error and a comparison measures the kernel alone.

use mlaserve_cuda::dims::{DecodeDims, PrefillDims, PrefillSeq};
use mlaserve_cuda::plan::PAGE;

/// Absorbed-MLA decode attention.
///
/// `q`: `[batch][rows][dqk]` with `row = s_idx * heads + head`; `cache`:
/// `[num_blocks][PAGE][dqk]` (`[c_kv | k_pe]` per token); `block_table`:
/// `[batch][bt_stride]`; query `s_idx` of request b sees positions
/// `p < seq_lens[b] - (q_len - 1 - s_idx)`. Keys are the full `dqk` vector, values its
/// first `dlat` entries. Returns `out [batch][rows][dlat]` and the natural-log
/// `lse [batch][rows]` of `sum exp(scale * q.k)` (`-inf`, output 0, for a row that sees
/// nothing).
pub fn mla_decode(
    d: &DecodeDims,
    q: &[f32],
    cache: &[f32],
    block_table: &[i32],
    seq_lens: &[i32],
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let (rows, dqk, dlat) = (d.rows(), d.dqk(), d.dlat);
    assert_eq!(q.len(), d.batch * rows * dqk, "q shape");
    assert_eq!(block_table.len(), d.batch * d.bt_stride, "block table shape");
    assert_eq!(seq_lens.len(), d.batch, "seq_lens shape");
    let mut out = vec![0f32; d.batch * rows * dlat];
    let mut lse = vec![f32::NEG_INFINITY; d.batch * rows];
    std::thread::scope(|s| {
        for ((b, out_b), lse_b) in out.chunks_mut(rows * dlat).enumerate().zip(lse.chunks_mut(rows)) {
            s.spawn(move || {
                let seq_len = seq_lens[b] as usize;
                let key = |p: usize| {
                    let page = block_table[b * d.bt_stride + p / PAGE] as usize;
                    let off = (page * PAGE + p % PAGE) * dqk;
                    &cache[off..off + dqk]
                };
                let mut scores = Vec::with_capacity(seq_len);
                for row in 0..rows {
                    let s_idx = row / d.heads;
                    let visible = (seq_len + s_idx + 1).saturating_sub(d.q_len);
                    let qr = &q[(b * rows + row) * dqk..][..dqk];
                    scores.clear();
                    scores.extend((0..visible).map(|p| {
                        let k = key(p);
                        scale as f64 * qr.iter().zip(k).map(|(&a, &c)| a as f64 * c as f64).sum::<f64>()
                    }));
                    if visible == 0 {
                        continue;
                    }
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let mut sum = 0f64;
                    let mut acc = vec![0f64; dlat];
                    for (p, &sc) in scores.iter().enumerate() {
                        let w = (sc - m).exp();
                        sum += w;
                        for (a, &v) in acc.iter_mut().zip(&key(p)[..dlat]) {
                            *a += w * v as f64;
                        }
                    }
                    for (o, a) in out_b[row * dlat..][..dlat].iter_mut().zip(&acc) {
                        *o = (a / sum) as f32;
                    }
                    lse_b[row] = (m + sum.ln()) as f32;
                }
            });
        }
    });
    (out, lse)
}

/// Expanded-form causal MLA attention, the reference of `kernels/mla_prefill.cu`.
///
/// `q`: `[rows][heads][nope + rope]`, RoPE already applied to the rope part and rounded as
/// the kernel rounds ([`rope_query`]); `kn`: `[keys][heads][nope]`; `kpe`: `[keys][rope]`,
/// shared by every head; `v`: `[keys][heads][vdim]`. Sequence j's keys are the rows
/// `Σ_{j' < j} k_len ..` of the key buffers, in position order; its query `i` (row
/// `q_row0 + i`) sits at position `k_len − q_len + i` and sees keys `0..=` that position.
/// Returns `o [rows][heads][vdim]` (`rows` = one past the last query row): the query rows
/// of the heads in `only` (every head when `None`) filled, everything else NaN.
#[allow(clippy::too_many_arguments)]
pub fn mla_prefill(
    d: &PrefillDims,
    seqs: &[PrefillSeq],
    q: &[f32],
    kn: &[f32],
    kpe: &[f32],
    v: &[f32],
    scale: f32,
    only: Option<&[usize]>,
) -> Vec<f32> {
    let (h, qk, nope, vd) = (d.heads, d.qk(), d.nope, d.vdim);
    let rows = seqs.iter().map(|s| s.q_row0 + s.q_len).max().unwrap_or(0);
    let keys: usize = seqs.iter().map(|s| s.k_len).sum();
    assert!(q.len() >= rows * h * qk, "q shape");
    assert!(kn.len() >= keys * h * nope && kpe.len() >= keys * d.rope && v.len() >= keys * h * vd, "key shapes");
    let heads: Vec<usize> = only.map_or_else(|| (0..h).collect(), <[usize]>::to_vec);
    let mut k_off = Vec::with_capacity(seqs.len());
    let mut at = 0;
    for s in seqs {
        k_off.push(at);
        at += s.k_len;
    }
    // Work items (sequence, head), spread over the machine's threads.
    let items: Vec<(usize, usize)> = (0..seqs.len()).flat_map(|j| heads.iter().map(move |&hd| (j, hd))).collect();
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get()).min(items.len().max(1));
    let results: Vec<Vec<(usize, usize, Vec<f32>)>> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..threads)
            .map(|th| {
                let (items, k_off) = (&items, &k_off);
                sc.spawn(move || {
                    let mut out = Vec::new();
                    for &(j, hd) in items.iter().skip(th).step_by(threads) {
                        let s = seqs[j];
                        let key_row = |t: usize| k_off[j] + t;
                        let mut o = vec![0f32; s.q_len * vd];
                        let mut scores = Vec::with_capacity(s.k_len);
                        for i in 0..s.q_len {
                            let qr = &q[((s.q_row0 + i) * h + hd) * qk..][..qk];
                            let visible = s.k_len - s.q_len + i + 1;
                            scores.clear();
                            scores.extend((0..visible).map(|t| {
                                let kr = key_row(t);
                                let knr = &kn[(kr * h + hd) * nope..][..nope];
                                let kpr = &kpe[kr * d.rope..][..d.rope];
                                let dot: f64 =
                                    qr[..nope].iter().zip(knr).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>()
                                        + qr[nope..].iter().zip(kpr).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>();
                                scale as f64 * dot
                            }));
                            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                            let mut sum = 0f64;
                            let mut acc = vec![0f64; vd];
                            for (t, &sc) in scores.iter().enumerate() {
                                let w = (sc - m).exp();
                                sum += w;
                                let vr = &v[(key_row(t) * h + hd) * vd..][..vd];
                                for (a, &x) in acc.iter_mut().zip(vr) {
                                    *a += w * x as f64;
                                }
                            }
                            for (dst, a) in o[i * vd..][..vd].iter_mut().zip(&acc) {
                                *dst = (a / sum) as f32;
                            }
                        }
                        out.push((j, hd, o));
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|t| t.join().expect("reference thread")).collect()
    });
    let mut o = vec![f32::NAN; rows * h * vd];
    for (j, hd, part) in results.into_iter().flatten() {
        let s = seqs[j];
        for i in 0..s.q_len {
            o[((s.q_row0 + i) * h + hd) * vd..][..vd].copy_from_slice(&part[i * vd..][..vd]);
        }
    }
    o
}

/// The query the prefill kernel attends with: per row r and head, `q_nope` and
/// `RoPE(q_pe, pos[r])` (interleaved pairs, f32 as the kernels compute it, with the tables
/// of [`mlaserve_cuda::rope::rope_tables`]), each value rounded to bf16. `q`: `[rows][heads][nope + rope]`.
pub fn rope_query(
    q: &[f32],
    pos: &[usize],
    heads: usize,
    nope: usize,
    cos: &[f32],
    sin: &[f32],
    rope: usize,
) -> Vec<f32> {
    let qk = nope + rope;
    let half = rope / 2;
    let bf = |x: f32| half::bf16::from_f32(x).to_f32();
    let mut out = q.to_vec();
    for (r, row) in out.chunks_mut(heads * qk).enumerate() {
        for hq in row.chunks_mut(qk) {
            let p = pos[r] * half;
            for i in 0..half {
                let (a, b) = (hq[nope + 2 * i], hq[nope + 2 * i + 1]);
                let (c, s) = (cos[p + i], sin[p + i]);
                hq[nope + 2 * i] = a * c - b * s;
                hq[nope + 2 * i + 1] = a * s + b * c;
            }
            hq.iter_mut().for_each(|x| *x = bf(*x));
        }
    }
    out
}

/// RMSNorm of each `h`-wide row: `x / sqrt(mean(x²) + eps) * w`.
pub fn rmsnorm(x: &[f32], w: &[f32], h: usize, eps: f32) -> Vec<f32> {
    assert_eq!(w.len(), h);
    let mut out = vec![0f32; x.len()];
    for (o, r) in out.chunks_mut(h).zip(x.chunks(h)) {
        let ms = r.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / h as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        for ((o, &v), &g) in o.iter_mut().zip(r).zip(w) {
            *o = (v as f64 * inv * g as f64) as f32;
        }
    }
    out
}

/// Fused residual add + RMSNorm: `z = x + residual`; returns `(rmsnorm(z), z)` (the
/// normalised hidden state and the new residual).
pub fn fused_add_rmsnorm(x: &[f32], residual: &[f32], w: &[f32], h: usize, eps: f32) -> (Vec<f32>, Vec<f32>) {
    let z: Vec<f32> = x.iter().zip(residual).map(|(a, b)| a + b).collect();
    (rmsnorm(&z, w, h, eps), z)
}

/// Gated-MLP activation: each row of `input` is `[gate (d) | up (d)]`; returns
/// `silu(gate) * up`, `silu(g) = g / (1 + e^-g)`.
pub fn silu_mul(input: &[f32], d: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(input.len() / 2);
    for r in input.chunks(2 * d) {
        let (g, u) = r.split_at(d);
        out.extend(g.iter().zip(u).map(|(&g, &u)| (g as f64 / (1.0 + (-g as f64).exp()) * u as f64) as f32));
    }
    out
}

/// Index of each `vocab`-wide row's largest value, first occurrence on ties, NaN ignored
/// (0 for a row with no number).
pub fn argmax(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits
        .chunks(vocab)
        .map(|r| {
            let mut best: Option<(usize, f32)> = None;
            for (i, &v) in r.iter().enumerate() {
                if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
                    best = Some((i, v));
                }
            }
            best.map_or(0, |(i, _)| i as u32)
        })
        .collect()
}

/// Error of `got` against `want`: `‖got − want‖₂ / ‖want‖₂`, the largest absolute
/// difference, and whether every value of `got` is finite.
#[derive(Debug, Clone, Copy)]
pub struct ErrStats {
    pub rel_l2: f64,
    pub max_abs: f64,
    pub all_finite: bool,
}

pub fn err_stats(got: &[f32], want: &[f32]) -> ErrStats {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den, mut max_abs, mut all_finite) = (0f64, 0f64, 0f64, true);
    for (&g, &w) in got.iter().zip(want) {
        all_finite &= g.is_finite();
        let diff = g as f64 - w as f64;
        num += diff * diff;
        den += w as f64 * w as f64;
        max_abs = max_abs.max(diff.abs());
    }
    let rel_l2 = if den > 0.0 { (num / den).sqrt() } else { num.sqrt() };
    ErrStats { rel_l2, max_abs, all_finite }
}

/// Like [`err_stats`] for LSE vectors, where `-inf` (a row that sees nothing) must match.
pub fn lse_max_abs(got: &[f32], want: &[f32]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            if g == w {
                0.0
            } else if g.is_finite() && w.is_finite() {
                (g as f64 - w as f64).abs()
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use mlaserve_cuda::rope::rope_tables;

    /// One token visible: output is that token's value, lse its scaled score.
    #[test]
    fn single_visible_token() {
        let d = DecodeDims { batch: 1, heads: 2, q_len: 2, dlat: 4, drope: 2, bt_stride: 1 };
        let mut rng = Rng::new(1);
        let q: Vec<f32> = (0..d.batch * d.rows() * d.dqk()).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let cache: Vec<f32> = (0..PAGE * d.dqk()).map(|_| rng.uniform(-1.0, 1.0)).collect();
        // seq_len 2 with q_len 2: query 0 sees position 0 only, query 1 sees 0 and 1.
        let (out, lse) = mla_decode(&d, &q, &cache, &[0], &[2], 0.5);
        for head in 0..2 {
            let row = head; // s_idx 0
            for i in 0..4 {
                assert!((out[row * 4 + i] - cache[i]).abs() < 1e-6);
            }
            let s: f32 = (0..6).map(|i| q[row * 6 + i] * cache[i]).sum::<f32>() * 0.5;
            assert!((lse[row] - s).abs() < 1e-5);
        }
        assert!(lse[2].is_finite() && lse[3].is_finite());
    }

    /// Uniform scores give the mean of the visible values; paging is honoured.
    #[test]
    fn zero_query_averages_values_through_block_table() {
        let d = DecodeDims { batch: 1, heads: 1, q_len: 1, dlat: 2, drope: 1, bt_stride: 2 };
        let q = vec![0f32; 3];
        let mut cache = vec![0f32; 2 * PAGE * 3];
        // Logical page 0 -> physical 1, logical page 1 -> physical 0.
        for p in 0..70usize {
            let phys = if p < PAGE { PAGE + p } else { p - PAGE };
            cache[phys * 3] = p as f32;
            cache[phys * 3 + 1] = 1.0;
        }
        let (out, lse) = mla_decode(&d, &q, &cache, &[1, 0], &[70], 1.0);
        assert!((out[0] - 34.5).abs() < 1e-4, "{}", out[0]);
        assert!((out[1] - 1.0).abs() < 1e-6);
        assert!((lse[0] - (70f32).ln()).abs() < 1e-5);
    }

    /// One key: the output is that key's value, whatever the scores.
    #[test]
    fn prefill_single_key_returns_its_value() {
        let d = PrefillDims { heads: 2, nope: 4, rope: 2, vdim: 3 };
        let seqs = [PrefillSeq { q_row0: 1, q_len: 1, k_len: 1, table_row: 0 }];
        let mut rng = Rng::new(5);
        let mut r = |n: usize| (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect::<Vec<f32>>();
        let (q, kn, kpe, v) = (r(2 * 2 * 6), r(2 * 4), r(2), r(2 * 3));
        let o = mla_prefill(&d, &seqs, &q, &kn, &kpe, &v, 0.7, None);
        assert!(o[..6].iter().all(|x| x.is_nan()), "row 0 is no query row");
        assert_eq!(&o[6..], &v[..]);
        let o1 = mla_prefill(&d, &seqs, &q, &kn, &kpe, &v, 0.7, Some(&[1]));
        assert!(o1[6..9].iter().all(|x| x.is_nan()));
        assert_eq!(&o1[9..], &v[3..]);
    }

    /// The expanded form (K_nope = c·W_UKᵀ, V = c·W_UVᵀ, attend, per head) equals the
    /// absorbed form (q_lat = W_UKᵀ q_nope over the latent cache, then W_UV): the same
    /// function, here through the two references, with a cached prefix that
    /// crosses a page and two sequences.
    #[test]
    fn prefill_expanded_equals_absorbed() {
        let (heads, nope, rope, vdim, lora) = (3, 8, 4, 6, 10);
        let d = PrefillDims { heads, nope, rope, vdim };
        let (q_len, lens) = (3, [70usize, 5]);
        let mut rng = Rng::new(17);
        let mut r = |n: usize| (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect::<Vec<f32>>();
        let keys: usize = lens.iter().sum();
        let (c, kpe) = (r(keys * lora), r(keys * rope));
        let (wuk, wuv) = (r(heads * nope * lora), r(heads * vdim * lora));
        let q = r(2 * q_len * heads * (nope + rope));
        // Expanded.
        let up = |w: &[f32], width: usize| -> Vec<f32> {
            (0..keys * heads * width)
                .map(|i| {
                    let (t, hw) = (i / (heads * width), i % (heads * width));
                    (0..lora).map(|x| c[t * lora + x] as f64 * w[hw * lora + x] as f64).sum::<f64>() as f32
                })
                .collect()
        };
        let (kn, v) = (up(&wuk, nope), up(&wuv, vdim));
        let seqs = [
            PrefillSeq { q_row0: 0, q_len, k_len: lens[0], table_row: 0 },
            PrefillSeq { q_row0: q_len, q_len, k_len: lens[1], table_row: 1 },
        ];
        let exp = mla_prefill(&d, &seqs, &q, &kn, &kpe, &v, 0.3, None);
        // Absorbed: the latent cache in pages (sequence 0 on pages 2, 0; sequence 1 on 1).
        let dqk = lora + rope;
        let tables = [2, 0, 1, 0];
        let mut cache = vec![0f32; 3 * PAGE * dqk];
        let mut t0 = 0;
        for (b, &len) in lens.iter().enumerate() {
            for p in 0..len {
                let slot = tables[b * 2 + p / PAGE] as usize * PAGE + p % PAGE;
                cache[slot * dqk..][..lora].copy_from_slice(&c[(t0 + p) * lora..][..lora]);
                cache[slot * dqk + lora..][..rope].copy_from_slice(&kpe[(t0 + p) * rope..][..rope]);
            }
            t0 += len;
        }
        let dd = DecodeDims { batch: 2, heads, q_len, dlat: lora, drope: rope, bt_stride: 2 };
        let mut qa = vec![0f32; 2 * q_len * heads * dqk];
        for row in 0..2 * q_len {
            for hd in 0..heads {
                let src = &q[(row * heads + hd) * (nope + rope)..][..nope + rope];
                let dst = &mut qa[(row * heads + hd) * dqk..][..dqk];
                for x in 0..lora {
                    dst[x] =
                        (0..nope).map(|n| src[n] as f64 * wuk[(hd * nope + n) * lora + x] as f64).sum::<f64>() as f32;
                }
                dst[lora..].copy_from_slice(&src[nope..]);
            }
        }
        let (o_lat, _) = mla_decode(&dd, &qa, &cache, &tables, &[lens[0] as i32, lens[1] as i32], 0.3);
        let mut worst = 0f64;
        for row in 0..2 * q_len {
            for hd in 0..heads {
                for x in 0..vdim {
                    let want: f64 = (0..lora)
                        .map(|l| wuv[(hd * vdim + x) * lora + l] as f64 * o_lat[(row * heads + hd) * lora + l] as f64)
                        .sum();
                    let got = exp[(row * heads + hd) * vdim + x] as f64;
                    worst = worst.max((got - want).abs() / want.abs().max(1.0));
                }
            }
        }
        assert!(worst < 1e-5, "expanded vs absorbed: {worst:e}");
    }

    /// `rope_query` rotates only the rope part, by the tables' row of the row's position,
    /// and rounds everything to bf16.
    #[test]
    fn rope_query_rotates_pairs_at_the_position() {
        let inv = [1.0, 0.1];
        let (cos, sin) = rope_tables(&inv, 1.0, 8);
        let q = vec![1.5f32, -0.25, 1.0, 0.0, 0.0, 1.0]; // one row, one head: nope 2, rope 4
        let out = rope_query(&q, &[3], 1, 2, &cos, &sin, 4);
        assert_eq!(&out[..2], &[1.5, -0.25]);
        let bf = |x: f32| half::bf16::from_f32(x).to_f32();
        assert_eq!(out[2], bf(cos[6]));
        assert_eq!(out[3], bf(sin[6]));
        assert_eq!(out[4], bf(-sin[7]));
        assert_eq!(out[5], bf(cos[7]));
    }

    #[test]
    fn small_ops() {
        let x = [3.0f32, 4.0];
        let out = rmsnorm(&x, &[1.0, 2.0], 2, 0.0);
        let rms = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / rms).abs() < 1e-6 && (out[1] - 8.0 / rms).abs() < 1e-6);
        let (o, z) = fused_add_rmsnorm(&[1.0, 2.0], &[2.0, 2.0], &[1.0, 2.0], 2, 0.0);
        assert_eq!(z, vec![3.0, 4.0]);
        assert_eq!(o, out);
        let s = silu_mul(&[0.0, 1.0, 5.0, 2.0], 2);
        assert_eq!(s[0], 0.0);
        assert!((s[1] - 2.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
        assert_eq!(argmax(&[1.0, 3.0, 3.0, f32::NAN, 0.0, 5.0], 3), vec![1, 2]);
        assert_eq!(argmax(&[f32::NAN, f32::NAN], 2), vec![0]);
    }

    #[test]
    fn err_stats_flags_nan() {
        let e = err_stats(&[1.0, f32::NAN], &[1.0, 2.0]);
        assert!(!e.all_finite);
        let e = err_stats(&[1.0, 2.0], &[1.0, 2.0]);
        assert!(e.all_finite && e.rel_l2 == 0.0);
        assert_eq!(lse_max_abs(&[f32::NEG_INFINITY], &[f32::NEG_INFINITY]), 0.0);
        assert!(lse_max_abs(&[0.0], &[f32::NEG_INFINITY]).is_infinite());
    }
}
