//! The row-wise kernels of the forward pass: the embedding gather, f32 RMSNorm, residual
//! adds, f32 → bf16, and the sums and interleaves of tensor-parallel ranks' parts.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use super::Ops;
use crate::error::{CudaError, Result};
use crate::launch::{i32_of, need, opt_ptr_mut, row_blocks_cfg, rows_cfg};
use crate::linear::GemmOut;

impl Ops {
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
        // SAFETY: blocks (r, ..) read tokens[r], positions[r] (n entries each), write out[r*h..][..h]
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
                .launch(row_blocks_cfg(n, h, 256, 8))
        }?;
        Ok(())
    }

    /// RMSNorm of `rows` rows of width `dim` (x row stride `x_stride`) into `out` (row
    /// stride `out_stride`): f32 for the residual stream, bf16 for a GEMM's input.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm<T: GemmOut>(
        &self,
        s: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<T>,
        out_stride: usize,
        x: &impl DevicePtr<f32>,
        x_stride: usize,
        w: &CudaSlice<f32>,
        rows: usize,
        eps: f32,
    ) -> Result<()> {
        let f = if T::BF16 { &self.norm_bf16 } else { &self.norm_f32 };
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
        // the entry point (rmsnorm_f32_of32 or _obf16).
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

    /// The residual add and the RMSNorm after it in one launch: `x += a` (`[rows][dim]`
    /// f32), then RMSNorm(x) · w into `of` (f32) and/or `ob` (bf16), dense rows; the bits
    /// of [`Ops::add`] followed by [`Ops::rmsnorm`] into each.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rmsnorm(
        &self,
        s: &Arc<CudaStream>,
        x: &mut CudaSlice<f32>,
        a: &CudaSlice<f32>,
        of: Option<&mut CudaSlice<f32>>,
        ob: Option<&mut CudaSlice<bf16>>,
        w: &CudaSlice<f32>,
        rows: usize,
        eps: f32,
    ) -> Result<()> {
        const K: &str = "add_rmsnorm_f32";
        let dim = w.len();
        need(K, "x", x.len(), rows * dim)?;
        need(K, "a", a.len(), rows * dim)?;
        if rows == 0 {
            return Ok(());
        }
        let d = i32_of(K, dim)?;
        let (ofp, _g1) = opt_ptr_mut(K, "of", s, of, rows * dim)?;
        let (obp, _g2) = opt_ptr_mut(K, "ob", s, ob, rows * dim)?;
        // SAFETY: block r reads and writes x[r*dim..][..dim], reads a[r*dim..][..dim] and
        // w[..dim], writes of/ob[r*dim..][..dim] where not null, r < rows; the lengths are
        // checked above.
        unsafe {
            s.launch_builder(&self.add_norm)
                .arg(x)
                .arg(a)
                .arg(&ofp)
                .arg(&obp)
                .arg(w)
                .arg(&d)
                .arg(&eps)
                .launch(rows_cfg(rows, 256, 0))
        }?;
        Ok(())
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

    /// `out = bf16(x)` over `x.len()` elements.
    pub fn to_bf16(&self, s: &Arc<CudaStream>, out: &mut CudaSlice<bf16>, x: &CudaSlice<f32>) -> Result<()> {
        need("to_bf16_f32", "out", out.len(), x.len())?;
        let n = x.len();
        // SAFETY: grid-strides over i < n = x.len() <= out.len().
        unsafe { s.launch_builder(&self.to_bf16).arg(out).arg(x).arg(&n).launch(self.grid_stride()) }?;
        Ok(())
    }
}
