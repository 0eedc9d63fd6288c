//! What speculation yields at measured step times: with the drafter's conditional
//! acceptance per draft position (`a_j = P(draft j accepted | the drafts before it
//! accepted)`, as `models/*/eval.json` and the engine report it), a request emits
//! `1 + Σ_{j ≤ k} Π_{i ≤ j} a_i` tokens per step with k drafts, so a batch of `b` requests
//! whose step takes `t` emits `b · that / t` tokens a second. Adaptive k chooses by the
//! same quantity (docs/engine.md, "k"); `mlaserve bench step --acceptance` prints it per
//! batch size from the measured steps.
//!
//! [`run_adaptive`] runs the engine's own adaptive policy ([`AdaptiveK`]) over steps a
//! caller times (`bench step --adaptive`: real steps at V3's widths), each request's
//! accepted drafts drawn at the given rates: the k it chooses and the tokens per second
//! it reaches, beside what the fixed k's projections promise.

use mlaserve_engine::AdaptiveK;

use crate::rng::Rng;

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

/// What the adaptive policy did over one batch size's cycles.
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveRun {
    pub batch: usize,
    /// Decisions per k (index = k).
    pub decisions: Vec<u64>,
    /// Tokens emitted: per request and step, 1 + its accepted drafts.
    pub tokens: f64,
    /// The cycles' measured time (target forward + drafting), ms.
    pub ms: f64,
}

impl AdaptiveRun {
    /// Measured tokens per second.
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens / self.ms * 1e3
    }

    /// Tokens per second its decisions would give at the fixed sweep's step times and the
    /// expected acceptance (`None` if the sweep lacks a k it chose).
    pub fn projected(&self, p: &Projection, rates: &[f64]) -> Option<f64> {
        let (mut tokens, mut ms) = (0.0, 0.0);
        for (k, &n) in self.decisions.iter().enumerate().filter(|(_, &n)| n > 0) {
            let step = p.per_k.iter().find(|r| r.0 == k)?.1;
            tokens += n as f64 * self.batch as f64 * expected_tokens(rates, k);
            ms += n as f64 * step;
        }
        Some(tokens / ms * 1e3)
    }
}

/// `cycles` decode steps of `batch` requests, each step's k chosen by the engine's
/// adaptive policy (at most `k_max`), run and timed by `step(k) -> (target ms, draft
/// ms)`; each request's drafts accepted position by position at `rates` (conditional;
/// positions past `rates.len()` never), drawn from `seed`.
pub fn run_adaptive<E>(
    batch: usize,
    k_max: usize,
    rates: &[f64],
    cycles: usize,
    seed: u64,
    mut step: impl FnMut(usize) -> Result<(f64, f64), E>,
) -> Result<AdaptiveRun, E> {
    let mut policy = AdaptiveK::new(k_max);
    let mut rng = Rng::new(seed);
    let mut run = AdaptiveRun { batch, decisions: vec![0; k_max + 1], tokens: 0.0, ms: 0.0 };
    for _ in 0..cycles {
        let k = policy.choose(batch);
        run.decisions[k] += 1;
        let (target, draft) = step(k)?;
        run.ms += target + draft;
        policy.cycle(k, batch, (draft * 1e3) as u64, (target * 1e3) as u64);
        for _ in 0..batch {
            let mut a = 0;
            while a < k && (rng.f32() as f64) < rates.get(a).copied().unwrap_or(0.0) {
                a += 1;
            }
            policy.observe(k, a);
            run.tokens += 1.0 + a as f64;
        }
    }
    Ok(run)
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

    #[test]
    fn the_adaptive_run_follows_the_step_times() {
        let r = [0.9, 0.93, 0.91];
        // Drafts nearly free: k = 3; a window of 4 costing 4 of 1: k = 0.
        let cheap = |k: usize| Ok::<_, ()>((10.0 + 0.5 * k as f64, 0.2 * k as f64));
        let run = run_adaptive(8, 3, &r, 400, 1, cheap).unwrap();
        assert!(run.decisions[3] > 350, "{:?}", run.decisions);
        let dear = |k: usize| Ok::<_, ()>((10.0 * (1 + k) as f64, 2.0 * k as f64));
        let run = run_adaptive(64, 3, &r, 400, 1, dear).unwrap();
        assert!(run.decisions[0] > 350, "{:?}", run.decisions);
        // Measured = tokens over the cycles' times; projected at a sweep of the same times.
        let steps: Vec<_> = (0..=3).map(|k| (64, k, dear(k).unwrap().0 + dear(k).unwrap().1)).collect();
        let p = &project(&steps, &r)[0];
        let (m, q) = (run.tokens_per_s(), run.projected(p, &r).unwrap());
        assert!((m / q - 1.0).abs() < 0.05, "measured {m} vs projected {q}");
        assert!(run_adaptive(4, 3, &r, 10, 1, |_| Err::<(f64, f64), _>("stop")).is_err());
    }
}
