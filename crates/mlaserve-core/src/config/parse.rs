//! `config.json` → [`ModelConfig`]: which fields are read, what an omitted field means,
//! and which values are refused.
//!
//! An omitted field takes transformers' default *for the declared architecture*
//! (`DeepseekV3Config` / `DeepseekV2Config`; [`ArchDefaults`]), so a checkpoint means the
//! same here as there. Where transformers has no usable default (`None`, which its
//! modeling code cannot run with) the field is required once it matters. A value that
//! states math we do not implement is refused, even where transformers would ignore it
//! (`rope_interleave: false` on V2, `mlp_bias: true` on V3): a silently different model is
//! worse than an error. Errors about a value that came from a default say so.

use super::{Arch, Fp8Config, ModelConfig, MoeConfig, RopeScaling, ScoringFunc, TopkMethod};
use crate::error::{Error, Result};
use serde_json::{Map, Value};
use std::cell::RefCell;

/// transformers' defaults for the fields of one architecture that `config.json` may omit
/// and that change the math. `None`: transformers has no usable default, so the field is
/// required when the model needs it.
///
/// Shared by both architectures, and so not in the table: `rope_theta` 10000,
/// `rms_norm_eps` 1e-6, `tie_word_embeddings` false, `hidden_act` "silu",
/// `attention_bias` false, `rope_interleave` true (V3's field; V2 always interleaves),
/// `moe_layer_freq` 1 (DeepSeek's own config class; transformers makes every layer from
/// `first_k_dense_replace` on an MoE layer). `topk_method` and `scoring_func` are fields
/// of V2 only in DeepSeek's config class; transformers hard-codes softmax for V2 and
/// sigmoid with `noaux_tc` selection for V3.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct ArchDefaults {
    /// An omitted `q_lora_rank` is 1536 in both; an explicit `null` means no LoRA.
    pub q_lora_rank: usize,
    pub n_routed_experts: usize,
    pub num_experts_per_tok: Option<usize>,
    pub moe_intermediate_size: usize,
    pub n_shared_experts: usize,
    pub routed_scaling_factor: f64,
    pub n_group: Option<usize>,
    pub topk_group: Option<usize>,
    pub topk_method: TopkMethod,
    pub scoring_func: ScoringFunc,
    pub norm_topk_prob: bool,
    pub first_k_dense_replace: usize,
    /// V3's `num_mtp_layers` (alias `num_nextn_predict_layers`); V2 has no MTP.
    pub num_nextn_predict_layers: usize,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
}

pub(super) const DEFAULT_ROPE_THETA: f64 = 10000.0;
const DEFAULT_RMS_NORM_EPS: f64 = 1e-6;

impl ArchDefaults {
    pub(super) fn of(arch: Arch) -> Self {
        match arch {
            Arch::DeepseekV3 => ArchDefaults {
                q_lora_rank: 1536,
                n_routed_experts: 256,
                num_experts_per_tok: Some(8),
                moe_intermediate_size: 2048,
                n_shared_experts: 1,
                routed_scaling_factor: 2.5,
                n_group: Some(8),
                topk_group: Some(4),
                topk_method: TopkMethod::NoauxTc,
                scoring_func: ScoringFunc::Sigmoid,
                norm_topk_prob: true,
                first_k_dense_replace: 3,
                num_nextn_predict_layers: 1,
                bos_token_id: 0,
                eos_token_id: 1,
            },
            Arch::DeepseekV2 => ArchDefaults {
                q_lora_rank: 1536,
                n_routed_experts: 64,
                num_experts_per_tok: None,
                moe_intermediate_size: 1407,
                n_shared_experts: 2,
                routed_scaling_factor: 1.0,
                n_group: None,
                topk_group: None,
                topk_method: TopkMethod::Greedy,
                scoring_func: ScoringFunc::Softmax,
                norm_topk_prob: false,
                first_k_dense_replace: 0,
                num_nextn_predict_layers: 0,
                bos_token_id: 1,
                eos_token_id: 2,
            },
        }
    }
}

