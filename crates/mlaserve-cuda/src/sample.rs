//! [`Sampler`]: the wrapper of `kernels/sample.cu`, `mlaserve_core::sample_token` on the
//! device (temperature, top-k, top-p, inverse CDF in id order with the row's uniform; a
//! cluster of 4 blocks per row, only the ids come back), and [`bench_sample`], its timing beside the
//! copy bandwidth of the same run.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use mlaserve_core::SampleRow;

use crate::bench::{measure_copy_bandwidth, time_calls};
use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::kernels::{self, Util};
use crate::ops::need;

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

/// One timed configuration of [`bench_sample`].
#[derive(Debug, Clone)]
pub struct SampleBenchRow {
    pub params: String,
    pub rows: usize,
    pub median_us: f64,
    pub min_us: f64,
    /// Reading the rows' logits once at the copy bandwidth of the same run.
    pub read_us: f64,
}

/// [`bench_sample`]'s result; `Display` prints the table.
#[derive(Debug, Clone)]
pub struct SampleBenchReport {
    pub device: String,
    pub vocab: usize,
    /// Device copy bandwidth, GB/s (read + write), measured in the same run.
    pub copy_gbps: f64,
    pub rows: Vec<SampleBenchRow>,
}

impl fmt::Display for SampleBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "sampling kernel on {}, vocab {}, copy bandwidth {:.0} GB/s (median of 30 launches):",
            self.device, self.vocab, self.copy_gbps
        )?;
        writeln!(
            f,
            "{:<30} {:>5} {:>11} {:>9} {:>24}",
            "params", "rows", "median us", "min us", "logits read once us"
        )?;
        for r in &self.rows {
            writeln!(f, "{:<30} {:>5} {:>11.1} {:>9.1} {:>24.1}", r.params, r.rows, r.median_us, r.min_us, r.read_us)?;
        }
        Ok(())
    }
}

/// Times [`Sampler::sample`] at `vocab` for each of `row_counts`, with three parameter
/// sets (T = 1; T = 0.7, top-p 0.9; T = 0.7, top-k 50, top-p 0.9), on U(-10, 10) logits
/// and spread uniforms; each figure beside the time to read the logits once at the copy
/// bandwidth measured in the same run.
pub fn bench_sample(gpu: &Gpu, vocab: usize, row_counts: &[usize]) -> Result<SampleBenchReport> {
    let s = &gpu.stream;
    let util = Util::new(gpu)?;
    let sampler = Sampler::new(gpu)?;
    let copy_gbps = measure_copy_bandwidth(gpu, &util, 1 << 30)?;
    let max_rows = row_counts.iter().copied().max().unwrap_or(1).max(1);
    let mut logits = s.alloc_zeros::<f32>(max_rows * vocab)?;
    util.fill_f32(s, &mut logits, 31, -10.0, 10.0)?;
    let mut out = s.alloc_zeros::<i32>(max_rows)?;
    let sets =
        [("T=1", 1.0f32, 0u32, 1.0f32), ("T=0.7 top_p=0.9", 0.7, 0, 0.9), ("T=0.7 top_k=50 top_p=0.9", 0.7, 50, 0.9)];
    let mut rows = Vec::new();
    for (label, temperature, top_k, top_p) in sets {
        for &n in row_counts {
            let spec: Vec<SampleRow> = (0..n)
                .map(|r| SampleRow { row: r as u32, temperature, top_k, top_p, u: (r as f64 * 0.618_034).fract() })
                .collect();
            let params = s.clone_htod(&Sampler::params(&spec))?;
            let t = time_calls(gpu, 3, 30, || sampler.sample(s, &logits, vocab, &params, &mut out, n))?;
            let bytes = (n * vocab * 4) as f64;
            rows.push(SampleBenchRow {
                params: label.to_string(),
                rows: n,
                median_us: t[t.len() / 2] * 1e3,
                min_us: t[0] * 1e3,
                read_us: bytes / (copy_gbps * 1e9) * 1e6,
            });
        }
    }
    Ok(SampleBenchReport { device: gpu.name.clone(), vocab, copy_gbps, rows })
}
