//! mlaserve-model: everything about a checkpoint on disk.
//!
//! [`weights`] memory-maps safetensors files (single or sharded), checks names, shapes
//! and dtypes, dequantises fp8 block-scaled weights and reads only a tensor-parallel
//! rank's slice, and refuses a checkpoint with tensors its `config.json` does not use
//! ([`expected`]). [`names`] is the one place that spells HF weight names. [`tokenizer`]
//! wraps `tokenizer.json` and the EOS ids. [`presets`] writes deterministic random
//! checkpoints (`mlaserve gen-model`) used by tests and benchmarks.

pub mod expected;
pub mod names;
pub mod presets;
pub mod tokenizer;
pub mod weights;

pub use tokenizer::Tokenizer;
pub use weights::{Shard, Weights};

use mlaserve_core::{ModelConfig, Result};
use std::path::Path;

/// Loads and validates `<dir>/config.json`; every error names the file.
pub fn load_config(dir: &Path) -> Result<ModelConfig> {
    ModelConfig::from_file(&dir.join("config.json"))
}
