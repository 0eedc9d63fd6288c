//! The tensors a configuration reads, and the check that a checkpoint holds those and
//! nothing else.
//!
//! A tensor the configuration does not use is an error naming it: shared-expert weights
//! under `n_shared_experts: 0`, a layer past `num_hidden_layers + num_nextn_predict_layers`,
//! `lm_head.weight` with tied embeddings. Such a checkpoint and its `config.json` disagree
//! about the model, and running it anyway gives wrong logits with no sign of why.
//! [`crate::Weights::open`] runs the check whenever the directory has a `config.json`, so
//! every backend gets it.

use crate::names;
use crate::weights::Weights;
use mlaserve_core::{Error, ModelConfig, Result, TopkMethod};
use safetensors::tensor::Dtype;
use std::collections::HashMap;

/// Whether the model needs a tensor or reads it only when present.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    Required,
    /// MTP layers may carry their own embedding and head, else they share the model's.
    Optional,
}

/// Every tensor name `cfg` reads (fp8 block scales aside: they go with their weight).
pub fn expected_tensors(cfg: &ModelConfig) -> HashMap<String, Need> {
    let mut out = HashMap::new();
    let mut req = |n: String| {
        out.insert(n, Need::Required);
    };
    req(names::EMBED.into());
    req(names::FINAL_NORM.into());
    if !cfg.tie_word_embeddings {
        req(names::LM_HEAD.into());
    }
    let layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers;
    for l in 0..layers {
        let n = |s: &str| names::layer(l, s);
        for s in ["input_layernorm.weight", "post_attention_layernorm.weight"] {
            req(n(s));
        }
        if cfg.q_lora_rank.is_some() {
            for s in ["self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight"] {
                req(n(s));
            }
        } else {
            req(n("self_attn.q_proj.weight"));
        }
        for s in [
            "self_attn.kv_a_proj_with_mqa.weight",
            "self_attn.kv_a_layernorm.weight",
            "self_attn.kv_b_proj.weight",
            "self_attn.o_proj.weight",
        ] {
            req(n(s));
        }
        let proj = ["gate_proj", "up_proj", "down_proj"];
        match (&cfg.moe, cfg.is_moe_layer(l)) {
            (Some(m), true) => {
                req(n("mlp.gate.weight"));
                if m.topk_method == TopkMethod::NoauxTc {
                    req(n("mlp.gate.e_score_correction_bias"));
                }
                for e in 0..m.n_routed_experts {
                    for p in proj {
                        req(names::expert(l, e, p));
                    }
                }
                if m.n_shared_experts > 0 {
                    for p in proj {
                        req(n(&format!("mlp.shared_experts.{p}.weight")));
                    }
                }
            }
            _ => {
                for p in proj {
                    req(n(&format!("mlp.{p}.weight")));
                }
            }
        }
        if l >= cfg.num_hidden_layers {
            for s in ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"] {
                req(n(s));
            }
        }
    }
    for l in cfg.num_hidden_layers..layers {
        for s in ["embed_tokens.weight", "shared_head.head.weight"] {
            out.insert(names::layer(l, s), Need::Optional);
        }
    }
    out
}

/// Fails, naming the tensor, if `w` holds a tensor `cfg` does not read or lacks one it
/// needs.
pub fn check_tensors(cfg: &ModelConfig, w: &Weights) -> Result<()> {
    let want = expected_tensors(cfg);
    let is_used = |name: &str| {
        if want.contains_key(name) {
            return true;
        }
        // An fp8 weight's block scales are read with it.
        name.strip_suffix("_scale_inv")
            .is_some_and(|weight| want.contains_key(weight) && w.dtype(weight).is_ok_and(|d| d == Dtype::F8_E4M3))
    };
    let unused: Vec<&str> = w.names().into_iter().filter(|n| !is_used(n)).collect();
    if let Some(first) = unused.first() {
        let file = w.path_of(first).map(|p| p.display().to_string()).unwrap_or_default();
        let more = match unused.len() - 1 {
            0 => String::new(),
            k => format!(" ({k} more unused tensors follow it)"),
        };
        return Err(Error::tensor(
            *first,
            format!("in {file} but unused by config.json: {}{more}", why_unused(cfg, first)),
        ));
    }
    let mut missing: Vec<&String> =
        want.iter().filter(|(n, need)| **need == Need::Required && !w.contains(n)).map(|(n, _)| n).collect();
    missing.sort();
    if let Some(first) = missing.first() {
        let mut msg = "missing from the checkpoint, and config.json needs it".to_string();
        if let Some(d) = layer_of(first).and_then(|l| l.checked_sub(cfg.num_hidden_layers)) {
            msg += &format!(
                " for MTP layer {d} (num_nextn_predict_layers {}, the architecture's default when the field is \
                 omitted; set it to the MTP layers the checkpoint holds, 0 for none)",
                cfg.num_nextn_predict_layers
            );
        }
        return Err(Error::tensor(first.as_str(), msg));
    }
    Ok(())
}

