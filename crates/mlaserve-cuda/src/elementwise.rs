//! Wrappers of the small per-token kernels: [`RmsNorm`] (`rmsnorm.cu`), [`SiluMul`]
//! (`silu_mul.cu`) and [`Argmax`] (`argmax.cu`). Each owns its launch geometry, checks
//! its buffers, and holds the only `unsafe` of its kernel.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::kernels;
use crate::launch::i32_of;
use crate::linear::GemmOut;

/// RMSNorm over rows of width `h`, plain or fused with the residual add.
#[derive(Debug)]
pub struct RmsNorm {
    plain: CudaFunction,
    fused: CudaFunction,
}

fn rows_of(kernel: &'static str, len: usize, h: usize) -> Result<u32> {
    if h == 0 || !len.is_multiple_of(h) || len / h > u32::MAX as usize || h > i32::MAX as usize {
        return Err(CudaError::shape(kernel, format!("{len} elements are not rows of {h}")));
    }
    Ok((len / h) as u32)
}

impl RmsNorm {
    /// One block of 256 threads per row (the kernels' `THREADS`).
    const THREADS: u32 = 256;

    pub fn new(gpu: &Gpu) -> Result<Self> {
        let m = gpu.load_module(kernels::RMSNORM)?;
        Ok(RmsNorm { plain: m.load_function("rmsnorm_bf16")?, fused: m.load_function("fused_add_rmsnorm_bf16")? })
    }

