//! Tests of config parsing: known configs, refusals that name the field, and every
//! omitted field's default against transformers' for each architecture.

use super::*;
use serde_json::Map;

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

/// A small config of `arch` in which every optional field is set to a value that differs
/// from transformers' default, so that omitting one shows the default we apply.
fn non_default(arch: &str) -> Map<String, Value> {
    let v2 = arch == "DeepseekV2ForCausalLM";
    let v = serde_json::json!({
        "architectures": [arch],
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 8, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "max_position_embeddings": 512,
        "q_lora_rank": 48, "n_routed_experts": 16, "num_experts_per_tok": if v2 { 1 } else { 2 },
        "moe_intermediate_size": 32, "n_shared_experts": 3, "routed_scaling_factor": 1.5,
        "n_group": 4, "topk_group": 2, "topk_method": "group_limited_greedy",
        "scoring_func": if v2 { "sigmoid" } else { "softmax" },
        // V2 refuses `true` with more than one expert per token; V2's default is false.
        "norm_topk_prob": v2, "first_k_dense_replace": 1, "moe_layer_freq": 2,
        "rope_theta": 50000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": true,
        "num_nextn_predict_layers": 2, "bos_token_id": 5, "eos_token_id": 6,
        "hidden_act": "silu", "attention_bias": false, "rope_interleave": true, "mlp_bias": false
    });
    v.as_object().cloned().unwrap_or_default()
}

fn moe(c: &ModelConfig) -> &MoeConfig {
    c.moe.as_ref().expect("an MoE config")
}

