//! Deterministic random-weight checkpoints in HF layout (`mlaserve gen-model`).
//!
//! Each tensor's values come from a PRNG seeded by the preset's seed and the tensor's
//! name, so a checkpoint is the same on every machine and independent of write order.
//! Scales are chosen so activations stay O(1) and logits are well separated (greedy
//! decisions are not near-ties), which keeps parity tests meaningful.

mod plan;
mod write;

use crate::progress::LoadProgress;
use mlaserve_core::{Error, ModelConfig, Result};
use serde_json::{json, Value};
use std::path::Path;

pub use write::Written;

/// The small presets that tests generate (each a few hundred KB).
pub const PRESETS: &[&str] = &["tiny-v3", "tiny-v2"];

/// Every name [`preset_config`] knows: the small presets and `deepseek-v3`, DeepSeek-V3's
/// real widths (61 layers + 1 MTP layer unless `--layers` says otherwise; ~690 GB in fp8).
pub const ALL_PRESETS: &[&str] = &["tiny-v3", "tiny-v2", "deepseek-v3"];

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
        // DeepSeek-V3's config.json (fields that change the math; quantization_config is
        // added with `fp8`).
        "deepseek-v3" => Ok(json!({
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": 129280,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "n_shared_experts": 1,
            "n_routed_experts": 256,
            "routed_scaling_factor": 2.5,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "qk_nope_head_dim": 128,
            "topk_method": "noaux_tc",
            "n_group": 8,
            "topk_group": 4,
            "num_experts_per_tok": 8,
            "moe_layer_freq": 1,
            "first_k_dense_replace": 3,
            "norm_topk_prob": true,
            "scoring_func": "sigmoid",
            "hidden_act": "silu",
            "max_position_embeddings": 163840,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000,
            "rope_scaling": {
                "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0
            },
            "attention_bias": false,
            "attention_dropout": 0.0,
            "tie_word_embeddings": false,
            "num_nextn_predict_layers": 1,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "initializer_range": 0.02,
            "use_cache": true,
            "torch_dtype": "bfloat16"
        })),
        other => Err(Error::config("preset", format!("unknown preset {other:?} (known: {})", ALL_PRESETS.join(", ")))),
    }
}

/// Options of [`generate_opts`] (`mlaserve gen-model`'s flags).
#[derive(Debug, Clone, Default)]
pub struct GenOptions {
    /// Store the attention and MLP projections as fp8 e4m3 with 128 × 128 F32
    /// `weight_scale_inv` blocks, and declare `quantization_config` (DeepSeek-V3's layout).
    pub fp8: bool,
    /// `num_hidden_layers` instead of the preset's (the MTP layers come after them).
    pub layers: Option<usize>,
    /// Shards of at most this many bytes (`model-0000i-of-0000n.safetensors` with an
    /// index); `None` keeps the preset's layout.
    pub shard_bytes: Option<u64>,
    /// Merged into the config last (a JSON object).
    pub overrides: Value,
    /// Write the config, generation config and tokenizer only, no weights (for a server
    /// started with random weights: `--load-format dummy`).
    pub config_only: bool,
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
    generate_opts(name, out, &GenOptions { overrides: overrides.clone(), ..Default::default() }).map(|_| ())
}

/// The config.json [`generate_opts`] writes for `name` with `opts`.
pub fn config_for(name: &str, opts: &GenOptions) -> Result<Value> {
    let mut cfg = preset_config(name)?;
    let c = cfg.as_object_mut().ok_or_else(|| Error::config("preset", "not a JSON object"))?;
    if let Some(n) = opts.layers {
        c.insert("num_hidden_layers".into(), json!(n));
    }
    if opts.fp8 {
        c.insert(
            "quantization_config".into(),
            json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
        );
    }
    if let Some(o) = opts.overrides.as_object() {
        for (k, v) in o {
            c.insert(k.clone(), v.clone());
        }
    }
    Ok(cfg)
}

/// Writes preset `name` into `out` as `opts` say. Tensors are drawn and written a band
/// of rows at a time, so memory stays small whatever the widths (a V3 MoE layer is ~11 GB
/// in fp8); progress is logged through `tracing` as for a load.
pub fn generate_opts(name: &str, out: &Path, opts: &GenOptions) -> Result<write::Written> {
    let cfg_json = config_for(name, opts)?;
    let cfg = ModelConfig::from_json_str(&cfg_json.to_string())?;
    std::fs::create_dir_all(out).map_err(|e| Error::file(out, e.to_string()))?;
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
    if opts.config_only {
        return Ok(write::Written { files: Vec::new(), total_size: 0 });
    }
    let block = cfg.fp8.map_or([128, 128], |q| q.block);
    if block != [128, 128] {
        return Err(Error::config("quantization_config.weight_block_size", "gen-model writes 128 x 128 blocks only"));
    }
    let specs = plan::plan(&cfg, cfg.fp8.is_some());
    let layout = match (opts.shard_bytes, name) {
        (Some(b), _) => write::Layout::MaxBytes(b.max(1)),
        (None, "tiny-v3") => write::Layout::SplitAfterLayer0,
        (None, "deepseek-v3") => write::Layout::MaxBytes(DEFAULT_SHARD_BYTES),
        (None, _) => write::Layout::Single,
    };
    let total = write::planned_bytes(&specs, block);
    let progress = LoadProgress::new(format!("writing {}", out.display()), total);
    let written = write::write_checkpoint(out, &specs, seed_of(name), block, layout, Some(&progress))?;
    progress.finish();
    Ok(written)
}

