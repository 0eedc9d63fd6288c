//! Per-request sampling parameters, shared by the router (validation) and the engine, and
//! the one sampling rule every backend follows ([`sample_token`]).
//!
//! A sampled token is a pure function of (logits row, temperature, top-k, top-p, u): the
//! engine draws `u` from the request's counter-based RNG for the position, a backend
//! applies the rule where the logits are (the CUDA backend on the device) and returns the
//! token. [`crate::argmax`] is the greedy rule, and the rule's fallback.

use crate::backend::argmax;

/// How a request's tokens are chosen and when it stops.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: u32,
    /// 1 means no nucleus cut.
    pub top_p: f32,
    /// Seed of the request's counter-based RNG; `None` draws one at admission.
    pub seed: Option<u64>,
    pub max_new_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    /// Token-id sequences that end the generation when they appear in the output.
    pub stop_sequences: Vec<Vec<u32>>,
    pub ignore_eos: bool,
    /// Subtracted once from the logit of every token the output already holds (OpenAI's
    /// `presence_penalty`, in `[-2, 2]`; 0: off).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the output (`[-2, 2]`; 0: off).
    pub frequency_penalty: f32,
    /// Divides the positive logits and multiplies the negative ones of every token of the
    /// prompt or the output (HF's and vLLM's `repetition_penalty`, `> 0`; 1: off).
    pub repetition_penalty: f32,
    /// Keeps only the tokens whose probability is at least `min_p` times the most likely
    /// token's (`[0, 1]`; 0: off). Sampled requests only.
    pub min_p: f32,
    /// `(token, bias)` added to the token's logit before the penalties (`bias` in
    /// `[-100, 100]`).
    pub logit_bias: Vec<(u32, f32)>,
    /// Return the log-probability of every generated token and of its `n` most likely
    /// alternatives (`Some(n)`, `n <= MAX_TOP_LOGPROBS`); `None`: none.
    pub logprobs: Option<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            max_new_tokens: 64,
            stop_token_ids: Vec::new(),
            stop_sequences: Vec::new(),
            ignore_eos: false,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            min_p: 0.0,
            logit_bias: Vec::new(),
            logprobs: None,
        }
    }
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// A row of a step whose token the backend samples (`Batch::sample_rows`): the flattened
/// row index, the request's temperature, top-k and top-p, and the uniform `u` the engine
/// drew for the position that row decides. The backend returns [`sample_token`] of the
/// row's logits with these.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleRow {
    pub row: u32,
    /// `> 0` and finite (`Batch::validate` refuses others; greedy rows use `argmax_rows`).
    pub temperature: f32,
    /// 0: no top-k cut.
    pub top_k: u32,
    /// In `(0, 1]`; 1: no nucleus cut.
    pub top_p: f32,
    /// In `[0, 1]`; 0: no min-p cut.
    pub min_p: f32,
    /// In `[0, 1)`.
    pub u: f64,
}

impl SampleRow {
    /// The token this row's logits give under the rule ([`sample_token`]).
    pub fn sample(&self, logits: &[f32]) -> u32 {
        sample_from(&target_distribution(logits, self.temperature, self.top_k, self.min_p, self.top_p), self.u)
    }
}

/// A target distribution: the kept candidates in ascending id order, their probabilities
/// (summing to 1), and the unnormalised weights the draw works on.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetDist {
    pub tokens: Vec<u32>,
    pub probs: Vec<f64>,
    /// `p_i` of step 3 of [`target_distribution`] (the largest candidate's is 1).
    pub weights: Vec<f64>,
    /// `Σ weights`, summed in id order.
    pub mass: f64,
}

impl TargetDist {
    fn one_hot(token: u32) -> Self {
        TargetDist { tokens: vec![token], probs: vec![1.0], weights: vec![1.0], mass: 1.0 }
    }
}

