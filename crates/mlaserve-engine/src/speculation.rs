//! Adaptive speculation: before each drafting pass the engine picks the next step's k
//! (0 ..= the configured maximum) that maximises the expected tokens per second
//! (docs/engine.md, "k").
//!
//! - **Acceptance** is measured online per draft position, as the conditional rate
//!   `a_j = P(draft j accepted | drafts before j accepted)`: overall (a position's
//!   counts decayed as new drafts come there, so it follows the traffic; its prior the
//!   rate of the position before) and per request (its own counts, shrunk towards the
//!   overall rate while they are few). A request's expected accepted drafts with k
//!   drafts are `Σ_{j<k} Π_{i≤j} a_i`. Each decision draws the overall rates from their
//!   posterior (Thompson sampling). Once enough were seen, the overall rates count only
//!   drafts from MTP layers without holes: a step at k below the layers in use runs
//!   layers `0..k` only (none at k = 0), and the requests in it have holes in the others
//!   for good.
//! - **Cost** is measured per (batch bucket, k): a cycle is the drafting pass that made a
//!   step's k drafts plus that step's schedule, target forward and verification — what
//!   choosing k costs; only cycles without prefill chunks count (a chunk's cost does not
//!   depend on k, and the arrivals would set it). Samples are kept per decode row (the
//!   lower quartile of the last 16: a cycle's noise is stalls, which only add time),
//!   buckets are powers of two of the decode rows. A bucket without samples of some k
//!   takes that k's cost relative to one it measured from the nearest bucket that
//!   measured every k (per-row costs shift with the batch size, their ratios much less).
//! - **Choice**: the first bucket tries each k once, the most drafts first; then the
//!   fewest drafts within [`MARGIN`] of the best `expected tokens / expected cost`, and
//!   the bucket's last choice unless another beats it by the margin — by the rates'
//!   means, not their draws, when the other has fewer drafts (fewer drafts leave holes
//!   in the running requests' MTP layers past them). A neighbour of the choice (k ± 1)
//!   that the bucket never measured is measured at once, and every [`EXPLORE_EVERY`]-th
//!   decision of a bucket the k above the choice (every [`EXPLORE_NEAR_EVERY`]-th while
//!   its expected rate is within [`NEAR`] of the choice's), so its costs stay current. Steps that
//!   captured a CUDA graph give no sample (the engine checks
//!   `Backend::graph_captures`): a capture costs several steps' time, once per shape,
//!   and a k far from the choice would keep such a cost for good.
//!
//! Output never depends on k: verification accepts only what the target would have
//! emitted.

use crate::api::{SpecStats, MAX_SPECULATIVE_TOKENS as KMAX};

/// Samples kept per (bucket, k); the estimate is their lower quartile: a cycle's work is
/// the same from one to the next, and its noise is stalls (the host, other processes),
/// which only add time. On one H100 some cycles took 10-20 ms where most took 2-3, and on
/// a TP-2 group the median of the last 8 put k = 2 below k = 0 at one row.
const KEEP: usize = 16;
/// Every this many decisions of a bucket, one re-measures the k above the choice.
const EXPLORE_EVERY: u64 = 100;
/// While the k above the choice is within [`NEAR`] of it (by the rates' means), every
/// this many decisions re-measure it: its cost moves with the batch and the contexts, and
/// a cost measured 100 decisions ago kept a TP-2 group at k = 2 at 256 streams where
/// k = 3 served the most (A/B in two calls on two H100s, one GPU and TP 2: 0.94–1.19×
/// the tokens/s of every 100th, 1.03× and 1.025× on the geometric mean).
const EXPLORE_NEAR_EVERY: u64 = 20;
/// How close "near" is: twice the margin more drafts must beat fewer by.
const NEAR: f64 = 2.0 * MARGIN;
/// Per-step decay of the overall acceptance counts (a half-life of ~700 steps).
const DECAY: f64 = 0.999;
/// The draws of a rate spread at most as a posterior of this many drafts would: wider
/// draws (a rate not measured lately) explored so often on the CPU that they cost 5% at
/// 4 streams; the periodic measurements re-measure such a rate anyway.
const MIN_SPREAD_COUNT: f64 = 30.0;
/// More drafts are chosen only when their expected rate beats fewer drafts' by this
/// fraction: measured costs are noisy, and near the break-even point the CPU served
/// 0.93× k = 0 at 4 streams choosing k = 1 four times in ten (costs drafting adds outside
/// the cycle, such as prompt rows through the MTP layers, are not in the samples).
const MARGIN: f64 = 0.05;
/// Drafts of whole caches (at the first position, decayed) from which the rates count
/// only those.
const WHOLE_ENOUGH: f64 = 20.0;
/// Drafts of whole layers (decayed) at the position past the choice below which a step
/// that can offer one drafts there too.
const PROBE_DRAFTS: f64 = 30.0;
/// Weight, in drafts, of a position's prior rate (the rate of the position before).
const PRIOR_DRAFTS: f64 = 2.0;
/// Weight, in observations, of the overall rate in a request's own estimate.
const PRIOR: f64 = 4.0;

