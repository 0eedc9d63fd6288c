//! [`CudaOptions`]: how a [`super::CudaBackend`] runs (kernel choices, CUDA graphs,
//! batch invariance), set by the command line's flags; its presets name what they
//! guarantee.

use mlaserve_core::KvCacheDtype;

use super::route::PrefillPath;
use crate::linear::{GemmMode, TcKernels};
use crate::prefill::PrefillKernel;

/// Construction options.
#[derive(Debug, Clone, Copy)]
pub struct CudaOptions {
    /// Physical blocks of [`mlaserve_core::BLOCK_SIZE`] tokens in every layer's latent cache.
    pub num_blocks: usize,
    /// Device ordinal.
    pub ordinal: usize,
    pub gemm: GemmMode,
    /// Use the FlashMLA-style decode kernel for uniform decode windows (≤ 4 tokens).
    /// Off, every row goes through the varlen kernel, whose result for a token does not
    /// depend on the window length or the batch.
    pub decode_kernel: bool,
    /// Tensor parallelism's all-reduce in a fixed order (all-gather, then a rank-ordered
    /// sum) instead of NCCL's, so results do not depend on the batch (batch-invariant mode).
    pub ordered_all_reduce: bool,
    /// Which sequences take the expanded form of MLA (prefill chunks by default).
    pub prefill: PrefillPath,
    /// Run decode steps (uniform windows of 1 to 4 tokens) as CUDA graphs, one per batch
    /// bucket and window length (`graphs.rs`); off, every step is launched kernel by kernel
    /// (vLLM's `enforce_eager`). They need the decode kernel, so the batch-invariant mode
    /// runs eagerly either way. Tensor-parallel ranks capture their collectives too.
    pub graphs: bool,
    /// The stream capture mode of the graphs (thread-local unless relaxed).
    pub graph_capture: CaptureMode,
    /// Most graphs held at once ([`crate::layout::MAX_GRAPHS`] by default). At the cap a
    /// new shape takes the place of the least recently used graph that has gone unused
    /// for [`crate::layout::GRAPH_IDLE_STEPS`] graph steps, else it runs eagerly.
    pub max_graphs: usize,
    /// The tensor-core kernels of [`GemmMode::InvariantTc`] and of the MoE experts
    /// ([`TcKernels::Auto`]: by row count on Hopper; the others for comparisons).
    pub linear_tc: TcKernels,
    /// The expanded-form attention kernel ([`PrefillKernel::WgmmaTma`] by default;
    /// mma.sync where the GPU has no wgmma).
    pub prefill_kernel: PrefillKernel,
    /// Decode-kernel splits of this many pages each, from the start of every request
    /// ([`crate::MlaDecode::set_fixed_splits`]: batch-invariant decode attention); None:
    /// the planner's, which depend on the batch.
    pub decode_split_blocks: Option<usize>,
    /// Size the KV cache from the device's memory instead of `num_blocks`: after the
    /// weights and a profiling forward of `profile_tokens` prompt tokens, the cache takes
    /// what is left of this fraction of the device's memory, less a reserve for the
    /// decode graphs (`CudaBackend::memory_plan`). `None`: `num_blocks` blocks.
    pub gpu_memory_utilization: Option<f64>,
    /// The largest step's tokens (the engine's `max_batch_tokens`), for that profile.
    pub profile_tokens: usize,
    /// Keep a checkpoint's fp8 projections and experts in fp8 and run them on the
    /// block-scaled fp8 GEMMs (activations quantised per token per 128 channels, as the
    /// CPU backend's fp8 semantics); off, they are widened to bf16 at load (the
    /// dequantised model, twice the memory).
    pub fp8_kernels: bool,
    /// [`super::CudaBackend::synthetic`] makes its projections and experts fp8 (random
    /// codes and block scales) instead of bf16: V3's real memory footprint.
    pub synthetic_fp8: bool,
    /// The latent cache's layout: bf16 (`Auto`), or fp8 entries of 656 bytes at V3's
    /// widths (`kernels/kv_fp8.cuh`: c_kv as e4m3 with per-128 f32 scales, k_pe bf16),
    /// quantised when written, as the CPU backend's fp8 cache.
    pub kv_cache_dtype: KvCacheDtype,
    /// A drafting pass's drafts stay on the device between its MTP stages
    /// (`Backend::keeps_drafts`), so the stages run back to back and the host waits once
    /// per pass; off, every stage's ids come back to the host. Tensor-parallel ranks
    /// keep them where the group runs on the one-shot collectives (`peer_all_reduce`):
    /// each rank picks the ids from the all-gathered maxima on the device.
    pub keep_drafts: bool,
    /// Tensor parallelism's all-reduces of at most this many bytes take the one-shot
    /// kernel over peer memory (`peer.rs`: one launch, a flag barrier, a sum in rank order
    /// that equals the ordered all-reduce bit for bit) instead of NCCL, where every GPU
    /// of the group reaches the others directly ([`PEER_ALL_REDUCE_BYTES`] by default).
    /// None: NCCL only.
    pub peer_all_reduce: Option<usize>,
    /// Of those, the messages of at most this many bytes take the lines kernel (each
    /// value pushed beside the call number: no barrier, the lowest latency, twice the
    /// bytes; the same bits); [`PEER_LINES_BYTES`] by default, 0 for the flag barrier at
    /// every size.
    pub peer_lines_bytes: usize,
}

