//! [`DeviceComm`]: the tensor-parallel collectives of [`crate::CudaBackend`], NCCL on the
//! backend's own stream and device buffers (no host staging), through mlaserve-tp's
//! NCCL wrapper ([`NcclComm`]: id check, bounded wait, abort on timeout).
//!
//! Operations are only enqueued; the backend waits for its stream through
//! [`DeviceComm::wait`], which polls an event against a deadline. A peer that died or
//! stalls leaves NCCL's kernels spinning: the wait times out, the communicator is aborted
//! (its kernels return) and this and every later call fail with an error naming the
//! operation, so a rank never hangs forever.
//!
//! Two all-reduce flavours: NCCL's own (fast; its summation order depends on the
//! algorithm NCCL picks for the message size, so a token's sum can depend on how many
//! rows share the step once there are more than two ranks), and the deterministic one
//! used in batch-invariant mode: an all-gather, then a sum in rank order on the device.
//! Where the GPUs reach each other directly, [`DeviceComm::enable_peer_reduce`] routes
//! messages up to a size through the one-shot kernel of [`crate::peer`] instead, for
//! either flavour: it sums in rank order too, so its bits equal the ordered one's.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaSlice, CudaStream};
use cudarc::nccl::safe::ReduceOp;
use mlaserve_tp::nccl::{nccl_err, NcclComm};

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::ops::Ops;
use crate::peer::PeerReduce;

/// Bytes of an NCCL unique id.
pub const NCCL_ID_BYTES: usize = mlaserve_tp::nccl::ID_BYTES;

/// How a rank joins its group's backend communicator.
#[derive(Debug, Clone)]
pub struct TpInit {
    pub rank: usize,
    pub world: usize,
    /// The group's NCCL unique id ([`NCCL_ID_BYTES`] bytes, made by the leader).
    pub id: Vec<u8>,
    /// How long a collective may wait for the other ranks.
    pub timeout: Duration,
}

impl TpInit {
    /// A fresh NCCL unique id (on the leader) as bytes.
    pub fn new_id() -> Result<Vec<u8>> {
        mlaserve_tp::nccl::new_id().map_err(collective)
    }
}

/// The wrapper's errors are collective failures of this rank.
fn collective(e: mlaserve_core::Error) -> CudaError {
    match e {
        mlaserve_core::Error::Collective(m) => CudaError::Collective(m),
        e => CudaError::Collective(e.to_string()),
    }
}

/// A rank's backend communicator.
#[derive(Debug)]
pub struct DeviceComm {
    comm: NcclComm,
    /// The one-shot all-reduce over peer memory, once enabled.
    peer: Option<PeerReduce>,
    timeout: Duration,
    pub rank: usize,
    pub world: usize,
}

impl DeviceComm {
    /// Joins the communicator of `init` on `stream`; returns once every rank has joined.
    pub fn new(stream: &Arc<CudaStream>, init: &TpInit) -> Result<Self> {
        let comm = NcclComm::join(stream, init.rank, init.world, &init.id, init.timeout).map_err(collective)?;
        Ok(DeviceComm { comm, peer: None, timeout: init.timeout, rank: init.rank, world: init.world })
    }

    /// Sends messages of at most `max_bytes` through the one-shot all-reduce over peer
    /// memory ([`PeerReduce`]), those of at most `lines_bytes` through its lines kernel;
    /// every rank must call this together. Returns whether the
    /// group took it (false where some rank cannot reach another directly: the group
    /// stays on NCCL).
    pub fn enable_peer_reduce(&mut self, gpu: &Gpu, max_bytes: usize, lines_bytes: usize) -> Result<bool> {
        let gather = |w: &[u32]| self.gather_words(w);
        let peer = PeerReduce::join(gpu, self.rank, self.world, max_bytes, lines_bytes, self.timeout, &gather)?;
        self.peer = peer;
        Ok(self.peer.is_some())
    }

    /// The largest message (floats) the one-shot all-reduce takes (per rank for an
    /// all-gather); None when it is off.
    pub fn peer_reduce_cap(&self) -> Option<usize> {
        self.peer.as_ref().map(PeerReduce::cap)
    }

    /// The one-shot kernels for a message of `len` floats per rank, where they are on and
    /// it fits; checked alive first (an aborted communicator fails every later call, the
    /// one-shot ones too).
    fn peer_for(&self, len: usize, what: &str) -> Result<Option<&PeerReduce>> {
        let Some(p) = self.peer.as_ref().filter(|p| len <= p.cap()) else { return Ok(None) };
        self.comm.with(what, |_| Ok(())).map_err(collective)?;
        Ok(Some(p))
    }

