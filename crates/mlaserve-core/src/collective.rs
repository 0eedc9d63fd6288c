//! The [`Collective`] trait: the communication a tensor-parallel rank needs.
//!
//! Implementations: [`SingleRank`] (world size 1, a no-op), an in-process one over
//! threads (CPU tests of TP = 2/4/8) and NCCL on the GPU.

use crate::error::Result;

/// Collective operations over the ranks of one worker group, on host `f32` buffers.
pub trait Collective {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Element-wise sum across ranks, in place.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;
    /// Concatenates every rank's `local` (all the same length) in rank order.
    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>>;
    /// Copies `root`'s `buf` to every rank.
    fn broadcast_u32(&self, buf: &mut [u32], root: usize) -> Result<()>;
    /// How long a collective waits for the other ranks before it fails (None: no
    /// deadline).
    fn timeout(&self) -> Option<std::time::Duration> {
        None
    }
}

/// The trivial collective of a single rank.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleRank;

impl Collective for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _buf: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        Ok(local.to_vec())
    }
    fn broadcast_u32(&self, _buf: &mut [u32], _root: usize) -> Result<()> {
        Ok(())
    }
}
