//! The sampling kernel's timing ([`bench_sample`]) beside the copy bandwidth of the same
//! run.

use std::fmt;

use mlaserve_core::SampleRow;
use mlaserve_cuda::sample::Sampler;
use mlaserve_cuda::{Gpu, Result};

use crate::bench::{measure_copy_bandwidth, time_calls};
use crate::util::Util;

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
                .map(|r| SampleRow {
                    row: r as u32,
                    temperature,
                    top_k,
                    top_p,
                    min_p: 0.0,
                    u: (r as f64 * 0.618_034).fract(),
                })
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
