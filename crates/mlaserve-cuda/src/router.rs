//! [`Router`]: the MoE router's logits `y = x · Wᵀ` in f32 (x `[m][k]`, W `[n][k]`, both
//! f32, as transformers' DeepSeek gate computes them: the expert choice is discrete, so no
//! bf16 or TF32 rounding), batch-invariant.
//!
//! The kernels (`router_f32_tile16`, `router_f32_tile32`, `router_f32_tile64`,
//! `router_reduce_f32` in kernels/router.cu) are a tiled CUDA-core GEMM with k cut into ranges fixed by the
//! weight's shape ([`plan::router_split`]): every logit is one FMA chain per range in
//! increasing k, and the ranges' partials are added in range order. Neither the rows of a
//! call nor the tile that runs it enter that order, so a token's logits have the same
//! bits in any batch. Decode calls (a few rows) are bound by reading W and get a tile of
//! 16 columns, so that the ranges give every SM blocks to stream it; prefill calls are
//! bound by the arithmetic and get 64 × 64 tiles with 4 × 4 outputs per thread; tens of
//! rows (a large batch's decode step) get 32 × 32 tiles, four times the blocks.
//! [`Router::logits_split`] leaves the ranges' partials unsummed for the routing kernel,
//! which adds them in the same order (one launch fewer per MoE layer).

use std::sync::Arc;

use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::kernels;
use crate::launch::{i32_of, need};
use crate::plan;

/// [`RouterTile::Auto`] runs the decode tile up to this many rows, the middle tile up to
/// [`MID_MAX_ROWS`], the prefill tile above (`gpu_router::router_auto_takes_the_faster_tile`
/// times the three at each m).
pub const DECODE_MAX_ROWS: usize = 16;
/// See [`DECODE_MAX_ROWS`].
pub const MID_MAX_ROWS: usize = 64;
/// Bytes of f32 partials one launch may write; more rows run in slabs.
const PARTIAL_BYTES: usize = 64 << 20;

/// Rows per launch of the router's GEMM: all `m` with one k range (the kernel writes the
/// logits), else as many 64-row tiles as fit [`PARTIAL_BYTES`] of partials. Slabs change
/// no logit's sum.
fn slab_rows(m: usize, n: usize, ksplit: usize) -> usize {
    if ksplit == 1 {
        return m;
    }
    ((PARTIAL_BYTES / (ksplit * n.max(1) * 4)).max(64) / 64 * 64).min(m)
}

/// Which tile computes the logits. Every choice gives the same bits; only the time
/// differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterTile {
    /// [`RouterTile::Decode`] up to [`DECODE_MAX_ROWS`] rows, [`RouterTile::Mid`] up to
    /// [`MID_MAX_ROWS`], else [`RouterTile::Prefill`].
    Auto,
    /// `router_f32_tile16`: 16 rows × 16 columns per block, one logit per thread, 64-wide
    /// k tiles four deep.
    Decode,
    /// `router_f32_tile32`: 32 rows × 32 columns per block, 2 × 2 logits per thread, 32-wide
    /// k tiles four deep.
    Mid,
    /// `router_f32_tile64`: 64 rows × 64 columns per block, 4 × 4 logits per thread, 32-wide
    /// k tiles double-buffered.
    Prefill,
}

impl RouterTile {
    /// (function, rows per block, columns per block) for a call of `m` rows.
    fn pick(self, r: &Router, m: usize) -> (&CudaFunction, usize, usize) {
        match self {
            RouterTile::Auto if m <= DECODE_MAX_ROWS => RouterTile::Decode.pick(r, m),
            RouterTile::Auto if m <= MID_MAX_ROWS => RouterTile::Mid.pick(r, m),
            RouterTile::Auto => RouterTile::Prefill.pick(r, m),
            RouterTile::Decode => (&r.tile16, 16, plan::ROUTER_DECODE_BN),
            RouterTile::Mid => (&r.tile32, 32, 32),
            RouterTile::Prefill => (&r.tile64, 64, 64),
        }
    }
}

/// The router's loaded kernels.
#[derive(Debug)]
pub struct Router {
    tile16: CudaFunction,
    tile32: CudaFunction,
    tile64: CudaFunction,
    reduce: CudaFunction,
    /// `linear_f32_of32`, the first router kernel (one warp per logit): the baseline of
    /// the timing test only.
    warp: CudaFunction,
    num_sms: usize,
}

