//! [`Util`]: the wrappers of `kernels/bench_util.cu`, the utility kernels of benchmarks
//! and checks: a copy-bandwidth probe, uniform random fills, NaN poison.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use mlaserve_cuda::{kernels, CudaError, Gpu, Result};

/// Grid for the grid-stride utility kernels: a few blocks per SM is enough to saturate
/// memory and keeps the launch independent of the element count.
fn grid_stride(gpu_sms: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: ((gpu_sms * 8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// Wrappers of `bench_util.cu`.
#[derive(Debug)]
pub struct Util {
    copy_f4: CudaFunction,
    fill_bf16: CudaFunction,
    fill_f32: CudaFunction,
    fill_u32: CudaFunction,
    num_sms: usize,
}

impl Util {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let m = gpu.load_module(kernels::BENCH_UTIL)?;
        Ok(Util {
            copy_f4: m.load_function("copy_f4")?,
            fill_bf16: m.load_function("fill_uniform_bf16")?,
            fill_f32: m.load_function("fill_uniform_f32")?,
            fill_u32: m.load_function("fill_u32")?,
            num_sms: gpu.num_sms,
        })
    }

    /// `dst = src` as 16-byte words (equal lengths, a multiple of 4 floats).
    pub fn copy(&self, stream: &Arc<CudaStream>, src: &CudaSlice<f32>, dst: &mut CudaSlice<f32>) -> Result<()> {
        if src.len() != dst.len() || !src.len().is_multiple_of(4) {
            return Err(CudaError::shape("copy_f4", format!("{} -> {} floats", src.len(), dst.len())));
        }
        let n16 = src.len() / 4;
        // SAFETY: copy_f4(const float4*, float4*, size_t) reads and writes n16 16-byte words,
        // which both buffers hold (checked above); cudarc allocations are 256-byte aligned.
        unsafe { stream.launch_builder(&self.copy_f4).arg(src).arg(dst).arg(&n16).launch(grid_stride(self.num_sms)) }?;
        Ok(())
    }

    /// Fills `x` with U(lo, hi) values rounded to bf16, deterministic in `seed`.
    pub fn fill_bf16(
        &self,
        stream: &Arc<CudaStream>,
        x: &mut CudaSlice<half::bf16>,
        seed: u64,
        lo: f32,
        hi: f32,
    ) -> Result<()> {
        self.fill_uniform(&self.fill_bf16, stream, x, seed, lo, hi)
    }

    /// Fills `x` with U(lo, hi), deterministic in `seed`.
    pub fn fill_f32(
        &self,
        stream: &Arc<CudaStream>,
        x: &mut CudaSlice<f32>,
        seed: u64,
        lo: f32,
        hi: f32,
    ) -> Result<()> {
        self.fill_uniform(&self.fill_f32, stream, x, seed, lo, hi)
    }

    /// One launch path for both fills: `f` is `fill_uniform_bf16` or `fill_uniform_f32`,
    /// the one whose element type is `T`.
    fn fill_uniform<T: cudarc::driver::DeviceRepr>(
        &self,
        f: &CudaFunction,
        stream: &Arc<CudaStream>,
        x: &mut CudaSlice<T>,
        seed: u64,
        lo: f32,
        hi: f32,
    ) -> Result<()> {
        let n = x.len();
        // SAFETY: fill_uniform_{bf16,f32}(T*, size_t, u64, float, float) writes x[0..n),
        // n = x.len(); the callers pass the kernel of x's element type.
        unsafe {
            stream.launch_builder(f).arg(x).arg(&n).arg(&seed).arg(&lo).arg(&hi).launch(grid_stride(self.num_sms))
        }?;
        Ok(())
    }

    /// Sets every 32-bit word of `x` to `bits` (a NaN pattern poisons outputs so that an
    /// element the kernel failed to write cannot pass a check).
    pub fn poison_f32(&self, stream: &Arc<CudaStream>, x: &mut CudaSlice<f32>, bits: u32) -> Result<()> {
        let n = x.len();
        // SAFETY: fill_u32(unsigned*, size_t, unsigned) writes n 4-byte words; f32 is 4 bytes.
        unsafe { stream.launch_builder(&self.fill_u32).arg(x).arg(&n).arg(&bits).launch(grid_stride(self.num_sms)) }?;
        Ok(())
    }

    /// As [`Util::poison_f32`] for a bf16 buffer of even length (whole 32-bit words).
    pub fn poison_bf16(&self, stream: &Arc<CudaStream>, x: &mut CudaSlice<half::bf16>, bits: u32) -> Result<()> {
        if !x.len().is_multiple_of(2) {
            return Err(CudaError::shape("fill_u32", "bf16 poison needs an even length"));
        }
        let n = x.len() / 2;
        // SAFETY: writes n = len/2 4-byte words, exactly the buffer's bytes.
        unsafe { stream.launch_builder(&self.fill_u32).arg(x).arg(&n).arg(&bits).launch(grid_stride(self.num_sms)) }?;
        Ok(())
    }
}