    /// The largest message (floats) of the one-shot lines kernel; None when the one-shot
    /// kernels are off.
    pub fn peer_lines_max(&self) -> Option<usize> {
        self.peer.as_ref().map(PeerReduce::lines_max)
    }

    /// Lowers (or restores, up to what [`Self::enable_peer_reduce`] made room for) the
    /// largest message of the lines kernel from the next call on; 0 sends every one-shot
    /// message through the flag barrier. Every rank must set the same (a benchmark's or a
    /// test's comparison of the two kernels).
    pub fn set_peer_lines_max(&mut self, floats: usize) {
        if let Some(peer) = self.peer.as_mut() {
            peer.set_lines_max(floats);
        }
    }

    /// Every rank's `words` (rank-major), through an NCCL all-gather, waited for.
    fn gather_words(&self, words: &[u32]) -> Result<Vec<u32>> {
        let s = self.comm.stream();
        let bits: Vec<f32> = words.iter().map(|&w| f32::from_bits(w)).collect();
        let local = s.clone_htod(&bits)?;
        let mut all = s.alloc_zeros::<f32>(bits.len() * self.world)?;
        self.all_gather(&local, &mut all)?;
        self.wait("peer all-reduce setup")?;
        Ok(s.clone_dtoh(&all)?.into_iter().map(f32::to_bits).collect())
    }

    /// Enqueues the in-place sum of `buf` across the ranks: NCCL's, or the one-shot
    /// kernel's (rank order) where it is enabled and the message fits.
    pub fn all_reduce(&self, buf: &mut CudaSlice<f32>) -> Result<()> {
        if let Some(p) = self.peer_for(buf.len(), "peer all-reduce")? {
            return p.all_reduce(self.comm.stream(), buf);
        }
        self.all_reduce_nccl(buf)
    }

    /// Enqueues NCCL's in-place sum of `buf`, whatever the one-shot kernels would take.
    pub fn all_reduce_nccl(&self, buf: &mut CudaSlice<f32>) -> Result<()> {
        const W: &str = "ncclAllReduce";
        self.comm
            .with(W, |c| c.all_reduce_in_place(buf, &ReduceOp::Sum).map(|_| ()).map_err(nccl_err(W)))
            .map_err(collective)
    }

    /// Enqueues the deterministic sum of `buf` across the ranks: an all-gather into a
    /// scratch buffer, then a rank-ordered sum back into `buf`.
    pub fn all_reduce_ordered(&self, ops: &Ops, buf: &mut CudaSlice<f32>) -> Result<()> {
        if let Some(p) = self.peer_for(buf.len(), "peer all-reduce")? {
            return p.all_reduce(self.comm.stream(), buf);
        }
        let s = self.comm.stream();
        let mut parts = s.alloc_zeros::<f32>(buf.len() * self.world)?;
        self.all_gather(buf, &mut parts)?;
        ops.sum_ranks(s, buf, &parts, self.world)
    }

    /// Enqueues the all-gather of every rank's `local` into `out` (`world × local.len()`,
    /// rank-major).
    pub fn all_gather(&self, local: &CudaSlice<f32>, out: &mut CudaSlice<f32>) -> Result<()> {
        const W: &str = "ncclAllGather";
        if out.len() != local.len() * self.world {
            let why = format!("output has {} elements for {} × {}", out.len(), self.world, local.len());
            return Err(collective(self.comm.error(W, &why)));
        }
        if let Some(p) = self.peer_for(local.len(), "peer all-gather")? {
            return p.all_gather(self.comm.stream(), local, out);
        }
        self.comm.with(W, |c| c.all_gather(local, out).map(|_| ()).map_err(nccl_err(W))).map_err(collective)
    }

    /// Waits until everything enqueued on the stream so far is done, at most the timeout;
    /// on a timeout or a CUDA error the communicator is aborted.
    /// A one-shot all-reduce that gave up on a peer fails the wait the same way.
    pub fn wait(&self, what: &str) -> Result<()> {
        self.comm.wait(what).map_err(collective)?;
        if self.peer.as_ref().is_some_and(PeerReduce::failed) {
            let why = "the peer all-reduce had no word from a peer within the timeout: a peer rank died or stalls";
            return self.comm.with(what, |_| Err(mlaserve_core::Error::Collective(why.into()))).map_err(collective);
        }
        Ok(())
    }
}
