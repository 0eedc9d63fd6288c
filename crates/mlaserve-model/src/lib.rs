//! mlaserve-model: everything about a checkpoint on disk.
//!
//! [`weights`] memory-maps safetensors files (single or sharded), checks names, shapes
//! and dtypes, dequantises fp8 block-scaled weights and reads only a tensor-parallel
//! rank's slice, and refuses a checkpoint with tensors its `config.json` does not use
//! ([`expected`]). [`names`] is the one place that spells HF weight names. [`tokenizer`]
//! wraps `tokenizer.json` and the EOS ids. [`presets`] writes deterministic random
//! checkpoints (`mlaserve gen-model`) used by tests and benchmarks.

pub mod expected;
pub mod fp8;
#[cfg(test)]
mod fp8_load_tests;
pub mod names;
pub mod presets;
pub mod progress;
pub mod tokenizer;
pub mod weights;

pub use fp8::Fp8Tensor;
pub use progress::{LoadProgress, ProgressSnapshot};
pub use safetensors::Dtype;
pub use tokenizer::Tokenizer;
pub use weights::{RawView, Shard, Weights};

use mlaserve_core::{ModelConfig, Result};
use std::path::Path;

/// What identifies the model in `dir` between processes: fingerprints of its
/// `config.json` and `tokenizer.json` bytes (64-bit FNV-1a, hex; empty when the file is
/// absent). A router compares them with each worker group's before it sends the group
/// any request. Not a cryptographic hash: it tells models apart, it does not
/// authenticate them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprints {
    pub config: String,
    pub tokenizer: String,
}

impl Fingerprints {
    pub fn of_dir(dir: &Path) -> Fingerprints {
        let of = |name: &str| std::fs::read(dir.join(name)).map(|b| fingerprint(&b)).unwrap_or_default();
        Fingerprints { config: of("config.json"), tokenizer: of("tokenizer.json") }
    }
}

/// 64-bit FNV-1a of `bytes`, as 16 hex digits.
pub fn fingerprint(bytes: &[u8]) -> String {
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    format!("{h:016x}")
}

/// Loads and validates `<dir>/config.json`; every error names the file.
pub fn load_config(dir: &Path) -> Result<ModelConfig> {
    ModelConfig::from_file(&dir.join("config.json"))
}
