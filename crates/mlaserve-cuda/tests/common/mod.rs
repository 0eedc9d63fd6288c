//! Shared by the backend tests: a CPU replay of a prefill that finds the tokens whose
//! MoE routing lies within a margin of a tie in the f32 reference (see routing_margins.rs),
//! and the tiny-v3 presets they run on.
#![allow(dead_code)]

use mlaserve_core::{ModelConfig, MoeConfig, TopkMethod};
use mlaserve_cpu::attention::{AttnMode, LayerCache, Mla, StepLayout};
use mlaserve_cpu::moe::{Mlp, Moe};
use mlaserve_cpu::ops::{rms_norm, Rope};
use mlaserve_model::{names, Weights};

/// Smallest gap that decides the choice: between the k-th and (k+1)-th allowed choice
/// score, and (grouped methods) between the last kept and the first dropped group.
fn margin(c: &MoeConfig, logits: &[f32], bias: Option<&[f32]>) -> f32 {
    let scores: Vec<f32> = logits.iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect();
    let choice: Vec<f32> = match bias {
        Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
        None => scores,
    };
    let desc = |v: &mut Vec<f32>| v.sort_by(|a, b| b.total_cmp(a));
    let per = choice.len() / c.n_group;
    let mut groups: Vec<(f32, usize)> = (0..c.n_group)
        .map(|g| {
            let mut m = choice[g * per..(g + 1) * per].to_vec();
            desc(&mut m);
            (if c.topk_method == TopkMethod::NoauxTc { m[0] + m.get(1).copied().unwrap_or(0.0) } else { m[0] }, g)
        })
        .collect();
    groups.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut gap = f32::INFINITY;
    if c.topk_method != TopkMethod::Greedy && c.topk_group < c.n_group {
        gap = groups[c.topk_group - 1].0 - groups[c.topk_group].0;
    }
    let kept: Vec<usize> = groups[..c.topk_group.min(c.n_group)].iter().map(|g| g.1).collect();
    let mut allowed: Vec<f32> =
        choice.iter().enumerate().filter(|(e, _)| kept.contains(&(e / per))).map(|(_, v)| *v).collect();
    desc(&mut allowed);
    if allowed.len() > c.num_experts_per_tok {
        gap = gap.min(allowed[c.num_experts_per_tok - 1] - allowed[c.num_experts_per_tok]);
    }
    gap
}

/// Replays a prefill batch (sequences of `lens` tokens from position 0, tokens from
/// `toks`) through the CPU layers; returns per MoE layer the (row, margin) below `thr`.
pub fn near_ties(dir: &std::path::Path, seqs: &[(Vec<u32>, Vec<u32>)], thr: f32) -> Vec<(usize, Vec<(usize, f32)>)> {
    let c: ModelConfig = mlaserve_model::load_config(dir).expect("config");
    let w = Weights::open(dir, c.fp8).expect("weights");
    let (h, eps) = (c.hidden_size, c.rms_norm_eps as f32);
    let emb = w.f32(names::EMBED, &[c.vocab_size, h]).expect("embed");
    let mut rows = Vec::new();
    let mut x = Vec::new();
    for (s, (tokens, _)) in seqs.iter().enumerate() {
        for (p, &t) in tokens.iter().enumerate() {
            rows.push((s, p));
            x.extend_from_slice(&emb[t as usize * h..(t as usize + 1) * h]);
        }
    }
    let layout = StepLayout { rows, tables: seqs.iter().map(|(_, t)| t.as_slice()).collect() };
    let rope = Rope::new(&c.rope_inv_freq(), c.rope_attention_factor(), c.max_position_embeddings);
    let mut out = Vec::new();
    for l in 0..c.num_hidden_layers {
        let mut cache = LayerCache::new(32, c.latent_dim());
        let mut n = x.clone();
        rms_norm(&mut n, &w.f32(&names::layer(l, "input_layernorm.weight"), &[h]).expect("norm"), eps);
        let a = Mla::load(&w, &c, l, 0, 1).expect("mla").forward(&n, &layout, &mut cache, &rope, AttnMode::Absorbed);
        x.iter_mut().zip(&a).for_each(|(xi, ai)| *xi += ai);
        let mut n = x.clone();
        rms_norm(&mut n, &w.f32(&names::layer(l, "post_attention_layernorm.weight"), &[h]).expect("norm"), eps);
        let f = match (&c.moe, c.is_moe_layer(l)) {
            (Some(m), true) => {
                let e = m.n_routed_experts;
                let gate = w.f32(&names::layer(l, "mlp.gate.weight"), &[e, h]).expect("gate");
                let bias = (m.topk_method == TopkMethod::NoauxTc)
                    .then(|| w.f32(&names::layer(l, "mlp.gate.e_score_correction_bias"), &[e]).expect("bias"));
                let mut ties = Vec::new();
                for (r, xr) in n.chunks(h).enumerate() {
                    let lg: Vec<f32> =
                        (0..e).map(|j| xr.iter().zip(&gate[j * h..(j + 1) * h]).map(|(a, b)| a * b).sum()).collect();
                    let g = margin(m, &lg, bias.as_deref());
                    if g < thr {
                        ties.push((r, g));
                    }
                }
                out.push((l, ties));
                Moe::load(&w, m, c.arch, l, h, 0, 1).expect("moe").forward(&n, h)
            }
            _ => Mlp::load(&w, &names::layer(l, "mlp"), h, c.intermediate_size, 0, 1).expect("mlp").forward(&n),
        };
        x.iter_mut().zip(&f).for_each(|(xi, fi)| *xi += fi);
    }
    out
}

