//! [`Stager`]: host-to-device uploads of checkpoint bytes through a ring of pinned
//! staging buffers.
//!
//! A copy from pageable memory (a checkpoint's memory map) is staged by the driver
//! through its own small pinned buffer, one chunk at a time, and the host waits for each.
//! Here the host copies a chunk from the map into one of a few large pinned buffers
//! (several threads at once: the page faults of a cold map then read the file in
//! parallel) while the DMA engine uploads the previous chunk, so reading, copying and
//! uploading overlap. A buffer is reused only after the upload from it has finished (an
//! event per buffer).

use std::sync::Arc;

use cudarc::driver::{result, CudaEvent, CudaStream, CudaViewMut, DevicePtrMut, PinnedHostSlice};

use crate::error::Result;
use crate::gpu::Gpu;
use crate::launch::need;

/// Pinned staging buffers in the ring.
pub const STAGE_BUFFERS: usize = 4;
/// Bytes per staging buffer.
pub const STAGE_BYTES: usize = 64 << 20;
/// Most host threads copying one chunk into its staging buffer.
pub const STAGE_THREADS: usize = 8;
/// A chunk smaller than this is copied by one thread.
const PARALLEL_MIN: usize = 4 << 20;

struct Slot {
    host: PinnedHostSlice<u8>,
    /// The upload out of `host`, until it is known to be done.
    done: Option<CudaEvent>,
}

/// A ring of pinned buffers for uploads on one stream (see the module docs). Uploads
/// smaller than a buffer share one: each goes at the current buffer's first free byte,
/// and the ring moves on to the next buffer (waiting for its last upload) only when the
/// current one is full.
pub struct Stager {
    slots: Vec<Slot>,
    /// The buffer being filled, and its first free byte.
    cur: usize,
    used: usize,
    threads: usize,
    /// What the uploads so far cost the host.
    pub stats: StageStats,
}

/// Where a [`Stager`]'s host time went.
#[derive(Debug, Clone, Copy, Default)]
pub struct StageStats {
    pub bytes: u64,
    /// Copying into the pinned buffers (page faults of a cold map included).
    pub copy_s: f64,
    /// Waiting for a buffer's uploads to finish before refilling it.
    pub wait_s: f64,
}

impl std::fmt::Debug for Stager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stager").field("buffers", &self.slots.len()).field("threads", &self.threads).finish()
    }
}

impl Stager {
    /// [`STAGE_BUFFERS`] pinned buffers of [`STAGE_BYTES`] on `gpu`, host copies on up to
    /// [`STAGE_THREADS`] threads (fewer on a smaller machine).
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with(gpu, STAGE_BUFFERS, STAGE_BYTES, STAGE_THREADS.min(cores))
    }

    /// `buffers` pinned buffers of `bytes` each, host copies on `threads` threads.
    pub fn with(gpu: &Gpu, buffers: usize, bytes: usize, threads: usize) -> Result<Self> {
        let slots = (0..buffers.max(1))
            .map(|_| {
                // SAFETY: the buffer is written (by `upload`) before any byte of it is read.
                let host = unsafe { gpu.ctx.alloc_pinned::<u8>(bytes.max(1)) }?;
                Ok(Slot { host, done: None })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Stager { slots, cur: 0, used: 0, threads: threads.max(1), stats: StageStats::default() })
    }

    /// Bytes per staging buffer.
    pub fn chunk(&self) -> usize {
        self.slots[0].host.len()
    }

    /// Copies `src` into the start of `dst` (at least as long) on stream `s`. Returns when
    /// the last chunk is queued: `src` may be dropped then (it was copied into the ring),
    /// and `dst` is written in stream order.
    pub fn upload(&mut self, s: &Arc<CudaStream>, src: &[u8], dst: &mut impl DevicePtrMut<u8>) -> Result<()> {
        need("stage", "dst", dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let cap = self.chunk();
        let (base, _guard) = dst.device_ptr_mut(s);
        let mut at = 0;
        while at < src.len() {
            if self.used == cap {
                self.advance()?;
            }
            let n = (src.len() - at).min(cap - self.used);
            let (lo, part) = (self.used, &src[at..at + n]);
            let slot = &mut self.slots[self.cur];
            // The slot's earlier uploads read other bytes of it: only this range is written.
            let host = &mut slot.host.as_mut_slice()?[lo..lo + n];
            let t0 = std::time::Instant::now();
            copy_parallel(host, part, self.threads);
            self.stats.copy_s += t0.elapsed().as_secs_f64();
            self.stats.bytes += n as u64;
            // SAFETY: `host` is pinned and stays allocated and unwritten until the event
            // recorded below has completed (waited for before the slot is refilled, and on
            // drop); the destination range `base + at .. + n` lies within `dst` (its length
            // checked above).
            unsafe { result::memcpy_htod_async(base + at as u64, host, s.cu_stream()) }?;
            slot.done = Some(s.record_event(None)?);
            self.used += n;
            at += n;
        }
        Ok(())
    }

    /// `src`'s values as bytes, uploaded as [`Stager::upload`] does.
    pub fn upload_f32(&mut self, s: &Arc<CudaStream>, src: &[f32], dst: &mut CudaViewMut<'_, f32>) -> Result<()> {
        // SAFETY: f32 is plain data with no padding; the byte slice covers exactly `src`'s
        // elements, borrowed for this call (the upload copies them into the ring).
        let bytes = unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), std::mem::size_of_val(src)) };
        // SAFETY: the byte view covers exactly dst's elements (f32, plain data).
        let mut view = unsafe { dst.transmute_mut::<u8>(dst.len() * 4) }
            .ok_or_else(|| crate::CudaError::shape("stage", "f32 view"))?;
        self.upload(s, bytes, &mut view)
    }

    /// Moves to the next buffer of the ring, once the uploads out of it have finished.
    fn advance(&mut self) -> Result<()> {
        self.cur = (self.cur + 1) % self.slots.len();
        self.used = 0;
        if let Some(e) = self.slots[self.cur].done.take() {
            let t0 = std::time::Instant::now();
            e.synchronize()?;
            self.stats.wait_s += t0.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// Waits for every upload queued so far.
    pub fn finish(&mut self) -> Result<()> {
        for slot in &mut self.slots {
            if let Some(e) = slot.done.take() {
                e.synchronize()?;
            }
        }
        Ok(())
    }
}

impl Drop for Stager {
    fn drop(&mut self) {
        // A pinned buffer must outlive the copies out of it.
        let _ = self.finish();
    }
}

/// `dst.copy_from_slice(src)` on up to `threads` threads.
fn copy_parallel(dst: &mut [u8], src: &[u8], threads: usize) {
    if threads <= 1 || src.len() < PARALLEL_MIN {
        dst.copy_from_slice(src);
        return;
    }
    let per = src.len().div_ceil(threads);
    std::thread::scope(|sc| {
        for (d, s) in dst.chunks_mut(per).zip(src.chunks(per)) {
            sc.spawn(move || d.copy_from_slice(s));
        }
    });
}