/// Recent cost samples of one (bucket, k), in microseconds per decode row.
#[derive(Debug, Clone, Copy, Default)]
struct Costs {
    samples: [f64; KEEP],
    len: usize,
    next: usize,
}

impl Costs {
    fn push(&mut self, v: f64) {
        self.samples[self.next] = v;
        self.next = (self.next + 1) % KEEP;
        self.len = (self.len + 1).min(KEEP);
    }

    fn estimate(&self) -> f64 {
        let mut s = self.samples;
        let s = &mut s[..self.len];
        s.sort_by(f64::total_cmp);
        s[(s.len() - 1) / 4]
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    per_k: [Costs; KMAX + 1],
    decisions: u64,
    /// The choices made in this bucket, per k (explorations and probes included).
    chosen: [u64; KMAX + 1],
    /// The bucket's last choice (not counting explorations).
    current: Option<usize>,
}

/// A request's own draft counts: per position, offered (every earlier draft accepted)
/// and accepted by the verifier.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Counts<'a> {
    pub offered: &'a [u64; KMAX],
    pub accepted: &'a [u64; KMAX],
    /// Leading draft positions whose MTP layers have no holes for this request.
    pub whole: usize,
}

/// The drafting pass whose step has not finished yet.
#[derive(Debug, Clone, Copy)]
struct Pending {
    k: usize,
    draft_us: f64,
    decode_only: bool,
}

/// Picks each step's k ([`crate::api::Speculation`]).
#[derive(Debug, Clone)]
pub(crate) struct Policy {
    k_max: usize,
    adaptive: bool,
    /// Decayed (offered, accepted) counts per position: `[0]` of requests whose MTP
    /// caches are whole, `[1]` of every request.
    counts: [([f64; KMAX], [f64; KMAX]); 2],
    /// The positions drafts were offered at since the last decision: only their counts
    /// decay at the next one.
    fresh: [bool; KMAX],
    /// State of the draws of the acceptance rates.
    rng: u64,
    buckets: Vec<Bucket>,
    pending: Option<Pending>,
    stats: SpecStats,
    /// Tests ([`crate::Engine::force_k`]): when set, decision i takes `forced[i % len]`
    /// (capped at the maximum).
    pub forced: Vec<usize>,
}

/// `k`, or one more draft as a probe: the position past `k` has few drafts of whole
/// layers behind its rate (`offered`: the whole-layer drafts offered per position; a
/// small k offers it no more, and requests drafted at a small k have holes there for
/// good), and a request whose layers are whole past `k` (`whole` positions) could offer
/// one. At one stream of a TP-2 group the second position's rate rested on a handful of
/// drafts at 0.52, which kept k = 1 chosen where k = 3 served the most.
fn probe(offered: &[f64; KMAX], k: usize, k_max: usize, whole: usize) -> usize {
    if k < k_max && whole > k && offered[k] < PROBE_DRAFTS {
        k + 1
    } else {
        k
    }
}

/// Bucket index of `n` decode rows: `⌈log2 n⌉`.
fn bucket_of(n: usize) -> usize {
    n.max(1).next_power_of_two().trailing_zeros() as usize
}

impl Policy {
    pub fn new(k_max: usize, adaptive: bool) -> Self {
        Policy {
            k_max,
            adaptive: adaptive && k_max > 0,
            counts: [([0.0; KMAX], [0.0; KMAX]); 2],
            fresh: [false; KMAX],
            rng: 0x5eed_5eed,
            buckets: Vec::new(),
            pending: None,
            stats: SpecStats { steps_per_k: vec![0; k_max + 1], ..Default::default() },
            forced: Vec::new(),
        }
    }

    #[cfg(test)]
    fn k_max(&self) -> usize {
        self.k_max
    }

    /// Bucket `b`, created (with those below it) if new.
    fn bucket_mut(&mut self, b: usize) -> &mut Bucket {
        if self.buckets.len() <= b {
            self.buckets.resize(b + 1, Bucket::default());
        }
        &mut self.buckets[b]
    }

    /// What each bucket `f` gives something for, as (the bucket's largest row count, it).
    fn by_bucket<T>(&self, f: impl Fn(&Bucket) -> Option<T>) -> Vec<(usize, T)> {
        self.buckets.iter().enumerate().filter_map(|(i, b)| Some((1 << i, f(b)?))).collect()
    }