/// The distribution a sampled row draws from. Precisely, for `logits` of length V:
///
/// 1. Candidates: the ids whose logit is not NaN. With none, or when the largest candidate
///    logit `max` is ±∞, the distribution is the one-hot [`argmax`] (lowest id of the
///    largest, NaN never; a row of NaN and −∞ only: its first non-NaN id, else 0).
/// 2. Top-k (`0 < top_k <` candidates): keep the `top_k` first candidates in the order
///    (logit descending in IEEE total order — so +0 above −0 —, id ascending).
/// 3. Weights: `p_i = exp(((l_i − max) as f32 subtraction) as f64 / T)` in f64, with
///    `T = temperature as f64` (1 when the temperature is not a finite value > 0). The
///    largest candidate has `p = 1`.
/// 4. Min-p (`min_p > 0`): keep the candidates with `p_i >= min_p` (the largest, `p = 1`,
///    always stays): probability at least `min_p` times the most likely token's.
/// 5. Top-p (`top_p < 1` and more than one candidate): `Z = Σ p_i`; walk the candidates in
///    the same order as top-k (logit descending, id ascending) summing `p_i`; keep the
///    smallest prefix whose sum is `≥ top_p · Z` (all of them if rounding never gets
///    there) — the prefix whose normalised mass reaches `top_p`.
/// 6. The kept candidates in ascending id order; `probs = p_i / Σ kept p_i`.
///
/// [`sample_from`] then draws by inverse CDF in id order. Two choices keep backends in
/// step: the walk orders by the logit, not by `p_i` (the same order except where rounding
/// gives distinct logits equal weights, `|l − max| ≲ 1e-9·T`, where an order by `p_i`
/// would hang on the last bit of `exp`, which libm and CUDA do not agree on); and sums are
/// of the unnormalised weights, compared with `top_p · Z` and `u · mass` (one rounding
/// each), so rows of equal or integral weights (ties, huge temperatures) are exact on every
/// backend. What is left is summation order: this reference sums in ascending id order
/// (the walk in its own order), a device in another, and `exp` may differ in its last bit.
/// Two backends can therefore pick different tokens only where a cumulative sum lies
/// within rounding (about 1e-11 relative for 2^17 terms summed in order) of `top_p · Z` or
/// of `u · mass`; every comparison of logits is exact.
pub fn target_distribution(logits: &[f32], temperature: f32, top_k: u32, min_p: f32, top_p: f32) -> TargetDist {
    let t = if temperature > 0.0 && temperature.is_finite() { temperature as f64 } else { 1.0 };
    let mut cand: Vec<u32> = (0..logits.len() as u32).filter(|&i| !logits[i as usize].is_nan()).collect();
    let max = cand.iter().map(|&i| logits[i as usize]).fold(f32::NEG_INFINITY, f32::max);
    if cand.is_empty() || !max.is_finite() {
        return TargetDist::one_hot(argmax(logits));
    }
    let by_logit_desc = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let k = top_k as usize;
    if k > 0 && k < cand.len() {
        cand.select_nth_unstable_by(k - 1, by_logit_desc);
        cand.truncate(k);
        cand.sort_unstable();
    }
    let mut weights: Vec<f64> = cand.iter().map(|&i| ((logits[i as usize] - max) as f64 / t).exp()).collect();
    if min_p > 0.0 {
        let keep: Vec<usize> = (0..cand.len()).filter(|&n| weights[n] >= min_p as f64).collect();
        if keep.len() < cand.len() {
            cand = keep.iter().map(|&n| cand[n]).collect();
            weights = keep.iter().map(|&n| weights[n]).collect();
        }
    }
    if top_p < 1.0 && cand.len() > 1 {
        let target = top_p as f64 * weights.iter().sum::<f64>();
        let mut order: Vec<usize> = (0..cand.len()).collect();
        order.sort_unstable_by(|&a, &b| by_logit_desc(&cand[a], &cand[b]));
        let mut cum = 0.0;
        let mut keep = order.len();
        for (n, &o) in order.iter().enumerate() {
            cum += weights[o];
            if cum >= target {
                keep = n + 1;
                break;
            }
        }
        if keep < order.len() {
            // `cand` is in id order, so sorting indices into it restores id order.
            let mut kept = order[..keep].to_vec();
            kept.sort_unstable();
            cand = kept.iter().map(|&o| cand[o]).collect();
            weights = kept.iter().map(|&o| weights[o]).collect();
        }
    }
    let mass: f64 = weights.iter().sum();
    let probs = weights.iter().map(|w| w / mass).collect();
    TargetDist { tokens: cand, probs, weights, mass }
}

/// Inverse-CDF draw from `dist` with uniform `u` in `[0, 1)`: the first token in id order
/// whose cumulative weight exceeds `u · mass`.
pub fn sample_from(dist: &TargetDist, u: f64) -> u32 {
    let limit = u * dist.mass;
    let mut cum = 0.0;
    for (&tok, &w) in dist.tokens.iter().zip(&dist.weights) {
        cum += w;
        if limit < cum {
            return tok;
        }
    }
    // Rounding left the limit above the last partial sum: the last token with weight.
    let last = dist.weights.iter().rposition(|&w| w > 0.0).unwrap_or(0);
    dist.tokens.get(last).copied().unwrap_or(0)
}