/// deepseek-v3's default shard size (DeepSeek's own shards are ~4.3 GB).
pub const DEFAULT_SHARD_BYTES: u64 = 4 << 30;

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|e| Error::file(path, e.to_string()))?;
    std::fs::write(path, text + "\n").map_err(|e| Error::file(path, e.to_string()))
}

fn seed_of(name: &str) -> u64 {
    plan::fnv1a(name.as_bytes()) ^ 0x6d6c_6173_6572_7665
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
    use crate::{load_config, names, Tokenizer, Weights};

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

#[cfg(test)]
mod fp8_tests {
    use super::*;
    use crate::expected::{expected_tensors, Need};
    use crate::fp8::fp8_e4m3_to_f32;
    use crate::{load_config, names, Weights};
    use safetensors::tensor::Dtype;
    use std::collections::BTreeSet;

    fn fp8() -> GenOptions {
        GenOptions { fp8: true, ..Default::default() }
    }

    #[test]
    fn config_only_writes_the_config_and_tokenizer_and_no_weights() {
        let t = tempfile::tempdir().unwrap();
        let opts = GenOptions { fp8: true, layers: Some(61), config_only: true, ..Default::default() };
        let w = generate_opts("deepseek-v3", t.path(), &opts).unwrap();
        assert!(w.files.is_empty() && w.total_size == 0);
        let cfg = load_config(t.path()).unwrap();
        assert_eq!((cfg.num_hidden_layers, cfg.hidden_size, cfg.fp8.map(|q| q.block)), (61, 7168, Some([128, 128])));
        assert!(t.path().join("tokenizer.json").is_file() && t.path().join("generation_config.json").is_file());
        let files: Vec<_> = std::fs::read_dir(t.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(files.iter().all(|f| !f.to_string_lossy().contains("safetensors")), "{files:?}");
    }

    #[test]
    fn fp8_presets_open_with_deepseeks_layout() {
        for name in PRESETS {
            let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
            generate(name, a.path()).unwrap();
            generate_opts(name, b.path(), &fp8()).unwrap();
            let cfg = load_config(b.path()).unwrap();
            assert_eq!(cfg.fp8.map(|q| q.block), Some([128, 128]));
            let q: Value =
                serde_json::from_str(&std::fs::read_to_string(b.path().join("config.json")).unwrap()).unwrap();
            assert_eq!(
                q["quantization_config"],
                json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
            );
            // `open` checks the tensor set against config.json (scales included).
            let w8 = Weights::open(b.path(), cfg.fp8).unwrap();
            let w16 = Weights::open(a.path(), None).unwrap();
            let mut fp8_count = 0;
            for n in w16.names() {
                let shape = w16.shape(n).unwrap();
                let dt = w8.dtype(n).unwrap();
                let quantised = n.contains("_proj") && !n.contains("eh_proj");
                if !quantised {
                    assert_eq!(dt, Dtype::BF16, "{n} stays high precision");
                    assert!(w8.same_tensor(n, n).unwrap());
                    assert_eq!(w8.raw(n).unwrap().data, w16.raw(n).unwrap().data, "{n}: same bf16 bytes");
                    continue;
                }
                fp8_count += 1;
                assert_eq!(dt, Dtype::F8_E4M3, "{n}");
                let s = names::scale_of(n);
                assert_eq!(w8.dtype(&s).unwrap(), Dtype::F32);
                assert_eq!(w8.shape(&s).unwrap(), vec![shape[0].div_ceil(128), shape[1].div_ceil(128)], "{s}");
                // The fp8 weight is the bf16 preset's draw, quantised per 128 × 128 block.
                let t = w8.fp8_shard(n, [shape[0], shape[1]], None).unwrap();
                let want = w16.f32(n, &shape).unwrap();
                for (i, (&qb, &v)) in t.q.iter().zip(&want).enumerate() {
                    let deq = fp8_e4m3_to_f32(qb) * t.scale_at(i / shape[1], i % shape[1]);
                    let tol = v.abs() / 16.0 + t.scale_at(i / shape[1], i % shape[1]) * 2f32.powi(-9) + v.abs() / 128.0;
                    assert!((deq - v).abs() <= tol, "{n}[{i}]: {deq} vs {v}");
                }
                // Some code in every block reaches ±448 (the block's amax sets its scale).
                assert!(t.q.iter().any(|&b| b & 0x7f == 0x7e), "{n}");
            }
            assert!(fp8_count > 10, "{name}: {fp8_count} fp8 weights");
        }
    }

    #[test]
    fn a_sharded_index_round_trips() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        generate_opts("tiny-v3", a.path(), &fp8()).unwrap();
        let limit = 40_000;
        let opts = GenOptions { shard_bytes: Some(limit), ..fp8() };
        let written = generate_opts("tiny-v3", b.path(), &opts).unwrap();
        assert!(written.files.len() > 5, "{:?}", written.files);
        let n = written.files.len();
        for (i, f) in written.files.iter().enumerate() {
            assert_eq!(f, &format!("model-{:05}-of-{n:05}.safetensors", i + 1));
        }
        let index: Value =
            serde_json::from_str(&std::fs::read_to_string(b.path().join("model.safetensors.index.json")).unwrap())
                .unwrap();
        let map = index["weight_map"].as_object().unwrap();
        let cfg = load_config(b.path()).unwrap();
        let w = Weights::open(b.path(), cfg.fp8).unwrap();
        let w_two = Weights::open(a.path(), cfg.fp8).unwrap();
        assert_eq!(index["metadata"]["total_size"].as_u64(), Some(w.data_bytes()));
        assert_eq!(written.total_size, w.data_bytes());
        assert_eq!(w.data_bytes(), w_two.data_bytes());
        // Every tensor is where the index says, with the same bytes as the two-file layout.
        assert_eq!(map.len(), w.names().len());
        for name in w.names() {
            let file = map[name].as_str().unwrap();
            assert!(w.path_of(name).unwrap().ends_with(file), "{name}");
            assert_eq!(w.raw(name).unwrap().data, w_two.raw(name).unwrap().data, "{name}");
        }
        // Files stay under the limit unless one tensor alone is larger.
        for f in &written.files {
            let len = std::fs::metadata(b.path().join(f)).unwrap().len();
            let one = Weights::open_files(&[b.path().join(f)], None).unwrap();
            assert!(len <= limit + 16_384 || one.names().len() == 1, "{f}: {len} bytes");
        }
    }

    #[test]
    fn deepseek_v3_widths_plan_the_published_tensor_set_and_size() {
        let cfg_for = |layers: usize| {
            let opts = GenOptions { layers: Some(layers), ..fp8() };
            ModelConfig::from_json_str(&config_for("deepseek-v3", &opts).unwrap().to_string()).unwrap()
        };
        let cfg = cfg_for(61);
        let specs = plan::plan(&cfg, true);
        // The planned tensors are exactly those config.json reads (the MTP layer's own
        // embedding and head included, as DeepSeek ships them).
        let planned: BTreeSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        let want = expected_tensors(&cfg);
        let required: BTreeSet<&str> =
            want.iter().filter(|(_, n)| **n == Need::Required).map(|(k, _)| k.as_str()).collect();
        assert!(required.is_subset(&planned));
        assert!(planned.iter().all(|n| want.contains_key(*n)));
        // 671B parameters in the main model, 11.5B unique to the MTP layer (DeepSeek's
        // README_WEIGHTS); the fp8 weights and their scales make ~689 GB.
        let params = |mtp: bool| -> f64 {
            specs
                .iter()
                .filter(|s| s.name.starts_with("model.layers.61.") == mtp)
                .filter(|s| !s.name.ends_with("embed_tokens.weight") || !mtp)
                .filter(|s| !s.name.ends_with("shared_head.head.weight"))
                .map(|s| s.numel() as f64)
                .sum()
        };
        let main = params(false);
        assert!((670.5e9..671.5e9).contains(&main), "{main}");
        let mtp = params(true);
        // (The MTP block alone is 11.51B; eh_proj adds 0.10B.)
        assert!((11.5e9..11.7e9).contains(&mtp), "{mtp}");
        let bytes = write::planned_bytes(&specs, [128, 128]);
        eprintln!("deepseek-v3 fp8: main {main:.4e} params, MTP {mtp:.4e}, {bytes} bytes");
        assert!((688.0e9..689.5e9).contains(&(bytes as f64)), "{bytes}");
        // One dense layer is ~0.6 GB in fp8, one MoE layer ~11 GB.
        let layer_bytes = |l: usize| -> u64 {
            let p = format!("model.layers.{l}.");
            let one: Vec<_> = specs.iter().filter(|s| s.name.starts_with(&p)).cloned().collect();
            write::planned_bytes(&one, [128, 128])
        };
        assert!((0.5e9..0.7e9).contains(&(layer_bytes(0) as f64)), "{}", layer_bytes(0));
        assert!((11.0e9..11.8e9).contains(&(layer_bytes(3) as f64)), "{}", layer_bytes(3));
        // `--layers` changes the depth only.
        assert_eq!(cfg_for(4).num_hidden_layers, 4);
        assert_eq!(cfg_for(4).hidden_size, 7168);
    }
}