    /// `out[r] = x[r] / rms(x[r]) * w` for every row of `x` (`[rows][w.len()]`).
    pub fn rmsnorm(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut CudaSlice<bf16>,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        eps: f32,
    ) -> Result<()> {
        let h = w.len();
        let rows = rows_of("rmsnorm_bf16", x.len(), h)?;
        if out.len() != x.len() {
            return Err(CudaError::shape("rmsnorm_bf16", "out and x differ in length"));
        }
        if rows == 0 {
            return Ok(());
        }
        let hi = h as i32;
        let cfg = LaunchConfig { grid_dim: (rows, 1, 1), block_dim: (Self::THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: rmsnorm_bf16(out, x, w, h, eps): block r reads x[r*h..][..h] and w[..h],
        // writes out[r*h..][..h]; rows*h = x.len() = out.len(), w.len() = h (checked).
        // The 16-byte path runs only when h % 8 == 0, so row starts stay 16-byte aligned.
        unsafe { stream.launch_builder(&self.plain).arg(out).arg(x).arg(w).arg(&hi).arg(&eps).launch(cfg) }?;
        Ok(())
    }

    /// In place: `residual += x`, then `x = rmsnorm(residual) * w` (bf16 residual stream,
    /// f32 statistics from the unrounded sum, as vLLM's fused_add_rms_norm).
    pub fn fused_add_rmsnorm(
        &self,
        stream: &Arc<CudaStream>,
        x: &mut CudaSlice<bf16>,
        residual: &mut CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        eps: f32,
    ) -> Result<()> {
        let h = w.len();
        let rows = rows_of("fused_add_rmsnorm_bf16", x.len(), h)?;
        if residual.len() != x.len() {
            return Err(CudaError::shape("fused_add_rmsnorm_bf16", "residual and x differ in length"));
        }
        if rows == 0 {
            return Ok(());
        }
        let hi = h as i32;
        let cfg = LaunchConfig { grid_dim: (rows, 1, 1), block_dim: (Self::THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: fused_add_rmsnorm_bf16(x, residual, w, h, eps): block r reads and writes
        // x and residual at [r*h..][..h], reads w[..h]; lengths checked above; each
        // element is touched by one thread only (pass 2 re-reads its own pass-1 writes).
        unsafe { stream.launch_builder(&self.fused).arg(x).arg(residual).arg(w).arg(&hi).arg(&eps).launch(cfg) }?;
        Ok(())
    }
}

/// `out = silu(gate) * up` for rows `[gate | up]` of width `2d`.
#[derive(Debug)]
pub struct SiluMul {
    f: CudaFunction,
    num_sms: usize,
}

impl SiluMul {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let m = gpu.load_module(kernels::SILU_MUL)?;
        Ok(SiluMul { f: m.load_function("silu_mul_bf16")?, num_sms: gpu.num_sms })
    }

    /// `input: [rows][2d]`, `out: [rows][d]`.
    pub fn launch(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut CudaSlice<bf16>,
        input: &CudaSlice<bf16>,
        d: usize,
    ) -> Result<()> {
        self.launch_padded(stream, out, input, d, d)
    }

    /// `input: [rows][2dp]` with the gate at columns `0..d` and the up projection at
    /// `dp..dp + d` (`dp ≥ d`: an fp8 gate_up padded to whole scale blocks), `out: [rows][d]`.
    pub fn launch_padded(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut CudaSlice<bf16>,
        input: &CudaSlice<bf16>,
        d: usize,
        dp: usize,
    ) -> Result<()> {
        const K: &str = "silu_mul_bf16";
        if dp < d {
            return Err(CudaError::shape(K, format!("padded half width {dp} below {d}")));
        }
        let rows = rows_of(K, input.len(), 2 * dp)?;
        if out.len() != rows as usize * d {
            return Err(CudaError::shape(K, format!("out has {} elements, want {}", out.len(), rows as usize * d)));
        }
        if rows == 0 || rows > i32::MAX as u32 {
            return if rows == 0 { Ok(()) } else { Err(CudaError::shape(K, "too many rows")) };
        }
        let (rows_i, di, dpi) = (rows as i32, i32_of(K, d)?, i32_of(K, dp)?);
        let cfg =
            LaunchConfig { grid_dim: ((self.num_sms * 8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: silu_mul_bf16(out, in, rows, d, dp) grid-strides over rows*d outputs,
        // reading in[r*2dp + c] and in[r*2dp + dp + c] (c < d ≤ dp); input holds rows*2dp
        // and out rows*d elements (checked); the 16-byte path needs d and dp multiples of
        // 8, which it tests itself.
        unsafe { stream.launch_builder(&self.f).arg(out).arg(input).arg(&rows_i).arg(&di).arg(&dpi).launch(cfg) }?;
        Ok(())
    }
}

/// Per-row argmax of logits on the device (greedy sampling without copying logits).
#[derive(Debug)]
pub struct Argmax {
    f32_: CudaFunction,
    bf16_: CudaFunction,
    pair: CudaFunction,
    best: CudaFunction,
}

impl Argmax {
    const THREADS: u32 = 512;

    pub fn new(gpu: &Gpu) -> Result<Self> {
        let m = gpu.load_module(kernels::ARGMAX)?;
        Ok(Argmax {
            f32_: m.load_function("argmax_f32")?,
            bf16_: m.load_function("argmax_bf16")?,
            pair: m.load_function("argmax_pair_f32")?,
            best: m.load_function("argmax_pairs_best")?,
        })
    }

    /// `out[r]` = index of the largest of `logits[r][..vocab]` (first on ties, NaN
    /// ignored), for f32 or bf16 logits.
    pub fn argmax<T: GemmOut>(
        &self,
        stream: &Arc<CudaStream>,
        logits: &CudaSlice<T>,
        out: &mut CudaSlice<i32>,
        vocab: usize,
    ) -> Result<()> {
        self.run(stream, if T::BF16 { &self.bf16_ } else { &self.f32_ }, logits, out, vocab)
    }

    /// The vocabulary-parallel form: `out[2r]` = the largest of `logits[r][..vocab]`,
    /// `out[2r + 1]` = its index + `offset`, as f32 (an all-NaN row: NaN, `offset`).
    pub fn argmax_pair_f32(
        &self,
        stream: &Arc<CudaStream>,
        logits: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        vocab: usize,
        offset: usize,
    ) -> Result<()> {
        let rows = rows_of("argmax_pair", logits.len(), vocab)?;
        if out.len() != 2 * rows as usize {
            return Err(CudaError::shape("argmax_pair", format!("out has {} entries for {rows} rows", out.len())));
        }
        if offset + vocab >= 1 << 24 {
            return Err(CudaError::shape("argmax_pair", format!("ids up to {} are not exact in f32", offset + vocab)));
        }
        if rows == 0 {
            return Ok(());
        }
        let (v, o) = (vocab as i32, offset as i32);
        let cfg = LaunchConfig { grid_dim: (rows, 1, 1), block_dim: (Self::THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: block r reads logits[r*vocab..][..vocab] (rows*vocab = logits.len()) and
        // writes out[2r], out[2r+1] (out.len() = 2*rows, checked).
        unsafe { stream.launch_builder(&self.pair).arg(logits).arg(out).arg(&v).arg(&o).launch(cfg) }?;
        Ok(())
    }

    /// The group's id per row from every rank's [`Self::argmax_pair_f32`] output,
    /// all-gathered rank-major (`pairs`: `[world][rows][2]`, rows = `ids.len()`):
    /// [`crate::vocab::best_of_ranks`] on the device, so every rank holds the same ids.
    pub fn best_of_pairs(
        &self,
        stream: &Arc<CudaStream>,
        pairs: &CudaSlice<f32>,
        ids: &mut CudaSlice<i32>,
        world: usize,
    ) -> Result<()> {
        const K: &str = "argmax_pairs_best";
        let rows = ids.len();
        if pairs.len() != 2 * rows * world {
            return Err(CudaError::shape(K, format!("{} pair floats for {world} ranks × {rows} rows", pairs.len())));
        }
        if rows == 0 {
            return Ok(());
        }
        let (r, w) = (i32_of(K, rows)?, i32_of(K, world)?);
        let cfg =
            LaunchConfig { grid_dim: (rows.div_ceil(128) as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: thread r < rows reads pairs[(rk·rows + r)·2 ..][..2] for rk < world
        // (pairs.len() = 2·rows·world, checked) and writes ids[r] (ids.len() = rows).
        unsafe { stream.launch_builder(&self.best).arg(pairs).arg(ids).arg(&r).arg(&w).launch(cfg) }?;
        Ok(())
    }

    fn run<T>(
        &self,
        stream: &Arc<CudaStream>,
        f: &CudaFunction,
        logits: &CudaSlice<T>,
        out: &mut CudaSlice<i32>,
        vocab: usize,
    ) -> Result<()> {
        let rows = rows_of("argmax", logits.len(), vocab)?;
        if out.len() != rows as usize {
            return Err(CudaError::shape("argmax", format!("out has {} entries for {rows} rows", out.len())));
        }
        if rows == 0 {
            return Ok(());
        }
        let v = vocab as i32;
        let cfg = LaunchConfig { grid_dim: (rows, 1, 1), block_dim: (Self::THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argmax_*(logits, out, vocab): block r reads logits[r*vocab..][..vocab]
        // (of type T, matching the chosen entry point) and writes out[r]; rows*vocab =
        // logits.len() and out.len() = rows (checked).
        unsafe { stream.launch_builder(f).arg(logits).arg(out).arg(&v).launch(cfg) }?;
        Ok(())
    }
}