    /// The choices so far, with the current cost and acceptance estimates.
    pub fn stats(&self) -> SpecStats {
        let ks = ..=self.k_max;
        let costs = self.by_bucket(|b| {
            b.per_k
                .iter()
                .any(|c| c.len > 0)
                .then(|| b.per_k[ks].iter().map(|c| (c.len > 0).then(|| c.estimate())).collect())
        });
        let decisions = self.by_bucket(|b| b.chosen.iter().any(|&n| n > 0).then(|| b.chosen[ks].to_vec()));
        SpecStats { costs, decisions, rates: self.rates()[..self.k_max].to_vec(), ..self.stats.clone() }
    }

    /// One decode window of `k` drafts, `accepted` of them accepted by the verifier.
    /// `whole`: the drafts before this position came from MTP layers without holes;
    /// later ones came from layers a smaller k (or k = 0) left holes in, and say less
    /// about the drafter's rate (the rates count them only until enough drafts of whole
    /// caches were seen).
    pub fn observe(&mut self, k: usize, accepted: usize, whole: usize) {
        self.stats.realised_accepted += accepted as u64;
        for f in &mut self.fresh[..k.min(accepted + 1)] {
            *f = true;
        }
        for (set, (offered, acc)) in self.counts.iter_mut().enumerate() {
            for j in (0..k.min(accepted + 1)).filter(|&j| set == 1 || j < whole) {
                offered[j] += 1.0;
                acc[j] += (j < accepted) as u64 as f64;
            }
        }
    }

    /// The counts the rates come from: drafts of whole caches once there are
    /// [`WHOLE_ENOUGH`] of them at the first position, else every draft.
    fn counts(&self) -> &([f64; KMAX], [f64; KMAX]) {
        if self.counts[0].0[0] >= WHOLE_ENOUGH {
            &self.counts[0]
        } else {
            &self.counts[1]
        }
    }

    /// The overall conditional acceptance rate of each position: the mean of its
    /// posterior, whose prior is worth [`PRIOR_DRAFTS`] drafts at the rate of the
    /// position before (one in two before the first): a position rarely offered is
    /// expected to accept about as its predecessor does, not one in two.
    pub fn rates(&self) -> [f64; KMAX] {
        let (offered, accepted) = self.counts();
        let mut r = [0.0; KMAX];
        let mut prior = 0.5;
        for j in 0..KMAX {
            r[j] = (accepted[j] + PRIOR_DRAFTS * prior) / (offered[j] + PRIOR_DRAFTS);
            prior = r[j];
        }
        r
    }

    /// A draw of each rate from (a normal approximation of) its posterior: where few
    /// drafts were verified lately the draws spread and now and then favour another k,
    /// which measures it; where many were, they stay close to the mean (Thompson
    /// sampling).
    fn draw_rates(&mut self) -> [f64; KMAX] {
        let mean = self.rates();
        std::array::from_fn(|j| {
            let n = self.counts().0[j];
            let sd = (mean[j] * (1.0 - mean[j]) / (n.max(MIN_SPREAD_COUNT) + 3.0)).sqrt();
            (mean[j] + sd * self.normal()).clamp(0.0, 1.0)
        })
    }

