//! Model configuration: HF `config.json` of `DeepseekV3ForCausalLM` and
//! `DeepseekV2ForCausalLM`, validated into [`ModelConfig`].
//!
//! Every field that changes the math is read here; a value we cannot honour is an
//! [`Error::Config`] naming the field and the value, never silently ignored. A field the
//! file omits takes transformers' default for the declared architecture (`parse.rs` holds
//! the table), and [`ModelConfig::from_file`] puts the file's path in front of every error.

use crate::error::{Error, Result};
use serde_json::Value;
use std::path::Path;

/// Which architecture the checkpoint declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    DeepseekV2,
    DeepseekV3,
}

impl Arch {
    /// The `architectures` entry that declares it.
    pub fn hf_name(self) -> &'static str {
        match self {
            Arch::DeepseekV2 => "DeepseekV2ForCausalLM",
            Arch::DeepseekV3 => "DeepseekV3ForCausalLM",
        }
    }
}

/// Gate scoring function of the MoE router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoringFunc {
    Sigmoid,
    Softmax,
}

/// Expert selection method of the MoE router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopkMethod {
    /// Plain top-k over all experts (DeepSeek-V2-Lite).
    Greedy,
    /// Groups scored by their best expert, keep `topk_group` groups (DeepSeek-V2).
    GroupLimitedGreedy,
    /// Sigmoid scores plus `e_score_correction_bias` for the choice only; groups scored
    /// by the sum of their top-2 experts (DeepSeek-V3).
    NoauxTc,
}

/// YaRN context extension parameters (`rope_scaling` / `rope_parameters`).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeScaling {
    pub factor: f64,
    pub original_max_position_embeddings: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    /// An explicit attention factor overrides the one derived from `mscale`s.
    pub attention_factor: Option<f64>,
    /// Round the correction range to whole dimensions (transformers' default).
    pub truncate: bool,
}

/// Routed-expert configuration; `None` in [`ModelConfig::moe`] means a dense model.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub topk_method: TopkMethod,
    pub scoring_func: ScoringFunc,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
    pub first_k_dense_replace: usize,
    pub moe_layer_freq: usize,
}

/// fp8 block quantisation as declared by `quantization_config`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Config {
    pub block: [usize; 2],
}

/// A validated DeepSeek-V2/V3 model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub moe: Option<MoeConfig>,
    pub num_nextn_predict_layers: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub fp8: Option<Fp8Config>,
}

mod parse;
#[cfg(test)]
mod tests;

impl ModelConfig {
    /// Reads and validates `config.json`; every error names the file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::file(path, e.to_string()))?;
        Self::from_json_str(&text).map_err(|e| Error::file(path, e.to_string()))
    }

    /// Parses and validates a `config.json` document.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| Error::config("<root>", format!("not valid JSON: {e}")))?;
        let obj = v.as_object().ok_or_else(|| Error::config("<root>", "expected a JSON object"))?;
        parse::parse(obj)
    }

    /// Width of one head's query/key: `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Fails unless every dimension tensor parallelism splits (heads, the MLPs'
    /// intermediate widths, the vocabulary) divides by `world` ranks.
    pub fn check_tp(&self, world: usize) -> Result<()> {
        let mut dims = vec![
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
        ];
        if let Some(m) = &self.moe {
            dims.push(("moe_intermediate_size", m.moe_intermediate_size));
        }
        for (name, v) in dims {
            if world == 0 || v % world != 0 {
                return Err(Error::config(
                    name,
                    format!("value {v} is not divisible by the tensor-parallel size {world}"),
                ));
            }
        }
        Ok(())
    }

    /// Values per token per layer in the latent cache: `kv_lora_rank + qk_rope_head_dim`.
    pub fn latent_dim(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// Whether decoder layer `layer` (MTP layers included, numbered after the main ones)
    /// uses routed experts.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        match &self.moe {
            None => false,
            Some(m) => layer >= m.first_k_dense_replace && layer.is_multiple_of(m.moe_layer_freq),
        }
    }

    /// YaRN `mscale` helper as in DeepSeek's and transformers' code.
    fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * mscale * scale.ln() + 1.0
        }
    }

    /// Softmax scale of attention: `1/sqrt(qk_head_dim)` times `mscale(factor, mscale_all_dim)²`.
    pub fn softmax_scale(&self) -> f64 {
        let base = 1.0 / (self.qk_head_dim() as f64).sqrt();
        match &self.rope_scaling {
            Some(y) => match y.mscale_all_dim {
                Some(m) if m != 0.0 => {
                    let s = Self::yarn_get_mscale(y.factor, m);
                    base * s * s
                }
                _ => base,
            },
            None => base,
        }
    }

    /// Factor applied to RoPE's cos/sin (YaRN's attention factor; 1 without YaRN).
    pub fn rope_attention_factor(&self) -> f64 {
        match &self.rope_scaling {
            None => 1.0,
            Some(y) => {
                if let Some(a) = y.attention_factor {
                    return a;
                }
                match (y.mscale, y.mscale_all_dim) {
                    (Some(m), Some(md)) if m != 0.0 && md != 0.0 => {
                        Self::yarn_get_mscale(y.factor, m) / Self::yarn_get_mscale(y.factor, md)
                    }
                    _ => Self::yarn_get_mscale(y.factor, 1.0),
                }
            }
        }
    }

    /// RoPE inverse frequencies (length `qk_rope_head_dim / 2`), YaRN-blended when configured.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let dim = self.qk_rope_head_dim;
        let base = self.rope_theta;
        let extra: Vec<f64> = (0..dim / 2).map(|i| 1.0 / base.powf((2 * i) as f64 / dim as f64)).collect();
        let Some(y) = &self.rope_scaling else { return extra };
        let pi = std::f64::consts::PI;
        let corr_dim = |rot: f64| {
            dim as f64 * (y.original_max_position_embeddings as f64 / (rot * 2.0 * pi)).ln() / (2.0 * base.ln())
        };
        let (mut low, mut high) = (corr_dim(y.beta_fast), corr_dim(y.beta_slow));
        if y.truncate {
            low = low.floor();
            high = high.ceil();
        }
        low = low.max(0.0);
        high = high.min(dim as f64 - 1.0);
        if low == high {
            high += 0.001;
        }
        extra
            .iter()
            .enumerate()
            .map(|(i, &e)| {
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let extrapolation_factor = 1.0 - ramp;
                let inter = e / y.factor;
                inter * (1.0 - extrapolation_factor) + e * extrapolation_factor
            })
            .collect()
    }
}
