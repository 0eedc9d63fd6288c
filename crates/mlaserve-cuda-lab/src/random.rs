//! [`RandomFill`]: uniform random values generated on the device (`bench_util.cu`'s
//! fills) for a backend's synthetic weights and caches ([`mlaserve_cuda::WeightFill`]):
//! benchmarks at real dimensions without a checkpoint.

use std::cell::{Cell, OnceCell};

use cudarc::driver::CudaSlice;
use half::bf16;
use mlaserve_core::ModelConfig;
use mlaserve_cuda::{CudaBackend, CudaOptions, Gpu, Result, TpInit, WeightFill};

use crate::util::Util;

/// A seeded sequence of uniform fills: each tensor gets the next seed of a linear
/// congruential sequence, so a seed gives the same model every time.
#[derive(Debug)]
pub struct RandomFill {
    seed: Cell<u64>,
    util: OnceCell<Util>,
}

impl RandomFill {
    pub fn new(seed: u64) -> Self {
        RandomFill { seed: Cell::new(seed), util: OnceCell::new() }
    }

    fn next(&self) -> u64 {
        let v = self.seed.get().wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.seed.set(v);
        v
    }

    fn util(&self, gpu: &Gpu) -> Result<&Util> {
        if self.util.get().is_none() {
            let _ = self.util.set(Util::new(gpu)?);
        }
        Ok(self.util.get().expect("set above"))
    }
}

impl WeightFill for RandomFill {
    fn fill_bf16(&self, gpu: &Gpu, x: &mut CudaSlice<bf16>, a: f32) -> Result<()> {
        self.util(gpu)?.fill_bf16(&gpu.stream, x, self.next(), -a, a)
    }
    fn fill_f32(&self, gpu: &Gpu, x: &mut CudaSlice<f32>, lo: f32, hi: f32) -> Result<()> {
        self.util(gpu)?.fill_f32(&gpu.stream, x, self.next(), lo, hi)
    }
}

/// A backend of configuration `cfg` with random weights from `seed` (one rank of a
/// tensor-parallel group with `tp`: this rank's shapes, its own values).
pub fn random_backend(cfg: ModelConfig, opts: CudaOptions, seed: u64, tp: Option<&TpInit>) -> Result<CudaBackend> {
    CudaBackend::synthetic(cfg, opts, &RandomFill::new(seed), tp)
}