/// `L` of `model.layers.L.…`.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?.split('.').next()?.parse().ok()
}

/// Which setting of the config leaves `name` unused.
fn why_unused(cfg: &ModelConfig, name: &str) -> String {
    let (n, mtp) = (cfg.num_hidden_layers, cfg.num_nextn_predict_layers);
    if name == names::LM_HEAD && cfg.tie_word_embeddings {
        return "tie_word_embeddings is true, so the head is the embedding".into();
    }
    if name.ends_with("_scale_inv") {
        return "the weight it scales is unused or not fp8".into();
    }
    let Some(l) = layer_of(name) else {
        return "not a tensor that a DeepSeek-V2/V3 model reads".into();
    };
    if l >= n + mtp {
        return format!(
            "layer {l} is past the {n} decoder layers (num_hidden_layers) and {mtp} MTP layers \
             (num_nextn_predict_layers)"
        );
    }
    let rest = name.splitn(4, '.').nth(3).unwrap_or_default();
    let moe_layer = cfg.is_moe_layer(l);
    let (first_k, freq) = cfg.moe.as_ref().map_or((0, 1), |m| (m.first_k_dense_replace, m.moe_layer_freq));
    let dense = || match &cfg.moe {
        None => "the model is dense (n_routed_experts 0)".to_string(),
        Some(_) => format!("layer {l} is dense (first_k_dense_replace {first_k}, moe_layer_freq {freq})"),
    };
    if rest.starts_with("mlp.shared_experts.") {
        return if moe_layer { "n_shared_experts is 0".into() } else { dense() };
    }
    if rest.starts_with("mlp.experts.") || rest.starts_with("mlp.gate.") {
        let Some(m) = cfg.moe.as_ref().filter(|_| moe_layer) else { return dense() };
        if rest == "mlp.gate.e_score_correction_bias" {
            return format!("only topk_method noaux_tc reads it (topk_method is {:?})", m.topk_method);
        }
        return format!("n_routed_experts is {}", m.n_routed_experts);
    }
    if moe_layer && ["mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj."].iter().any(|p| rest.starts_with(p)) {
        return format!("layer {l} is an MoE layer (first_k_dense_replace {first_k}, moe_layer_freq {freq})");
    }
    if rest.starts_with("self_attn.q_proj.") {
        return format!("q_lora_rank is {:?}, so q_a_proj and q_b_proj are read instead", cfg.q_lora_rank);
    }
    if rest.starts_with("self_attn.q_a_") || rest.starts_with("self_attn.q_b_") {
        return "q_lora_rank is null, so q_proj is read instead".into();
    }
    if l < n && ["enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens."].iter().any(|p| rest.starts_with(p)) {
        return format!("only MTP layers (from layer {n}, num_hidden_layers) have it");
    }
    "not a tensor that a DeepSeek-V2/V3 model reads".into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets;
    use crate::weights::{f32_to_fp8_e4m3, write_safetensors, RawTensor};
    use serde_json::{json, Value};
    use std::collections::BTreeMap;
    use std::path::Path;

    fn preset(name: &str, overrides: Value) -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        presets::generate_with(name, t.path(), &overrides).unwrap();
        t
    }

    /// Rewrites `config.json` in `dir`, leaving the weights as they are.
    fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
        let p = dir.join("config.json");
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        edit(v.as_object_mut().unwrap());
        std::fs::write(&p, v.to_string()).unwrap();
    }

    fn open_err(dir: &Path) -> String {
        Weights::open(dir, None).unwrap_err().to_string()
    }

    #[test]
    fn presets_and_the_bundled_model_hold_exactly_their_tensors() {
        for name in presets::PRESETS {
            let t = preset(name, json!({}));
            let cfg = crate::load_config(t.path()).unwrap();
            let w = Weights::open_unchecked(t.path(), cfg.fp8).unwrap();
            check_tensors(&cfg, &w).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/mla-tiny-code");
        let cfg = crate::load_config(&dir).unwrap();
        Weights::open(&dir, cfg.fp8).unwrap();
    }

    #[test]
    fn shared_experts_without_n_shared_experts_are_refused() {
        let t = preset("tiny-v3", json!({}));
        edit_config(t.path(), |o| {
            o.insert("n_shared_experts".into(), 0.into());
        });
        let e = open_err(t.path());
        assert!(e.contains("`model.layers.1.mlp.shared_experts.down_proj.weight`"), "{e}");
        assert!(e.contains("n_shared_experts is 0") && e.contains("unused"), "{e}");
    }

    #[test]
    fn layers_past_the_config_are_refused() {
        // tiny-v3: 3 decoder layers + 2 MTP layers; the config now claims 1 MTP layer.
        let t = preset("tiny-v3", json!({}));
        edit_config(t.path(), |o| {
            o.insert("num_nextn_predict_layers".into(), 1.into());
        });
        let e = open_err(t.path());
        assert!(e.contains("`model.layers.4.") && e.contains("num_nextn_predict_layers"), "{e}");
        // tiny-v2: 2 decoder layers; the config now claims 1.
        let t = preset("tiny-v2", json!({}));
        edit_config(t.path(), |o| {
            o.insert("num_hidden_layers".into(), 1.into());
        });
        let e = open_err(t.path());
        assert!(e.contains("`model.layers.1.") && e.contains("num_hidden_layers"), "{e}");
    }

    #[test]
    fn a_tied_head_beside_lm_head_is_refused() {
        let t = preset("tiny-v2", json!({}));
        edit_config(t.path(), |o| {
            o.insert("tie_word_embeddings".into(), true.into());
        });
        let e = open_err(t.path());
        assert!(e.contains("`lm_head.weight`") && e.contains("tie_word_embeddings"), "{e}");
    }

    #[test]
    fn an_omitted_mtp_count_missing_its_layer_says_how_to_fix_it() {
        // DeepseekV3's default is one MTP layer; this checkpoint has none.
        let t = preset("tiny-v3", json!({"num_nextn_predict_layers": 0}));
        edit_config(t.path(), |o| {
            o.remove("num_nextn_predict_layers");
        });
        let e = open_err(t.path());
        assert!(e.contains("`model.layers.3.") && e.contains("missing") && e.contains("0 for none"), "{e}");
    }

    #[test]
    fn extra_files_and_scales_are_checked() {
        let t = preset("tiny-v2", json!({}));
        let o_proj = names::layer(0, "self_attn.o_proj.weight");
        let scale = names::scale_of(&o_proj);
        // A block scale beside a bf16 weight is unused; the error names it and its file.
        let extra: BTreeMap<String, RawTensor> = [(scale.clone(), RawTensor::f32(&[1, 1], &[1.0]))].into();
        write_safetensors(&t.path().join("extra.safetensors"), &extra).unwrap();
        let e = open_err(t.path());
        assert!(e.contains(&format!("`{scale}`")) && e.contains("extra.safetensors"), "{e}");
        // With the weight stored as fp8 the same scale is read with it.
        std::fs::remove_file(t.path().join("extra.safetensors")).unwrap();
        let path = t.path().join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut all: BTreeMap<String, RawTensor> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, RawTensor { shape: v.shape().to_vec(), dtype: v.dtype(), data: v.data().to_vec() }))
            .collect();
        let shape = all[&o_proj].shape.clone();
        let q = vec![f32_to_fp8_e4m3(0.5); shape.iter().product()];
        all.insert(o_proj.clone(), RawTensor { shape: shape.clone(), dtype: Dtype::F8_E4M3, data: q });
        let s = [shape[0].div_ceil(128), shape[1].div_ceil(128)];
        all.insert(scale, RawTensor::f32(&s, &vec![1.0; s[0] * s[1]]));
        write_safetensors(&path, &all).unwrap();
        let w = Weights::open(t.path(), None).unwrap();
        assert_eq!(w.dtype(&o_proj).unwrap(), Dtype::F8_E4M3);
    }
}
