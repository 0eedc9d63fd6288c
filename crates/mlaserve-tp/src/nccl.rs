//! NCCL for the workspace: [`NcclComm`], one rank's communicator on a stream with a
//! bounded wait, and on it the host-staged [`Collective`] ([`NcclCollective`]: the
//! step-plan channel of a group and the CPU backend's TP collectives on the GPU machines).
//! The CUDA backend's device-buffer collectives (`mlaserve_cuda::DeviceComm`) use
//! [`NcclComm`] on the backend's stream. Every operation is enqueued, then its
//! completion is polled against a deadline: a peer that died or stalls makes the wait
//! time out, the communicator is aborted (which also releases NCCL's spinning kernels),
//! and this and every later call fail with an error naming the operation — a group never
//! hangs forever.

use crate::wait::Waiter;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::safe::{Comm, Id, ReduceOp};
use mlaserve_core::{Collective, Error, Result};
use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

/// Bytes of NCCL's unique id (what the rendezvous hands around).
pub const ID_BYTES: usize = 128;

/// Creates a fresh NCCL unique id (on the leader) as bytes.
pub fn new_id() -> Result<Vec<u8>> {
    let id = Id::new().map_err(|e| Error::Collective(format!("ncclGetUniqueId: {e:?}")))?;
    Ok(id.internal().iter().map(|&c| c as u8).collect())
}

/// One rank's NCCL communicator on a stream, the single NCCL wrapper of the workspace:
/// the host-staged [`NcclCollective`] here and the CUDA backend's device-buffer
/// collectives (`mlaserve_cuda::DeviceComm`) both run on it. Operations are enqueued
/// through [`NcclComm::with`]; [`NcclComm::wait`] polls the stream against the deadline
/// and aborts the communicator when it passes, after which every call fails.
#[derive(Debug)]
pub struct NcclComm {
    comm: RefCell<Option<Comm>>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    timeout: Duration,
}

impl NcclComm {
    /// Joins the communicator described by `id` (from [`new_id`] on the leader) as `rank`
    /// of `world`, on `stream`. Blocks until every rank has joined.
    pub fn join(stream: &Arc<CudaStream>, rank: usize, world: usize, id: &[u8], timeout: Duration) -> Result<Self> {
        let failed = |why: String| Error::Collective(format!("rank {rank} of {world}: ncclCommInitRank: {why}"));
        if id.len() != ID_BYTES {
            return Err(failed(format!("NCCL id has {} bytes, expected {ID_BYTES}", id.len())));
        }
        if rank >= world {
            return Err(failed("rank out of range".into()));
        }
        let mut raw = [0 as std::ffi::c_char; ID_BYTES];
        for (d, s) in raw.iter_mut().zip(id) {
            *d = *s as std::ffi::c_char;
        }
        let comm =
            Comm::from_rank(stream.clone(), rank, world, Id::uninit(raw)).map_err(|e| failed(format!("{e:?}")))?;
        Ok(NcclComm { comm: RefCell::new(Some(comm)), stream: stream.clone(), rank, world, timeout })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// The stream the communicator's operations run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// An error of operation `what` on this rank.
    pub fn error(&self, what: &str, why: &str) -> Error {
        Error::Collective(format!("rank {} of {}: {what}: {why}", self.rank, self.world))
    }

    /// Enqueues `op` on the communicator (fails once it was aborted). An error from `op`
    /// itself (NCCL refused the call at once) fails the group exactly as a timeout does:
    /// the communicator is aborted, so this rank's peers see it gone instead of waiting
    /// for a collective it will never join.
    pub fn with<T>(&self, what: &str, op: impl FnOnce(&Comm) -> Result<T>) -> Result<T> {
        let out = {
            let guard = self.comm.borrow();
            let comm =
                guard.as_ref().ok_or_else(|| self.error(what, "communicator aborted after an earlier failure"))?;
            op(comm)
        };
        out.map_err(|e| self.abort(what, &e.to_string()))
    }

    /// Waits until everything enqueued on the stream so far is done, at most the timeout;
    /// on a timeout or a CUDA error the communicator is aborted.
    pub fn wait(&self, what: &str) -> Result<()> {
        let event = self.stream.record_event(None).map_err(|e| Error::Backend(format!("cuEventRecord: {e:?}")))?;
        let wait = Waiter::new(Some(self.timeout));
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.abort(what, &format!("CUDA error {e:?}"))),
            }
            if !wait.pause() {
                let why = format!("no completion within {:?}: a peer rank died or stalls", self.timeout);
                return Err(self.abort(what, &why));
            }
        }
    }

    /// Aborts the communicator and builds the error. Dropping a cudarc `Comm` calls
    /// ncclCommAbort, which raises NCCL's abort flags at once (its kernels return) and
    /// then waits until every CUDA graph that captured the communicator's collectives is
    /// destroyed. Those graphs belong to the caller, who can destroy them only once this
    /// error reaches it, so the abort runs on a thread of its own.
    fn abort(&self, what: &str, why: &str) -> Error {
        if let Some(comm) = self.comm.borrow_mut().take() {
            abort_comm(comm, Duration::ZERO);
        }
        self.error(what, &format!("{why}; communicator aborted"))
    }
}

