//! Feed-forward blocks: the dense SwiGLU MLP and DeepSeekMoE (router + routed experts +
//! shared experts), with every routing variant the config names (`topk_method`, `scoring_func`, groups).
//!
//! Under tensor parallelism each rank holds a slice of every expert's intermediate
//! dimension; the router is replicated so all ranks pick the same experts, and the
//! caller all-reduces the partial outputs once per layer.

use crate::fp8::{load_linear, Fp8Act};
use crate::ops::{silu_mul, Linear};
use mlaserve_core::config::Arch;
use mlaserve_core::{MoeConfig, Result, ScoringFunc, TopkMethod};
use mlaserve_model::{names, Shard, Weights};

/// SwiGLU MLP: `down(silu(gate x) * up x)`; gate/up split by output, down by input.
#[derive(Debug)]
pub struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Mlp {
    pub fn load(w: &Weights, prefix: &str, hidden: usize, inter: usize, rank: usize, world: usize) -> Result<Self> {
        Self::load_with(w, prefix, hidden, inter, rank, world, Fp8Act::F32)
    }

    /// [`Mlp::load`]; `fp8_act` says whether fp8 weights quantise their activations.
    pub fn load_with(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        inter: usize,
        rank: usize,
        world: usize,
        fp8_act: Fp8Act,
    ) -> Result<Self> {
        let col = Some(Shard::new(0, rank, world));
        let row = Some(Shard::new(1, rank, world));
        let lin = |p: &str, full: [usize; 2], s| load_linear(w, &format!("{prefix}.{p}.weight"), full, s, fp8_act);
        Ok(Mlp {
            gate: lin("gate_proj", [inter, hidden], col)?,
            up: lin("up_proj", [inter, hidden], col)?,
            down: lin("down_proj", [hidden, inter], row)?,
        })
    }

    /// `x` is `[n, hidden]`; returns this rank's partial `[n, hidden]`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let g = self.gate.forward(x);
        let u = self.up.forward(x);
        self.down.forward(&silu_mul(&g, &u))
    }
}

/// The router's decision for one token: expert ids and their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Picks experts for one token from its gate logits.
pub fn route(cfg: &MoeConfig, arch: Arch, logits: &[f32], bias: Option<&[f32]>) -> Route {
    let n = logits.len();
    let scores: Vec<f32> = match cfg.scoring_func {
        ScoringFunc::Sigmoid => logits.iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect(),
        ScoringFunc::Softmax => {
            let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let e: Vec<f32> = logits.iter().map(|x| (x - m).exp()).collect();
            let s: f32 = e.iter().sum();
            e.iter().map(|x| x / s).collect()
        }
    };
    // Scores used for the choice (bias added for noaux_tc only); weights use `scores`.
    let choice: Vec<f32> = match (cfg.topk_method, bias) {
        (TopkMethod::NoauxTc, Some(b)) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
        _ => scores.clone(),
    };
    let per_group = n / cfg.n_group;
    let allowed: Vec<bool> = match cfg.topk_method {
        TopkMethod::Greedy => vec![true; n],
        TopkMethod::GroupLimitedGreedy | TopkMethod::NoauxTc => {
            let group_score: Vec<f32> = (0..cfg.n_group)
                .map(|g| {
                    let grp = &choice[g * per_group..(g + 1) * per_group];
                    if cfg.topk_method == TopkMethod::NoauxTc {
                        top_k_indices(grp, 2).iter().map(|&i| grp[i]).sum()
                    } else {
                        grp.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
                    }
                })
                .collect();
            let keep = top_k_indices(&group_score, cfg.topk_group);
            (0..n).map(|e| keep.contains(&(e / per_group))).collect()
        }
    };
    let masked: Vec<f32> =
        choice.iter().zip(&allowed).map(|(&c, &ok)| if ok { c } else { f32::NEG_INFINITY }).collect();
    let experts = top_k_indices(&masked, cfg.num_experts_per_tok);
    let mut weights: Vec<f32> = experts.iter().map(|&e| scores[e]).collect();
    let normalise = cfg.norm_topk_prob && (arch == Arch::DeepseekV3 || cfg.num_experts_per_tok > 1);
    if normalise {
        let s: f32 = weights.iter().sum::<f32>() + 1e-20;
        weights.iter_mut().for_each(|w| *w /= s);
    }
    let f = cfg.routed_scaling_factor as f32;
    weights.iter_mut().for_each(|w| *w *= f);
    Route { experts, weights }
}

