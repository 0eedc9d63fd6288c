//! Dense projections `y = x Wᵀ` with bf16 weights and f32 accumulation: [`Linear`] (a
//! weight on the device) and [`Gemm`] (cuBLAS, or one of the batch-invariant kernels).
//!
//! cuBLAS picks its algorithm (tile shape, split-K) per problem size, so a token's output
//! can change in the last bits with the number of rows sharing the GEMM. The engine's
//! "greedy output with k = 3 equals k = 0" holds only if a token's logits do not depend
//! on its batch. Two modes guarantee that: [`GemmMode::InvariantTc`] on tensor cores
//! (`gemm_tc.cu`, a split-K fixed by the weight's shape: [`plan::tc_split`]) and
//! [`GemmMode::BatchInvariant`] on CUDA cores (one warp per output, slow).

use std::sync::Arc;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::kernels;
use crate::launch::{need, with_smem};
use crate::plan;
use crate::tensor_map::bf16_matrix_map;

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
    /// The batch-invariant CUDA-core kernel (`linear_inv`): a row's result never depends
    /// on the other rows; slow.
    BatchInvariant,
    /// Batch-invariant on tensor cores (`linear_tc`): mma.sync with a fixed k order and a
    /// split-K that depends on the weight's shape only ([`plan::tc_split`]).
    InvariantTc,
}

impl GemmMode {
    /// Whether a row's result is independent of the other rows of the call.
    pub fn batch_invariant(self) -> bool {
        self != GemmMode::Cublas
    }
}

/// Rows per `linear_tc` block (its columns per block and k granularity: [`plan::TC_BN`],
/// [`plan::TC_BK`]).
const TC_ROWS: usize = 64;
/// Bytes of f32 partials one `linear_tc` launch may write; more rows run in slabs.
const TC_PARTIAL_BYTES: usize = 64 << 20;
/// Rows and columns per block of `linear_tc_big`, the kernel of calls over
/// [`Gemm::large_from`] rows (same k order as `linear_tc`, so the same bits per row).
const TC_BIG: usize = 128;
/// `linear_tc_big`'s dynamic shared memory: 3 stages of 128 rows of x and of W, 64 bf16 each.
const TC_BIG_SMEM: usize = 3 * 2 * TC_BIG * plan::TC_BK * 2;
/// `linear_wgt*`'s dynamic shared memory for `rows` × 128 tiles: 5 stages of x and W rows
/// of 64 bf16, their 10 barriers, and 1024 bytes to align the swizzle atoms.
const fn wgt_smem(rows: usize) -> usize {
    5 * (rows + TC_BIG) * plan::TC_BK * 2 + 10 * 8 + 1024
}

/// `TcKernels::Auto` runs mma.sync up to this many rows (H200: at 8 rows it was 8% faster
/// over V3's projections than the TMA kernel, at 64 rows 18% slower).
pub const TC_SMALL_ROWS: usize = 16;

/// Which kernels run [`GemmMode::InvariantTc`]. Every one adds the same bf16 products in
/// the same k16 groups in the same order into f32; on an H200 mma.sync and wgmma round
/// them alike (`gpu_ops::gemm_matches_reference_and_invariant_mode_is_batch_invariant`
/// asserts it, 0 of 7.3 million outputs differ), which is what lets `Auto` choose by
/// row count and stay batch-invariant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TcKernels {
    /// Hopper: mma.sync (`linear_tc`) up to [`TC_SMALL_ROWS`] rows, where it measured
    /// fastest, wgmma with TMA above; mma.sync elsewhere.
    #[default]
    Auto,
    /// mma.sync (`linear_tc`, `linear_tc_big`): every GPU (the portable kernels).
    MmaSync,
    /// wgmma with TMA copies and a producer warpgroup (`linear_wgt*`) at every row count:
    /// Hopper.
    WgmmaTma,
}

impl TcKernels {
    /// Every choice, as [`TcKernels::name`] spells it.
    pub const ALL: [TcKernels; 3] = [TcKernels::Auto, TcKernels::MmaSync, TcKernels::WgmmaTma];

