//! YaRN RoPE cos/sin tables: computed on the host (always built, the references use
//! them too) and, with `cuda`, uploaded once per backend as [`RopeTables`].

/// YaRN RoPE tables `[max_pos][inv_freq.len()]` (cos, sin), computed as mlaserve-cpu's
/// `Rope::new` does: the angle in f32 (as transformers), cos/sin in f64, times the
/// attention factor.
pub fn rope_tables(inv_freq: &[f64], attention_factor: f64, max_pos: usize) -> (Vec<f32>, Vec<f32>) {
    let mut cos = Vec::with_capacity(max_pos * inv_freq.len());
    let mut sin = Vec::with_capacity(max_pos * inv_freq.len());
    for p in 0..max_pos {
        for f in inv_freq {
            let ang = (p as f32 * *f as f32) as f64;
            cos.push((ang.cos() * attention_factor) as f32);
            sin.push((ang.sin() * attention_factor) as f32);
        }
    }
    (cos, sin)
}

#[cfg(feature = "cuda")]
pub use device::{PendingRope, RopeTables};

#[cfg(feature = "cuda")]
mod device {
    use std::sync::Arc;

    use cudarc::driver::{CudaSlice, CudaStream};

    use crate::error::{CudaError, Result};

    /// YaRN RoPE cos/sin tables `[max_pos][rope/2]` (attention factor folded in), on the device.
    #[derive(Debug)]
    pub struct RopeTables {
        pub cos: CudaSlice<f32>,
        pub sin: CudaSlice<f32>,
        /// `qk_rope_head_dim`.
        pub dim: usize,
    }

    impl RopeTables {
        /// As mlaserve-cpu's `Rope::new`: f32 angle, cos/sin in f64, times the factor.
        pub fn new(s: &Arc<CudaStream>, inv_freq: &[f64], attention_factor: f64, max_pos: usize) -> Result<Self> {
            Self::upload(s, super::rope_tables(inv_freq, attention_factor, max_pos), 2 * inv_freq.len())
        }

        fn upload(s: &Arc<CudaStream>, (cos, sin): (Vec<f32>, Vec<f32>), dim: usize) -> Result<Self> {
            Ok(RopeTables { cos: s.clone_htod(&cos)?, sin: s.clone_htod(&sin)?, dim })
        }
    }

    /// The host tables of [`RopeTables::new`] being computed on a thread of their own: at
    /// V3's config (163,840 positions) they take a few tenths of a second on one core,
    /// which a load overlaps with reading the weights.
    #[derive(Debug)]
    pub struct PendingRope {
        tables: std::thread::JoinHandle<(Vec<f32>, Vec<f32>)>,
        dim: usize,
    }

    impl PendingRope {
        /// Starts computing the tables of `cfg`.
        pub fn start(cfg: &mlaserve_core::ModelConfig) -> Self {
            let (inv_freq, factor, max_pos) =
                (cfg.rope_inv_freq(), cfg.rope_attention_factor(), cfg.max_position_embeddings);
            let dim = 2 * inv_freq.len();
            let tables = std::thread::spawn(move || super::rope_tables(&inv_freq, factor, max_pos));
            PendingRope { tables, dim }
        }

        /// Waits for the tables and uploads them.
        pub fn upload(self, s: &Arc<CudaStream>) -> Result<RopeTables> {
            let tables =
                self.tables.join().map_err(|_| CudaError::shape("rope", "the thread computing the tables panicked"))?;
            RopeTables::upload(s, tables, self.dim)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GPU's RoPE tables are exactly the CPU backend's (same f32 angle, f64 cos/sin).
    #[test]
    fn rope_tables_match_the_cpu_backend() {
        let inv: Vec<f64> = (0..4).map(|i| 1.0 / 10000f64.powf(i as f64 / 4.0)).collect();
        let (cos, sin) = rope_tables(&inv, 1.3, 100);
        let rope = mlaserve_cpu::ops::Rope::new(&inv, 1.3, 100);
        for p in [0usize, 1, 63, 99] {
            let mut v = vec![1.0f32, 0.0, 0.5, -2.0, 3.0, 0.25, -1.0, 1.0];
            let orig = v.clone();
            rope.apply(&mut v, p);
            for i in 0..4 {
                let (c, s) = (cos[p * 4 + i], sin[p * 4 + i]);
                let (a, b) = (orig[2 * i], orig[2 * i + 1]);
                assert_eq!(v[2 * i], a * c - b * s);
                assert_eq!(v[2 * i + 1], a * s + b * c);
            }
        }
    }
}