/// Indices of the `k` largest values, largest first; ties go to the lower index.
fn top_k_indices(x: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].partial_cmp(&x[a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// A DeepSeekMoE layer.
#[derive(Debug)]
pub struct Moe {
    cfg: MoeConfig,
    arch: Arch,
    gate: Linear,
    bias: Option<Vec<f32>>,
    experts: Vec<Mlp>,
    shared: Option<Mlp>,
}

impl Moe {
    pub fn load(
        w: &Weights,
        cfg: &MoeConfig,
        arch: Arch,
        layer: usize,
        hidden: usize,
        rank: usize,
        world: usize,
    ) -> Result<Self> {
        Self::load_with(w, cfg, arch, layer, hidden, rank, world, Fp8Act::F32)
    }

    /// [`Moe::load`]; `fp8_act` says whether fp8 weights quantise their activations.
    pub fn load_with(
        w: &Weights,
        cfg: &MoeConfig,
        arch: Arch,
        layer: usize,
        hidden: usize,
        rank: usize,
        world: usize,
        fp8_act: Fp8Act,
    ) -> Result<Self> {
        let e = cfg.n_routed_experts;
        let gate = Linear::new(w.f32(&names::layer(layer, "mlp.gate.weight"), &[e, hidden])?, e, hidden);
        let bias = if cfg.topk_method == TopkMethod::NoauxTc {
            Some(w.f32(&names::layer(layer, "mlp.gate.e_score_correction_bias"), &[e])?)
        } else {
            None
        };
        let inter = cfg.moe_intermediate_size;
        let experts = (0..e)
            .map(|i| {
                Mlp::load_with(
                    w,
                    &names::layer(layer, &format!("mlp.experts.{i}")),
                    hidden,
                    inter,
                    rank,
                    world,
                    fp8_act,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let shared = if cfg.n_shared_experts > 0 {
            let si = inter * cfg.n_shared_experts;
            Some(Mlp::load_with(w, &names::layer(layer, "mlp.shared_experts"), hidden, si, rank, world, fp8_act)?)
        } else {
            None
        };
        Ok(Moe { cfg: cfg.clone(), arch, gate, bias, experts, shared })
    }

    /// `x` is `[n, hidden]`; returns this rank's partial output `[n, hidden]`.
    pub fn forward(&self, x: &[f32], hidden: usize) -> Vec<f32> {
        let n = x.len() / hidden;
        let logits = self.gate.forward(x);
        let ne = self.cfg.n_routed_experts;
        let mut out = match &self.shared {
            Some(s) => s.forward(x),
            None => vec![0f32; x.len()],
        };
        for t in 0..n {
            let r = route(&self.cfg, self.arch, &logits[t * ne..(t + 1) * ne], self.bias.as_deref());
            let xt = &x[t * hidden..(t + 1) * hidden];
            // Sum in ascending expert order: the result does not depend on the top-k order.
            let mut order: Vec<usize> = (0..r.experts.len()).collect();
            order.sort_by_key(|&i| r.experts[i]);
            let mut acc = vec![0f32; hidden];
            for i in order {
                let y = self.experts[r.experts[i]].forward(xt);
                for (a, v) in acc.iter_mut().zip(&y) {
                    *a += r.weights[i] * v;
                }
            }
            for (o, a) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(&acc) {
                *o += a;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(method: TopkMethod, scoring: ScoringFunc, n_group: usize, topk_group: usize, k: usize) -> MoeConfig {
        MoeConfig {
            n_routed_experts: 8,
            n_shared_experts: 0,
            num_experts_per_tok: k,
            moe_intermediate_size: 4,
            n_group,
            topk_group,
            topk_method: method,
            scoring_func: scoring,
            norm_topk_prob: false,
            routed_scaling_factor: 1.0,
            first_k_dense_replace: 0,
            moe_layer_freq: 1,
        }
    }

    const LOGITS: [f32; 8] = [0.1, 2.0, -1.0, 0.5, 1.5, 1.4, -0.3, 0.9];

    #[test]
    fn greedy_softmax() {
        let r = route(&cfg(TopkMethod::Greedy, ScoringFunc::Softmax, 1, 1, 2), Arch::DeepseekV2, &LOGITS, None);
        assert_eq!(r.experts, vec![1, 4]);
        let z: f32 = LOGITS.iter().map(|x| x.exp()).sum();
        assert!((r.weights[0] - 2f32.exp() / z).abs() < 1e-6);
    }

    #[test]
    fn group_limited_greedy_uses_group_max() {
        // Groups of two: {0,1} max 2.0, {2,3} 0.5, {4,5} 1.5, {6,7} 0.9. Keep 2 groups.
        let mut c = cfg(TopkMethod::GroupLimitedGreedy, ScoringFunc::Softmax, 4, 2, 3);
        let r = route(&c, Arch::DeepseekV2, &LOGITS, None);
        assert_eq!(r.experts, vec![1, 4, 5]);
        c.topk_group = 1;
        c.num_experts_per_tok = 2;
        assert_eq!(route(&c, Arch::DeepseekV2, &LOGITS, None).experts, vec![1, 0]);
    }

    #[test]
    fn noaux_tc_bias_for_choice_only_and_top2_group_sum() {
        let mut c = cfg(TopkMethod::NoauxTc, ScoringFunc::Sigmoid, 4, 2, 2);
        c.norm_topk_prob = true;
        c.routed_scaling_factor = 2.5;
        // Bias lifts group {6,7} (top-2 sum 2.44) and {4,5} (1.62) over {0,1} (1.41),
        // which holds the best unbiased expert 1: it is masked out.
        let bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 1.0];
        let r = route(&c, Arch::DeepseekV3, &LOGITS, Some(&bias));
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        assert_eq!(r.experts, vec![7, 4]);
        let (a, b) = (sig(LOGITS[7]), sig(LOGITS[4]));
        assert!((r.weights[0] - 2.5 * a / (a + b)).abs() < 1e-6, "{:?}", r.weights);
    }
}
