//! Which backend a worker group runs on, and starting its engine.

use mlaserve_core::SingleRank;
use mlaserve_engine::{EngineConfig, EngineHandle};
use mlaserve_model::progress::LoadProgress;
use std::path::PathBuf;
use std::sync::Arc;

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
    #[command(flatten)]
    pub cuda: CudaFlags,
    /// Where the weights come from: `auto` reads the checkpoint; `dummy` makes random
    /// weights of the config's shapes on the GPU (fp8 where the config's
    /// `quantization_config` says so) without reading any, as vLLM's flag of the same
    /// name: for measuring a model whose checkpoint is not at hand (`gen-model
    /// --config-only` writes its directory). CUDA backend only.
    #[arg(long, value_enum, default_value_t = LoadFormat::Auto)]
    pub load_format: LoadFormat,
    /// How the latent cache is stored (vLLM's flag of the same name): `auto`, the
    /// backend's own precision (bf16 on the GPU, f32 on the CPU), or `fp8`, DeepSeek's
    /// layout: the latent channels as e4m3 with an f32 scale per 128, the RoPE channels in
    /// bf16 (656 bytes a token and layer at V3's widths, 0.57× bf16), quantised when
    /// written. The CPU backend computes the format's rounding; the CUDA backend stores
    /// and reads its bytes (the decode kernel's fp8 path needs an sm_90 GPU).
    #[arg(long, value_enum, default_value_t = KvCacheDtypeArg::Auto)]
    pub kv_cache_dtype: KvCacheDtypeArg,
}

/// `--kv-cache-dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvCacheDtypeArg {
    /// The backend's own precision.
    Auto,
    /// DeepSeek's fp8 layout.
    Fp8,
}

/// Where a worker's weights come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LoadFormat {
    /// The checkpoint's safetensors files.
    #[default]
    Auto,
    /// Random weights of the config's shapes, made on the GPU.
    Dummy,
}

/// The tensor-core kernels of the batch-invariant projections and the MoE experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LinearTc {
    /// mma.sync up to 16 rows, wgmma with TMA above (Hopper; mma.sync elsewhere).
    #[default]
    Auto,
    /// mma.sync at every row count (every GPU).
    #[value(name = "mma.sync")]
    MmaSync,
    /// wgmma with TMA at every row count (Hopper).
    Tma,
}

/// The expanded-form (prefill) attention kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PrefillKernelArg {
    /// mma.sync (every GPU).
    #[value(name = "mma.sync")]
    MmaSync,
    /// wgmma, K/V by cp.async (Hopper).
    Wgmma,
    /// wgmma, K/V by TMA where the head widths are DeepSeek's, else cp.async (Hopper).
    #[default]
    Tma,
}

/// A CUDA graph's stream capture mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum GraphCapture {
    #[default]
    ThreadLocal,
    Relaxed,
}

/// Kernel choices and experimental switches of the CUDA backend (for comparisons and
/// diagnosis; the defaults are the production choices). Kernels without wgmma fall back
/// to mma.sync on GPUs other than Hopper.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CudaFlags {
    /// CUDA backend: the tensor-core kernels of the batch-invariant projections and of
    /// the MoE experts. All round alike (asserted by the GEMM test), so `auto` chooses by
    /// row count and stays batch-invariant.
    #[arg(long, value_enum, default_value_t = LinearTc::Auto)]
    pub linear_tc: LinearTc,
    /// CUDA backend: the prefill (expanded-form) attention kernel. They agree to rounding,
    /// not in bits: keep one for the runs whose outputs are compared.
    #[arg(long, value_enum, default_value_t = PrefillKernelArg::Tma)]
    pub prefill_kernel: PrefillKernelArg,
    /// CUDA backend: the stream capture mode of the CUDA graphs (`relaxed` to diagnose a
    /// capture that fails).
    #[arg(long, value_enum, default_value_t = GraphCapture::ThreadLocal)]
    pub graph_capture: GraphCapture,
    /// CUDA backend: widen an fp8 checkpoint's projections and experts to bf16 at load
    /// (the dequantised model: twice the weight memory) instead of running them on the
    /// fp8 GEMMs.
    #[arg(long)]
    pub dequantize_fp8: bool,
    /// CUDA backend: bring each MTP stage's drafts back to the host before the next
    /// stage instead of keeping a drafting pass's drafts on the device (for comparisons).
    #[arg(long)]
    pub drafts_to_host: bool,
    /// CUDA backend, tensor parallelism: all-reduces of at most this many bytes take the
    /// one-shot kernel over peer memory (NVLink) instead of NCCL, where every GPU of the
    /// group reaches the others directly (bit for bit the ordered all-reduce). Default
    /// 2 MiB; 0: NCCL for every all-reduce.
    #[arg(long, value_name = "BYTES")]
    pub peer_all_reduce_bytes: Option<usize>,
    /// CUDA backend, tensor parallelism: of those, all-reduces of at most this many bytes
    /// take the one-shot lines kernel (each value sent beside the call number, no
    /// barrier: the lowest latency, at twice the bytes; the same bits). Default 256 KiB;
    /// 0: the flag-barrier kernel at every size.
    #[arg(long, value_name = "BYTES")]
    pub peer_lines_bytes: Option<usize>,
}