    pub fn name(self) -> &'static str {
        match self {
            TcKernels::Auto => "auto",
            TcKernels::MmaSync => "mma.sync",
            TcKernels::WgmmaTma => "tma",
        }
    }

    /// The choice called `name` (as [`TcKernels::name`] spells it).
    pub fn from_name(name: &str) -> Option<TcKernels> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// What runs on `gpu`: wgmma exists on Hopper (sm_90) only, mma.sync everywhere.
    pub fn resolve(self, gpu: &Gpu) -> Self {
        if gpu.compute_capability == (9, 0) {
            self
        } else {
            TcKernels::MmaSync
        }
    }
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
    tc_f32: CudaFunction,
    tc_bf16: CudaFunction,
    tc_reduce_f32: CudaFunction,
    tc_reduce_bf16: CudaFunction,
    tc_big_f32: CudaFunction,
    tc_big_bf16: CudaFunction,
    /// The TMA-fed warpgroup-MMA kernels (sm_90 only): 64-row tile [f32, bf16], 128-row
    /// tile [f32, bf16].
    wgt: Option<[CudaFunction; 4]>,
    /// The kernels of `InvariantTc` (resolved for the GPU: [`TcKernels::resolve`]); fixed
    /// at construction (a process's results stay batch-invariant only with one kind).
    tc_kernels: TcKernels,
    /// `linear_tc` runs its 128 × 128 tile (`linear_tc_big`) for calls of more rows than
    /// this, its 64 × 64 tile for the others (the same bits either way).
    pub large_from: usize,
    num_sms: usize,
    pub mode: GemmMode,
}

