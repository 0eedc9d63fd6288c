//! [`Ops`]: typed wrappers of `kernels/backend_ops.cu`, the per-token kernels of the
//! backend's forward pass (embedding, f32 RMSNorm, adds and gathers, RoPE + paged latent
//! write, query absorption, varlen absorbed attention, W_UV, MoE routing and combine; the
//! router's logits through [`Router`]).
//!
//! Every wrapper checks the lengths of the buffers it is handed against what its kernel
//! touches, then launches on the given stream; buffers are anything cudarc can give a
//! device pointer for (slices and views), so callers can address sub-ranges.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::kernels;
use crate::linear::GemmMode;
use crate::router::Router;

pub use crate::layout::AttnMeta;

/// Fails with a shape error unless `len >= want`.
pub(crate) fn need(kernel: &'static str, what: &str, len: usize, want: usize) -> Result<()> {
    if len < want {
        return Err(CudaError::shape(kernel, format!("{what} has {len} elements, needs {want}")));
    }
    Ok(())
}

pub(crate) fn i32_of(kernel: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::shape(kernel, format!("{v} overflows i32")))
}

fn rows_cfg(rows: usize, threads: u32, smem: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem as u32 }
}

/// One `heads_tc` call: `m` rows of `heads` heads, `k` inputs and `n` outputs per head,
/// row strides (elements) of x and y, and W's layout per head: `[k][n]` (W_UK) when
/// `w_kn`, else `[n][k]` (W_UV).
struct HeadsTc {
    m: usize,
    heads: usize,
    k: usize,
    n: usize,
    x_stride: usize,
    y_stride: usize,
    w_kn: bool,
}

/// Whether `heads_tc` (kernels/gemm_tc.cu) takes these widths: 16-byte rows of x and W,
/// pairs of outputs.
fn heads_tc_takes(k: usize, n: usize, x_stride: usize, y_stride: usize) -> bool {
    k.is_multiple_of(8) && n.is_multiple_of(8) && x_stride.is_multiple_of(4) && y_stride.is_multiple_of(2)
}

fn head_cfg(heads: usize, rows: usize, threads: u32, smem: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (heads as u32, rows as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem as u32 }
}

/// The device addresses of one projection (gate_up or down) of every routed expert, for
/// [`Ops::moe_grouped_sorted`]. The weights must outlive it (the owning `Moe` keeps both).
#[derive(Debug)]
pub struct ExpertWeights {
    pub ptrs: CudaSlice<u64>,
    /// Each weight's TMA tensor map (128 bytes: 16 words per expert; box 64 of k × 128
    /// rows), for `moe_grouped_wgt_*`; `None` where the driver would not encode them.
    maps: Option<CudaSlice<u64>>,
    pub count: usize,
    pub out: usize,
    pub inp: usize,
}

impl ExpertWeights {
    /// The table of `weights` (all `[out][inp]`).
    pub fn new(s: &Arc<CudaStream>, weights: &[&crate::linear::Linear]) -> Result<Self> {
        let (out, inp) = weights.first().map_or((0, 0), |l| (l.out, l.inp));
        if weights.iter().any(|l| l.out != out || l.inp != inp) {
            return Err(CudaError::shape("moe_grouped", "experts of different shapes"));
        }
        let ptrs: Vec<u64> = weights.iter().map(|l| l.w.device_ptr(s).0).collect();
        // Tensor maps need 16-byte rows; a weight whose map cannot be encoded leaves the
        // TMA kernel out (the other kernels take every shape).
        let maps = if !ptrs.is_empty() && inp.is_multiple_of(8) {
            let words: std::result::Result<Vec<u64>, _> = ptrs
                .iter()
                .map(|&p| {
                    crate::mla_decode::bf16_tensor_map(p, &[inp as u64, out as u64], &[(inp * 2) as u64], &[64, 128])
                        .map(|m| m.0.opaque)
                })
                .collect::<std::result::Result<Vec<_>, _>>()
                .map(|v| v.concat());
            match words {
                Ok(w) => Some(s.clone_htod(&w)?),
                Err(_) => None,
            }
        } else {
            None
        };
        let ptrs = s.clone_htod(if ptrs.is_empty() { &[0u64][..] } else { &ptrs })?;
        Ok(ExpertWeights { ptrs, maps, count: weights.len(), out, inp })
    }
}

/// How [`Ops::moe_grouped_sorted`] reads the activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupedVariant {
    /// Each warp reads its rows from global memory (best with few rows per expert).
    Direct,
    /// The block stages its rows in shared memory (best with several rows per expert).
    Staged,
    /// mma.sync tensor cores (`gemm_tc.cu`): fast, and a row's sum never depends on the
    /// expert's other rows, but its sums are not `linear_inv`'s, so not for
    /// [`GemmMode::BatchInvariant`].
    TensorCore,
    /// Hopper's warpgroup MMA (`moe_grouped_wg_*`): 64 rows × 128 columns per tile; a
    /// row's sum never depends on the expert's other rows, and equals `TensorCore`'s bit
    /// for bit on an H200 (asserted by the tensor-core experts test).
    Wgmma,
    /// Hopper's warpgroup MMA fed by TMA (`moe_grouped_wgt_*`): up to 192 rows of an
    /// expert per pass over its weight, 128 columns per block; the same bits as `Wgmma`.
    WgmmaTma,
    /// By the backend's GEMM mode: [`GroupedVariant::TensorCore`] (or `Wgmma` on Hopper) in
    /// [`GemmMode::Cublas`] and [`GemmMode::InvariantTc`]; in [`GemmMode::BatchInvariant`]
    /// `Direct` or `Staged` by the average rows per expert (both sum as the invariant GEMM
    /// does).
    Auto(GemmMode),
}

/// Routing parameters of one MoE layer, as the kernel takes them.
#[derive(Debug, Clone, Copy)]
pub struct RouteParams {
    pub experts: usize,
    pub k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    /// 0 greedy, 1 group_limited_greedy, 2 noaux_tc.
    pub method: i32,
    /// 0 sigmoid, 1 softmax.
    pub scoring: i32,
    pub normalise: bool,
    pub scale: f32,
}