impl CudaFlags {
    /// `o` with these choices.
    #[cfg(feature = "cuda")]
    pub fn apply(&self, o: mlaserve_cuda::CudaOptions) -> mlaserve_cuda::CudaOptions {
        use mlaserve_cuda::linear::TcKernels;
        use mlaserve_cuda::prefill::PrefillKernel;
        mlaserve_cuda::CudaOptions {
            linear_tc: match self.linear_tc {
                LinearTc::Auto => TcKernels::Auto,
                LinearTc::MmaSync => TcKernels::MmaSync,
                LinearTc::Tma => TcKernels::WgmmaTma,
            },
            prefill_kernel: match self.prefill_kernel {
                PrefillKernelArg::MmaSync => PrefillKernel::MmaSync,
                PrefillKernelArg::Wgmma => PrefillKernel::Wgmma,
                PrefillKernelArg::Tma => PrefillKernel::WgmmaTma,
            },
            fp8_kernels: !self.dequantize_fp8,
            keep_drafts: !self.drafts_to_host,
            peer_all_reduce: match self.peer_all_reduce_bytes {
                None => o.peer_all_reduce,
                Some(0) => None,
                b => b,
            },
            peer_lines_bytes: self.peer_lines_bytes.unwrap_or(o.peer_lines_bytes),
            graph_capture: match self.graph_capture {
                GraphCapture::ThreadLocal => mlaserve_cuda::CaptureMode::ThreadLocal,
                GraphCapture::Relaxed => mlaserve_cuda::CaptureMode::Relaxed,
            },
            ..o
        }
    }

    /// These flags as command-line arguments (for the processes of a group started by
    /// rank 0).
    #[cfg(any(feature = "cuda", test))]
    pub fn to_args(&self) -> Vec<String> {
        use clap::ValueEnum;
        let name = |v: Option<clap::builder::PossibleValue>| v.map(|p| p.get_name().to_string()).unwrap_or_default();
        let mut a = vec![
            "--linear-tc".to_string(),
            name(self.linear_tc.to_possible_value()),
            "--prefill-kernel".to_string(),
            name(self.prefill_kernel.to_possible_value()),
            "--graph-capture".to_string(),
            name(self.graph_capture.to_possible_value()),
        ];
        if self.dequantize_fp8 {
            a.push("--dequantize-fp8".to_string());
        }
        if self.drafts_to_host {
            a.push("--drafts-to-host".to_string());
        }
        if let Some(b) = self.peer_all_reduce_bytes {
            a.push(format!("--peer-all-reduce-bytes={b}"));
        }
        if let Some(b) = self.peer_lines_bytes {
            a.push(format!("--peer-lines-bytes={b}"));
        }
        a
    }
}

impl BackendArgs {
    /// The CPU backend's options for a cache of `num_blocks` blocks.
    pub fn cpu_options(&self, num_blocks: usize) -> mlaserve_cpu::CpuOptions {
        mlaserve_cpu::CpuOptions { num_blocks, kv_cache_dtype: self.kv_dtype(), ..Default::default() }
    }

    /// `--kv-cache-dtype`.
    pub fn kv_dtype(&self) -> mlaserve_core::KvCacheDtype {
        match self.kv_cache_dtype {
            KvCacheDtypeArg::Auto => mlaserve_core::KvCacheDtype::Auto,
            KvCacheDtypeArg::Fp8 => mlaserve_core::KvCacheDtype::Fp8,
        }
    }