impl Gemm {
    /// cuBLAS on the GPU's stream plus the invariant kernels; `tc` picks the kernels of
    /// [`GemmMode::InvariantTc`].
    pub fn new(gpu: &Gpu, mode: GemmMode, tc_kernels: TcKernels) -> Result<Self> {
        let m = gpu.load_module(kernels::BACKEND_OPS)?;
        let tc = gpu.load_module(kernels::GEMM_TC)?;
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
            tc_f32: tc.load_function("linear_tc_bf16_of32")?,
            tc_bf16: tc.load_function("linear_tc_bf16_obf16")?,
            tc_big_f32: with_smem(&tc, "linear_tc_big_bf16_of32", TC_BIG_SMEM)?,
            tc_big_bf16: with_smem(&tc, "linear_tc_big_bf16_obf16", TC_BIG_SMEM)?,
            wgt: if gpu.compute_capability == (9, 0) {
                Some([
                    with_smem(&tc, "linear_wgt64_bf16_of32", wgt_smem(TC_ROWS))?,
                    with_smem(&tc, "linear_wgt64_bf16_obf16", wgt_smem(TC_ROWS))?,
                    with_smem(&tc, "linear_wgt128_bf16_of32", wgt_smem(TC_BIG))?,
                    with_smem(&tc, "linear_wgt128_bf16_obf16", wgt_smem(TC_BIG))?,
                ])
            } else {
                None
            },
            tc_kernels: tc_kernels.resolve(gpu),
            large_from: TC_ROWS,
            tc_reduce_f32: tc.load_function("linear_tc_reduce_of32")?,
            tc_reduce_bf16: tc.load_function("linear_tc_reduce_obf16")?,
            num_sms: gpu.num_sms,
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
        // linear_tc needs 16-byte rows; other widths keep the CUDA-core invariant kernel (a
        // choice by the weight's shape, so still batch-invariant).
        let mode = match self.mode {
            GemmMode::InvariantTc if !lin.inp.is_multiple_of(8) => GemmMode::BatchInvariant,
            m => m,
        };
        match mode {
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
            GemmMode::InvariantTc => {
                let (ksplit, kchunk) = plan::tc_split(lin.out, lin.inp, self.num_sms);
                // More rows than `large_from`: the 128 × 128 tile (the same bits per row).
                let large = m > self.large_from;
                let red = if T::BF16 { &self.tc_reduce_bf16 } else { &self.tc_reduce_f32 };
                let wg = match self.tc_kernels {
                    TcKernels::WgmmaTma => self.wgt.as_ref(),
                    TcKernels::Auto if m > TC_SMALL_ROWS => self.wgt.as_ref(),
                    TcKernels::Auto | TcKernels::MmaSync => None,
                };
                let tma = wg.is_some();
                let f = match (wg, T::BF16, large) {
                    (None, true, false) => &self.tc_bf16,
                    (None, false, false) => &self.tc_f32,
                    (None, true, true) => &self.tc_big_bf16,
                    (None, false, true) => &self.tc_big_f32,
                    (Some(w), bf, large) => &w[2 * large as usize + bf as usize],
                };
                let (tile_rows, tile_cols, threads, smem) = match (tma, large) {
                    (false, false) => (TC_ROWS, plan::TC_BN, 128, 0),
                    (false, true) => (TC_BIG, TC_BIG, 256, TC_BIG_SMEM),
                    (true, false) => (TC_ROWS, TC_BIG, 256, wgt_smem(TC_ROWS)),
                    (true, true) => (TC_BIG, TC_BIG, 384, wgt_smem(TC_BIG)),
                };
                // The weight's tensor map (TMA kernels): its rows in boxes of a column tile.
                let tw = if tma { Some(bf16_matrix_map(wp, lin.inp, lin.out, tile_cols as u32)?) } else { None };
                let col_blocks = lin.out.div_ceil(tile_cols);
                if col_blocks > 65_535 {
                    return Err(CudaError::shape(K, "too many columns for linear_tc"));
                }
                // The warpgroup kernels run a weight's k ranges one after another in one
                // block (`seq`, the same bits as the partials' reduce) when the row tiles
                // alone fill the chip: no partials in memory.
                let seq = wg.is_some() && ksplit > 1 && m.div_ceil(tile_rows) * col_blocks >= self.num_sms;
                let split = if seq { 1 } else { ksplit };
                // Rows per launch: all of them without partials, else as many row tiles as
                // fit TC_PARTIAL_BYTES of partials.
                let slab = if split == 1 {
                    m
                } else {
                    (TC_PARTIAL_BYTES / (split * lin.out * 4)).max(tile_rows) / tile_rows * tile_rows
                };
                let mut part = if split > 1 {
                    // SAFETY: every element a launch's reduce reads (ksplit × rows × out) is
                    // written by that launch's linear_tc first (each block stores all of its
                    // rows < rows and columns < out, zeros for an empty k range).
                    Some(unsafe { s.alloc::<f32>(split * slab.min(m) * lin.out) }?)
                } else {
                    None
                };
                // The partials' pointer, or null without split-K (the kernel then writes y).
                let (pp, _gp) = match part.as_mut() {
                    Some(p) => {
                        let (ptr, g) = p.device_ptr_mut(s);
                        (ptr, Some(g))
                    }
                    None => (0, None),
                };
                let (kc, ks, seq_i) = (kchunk as i32, split as u32, seq as i32);
                let in_bytes = std::mem::size_of::<bf16>() as u64;
                let out_bytes = std::mem::size_of::<T>() as u64;
                let mut r0 = 0;
                while r0 < m {
                    let rows = slab.min(m - r0);
                    let chunks = rows.div_ceil(tile_rows);
                    if chunks > u32::MAX as usize {
                        return Err(CudaError::shape(K, "too many rows for linear_tc"));
                    }
                    let ri = rows as i32;
                    let xr = xp + r0 as u64 * lin.inp as u64 * in_bytes;
                    let yr = yp + r0 as u64 * lin.out as u64 * out_bytes;
                    let cfg = LaunchConfig {
                        grid_dim: (chunks as u32, ks, col_blocks as u32),
                        block_dim: (threads, 1, 1),
                        shared_mem_bytes: smem as u32,
                    };
                    let tx = match tw {
                        Some(_) => Some(bf16_matrix_map(xr, lin.inp, rows, tile_rows as u32)?),
                        None => None,
                    };
                    let mut launch = s.launch_builder(f);
                    match (&tx, &tw) {
                        (Some(tx), Some(tw)) => {
                            launch.arg(tx).arg(tw).arg(&yr).arg(&pp).arg(&ri).arg(&ni).arg(&ki).arg(&kc).arg(&seq_i)
                        }
                        _ => launch.arg(&yr).arg(&pp).arg(&xr).arg(&wp).arg(&ri).arg(&ni).arg(&ki).arg(&kc),
                    };
                    // SAFETY: linear_tc_*/linear_tc_big_*(y, part, x, w, m, n, k, kchunk)
                    // and linear_wgt*(tx, tw, y, part, m, n, k,
                    // kchunk, seq) (tensor maps of exactly these x rows and w, made just
                    // above; with their dynamic shared memory, allowed at load) read x rows r0.. (rows × inp, in bounds: r0 + rows <= m,
                    // lengths checked above) and w (out × inp). With grid.y = 1 (part null)
                    // they write y[row][col] for row < rows, col < out only (linear_wgt with
                    // seq = 1 runs every k range itself); with grid.y = ksplit > 1 block
                    // (.., ks, ..) writes part[ks][row][col] (ksplit × rows × out f32, within
                    // the ksplit × slab × out allocation) and never y. Rows are 16-byte
                    // aligned: inp % 8 == 0, cudarc buffers are 256-byte aligned, and k
                    // ranges start at multiples of 64.
                    unsafe { launch.launch(cfg) }?;
                    if split > 1 {
                        let len = (rows * lin.out) as u64;
                        let blocks = (rows * lin.out).div_ceil(4 * 256);
                        let rcfg = LaunchConfig {
                            grid_dim: (blocks as u32, 1, 1),
                            block_dim: (256, 1, 1),
                            shared_mem_bytes: 0,
                        };
                        let ksi = split as i32;
                        // SAFETY: linear_tc_reduce_*(y, part, len, ksplit) reads part[ks][i]
                        // for i < len = rows × out (written just above on this stream) and
                        // writes y[i], i < len: y rows r0.. are within m × out (checked).
                        unsafe { s.launch_builder(red).arg(&yr).arg(&pp).arg(&len).arg(&ksi).launch(rcfg) }?;
                    }
                    r0 += rows;
                }
            }
        }
        Ok(())
    }
}