/// Experts per token `moe_combine_f32` takes (its shared order of the slots).
const COMBINE_MAX_K: usize = 32;

/// `moe_grouped_wg_*`'s dynamic shared memory: 4 stages of 64 rows of x and 128 of W, 64
/// bf16 each, and 1024 bytes to align them.
const GROUPED_WG_SMEM: usize = 4 * (64 + 128) * 64 * 2 + 1024;

/// `moe_grouped_wgt_*`'s dynamic shared memory: 5 stages of 128 rows of W and 192 of x,
/// 64 bf16 each, a full and an empty barrier per stage, and 1024 bytes to align them.
const GROUPED_WGT_SMEM: usize = 1024 + 5 * (128 + 192) * 64 * 2 + 5 * 16;

/// The loaded functions of `backend_ops.cu`.
#[derive(Debug)]
pub struct Ops {
    embed: CudaFunction,
    norm_f32: CudaFunction,
    norm_bf16: CudaFunction,
    add: CudaFunction,
    sum_ranks: CudaFunction,
    interleave: CudaFunction,
    grouped_bf16: CudaFunction,
    grouped_f32: CudaFunction,
    grouped_staged_bf16: CudaFunction,
    grouped_staged_f32: CudaFunction,
    grouped_tc_bf16: CudaFunction,
    grouped_tc_f32: CudaFunction,
    /// The warpgroup-MMA experts (sm_90 only) [bf16, f32].
    grouped_wg: Option<[CudaFunction; 2]>,
    /// The TMA-fed warpgroup-MMA experts (sm_90 only) [bf16, f32].
    grouped_wgt: Option<[CudaFunction; 2]>,
    /// `Auto` runs the tensor-core experts on wgmma where the GPU has it (as
    /// [`crate::linear::Gemm::tc_kernels`]; `MLASERVE_LINEAR_TC=mma.sync` turns both off).
    pub wgmma: bool,
    moe_sort: CudaFunction,
    to_bf16: CudaFunction,
    gather_f32: CudaFunction,
    gather_f32_bf16: CudaFunction,
    gather_bf16: CudaFunction,
    kv_write: CudaFunction,
    q_absorb: CudaFunction,
    heads_tc: CudaFunction,
    attn: CudaFunction,
    wuv: CudaFunction,
    route: CudaFunction,
    combine: CudaFunction,
    router: Router,
    num_sms: usize,
    max_smem: usize,
}

