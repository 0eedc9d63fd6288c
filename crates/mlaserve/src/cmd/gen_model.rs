//! `mlaserve gen-model`: deterministic random-weight checkpoints (tests, benchmarks).

use anyhow::Context;
use mlaserve_model::presets;
use std::path::PathBuf;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Preset name (tiny-v3, tiny-v2).
    #[arg(long)]
    preset: String,
    /// Output directory (created if missing).
    #[arg(long)]
    out: PathBuf,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    presets::generate(&a.preset, &a.out)
        .with_context(|| format!("--preset {}: writing {}", a.preset, a.out.display()))?;
    println!("wrote preset {} to {}", a.preset, a.out.display());
    Ok(())
}