#[cfg(feature = "cuda")]
/// Whether a GPU is present; without one the test is skipped (it fails instead when
/// `MLASERVE_REQUIRE_GPU` is set).
pub fn require_gpu() -> bool {
    gpu().is_some()
}

#[cfg(feature = "cuda")]
/// GPU 0, or `None` to skip (a panic instead when `MLASERVE_REQUIRE_GPU` is set).
pub fn gpu() -> Option<mlaserve_cuda::Gpu> {
    match mlaserve_cuda::Gpu::new(0) {
        Ok(g) => Some(g),
        Err(e) if std::env::var_os("MLASERVE_REQUIRE_GPU").is_none() => {
            eprintln!("skipping GPU test: {e}");
            None
        }
        Err(e) => panic!("MLASERVE_REQUIRE_GPU is set but no GPU: {e}"),
    }
}

#[cfg(feature = "cuda")]
/// GPUs 0..world present, or skip (fail instead when `MLASERVE_REQUIRE_GPUS` asks for
/// at least `world`).
pub fn require_gpus(world: usize) -> bool {
    if !require_gpu() {
        return false;
    }
    let have = mlaserve_cuda::Gpu::count().unwrap_or(0);
    let want: usize = std::env::var("MLASERVE_REQUIRE_GPUS").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    if have >= world {
        return true;
    }
    assert!(want < world, "MLASERVE_REQUIRE_GPUS={want} but only {have} GPUs");
    eprintln!("skipping TP={world} test: {have} GPU(s)");
    false
}

/// Largest absolute difference over the largest |want| (NaN when `got` has a non-finite
/// value): the backend tests' relative error.
pub fn rel(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "shape");
    if got.iter().any(|v| !v.is_finite()) {
        return f64::NAN;
    }
    let d = got.iter().zip(want).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
    d / want.iter().map(|v| v.abs() as f64).fold(1e-30, f64::max)
}

/// tiny-v3's config changes that give it V3's attention widths (512 + 64 latent, 16
/// heads: the tensor-core decode kernels' shape).
pub fn v3_attention() -> serde_json::Value {
    serde_json::json!({"kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 16,
                       "num_key_value_heads": 16})
}

/// tiny-v3 in a temporary directory, with `v3_attention` at V3's attention widths.
pub fn tiny_v3(v3_attention: bool) -> tempfile::TempDir {
    let t = tempfile::tempdir().expect("tempdir");
    let o = if v3_attention { self::v3_attention() } else { serde_json::json!({}) };
    mlaserve_model::presets::generate_with("tiny-v3", t.path(), &o).expect("preset");
    t
}
