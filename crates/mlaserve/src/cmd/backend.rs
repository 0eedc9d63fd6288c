//! Which backend a worker group runs on, and starting its engine.

use mlaserve_engine::{EngineConfig, EngineHandle};
use std::path::PathBuf;

/// The compute backend of a worker group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// The GPU when this build has CUDA (`--features cuda`) and a GPU is present, else CPU.
    Auto,
    /// The f32 CPU reference backend.
    Cpu,
    /// The CUDA backend (needs a build with `--features cuda`).
    Cuda,
}

/// `--backend` for commands that run a worker group.
#[derive(Debug, Clone, clap::Args)]
pub struct BackendArgs {
    /// Compute backend of the worker group.
    #[arg(long, value_enum, default_value_t = BackendKind::Auto)]
    pub backend: BackendKind,
    /// CUDA device of the group (single-rank groups).
    #[arg(long = "cuda-device", default_value_t = 0)]
    pub cuda_device: usize,
    /// CUDA backend: launch every kernel of a decode step from the host instead of
    /// replaying a CUDA graph per batch bucket (vLLM's flag of the same name).
    #[arg(long)]
    pub enforce_eager: bool,
    /// CUDA backend: batch-invariant kernels (the default): tensor-core GEMMs with a
    /// split-K fixed by the weight, decode attention in fixed-size splits, prefill chunks
    /// always in the expanded form. A token's result never depends on what shares its
    /// step, so greedy output with speculation equals output without it, token for token.
    /// `--batch-invariant false` takes cuBLAS and the batch-sized decode plan instead.
    /// On one H200 (docs/PERFORMANCE.md) decode steps are then 2–11% shorter and prefill
    /// 15–18% shorter, but 8 of 64 greedy requests differed between k = 3 and k = 0 on
    /// tiny-v3.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1,
          default_missing_value = "true", value_name = "BOOL")]
    pub batch_invariant: bool,
}

impl BackendArgs {
    /// The CUDA backend's options for a cache of `kv_blocks` on GPU `ordinal`.
    #[cfg(feature = "cuda")]
    pub fn cuda_options(&self, kv_blocks: usize, ordinal: usize) -> mlaserve_cuda::CudaOptions {
        let o = mlaserve_cuda::CudaOptions {
            graphs: !self.enforce_eager,
            ..mlaserve_cuda::CudaOptions::new(kv_blocks, ordinal)
        };
        if self.batch_invariant {
            o.exact()
        } else {
            o
        }
    }
}

#[cfg(feature = "cuda")]
fn gpu_present(ordinal: usize) -> bool {
    mlaserve_cuda::Gpu::new(ordinal).is_ok()
}

/// Starts the engine of a single-rank group on the chosen backend.
pub async fn spawn_engine(
    b: &BackendArgs,
    model: PathBuf,
    kv_blocks: usize,
    cfg: EngineConfig,
) -> anyhow::Result<EngineHandle> {
    #[cfg(feature = "cuda")]
    {
        let use_gpu = match b.backend {
            BackendKind::Cuda => true,
            BackendKind::Auto => gpu_present(b.cuda_device),
            BackendKind::Cpu => false,
        };
        if use_gpu {
            let ordinal = b.cuda_device;
            tracing::info!(ordinal, graphs = !b.enforce_eager, "worker group on the CUDA backend");
            let opts = b.cuda_options(kv_blocks, ordinal);
            let make = move || {
                mlaserve_cuda::CudaBackend::load_with(&model, opts)
                    .map_err(|e| mlaserve_core::Error::Backend(e.to_string()))
            };
            return Ok(EngineHandle::spawn(make, cfg).await?);
        }
    }
    #[cfg(not(feature = "cuda"))]
    if b.backend == BackendKind::Cuda {
        anyhow::bail!(
            "--backend cuda: this build has no CUDA; rebuild with `cargo build --release -p mlaserve --features cuda`"
        );
    }
    tracing::info!("worker group on the CPU backend");
    Ok(EngineHandle::spawn(move || mlaserve_cpu::CpuBackend::load(&model, kv_blocks), cfg).await?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        b: BackendArgs,
    }

    #[test]
    fn batch_invariant_is_the_default() {
        let on = |args: &[&str]| Cli::try_parse_from([&["mlaserve"], args].concat()).expect("parses").b.batch_invariant;
        assert!(on(&[]), "on unless asked otherwise");
        assert!(on(&["--batch-invariant"]));
        assert!(on(&["--batch-invariant", "true"]));
        assert!(!on(&["--batch-invariant", "false"]));
        assert!(!on(&["--batch-invariant=false"]));
        assert!(Cli::try_parse_from(["mlaserve", "--batch-invariant", "maybe"]).is_err());
    }
}
