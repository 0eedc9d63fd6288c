//! Token choice and draft verification.
//!
//! The target distribution of a logits row is the softmax after temperature, top-k and
//! top-p, and a token is chosen by inverse-CDF sampling in token-id order with the
//! request's counter-based uniform for that position, or by argmax when the request is
//! greedy. That rule lives in `mlaserve_core::sampling` ([`mlaserve_core::sample_token`]),
//! because every backend applies it where the logits are: the engine asks the backend for
//! the token of each sampled row (`Batch::sample_rows`, with the uniform it draws here)
//! as it asks for the argmax of each greedy row, and compares ids.
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

/// Index of the largest logit; ties go to the lowest id, NaN never wins (the one rule
/// every backend's `argmax_rows` follows too).
pub use mlaserve_core::argmax;
/// The sampling rule's pieces (`mlaserve_core::sampling` specifies them).
pub use mlaserve_core::{sample_from, SampleRow, TargetDist};

/// The distribution a non-greedy request samples from: softmax(logits / temperature)
/// restricted to the top-k logits and then to the smallest nucleus of mass `top_p`
/// ([`mlaserve_core::target_distribution`] with the request's parameters).
pub fn target_distribution(logits: &[f32], params: &SamplingParams) -> TargetDist {
    mlaserve_core::target_distribution(logits, params.temperature, params.top_k, params.min_p, params.top_p)
}

/// What the backend needs to sample the token at sequence index `position` of a
/// non-greedy request from flattened row `row`: its parameters and its uniform.
pub fn sample_row(row: u32, params: &SamplingParams, seed: u64, position: u64) -> SampleRow {
    SampleRow {
        row,
        temperature: params.temperature,
        top_k: params.top_k,
        top_p: params.top_p,
        min_p: params.min_p,
        u: uniform(seed, position, Purpose::Sample),
    }
}

/// The target token for a logits row: argmax when greedy, else a draw with the
/// request's uniform for `position` (the index the chosen token will have in the
/// sequence) — on the host, what a backend returns for [`sample_row`].
pub fn choose_token(logits: &[f32], params: &SamplingParams, seed: u64, position: u64) -> u32 {
    if params.is_greedy() {
        argmax(logits)
    } else {
        sample_row(0, params, seed, position).sample(logits)
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

/// Verification of `drafts` against the target tokens of the window computed by the
/// backend (`ids`, `drafts.len() + 1` of them: the argmax ids of a greedy request, the
/// sampled ids of a sampled one): pushes the emitted tokens to `out` and returns the
/// number of accepted drafts — what [`verify_window_into`] does, without the logits.
pub fn verify_ids_into(ids: &[u32], drafts: &[u32], out: &mut Vec<u32>) -> usize {
    verify_with(drafts, out, |j| ids[j])
}

/// [`verify_ids_into`] for a greedy request (`ids` are the window's argmax tokens).
pub fn verify_greedy_into(ids: &[u32], drafts: &[u32], out: &mut Vec<u32>) -> usize {
    verify_ids_into(ids, drafts, out)
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
