//! Deterministic random-weight checkpoints in HF layout (`mlaserve gen-model`).
//!
//! Each tensor's values come from a PRNG seeded by the preset's seed and the tensor's
//! name, so a checkpoint is the same on every machine and independent of write order.
//! Scales are chosen so activations stay O(1) and logits are well separated (greedy
//! decisions are not near-ties), which keeps parity tests meaningful.

use crate::names;
use crate::weights::{write_safetensors, RawTensor};
use mlaserve_core::{Error, ModelConfig, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// Names accepted by [`generate`].
pub const PRESETS: &[&str] = &["tiny-v3", "tiny-v2"];

/// The `config.json` of a preset.
pub fn preset_config(name: &str) -> Result<Value> {
    match name {
        // q_lora, sigmoid noaux_tc with 4 groups, YaRN with mscale != mscale_all_dim, a
        // first dense layer, v_head_dim != qk_nope_head_dim, 2 MTP layers; heads,
        // intermediate sizes and vocabulary divisible by 8 for TP up to 8.
        "tiny-v3" => Ok(json!({
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "n_shared_experts": 1,
            "n_routed_experts": 16,
            "routed_scaling_factor": 2.5,
            "kv_lora_rank": 32,
            "q_lora_rank": 48,
            "qk_rope_head_dim": 8,
            "v_head_dim": 24,
            "qk_nope_head_dim": 16,
            "topk_method": "noaux_tc",
            "n_group": 4,
            "topk_group": 2,
            "num_experts_per_tok": 4,
            "moe_layer_freq": 1,
            "first_k_dense_replace": 1,
            "norm_topk_prob": true,
            "scoring_func": "sigmoid",
            "hidden_act": "silu",
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8
            },
            "attention_bias": false,
            "attention_dropout": 0.0,
            "tie_word_embeddings": false,
            "num_nextn_predict_layers": 2,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "initializer_range": 0.02,
            "use_cache": true,
            "torch_dtype": "bfloat16"
        })),
        // q_lora_rank null, softmax greedy routing, two shared experts, no MTP.
        "tiny-v2" => Ok(json!({
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "n_shared_experts": 2,
            "n_routed_experts": 8,
            "routed_scaling_factor": 1.0,
            "kv_lora_rank": 32,
            "q_lora_rank": null,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "qk_nope_head_dim": 16,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "num_experts_per_tok": 2,
            "moe_layer_freq": 1,
            "first_k_dense_replace": 1,
            "norm_topk_prob": false,
            "scoring_func": "softmax",
            "hidden_act": "silu",
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707
            },
            "attention_bias": false,
            "attention_dropout": 0.0,
            "tie_word_embeddings": false,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "initializer_range": 0.02,
            "use_cache": true,
            "torch_dtype": "bfloat16"
        })),
        other => Err(Error::config("preset", format!("unknown preset {other:?} (known: {})", PRESETS.join(", ")))),
    }
}

/// Writes preset `name` into `out` (created if needed): config.json, safetensors
/// (tiny-v3 as two shards with an index, to exercise the sharded path),
/// generation_config.json and a byte-level BPE tokenizer.json.
pub fn generate(name: &str, out: &Path) -> Result<()> {
    generate_with(name, out, &json!({}))
}

