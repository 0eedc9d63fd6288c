//! Row gathers: rows picked by an index list, from one buffer into a dense one, in one
//! generic launch path for every (input, output) element pair a kernel exists for.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use half::bf16;

use super::Ops;
use crate::error::{CudaError, Result};
use crate::launch::{i32_of, need, row_blocks_cfg};

/// The gather entry points of `backend_ops.cu`, indexed by [`GatherInto::KERNEL`].
pub(super) const KERNELS: [&str; 3] = ["gather_rows_f32", "gather_rows_f32_obf16", "gather_rows_bf16"];

/// An element type whose rows can be gathered into rows of `O` (f32 → f32, f32 → bf16
/// with rounding to nearest even, bf16 → bf16): the pairs a kernel exists for.
pub trait GatherInto<O>: DeviceRepr {
    /// Index of the entry point in [`KERNELS`].
    const KERNEL: usize;
}
impl GatherInto<f32> for f32 {
    const KERNEL: usize = 0;
}
impl GatherInto<bf16> for f32 {
    const KERNEL: usize = 1;
}
impl GatherInto<bf16> for bf16 {
    const KERNEL: usize = 2;
}

/// `gather_rows_*`'s grid: a row's column blocks give each thread one 16-byte copy when
/// the types match (four values where they convert).
fn gather_cfg<I, O>(n: usize, h: usize) -> LaunchConfig {
    let per_thread =
        if std::mem::size_of::<I>() == std::mem::size_of::<O>() { 16 / std::mem::size_of::<I>() } else { 4 };
    row_blocks_cfg(n, h, 256, per_thread)
}

impl Ops {
    /// `out[i] = x[rows[i]]` (converted to `O`), rows of width `h`. `host_rows` is the
    /// host copy of `rows`, checked against `x` before the launch.
    pub fn gather<I: GatherInto<O>, O>(
        &self,
        s: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<O>,
        x: &CudaSlice<I>,
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
        // SAFETY: gather_rows_*(out, x, rows, h): blocks (i, ..) read rows[i] (< n entries) and
        // x[rows[i]*h..][..h] (every row checked in bounds on the host copy), writes
        // out[i*h..][..h] (n*h checked); the entry point is the one of (I, O).
        unsafe {
            s.launch_builder(&self.gather[I::KERNEL]).arg(&o).arg(x).arg(rows).arg(&hi).launch(gather_cfg::<I, O>(n, h))
        }?;
        Ok(())
    }

    /// `out[i] = x[rows[i]]` (bf16) for `n` rows whose indices were made on the device
    /// ([`Ops::moe_sort`]'s `perm`, each < the tokens of `x`), so not checked on the host.
    pub fn gather_sorted(
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
        let f = &self.gather[<bf16 as GatherInto<bf16>>::KERNEL];
        // SAFETY: blocks (i, ..) read rows[i] (n entries) — a token index from moe_sort, < the
        // tokens whose rows x holds — and x[rows[i]*h..][..h], writes out[i*h..][..h].
        unsafe { s.launch_builder(f).arg(out).arg(x).arg(rows).arg(&hi).launch(gather_cfg::<bf16, bf16>(n, h)) }?;
        Ok(())
    }

    /// `q_out[i] = q[rows[i]]` and `s_out[i] = scale[rows[i]]` for `n` rows of a quantised
    /// activation (`k` e4m3 codes and `k / 128` scales a row; `k` a multiple of 128)
    /// whose indices were made on the device ([`Ops::moe_sort`]'s `perm`, each < the
    /// rows of `q`), so not checked on the host.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_q8_sorted(
        &self,
        s: &Arc<CudaStream>,
        q_out: &mut CudaSlice<u8>,
        s_out: &mut CudaSlice<f32>,
        q: &CudaSlice<u8>,
        scale: &CudaSlice<f32>,
        rows: &CudaSlice<i32>,
        n: usize,
        k: usize,
    ) -> Result<()> {
        const K: &str = "gather_rows_q8";
        if !k.is_multiple_of(128) {
            return Err(CudaError::shape(K, format!("k = {k} is not a multiple of 128")));
        }
        need(K, "rows", rows.len(), n)?;
        need(K, "q_out", q_out.len(), n * k)?;
        need(K, "s_out", s_out.len(), n * k / 128)?;
        need(K, "scale", scale.len(), q.len() / k * (k / 128))?;
        if n == 0 {
            return Ok(());
        }
        let ki = i32_of(K, k)?;
        // SAFETY: blocks (i, ..) read rows[i] (n entries) — a token index from moe_sort, <
        // the rows q holds (and scale, checked) — then q[rows[i]*k..][..k] by 16-byte
        // copies (k % 128 == 0; cudarc buffers are 256-byte aligned) and
        // scale[rows[i]*k/128..][..k/128]; writes q_out[i*k..][..k] and
        // s_out[i*k/128..][..k/128] (lengths checked).
        unsafe {
            s.launch_builder(&self.gather_q8)
                .arg(q_out)
                .arg(s_out)
                .arg(q)
                .arg(scale)
                .arg(rows)
                .arg(&ki)
                .launch(row_blocks_cfg(n, k, 256, 16))
        }?;
        Ok(())
    }

    /// `dst[d] = src[s]` for each `(d, s)` of `host_pairs` (`pairs` is their upload,
    /// `2 × n` words, `d` then `s`): ids moved on the device, each index checked on the
    /// host copy.
    pub fn copy_ids(
        &self,
        s: &Arc<CudaStream>,
        dst: &mut CudaSlice<i32>,
        src: &CudaSlice<i32>,
        pairs: &CudaSlice<i32>,
        host_pairs: &[(u32, u32)],
    ) -> Result<()> {
        const K: &str = "copy_ids";
        let n = host_pairs.len();
        need(K, "pairs", pairs.len(), 2 * n)?;
        if let Some(&(d, x)) = host_pairs.iter().find(|&&(d, x)| d as usize >= dst.len() || x as usize >= src.len()) {
            return Err(CudaError::shape(K, format!("pair ({d}, {x}) outside {} / {} ids", dst.len(), src.len())));
        }
        if n == 0 {
            return Ok(());
        }
        let ni = i32_of(K, n)?;
        let cfg =
            LaunchConfig { grid_dim: (n.div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: copy_ids(dst, src, pairs, n): thread i < n reads pairs[2i..2i + 2] (2n
        // words checked), src[pairs[2i + 1]] and writes dst[pairs[2i]], both indices
        // checked in bounds on the host copy of the pairs.
        unsafe { s.launch_builder(&self.copy_ids).arg(dst).arg(src).arg(pairs).arg(&ni).launch(cfg) }?;
        Ok(())
    }
}