impl Ops {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let m = gpu.load_module(kernels::BACKEND_OPS)?;
        let f = |n: &str| m.load_function(n);
        let tc = gpu.load_module(kernels::GEMM_TC)?;
        Ok(Ops {
            embed: f("embed_gather_f32")?,
            norm_f32: f("rmsnorm_f32_of32")?,
            norm_bf16: f("rmsnorm_f32_obf16")?,
            add: f("add_f32")?,
            sum_ranks: f("sum_ranks_f32")?,
            interleave: f("interleave_ranks_f32")?,
            grouped_bf16: f("moe_grouped_bf16_obf16")?,
            grouped_f32: f("moe_grouped_bf16_of32")?,
            grouped_staged_bf16: f("moe_grouped_staged_bf16_obf16")?,
            grouped_staged_f32: f("moe_grouped_staged_bf16_of32")?,
            grouped_tc_bf16: tc.load_function("moe_grouped_tc_bf16_obf16")?,
            grouped_tc_f32: tc.load_function("moe_grouped_tc_bf16_of32")?,
            grouped_wg: if gpu.compute_capability == (9, 0) {
                let f = |n: &str| crate::linear::with_smem(&tc, n, GROUPED_WG_SMEM);
                Some([f("moe_grouped_wg_bf16_obf16")?, f("moe_grouped_wg_bf16_of32")?])
            } else {
                None
            },
            grouped_wgt: if gpu.compute_capability == (9, 0) {
                let f = |n: &str| crate::linear::with_smem(&tc, n, GROUPED_WGT_SMEM);
                Some([f("moe_grouped_wgt_bf16_obf16")?, f("moe_grouped_wgt_bf16_of32")?])
            } else {
                None
            },
            wgmma: crate::linear::TcKernels::for_gpu(gpu) != crate::linear::TcKernels::MmaSync,
            moe_sort: f("moe_sort")?,
            to_bf16: f("to_bf16_f32")?,
            gather_f32: f("gather_rows_f32")?,
            gather_f32_bf16: f("gather_rows_f32_obf16")?,
            gather_bf16: f("gather_rows_bf16")?,
            kv_write: f("kv_cache_write_bf16")?,
            q_absorb: f("q_absorb_f32")?,
            heads_tc: tc.load_function("heads_tc")?,
            attn: f("mla_attn_varlen_f32")?,
            wuv: f("wuv_f32_obf16")?,
            route: f("moe_route_f32")?,
            combine: f("moe_combine_f32")?,
            router: Router::from_module(&m, gpu.num_sms)?,
            num_sms: gpu.num_sms,
            max_smem: gpu.max_smem_optin,
        })
    }

    /// `out[r] = table[tokens[r] - lo]` (`[n][h]` f32), zero outside `[lo, lo + rows)` and,
    /// when `zero_pos0`, where `positions[r] == 0`.
    #[allow(clippy::too_many_arguments)]
    pub fn embed(
        &self,
        s: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<f32>,
        table: &CudaSlice<bf16>,
        tokens: &CudaSlice<i32>,
        positions: &CudaSlice<i32>,
        h: usize,
        lo: usize,
        rows: usize,
        zero_pos0: bool,
    ) -> Result<()> {
        const K: &str = "embed_gather_f32";
        let n = tokens.len();
        need(K, "positions", positions.len(), n)?;
        need(K, "out", out.len(), n * h)?;
        need(K, "table", table.len(), rows * h)?;
        if n == 0 {
            return Ok(());
        }
        let (hi, loi, ri, z) = (i32_of(K, h)?, i32_of(K, lo)?, i32_of(K, rows)?, zero_pos0 as i32);
        let (o, _g) = out.device_ptr_mut(s);
        // SAFETY: block r reads tokens[r], positions[r] (n entries each), writes out[r*h..][..h]
        // (out holds n*h), and reads table row tokens[r]-lo only when it lies in [0, rows)
        // (table holds rows*h).
        unsafe {
            s.launch_builder(&self.embed)
                .arg(&o)
                .arg(table)
                .arg(tokens)
                .arg(positions)
                .arg(&hi)
                .arg(&loi)
                .arg(&ri)
                .arg(&z)
                .launch(rows_cfg(n, 256, 0))
        }?;
        Ok(())
    }

    /// RMSNorm of `rows` rows of width `dim` (x row stride `x_stride`) into f32 `out`
    /// (row stride `out_stride`).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_f32(
        &self,
        s: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<f32>,
        out_stride: usize,
        x: &impl DevicePtr<f32>,
        x_stride: usize,
        w: &CudaSlice<f32>,
        rows: usize,
        eps: f32,
    ) -> Result<()> {
        self.norm(s, &self.norm_f32, out, out_stride, x, x_stride, w, rows, eps)
    }

    /// As [`Ops::rmsnorm_f32`] with a bf16 output (a GEMM's input).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_bf16(
        &self,
        s: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<bf16>,
        out_stride: usize,
        x: &impl DevicePtr<f32>,
        x_stride: usize,
        w: &CudaSlice<f32>,
        rows: usize,
        eps: f32,
    ) -> Result<()> {
        self.norm(s, &self.norm_bf16, out, out_stride, x, x_stride, w, rows, eps)
    }

    #[allow(clippy::too_many_arguments)]
    fn norm<T>(
        &self,
        s: &Arc<CudaStream>,
        f: &CudaFunction,
        out: &mut impl DevicePtrMut<T>,
        out_stride: usize,
        x: &impl DevicePtr<f32>,
        x_stride: usize,
        w: &CudaSlice<f32>,
        rows: usize,
        eps: f32,
    ) -> Result<()> {
        const K: &str = "rmsnorm_f32";
        let dim = w.len();
        if rows == 0 {
            return Ok(());
        }
        if out_stride < dim || x_stride < dim {
            return Err(CudaError::shape(K, "row stride below the width"));
        }
        need(K, "out", out.len(), (rows - 1) * out_stride + dim)?;
        need(K, "x", x.len(), (rows - 1) * x_stride + dim)?;
        let (os, xs, d) = (i32_of(K, out_stride)?, i32_of(K, x_stride)?, i32_of(K, dim)?);
        let (o, _g1) = out.device_ptr_mut(s);
        let (xp, _g2) = x.device_ptr(s);
        // SAFETY: block r reads x[r*x_stride..][..dim] and w[..dim], writes
        // out[r*out_stride..][..dim], r < rows; the lengths are checked above; T matches
        // the entry point chosen by the caller (f32 or bf16).
        unsafe {
            s.launch_builder(f)
                .arg(&o)
                .arg(&os)
                .arg(&xp)
                .arg(&xs)
                .arg(w)
                .arg(&d)
                .arg(&eps)
                .launch(rows_cfg(rows, 256, 0))
        }?;
        Ok(())
    }

    fn grid_stride(&self) -> LaunchConfig {
        LaunchConfig { grid_dim: ((self.num_sms * 4) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }

    /// `x += y` elementwise (equal lengths).
    pub fn add(&self, s: &Arc<CudaStream>, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> Result<()> {
        need("add_f32", "y", y.len(), x.len())?;
        let n = x.len();
        // SAFETY: grid-strides over i < n = x.len() <= y.len().
        unsafe { s.launch_builder(&self.add).arg(x).arg(y).arg(&n).launch(self.grid_stride()) }?;
        Ok(())
    }

    /// `out[i] = Σ_r parts[r·n + i]` summed in rank order, `n = out.len()`: the second half of
    /// the deterministic all-reduce (`parts` is the all-gather of `world` ranks' buffers).
    pub fn sum_ranks(
        &self,
        s: &Arc<CudaStream>,
        out: &mut CudaSlice<f32>,
        parts: &CudaSlice<f32>,
        world: usize,
    ) -> Result<()> {
        const K: &str = "sum_ranks_f32";
        let n = out.len();
        need(K, "parts", parts.len(), n * world)?;
        let w = i32_of(K, world)?;
        // SAFETY: grid-strides over i < n = out.len(), reading parts[r*n + i] for r < world
        // (parts holds world*n).
        unsafe { s.launch_builder(&self.sum_ranks).arg(out).arg(parts).arg(&w).arg(&n).launch(self.grid_stride()) }?;
        Ok(())
    }

    /// `out[r][rk·part + c] = parts[rk][r][c]` for `world` ranks' `[rows][part]` blocks
    /// (rank-major, as an all-gather leaves them) into `[rows][world·part]`.
    pub fn interleave_ranks(
        &self,
        s: &Arc<CudaStream>,
        out: &mut CudaSlice<f32>,
        parts: &CudaSlice<f32>,
        world: usize,
        rows: usize,
        part: usize,
    ) -> Result<()> {
        const K: &str = "interleave_ranks_f32";
        let n = world * rows * part;
        need(K, "parts", parts.len(), n)?;
        need(K, "out", out.len(), n)?;
        let (w, r, p) = (i32_of(K, world)?, i32_of(K, rows)?, i32_of(K, part)?);
        // SAFETY: grid-strides over i < world*rows*part, reading parts[i] and writing
        // out[(r*world + rk)*part + c] < world*rows*part; both hold at least that many.
        unsafe {
            s.launch_builder(&self.interleave).arg(out).arg(parts).arg(&w).arg(&r).arg(&p).launch(self.grid_stride())
        }?;
        Ok(())
    }

    /// Sorts the `tokens × k` routing slots (`ids`, expert per slot) by expert on the
    /// device: `off` (`experts + 1`) each expert's first row, `perm` (`tokens × k`) each
    /// row's token, `inv` (`tokens × k`) each slot's row.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_sort(
        &self,
        s: &Arc<CudaStream>,
        ids: &CudaSlice<i32>,
        tokens: usize,
        k: usize,
        experts: usize,
        off: &mut CudaSlice<i32>,
        perm: &mut CudaSlice<i32>,
        inv: &mut CudaSlice<i32>,
    ) -> Result<()> {
        const K: &str = "moe_sort";
        let slots = tokens * k;
        if experts == 0 || experts > 1024 || k == 0 {
            return Err(CudaError::shape(K, format!("{experts} experts (1..=1024), k = {k}")));
        }
        need(K, "ids", ids.len(), slots)?;
        need(K, "off", off.len(), experts + 1)?;
        need(K, "perm", perm.len(), slots)?;
        need(K, "inv", inv.len(), slots)?;
        let (sl, ki, ei) = (i32_of(K, slots)?, i32_of(K, k)?, i32_of(K, experts)?);
        // SAFETY: one block reads ids[..slots], writes off[..=experts] and perm/inv rows
        // < slots (the per-expert counts sum to slots; out-of-range ids count as expert 0).
        unsafe {
            s.launch_builder(&self.moe_sort)
                .arg(ids)
                .arg(&sl)
                .arg(&ki)
                .arg(&ei)
                .arg(off)
                .arg(perm)
                .arg(inv)
                .launch(rows_cfg(1, 1024, 0))
        }?;
        Ok(())
    }

    /// The MoE experts in one launch: for each expert `g`, rows `off[g]..off[g + 1]` of `x`
    /// (sorted by expert, `k` wide) times its `[n][k]` bf16 weight (`weights` holds the
    /// addresses) into the same rows of `y` (bf16, or f32 when `out_f32`). `off`
    /// (`experts + 1`) comes from [`Ops::moe_sort`] and is never read on the host; `rows`
    /// sorted rows in all; experts without rows return at once. `variant` picks the kernel:
    /// the CUDA-core ones (`Direct`, `Staged`: the same bits, equal to the invariant GEMM's)
    /// or tensor cores (fast mode only).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_grouped_sorted<T: cudarc::driver::DeviceRepr>(
        &self,
        s: &Arc<CudaStream>,
        y: &mut CudaSlice<T>,
        x: &CudaSlice<bf16>,
        weights: &ExpertWeights,
        off: &CudaSlice<i32>,
        rows: usize,
        out_f32: bool,
        variant: GroupedVariant,
    ) -> Result<()> {
        const K: &str = "moe_grouped";
        let (n, k) = (weights.out, weights.inp);
        if k % 8 != 0 {
            return Err(CudaError::shape(K, format!("k = {k} is not a multiple of 8")));
        }
        need(K, "off", off.len(), weights.count + 1)?;
        need(K, "x", x.len(), rows * k)?;
        need(K, "y", y.len(), rows * n)?;
        if std::mem::size_of::<T>() != if out_f32 { 4 } else { 2 } {
            return Err(CudaError::shape(K, format!("y elements of {} bytes", std::mem::size_of::<T>())));
        }
        if rows == 0 || weights.count == 0 {
            return Ok(());
        }
        let (ni, ki) = (i32_of(K, n)?, i32_of(K, k)?);
        #[derive(PartialEq)]
        enum Kind {
            Direct,
            Staged,
            Tc,
            Wg,
            Wgt,
        }
        // wgmma from 16 rows per expert on average (prefill; at 8 it was 2% slower than
        // mma.sync, at 64 30% faster), fed by TMA where the weights have tensor maps. All
        // round alike (the tensor-core experts test asserts it), so the choice by batch
        // size keeps a row's bits.
        let wg_auto = self.wgmma && self.grouped_wg.is_some() && rows >= 16 * weights.count;
        let tma = self.grouped_wgt.is_some() && weights.maps.is_some();
        let kind = match variant {
            GroupedVariant::Direct => Kind::Direct,
            GroupedVariant::Staged => Kind::Staged,
            GroupedVariant::TensorCore => Kind::Tc,
            GroupedVariant::Wgmma if self.grouped_wg.is_none() => {
                return Err(CudaError::shape(K, "the wgmma experts need an sm_90 GPU"));
            }
            GroupedVariant::Wgmma => Kind::Wg,
            GroupedVariant::WgmmaTma if !tma => {
                return Err(CudaError::shape(K, "the TMA experts need an sm_90 GPU and encodable tensor maps"));
            }
            GroupedVariant::WgmmaTma => Kind::Wgt,
            GroupedVariant::Auto(GemmMode::Cublas) | GroupedVariant::Auto(GemmMode::InvariantTc) if wg_auto && tma => {
                Kind::Wgt
            }
            GroupedVariant::Auto(GemmMode::Cublas) | GroupedVariant::Auto(GemmMode::InvariantTc) if wg_auto => Kind::Wg,
            GroupedVariant::Auto(GemmMode::Cublas) | GroupedVariant::Auto(GemmMode::InvariantTc) => Kind::Tc,
            // Measured on H200 (V3 experts): staging pays from about 4 rows per expert.
            GroupedVariant::Auto(GemmMode::BatchInvariant) if rows >= 4 * weights.count => Kind::Staged,
            GroupedVariant::Auto(GemmMode::BatchInvariant) => Kind::Direct,
        };
        // CUDA cores: 32 columns per 256-thread block; tensor cores: 64 per 128 threads
        // (static shared memory, 48 KiB); wgmma: 128 per 128 threads (dynamic); TMA: 128
        // per producer and two consumer warpgroups.
        let (cols, threads, smem) = match kind {
            Kind::Tc => (64, 128, 0),
            Kind::Wg => (128, 128, GROUPED_WG_SMEM),
            Kind::Wgt => (128, 384, GROUPED_WGT_SMEM),
            _ => (32, 256, 0),
        };
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(cols) as u32, weights.count as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let no_experts: u64 = 0; // null: group g is expert g
        if kind == Kind::Wgt {
            let (Some(fs), Some(maps)) = (&self.grouped_wgt, &weights.maps) else { unreachable!("checked above") };
            // x [rows][k] in boxes of 64 × 64 (k % 8 == 0 checked: 16-byte rows).
            let tx = crate::mla_decode::bf16_tensor_map(
                x.device_ptr(s).0,
                &[k as u64, rows as u64],
                &[(k * 2) as u64],
                &[64, 64],
            )?;
            // SAFETY: moe_grouped_wgt_*(const __grid_constant__ CUtensorMap tx, const
            // CUtensorMap* wmaps, T* y, const int* experts, const int* off, int n, int k),
            // T f32 when out_f32, else bf16 (the caller's y). tx covers rows*k elements of x
            // (checked); `maps` holds `count` live 128-byte maps of the `[n][k]` weights
            // (64-byte aligned: 128 bytes each from a 256-byte aligned allocation), g <
            // count; `off` from moe_sort over `rows` slots is non-decreasing from 0 to rows,
            // so group g writes rows < rows of y (rows*n, checked), columns < n.
            unsafe {
                s.launch_builder(&fs[out_f32 as usize])
                    .arg(&tx)
                    .arg(maps)
                    .arg(y)
                    .arg(&no_experts)
                    .arg(off)
                    .arg(&ni)
                    .arg(&ki)
                    .launch(cfg)
            }?;
            return Ok(());
        }
        let wg = self.grouped_wg.as_ref();
        let f = match (kind, out_f32) {
            (Kind::Direct, false) => &self.grouped_bf16,
            (Kind::Direct, true) => &self.grouped_f32,
            (Kind::Staged, false) => &self.grouped_staged_bf16,
            (Kind::Staged, true) => &self.grouped_staged_f32,
            (Kind::Tc, false) => &self.grouped_tc_bf16,
            (Kind::Tc, true) => &self.grouped_tc_f32,
            (Kind::Wg, f32) => &wg.expect("checked above")[f32 as usize],
            (Kind::Wgt, _) => unreachable!("launched above"),
        };

        // SAFETY: every entry point takes (T* y, const bf16* x, const bf16* const* w,
        // const int* experts, const int* off, int n, int k) with T f32 when out_f32, else
        // bf16 (the caller's y). `off` comes from moe_sort over `rows` slots: non-decreasing
        // from 0 to rows, so group g reads rows < rows of x (rows*k, checked) and writes the
        // same rows of y (rows*n, checked); columns past n and k are masked or zero-filled;
        // g < count indexes the address table (live `[n][k]` weights, 256-byte aligned as
        // cudarc allocates them; k % 8 == 0 keeps every row 16-byte aligned).
        unsafe {
            s.launch_builder(f).arg(y).arg(x).arg(&weights.ptrs).arg(&no_experts).arg(off).arg(&ni).arg(&ki).launch(cfg)
        }?;
        Ok(())
    }

    /// `out[i] = x[rows[i]]` (bf16) for `n` rows whose indices were made on the device
    /// ([`Ops::moe_sort`]'s `perm`, each < the tokens of `x`).
    pub fn gather_bf16_sorted(
        &self,
        s: &Arc<CudaStream>,
        out: &mut CudaSlice<bf16>,
        x: &CudaSlice<bf16>,
        rows: &CudaSlice<i32>,
        n: usize,
        h: usize,
    ) -> Result<()> {
        const K: &str = "gather_rows";
        need(K, "rows", rows.len(), n)?;
        need(K, "out", out.len(), n * h)?;
        if n == 0 {
            return Ok(());
        }
        let hi = i32_of(K, h)?;
        // SAFETY: block i reads rows[i] (n entries) — a token index from moe_sort, < the
        // tokens whose rows x holds — and x[rows[i]*h..][..h], writes out[i*h..][..h].
        unsafe { s.launch_builder(&self.gather_bf16).arg(out).arg(x).arg(rows).arg(&hi).launch(rows_cfg(n, 256, 0)) }?;
        Ok(())
    }

    /// `out = bf16(x)` over `x.len()` elements.
    pub fn to_bf16(&self, s: &Arc<CudaStream>, out: &mut CudaSlice<bf16>, x: &CudaSlice<f32>) -> Result<()> {
        need("to_bf16_f32", "out", out.len(), x.len())?;
        let n = x.len();
        // SAFETY: grid-strides over i < n = x.len() <= out.len().
        unsafe { s.launch_builder(&self.to_bf16).arg(out).arg(x).arg(&n).launch(self.grid_stride()) }?;
        Ok(())
    }

    /// `out[i] = x[rows[i]]`, rows of width `h`, f32.
    pub fn gather_f32(
        &self,
        s: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<f32>,
        x: &CudaSlice<f32>,
        rows: &CudaSlice<i32>,
        host_rows: &[u32],
        h: usize,
    ) -> Result<()> {
        self.gather(s, &self.gather_f32, out, x, rows, host_rows, h)
    }

    /// `out[i] = bf16(x[rows[i]])`.
    pub fn gather_f32_bf16(
        &self,
        s: &Arc<CudaStream>,
        out: &mut CudaSlice<bf16>,
        x: &CudaSlice<f32>,
        rows: &CudaSlice<i32>,
        host_rows: &[u32],
        h: usize,
    ) -> Result<()> {
        self.gather(s, &self.gather_f32_bf16, out, x, rows, host_rows, h)
    }

    /// `out[i] = x[rows[i]]`, bf16.
    pub fn gather_bf16(
        &self,
        s: &Arc<CudaStream>,
        out: &mut CudaSlice<bf16>,
        x: &CudaSlice<bf16>,
        rows: &CudaSlice<i32>,
        host_rows: &[u32],
        h: usize,
    ) -> Result<()> {
        self.gather(s, &self.gather_bf16, out, x, rows, host_rows, h)
    }

    /// `host_rows` is the host copy of `rows`, checked against `x` before the launch.
    #[allow(clippy::too_many_arguments)]
    fn gather<A, B>(
        &self,
        s: &Arc<CudaStream>,
        f: &CudaFunction,
        out: &mut impl DevicePtrMut<B>,
        x: &CudaSlice<A>,
        rows: &CudaSlice<i32>,
        host_rows: &[u32],
        h: usize,
    ) -> Result<()> {
        const K: &str = "gather_rows";
        let n = host_rows.len();
        need(K, "rows", rows.len(), n)?;
        need(K, "out", out.len(), n * h)?;
        if let Some(&r) = host_rows.iter().find(|&&r| (r as usize + 1) * h > x.len()) {
            return Err(CudaError::shape(K, format!("row {r} outside the input")));
        }
        if n == 0 {
            return Ok(());
        }
        let hi = i32_of(K, h)?;
        let (o, _g) = out.device_ptr_mut(s);
        // SAFETY: block i reads rows[i] (< n entries) and x[rows[i]*h..][..h] (every row
        // checked in bounds on the host copy), writes out[i*h..][..h]; A/B match `f`.
        unsafe { s.launch_builder(f).arg(&o).arg(x).arg(rows).arg(&hi).launch(rows_cfg(n, 256, 0)) }?;
        Ok(())
    }

    /// Writes the latent of `n` rows of `kv` (`[n][lora + rope]` f32) into `cache` at
    /// `slot[r]`: `[RMSNorm(c_kv) * norm_w, RoPE(k_pe, pos[r])]` as bf16. A row whose slot
    /// is negative (a CUDA-graph bucket's padding) or past the cache writes nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write(
        &self,
        s: &Arc<CudaStream>,
        cache: &mut CudaSlice<bf16>,
        kv: &CudaSlice<f32>,
        norm_w: &CudaSlice<f32>,
        rope: &RopeTables,
        pos: &CudaSlice<i32>,
        slot: &CudaSlice<i64>,
        n: usize,
        eps: f32,
    ) -> Result<()> {
        const K: &str = "kv_cache_write_bf16";
        let (lora, r) = (norm_w.len(), rope.dim);
        let lat = lora + r;
        need(K, "kv", kv.len(), n * lat)?;
        need(K, "pos", pos.len(), n)?;
        need(K, "slot", slot.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let (li, ri) = (i32_of(K, lora)?, i32_of(K, r)?);
        let slots = (cache.len() / lat) as i64;
        // SAFETY: block r reads kv[r*lat..][..lat], norm_w[..lora], pos[r], slot[r] and the
        // rope tables at pos[r] (positions < the tables' length, validated by the caller
        // through Batch::validate; a padding row's positions are 0..4), and writes
        // cache[slot[r]*lat..][..lat] only for 0 <= slot[r] < slots = whole latents in the
        // cache (the kernel skips the others).
        unsafe {
            s.launch_builder(&self.kv_write)
                .arg(cache)
                .arg(kv)
                .arg(norm_w)
                .arg(&rope.cos)
                .arg(&rope.sin)
                .arg(pos)
                .arg(slot)
                .arg(&slots)
                .arg(&li)
                .arg(&ri)
                .arg(&eps)
                .launch(rows_cfg(n, 128, 0))
        }?;
        Ok(())
    }

    /// Absorbed queries: `qa[r][h] = [W_UK[h]^T q_nope, RoPE(q_pe, pos[r])]`, in f32 and bf16,
    /// on tensor cores (`heads_tc`, q_nope as bf16 hi + lo) when the widths allow, else one
    /// CUDA-core block per row and head. Either way a row's result ignores the other rows.
    #[allow(clippy::too_many_arguments)]
    pub fn q_absorb(
        &self,
        s: &Arc<CudaStream>,
        qa: &mut CudaSlice<f32>,
        qa_bf16: &mut CudaSlice<bf16>,
        q: &CudaSlice<f32>,
        wuk: &CudaSlice<bf16>,
        rope: &RopeTables,
        pos: &CudaSlice<i32>,
        n: usize,
        heads: usize,
        nope: usize,
        lora: usize,
    ) -> Result<()> {
        const K: &str = "q_absorb_f32";
        let r = rope.dim;
        need(K, "q", q.len(), n * heads * (nope + r))?;
        need(K, "wuk", wuk.len(), heads * nope * lora)?;
        need(K, "qa", qa.len(), n * heads * (lora + r))?;
        need(K, "qa_bf16", qa_bf16.len(), n * heads * (lora + r))?;
        need(K, "pos", pos.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        if heads_tc_takes(nope, lora, nope + r, lora + r) {
            let t = HeadsTc { m: n, heads, k: nope, n: lora, x_stride: nope + r, y_stride: lora + r, w_kn: true };
            return self.heads_tc(s, Some(qa), qa_bf16, q, wuk, &t, Some((rope, pos)));
        }
        let (hi, ni, ri, li) = (i32_of(K, heads)?, i32_of(K, nope)?, i32_of(K, r)?, i32_of(K, lora)?);
        // SAFETY: block (h, r) reads q[(r*heads+h)*(nope+rope)..][..nope+rope],
        // wuk[h*nope*lora..][..nope*lora] and the rope tables at pos[r] (validated by the
        // caller), writes qa/qa_bf16[(r*heads+h)*(lora+rope)..][..lora+rope]; lengths
        // checked above; shared memory holds nope floats.
        unsafe {
            s.launch_builder(&self.q_absorb)
                .arg(qa)
                .arg(qa_bf16)
                .arg(q)
                .arg(wuk)
                .arg(&rope.cos)
                .arg(&rope.sin)
                .arg(pos)
                .arg(&hi)
                .arg(&ni)
                .arg(&ri)
                .arg(&li)
                .launch(head_cfg(heads, n, 128, nope * 4))
        }?;
        Ok(())
    }

    /// Varlen causal absorbed attention: row r (sequence `row_seq[r]`, position `pos[r]`)
    /// attends to its sequence's cache positions `0..=pos[r]` through `tables`
    /// (`[seqs][bt_stride]`). `max_pos` bounds every `pos[r]` (the caller's host copy);
    /// `max_block` bounds every table entry.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_varlen(
        &self,
        s: &Arc<CudaStream>,
        o_lat: &mut CudaSlice<f32>,
        qa: &CudaSlice<f32>,
        cache: &CudaSlice<bf16>,
        tables: &CudaSlice<i32>,
        row_seq: &CudaSlice<i32>,
        pos: &CudaSlice<i32>,
        meta: &AttnMeta,
        heads: usize,
        lora: usize,
        rope: usize,
        scale: f32,
    ) -> Result<()> {
        const K: &str = "mla_attn_varlen_f32";
        let (n, dqk) = (meta.n, lora + rope);
        need(K, "qa", qa.len(), n * heads * dqk)?;
        need(K, "o_lat", o_lat.len(), n * heads * lora)?;
        need(K, "row_seq", row_seq.len(), n)?;
        need(K, "pos", pos.len(), n)?;
        need(K, "tables", tables.len(), meta.seqs * meta.bt_stride)?;
        need(K, "cache", cache.len(), (meta.max_block + 1) * 64 * dqk)?;
        if meta.max_pos >= meta.bt_stride * 64 {
            return Err(CudaError::shape(K, "a position lies past its block table"));
        }
        if n == 0 {
            return Ok(());
        }
        let smem = (dqk + meta.max_pos + 1) * 4;
        if smem > self.max_smem {
            return Err(CudaError::shape(
                K,
                format!("context of {} tokens needs {smem} B of shared memory", meta.max_pos),
            ));
        }
        if smem > 48 * 1024 {
            self.attn.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        let (bt, hi, li, ri) = (i32_of(K, meta.bt_stride)?, i32_of(K, heads)?, i32_of(K, lora)?, i32_of(K, rope)?);
        // SAFETY: block (h, r) reads qa[(r*heads+h)*dqk..][..dqk], tables[row_seq[r]*bt..][..]
        // for pages j/64 with j <= pos[r] <= max_pos < bt*64, cache entries of those pages
        // (every table entry <= max_block, checked against the cache length), and writes
        // o_lat[(r*heads+h)*lora..][..lora]; shared memory holds dqk + max_pos + 1 floats.
        unsafe {
            s.launch_builder(&self.attn)
                .arg(o_lat)
                .arg(qa)
                .arg(cache)
                .arg(tables)
                .arg(row_seq)
                .arg(pos)
                .arg(&bt)
                .arg(&hi)
                .arg(&li)
                .arg(&ri)
                .arg(&scale)
                .launch(head_cfg(heads, n, 128, smem))
        }?;
        Ok(())
    }

    /// `heads_tc`: per head h, `y[r][h][..n] = x[r][h][..k] · W_h` (see [`HeadsTc`]), f32
    /// into `y` when given and bf16 into `yb`; with `rope`, also the rotated q_pe (x's
    /// elements k..k + rope.dim of each row, at `pos[r]`) into columns n.. of y and yb.
    #[allow(clippy::too_many_arguments)]
    fn heads_tc(
        &self,
        s: &Arc<CudaStream>,
        y: Option<&mut CudaSlice<f32>>,
        yb: &mut CudaSlice<bf16>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<bf16>,
        t: &HeadsTc,
        rope: Option<(&RopeTables, &CudaSlice<i32>)>,
    ) -> Result<()> {
        const K: &str = "heads_tc";
        let rd = rope.map_or(0, |r| r.0.dim);
        need(K, "x", x.len(), t.m * t.heads * t.x_stride)?;
        need(K, "yb", yb.len(), t.m * t.heads * t.y_stride)?;
        need(K, "w", w.len(), t.heads * t.k * t.n)?;
        if t.x_stride < t.k + rd || t.y_stride < t.n + rd {
            return Err(CudaError::shape(K, "strides narrower than the row"));
        }
        let (yp, _gy) = match y {
            Some(y) => {
                need(K, "y", y.len(), t.m * t.heads * t.y_stride)?;
                let (p, g) = y.device_ptr_mut(s);
                (p, Some(g))
            }
            None => (0, None),
        };
        let (cp, sp, pp, _gr) = match rope {
            Some((tab, pos)) => {
                need(K, "pos", pos.len(), t.m)?;
                let (c, g1) = tab.cos.device_ptr(s);
                let (sn, g2) = tab.sin.device_ptr(s);
                let (p, g3) = pos.device_ptr(s);
                (c, sn, p, Some((g1, g2, g3)))
            }
            None => (0, 0, 0, None),
        };
        let chunks = t.m.div_ceil(64);
        if chunks > u32::MAX as usize || t.n.div_ceil(64) > 65_535 || t.heads > 65_535 {
            return Err(CudaError::shape(K, "grid too large"));
        }
        let mut args = [0i32; 8];
        for (a, v) in args.iter_mut().zip([t.m, t.heads, t.k, t.n, t.x_stride, t.y_stride, t.w_kn as usize, rd]) {
            *a = i32_of(K, v)?;
        }
        let cfg = LaunchConfig {
            grid_dim: (chunks as u32, t.n.div_ceil(64) as u32, t.heads as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: heads_tc(y, yb, x, w, m, heads, K, N, x_stride, y_stride, wt, cos, sin,
        // pos, rope): block (chunk, col block, h) reads x[(r·heads + h)·x_stride..][..K +
        // rope] for its rows r < m, w[h·K·N..][..K·N], the rope tables at pos[r] (validated
        // positions, the tables cover them) and writes y/yb[(r·heads + h)·y_stride..][..N +
        // rope] for r < m only; every length is checked above (y null: not written); 16-byte
        // loads: K, N, x_stride multiples of 8, 8, 4 (heads_tc_takes), 256-byte aligned buffers.
        unsafe {
            s.launch_builder(&self.heads_tc)
                .arg(&yp)
                .arg(yb)
                .arg(x)
                .arg(w)
                .arg(&args[0])
                .arg(&args[1])
                .arg(&args[2])
                .arg(&args[3])
                .arg(&args[4])
                .arg(&args[5])
                .arg(&args[6])
                .arg(&cp)
                .arg(&sp)
                .arg(&pp)
                .arg(&args[7])
                .launch(cfg)
        }?;
        Ok(())
    }

    /// `out[r][h*vdim + v] = W_UV[h][v] . o_lat[r][h]` (bf16 out), on tensor cores
    /// (`heads_tc`) when the widths allow.
    #[allow(clippy::too_many_arguments)]
    pub fn wuv(
        &self,
        s: &Arc<CudaStream>,
        out: &mut CudaSlice<bf16>,
        o_lat: &CudaSlice<f32>,
        wuv: &CudaSlice<bf16>,
        n: usize,
        heads: usize,
        lora: usize,
        vdim: usize,
    ) -> Result<()> {
        const K: &str = "wuv_f32_obf16";
        need(K, "out", out.len(), n * heads * vdim)?;
        need(K, "o_lat", o_lat.len(), n * heads * lora)?;
        need(K, "wuv", wuv.len(), heads * vdim * lora)?;
        if n == 0 {
            return Ok(());
        }
        if heads_tc_takes(lora, vdim, lora, vdim) {
            let t = HeadsTc { m: n, heads, k: lora, n: vdim, x_stride: lora, y_stride: vdim, w_kn: false };
            return self.heads_tc(s, None, out, o_lat, wuv, &t, None);
        }
        let (hi, li, vi) = (i32_of(K, heads)?, i32_of(K, lora)?, i32_of(K, vdim)?);
        // SAFETY: block (h, r) reads o_lat[(r*heads+h)*lora..][..lora] and
        // wuv[h*vdim*lora..][..vdim*lora], writes out[(r*heads+h)*vdim..][..vdim]; lengths
        // checked; shared memory holds lora floats.
        unsafe {
            s.launch_builder(&self.wuv).arg(out).arg(o_lat).arg(wuv).arg(&hi).arg(&li).arg(&vi).launch(head_cfg(
                heads,
                n,
                128,
                lora * 4,
            ))
        }?;
        Ok(())
    }

    /// Router logits in f32: `y[m][n] = x[m][k] · w[n][k]` (x, w f32), a row's logits
    /// the same bits in any batch ([`Router::logits`]).
    #[allow(clippy::too_many_arguments)]
    pub fn router_logits(
        &self,
        s: &Arc<CudaStream>,
        y: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        self.router.logits(s, y, x, w, m, n, k)
    }

    /// Routes `n` tokens from gate logits `[n][experts]`: `ids`/`weights` `[n][k]`.
    pub fn route(
        &self,
        s: &Arc<CudaStream>,
        ids: &mut CudaSlice<i32>,
        weights: &mut CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        bias: Option<&CudaSlice<f32>>,
        n: usize,
        p: &RouteParams,
    ) -> Result<()> {
        const K: &str = "moe_route_f32";
        need(K, "logits", logits.len(), n * p.experts)?;
        need(K, "ids", ids.len(), n * p.k)?;
        need(K, "weights", weights.len(), n * p.k)?;
        if p.n_group == 0 || !p.experts.is_multiple_of(p.n_group) || p.k == 0 || p.k > p.experts {
            return Err(CudaError::shape(K, format!("bad routing shape {p:?}")));
        }
        if let Some(b) = bias {
            need(K, "bias", b.len(), p.experts)?;
        }
        if n == 0 {
            return Ok(());
        }
        let smem = (2 * p.experts + p.n_group) * 4 + p.experts + p.n_group;
        let (e, k, g, tg) = (i32_of(K, p.experts)?, i32_of(K, p.k)?, i32_of(K, p.n_group)?, i32_of(K, p.topk_group)?);
        let (has_bias, norm) = (bias.is_some() as i32, p.normalise as i32);
        let b = bias.unwrap_or(logits);
        // SAFETY: block t reads logits[t*E..][..E] and bias[..E] (only when has_bias; the
        // stand-in is a live buffer otherwise), writes ids/weights[t*k..][..k]; lengths
        // checked; shared memory holds 2E + G floats and E + G bytes.
        unsafe {
            s.launch_builder(&self.route)
                .arg(ids)
                .arg(weights)
                .arg(logits)
                .arg(b)
                .arg(&e)
                .arg(&k)
                .arg(&g)
                .arg(&tg)
                .arg(&p.method)
                .arg(&p.scoring)
                .arg(&has_bias)
                .arg(&norm)
                .arg(&p.scale)
                .launch(rows_cfg(n, 128, smem))
        }?;
        Ok(())
    }

    /// `out[t] += Σ_j (ascending expert id) weights[t][j] · y[inv[t*k + j]]`.
    #[allow(clippy::too_many_arguments)]
    pub fn combine(
        &self,
        s: &Arc<CudaStream>,
        out: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        ids: &CudaSlice<i32>,
        weights: &CudaSlice<f32>,
        inv: &CudaSlice<i32>,
        n: usize,
        k: usize,
        h: usize,
    ) -> Result<()> {
        const K: &str = "moe_combine_f32";
        need(K, "out", out.len(), n * h)?;
        need(K, "y", y.len(), n * k * h)?;
        need(K, "ids", ids.len(), n * k)?;
        need(K, "weights", weights.len(), n * k)?;
        need(K, "inv", inv.len(), n * k)?;
        if k > COMBINE_MAX_K {
            return Err(CudaError::shape(K, format!("k = {k} experts per token > {COMBINE_MAX_K}")));
        }
        if n == 0 {
            return Ok(());
        }
        let (ki, hi) = (i32_of(K, k)?, i32_of(K, h)?);
        // SAFETY: block t reads ids/weights/inv[t*k..][..k] (k <= COMBINE_MAX_K, the size
        // of its shared order) and rows inv[..] < n*k of y (a permutation built by the
        // caller), writes out[t*h..][..h]; lengths checked. float4 accesses only when
        // h % 4 == 0, on cudarc's 256-byte aligned allocations.
        unsafe {
            s.launch_builder(&self.combine)
                .arg(out)
                .arg(y)
                .arg(ids)
                .arg(weights)
                .arg(inv)
                .arg(&ki)
                .arg(&hi)
                .launch(rows_cfg(n, 256, 0))
        }?;
        Ok(())
    }
}

/// YaRN RoPE cos/sin tables `[max_pos][rope/2]` (attention factor folded in), on the device.
#[derive(Debug)]
pub struct RopeTables {
    pub cos: CudaSlice<f32>,
    pub sin: CudaSlice<f32>,
    /// `qk_rope_head_dim`.
    pub dim: usize,
}

impl RopeTables {
    /// As mlaserve-cpu's `Rope::new`: f32 angle, cos/sin in f64, times the factor.
    pub fn new(s: &Arc<CudaStream>, inv_freq: &[f64], attention_factor: f64, max_pos: usize) -> Result<Self> {
        let (cos, sin) = crate::reference::rope_tables(inv_freq, attention_factor, max_pos);
        Ok(RopeTables { cos: s.clone_htod(&cos)?, sin: s.clone_htod(&sin)?, dim: 2 * inv_freq.len() })
    }
}