/// [`generate`] with `overrides` (a JSON object) merged into the preset's config before the
/// weights are drawn, e.g. `{"first_k_dense_replace": 3}` for an all-dense variant. The
/// weights' seed is the preset's.
pub fn generate_with(name: &str, out: &Path, overrides: &Value) -> Result<()> {
    let mut cfg_json = preset_config(name)?;
    if let (Some(c), Some(o)) = (cfg_json.as_object_mut(), overrides.as_object()) {
        for (k, v) in o {
            c.insert(k.clone(), v.clone());
        }
    }
    let cfg = ModelConfig::from_json_str(&cfg_json.to_string())?;
    std::fs::create_dir_all(out).map_err(|e| Error::file(out, e.to_string()))?;
    let tensors = random_weights(&cfg, seed_of(name));
    write_json(&out.join("config.json"), &cfg_json)?;
    write_json(
        &out.join("generation_config.json"),
        &json!({"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids.first(), "do_sample": false}),
    )?;
    write_json(&out.join("tokenizer.json"), &byte_level_tokenizer(cfg.vocab_size))?;
    write_json(
        &out.join("tokenizer_config.json"),
        &json!({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
                "model_max_length": cfg.max_position_embeddings, "add_bos_token": true}),
    )?;
    if name == "tiny-v3" {
        // Split after the first decoder layer: embeddings + layer 0 | the rest.
        let (a, b): (BTreeMap<_, _>, BTreeMap<_, _>) =
            tensors.into_iter().partition(|(k, _)| k.starts_with("model.embed") || k.starts_with("model.layers.0."));
        let files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
        let mut map = serde_json::Map::new();
        for (file, part) in files.iter().zip([&a, &b]) {
            write_safetensors(&out.join(file), part)?;
            for k in part.keys() {
                map.insert(k.clone(), json!(file));
            }
        }
        write_json(&out.join("model.safetensors.index.json"), &json!({"metadata": {}, "weight_map": map}))?;
    } else {
        write_safetensors(&out.join("model.safetensors"), &tensors)?;
    }
    Ok(())
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|e| Error::file(path, e.to_string()))?;
    std::fs::write(path, text + "\n").map_err(|e| Error::file(path, e.to_string()))
}

fn seed_of(name: &str) -> u64 {
    fnv1a(name.as_bytes()) ^ 0x6d6c_6173_6572_7665
}

fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ x as u64).wrapping_mul(0x100_0000_01b3))
}

/// splitmix64: small, fast, and good enough for test weights.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn sym(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

struct Gen {
    seed: u64,
    out: BTreeMap<String, RawTensor>,
}

impl Gen {
    fn fill(&mut self, name: &str, shape: &[usize], f: impl Fn(f32) -> f32) {
        let mut rng = Rng(self.seed ^ fnv1a(name.as_bytes()));
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| f(rng.sym())).collect();
        self.out.insert(name.to_string(), RawTensor::bf16(shape, &v));
    }
    fn linear(&mut self, name: &str, out: usize, inp: usize) {
        let a = (3.0 / inp as f32).sqrt();
        self.fill(name, &[out, inp], |u| u * a);
    }
    fn norm(&mut self, name: &str, n: usize) {
        self.fill(name, &[n], |u| 1.0 + 0.1 * u);
    }
    fn mlp(&mut self, prefix: &str, hidden: usize, inter: usize) {
        self.linear(&format!("{prefix}.gate_proj.weight"), inter, hidden);
        self.linear(&format!("{prefix}.up_proj.weight"), inter, hidden);
        self.linear(&format!("{prefix}.down_proj.weight"), hidden, inter);
    }

    fn decoder_layer(&mut self, c: &ModelConfig, l: usize) {
        let h = c.hidden_size;
        let nh = c.num_attention_heads;
        self.norm(&names::layer(l, "input_layernorm.weight"), h);
        self.norm(&names::layer(l, "post_attention_layernorm.weight"), h);
        match c.q_lora_rank {
            Some(r) => {
                self.linear(&names::layer(l, "self_attn.q_a_proj.weight"), r, h);
                self.norm(&names::layer(l, "self_attn.q_a_layernorm.weight"), r);
                self.linear(&names::layer(l, "self_attn.q_b_proj.weight"), nh * c.qk_head_dim(), r);
            }
            None => self.linear(&names::layer(l, "self_attn.q_proj.weight"), nh * c.qk_head_dim(), h),
        }
        self.linear(&names::layer(l, "self_attn.kv_a_proj_with_mqa.weight"), c.latent_dim(), h);
        self.norm(&names::layer(l, "self_attn.kv_a_layernorm.weight"), c.kv_lora_rank);
        self.linear(
            &names::layer(l, "self_attn.kv_b_proj.weight"),
            nh * (c.qk_nope_head_dim + c.v_head_dim),
            c.kv_lora_rank,
        );
        self.linear(&names::layer(l, "self_attn.o_proj.weight"), h, nh * c.v_head_dim);
        match (&c.moe, c.is_moe_layer(l)) {
            (Some(m), true) => {
                let a = 2.0 * (3.0 / h as f32).sqrt();
                self.fill(&names::layer(l, "mlp.gate.weight"), &[m.n_routed_experts, h], |u| u * a);
                if m.topk_method == mlaserve_core::TopkMethod::NoauxTc {
                    // Non-negative so the group mask's fill value (0 or -inf) never matters.
                    self.fill(&names::layer(l, "mlp.gate.e_score_correction_bias"), &[m.n_routed_experts], |u| {
                        0.05 * (u + 1.0)
                    });
                }
                for e in 0..m.n_routed_experts {
                    self.mlp(&names::layer(l, &format!("mlp.experts.{e}")), h, m.moe_intermediate_size);
                }
                if m.n_shared_experts > 0 {
                    self.mlp(&names::layer(l, "mlp.shared_experts"), h, m.moe_intermediate_size * m.n_shared_experts);
                }
            }
            _ => self.mlp(&names::layer(l, "mlp"), h, c.intermediate_size),
        }
    }
}

