//! Dense projections `y = x Wᵀ` with bf16 weights and f32 accumulation: [`Linear`] (a
//! weight on the device) and [`Gemm`] (cuBLAS, or the batch-invariant kernel of
//! `backend_ops.cu`).
//!
//! cuBLAS picks its algorithm (tile shape, split-K) per problem size, so a token's output
//! can change in the last bits with the number of rows sharing the GEMM. The engine's
//! "greedy output with k = 3 equals k = 0" holds only if a token's logits do not depend
//! on its batch; [`GemmMode::BatchInvariant`] guarantees that (one warp per output, a
//! fixed reduction order) at the cost of speed.

use std::sync::Arc;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::kernels;
use crate::ops::need;

/// A weight `[out][inp]` (row-major, bf16) on the device.
#[derive(Debug)]
pub struct Linear {
    pub w: CudaSlice<bf16>,
    pub out: usize,
    pub inp: usize,
}

impl Linear {
    /// Uploads an f32 host weight `[out][inp]` as bf16 (round to nearest even).
    pub fn from_f32(s: &Arc<CudaStream>, w: &[f32], out: usize, inp: usize) -> Result<Self> {
        if w.len() != out * inp {
            return Err(CudaError::shape("Linear", format!("{} values for [{out}, {inp}]", w.len())));
        }
        let b: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        Ok(Linear { w: s.clone_htod(&b)?, out, inp })
    }
}

/// How dense projections run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GemmMode {
    /// cuBLAS `GemmEx`, bf16 inputs, f32 compute (the fast path).
    #[default]
    Cublas,
    /// The batch-invariant kernel: a row's result never depends on the other rows.
    BatchInvariant,
}

/// Output element of a projection: f32 (residual stream, logits) or bf16 (the next
/// GEMM's input).
pub trait GemmOut: cudarc::driver::DeviceRepr {
    const CUDA_TYPE: cudaDataType;
    const BF16: bool;
}
impl GemmOut for f32 {
    const CUDA_TYPE: cudaDataType = cudaDataType::CUDA_R_32F;
    const BF16: bool = false;
}
impl GemmOut for bf16 {
    const CUDA_TYPE: cudaDataType = cudaDataType::CUDA_R_16BF;
    const BF16: bool = true;
}

/// Bytes of cuBLAS workspace (what cuBLAS recommends for Hopper).
const CUBLAS_WORKSPACE: usize = 32 << 20;

/// Runs projections on one stream (its cuBLAS handle is bound to that stream).
#[derive(Debug)]
pub struct Gemm {
    blas: CudaBlas,
    /// cuBLAS's workspace, ours for the handle's life: a GEMM then never allocates, which
    /// a stream being captured into a CUDA graph forbids.
    _workspace: CudaSlice<u8>,
    inv_f32: CudaFunction,
    inv_bf16: CudaFunction,
    pub mode: GemmMode,
}

impl Gemm {
    pub fn new(gpu: &Gpu, mode: GemmMode) -> Result<Self> {
        let m = gpu.load_module(kernels::BACKEND_OPS)?;
        let blas = CudaBlas::new(gpu.stream.clone())?;
        let workspace = gpu.stream.alloc_zeros::<u8>(CUBLAS_WORKSPACE)?;
        {
            let (ptr, _sync) = workspace.device_ptr(&gpu.stream);
            // SAFETY: the handle is live; the workspace is a device allocation of that many
            // bytes that lives as long as the handle (both owned by this Gemm) and is used
            // only on the handle's stream. (Set after the stream: setting a stream resets it.)
            unsafe { cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, CUBLAS_WORKSPACE) }
                .result()?;
        }
        Ok(Gemm {
            blas,
            _workspace: workspace,
            inv_f32: m.load_function("linear_inv_bf16_of32")?,
            inv_bf16: m.load_function("linear_inv_bf16_obf16")?,
            mode,
        })
    }

    /// `y[m][out] = x[m][inp] · lin.wᵀ` on `s` (which must be the stream the handle was
    /// made with, the rank's stream).
    pub fn forward<T: GemmOut>(
        &self,
        s: &Arc<CudaStream>,
        lin: &Linear,
        x: &impl DevicePtr<bf16>,
        m: usize,
        y: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        const K: &str = "gemm";
        need(K, "x", x.len(), m * lin.inp)?;
        need(K, "y", y.len(), m * lin.out)?;
        if m == 0 {
            return Ok(());
        }
        let big = |v: usize| v > i32::MAX as usize;
        if big(m) || big(lin.out) || big(lin.inp) {
            return Err(CudaError::shape(K, "dimension overflows i32"));
        }
        let (mi, ni, ki) = (m as i32, lin.out as i32, lin.inp as i32);
        let (xp, _g1) = x.device_ptr(s);
        let (wp, _g2) = lin.w.device_ptr(s);
        let (yp, _g3) = y.device_ptr_mut(s);
        match self.mode {
            GemmMode::Cublas => {
                let (alpha, beta) = (1f32, 0f32);
                // Column-major view: yᵀ[out][m] = W[out][inp] (stored as inpxout, transposed)
                // · xᵀ (inp x m, ld inp); yᵀ has ld out, i.e. y row-major [m][out].
                // SAFETY: A = W holds out*inp bf16, B = x holds >= m*inp bf16, C = y holds
                // >= m*out elements of T (checked above); alpha/beta are f32 host scalars as
                // CUBLAS_COMPUTE_32F requires; the handle runs on stream `s`.
                unsafe {
                    cudarc::cublas::result::gemm_ex(
                        *self.blas.handle(),
                        cublasOperation_t::CUBLAS_OP_T,
                        cublasOperation_t::CUBLAS_OP_N,
                        ni,
                        mi,
                        ki,
                        (&alpha) as *const f32 as *const _,
                        wp as *const _,
                        cudaDataType::CUDA_R_16BF,
                        ki,
                        xp as *const _,
                        cudaDataType::CUDA_R_16BF,
                        ki,
                        (&beta) as *const f32 as *const _,
                        yp as *mut _,
                        T::CUDA_TYPE,
                        ni,
                        cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }?;
            }
            GemmMode::BatchInvariant => {
                let f = if T::BF16 { &self.inv_bf16 } else { &self.inv_f32 };
                let cfg = LaunchConfig {
                    grid_dim: (lin.out.div_ceil(8) as u32, m.div_ceil(4) as u32, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                if m.div_ceil(4) > 65_535 {
                    return Err(CudaError::shape(K, "too many rows for the invariant kernel"));
                }
                // SAFETY: linear_inv_*(y, x, w, m, n, k): warp (col, row) reads x[row*k..][..k]
                // and w[col*k..][..k], writes y[row*n + col] for row < m, col < n; lengths
                // checked above; 16-byte loads only when k % 8 == 0 (row starts then stay
                // 16-byte aligned: cudarc buffers are 256-byte aligned, and callers' views
                // start at multiples of k elements).
                unsafe { s.launch_builder(f).arg(&yp).arg(&xp).arg(&wp).arg(&mi).arg(&ni).arg(&ki).launch(cfg) }?;
            }
        }
        Ok(())
    }
}
