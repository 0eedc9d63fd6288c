//! Model configuration: HF `config.json` of `DeepseekV3ForCausalLM` and
//! `DeepseekV2ForCausalLM`, validated into [`ModelConfig`].
//!
//! Every field that changes the math is read here; a value we cannot honour is an
//! [`Error::Config`] naming the field and the value, never silently ignored.

use crate::error::{Error, Result};
use serde_json::{Map, Value};
use std::path::Path;

/// Which architecture the checkpoint declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    DeepseekV2,
    DeepseekV3,
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

impl ModelConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::file(path, e.to_string()))?;
        Self::from_json_str(&text).map_err(|e| match e {
            Error::Config { .. } => e,
            other => Error::file(path, other.to_string()),
        })
    }

    /// Parses and validates a `config.json` document.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| Error::config("<root>", format!("not valid JSON: {e}")))?;
        let obj = v.as_object().ok_or_else(|| Error::config("<root>", "expected a JSON object"))?;
        Self::from_json(obj)
    }

    fn from_json(o: &Map<String, Value>) -> Result<Self> {
        let arch = parse_arch(o)?;
        let r = Reader(o);
        let hidden_act = r.opt_str("hidden_act")?.unwrap_or_else(|| "silu".into());
        if hidden_act != "silu" {
            return Err(Error::config("hidden_act", format!("unsupported value {hidden_act:?} (only \"silu\")")));
        }
        if r.opt_bool("attention_bias")?.unwrap_or(false) {
            return Err(Error::config("attention_bias", "unsupported value true"));
        }
        let num_hidden_layers = r.usize("num_hidden_layers")?;
        let n_routed = r.opt_usize("n_routed_experts")?;
        let moe = match n_routed {
            None | Some(0) => None,
            Some(n_routed_experts) => {
                let scoring_func = match r.opt_str("scoring_func")?.as_deref() {
                    None => match arch {
                        Arch::DeepseekV3 => ScoringFunc::Sigmoid,
                        Arch::DeepseekV2 => ScoringFunc::Softmax,
                    },
                    Some("sigmoid") => ScoringFunc::Sigmoid,
                    Some("softmax") => ScoringFunc::Softmax,
                    Some(x) => return Err(Error::config("scoring_func", format!("unsupported value {x:?}"))),
                };
                let topk_method = match r.opt_str("topk_method")?.as_deref() {
                    None => match arch {
                        Arch::DeepseekV3 => TopkMethod::NoauxTc,
                        Arch::DeepseekV2 => TopkMethod::Greedy,
                    },
                    Some("greedy") => TopkMethod::Greedy,
                    Some("group_limited_greedy") => TopkMethod::GroupLimitedGreedy,
                    Some("noaux_tc") => TopkMethod::NoauxTc,
                    Some(x) => return Err(Error::config("topk_method", format!("unsupported value {x:?}"))),
                };
                let n_group = r.opt_usize("n_group")?.unwrap_or(1).max(1);
                let topk_group = r.opt_usize("topk_group")?.unwrap_or(n_group).max(1);
                let num_experts_per_tok = r.usize("num_experts_per_tok")?;
                if n_routed_experts % n_group != 0 {
                    return Err(Error::config(
                        "n_group",
                        format!("value {n_group} does not divide n_routed_experts {n_routed_experts}"),
                    ));
                }
                if topk_group > n_group {
                    return Err(Error::config("topk_group", format!("value {topk_group} exceeds n_group {n_group}")));
                }
                if num_experts_per_tok == 0 || num_experts_per_tok > n_routed_experts {
                    return Err(Error::config(
                        "num_experts_per_tok",
                        format!("value {num_experts_per_tok} must be in 1..={n_routed_experts}"),
                    ));
                }
                if num_experts_per_tok > topk_group * (n_routed_experts / n_group) {
                    return Err(Error::config(
                        "num_experts_per_tok",
                        format!("value {num_experts_per_tok} exceeds the experts of the {topk_group} kept groups"),
                    ));
                }
                if topk_method == TopkMethod::NoauxTc && n_routed_experts / n_group < 2 {
                    return Err(Error::config("n_group", "noaux_tc needs at least 2 experts per group"));
                }
                let moe_layer_freq = r.opt_usize("moe_layer_freq")?.unwrap_or(1);
                if moe_layer_freq == 0 {
                    return Err(Error::config("moe_layer_freq", "value 0 is not allowed"));
                }
                Some(MoeConfig {
                    n_routed_experts,
                    n_shared_experts: r.opt_usize("n_shared_experts")?.unwrap_or(0),
                    num_experts_per_tok,
                    moe_intermediate_size: r.usize("moe_intermediate_size")?,
                    n_group,
                    topk_group,
                    topk_method,
                    scoring_func,
                    norm_topk_prob: r.opt_bool("norm_topk_prob")?.unwrap_or(false),
                    routed_scaling_factor: r.opt_f64("routed_scaling_factor")?.unwrap_or(1.0),
                    first_k_dense_replace: r.opt_usize("first_k_dense_replace")?.unwrap_or(0),
                    moe_layer_freq,
                })
            }
        };

        let (rope_theta, rope_scaling) = parse_rope(o)?;
        let eos_token_ids = match o.get("eos_token_id") {
            None | Some(Value::Null) => vec![],
            Some(v) => token_ids("eos_token_id", v)?,
        };
        let bos_token_id = r.opt_usize("bos_token_id")?.map(|x| x as u32);
        let fp8 = parse_quant(o)?;

        let cfg = ModelConfig {
            arch,
            vocab_size: r.usize("vocab_size")?,
            hidden_size: r.usize("hidden_size")?,
            intermediate_size: r.usize("intermediate_size")?,
            num_hidden_layers,
            num_attention_heads: r.usize("num_attention_heads")?,
            q_lora_rank: r.opt_usize("q_lora_rank")?,
            kv_lora_rank: r.usize("kv_lora_rank")?,
            qk_nope_head_dim: r.usize("qk_nope_head_dim")?,
            qk_rope_head_dim: r.usize("qk_rope_head_dim")?,
            v_head_dim: r.usize("v_head_dim")?,
            rms_norm_eps: r.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: r.usize("max_position_embeddings")?,
            moe,
            num_nextn_predict_layers: r.opt_usize("num_nextn_predict_layers")?.unwrap_or(0),
            tie_word_embeddings: r.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            bos_token_id,
            eos_token_ids,
            fp8,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("v_head_dim", self.v_head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(Error::config(name, "value 0 is not allowed"));
            }
        }
        if self.qk_rope_head_dim == 0 || !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(Error::config(
                "qk_rope_head_dim",
                format!("value {} must be even and positive", self.qk_rope_head_dim),
            ));
        }
        if self.q_lora_rank == Some(0) {
            return Err(Error::config("q_lora_rank", "value 0 is not allowed (use null)"));
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 {
            return Err(Error::config("rope_theta", format!("value {} must be positive", self.rope_theta)));
        }
        if let Some(y) = &self.rope_scaling {
            if y.factor.is_nan() || y.factor < 1.0 {
                return Err(Error::config("rope_scaling.factor", format!("value {} must be >= 1", y.factor)));
            }
            if y.original_max_position_embeddings == 0 {
                return Err(Error::config("rope_scaling.original_max_position_embeddings", "value 0"));
            }
        }
        for &e in &self.eos_token_ids {
            if e as usize >= self.vocab_size {
                return Err(Error::config("eos_token_id", format!("value {e} >= vocab_size {}", self.vocab_size)));
            }
        }
        Ok(())
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

fn parse_arch(o: &Map<String, Value>) -> Result<Arch> {
    let archs = o.get("architectures").and_then(|v| v.as_array());
    let first = archs.and_then(|a| a.first()).and_then(|v| v.as_str());
    match first {
        Some("DeepseekV3ForCausalLM") => Ok(Arch::DeepseekV3),
        Some("DeepseekV2ForCausalLM") => Ok(Arch::DeepseekV2),
        Some(x) => Err(Error::config("architectures", format!("unsupported value {x:?}"))),
        None => match o.get("model_type").and_then(|v| v.as_str()) {
            Some("deepseek_v3") => Ok(Arch::DeepseekV3),
            Some("deepseek_v2") => Ok(Arch::DeepseekV2),
            Some(x) => Err(Error::config("model_type", format!("unsupported value {x:?}"))),
            None => Err(Error::config("architectures", "missing (and no model_type)")),
        },
    }
}

/// Reads `rope_theta` and YaRN from either `rope_scaling` (older) or `rope_parameters`
/// (transformers v5), which may also carry `rope_theta`.
fn parse_rope(o: &Map<String, Value>) -> Result<(f64, Option<RopeScaling>)> {
    let (field, params) = match (o.get("rope_parameters"), o.get("rope_scaling")) {
        (Some(Value::Object(p)), _) => ("rope_parameters", Some(p)),
        (_, Some(Value::Object(p))) => ("rope_scaling", Some(p)),
        (Some(Value::Null) | None, Some(Value::Null) | None) => ("rope_scaling", None),
        (Some(v), _) if !v.is_null() => {
            return Err(Error::config("rope_parameters", format!("expected an object, got {v}")))
        }
        (_, Some(v)) => return Err(Error::config("rope_scaling", format!("expected an object, got {v}"))),
        _ => ("rope_scaling", None),
    };
    let top_theta = Reader(o).opt_f64("rope_theta")?;
    let Some(p) = params else {
        return Ok((top_theta.unwrap_or(10000.0), None));
    };
    let r = Reader(p);
    let f = |k: &str| format!("{field}.{k}");
    let theta = match r.opt_f64("rope_theta").map_err(|e| rename(e, field))? {
        Some(t) => t,
        None => top_theta.unwrap_or(10000.0),
    };
    let kind = match r.opt_str("rope_type").map_err(|e| rename(e, field))? {
        Some(t) => Some(t),
        None => r.opt_str("type").map_err(|e| rename(e, field))?,
    };
    match kind.as_deref() {
        None | Some("default") => Ok((theta, None)),
        Some("yarn") => {
            let factor = r
                .opt_f64("factor")
                .map_err(|e| rename(e, field))?
                .ok_or_else(|| Error::config(f("factor"), "missing"))?;
            let original = r
                .opt_usize("original_max_position_embeddings")
                .map_err(|e| rename(e, field))?
                .ok_or_else(|| Error::config(f("original_max_position_embeddings"), "missing"))?;
            Ok((
                theta,
                Some(RopeScaling {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast: r.opt_f64("beta_fast").map_err(|e| rename(e, field))?.unwrap_or(32.0),
                    beta_slow: r.opt_f64("beta_slow").map_err(|e| rename(e, field))?.unwrap_or(1.0),
                    mscale: r.opt_f64("mscale").map_err(|e| rename(e, field))?,
                    mscale_all_dim: r.opt_f64("mscale_all_dim").map_err(|e| rename(e, field))?,
                    attention_factor: r.opt_f64("attention_factor").map_err(|e| rename(e, field))?,
                    truncate: r.opt_bool("truncate").map_err(|e| rename(e, field))?.unwrap_or(true),
                }),
            ))
        }
        Some(x) => {
            Err(Error::config(f("rope_type"), format!("unsupported value {x:?} (only \"yarn\" or \"default\")")))
        }
    }
}

fn rename(e: Error, prefix: &str) -> Error {
    match e {
        Error::Config { field, msg } => Error::Config { field: format!("{prefix}.{field}"), msg },
        other => other,
    }
}

fn parse_quant(o: &Map<String, Value>) -> Result<Option<Fp8Config>> {
    let Some(q) = o.get("quantization_config") else { return Ok(None) };
    if q.is_null() {
        return Ok(None);
    }
    let q = q.as_object().ok_or_else(|| Error::config("quantization_config", "expected an object"))?;
    let r = Reader(q);
    let method = r.opt_str("quant_method").map_err(|e| rename(e, "quantization_config"))?;
    if method.as_deref() != Some("fp8") {
        return Err(Error::config(
            "quantization_config.quant_method",
            format!("unsupported value {method:?} (only \"fp8\")"),
        ));
    }
    if let Some(fmt) = r.opt_str("fmt").map_err(|e| rename(e, "quantization_config"))? {
        if fmt != "e4m3" {
            return Err(Error::config("quantization_config.fmt", format!("unsupported value {fmt:?} (only \"e4m3\")")));
        }
    }
    let block = match q.get("weight_block_size") {
        Some(Value::Array(a)) if a.len() == 2 => {
            let b: Vec<usize> = a.iter().filter_map(|v| v.as_u64().map(|x| x as usize)).collect();
            if b.len() != 2 || b[0] == 0 || b[1] == 0 {
                return Err(Error::config("quantization_config.weight_block_size", format!("bad value {a:?}")));
            }
            [b[0], b[1]]
        }
        None => [128, 128],
        Some(v) => return Err(Error::config("quantization_config.weight_block_size", format!("bad value {v}"))),
    };
    Ok(Some(Fp8Config { block }))
}

fn token_ids(field: &str, v: &Value) -> Result<Vec<u32>> {
    let one = |x: &Value| {
        x.as_u64()
            .filter(|&n| n <= u32::MAX as u64)
            .map(|n| n as u32)
            .ok_or_else(|| Error::config(field, format!("bad token id {x}")))
    };
    match v {
        Value::Array(a) => a.iter().map(one).collect(),
        x => Ok(vec![one(x)?]),
    }
}

/// Typed accessors that name the field in their errors.
struct Reader<'a>(&'a Map<String, Value>);