/// Parses and validates a `config.json` object.
pub(super) fn parse(o: &Map<String, Value>) -> Result<ModelConfig> {
    let arch = parse_arch(o)?;
    let r = Reader::new(o);
    parse_fields(&r, arch).and_then(|c| c.validate().map(|()| c)).map_err(|e| r.annotate(e, arch))
}

fn parse_fields(r: &Reader, arch: Arch) -> Result<ModelConfig> {
    let d = ArchDefaults::of(arch);
    refuse_unsupported(r, arch)?;
    let num_attention_heads = r.usize("num_attention_heads")?;
    if let Some(kv) = r.opt_usize("num_key_value_heads")? {
        if kv != num_attention_heads {
            return Err(Error::config(
                "num_key_value_heads",
                format!("value {kv} differs from num_attention_heads {num_attention_heads} (MLA has one K/V per head)"),
            ));
        }
    }
    let moe = parse_moe(r, arch, &d)?;
    let (rope_theta, rope_scaling) = parse_rope(r.0)?;
    let q_lora_rank = match r.0.get("q_lora_rank") {
        None => Some(r.defaulted("q_lora_rank", d.q_lora_rank)),
        Some(Value::Null) => None,
        Some(_) => r.opt_usize("q_lora_rank")?,
    };
    let bos_token_id = match r.0.get("bos_token_id") {
        None => Some(r.defaulted("bos_token_id", d.bos_token_id)),
        Some(Value::Null) => None,
        Some(v) => token_ids("bos_token_id", v)?.first().copied(),
    };
    let eos_token_ids = match r.0.get("eos_token_id") {
        None => vec![r.defaulted("eos_token_id", d.eos_token_id)],
        Some(Value::Null) => vec![],
        Some(v) => token_ids("eos_token_id", v)?,
    };
    Ok(ModelConfig {
        arch,
        vocab_size: r.usize("vocab_size")?,
        hidden_size: r.usize("hidden_size")?,
        intermediate_size: r.usize("intermediate_size")?,
        num_hidden_layers: r.usize("num_hidden_layers")?,
        num_attention_heads,
        q_lora_rank,
        kv_lora_rank: r.usize("kv_lora_rank")?,
        qk_nope_head_dim: r.usize("qk_nope_head_dim")?,
        qk_rope_head_dim: r.usize("qk_rope_head_dim")?,
        v_head_dim: r.usize("v_head_dim")?,
        rms_norm_eps: r.f64_or("rms_norm_eps", DEFAULT_RMS_NORM_EPS)?,
        rope_theta,
        rope_scaling,
        max_position_embeddings: r.usize("max_position_embeddings")?,
        moe,
        num_nextn_predict_layers: r.usize_or("num_nextn_predict_layers", d.num_nextn_predict_layers)?,
        tie_word_embeddings: r.bool_or("tie_word_embeddings", false)?,
        bos_token_id,
        eos_token_ids,
        fp8: parse_quant(r.0)?,
    })
}

/// Values that state math mlaserve does not implement.
fn refuse_unsupported(r: &Reader, arch: Arch) -> Result<()> {
    let hidden_act = r.opt_str("hidden_act")?.unwrap_or_else(|| "silu".into());
    if hidden_act != "silu" {
        return Err(Error::config("hidden_act", format!("unsupported value {hidden_act:?} (only \"silu\")")));
    }
    if r.opt_bool("attention_bias")?.unwrap_or(false) {
        return Err(Error::config("attention_bias", "unsupported value true"));
    }
    if r.opt_bool("mlp_bias")?.unwrap_or(false) {
        return Err(Error::config("mlp_bias", "unsupported value true"));
    }
    if !r.opt_bool("rope_interleave")?.unwrap_or(true) {
        let why = match arch {
            Arch::DeepseekV3 => {
                "transformers then applies rotate-half RoPE, which mlaserve does not implement; DeepSeek's \
                 checkpoints use the interleaved layout (true, the default)"
            }
            Arch::DeepseekV2 => {
                "DeepseekV2ForCausalLM always applies interleaved RoPE (transformers ignores the field), so \
                 false cannot be honoured; remove the field or set it to true"
            }
        };
        return Err(Error::config("rope_interleave", format!("unsupported value false: {why}")));
    }
    Ok(())
}

