//! fp8 e4m3 weights with DeepSeek's block scales turned into bf16 on the device
//! (`fp8_dequant.cu`): a checkpoint's codes are uploaded as they are stored and widened
//! there, so loading an fp8 checkpoint makes no f32 or bf16 host copy. The bits equal the
//! host's dequantisation (`Weights::f32_shard`, then bf16 round to nearest even).

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, CudaViewMut, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::kernels;
use crate::linear::Linear;

/// The dequantisation kernel on one GPU.
#[derive(Debug)]
pub struct Fp8Dequant {
    f: CudaFunction,
}

/// A block-scaled fp8 matrix on the host: codes `[rows][cols]`, scales
/// `[⌈rows / block[0]⌉][⌈cols / block[1]⌉]` (`w = q · s` per block).
#[derive(Debug, Clone, Copy)]
pub struct Fp8Host<'a> {
    pub q: &'a [u8],
    pub scales: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub block: [usize; 2],
}

impl Fp8Host<'_> {
    fn scale_shape(&self) -> [usize; 2] {
        [self.rows.div_ceil(self.block[0].max(1)), self.cols.div_ceil(self.block[1].max(1))]
    }

    fn check(&self) -> Result<()> {
        let [sr, sc] = self.scale_shape();
        if self.block.contains(&0)
            || self.q.len() != self.rows * self.cols
            || self.scales.len() != sr * sc
            || self.rows * self.cols > i32::MAX as usize
        {
            return Err(CudaError::shape(
                "fp8_dequant_bf16",
                format!(
                    "{} codes and {} scales for [{}, {}] in blocks of {:?}",
                    self.q.len(),
                    self.scales.len(),
                    self.rows,
                    self.cols,
                    self.block
                ),
            ));
        }
        Ok(())
    }
}

impl Fp8Dequant {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let m = gpu.load_module(kernels::FP8_DEQUANT)?;
        Ok(Fp8Dequant { f: m.load_function("fp8_dequant_bf16")? })
    }

    /// Uploads `w` and widens it into `out` (`rows × cols` values).
    pub fn into(&self, s: &Arc<CudaStream>, w: Fp8Host<'_>, out: &mut CudaViewMut<'_, bf16>) -> Result<()> {
        w.check()?;
        if out.len() != w.rows * w.cols {
            return Err(CudaError::shape(
                "fp8_dequant_bf16",
                format!("{} outputs for [{}, {}]", out.len(), w.rows, w.cols),
            ));
        }
        if w.q.is_empty() {
            return Ok(());
        }
        let q: CudaSlice<u8> = s.clone_htod(w.q)?;
        let sc: CudaSlice<f32> = s.clone_htod(w.scales)?;
        let n = (w.rows * w.cols) as u32;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256).min(65_535 * 8), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let dims = [w.rows as i32, w.cols as i32, w.scale_shape()[1] as i32, w.block[0] as i32, w.block[1] as i32];
        let mut b = s.launch_builder(&self.f);
        b.arg(&q).arg(&sc).arg(out);
        for d in &dims {
            b.arg(d);
        }
        // SAFETY: the shapes were checked above: `q` holds rows × cols codes, `sc` the
        // scale grid the kernel indexes, `out` rows × cols outputs; every index the
        // kernel forms is below those bounds.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `w` as a bf16 [`Linear`] (`[rows][cols]` = `[out][inp]`).
    pub fn linear(&self, s: &Arc<CudaStream>, w: Fp8Host<'_>) -> Result<Linear> {
        let mut out = s.alloc_zeros::<bf16>(w.rows * w.cols)?;
        self.into(s, w, &mut out.as_view_mut())?;
        Ok(Linear { w: out, out: w.rows, inp: w.cols })
    }
}
