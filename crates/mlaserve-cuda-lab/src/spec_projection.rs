//! What speculation yields at measured step times: with the drafter's conditional
//! acceptance per draft position (`a_j = P(draft j accepted | the drafts before it
//! accepted)`, as `models/*/eval.json` and the engine report it), a request emits
//! `1 + Σ_{j ≤ k} Π_{i ≤ j} a_i` tokens per step with k drafts, so a batch of `b` requests
//! whose step takes `t` emits `b · that / t` tokens a second. Adaptive k chooses by the
//! same quantity (docs/engine.md, "k"); `mlaserve bench step --acceptance` prints it per
//! batch size from the measured steps.

/// Tokens a request emits in a step of `k` drafts (rates past `rates.len()` count as 0).
pub fn expected_tokens(rates: &[f64], k: usize) -> f64 {
    let mut reach = 1.0;
    let mut tokens = 1.0;
    for j in 0..k {
        reach *= rates.get(j).copied().unwrap_or(0.0);
        tokens += reach;
    }
    tokens
}

/// One batch size's projection.
#[derive(Debug, Clone, PartialEq)]
pub struct Projection {
    pub batch: usize,
    /// Per k measured at this batch size: (k, step ms, tokens per step of the batch,
    /// tokens per second).
    pub per_k: Vec<(usize, f64, f64, f64)>,
    /// The k with the most tokens per second.
    pub best: usize,
}

/// Groups `(batch, k, step ms)` measurements by batch size (first appearance order) and
/// projects each k's tokens per second at `rates`.
pub fn project(steps: &[(usize, usize, f64)], rates: &[f64]) -> Vec<Projection> {
    let mut out: Vec<Projection> = Vec::new();
    for &(batch, k, ms) in steps {
        let tokens = batch as f64 * expected_tokens(rates, k);
        let row = (k, ms, tokens, tokens / ms * 1e3);
        match out.iter_mut().find(|p| p.batch == batch) {
            Some(p) => p.per_k.push(row),
            None => out.push(Projection { batch, per_k: vec![row], best: k }),
        }
    }
    for p in &mut out {
        p.best = p.per_k.iter().max_by(|a, b| a.3.total_cmp(&b.3)).map_or(0, |r| r.0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_per_step_follow_the_conditional_rates() {
        let r = [0.9, 0.8, 0.5];
        assert_eq!(expected_tokens(&r, 0), 1.0);
        assert!((expected_tokens(&r, 1) - 1.9).abs() < 1e-12);
        assert!((expected_tokens(&r, 2) - (1.9 + 0.72)).abs() < 1e-12);
        assert!((expected_tokens(&r, 3) - (1.9 + 0.72 + 0.36)).abs() < 1e-12);
        assert_eq!(expected_tokens(&r[..1], 3), expected_tokens(&r, 1), "missing rates are 0");
    }

    #[test]
    fn the_best_k_has_the_most_tokens_per_second() {
        let r = [0.9, 0.9, 0.9];
        // Batch 1: drafts nearly free (k = 3 wins); batch 64: a window of 4 costs 4× (k = 0).
        let steps = [(1, 0, 10.0), (1, 3, 11.0), (64, 0, 30.0), (64, 3, 120.0)];
        let p = project(&steps, &r);
        assert_eq!((p[0].batch, p[0].best, p[1].batch, p[1].best), (1, 3, 64, 0));
        assert!((p[0].per_k[1].3 - expected_tokens(&r, 3) / 11.0 * 1e3).abs() < 1e-9);
        assert!((p[1].per_k[0].3 - 64.0 / 30.0 * 1e3).abs() < 1e-9);
    }
}