fn random_weights(c: &ModelConfig, seed: u64) -> BTreeMap<String, RawTensor> {
    let mut g = Gen { seed, out: BTreeMap::new() };
    let (h, v) = (c.hidden_size, c.vocab_size);
    g.fill(names::EMBED, &[v, h], |u| u);
    g.norm(names::FINAL_NORM, h);
    let head_scale = 4.0 * (3.0 / h as f32).sqrt();
    g.fill(names::LM_HEAD, &[v, h], |u| u * head_scale);
    for l in 0..c.num_hidden_layers {
        g.decoder_layer(c, l);
    }
    for d in 0..c.num_nextn_predict_layers {
        let l = c.num_hidden_layers + d;
        g.decoder_layer(c, l);
        g.norm(&names::layer(l, "enorm.weight"), h);
        g.norm(&names::layer(l, "hnorm.weight"), h);
        g.linear(&names::layer(l, "eh_proj.weight"), h, 2 * h);
        g.norm(&names::layer(l, "shared_head.norm.weight"), h);
        g.fill(&names::layer(l, "shared_head.head.weight"), &[v, h], |u| u * head_scale);
        // MTP layer 0 carries its own copy of the embedding (as DeepSeek-V3's checkpoint
        // does); later layers omit it and fall back to the main one.
        if d == 0 {
            let e = g.out[names::EMBED].clone();
            g.out.insert(names::layer(l, "embed_tokens.weight"), e);
        }
    }
    g.out
}

pub const BOS: &str = "<｜begin▁of▁sentence｜>";
pub const EOS: &str = "<｜end▁of▁sentence｜>";

/// GPT-2's byte → printable-char map used by byte-level BPE.
fn byte_to_char() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xa1..=0xac).chain(0xae..=0xff).collect();
    let mut map = vec!['\0'; 256];
    for &b in &printable {
        map[b as usize] = char::from_u32(b).unwrap_or('\0');
    }
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            map[b as usize] = char::from_u32(256 + n).unwrap_or('\0');
            n += 1;
        }
    }
    printable.clear();
    map
}

/// A byte-level BPE tokenizer: ids 0/1 are BOS/EOS, 2..258 the 256 bytes, no merges.
/// Ids from 258 to `vocab_size` exist in the model only (they decode to nothing).
fn byte_level_tokenizer(vocab_size: usize) -> Value {
    let chars = byte_to_char();
    let mut vocab = serde_json::Map::new();
    vocab.insert(BOS.into(), json!(0));
    vocab.insert(EOS.into(), json!(1));
    for (b, ch) in chars.iter().enumerate() {
        vocab.insert(ch.to_string(), json!(b + 2));
    }
    debug_assert!(vocab_size >= 258);
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, BOS), special(1, EOS)],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{load_config, Tokenizer, Weights};

    #[test]
    fn presets_are_deterministic_and_load() {
        for name in PRESETS {
            let a = tempfile::tempdir().unwrap();
            let b = tempfile::tempdir().unwrap();
            generate(name, a.path()).unwrap();
            generate(name, b.path()).unwrap();
            let mut files: Vec<_> = std::fs::read_dir(a.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
            files.sort();
            for f in &files {
                assert_eq!(std::fs::read(a.path().join(f)).unwrap(), std::fs::read(b.path().join(f)).unwrap());
            }
            let cfg = load_config(a.path()).unwrap();
            let w = Weights::open(a.path(), cfg.fp8).unwrap();
            assert!(w.contains(names::LM_HEAD));
            let tok = Tokenizer::from_dir(a.path(), &cfg).unwrap();
            let ids = tok.encode("def f(x):\n  return x — ok", true).unwrap();
            assert_eq!(ids[0], 0);
            assert_eq!(tok.decode(&ids, true).unwrap(), "def f(x):\n  return x — ok");
            assert_eq!(tok.eos_token_ids(), &[1]);
        }
    }
}
