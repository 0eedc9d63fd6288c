//! Token choice and draft verification.
//!
//! The target distribution of a logits row is the softmax after temperature, top-k and
//! top-p ([`target_distribution`]). A token is chosen by inverse-CDF sampling in token-id
//! order with the request's counter-based uniform for that position, or by argmax when
//! the request is greedy.
//!
//! Verification of a window `[last, d1..dk]` walks the rows in order: row `j` gives the
//! target token `x_j` for the position after window index `j`; draft `d_{j+1}` is accepted
//! iff it equals `x_j`, and the first mismatch (or row `k`, the bonus) ends the window
//! with `x_j` emitted. Because drafts are the argmax of the MTP logits, the draft
//! distribution q is one-hot, and this *sample-then-compare* rule is exactly Leviathan
//! rejection sampling for one-hot q: the draft is accepted with probability
//! `min(1, p(d)/q(d)) = p(d)`, and on rejection the emitted token is distributed as
//! `p` with `d` removed and renormalised, i.e. `norm(max(0, p − q))`. It also makes the
//! emitted token a pure function of (target row, seed, position), independent of the
//! draft, of k and of the batch (docs/engine.md has the argument).

use crate::rng::{uniform, Purpose};
use mlaserve_core::SamplingParams;

/// A target distribution: candidate tokens in ascending id order and their
/// probabilities (summing to 1).
#[derive(Debug, Clone, PartialEq)]
pub struct TargetDist {
    pub tokens: Vec<u32>,
    pub probs: Vec<f64>,
}

/// Index of the largest logit; ties go to the lowest id, NaN never wins (the one rule
/// every backend's `argmax_rows` follows too).
pub use mlaserve_core::argmax;

/// The distribution a non-greedy request samples from: softmax(logits / temperature)
/// restricted to the top-k logits and then to the smallest nucleus of mass `top_p`.
pub fn target_distribution(logits: &[f32], params: &SamplingParams) -> TargetDist {
    let t = if params.temperature > 0.0 { params.temperature as f64 } else { 1.0 };
    let mut cand: Vec<u32> = (0..logits.len() as u32).filter(|&i| !logits[i as usize].is_nan()).collect();
    let by_logit_desc = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let k = params.top_k as usize;
    if k > 0 && k < cand.len() {
        cand.select_nth_unstable_by(k - 1, by_logit_desc);
        cand.truncate(k);
    }
    let max = cand.iter().map(|&i| logits[i as usize]).fold(f32::NEG_INFINITY, f32::max);
    if cand.is_empty() || !max.is_finite() {
        return TargetDist { tokens: vec![argmax(logits)], probs: vec![1.0] };
    }
    let mut probs: Vec<f64> = cand.iter().map(|&i| ((logits[i as usize] - max) as f64 / t).exp()).collect();
    if params.top_p < 1.0 && cand.len() > 1 {
        let total: f64 = probs.iter().sum();
        let mut order: Vec<usize> = (0..cand.len()).collect();
        order.sort_unstable_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(cand[a].cmp(&cand[b])));
        let mut cum = 0.0;
        let mut keep = order.len();
        for (n, &o) in order.iter().enumerate() {
            cum += probs[o] / total;
            if cum >= params.top_p as f64 {
                keep = n + 1;
                break;
            }
        }
        let mut kept: Vec<(u32, f64)> = order[..keep].iter().map(|&o| (cand[o], probs[o])).collect();
        kept.sort_unstable_by_key(|&(tok, _)| tok);
        cand = kept.iter().map(|&(tok, _)| tok).collect();
        probs = kept.iter().map(|&(_, p)| p).collect();
    } else if k > 0 {
        // top-k alone: restore id order.
        let mut kept: Vec<(u32, f64)> = cand.iter().copied().zip(probs.iter().copied()).collect();
        kept.sort_unstable_by_key(|&(tok, _)| tok);
        cand = kept.iter().map(|&(tok, _)| tok).collect();
        probs = kept.iter().map(|&(_, p)| p).collect();
    }
    let total: f64 = probs.iter().sum();
    for p in &mut probs {
        *p /= total;
    }
    TargetDist { tokens: cand, probs }
}

/// Inverse-CDF draw from `dist` with uniform `u` in `[0, 1)`.
pub fn sample_from(dist: &TargetDist, u: f64) -> u32 {
    let mut cum = 0.0;
    for (&tok, &p) in dist.tokens.iter().zip(&dist.probs) {
        cum += p;
        if u < cum {
            return tok;
        }
    }
    // Rounding left u above the last partial sum: the last token with mass.
    let last = dist.probs.iter().rposition(|&p| p > 0.0).unwrap_or(0);
    dist.tokens.get(last).copied().unwrap_or(0)
}