impl Drop for NcclComm {
    /// The same abort on its own thread, waited for a few seconds: should a CUDA graph
    /// that captured this communicator outlive it, the wait ends with a warning instead
    /// of hanging the rank's exit.
    fn drop(&mut self) {
        if let Some(comm) = self.comm.get_mut().take() {
            if !abort_comm(comm, Duration::from_secs(5)) {
                eprintln!(
                    "rank {} of {}: ncclCommAbort did not return within 5 s (a CUDA graph still holds \
                     the communicator); left to finish in the background",
                    self.rank, self.world
                );
            }
        }
    }
}

/// Runs ncclCommAbort (a cudarc `Comm`'s drop) on a thread of its own and waits at most
/// `wait` for it: whether it returned in time. Should the thread not start, the abort
/// runs here.
fn abort_comm(comm: Comm, wait: Duration) -> bool {
    let comm = Aborting(comm);
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new().name("nccl-abort".into()).spawn(move || {
        drop(comm);
        let _ = tx.send(());
    });
    spawned.is_err() || wait.is_zero() || rx.recv_timeout(wait).is_ok()
}

/// A communicator on its way to ncclCommAbort on another thread (its drop is the abort).
struct Aborting(#[allow(dead_code)] Comm);

// SAFETY: NCCL allows a communicator to be used from any thread as long as calls do not
// overlap; once taken out of its `NcclComm` this is the only handle, and the thread it
// moves to only drops it (the abort).
unsafe impl Send for Aborting {}

/// A rank's host-staged NCCL [`Collective`], on a stream of its own.
#[derive(Debug)]
pub struct NcclCollective {
    comm: NcclComm,
}

impl NcclCollective {
    /// Joins the communicator described by `id` (from [`new_id`] on the leader) as `rank`
    /// of `world`, on GPU `ordinal`. Blocks until every rank has joined.
    pub fn new(ordinal: usize, rank: usize, world: usize, id: &[u8], timeout: Duration) -> Result<Self> {
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::Backend(format!("CUDA device {ordinal}: {e:?}")))?;
        let stream = ctx.new_stream().map_err(|e| Error::Backend(format!("cuStreamCreate: {e:?}")))?;
        Ok(NcclCollective { comm: NcclComm::join(&stream, rank, world, id, timeout)? })
    }

    /// Runs `op` on the communicator, then waits for the stream with a deadline.
    fn run<T>(&self, what: &str, op: impl FnOnce(&Comm) -> Result<T>) -> Result<T> {
        let out = self.comm.with(what, op)?;
        self.comm.wait(what)?;
        Ok(out)
    }

    fn htod<T: cudarc::driver::DeviceRepr>(&self, v: &[T]) -> Result<CudaSlice<T>> {
        self.comm.stream().clone_htod(v).map_err(|e| Error::Backend(format!("host-to-device copy: {e:?}")))
    }

    fn dtoh<T: cudarc::driver::DeviceRepr>(&self, v: &CudaSlice<T>) -> Result<Vec<T>> {
        self.comm.stream().clone_dtoh(v).map_err(|e| Error::Backend(format!("device-to-host copy: {e:?}")))
    }
}