/// The sampling rule: [`target_distribution`], then [`sample_from`] with `u`. Every
/// backend's `Batch::sample_rows` answer is this token of the row's logits.
pub fn sample_token(logits: &[f32], temperature: f32, top_k: u32, top_p: f32, u: f64) -> u32 {
    sample_from(&target_distribution(logits, temperature, top_k, 0.0, top_p), u)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_and_edges() {
        let logits = [0.0f32, 2.0, 1.0, 3.0, f32::NAN];
        let d = target_distribution(&logits, 1.0, 0, 0.0, 1.0);
        assert_eq!(d.tokens, vec![0, 1, 2, 3]);
        assert!((d.probs.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert_eq!(target_distribution(&logits, 1.0, 2, 0.0, 1.0).tokens, vec![1, 3]);
        assert_eq!(target_distribution(&logits, 1.0, 0, 0.0, 0.5).tokens, vec![3]);
        assert_eq!(target_distribution(&logits, 1.0, 0, 0.0, 0.8).tokens, vec![1, 3]);
        // Ties: top-k takes the lowest ids among equal logits, +0 ranks above -0.
        assert_eq!(target_distribution(&[1.0, 5.0, 5.0, 5.0], 1.0, 2, 0.0, 1.0).tokens, vec![1, 2]);
        assert_eq!(target_distribution(&[-0.0, 0.0, -0.0], 1.0, 1, 0.0, 1.0).tokens, vec![1]);
        // A huge temperature makes every probability 1.0: the nucleus still follows the
        // logits (ids 3 and 1 carry the two largest), not the ids.
        assert_eq!(target_distribution(&[0.0, 2.0, 1.0, 3.0], 1e30, 0, 0.0, 0.5).tokens, vec![1, 3]);
        // Fallbacks: the argmax rule.
        for (row, want) in [
            (vec![f32::NAN, f32::NAN], 0),
            (vec![f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY], 1),
            (vec![1.0, f32::INFINITY, f32::NAN, f32::INFINITY], 1),
        ] {
            assert_eq!(target_distribution(&row, 1.0, 0, 0.0, 0.9), TargetDist::one_hot(want));
        }
        // -inf candidates carry no mass and are never drawn.
        let row = [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY];
        for u in [0.0, 0.5, 0.999_999] {
            assert_eq!(sample_token(&row, 1.0, 0, 1.0, u), 1);
        }
    }

    #[test]
    fn min_p_keeps_the_tokens_at_least_min_p_as_likely_as_the_best() {
        // Weights e^0, e^-1, e^-2, e^-3 relative to the best (id 1).
        let row = [2.0f32, 3.0, 1.0, 0.0];
        let e = |x: f64| x.exp();
        for (min_p, want) in
            [(0.0, vec![0, 1, 2, 3]), (e(-1.0) as f32 * 0.999, vec![0, 1]), (e(-2.5) as f32, vec![0, 1, 2])]
        {
            assert_eq!(target_distribution(&row, 1.0, 0, min_p, 1.0).tokens, want, "min_p {min_p}");
        }
        assert_eq!(target_distribution(&row, 1.0, 0, 1.0, 1.0).tokens, vec![1], "min_p 1: the best only");
        // The temperature applies first: at T = 2 the weights are e^-0.5 per step.
        assert_eq!(target_distribution(&row, 2.0, 0, 0.5, 1.0).tokens, vec![0, 1]);
        // Then top-p over what is left: 1 / (1 + e^-0.5) = 0.62 >= 0.6 keeps the best alone.
        assert_eq!(target_distribution(&row, 2.0, 0, 0.5, 0.6).tokens, vec![1]);
    }

    #[test]
    fn inverse_cdf_in_id_order() {
        // Equal logits: four tokens of 1/4 each, chosen by u's quarter.
        let row = [7.0f32; 4];
        for (u, want) in [(0.0, 0), (0.2499, 0), (0.25, 1), (0.74, 2), (0.9999, 3)] {
            assert_eq!(sample_token(&row, 0.7, 0, 1.0, u), want, "u = {u}");
        }
        // top_p 0.5 on four equal tokens keeps exactly the two lowest ids.
        for (u, want) in [(0.0, 0), (0.49, 0), (0.5, 1), (0.99, 1)] {
            assert_eq!(sample_token(&row, 1.0, 0, 0.5, u), want, "u = {u}");
        }
        // A tiny temperature is the argmax.
        assert_eq!(sample_token(&[0.0, 1.0, 0.999], 1e-30, 0, 1.0, 0.99), 1);
        // Twelve tokens tied at the top, the rest without weight: top_p 0.5 keeps exactly
        // six (6 >= 0.5 * 12, exact), where summing 1/12 six times stays below 0.5.
        let mut row = vec![-1e6f32; 16];
        row[2..14].fill(4.0);
        assert_eq!(target_distribution(&row, 1.0, 0, 0.0, 0.5).tokens, (2..8).collect::<Vec<u32>>());
        assert!((0..6).fold(0.0, |c, _| c + 1.0f64 / 12.0) < 0.5, "the normalised walk would take a seventh");
    }
}
