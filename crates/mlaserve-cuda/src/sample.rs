//! [`Sampler`]: the wrapper of `kernels/sample.cu`, `mlaserve_core::sample_token` on the
//! device (temperature, top-k, top-p, inverse CDF in id order with the row's uniform; a
//! cluster of 4 blocks per row, only the ids come back).

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use mlaserve_core::SampleRow;

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::kernels;
use crate::launch::need;

/// Per-row sampling on the device.
#[derive(Debug)]
pub struct Sampler {
    f: CudaFunction,
}

impl Sampler {
    /// The kernel's block size (`smp::THREADS`).
    const THREADS: u32 = 512;
    /// Blocks per row, one cluster (`smp::CL`, the kernel's `__cluster_dims__`).
    const CLUSTER: usize = 4;

    pub fn new(gpu: &Gpu) -> Result<Self> {
        let m = gpu.load_module(kernels::SAMPLE)?;
        Ok(Sampler { f: m.load_function("sample_f32")? })
    }

    /// The kernel's parameters of `rows`: `(temperature, top_k, top_p, u)` per row, each
    /// as f64 (exact for the f32 and u32 values).
    pub fn params(rows: &[SampleRow]) -> Vec<f64> {
        rows.iter().flat_map(|r| [r.temperature as f64, r.top_k as f64, r.top_p as f64, r.u]).collect()
    }

    /// `out[r]` = `mlaserve_core::sample_token` of `logits[r * vocab..][..vocab]` with the
    /// parameters `params[4r..4r + 4]` ([`Sampler::params`]), for `r < rows`.
    pub fn sample(
        &self,
        stream: &Arc<CudaStream>,
        logits: &CudaSlice<f32>,
        vocab: usize,
        params: &CudaSlice<f64>,
        out: &mut CudaSlice<i32>,
        rows: usize,
    ) -> Result<()> {
        const K: &str = "sample_f32";
        if vocab == 0 || vocab > i32::MAX as usize || rows * Self::CLUSTER > i32::MAX as usize {
            return Err(CudaError::shape(K, format!("{rows} rows of vocabulary {vocab}")));
        }
        need(K, "logits", logits.len(), rows * vocab)?;
        need(K, "params", params.len(), 4 * rows)?;
        need(K, "out", out.len(), rows)?;
        if rows == 0 {
            return Ok(());
        }
        let v = vocab as i32;
        let cfg = LaunchConfig {
            grid_dim: ((rows * Self::CLUSTER) as u32, 1, 1),
            block_dim: (Self::THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: sample_f32(logits, vocab, params, out): the cluster of blocks 4r..4r+4
        // reads logits[r*vocab..][..vocab] (each block its slice) and params[4r..4r+4], and
        // its rank 0 writes out[r], for r < rows = grid size / 4 (the kernel's cluster
        // dimension divides the grid); the lengths are checked above (logits >= rows*vocab,
        // params >= 4*rows, out >= rows). Its shared memory is static (36 KiB, under the
        // 48 KiB default).
        unsafe { stream.launch_builder(&self.f).arg(logits).arg(&v).arg(params).arg(out).launch(cfg) }?;
        Ok(())
    }
}
