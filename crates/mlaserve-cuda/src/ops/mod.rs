//! [`Ops`]: typed wrappers of `kernels/backend_ops.cu` (and the head-wise and expert
//! tensor-core kernels of `gemm_tc.cu`), the per-token kernels of the backend's forward
//! pass, one file per family: [`rows`] (embedding, f32 RMSNorm, adds, rank sums),
//! [`gather`] (row gathers), [`attn`] (RoPE + paged latent write, query absorption, varlen
//! absorbed attention, W_UV) and [`moe`] (routing, the router's logits through
//! [`Router`], expert GEMMs, combine).
//!
//! Every wrapper checks the lengths of the buffers it is handed against what its kernel
//! touches, then launches on the given stream; buffers are anything cudarc can give a
//! device pointer for (slices and views), so callers can address sub-ranges.

pub mod attn;
pub mod gather;
pub mod moe;
pub mod rows;

use cudarc::driver::{CudaFunction, LaunchConfig};
use mlaserve_core::KvCacheDtype;

use crate::error::Result;
use crate::gpu::Gpu;
use crate::kernels;
use crate::launch::with_smem;
use crate::linear::TcKernels;
use crate::router::Router;

pub use gather::GatherInto;
pub use moe::{ExpertWeights, GroupedVariant, RouteParams};

/// The loaded functions of `backend_ops.cu`.
#[derive(Debug)]
pub struct Ops {
    embed: CudaFunction,
    norm_f32: CudaFunction,
    norm_bf16: CudaFunction,
    add_norm: CudaFunction,
    add: CudaFunction,
    sum_ranks: CudaFunction,
    interleave: CudaFunction,
    grouped_bf16: CudaFunction,
    grouped_f32: CudaFunction,
    grouped_staged_bf16: CudaFunction,
    grouped_staged_f32: CudaFunction,
    grouped_tc_bf16: CudaFunction,
    grouped_tc_f32: CudaFunction,
    /// The TMA-fed warpgroup-MMA experts (sm_90 only) [bf16, f32].
    grouped_wgt: Option<[CudaFunction; 2]>,
    /// `Auto` runs the tensor-core experts on wgmma where the GPU has it, unless the
    /// dense projections are held to mma.sync ([`TcKernels::MmaSync`]).
    pub wgmma: bool,
    moe_sort: CudaFunction,
    to_bf16: CudaFunction,
    /// By [`GatherInto::KERNEL`].
    gather: [CudaFunction; 3],
    gather_q8: CudaFunction,
    copy_ids: CudaFunction,
    kv_write: CudaFunction,
    /// The fp8 cache's writer and varlen reader (`kernels/kv_fp8.cu`).
    kv_write_fp8: CudaFunction,
    attn_fp8: CudaFunction,
    kv_fill_fp8: CudaFunction,
    /// The latent cache's layout: bf16, or fp8 entries (`kernels/kv_fp8.cuh`).
    kv_fp8: bool,
    q_absorb: CudaFunction,
    heads_tc: CudaFunction,
    heads_tc_reduce: CudaFunction,
    heads_tc_reduce_quant: CudaFunction,
    attn: CudaFunction,
    wuv: CudaFunction,
    route: CudaFunction,
    combine: CudaFunction,
    router: Router,
    num_sms: usize,
    max_smem: usize,
}

impl Ops {
    /// Loads the kernels; `tc_kernels` is the dense projections' tensor-core choice, which the
    /// expert GEMMs follow.
    pub fn new(gpu: &Gpu, tc_kernels: TcKernels) -> Result<Self> {
        let m = gpu.load_module(kernels::BACKEND_OPS)?;
        let f = |n: &str| m.load_function(n);
        let tc = gpu.load_module(kernels::GEMM_TC)?;
        let heads = gpu.load_module(kernels::HEADS_TC)?;
        let kv8 = gpu.load_module(kernels::KV_FP8)?;
        Ok(Ops {
            embed: f("embed_gather_f32")?,
            norm_f32: f("rmsnorm_f32_of32")?,
            norm_bf16: f("rmsnorm_f32_obf16")?,
            add_norm: f("add_rmsnorm_f32")?,
            add: f("add_f32")?,
            sum_ranks: f("sum_ranks_f32")?,
            interleave: f("interleave_ranks_f32")?,
            grouped_bf16: f("moe_grouped_bf16_obf16")?,
            grouped_f32: f("moe_grouped_bf16_of32")?,
            grouped_staged_bf16: f("moe_grouped_staged_bf16_obf16")?,
            grouped_staged_f32: f("moe_grouped_staged_bf16_of32")?,
            grouped_tc_bf16: tc.load_function("moe_grouped_tc_bf16_obf16")?,
            grouped_tc_f32: tc.load_function("moe_grouped_tc_bf16_of32")?,
            grouped_wgt: if gpu.compute_capability == (9, 0) {
                let f = |n: &str| with_smem(&tc, n, moe::GROUPED_WGT_SMEM);
                Some([f("moe_grouped_wgt_bf16_obf16")?, f("moe_grouped_wgt_bf16_of32")?])
            } else {
                None
            },
            wgmma: tc_kernels.resolve(gpu) != TcKernels::MmaSync,
            moe_sort: f("moe_sort")?,
            to_bf16: f("to_bf16_f32")?,
            gather: [f(gather::KERNELS[0])?, f(gather::KERNELS[1])?, f(gather::KERNELS[2])?],
            gather_q8: f("gather_rows_q8")?,
            copy_ids: f("copy_ids")?,
            kv_write: f("kv_cache_write_bf16")?,
            kv_write_fp8: kv8.load_function("kv_cache_write_fp8")?,
            attn_fp8: kv8.load_function("mla_attn_varlen_fp8")?,
            kv_fill_fp8: kv8.load_function("kv_fill_fp8")?,
            kv_fp8: false,
            q_absorb: f("q_absorb_f32")?,
            heads_tc: heads.load_function("heads_tc")?,
            heads_tc_reduce: heads.load_function("heads_tc_reduce")?,
            heads_tc_reduce_quant: heads.load_function("heads_tc_reduce_quant")?,
            attn: f("mla_attn_varlen_f32")?,
            wuv: f("wuv_f32_obf16")?,
            route: f("moe_route_f32")?,
            combine: f("moe_combine_f32")?,
            router: Router::new(gpu)?,
            num_sms: gpu.num_sms,
            max_smem: gpu.max_smem_optin,
        })
    }

    /// Selects the latent cache's layout that [`Ops::kv_write`] writes and
    /// [`Ops::attn_varlen`] reads (bf16 until set).
    pub fn set_kv_cache_dtype(&mut self, dtype: KvCacheDtype) {
        self.kv_fp8 = dtype == KvCacheDtype::Fp8;
    }

    fn grid_stride(&self) -> LaunchConfig {
        crate::launch::grid_stride(self.num_sms, 4)
    }
}