#[test]
fn omitted_fields_take_transformers_defaults_per_architecture() {
    type Get = fn(&ModelConfig) -> String;
    // (field, what it sets, transformers' DeepseekV3Config default, DeepseekV2Config default),
    // from configuration_deepseek_v3.py / configuration_deepseek_v2.py (transformers 5.24);
    // "refused" where transformers has none (None) and the model needs one, or where the
    // field is one we require. `topk_method`, `scoring_func` and `moe_layer_freq`: see
    // `ArchDefaults`.
    let rows: &[(&str, Get, &str, &str)] = &[
        ("routed_scaling_factor", |c| moe(c).routed_scaling_factor.to_string(), "2.5", "1"),
        ("norm_topk_prob", |c| moe(c).norm_topk_prob.to_string(), "true", "false"),
        ("n_group", |c| moe(c).n_group.to_string(), "8", "refused"),
        ("topk_group", |c| moe(c).topk_group.to_string(), "4", "refused"),
        ("n_shared_experts", |c| moe(c).n_shared_experts.to_string(), "1", "2"),
        ("n_routed_experts", |c| moe(c).n_routed_experts.to_string(), "256", "64"),
        ("num_experts_per_tok", |c| moe(c).num_experts_per_tok.to_string(), "8", "refused"),
        ("moe_intermediate_size", |c| moe(c).moe_intermediate_size.to_string(), "2048", "1407"),
        ("topk_method", |c| format!("{:?}", moe(c).topk_method), "NoauxTc", "Greedy"),
        ("scoring_func", |c| format!("{:?}", moe(c).scoring_func), "Sigmoid", "Softmax"),
        ("first_k_dense_replace", |c| moe(c).first_k_dense_replace.to_string(), "3", "0"),
        ("moe_layer_freq", |c| moe(c).moe_layer_freq.to_string(), "1", "1"),
        ("q_lora_rank", |c| format!("{:?}", c.q_lora_rank), "Some(1536)", "Some(1536)"),
        ("rope_theta", |c| c.rope_theta.to_string(), "10000", "10000"),
        ("rms_norm_eps", |c| c.rms_norm_eps.to_string(), "0.000001", "0.000001"),
        ("tie_word_embeddings", |c| c.tie_word_embeddings.to_string(), "false", "false"),
        ("num_nextn_predict_layers", |c| c.num_nextn_predict_layers.to_string(), "1", "0"),
        ("bos_token_id", |c| format!("{:?}", c.bos_token_id), "Some(0)", "Some(1)"),
        ("eos_token_id", |c| format!("{:?}", c.eos_token_ids), "[1]", "[2]"),
        // No field in `ModelConfig`: the default is the only supported value.
        ("hidden_act", |_| "parsed".into(), "parsed", "parsed"),
        ("attention_bias", |_| "parsed".into(), "parsed", "parsed"),
        ("mlp_bias", |_| "parsed".into(), "parsed", "parsed"),
        ("rope_interleave", |_| "parsed".into(), "parsed", "parsed"),
        ("num_key_value_heads", |_| "parsed".into(), "parsed", "parsed"),
        // Required: transformers' defaults are the full-size model's, never a small one's.
        ("vocab_size", |c| c.vocab_size.to_string(), "refused", "refused"),
        ("hidden_size", |c| c.hidden_size.to_string(), "refused", "refused"),
        ("intermediate_size", |c| c.intermediate_size.to_string(), "refused", "refused"),
        ("num_hidden_layers", |c| c.num_hidden_layers.to_string(), "refused", "refused"),
        ("num_attention_heads", |c| c.num_attention_heads.to_string(), "refused", "refused"),
        ("kv_lora_rank", |c| c.kv_lora_rank.to_string(), "refused", "refused"),
        ("qk_nope_head_dim", |c| c.qk_nope_head_dim.to_string(), "refused", "refused"),
        ("qk_rope_head_dim", |c| c.qk_rope_head_dim.to_string(), "refused", "refused"),
        ("v_head_dim", |c| c.v_head_dim.to_string(), "refused", "refused"),
        ("max_position_embeddings", |c| c.max_position_embeddings.to_string(), "refused", "refused"),
    ];
    let mut failures = Vec::new();
    for (arch, col) in [("DeepseekV3ForCausalLM", 0), ("DeepseekV2ForCausalLM", 1)] {
        let full = non_default(arch);
        let c = ModelConfig::from_json_str(&Value::Object(full.clone()).to_string())
            .unwrap_or_else(|e| panic!("{arch}: the all-explicit config must parse: {e}"));
        for &(field, get, v3, v2) in rows {
            let want = if col == 0 { v3 } else { v2 };
            assert!(full.contains_key(field), "{arch}: the base config must set {field}");
            // Each value of the base config differs from the default, so the test can fail.
            if want != "refused" && want != "parsed" {
                assert_ne!(get(&c), want, "{arch}: the base config's {field} equals the default");
            }
            let mut o = full.clone();
            o.remove(field);
            let got = match ModelConfig::from_json_str(&Value::Object(o).to_string()) {
                Ok(_) if want == "parsed" => "parsed".to_string(),
                Ok(c) => get(&c),
                Err(e) => {
                    let e = e.to_string();
                    assert!(e.contains(field), "{arch}: refusing omitted {field} must name it: {e}");
                    "refused".to_string()
                }
            };
            if got != want {
                failures.push(format!("{arch} without {field}: got {got}, transformers' default {want}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn null_is_not_omitted_where_transformers_distinguishes() {
    let mut o = non_default("DeepseekV3ForCausalLM");
    for k in ["q_lora_rank", "bos_token_id", "eos_token_id"] {
        o.insert(k.into(), Value::Null);
    }
    let c = ModelConfig::from_json_str(&Value::Object(o).to_string()).unwrap();
    assert_eq!(c.q_lora_rank, None);
    assert_eq!(c.bos_token_id, None);
    assert!(c.eos_token_ids.is_empty());
}

#[test]
fn rope_interleave_false_is_refused_for_both_architectures() {
    for arch in ["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"] {
        let mut o = non_default(arch);
        o.insert("rope_interleave".into(), false.into());
        let e = ModelConfig::from_json_str(&Value::Object(o).to_string()).unwrap_err().to_string();
        assert!(e.contains("rope_interleave") && e.contains("false"), "{arch}: {e}");
    }
}

#[test]
fn math_changing_values_we_do_not_implement_are_refused() {
    let cases: &[(&str, &str, Value, &str)] = &[
        ("DeepseekV3ForCausalLM", "mlp_bias", true.into(), "mlp_bias"),
        ("DeepseekV3ForCausalLM", "num_key_value_heads", 4.into(), "num_key_value_heads"),
        ("DeepseekV2ForCausalLM", "num_experts_per_tok", 2.into(), "norm_topk_prob"),
        ("DeepseekV3ForCausalLM", "routed_scaling_factor", (-1.0).into(), "routed_scaling_factor"),
        (
            "DeepseekV3ForCausalLM",
            "quantization_config",
            serde_json::json!({"quant_method": "fp8", "activation_scheme": "static"}),
            "activation_scheme",
        ),
    ];
    for (arch, k, v, named) in cases {
        let mut o = non_default(arch);
        o.insert(k.to_string(), v.clone());
        let e = ModelConfig::from_json_str(&Value::Object(o).to_string()).unwrap_err().to_string();
        assert!(e.contains(named), "{arch} {k}={v}: {e}");
    }
    // Greedy routing ignores the groups, as transformers does: no group checks apply.
    let mut o = non_default("DeepseekV2ForCausalLM");
    o.insert("topk_method".into(), "greedy".into());
    o.insert("n_group".into(), 3.into());
    let c = ModelConfig::from_json_str(&Value::Object(o).to_string()).unwrap();
    assert_eq!((moe(&c).n_group, moe(&c).topk_group), (1, 1));
}

#[test]
fn errors_from_a_default_say_so() {
    let mut o = non_default("DeepseekV3ForCausalLM");
    o.remove("n_group");
    o.insert("n_routed_experts".into(), 12.into());
    let e = ModelConfig::from_json_str(&Value::Object(o).to_string()).unwrap_err().to_string();
    assert!(e.contains("n_group") && e.contains("n_group = 8") && e.contains("default"), "{e}");
}

#[test]
fn file_errors_name_the_file() {
    let dir = std::env::temp_dir().join(format!("mlaserve-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config.json");
    let mut o = non_default("DeepseekV3ForCausalLM");
    o.insert("n_group".into(), 3.into());
    std::fs::write(&path, Value::Object(o).to_string()).unwrap();
    let e = ModelConfig::from_file(&path).unwrap_err().to_string();
    let p = path.display().to_string();
    assert!(e.starts_with(&p) && e.contains("n_group") && e.contains("value 3"), "{e}");
    std::fs::write(&path, "{not json").unwrap();
    let e = ModelConfig::from_file(&path).unwrap_err().to_string();
    assert!(e.starts_with(&p) && e.contains("not valid JSON"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
    let e = ModelConfig::from_file(&path).unwrap_err().to_string();
    assert!(e.starts_with(&p), "{e}");
}