/// The target token for a logits row: argmax when greedy, else a draw with the
/// request's uniform for `position` (the index the chosen token will have in the
/// sequence).
pub fn choose_token(logits: &[f32], params: &SamplingParams, seed: u64, position: u64) -> u32 {
    if params.is_greedy() {
        argmax(logits)
    } else {
        sample_from(&target_distribution(logits, params), uniform(seed, position, Purpose::Sample))
    }
}

/// Result of verifying one window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// Accepted drafts `a` (the first `a` emitted tokens are drafts).
    pub accepted: usize,
    /// `a + 1` tokens: `d1..da` and the correction (or bonus) token.
    pub tokens: Vec<u32>,
}

/// Verifies `drafts` against a window's logits (`(drafts.len() + 1) × vocab`,
/// row-major). `first_position` is the sequence index of the token row 0 decides.
pub fn verify_window(
    logits: &[f32],
    vocab: usize,
    drafts: &[u32],
    params: &SamplingParams,
    seed: u64,
    first_position: u64,
) -> Verified {
    let mut tokens = Vec::with_capacity(drafts.len() + 1);
    let accepted = verify_window_into(logits, vocab, drafts, params, seed, first_position, &mut tokens);
    Verified { accepted, tokens }
}

/// [`verify_window`] without an allocation of its own: appends the `a + 1` emitted
/// tokens to `out` and returns `a`. The engine passes the `Vec` that becomes the
/// request's `Tokens` event.
pub fn verify_window_into(
    logits: &[f32],
    vocab: usize,
    drafts: &[u32],
    params: &SamplingParams,
    seed: u64,
    first_position: u64,
    out: &mut Vec<u32>,
) -> usize {
    verify_with(drafts, out, |j| {
        choose_token(&logits[j * vocab..(j + 1) * vocab], params, seed, first_position + j as u64)
    })
}

/// The accept loop both verifiers share: window position `j`'s target token is
/// `target(j)`; it is emitted, and the run stops at the first draft that differs (or
/// after the bonus token). Returns the number of accepted drafts.
fn verify_with(drafts: &[u32], out: &mut Vec<u32>, mut target: impl FnMut(usize) -> u32) -> usize {
    let mut j = 0;
    loop {
        let x = target(j);
        out.push(x);
        if j == drafts.len() || drafts[j] != x {
            return j;
        }
        j += 1;
    }
}

/// Greedy verification of `drafts` against the target's argmax tokens of the window
/// (`ids`, `drafts.len() + 1` of them, computed by the backend): pushes the emitted tokens
/// to `out` and returns the number of accepted drafts — what [`verify_window_into`] does
/// for a greedy request, without the logits.
pub fn verify_greedy_into(ids: &[u32], drafts: &[u32], out: &mut Vec<u32>) -> usize {
    verify_with(drafts, out, |j| ids[j])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32, k: u32, p: f32) -> SamplingParams {
        SamplingParams { temperature: t, top_k: k, top_p: p, ..Default::default() }
    }

    #[test]
    fn argmax_ties_and_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, f32::NAN]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), 1);
        let long: Vec<f32> = (0..100).map(|i| ((i * 37) % 101) as f32).collect();
        assert_eq!(argmax(&long), 30, "37 * 30 = 1110 = 10 * 101 + 100");
    }

    #[test]
    fn distribution_cuts() {
        let logits = [0.0f32, 2.0, 1.0, 3.0, f32::NAN];
        let d = target_distribution(&logits, &params(1.0, 0, 1.0));
        assert_eq!(d.tokens, vec![0, 1, 2, 3]);
        assert!((d.probs.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        let d = target_distribution(&logits, &params(1.0, 2, 1.0));
        assert_eq!(d.tokens, vec![1, 3]);
        let e = 1.0f64.exp();
        assert!((d.probs[1] - e / (1.0 + e)).abs() < 1e-9);
        let d = target_distribution(&logits, &params(1.0, 0, 0.5));
        assert_eq!(d.tokens, vec![3]);
        let d = target_distribution(&logits, &params(1.0, 0, 0.8));
        assert_eq!(d.tokens, vec![1, 3]);
    }

    #[test]
    fn verify_greedy() {
        // rows' argmax: 5, 6, 7
        let vocab = 8;
        let mut logits = vec![0.0f32; 3 * vocab];
        for (j, t) in [5, 6, 7].iter().enumerate() {
            logits[j * vocab + t] = 1.0;
        }
        let g = SamplingParams::default();
        assert_eq!(verify_window(&logits, vocab, &[5, 6], &g, 0, 10), Verified { accepted: 2, tokens: vec![5, 6, 7] });
        assert_eq!(verify_window(&logits, vocab, &[5, 1], &g, 0, 10), Verified { accepted: 1, tokens: vec![5, 6] });
        assert_eq!(verify_window(&logits, vocab, &[2, 6], &g, 0, 10), Verified { accepted: 0, tokens: vec![5] });
        assert_eq!(verify_window(&logits[..vocab], vocab, &[], &g, 0, 10), Verified { accepted: 0, tokens: vec![5] });
    }
}