impl Router {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Self::from_module(&gpu.load_module(kernels::ROUTER)?, gpu.num_sms)
    }

    /// From an already loaded `router` module.
    fn from_module(m: &Arc<CudaModule>, num_sms: usize) -> Result<Self> {
        Ok(Router {
            tile16: m.load_function("router_f32_tile16")?,
            tile32: m.load_function("router_f32_tile32")?,
            tile64: m.load_function("router_f32_tile64")?,
            reduce: m.load_function("router_reduce_f32")?,
            warp: m.load_function("linear_f32_of32")?,
            num_sms,
        })
    }

    /// `y[m][n] = x[m][k] · w[n][k]`, the tile picked by the rows ([`RouterTile::Auto`]).
    #[allow(clippy::too_many_arguments)]
    pub fn logits(
        &self,
        s: &Arc<CudaStream>,
        y: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        self.logits_with(s, y, x, w, m, n, k, RouterTile::Auto)
    }

    /// As [`Router::logits`] on the given tile (the same bits; tests and timing).
    #[allow(clippy::too_many_arguments)]
    pub fn logits_with(
        &self,
        s: &Arc<CudaStream>,
        y: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
        tile: RouterTile,
    ) -> Result<()> {
        const K: &str = "router_f32";
        need(K, "y", y.len(), m * n)?;
        need(K, "x", x.len(), m * k)?;
        need(K, "w", w.len(), n * k)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (ksplit, kchunk) = plan::router_split(n, k, self.num_sms);
        let (f, tile_rows, tile_cols) = tile.pick(self, m);
        i32_of(K, m)?; // also bounds the row tiles of grid.x
        let slab = slab_rows(m, n, ksplit);
        let mut part = if ksplit > 1 {
            // SAFETY: every element a slab's reduce reads (ksplit × rows × n) is written by
            // that slab's GEMM launch first, earlier on this stream: block (.., .., z)
            // stores each of its rows < rows and columns < n, 0 for an empty k range.
            Some(unsafe { s.alloc::<f32>(ksplit * slab * n) }?)
        } else {
            None
        };
        let (pp, _gp) = match part.as_mut() {
            Some(p) => {
                let (ptr, g) = p.device_ptr_mut(s);
                (ptr, Some(g))
            }
            None => (0, None),
        };
        let (xp, _gx) = x.device_ptr(s);
        let (wp, _gw) = w.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        let elem = std::mem::size_of::<f32>() as u64;
        let mut r0 = 0;
        while r0 < m {
            let rows = slab.min(m - r0);
            let (xr, yr) = (xp + (r0 * k) as u64 * elem, yp + (r0 * n) as u64 * elem);
            let out = if ksplit > 1 { pp } else { yr };
            // SAFETY: x from row r0 holds rows × k floats (r0 + rows <= m, x holds m × k,
            // checked), w holds n × k (checked); `out` is y from row r0 (rows × n floats
            // within y's m × n, checked) with one k range, else the ksplit × slab × n
            // partials (rows <= slab).
            unsafe { self.gemm(s, f, (tile_rows, tile_cols), out, xr, wp, rows, n, k, ksplit, kchunk) }?;
            if ksplit > 1 {
                let len = (rows * n) as u64;
                let rcfg = LaunchConfig {
                    grid_dim: ((rows * n).div_ceil(256) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let ksi = ksplit as i32; // <= 65_535, checked by the launch above
                                         // SAFETY: router_reduce_f32(y, part, len, ksplit) reads part[z][i] for
                                         // z < ksplit, i < len = rows × n (all written by the launch above, on this
                                         // stream) and writes y[i] from row r0, i < len: within y's m × n (checked).
                unsafe { s.launch_builder(&self.reduce).arg(&yr).arg(&pp).arg(&len).arg(&ksi).launch(rcfg) }?;
            }
            r0 += rows;
        }
        Ok(())
    }

    /// The logits for a consumer that adds the k ranges itself (`Ops::route_split`):
    /// `(buffer, ksplit)`, the GEMM's partials `[ksplit][m][n]` with no reduce where
    /// [`plan::router_split`] cuts k and one launch holds the rows' partials, else the
    /// logits `[m][n]` of [`Router::logits`] (ksplit 1). The same bits once summed in
    /// range order.
    #[allow(clippy::too_many_arguments)]
    pub fn logits_split(
        &self,
        s: &Arc<CudaStream>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(CudaSlice<f32>, usize)> {
        const K: &str = "router_f32";
        let (ksplit, kchunk) = plan::router_split(n, k, self.num_sms);
        if ksplit == 1 || slab_rows(m, n, ksplit) < m || m == 0 || n == 0 {
            let mut y = s.alloc_zeros::<f32>(m * n)?;
            self.logits(s, &mut y, x, w, m, n, k)?;
            return Ok((y, 1));
        }
        need(K, "x", x.len(), m * k)?;
        need(K, "w", w.len(), n * k)?;
        i32_of(K, m)?;
        let (f, tile_rows, tile_cols) = RouterTile::Auto.pick(self, m);
        // SAFETY: the launch below writes every element (block (.., .., z) stores each of
        // its rows < m and columns < n, 0 for an empty k range) before any later read on
        // this stream.
        let mut part = unsafe { s.alloc::<f32>(ksplit * m * n) }?;
        {
            let (pp, _gp) = part.device_ptr_mut(s);
            let (xp, _gx) = x.device_ptr(s);
            let (wp, _gw) = w.device_ptr(s);
            // SAFETY: x holds m × k, w n × k (checked); `part` ksplit × m × n floats.
            unsafe { self.gemm(s, f, (tile_rows, tile_cols), pp, xp, wp, m, n, k, ksplit, kchunk) }?;
        }
        Ok((part, ksplit))
    }

    /// One launch of a tile kernel `f` over `rows` rows of x at `xp` into `out` (the
    /// logits with one k range, else the partials `[ksplit][rows][n]`).
    ///
    /// # Safety
    /// `xp` must hold rows × k floats, `wp` n × k, and `out` rows × n floats (one k range)
    /// or ksplit × rows × n; all device pointers of live buffers used on stream `s`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        &self,
        s: &Arc<CudaStream>,
        f: &CudaFunction,
        (tile_rows, tile_cols): (usize, usize),
        out: u64,
        xp: u64,
        wp: u64,
        rows: usize,
        n: usize,
        k: usize,
        ksplit: usize,
        kchunk: usize,
    ) -> Result<()> {
        const K: &str = "router_f32";
        let (ri, ni, ki, kci) = (i32_of(K, rows)?, i32_of(K, n)?, i32_of(K, k)?, i32_of(K, kchunk)?);
        if n.div_ceil(tile_cols) > 65_535 || ksplit > 65_535 {
            return Err(CudaError::shape(K, format!("grid too large: n = {n}, {ksplit} k ranges")));
        }
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(tile_rows) as u32, n.div_ceil(tile_cols) as u32, ksplit as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: router_f32_tile{16,32,64}(out, x, w, m, n, k, kchunk) (static shared
        // memory only) reads x's rows × k floats and w (n × k), only rows < rows and < n
        // and k < k (the rest zero-filled), 16 bytes at a time only when k % 4 == 0 (row
        // starts then 16-byte aligned: cudarc buffers are 256-byte aligned). With one k
        // range (grid.z = 1) the kernel writes out[r][c] for r < rows, c < n; with ksplit
        // ranges block (.., .., z) writes out[z][r][c] for the same r and c. kchunk is a
        // multiple of every tile's k width (64 or 32) and the ranges cover k
        // (plan::router_split). The caller vouches for the buffers' sizes.
        unsafe { s.launch_builder(f).arg(&out).arg(&xp).arg(&wp).arg(&ri).arg(&ni).arg(&ki).arg(&kci).launch(cfg) }?;
        Ok(())
    }

    /// The same logits from the first router kernel, `linear_f32_of32` (one warp per
    /// logit, lanes stride k, a warp tree): batch-invariant too but with other bits, and
    /// it reads a row of x and of W per logit. The timing test's baseline, nothing else.
    #[allow(clippy::too_many_arguments)]
    pub fn logits_warp(
        &self,
        s: &Arc<CudaStream>,
        y: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        const K: &str = "linear_f32_of32";
        need(K, "y", y.len(), m * n)?;
        need(K, "x", x.len(), m * k)?;
        need(K, "w", w.len(), n * k)?;
        if m == 0 {
            return Ok(());
        }
        if m.div_ceil(4) > 65_535 {
            return Err(CudaError::shape(K, "too many rows"));
        }
        let (mi, ni, ki) = (i32_of(K, m)?, i32_of(K, n)?, i32_of(K, k)?);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(8) as u32, m.div_ceil(4) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: warp (col, row) reads x[row*k..][..k] and w[col*k..][..k], writes
        // y[row*n + col], row < m, col < n; lengths checked above.
        unsafe { s.launch_builder(&self.warp).arg(y).arg(x).arg(w).arg(&mi).arg(&ni).arg(&ki).launch(cfg) }?;
        Ok(())
    }
}