/// An NCCL error of operation `what` as a collective error.
pub fn nccl_err(what: &str) -> impl Fn(cudarc::nccl::result::NcclError) -> Error + '_ {
    move |e| Error::Collective(format!("{what}: {e:?}"))
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world_size(&self) -> usize {
        self.comm.world()
    }
    fn timeout(&self) -> Option<Duration> {
        Some(self.comm.timeout)
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let mut d = self.htod(buf)?;
        self.run("all_reduce", |c| c.all_reduce_in_place(&mut d, &ReduceOp::Sum).map_err(nccl_err("ncclAllReduce")))?;
        buf.copy_from_slice(&self.dtoh(&d)?);
        Ok(())
    }
    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        let d = self.htod(local)?;
        let mut out = self
            .comm
            .stream()
            .alloc_zeros::<f32>(local.len() * self.comm.world())
            .map_err(|e| Error::Backend(format!("cuMemAlloc: {e:?}")))?;
        self.run("all_gather", |c| c.all_gather(&d, &mut out).map_err(nccl_err("ncclAllGather")))?;
        self.dtoh(&out)
    }
    fn broadcast_u32(&self, buf: &mut [u32], root: usize) -> Result<()> {
        // Only the root's words travel: the others receive into zeroed device memory, and
        // the root's own buffer is left as it was (no copy back).
        let is_root = root == self.comm.rank();
        let mut d = if is_root {
            self.htod(buf)?
        } else {
            self.comm
                .stream()
                .alloc_zeros::<u32>(buf.len())
                .map_err(|e| Error::Backend(format!("cuMemAlloc: {e:?}")))?
        };
        self.run("broadcast", |c| c.broadcast_in_place(&mut d, root as i32).map_err(nccl_err("ncclBroadcast")))?;
        if !is_root {
            buf.copy_from_slice(&self.dtoh(&d)?);
        }
        Ok(())
    }
}

/// CUDA devices on this machine.
pub fn device_count() -> Result<usize> {
    let n = CudaContext::device_count().map_err(|e| Error::Backend(format!("no CUDA device for NCCL: {e:?}")))?;
    Ok(n.max(0) as usize)
}

/// Bytes of the ids a group needs: one for the backend's communicator, one for the
/// leader's step-plan channel.
pub const GROUP_ID_BYTES: usize = 2 * ID_BYTES;

/// Fresh ids for a group (on the leader): [`GROUP_ID_BYTES`] bytes to hand to the ranks.
pub fn new_group_ids() -> Result<Vec<u8>> {
    Ok([new_id()?, new_id()?].concat())
}

/// Both communicators of a rank from the group's ids: the backend's own (all-reduces,
/// gathers) and the step-plan channel of `mlaserve_core::TpLeader`/`run_follower`.
pub fn group_comms(
    ordinal: usize,
    rank: usize,
    world: usize,
    ids: &[u8],
    timeout: Duration,
) -> Result<(NcclCollective, NcclCollective)> {
    if ids.len() != GROUP_ID_BYTES {
        return Err(Error::Collective(format!("group ids have {} bytes, expected {GROUP_ID_BYTES}", ids.len())));
    }
    let inner = NcclCollective::new(ordinal, rank, world, &ids[..ID_BYTES], timeout)?;
    let plans = NcclCollective::new(ordinal, rank, world, &ids[ID_BYTES..], timeout)?;
    Ok((inner, plans))
}