/// The routed-expert fields; `None` for a dense model (`n_routed_experts: 0`).
fn parse_moe(r: &Reader, arch: Arch, d: &ArchDefaults) -> Result<Option<MoeConfig>> {
    let n_routed_experts = r.usize_or("n_routed_experts", d.n_routed_experts)?;
    if n_routed_experts == 0 {
        // mlaserve's spelling of a dense model (transformers has none: there every layer
        // from `first_k_dense_replace` on is MoE).
        return Ok(None);
    }
    let scoring_func = match r.opt_str("scoring_func")?.as_deref() {
        None => r.defaulted("scoring_func", d.scoring_func),
        Some("sigmoid") => ScoringFunc::Sigmoid,
        Some("softmax") => ScoringFunc::Softmax,
        Some(x) => return Err(Error::config("scoring_func", format!("unsupported value {x:?}"))),
    };
    let topk_method = match r.opt_str("topk_method")?.as_deref() {
        None => r.defaulted("topk_method", d.topk_method),
        Some("greedy") => TopkMethod::Greedy,
        Some("group_limited_greedy") => TopkMethod::GroupLimitedGreedy,
        Some("noaux_tc") => TopkMethod::NoauxTc,
        Some(x) => return Err(Error::config("topk_method", format!("unsupported value {x:?}"))),
    };
    let num_experts_per_tok = r.usize_or_required("num_experts_per_tok", d.num_experts_per_tok, arch)?;
    if num_experts_per_tok == 0 || num_experts_per_tok > n_routed_experts {
        return Err(Error::config(
            "num_experts_per_tok",
            format!("value {num_experts_per_tok} must be in 1..={n_routed_experts} (n_routed_experts)"),
        ));
    }
    // Greedy selection never reads the groups (neither does transformers'), so their
    // values, given or not, do not matter: one group holding every expert.
    let (n_group, topk_group) = if topk_method == TopkMethod::Greedy {
        (1, 1)
    } else {
        let n_group = r.usize_or_required("n_group", d.n_group, arch)?;
        let topk_group = r.usize_or_required("topk_group", d.topk_group, arch)?;
        if n_group == 0 || !n_routed_experts.is_multiple_of(n_group) {
            return Err(Error::config(
                "n_group",
                format!("value {n_group} does not divide n_routed_experts {n_routed_experts}"),
            ));
        }
        if topk_group == 0 || topk_group > n_group {
            return Err(Error::config("topk_group", format!("value {topk_group} must be in 1..={n_group} (n_group)")));
        }
        if num_experts_per_tok > topk_group * (n_routed_experts / n_group) {
            return Err(Error::config(
                "num_experts_per_tok",
                format!(
                    "value {num_experts_per_tok} exceeds the {} experts of the topk_group {topk_group} kept groups",
                    topk_group * (n_routed_experts / n_group)
                ),
            ));
        }
        if topk_method == TopkMethod::NoauxTc && n_routed_experts / n_group < 2 {
            return Err(Error::config(
                "n_group",
                format!("value {n_group} leaves fewer than 2 experts per group, which noaux_tc needs"),
            ));
        }
        (n_group, topk_group)
    };
    let norm_topk_prob = r.bool_or("norm_topk_prob", d.norm_topk_prob)?;
    if arch == Arch::DeepseekV2 && norm_topk_prob && num_experts_per_tok > 1 {
        return Err(Error::config(
            "norm_topk_prob",
            "unsupported value true for DeepseekV2ForCausalLM: transformers' DeepseekV2 ignores it, DeepSeek's \
             own V2 code normalises and then skips routed_scaling_factor; the references disagree",
        ));
    }
    let routed_scaling_factor = r.f64_or("routed_scaling_factor", d.routed_scaling_factor)?;
    if !routed_scaling_factor.is_finite() || routed_scaling_factor <= 0.0 {
        return Err(Error::config("routed_scaling_factor", format!("value {routed_scaling_factor} must be positive")));
    }
    let moe_intermediate_size = r.usize_or("moe_intermediate_size", d.moe_intermediate_size)?;
    if moe_intermediate_size == 0 {
        return Err(Error::config("moe_intermediate_size", "value 0 is not allowed"));
    }
    let moe_layer_freq = r.usize_or("moe_layer_freq", 1)?;
    if moe_layer_freq == 0 {
        return Err(Error::config("moe_layer_freq", "value 0 is not allowed"));
    }
    Ok(Some(MoeConfig {
        n_routed_experts,
        n_shared_experts: r.usize_or("n_shared_experts", d.n_shared_experts)?,
        num_experts_per_tok,
        moe_intermediate_size,
        n_group,
        topk_group,
        topk_method,
        scoring_func,
        norm_topk_prob,
        routed_scaling_factor,
        first_k_dense_replace: r.usize_or("first_k_dense_replace", d.first_k_dense_replace)?,
        moe_layer_freq,
    }))
}