impl Reader<'_> {
    fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }
    fn usize(&self, k: &str) -> Result<usize> {
        self.opt_usize(k)?.ok_or_else(|| Error::config(k, "missing"))
    }
    fn opt_usize(&self, k: &str) -> Result<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| Error::config(k, format!("expected a non-negative integer, got {v}"))),
        }
    }
    fn opt_f64(&self, k: &str) -> Result<Option<f64>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| Error::config(k, format!("expected a number, got {v}"))),
        }
    }
    fn opt_bool(&self, k: &str) -> Result<Option<bool>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| Error::config(k, format!("expected a boolean, got {v}"))),
        }
    }
    fn opt_str(&self, k: &str) -> Result<Option<String>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(|s| Some(s.to_string()))
                .ok_or_else(|| Error::config(k, format!("expected a string, got {v}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v3() -> Value {
        serde_json::json!({
            "architectures": ["DeepseekV3ForCausalLM"],
            "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
            "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
            "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
            "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
            "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
            "norm_topk_prob": true, "scoring_func": "sigmoid", "max_position_embeddings": 163840,
            "rms_norm_eps": 1e-6, "rope_theta": 10000,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
            "num_nextn_predict_layers": 1, "eos_token_id": 1, "bos_token_id": 0,
            "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [128, 128]}
        })
    }

    #[test]
    fn parses_deepseek_v3() {
        let c = ModelConfig::from_json_str(&v3().to_string()).unwrap();
        assert_eq!(c.arch, Arch::DeepseekV3);
        assert_eq!(c.latent_dim(), 576);
        assert!(!c.is_moe_layer(2) && c.is_moe_layer(3) && c.is_moe_layer(61));
        let y = c.rope_scaling.as_ref().unwrap();
        assert_eq!(y.factor, 40.0);
        // mscale == mscale_all_dim: cos/sin unscaled, softmax scale grows by mscale².
        assert!((c.rope_attention_factor() - 1.0).abs() < 1e-12);
        let m = 0.1 * 40f64.ln() + 1.0;
        assert!((c.softmax_scale() - m * m / 192f64.sqrt()).abs() < 1e-12);
        assert_eq!(c.fp8, Some(Fp8Config { block: [128, 128] }));
        assert_eq!(c.eos_token_ids, vec![1]);
    }

    #[test]
    fn rope_parameters_spelling() {
        let mut v = v3();
        let o = v.as_object_mut().unwrap();
        let rs = o.remove("rope_scaling").unwrap();
        o.remove("rope_theta");
        let mut p = rs.as_object().unwrap().clone();
        p.remove("type");
        p.insert("rope_type".into(), "yarn".into());
        p.insert("rope_theta".into(), 50000.0.into());
        o.insert("rope_parameters".into(), Value::Object(p));
        let c = ModelConfig::from_json_str(&v.to_string()).unwrap();
        assert_eq!(c.rope_theta, 50000.0);
        assert_eq!(c.rope_scaling.unwrap().original_max_position_embeddings, 4096);
    }

    fn err_of(mutate: impl FnOnce(&mut Map<String, Value>)) -> String {
        let mut v = v3();
        mutate(v.as_object_mut().unwrap());
        ModelConfig::from_json_str(&v.to_string()).unwrap_err().to_string()
    }

    #[test]
    fn bad_values_name_the_field() {
        let e = err_of(|o| {
            o.insert("architectures".into(), serde_json::json!(["LlamaForCausalLM"]));
        });
        assert!(e.contains("architectures") && e.contains("LlamaForCausalLM"), "{e}");
        let e = err_of(|o| {
            o.insert("scoring_func".into(), "relu".into());
        });
        assert!(e.contains("scoring_func") && e.contains("relu"), "{e}");
        let e = err_of(|o| {
            o.insert("topk_method".into(), "magic".into());
        });
        assert!(e.contains("topk_method") && e.contains("magic"), "{e}");
        let e = err_of(|o| {
            o.insert("n_group".into(), 7.into());
        });
        assert!(e.contains("n_group") && e.contains('7'), "{e}");
        let e = err_of(|o| {
            o.insert("rope_scaling".into(), serde_json::json!({"type": "longrope", "factor": 2}));
        });
        assert!(e.contains("rope_scaling.rope_type") && e.contains("longrope"), "{e}");
        let e = err_of(|o| {
            o.insert("kv_lora_rank".into(), "big".into());
        });
        assert!(e.contains("kv_lora_rank") && e.contains("big"), "{e}");
        let e = err_of(|o| {
            o.remove("hidden_size");
        });
        assert!(e.contains("hidden_size") && e.contains("missing"), "{e}");
        let e = err_of(|o| {
            o.insert("hidden_act".into(), "gelu".into());
        });
        assert!(e.contains("hidden_act") && e.contains("gelu"), "{e}");
        let e = err_of(|o| {
            o.insert("quantization_config".into(), serde_json::json!({"quant_method": "awq"}));
        });
        assert!(e.contains("quant_method") && e.contains("awq"), "{e}");
        let e = err_of(|o| {
            o.insert("qk_rope_head_dim".into(), 63.into());
        });
        assert!(e.contains("qk_rope_head_dim") && e.contains("63"), "{e}");
    }

    #[test]
    fn yarn_inv_freq_blends() {
        let c = ModelConfig::from_json_str(&v3().to_string()).unwrap();
        let f = c.rope_inv_freq();
        assert_eq!(f.len(), 32);
        // Highest frequencies extrapolate (unchanged), lowest are interpolated by 1/factor.
        assert!((f[0] - 1.0).abs() < 1e-12);
        let plain = 1.0 / 10000f64.powf(62.0 / 64.0);
        assert!((f[31] - plain / 40.0).abs() < 1e-15);
    }
}