/// The largest all-reduce of the one-shot kernel by default: a decode step's hidden
/// states up to 64 rows at V3's width (64 × 7168 × 4 bytes is 1.75 MiB). Each rank holds
/// twice `world` slots of it (8 MiB at TP 2, 32 MiB at TP 8).
pub const PEER_ALL_REDUCE_BYTES: usize = 2 << 20;

/// The largest all-reduce of the one-shot lines kernel by default: 256 KiB (a step's
/// hidden states up to 9 rows at V3's width), each rank holding twice `world` slots of
/// 512 KiB of lines.
pub const PEER_LINES_BYTES: usize = 256 << 10;

/// Pages per decode split in [`CudaOptions::batch_invariant`] (1024 tokens): enough CTAs
/// for a batch of long requests, few partials to merge.
pub const INVARIANT_SPLIT_BLOCKS: usize = 16;

/// How a CUDA graph's stream capture treats other threads' CUDA calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CaptureMode {
    /// Only this thread's unsafe calls are prohibited during the capture (the default).
    #[default]
    ThreadLocal,
    /// Nothing is prohibited (for diagnosing a capture that fails).
    Relaxed,
}

impl CudaOptions {
    pub fn new(num_blocks: usize, ordinal: usize) -> Self {
        CudaOptions {
            num_blocks,
            ordinal,
            gemm: GemmMode::Cublas,
            decode_kernel: true,
            ordered_all_reduce: false,
            prefill: PrefillPath::Auto,
            graphs: true,
            graph_capture: CaptureMode::ThreadLocal,
            max_graphs: crate::layout::MAX_GRAPHS,
            linear_tc: TcKernels::Auto,
            prefill_kernel: PrefillKernel::WgmmaTma,
            decode_split_blocks: None,
            gpu_memory_utilization: None,
            profile_tokens: 2048,
            fp8_kernels: true,
            synthetic_fp8: false,
            kv_cache_dtype: KvCacheDtype::Auto,
            keep_drafts: true,
            peer_all_reduce: Some(PEER_ALL_REDUCE_BYTES),
            peer_lines_bytes: PEER_LINES_BYTES,
        }
    }
    /// Every token's result independent of its batch, on the fast kernels: the
    /// tensor-core invariant GEMM ([`GemmMode::InvariantTc`]), the decode kernel with
    /// fixed-size splits ([`INVARIANT_SPLIT_BLOCKS`]), the ordered all-reduce, CUDA graphs.
    /// Greedy output with speculation then equals output without it, token for token.
    ///
    /// The form of MLA follows what a chunk is ([`PrefillPath::Flagged`]): prefill chunks,
    /// of any length, take the expanded form, whose kernel walks every row's keys in tiles
    /// from key 0 (so a row's sums do not depend on where its chunk starts); decode windows
    /// take the decode kernel, whose fixed splits make a token's sums the same in a window
    /// of 4 and as a single token. A sequence recomputed after preemption prefills its
    /// generated tokens, so those can differ in the last bits from their first pass.
    pub fn batch_invariant(mut self) -> Self {
        self.gemm = GemmMode::InvariantTc;
        self.decode_kernel = true;
        self.decode_split_blocks = Some(INVARIANT_SPLIT_BLOCKS);
        self.ordered_all_reduce = true;
        self.prefill = PrefillPath::Flagged;
        self
    }
    /// Every token's result independent of its batch on CUDA cores (slow; the fallback
    /// where the fast kernels are missing): the CUDA-core invariant GEMM, no decode kernel,
    /// every row in the absorbed form. The expanded kernel is batch-invariant itself, but
    /// the choice of form is made by a chunk's length, and the scheduler sizes prefill
    /// chunks by what else is in the step: a prompt's tail could take the absorbed form in
    /// one batch and the expanded one in another, and the two forms round differently.
    pub fn batch_invariant_cuda_cores(mut self) -> Self {
        self.gemm = GemmMode::BatchInvariant;
        self.decode_kernel = false;
        self.ordered_all_reduce = true;
        self.prefill = PrefillPath::Absorbed;
        self
    }
}
