//! [`DeviceComm`]: the tensor-parallel collectives of [`crate::CudaBackend`], NCCL on the
//! backend's own stream and device buffers (no host staging).
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

use std::cell::RefCell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream};
use cudarc::nccl::safe::{Comm, Id, ReduceOp};

use crate::error::{CudaError, Result};
use crate::ops::Ops;

/// Bytes of an NCCL unique id.
pub const NCCL_ID_BYTES: usize = 128;

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
        Ok(Id::new()?.internal().iter().map(|&c| c as u8).collect())
    }
}

/// A rank's backend communicator.
#[derive(Debug)]
pub struct DeviceComm {
    comm: RefCell<Option<Comm>>,
    stream: Arc<CudaStream>,
    pub rank: usize,
    pub world: usize,
    timeout: Duration,
}

fn failed(rank: usize, world: usize, what: &str, why: &str) -> CudaError {
    CudaError::Collective(format!("rank {rank} of {world}: {what}: {why}"))
}

impl DeviceComm {
    /// Joins the communicator of `init` on `stream`; returns once every rank has joined.
    pub fn new(stream: &Arc<CudaStream>, init: &TpInit) -> Result<Self> {
        let (rank, world) = (init.rank, init.world);
        if init.id.len() != NCCL_ID_BYTES {
            let why = format!("NCCL id has {} bytes, expected {NCCL_ID_BYTES}", init.id.len());
            return Err(failed(rank, world, "ncclCommInitRank", &why));
        }
        if rank >= world {
            return Err(failed(rank, world, "ncclCommInitRank", "rank out of range"));
        }
        let mut raw = [0 as std::ffi::c_char; NCCL_ID_BYTES];
        for (d, s) in raw.iter_mut().zip(&init.id) {
            *d = *s as std::ffi::c_char;
        }
        let comm = Comm::from_rank(stream.clone(), rank, world, Id::uninit(raw))
            .map_err(|e| failed(rank, world, "ncclCommInitRank", &format!("{e:?}")))?;
        Ok(DeviceComm { comm: RefCell::new(Some(comm)), stream: stream.clone(), rank, world, timeout: init.timeout })
    }

    fn with<T>(&self, what: &str, op: impl FnOnce(&Comm) -> Result<T>) -> Result<T> {
        let guard = self.comm.borrow();
        let comm = guard
            .as_ref()
            .ok_or_else(|| failed(self.rank, self.world, what, "communicator aborted after an earlier failure"))?;
        op(comm)
    }

    /// Enqueues NCCL's in-place sum of `buf` across the ranks.
    pub fn all_reduce(&self, buf: &mut CudaSlice<f32>) -> Result<()> {
        self.with("ncclAllReduce", |c| Ok(c.all_reduce_in_place(buf, &ReduceOp::Sum).map(|_| ())?))
    }

    /// Enqueues the deterministic sum of `buf` across the ranks: an all-gather into a
    /// scratch buffer, then a rank-ordered sum back into `buf`.
    pub fn all_reduce_ordered(&self, ops: &Ops, buf: &mut CudaSlice<f32>) -> Result<()> {
        let mut parts = self.stream.alloc_zeros::<f32>(buf.len() * self.world)?;
        self.all_gather(buf, &mut parts)?;
        ops.sum_ranks(&self.stream, buf, &parts, self.world)
    }

    /// Enqueues the all-gather of every rank's `local` into `out` (`world × local.len()`,
    /// rank-major).
    pub fn all_gather(&self, local: &CudaSlice<f32>, out: &mut CudaSlice<f32>) -> Result<()> {
        if out.len() != local.len() * self.world {
            let why = format!("output has {} elements for {} × {}", out.len(), self.world, local.len());
            return Err(failed(self.rank, self.world, "ncclAllGather", &why));
        }
        self.with("ncclAllGather", |c| Ok(c.all_gather(local, out).map(|_| ())?))
    }

    /// Waits until everything enqueued on the stream so far is done, at most the timeout;
    /// on a timeout or a CUDA error the communicator is aborted.
    pub fn wait(&self, what: &str) -> Result<()> {
        let event = self.stream.record_event(None)?;
        let start = Instant::now();
        let deadline = start + self.timeout;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.abort(what, &format!("CUDA error {e:?}"))),
            }
            if Instant::now() >= deadline {
                let why = format!("no completion within {:?}: a peer rank died or stalls", self.timeout);
                return Err(self.abort(what, &why));
            }
            // Spin (yielding) through a step's usual wait, then nap: a stalled peer must
            // not cost a core, a healthy step must not pay a sleep's latency.
            if start.elapsed() < Duration::from_millis(50) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    /// Aborts the communicator (dropping a cudarc `Comm` calls ncclCommAbort, which makes
    /// NCCL's kernels return) and builds the error.
    fn abort(&self, what: &str, why: &str) -> CudaError {
        drop(self.comm.borrow_mut().take());
        failed(self.rank, self.world, what, &format!("{why}; communicator aborted"))
    }
}