impl ModelConfig {
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
        if !self.rms_norm_eps.is_finite() || self.rms_norm_eps < 0.0 {
            return Err(Error::config("rms_norm_eps", format!("value {} must be >= 0", self.rms_norm_eps)));
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
    let top_theta = Reader::new(o).opt_f64("rope_theta")?;
    let Some(p) = params else {
        return Ok((top_theta.unwrap_or(DEFAULT_ROPE_THETA), None));
    };
    let r = Reader::new(p);
    let f = |k: &str| format!("{field}.{k}");
    let theta = match r.opt_f64("rope_theta").map_err(|e| rename(e, field))? {
        Some(t) => t,
        None => top_theta.unwrap_or(DEFAULT_ROPE_THETA),
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
    let r = Reader::new(q);
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
    if let Some(s) = r.opt_str("activation_scheme").map_err(|e| rename(e, "quantization_config"))? {
        if s != "dynamic" {
            return Err(Error::config(
                "quantization_config.activation_scheme",
                format!("unsupported value {s:?} (only \"dynamic\")"),
            ));
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

/// Typed accessors that name the field in their errors, and remember which fields took
/// a default (for [`Reader::annotate`]).
struct Reader<'a>(&'a Map<String, Value>, RefCell<Vec<(String, String)>>);

impl<'a> Reader<'a> {
    fn new(o: &'a Map<String, Value>) -> Self {
        Reader(o, RefCell::new(Vec::new()))
    }
    fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }
    /// Records that `k` was omitted and took `value`.
    fn defaulted<T: std::fmt::Debug>(&self, k: &str, value: T) -> T {
        self.1.borrow_mut().push((k.to_string(), format!("{value:?}")));
        value
    }
    fn usize_or(&self, k: &str, d: usize) -> Result<usize> {
        Ok(match self.opt_usize(k)? {
            Some(v) => v,
            None => self.defaulted(k, d),
        })
    }
    /// `d` is `None` where transformers has no usable default for `arch`.
    fn usize_or_required(&self, k: &str, d: Option<usize>, arch: Arch) -> Result<usize> {
        match (self.opt_usize(k)?, d) {
            (Some(v), _) => Ok(v),
            (None, Some(d)) => Ok(self.defaulted(k, d)),
            (None, None) => {
                Err(Error::config(k, format!("missing, and transformers has no default for it in {}", arch.hf_name())))
            }
        }
    }
    fn f64_or(&self, k: &str, d: f64) -> Result<f64> {
        Ok(match self.opt_f64(k)? {
            Some(v) => v,
            None => self.defaulted(k, d),
        })
    }
    fn bool_or(&self, k: &str, d: bool) -> Result<bool> {
        Ok(match self.opt_bool(k)? {
            Some(v) => v,
            None => self.defaulted(k, d),
        })
    }
    /// Adds to a config error which of the values it involves were defaults, so a user
    /// sees why a field they never wrote is wrong.
    fn annotate(&self, e: Error, arch: Arch) -> Error {
        let Error::Config { field, msg } = e else { return e };
        let named =
            |k: &str| field == k || msg.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).any(|w| w == k);
        let used: Vec<String> =
            self.1.borrow().iter().filter(|(k, _)| named(k)).map(|(k, v)| format!("{k} = {v}")).collect();
        if used.is_empty() {
            return Error::Config { field, msg };
        }
        let msg = format!(
            "{msg} (not set in the file, so transformers' default for {} applies: {})",
            arch.hf_name(),
            used.join(", ")
        );
        Error::Config { field, msg }
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