    /// The CUDA backend's options on GPU `ordinal`: `--kv-blocks` blocks, or the cache
    /// sized from the device's memory (`--gpu-memory-utilization`).
    #[cfg(feature = "cuda")]
    pub fn cuda_options(&self, engine: &mlaserve_worker::EngineArgs, ordinal: usize) -> mlaserve_cuda::CudaOptions {
        let base = mlaserve_cuda::CudaOptions {
            gpu_memory_utilization: engine.kv_blocks.is_none().then_some(engine.gpu_memory_utilization),
            profile_tokens: engine.max_batch_tokens,
            ..mlaserve_cuda::CudaOptions::new(engine.kv_blocks.unwrap_or(1), ordinal)
        };
        let o = mlaserve_cuda::CudaOptions {
            graphs: !self.enforce_eager,
            kv_cache_dtype: self.kv_dtype(),
            ..self.cuda.apply(base)
        };
        if self.batch_invariant {
            o.batch_invariant()
        } else {
            o
        }
    }
}

/// The CUDA backend of one rank (`tp`: its group) on `model`: the checkpoint's weights, or
/// random ones of the config's shapes (`LoadFormat::Dummy`; fp8 when the config says so).
#[cfg(feature = "cuda")]
pub fn load_cuda(
    model: &std::path::Path,
    opts: mlaserve_cuda::CudaOptions,
    tp: Option<&mlaserve_cuda::TpInit>,
    format: LoadFormat,
    progress: Option<Arc<LoadProgress>>,
) -> mlaserve_core::Result<mlaserve_cuda::CudaBackend> {
    let be = match (format, progress) {
        (LoadFormat::Dummy, _) => {
            let cfg = mlaserve_model::load_config(model)?;
            let opts = mlaserve_cuda::CudaOptions { synthetic_fp8: cfg.fp8.is_some(), ..opts };
            tracing::info!(fp8 = opts.synthetic_fp8, "--load-format dummy: random weights, made on the GPU");
            mlaserve_cuda_lab::random::random_backend(cfg, opts, 1, tp)
        }
        (LoadFormat::Auto, Some(p)) => mlaserve_cuda::CudaBackend::load_tp_observed(model, opts, tp, p),
        (LoadFormat::Auto, None) => mlaserve_cuda::CudaBackend::load_tp(model, opts, tp),
    };
    be.map_err(|e| mlaserve_core::Error::Backend(e.to_string()))
}

#[cfg(feature = "cuda")]
fn gpu_present(ordinal: usize) -> bool {
    mlaserve_cuda::Gpu::new(ordinal).is_ok()
}

/// Starts the engine of a single-rank group on the chosen backend.
pub async fn spawn_engine(
    b: &BackendArgs,
    model: PathBuf,
    engine: &mlaserve_worker::EngineArgs,
    progress: Arc<LoadProgress>,
) -> anyhow::Result<EngineHandle> {
    let cfg = engine.engine_config();
    #[cfg(feature = "cuda")]
    {
        let use_gpu = match b.backend {
            BackendKind::Cuda => true,
            BackendKind::Auto => gpu_present(b.cuda_device),
            BackendKind::Cpu => false,
        };
        if use_gpu {
            let ordinal = b.cuda_device;
            let cfg = engine.gpu_engine_config();
            tracing::info!(ordinal, graphs = !b.enforce_eager, "worker group on the CUDA backend");
            let opts = b.cuda_options(engine, ordinal);
            let format = b.load_format;
            let make = move || load_cuda(&model, opts, None, format, Some(progress));
            return Ok(EngineHandle::spawn(make, cfg).await?);
        }
    }
    #[cfg(not(feature = "cuda"))]
    if b.backend == BackendKind::Cuda {
        anyhow::bail!(
            "--backend cuda: this build has no CUDA; rebuild with `cargo build --release -p mlaserve --features cuda`"
        );
    }
    anyhow::ensure!(
        b.load_format == LoadFormat::Auto,
        "--load-format dummy: random weights are made on the GPU; this group runs on the CPU backend"
    );
    tracing::info!("worker group on the CPU backend");
    let cfg = cpu_config(cfg);
    let opts = b.cpu_options(engine.kv_blocks_or_default());
    let make = move || mlaserve_cpu::CpuBackend::load_observed(&model, opts, Box::new(SingleRank), progress);
    Ok(EngineHandle::spawn(make, cfg).await?)
}

/// Prompt tokens per step while others decode, on the CPU backend: about a third of a
/// second of prefill with the bundled model on two cores, so a long prompt cannot stall
/// the other streams for seconds (`--max-prefill-tokens` overrides it).
pub const CPU_MAX_PREFILL_TOKENS: usize = 128;

