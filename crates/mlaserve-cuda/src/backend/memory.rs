//! Sizing the KV cache from the device's memory (`CudaOptions::gpu_memory_utilization`):
//! the weights are measured as loaded, then a profiling forward of the largest step
//! (`profile_tokens` prompt tokens, on a temporary cache just large enough for it)
//! measures the activations — the stream-ordered pool keeps what a step took, so the
//! device's free memory after the step tells it — and the cache takes what is left of the
//! fraction, less a reserve for the decode graphs as large as the profiled step's
//! activations (a graph's buffers are at most a step's). All ranks of a group take the
//! smallest plan among them, since they index one block table.

use mlaserve_core::memory::{plan_kv, Measured};
use mlaserve_core::{Backend, Batch, BLOCK_SIZE};

use super::CudaBackend;
use crate::error::{CudaError, Result};

/// Free device memory at two points of the load.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LoadMemory {
    pub total: usize,
    /// Before any weight.
    pub free_at_start: usize,
    /// After the weights.
    pub free_after_weights: usize,
}

impl CudaBackend {
    /// Bytes of one cache block over every layer (target and MTP).
    pub(crate) fn kv_block_bytes(&self) -> u64 {
        (self.caches.len() * BLOCK_SIZE * self.kv_entry_elems() * std::mem::size_of::<half::bf16>()) as u64
    }

    /// bf16 elements of one token's entry in one layer's cache (the layout's bytes / 2).
    pub(crate) fn kv_entry_elems(&self) -> usize {
        let fp8 = self.opts.kv_cache_dtype == mlaserve_core::KvCacheDtype::Fp8;
        crate::layout::kv_entry_elems(fp8, self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim)
            .expect("checked when the backend was assembled")
    }

    /// Runs the profile, plans, and replaces the temporary cache (`profile_blocks`
    /// blocks) by the planned one.
    pub(crate) fn plan_memory(&mut self, utilization: f64, mem: LoadMemory, profile: Batch) -> Result<()> {
        let temp_blocks = self.opts.num_blocks;
        let temp_bytes = temp_blocks as u64 * self.kv_block_bytes();
        self.forward(&profile).map_err(|e| CudaError::shape("memory plan", format!("profiling forward: {e}")))?;
        // Not trimmed: what the pool kept from the step is the activations' share.
        self.gpu.sync()?;
        let (free_after, _) = self.gpu.ctx.mem_get_info()?;
        let activations = (mem.free_after_weights.saturating_sub(free_after) as u64).saturating_sub(temp_bytes);
        let measured = Measured {
            total_bytes: mem.total as u64,
            other_bytes: mem.total.saturating_sub(mem.free_at_start) as u64,
            weights_bytes: mem.free_at_start.saturating_sub(mem.free_after_weights) as u64,
            activation_bytes: activations,
            graph_bytes: if self.opts.graphs { activations } else { 0 },
        };
        let block_bytes = self.kv_block_bytes();
        let mut plan = plan_kv(measured, utilization, block_bytes, BLOCK_SIZE as u64, temp_blocks as u64)
            .map_err(|e| CudaError::shape("memory plan", e))?;
        if let Some(comm) = &self.comm {
            // One block table for the group: the smallest plan of its ranks.
            let s = &self.gpu.stream;
            let mine = s.clone_htod(&[plan.kv_blocks as f32])?;
            let mut all = s.alloc_zeros::<f32>(comm.world)?;
            comm.all_gather(&mine, &mut all)?;
            comm.wait("memory plan")?;
            let least = s.clone_dtoh(&all)?.into_iter().fold(f32::INFINITY, f32::min) as u64;
            plan.kv_blocks = least;
            plan.kv_bytes = least * block_bytes;
            plan.kv_tokens = least * BLOCK_SIZE as u64;
        }
        // Free the temporary cache first: the planned one takes its place in the pool.
        let layers = self.caches.len();
        self.caches.clear();
        let len = plan.kv_blocks as usize * BLOCK_SIZE * self.kv_entry_elems();
        for _ in 0..layers {
            self.caches.push(self.gpu.stream.alloc_zeros::<half::bf16>(len)?);
        }
        self.gpu.sync()?;
        self.opts.num_blocks = plan.kv_blocks as usize;
        self.memory = Some(plan);
        Ok(())
    }
}
