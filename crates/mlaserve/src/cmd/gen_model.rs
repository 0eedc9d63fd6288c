//! `mlaserve gen-model`: deterministic random-weight checkpoints (tests, benchmarks), in
//! bf16 or in DeepSeek's fp8 layout, at the tiny presets' widths or DeepSeek-V3's.

use anyhow::Context;
use mlaserve_model::presets::{self, GenOptions};
use std::path::PathBuf;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Preset name: tiny-v3, tiny-v2, or deepseek-v3 (V3's real widths; pick the depth
    /// with --layers: each dense layer is ~0.6 GB in fp8, each MoE layer ~11.6 GB).
    #[arg(long)]
    preset: String,
    /// Output directory (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// Store the attention and MLP projections as fp8 e4m3 with 128 x 128 F32
    /// weight_scale_inv blocks and declare quantization_config, as DeepSeek-V3 ships.
    #[arg(long)]
    fp8: bool,
    /// Decoder layers (num_hidden_layers) instead of the preset's; the MTP layers follow.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000))]
    layers: Option<u32>,
    /// Split the weights into shards of at most this many MiB with a
    /// model.safetensors.index.json (default: the preset's layout; 4096 for deepseek-v3).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    shard_size_mb: Option<u64>,
    /// Write config.json, generation_config.json and the tokenizer only, no weights: the
    /// model directory of a server started with `--load-format dummy` (random weights on
    /// the GPU), e.g. the full DeepSeek-V3 where the disk cannot hold its 688 GB.
    #[arg(long)]
    config_only: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let opts = GenOptions {
        fp8: a.fp8,
        layers: a.layers.map(|n| n as usize),
        shard_bytes: a.shard_size_mb.map(|mb| mb << 20),
        overrides: serde_json::json!({}),
        config_only: a.config_only,
    };
    let w = presets::generate_opts(&a.preset, &a.out, &opts)
        .with_context(|| format!("--preset {}: writing {}", a.preset, a.out.display()))?;
    if a.config_only {
        println!("wrote preset {}'s config and tokenizer to {} (no weights)", a.preset, a.out.display());
        return Ok(());
    }
    println!(
        "wrote preset {} to {} ({} file{}, {:.3} GB of weights{})",
        a.preset,
        a.out.display(),
        w.files.len(),
        if w.files.len() == 1 { "" } else { "s" },
        w.total_size as f64 / 1e9,
        if a.fp8 { ", fp8" } else { "" }
    );
    Ok(())
}