/// The CPU backend's defaults where the flags left them open.
fn cpu_config(mut cfg: EngineConfig) -> EngineConfig {
    cfg.max_prefill_tokens.get_or_insert(CPU_MAX_PREFILL_TOKENS);
    cfg
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

    /// Random weights are made on the GPU: a CPU group refuses `--load-format dummy` with
    /// a message naming the flag, before it reads anything.
    #[test]
    fn dummy_weights_are_refused_on_the_cpu_backend() {
        let b = Cli::try_parse_from(["mlaserve", "--backend", "cpu", "--load-format", "dummy"]).expect("flags").b;
        assert_eq!(b.load_format, LoadFormat::Dummy);
        let engine = mlaserve_worker::EngineArgs::default();
        let progress = Arc::new(LoadProgress::new("test", 0));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let Err(e) = rt.block_on(spawn_engine(&b, PathBuf::from("/nonexistent"), &engine, progress)) else {
            panic!("--load-format dummy on the CPU backend was accepted")
        };
        assert!(e.to_string().contains("--load-format dummy"), "{e}");
        assert!(Cli::try_parse_from(["mlaserve", "--load-format", "random"]).is_err());
    }

    /// `--kv-cache-dtype fp8` reaches both backends' options.
    #[test]
    fn kv_cache_dtype_reaches_the_cpu_backend() {
        let parse = |args: &[&str]| Cli::try_parse_from([&["mlaserve"], args].concat()).map(|c| c.b);
        let fp8 = parse(&["--kv-cache-dtype", "fp8"]).expect("flags");
        let o = fp8.cpu_options(7);
        assert_eq!((o.num_blocks, o.kv_cache_dtype), (7, mlaserve_core::KvCacheDtype::Fp8));
        let auto = parse(&[]).expect("defaults");
        assert_eq!(auto.cpu_options(7).kv_cache_dtype, mlaserve_core::KvCacheDtype::Auto);
        assert!(parse(&["--kv-cache-dtype", "fp16"]).is_err());
        #[cfg(feature = "cuda")]
        {
            let engine = mlaserve_worker::EngineArgs::default();
            assert_eq!(fp8.cuda_options(&engine, 0).kv_cache_dtype, mlaserve_core::KvCacheDtype::Fp8);
            assert_eq!(auto.cuda_options(&engine, 0).kv_cache_dtype, mlaserve_core::KvCacheDtype::Auto);
        }
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

    #[test]
    fn cuda_flags_parse_and_round_trip() {
        let parse = |args: &[&str]| Cli::try_parse_from([&["mlaserve"], args].concat()).map(|c| c.b.cuda);
        let d = parse(&[]).expect("defaults");
        assert_eq!((d.linear_tc, d.prefill_kernel), (LinearTc::Auto, PrefillKernelArg::Tma));
        assert_eq!((d.graph_capture, d.dequantize_fp8, d.drafts_to_host), (GraphCapture::ThreadLocal, false, false));
        assert_eq!((d.peer_all_reduce_bytes, d.peer_lines_bytes), (None, None));
        let args = [
            "--linear-tc",
            "mma.sync",
            "--prefill-kernel",
            "wgmma",
            "--graph-capture",
            "relaxed",
            "--dequantize-fp8",
            "--drafts-to-host",
            "--peer-all-reduce-bytes",
            "65536",
            "--peer-lines-bytes",
            "0",
        ];
        let f = parse(&args).expect("flags");
        assert_eq!((f.peer_all_reduce_bytes, f.peer_lines_bytes), (Some(65536), Some(0)));
        assert_eq!((f.linear_tc, f.prefill_kernel), (LinearTc::MmaSync, PrefillKernelArg::Wgmma));
        assert!(f.dequantize_fp8 && f.to_args().contains(&"--dequantize-fp8".to_string()));
        assert!(f.drafts_to_host && f.to_args().contains(&"--drafts-to-host".to_string()));
        assert_eq!(f.graph_capture, GraphCapture::Relaxed);
        let again = f.to_args();
        let g = parse(&again.iter().map(String::as_str).collect::<Vec<_>>()).expect("round trip");
        assert_eq!(g.to_args(), again);
        assert!(parse(&["--linear-tc", "wgmma"]).is_err(), "the cp.async GEMM kernels are gone");
    }
}
