//! Drafts kept on the device (`Backend::keeps_drafts`, `CudaOptions::keep_drafts`): a
//! drafting pass's MTP stages store their argmax ids in slots of one device buffer
//! (`Batch::argmax_slots`) and read their draft tokens from it (`Batch::draft_links`),
//! so no stage waits for the host; the engine reads the slots once, after the pass.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use mlaserve_core::{Batch, MAX_DRAFT_SLOTS};

use super::CudaBackend;
use crate::error::{CudaError, Result};
use crate::ops::Ops;

/// Writes each linked row's draft from `slots` into `tokens` (a call's uploaded token
/// ids), after the upload and before the body reads them.
pub(super) fn link_tokens(
    ops: &Ops,
    s: &Arc<CudaStream>,
    slots: Option<&CudaSlice<i32>>,
    tokens: &mut CudaSlice<i32>,
    links: &[(u32, u32)],
) -> Result<()> {
    if links.is_empty() {
        return Ok(());
    }
    let slots = slots.ok_or_else(|| CudaError::shape("draft links", "no draft stored yet".to_string()))?;
    copy_pairs(ops, s, tokens, slots, links)
}

/// `dst[d] = src[x]` for each `(d, x)` of `pairs`, uploaded for the launch.
fn copy_pairs(
    ops: &Ops,
    s: &Arc<CudaStream>,
    dst: &mut CudaSlice<i32>,
    src: &CudaSlice<i32>,
    pairs: &[(u32, u32)],
) -> Result<()> {
    let up = s.clone_htod(&pairs.iter().flat_map(|&(d, x)| [d as i32, x as i32]).collect::<Vec<_>>())?;
    ops.copy_ids(s, dst, src, &up, pairs)
}

impl CudaBackend {
    /// Whether MTP calls keep their drafts here: the option on, and a single rank or a
    /// group on the one-shot collectives over peer memory (whose kernels end their own
    /// waits, so the stages may follow each other without a bounded wait between them).
    pub(super) fn keeps_drafts_here(&self) -> bool {
        self.opts.keep_drafts && self.comm.as_ref().is_none_or(|c| c.peer_reduce_cap().is_some())
    }

    /// Stores `ids` (one per `batch.argmax_rows`, on the device) in their slots.
    pub(super) fn store_drafts(&mut self, ids: &CudaSlice<i32>, batch: &Batch) -> Result<()> {
        let s = self.gpu.stream.clone();
        if self.draft_slots.is_none() {
            self.draft_slots = Some(s.alloc_zeros::<i32>(MAX_DRAFT_SLOTS)?);
        }
        let pairs: Vec<(u32, u32)> = batch.argmax_slots.iter().enumerate().map(|(i, &t)| (t, i as u32)).collect();
        let slots = self.draft_slots.as_mut().expect("allocated above");
        copy_pairs(&self.ops, &s, slots, ids, &pairs)
    }

    /// The ids in slots `0..n`: the pass's one wait.
    pub(super) fn read_drafts_impl(&self, n: usize) -> Result<Vec<u32>> {
        if n == 0 && self.keeps_drafts_here() {
            return Ok(Vec::new());
        }
        let slots = match &self.draft_slots {
            Some(d) if self.keeps_drafts_here() && n <= d.len() => d,
            _ => return Err(CudaError::shape("read_drafts", format!("{n} draft slots cannot be read here"))),
        };
        let s = &self.gpu.stream;
        self.settle("read drafts")?;
        let v = s.clone_dtoh(&slots.slice(..n))?;
        self.gpu.sync()?;
        Ok(v.into_iter().map(|i| i as u32).collect())
    }
}