    /// A standard normal variate (Box–Muller over splitmix64).
    fn normal(&mut self) -> f64 {
        let mut u = || {
            self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
            ((crate::rng::mix64(self.rng) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        let (u1, u2) = (u(), u());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Expected accepted drafts of one request with `k` drafts, for every k at once
    /// (`out[k]`), from its own counts shrunk towards `overall`.
    fn expected(overall: &[f64; KMAX], c: Counts, out: &mut [f64; KMAX + 1]) {
        let mut p = 1.0;
        out[0] = 0.0;
        for j in 0..KMAX {
            let a = (c.accepted[j] as f64 + PRIOR * overall[j]) / (c.offered[j] as f64 + PRIOR);
            p *= a;
            out[j + 1] = out[j] + p;
        }
    }

    /// The k of the next step, for the requests that will decode in it (their own draft
    /// counts). Call once per step, before drafting. `measurable`: the step just run
    /// held no prefill chunk, so the next one likely gives a cost sample too; only then
    /// does the policy explore (a k tried in a step that gives no sample is a cost for
    /// nothing, again at every decision of a prefill-heavy stretch).
    pub fn choose<'a>(&mut self, requests: impl Iterator<Item = Counts<'a>>, measurable: bool) -> usize {
        // Decay with new observations only, position by position: a stretch without
        // drafts, or with fewer than some position, keeps the rates the drafter last
        // showed there. (Decaying every position at every step let the rates of
        // positions a small k never offers drift to the prior, which made the small k
        // look better still: at one stream on a GPU the policy settled on k = 1 where
        // k = 3 served the most.)
        let fresh = std::mem::take(&mut self.fresh);
        for (offered, accepted) in self.counts.iter_mut() {
            for j in (0..KMAX).filter(|&j| fresh[j]) {
                offered[j] *= DECAY;
                accepted[j] *= DECAY;
            }
        }
        if !self.adaptive {
            self.stats.steps_per_k[self.k_max] += 1;
            return self.k_max;
        }
        // Expected tokens per k: by the drawn rates (the choice) and by their means (the
        // expectation reported beside what verification accepts).
        let (drawn, mean) = (self.draw_rates(), self.rates());
        let (mut tokens, mut at_mean) = ([0.0; KMAX + 1], [0.0; KMAX + 1]);
        let mut one = [0.0; KMAX + 1];
        let (mut n, mut whole) = (0usize, 0usize);
        for c in requests {
            whole = whole.max(c.whole);
            Self::expected(&drawn, c, &mut one);
            for (t, o) in tokens.iter_mut().zip(&one) {
                *t += 1.0 + o;
            }
            Self::expected(&mean, c, &mut one);
            for (t, o) in at_mean.iter_mut().zip(&one) {
                *t += 1.0 + o;
            }
            n += 1;
        }
        let k = if self.forced.is_empty() {
            self.pick(n, &tokens, &at_mean, whole, measurable)
        } else {
            let i = self.stats.steps_per_k.iter().sum::<u64>() as usize;
            self.forced[i % self.forced.len()].min(self.k_max)
        };
        self.bucket_mut(bucket_of(n)).chosen[k] += 1;
        self.stats.steps_per_k[k] += 1;
        self.stats.expected_accepted += at_mean[k] - n as f64;
        k
    }

    /// The choice for `n` requests whose expected tokens with k drafts are `tokens[k]`
    /// by the drawn rates, `at_mean[k]` by their means; `whole`: the most leading
    /// positions any of them has whole MTP layers for.
    fn pick(
        &mut self,
        n: usize,
        tokens: &[f64; KMAX + 1],
        at_mean: &[f64; KMAX + 1],
        whole: usize,
        measurable: bool,
    ) -> usize {
        let k_max = self.k_max;
        let b = bucket_of(n);
        self.bucket_mut(b);
        let Some(cost) = self.costs(b) else {
            // Nothing to compare with yet: try each k here once, the most drafts first
            // (the requests' MTP caches are still whole, so their drafts measure the
            // drafter's own rate); until a step can measure, none (no drafting is never
            // worse than plain decoding).
            let bucket = &mut self.buckets[b];
            bucket.decisions += 1;
            if !measurable {
                return 0;
            }
            return (0..=k_max).rev().find(|&k| bucket.per_k[k].len == 0).unwrap_or(0);
        };
        let bucket = &mut self.buckets[b];
        bucket.decisions += 1;
        // The fewest drafts within the margin of the best: more drafts must pay clearly.
        let fewest = |tokens: &[f64; KMAX + 1]| {
            let rate = |k: usize| tokens[k] / cost[k];
            let top = (0..=k_max).map(rate).fold(0.0, f64::max);
            (0..=k_max).find(|&k| rate(k) * (1.0 + MARGIN) >= top).unwrap_or(0)
        };
        let rate = |t: &[f64; KMAX + 1], k: usize| t[k] / cost[k];
        let mut best = fewest(tokens);
        // The last choice stays unless another beats it by the margin. Fewer drafts than
        // it leave holes in the running requests' MTP layers past the new k, which lower
        // their deeper drafts' acceptance for the rest of their lives (drafts after a
        // stretch without them see caches with holes): a step down goes by the rates'
        // means, not the draws. (Steps down left requests whose lowered acceptance then
        // kept the smaller k: at one stream on a GPU, k = 1 where k = 3 served the most.)
        if let Some(c) = bucket.current.filter(|&c| c <= k_max) {
            if best < c {
                let down = fewest(at_mean);
                best = if down < c && rate(at_mean, down) > rate(at_mean, c) * (1.0 + MARGIN) { down } else { c };
            } else if rate(tokens, c) * (1.0 + MARGIN) >= rate(tokens, best) {
                best = c;
            }
        }
        bucket.current = Some(best);
        let probed = probe(&self.counts[0].0, best, k_max, whole);
        if !measurable {
            return probed;
        }
        // A neighbour of the best that this bucket never measured is measured now (its
        // cost was borrowed): a wrong borrowed cost is corrected within a few steps.
        let near = [best.checked_sub(1), (best < k_max).then_some(best + 1)];
        if let Some(k) = near.into_iter().flatten().find(|&k| bucket.per_k[k].len == 0) {
            return k;
        }
        // Re-measuring a neighbour: the one above only (one below would leave holes; its
        // cost was measured once above, and a cost model is not needed for the rest);
        // more often while it is near the choice.
        if best < k_max {
            let near = rate(at_mean, best + 1) * (1.0 + NEAR) >= rate(at_mean, best);
            if bucket.decisions.is_multiple_of(if near { EXPLORE_NEAR_EVERY } else { EXPLORE_EVERY }) {
                return best + 1;
            }
        }
        probed
    }

    /// The cost per decode row of each k in bucket `b`: its own samples; for a k it has
    /// none of, the nearest bucket that has samples of every k gives the ratio to a k
    /// measured here (or, with none measured here, its costs as they are). `None` while
    /// no bucket has samples of every k.
    fn costs(&self, b: usize) -> Option<[f64; KMAX + 1]> {
        let ks = 0..=self.k_max;
        let median = |i: usize, k: usize| {
            let c = &self.buckets[i].per_k[k];
            (c.len > 0).then(|| c.estimate().max(1e-9))
        };
        // The nearest bucket that measured every k: `b` itself once it has.
        let complete = |i: usize| ks.clone().all(|k| self.buckets[i].per_k[k].len > 0);
        let r = (0..self.buckets.len()).filter(|&i| complete(i)).min_by_key(|&i| (i.abs_diff(b), i))?;
        let theirs = |k: usize| median(r, k).unwrap_or(1e-9);
        // The k measured most here sets the scale.
        let scale = ks
            .clone()
            .filter(|&k| self.buckets[b].per_k[k].len > 0)
            .max_by_key(|&k| self.buckets[b].per_k[k].len)
            .map_or(1.0, |k| median(b, k).unwrap_or(1e-9) / theirs(k));
        let mut cost = [0.0; KMAX + 1];
        for k in ks {
            cost[k] = median(b, k).unwrap_or_else(|| (theirs(k) * scale).max(1e-9));
        }
        Some(cost)
    }

    /// The drafting pass for a step of `k` drafts took `us` (0 when k = 0: none ran).
    /// `decode_only`: the step it drafted after held no prefill chunk (whose rows the
    /// MTP layers also run over).
    pub fn drafted(&mut self, k: usize, us: u64, decode_only: bool) {
        self.pending = Some(Pending { k, draft_us: us as f64, decode_only });
    }

    /// A step whose `n` decode windows held `k` drafts spent `us` in scheduling, the
    /// target forward and verification: with its drafting pass, one cost sample — when
    /// neither held a prefill chunk. (A chunk's cost does not depend on k; divided by
    /// the decode rows it would make a bucket's per-row costs depend on the arrivals.)
    pub fn stepped(&mut self, k: usize, n: usize, us: u64, decode_only: bool) {
        let Some(p) = self.pending.take() else { return };
        if !self.adaptive || n == 0 || p.k != k || !p.decode_only || !decode_only {
            return;
        }
        self.bucket_mut(bucket_of(n)).per_k[k].push((p.draft_us + us as f64) / n as f64);
    }

    /// Whether the choice is the policy's (not a fixed k).
    pub fn is_adaptive(&self) -> bool {
        self.adaptive
    }

    /// Cost samples of `k` kept in the bucket of `n` decode rows (at most [`KEEP`]).
    pub fn samples(&self, n: usize, k: usize) -> usize {
        self.buckets.get(bucket_of(n)).map_or(0, |b| b.per_k[k].len)
    }

    /// Samples a calibration takes of each (bucket, k) it measures: enough for a lower
    /// quartile, and few enough that serving replaces them soon.
    pub const CALIBRATION_SAMPLES: usize = KEEP / 2;

    /// Ends a start-up calibration ([`crate::Engine::calibrate`]): its cost samples stay,
    /// everything else it did is forgotten — the decisions and their statistics, the
    /// acceptance of its throwaway requests, the forced choices.
    pub fn end_calibration(&mut self) {
        let costs: Vec<[Costs; KMAX + 1]> = self.buckets.iter().map(|b| b.per_k).collect();
        *self = Policy::new(self.k_max, self.adaptive);
        self.buckets = costs.into_iter().map(|per_k| Bucket { per_k, ..Bucket::default() }).collect();
    }

    /// The cost (µs per decode row) of `k` measured in `n` decode rows' own bucket.
    #[cfg(test)]
    fn cost_per_row(&self, n: usize, k: usize) -> Option<f64> {
        let c = self.buckets.get(bucket_of(n))?.per_k.get(k)?;
        (c.len > 0).then(|| c.estimate())
    }
}

/// The adaptive policy driven from outside an engine, over steps whose requests draft
/// from whole MTP layers and have no counts of their own (every request expects the
/// overall rates): `mlaserve bench step --adaptive` runs it over measured steps at
/// DeepSeek-V3's widths with a given acceptance. Per cycle: [`AdaptiveK::choose`], run
/// the step, [`AdaptiveK::cycle`] with its times, [`AdaptiveK::observe`] per request.
#[derive(Debug, Clone)]
pub struct AdaptiveK(Policy);

impl AdaptiveK {
    /// Choices in `0..=k_max` (at most [`KMAX`]).
    pub fn new(k_max: usize) -> Self {
        AdaptiveK(Policy::new(k_max.min(KMAX), true))
    }

    /// The k of the next step of `n` requests.
    pub fn choose(&mut self, n: usize) -> usize {
        const NONE: [u64; KMAX] = [0; KMAX];
        self.0.choose((0..n).map(|_| Counts { offered: &NONE, accepted: &NONE, whole: KMAX }), true)
    }

    /// The step of `n` decode rows chose `k`: its drafting took `draft_us`, its target
    /// forward and verification `step_us`.
    pub fn cycle(&mut self, k: usize, n: usize, draft_us: u64, step_us: u64) {
        self.0.drafted(k, draft_us, true);
        self.0.stepped(k, n, step_us, true);
    }

    /// One request's window of `k` drafts, `accepted` of them accepted.
    pub fn observe(&mut self, k: usize, accepted: usize) {
        self.0.observe(k, accepted, KMAX);
    }

    /// The choices so far and the estimates behind them.
    pub fn stats(&self) -> SpecStats {
        self.0.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: [u64; KMAX] = [0; KMAX];

    /// Drafts accepted in window `w` of `k` drafts: deterministic, `rate` of the offers at
    /// each position.
    fn accepted(w: usize, k: usize, rate: f64) -> usize {
        let mut a = 0;
        while a < k && (w * 7919 + a * 104_729) % 1000 < (rate * 1000.0) as usize {
            a += 1;
        }
        a
    }

    /// Runs `steps` decisions for `n` requests with acceptance `rate` per position, the
    /// cost of a cycle at k being `cost(k)` µs; returns how often each k was chosen.
    fn run(p: &mut Policy, n: usize, steps: usize, rate: f64, cost: impl Fn(usize) -> f64) -> Vec<u64> {
        let mut chosen = vec![0u64; p.k_max() + 1];
        for step in 0..steps {
            let k = p.choose((0..n).map(|_| Counts { offered: &NONE, accepted: &NONE, whole: KMAX }), true);
            chosen[k] += 1;
            for r in 0..n {
                p.observe(k, accepted(step * n + r, k, rate), k);
            }
            p.drafted(k, 0, true);
            p.stepped(k, n, cost(k) as u64, true);
        }
        chosen
    }

    #[test]
    fn cheap_drafts_and_good_acceptance_choose_the_most_drafts() {
        // A memory-bound step: the window barely costs more, drafts are cheap.
        let mut p = Policy::new(3, true);
        let chosen = run(&mut p, 4, 1000, 0.8, |k| 1000.0 + 50.0 * k as f64);
        assert!(chosen[3] > 900, "{chosen:?}");
    }

    #[test]
    fn a_compute_bound_step_chooses_no_drafts() {
        // Cost in proportion to the tokens: a window of 1 + k costs 1 + k rows.
        let mut p = Policy::new(3, true);
        let chosen = run(&mut p, 64, 1000, 0.7, |k| 64.0 * 100.0 * (1 + k) as f64);
        assert!(chosen[0] > 900, "{chosen:?}");
        // Exploration of the others stays rare.
        assert!(chosen[1] + chosen[2] + chosen[3] < 1000 / EXPLORE_EVERY + 8, "{chosen:?}");
    }

    #[test]
    fn poor_acceptance_turns_drafting_off_and_good_acceptance_on() {
        let cost = |k: usize| 1000.0 + 300.0 * k as f64;
        let mut p = Policy::new(3, true);
        let chosen = run(&mut p, 8, 600, 0.05, cost);
        assert!(chosen[0] > 500, "rarely accepted drafts are not worth 30% a draft: {chosen:?}");
        let mut p = Policy::new(3, true);
        let chosen = run(&mut p, 8, 600, 0.9, cost);
        assert!(chosen[3] > 500, "drafts accepted 9 in 10 are: {chosen:?}");
    }

    #[test]
    fn the_middle_k_wins_when_it_should() {
        // Acceptance 0.9, a third draft dearer than the others (a chained stage): k = 1
        // gives 1.9 tokens for 1.2, k = 2 2.71 for 1.4, k = 3 3.44 for 2.4 (per unit):
        // 1.58, 1.94, 1.43 — k = 2.
        let mut p = Policy::new(3, true);
        let cost = [1000.0, 1200.0, 1400.0, 2400.0];
        let chosen = run(&mut p, 16, 1000, 0.9, |k| cost[k]);
        assert!(chosen[2] > 900, "{chosen:?}");
    }

    /// Every k within 3% of the others, k = 3 the best (a GPU at 256 rows): a step up
    /// follows the rates' draws, a step down needs the margin by their means, so the
    /// choice settles on k = 3 and stays there, not on the fewest drafts within the
    /// margin.
    #[test]
    fn a_near_tie_settles_on_the_most_drafts() {
        // Acceptance 0.9: 1, 1.9, 2.71, 3.44 tokens at k = 0..3; per µs 0.970, 0.970,
        // 0.975 and 1.0 (in thousandths).
        let cost = [1000.0 / 0.97, 1900.0 / 0.97, 2710.0 / 0.975, 3440.0];
        let mut p = Policy::new(3, true);
        let chosen = run(&mut p, 16, 1000, 0.9, |k| cost[k]);
        assert!(chosen[3] > 950, "{chosen:?}");
    }

    /// The decisions are counted per bucket of decode rows, every one of them.
    #[test]
    fn decisions_are_counted_per_row_bucket() {
        let mut p = Policy::new(3, true);
        run(&mut p, 3, 50, 0.8, |k| 1000.0 + 50.0 * k as f64);
        run(&mut p, 16, 70, 0.8, |k| 1000.0 + 50.0 * k as f64);
        let d = p.stats().decisions;
        assert_eq!(d.iter().map(|(rows, _)| *rows).collect::<Vec<_>>(), vec![4, 16]);
        assert_eq!(d.iter().map(|(_, per_k)| per_k.iter().sum::<u64>()).collect::<Vec<_>>(), vec![50, 70]);
        let total: Vec<u64> = (0..=3).map(|k| d.iter().map(|(_, per_k)| per_k[k]).sum()).collect();
        assert_eq!(total, p.stats().steps_per_k);
        // A fixed k counts none.
        let mut fixed = Policy::new(3, false);
        run(&mut fixed, 4, 10, 0.8, |_| 1000.0);
        assert!(fixed.stats().decisions.is_empty());
    }

    /// A fixed cost per step plus a cost per token (the CPU): drafts pay at one row and
    /// not at sixteen. The policy meets one row first; its per-row costs there must not
    /// make k = 0 look dear at sixteen.
    #[test]
    fn costs_borrowed_from_another_batch_size_keep_their_ratios() {
        let mut p = Policy::new(3, true);
        // Acceptance 0.6: at one row k = 1 gives 1.6 tokens for 700, k = 2 1.96 for 800
        // and k = 3 2.18 for 900 against 1 for 600; at sixteen k = 0 gives 16 for 2,100, k = 1 25.6 for
        // 3,700 (9% fewer a second).
        let cost = |n: usize, k: usize| 500.0 + 100.0 * (n * (1 + k)) as f64;
        let one = run(&mut p, 1, 200, 0.6, |k| cost(1, k));
        assert!(one[0] <= 20, "one row drafts: {one:?}");
        let sixteen = run(&mut p, 16, 600, 0.6, |k| cost(16, k));
        assert!(sixteen[0] > 560, "sixteen rows: {sixteen:?}");
    }

    /// A stretch at k = 1 offers no second or third draft: those positions keep the
    /// rates last measured there instead of drifting to the prior, and a position never
    /// offered is expected to accept as the one before it.
    #[test]
    fn positions_a_small_k_never_offers_keep_their_rates() {
        let mut p = Policy::new(3, true);
        p.forced = vec![1];
        run(&mut p, 1, 500, 0.9, |_| 1000.0);
        let r = p.rates();
        assert!((r[0] - 0.9).abs() < 0.05 && (r[1] - r[0]).abs() < 1e-12, "{r:?}");
        p.forced = vec![3];
        run(&mut p, 1, 500, 0.9, |_| 1000.0);
        let before = p.rates();
        p.forced = vec![1];
        run(&mut p, 1, 6000, 0.9, |_| 1000.0);
        let after = p.rates();
        for j in 1..3 {
            // (Their prior, the first position's rate, still moves a little.)
            assert!((after[j] - before[j]).abs() < 0.01, "position {}: {before:?} -> {after:?}", j + 1);
            assert!(after[j] > 0.85, "{after:?}");
        }
    }

    /// Drafts from MTP layers a smaller k left holes in are accepted less; once enough
    /// drafts of whole layers were seen, they do not lower the drafter's rate.
    #[test]
    fn drafts_from_layers_with_holes_do_not_set_the_rates() {
        let mut p = Policy::new(3, true);
        for _ in 0..100 {
            p.choose(std::iter::empty(), true);
            p.observe(3, 3, 3);
        }
        let before = p.rates();
        assert!(before.iter().all(|&r| r > 0.95), "{before:?}");
        for _ in 0..500 {
            p.choose(std::iter::empty(), true);
            // The first draft from a whole layer 0, the second from a layer 1 with holes.
            p.observe(3, 1, 1);
        }
        let after = p.rates();
        assert!(after[1] > 0.95 && after[2] > 0.95, "{before:?} -> {after:?}");
        assert!(after[0] > 0.95, "{after:?}");
    }

    /// Once k = 3 is the choice, no step takes fewer drafts: fewer would leave holes in
    /// the running requests' deeper MTP layers. (Exploration re-measures the k above the
    /// choice only; the ones below were measured once, at the start.)
    #[test]
    fn the_choice_never_explores_below_itself() {
        let mut p = Policy::new(3, true);
        // Acceptance 0.9: 3.44 tokens for 1,780 against 2.71 for 1,500 (7% more a µs).
        let cost = [1000.0, 1200.0, 1500.0, 1780.0];
        let mut below = 0;
        for round in 0..20 {
            let chosen = run(&mut p, 1, 100, 0.9, |k| cost[k]);
            if round > 0 {
                below += chosen[0] + chosen[1] + chosen[2];
            }
        }
        assert_eq!(below, 0, "steps below k = 3 after the first 100 decisions");
    }

    /// The k above the choice grows cheaper (at 256 streams of a TP-2 group the choice
    /// stayed at k = 2 while k = 3's cost, re-measured every 100 decisions, was stale).
    /// A k within [`NEAR`] of the choice is re-measured every [`EXPLORE_NEAR_EVERY`]
    /// decisions, and the choice follows within 100 decisions (re-measuring every
    /// [`EXPLORE_EVERY`], it still had not after 200); a k near but dearer costs a step in 20.
    #[test]
    fn a_near_k_above_is_re_measured_often_enough_to_follow_its_cost() {
        // Acceptance 0.9: k = 2 gives 2.71 tokens, k = 3 3.44. Phase 1: k = 3 costs 1,900
        // against 1,400 (7% fewer tokens a µs: near, not chosen); phase 2: 1,650 (8% more).
        let cost = |k: usize, late: bool| [1000.0, 1200.0, 1400.0, if late { 1650.0 } else { 1900.0 }][k];
        let mut p = Policy::new(3, true);
        let early = run(&mut p, 8, 300, 0.9, |k| cost(k, false));
        run(&mut p, 8, 100, 0.9, |k| cost(k, true));
        let late = run(&mut p, 8, 100, 0.9, |k| cost(k, true));
        assert!(early[2] > 250 && early[3] < 300 / EXPLORE_NEAR_EVERY + 8, "phase 1: {early:?}");
        assert!(late[3] > 90, "100 decisions after k = 3 grew cheaper: {late:?}");
    }

    #[test]
    fn a_scarce_rate_past_the_choice_is_probed_where_a_request_can_offer_it() {
        let mut offered = [100.0, 2.0, 0.0, 0.0];
        assert_eq!(probe(&offered, 1, 3, KMAX), 2, "two drafts behind the second position's rate");
        assert_eq!(probe(&offered, 1, 3, 1), 1, "no request is whole past the first position");
        assert_eq!(probe(&offered, 3, 3, KMAX), 3, "the most drafts already");
        offered[1] = 40.0;
        assert_eq!(probe(&offered, 1, 3, KMAX), 1, "enough drafts there");
    }

    #[test]
    fn a_request_with_its_own_poor_acceptance_lowers_the_expectation() {
        let overall = [0.8; KMAX];
        let mut good = [0.0; KMAX + 1];
        let mut bad = [0.0; KMAX + 1];
        Policy::expected(&overall, Counts { offered: &NONE, accepted: &NONE, whole: KMAX }, &mut good);
        Policy::expected(&overall, Counts { offered: &[100, 5, 1, 0], accepted: &[5, 1, 0, 0], whole: KMAX }, &mut bad);
        assert!((good[1] - 0.8).abs() < 1e-12 && (good[2] - (0.8 + 0.64)).abs() < 1e-12, "{good:?}");
        assert!(bad[3] < 0.2, "{bad:?}");
    }

    #[test]
    fn fixed_always_takes_the_maximum_and_costs_follow_the_bucket() {
        let mut p = Policy::new(2, false);
        let chosen = run(&mut p, 4, 10, 0.0, |_| 1.0);
        assert_eq!(chosen, vec![0, 0, 10]);
        let mut p = Policy::new(3, true);
        run(&mut p, 5, 40, 0.5, |k| 500.0 * (1 + k) as f64);
        assert_eq!(p.cost_per_row(8, 0), Some(100.0), "5 rows: bucket 8, 500 µs / 5 rows");
        assert_eq!(p.cost_per_row(4, 0), None);
        assert_eq!(bucket_of(1), 0);
        assert_eq!(bucket_of(2), 1);
        assert_eq!(bucket_of(3), 2);
        assert_eq!(bucket_of(256), 8);
    }

    #[test]
    fn the_facade_drives_the_same_policy() {
        // As `bench step --adaptive` drives it: the middle k of the test above wins.
        let cost = [1000.0, 1200.0, 1400.0, 2400.0];
        let mut a = AdaptiveK::new(3);
        let mut chosen = [0u64; 4];
        for step in 0..1000usize {
            let k = a.choose(16);
            chosen[k] += 1;
            a.cycle(k, 16, 0, (cost[k] * 16.0) as u64);
            for r in 0..16 {
                a.observe(k, accepted(step * 16 + r, k, 0.9));
            }
        }
        assert!(chosen[2] > 900, "{chosen:?}");
        let s = a.stats();
        assert_eq!(s.steps_per_k.iter().sum::<u64>(), 1000);
        assert!((s.rates[0] - 0.9).abs() < 0.05, "{:?}", s.rates);
    }
}
