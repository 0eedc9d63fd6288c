//! [`PeerReduce`]: the one-shot all-reduce over peer memory (`kernels/peer_reduce.cu`)
//! for a tensor-parallel group whose GPUs reach each other directly (NVLink or PCIe P2P).
//!
//! Every rank allocates one buffer (flags, its call counters, and two halves of `world`
//! slots of `cap` floats) and the ranks map each other's: through CUDA IPC handles
//! across processes, by address (after enabling peer access) between threads of one
//! process. The addresses are exchanged through a host all-gather the caller provides
//! (the group's NCCL communicator), so this module needs nothing of [`crate::comm`].
//!
//! A message of at most `cap` floats then takes one kernel, a push of each rank's values
//! into every rank's slot, a flag barrier and a sum in rank order: the same order and
//! the same bits as the ordered all-reduce (an all-gather, then `sum_ranks_f32`), so it
//! serves the batch-invariant mode as well as the default. The same kernel all-gathers
//! (the slots copied out rank-major). Messages up to a smaller size take the lines kernel
//! instead (each value pushed beside the call number, no flag barrier: the lowest
//! latency, at twice the bytes), with the same bits. Larger messages stay on NCCL.
//! Where the ranks cannot all reach each other, every rank agrees to go without it.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr, CUresult};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
};
use cudarc::driver::{DriverError, PushKernelArg};

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;

/// Ranks a group may have (`PR_MAX_WORLD` in the kernel).
pub const MAX_WORLD: usize = 8;
/// Blocks and threads of every call (`PR_BLOCKS`, `PR_THREADS`).
const BLOCKS: u32 = 32;
const THREADS: u32 = 512;
/// Where the data starts in a rank's buffer (`PR_DATA_OFFSET`): after the flags and
/// counters.
const DATA_OFFSET: usize = 4096;
const _: () = assert!((BLOCKS as usize) * (MAX_WORLD + 1) * 4 + 4 <= DATA_OFFSET);

/// A rank's record in the exchange: 32 words.
const WORDS: usize = 32;
const MAGIC: u32 = 0x4d4c_5052;

/// The ranks' buffer addresses in this rank's address space (`PeerBases`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct PeerBases {
    p: [u64; MAX_WORLD],
}

// SAFETY: a plain array of device addresses, passed by value as the kernel's
// `PeerBases` (the same layout: eight 64-bit words).
unsafe impl DeviceRepr for PeerBases {}

/// A rank's side of the one-shot all-reduce.
#[derive(Debug)]
pub struct PeerReduce {
    ctx: Arc<CudaContext>,
    func: CudaFunction,
    lines_func: CudaFunction,
    local: CUdeviceptr,
    bases: PeerBases,
    /// The peers' buffers opened from their IPC handles (other processes), closed on
    /// drop; a peer in this process is used by its address.
    opened: Vec<CUdeviceptr>,
    rank: usize,
    world: usize,
    /// Floats a slot holds: the largest message this path takes.
    cap: usize,
    /// Where the lines start in a buffer, and the lines a slot holds (two values each).
    lines_offset: usize,
    line_cap: usize,
    /// Messages of at most this many floats take the lines kernel.
    lines_max: usize,
    timeout_ns: u64,
    /// One word of mapped, pinned host memory that the kernel raises when a peer never
    /// arrived: its host address (an integer: the memory is the process's, not a
    /// thread's) and its device address.
    status_host: usize,
    status_dev: CUdeviceptr,
}

fn drv(what: &'static str) -> impl Fn(DriverError) -> CudaError {
    move |e| CudaError::Collective(format!("peer all-reduce: {what}: {e:?}"))
}

fn check(r: CUresult, what: &'static str) -> Result<()> {
    r.result().map_err(drv(what))
}

/// This device's PCI bus id as four words (NUL-padded), for peers in other processes to
/// find it among their devices.
fn pci_words(dev: sys::CUdevice) -> Result<[u32; 4]> {
    let mut id = [0 as std::ffi::c_char; 16];
    // SAFETY: writes at most 16 bytes (NUL included) into `id`.
    check(unsafe { sys::cuDeviceGetPCIBusId(id.as_mut_ptr(), 16, dev) }, "cuDeviceGetPCIBusId")?;
    let b: Vec<u8> = id.iter().map(|&c| c as u8).collect();
    Ok(std::array::from_fn(|i| u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])))
}

/// A random number drawn once per process (std's hash keys are seeded from the OS).
fn process_token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static TOKEN: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TOKEN.get_or_init(|| std::collections::hash_map::RandomState::new().build_hasher().finish())
}

/// The device of a peer's PCI bus id in this process, if this process sees it.
fn device_of(pci: &[u32]) -> Option<sys::CUdevice> {
    let mut s: Vec<u8> = pci.iter().flat_map(|w| w.to_le_bytes()).collect();
    s.push(0);
    let mut dev: sys::CUdevice = 0;
    // SAFETY: `s` is NUL-terminated; `dev` is written on success only.
    let r = unsafe { sys::cuDeviceGetByPCIBusId(&mut dev, s.as_ptr() as *const std::ffi::c_char) };
    (r == CUresult::CUDA_SUCCESS).then_some(dev)
}

/// Whether the device `from` may address `to`'s memory.
fn can_access(from: sys::CUdevice, to: sys::CUdevice) -> bool {
    let mut can = 0;
    // SAFETY: plain query.
    let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, from, to) };
    r == CUresult::CUDA_SUCCESS && can == 1 && from != to
}

/// A rank's record: magic, process id, the buffer's address, its PCI bus id, its IPC
/// handle, and a token drawn once per process (two containers' processes can have the
/// same id; only an equal id and token mean the same process, where an address is usable).
struct Record {
    pid: u32,
    token: u64,
    base: u64,
    pci: [u32; 4],
    handle: sys::CUipcMemHandle,
}

impl Record {
    fn words(&self) -> [u32; WORDS] {
        let mut w = [0u32; WORDS];
        w[0] = MAGIC;
        w[1] = self.pid;
        w[2] = self.base as u32;
        w[3] = (self.base >> 32) as u32;
        w[4..8].copy_from_slice(&self.pci);
        for (i, c) in self.handle.reserved.chunks(4).enumerate() {
            w[8 + i] = u32::from_le_bytes([c[0] as u8, c[1] as u8, c[2] as u8, c[3] as u8]);
        }
        w[24] = self.token as u32;
        w[25] = (self.token >> 32) as u32;
        w
    }

    fn from_words(w: &[u32]) -> Option<Record> {
        if w.len() != WORDS || w[0] != MAGIC {
            return None;
        }
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        for (i, word) in w[8..24].iter().enumerate() {
            for (j, b) in word.to_le_bytes().into_iter().enumerate() {
                handle.reserved[4 * i + j] = b as std::ffi::c_char;
            }
        }
        Some(Record {
            pid: w[1],
            token: u64::from(w[24]) | (u64::from(w[25]) << 32),
            base: u64::from(w[2]) | (u64::from(w[3]) << 32),
            pci: [w[4], w[5], w[6], w[7]],
            handle,
        })
    }
}

/// The host all-gather the setup runs on: every rank's words, rank-major.
pub type Gather<'a> = &'a dyn Fn(&[u32]) -> Result<Vec<u32>>;

impl PeerReduce {
    /// Sets up the one-shot all-reduce for messages of at most `max_bytes` on `gpu` as
    /// `rank` of `world`, those of at most `lines_bytes` on the lines kernel, exchanging
    /// addresses through `gather` (every rank must call this together). `None` when some rank cannot reach some other directly: every rank gets
    /// `None` then, and the group stays on NCCL.
    pub fn join(
        gpu: &Gpu,
        rank: usize,
        world: usize,
        max_bytes: usize,
        lines_bytes: usize,
        timeout: std::time::Duration,
        gather: Gather,
    ) -> Result<Option<PeerReduce>> {
        let agree = |ok: bool| -> Result<bool> { Ok(gather(&[u32::from(ok)])?.iter().all(|&v| v == 1)) };
        if !agree(world <= MAX_WORLD && world > 1)? {
            return Ok(None);
        }
        gpu.ctx.bind_to_thread().map_err(drv("bind"))?;
        let cap = (max_bytes / 4).next_multiple_of(4).max(4);
        let lines_max = cap.min(lines_bytes / 4);
        let line_cap = lines_max.div_ceil(2);
        let lines_offset = DATA_OFFSET + 2 * world * cap * 4;
        let bytes = lines_offset + 2 * world * line_cap * 16;
        let mut local: CUdeviceptr = 0;
        // SAFETY: allocates `bytes` in the current (this rank's) context; freed on drop.
        check(unsafe { sys::cuMemAlloc_v2(&mut local, bytes) }, "cuMemAlloc")?;
        let module = gpu.load_module(crate::kernels::PEER_REDUCE)?;
        let func = module.load_function("peer_all_reduce_f32")?;
        let lines_func = module.load_function("peer_all_reduce_lines_f32")?;
        let (status_host, status_dev) = match mapped_word() {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: allocated above, not yet shared.
                unsafe { sys::cuMemFree_v2(local) };
                return Err(e);
            }
        };
        let mut me = PeerReduce {
            ctx: gpu.ctx.clone(),
            func,
            lines_func,
            local,
            bases: PeerBases::default(),
            opened: Vec::new(),
            rank,
            world,
            cap,
            lines_offset,
            line_cap,
            lines_max,
            timeout_ns: u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX),
            status_host,
            status_dev,
        };
        // Flags and counters start at 0 on every rank before any peer can see the buffer.
        // SAFETY: the allocation above holds `bytes` bytes.
        check(unsafe { sys::cuMemsetD8_v2(local, 0, bytes) }, "cuMemset")?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `local` came from cuMemAlloc (IPC-exportable).
        check(unsafe { sys::cuIpcGetMemHandle(&mut handle, local) }, "cuIpcGetMemHandle")?;
        let dev = gpu.ctx.cu_device();
        let mine =
            Record { pid: std::process::id(), token: process_token(), base: local, pci: pci_words(dev)?, handle };
        let all = gather(&mine.words())?;
        let recs: Vec<Option<Record>> = all.chunks(WORDS).map(Record::from_words).collect();
        // Can this rank reach every peer?
        let reach = recs.iter().enumerate().all(|(r, rec)| match rec {
            _ if r == rank => true,
            Some(p) => device_of(&p.pci).is_some_and(|d| can_access(dev, d)),
            None => false,
        });
        if !agree(reach)? {
            return Ok(None);
        }
        let mut all_mapped = true;
        for (r, rec) in recs.iter().enumerate() {
            let rec = rec.as_ref().expect("every record parsed (agreed above)");
            if r == rank {
                me.bases.p[r] = local;
            } else if (rec.pid, rec.token) == (mine.pid, mine.token) {
                all_mapped &= enable_peer(&rec.pci).is_ok();
                me.bases.p[r] = rec.base;
            } else {
                let mut p: CUdeviceptr = 0;
                let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
                // SAFETY: the handle came from the peer's cuIpcGetMemHandle; `p` is
                // written on success and closed on drop.
                let r2 = unsafe { sys::cuIpcOpenMemHandle_v2(&mut p, rec.handle, flags) };
                if r2 == CUresult::CUDA_SUCCESS {
                    me.bases.p[r] = p;
                    me.opened.push(p);
                } else {
                    all_mapped = false;
                }
            }
        }
        Ok(agree(all_mapped)?.then_some(me))
    }

    /// Whether a call of this rank gave up waiting for a peer (it never arrived within the
    /// timeout); read after the stream's work is done.
    pub fn failed(&self) -> bool {
        // SAFETY: `status_host` is the live mapped word of `mapped_word`, written only by
        // the kernel (a volatile read sees its write once the stream is done).
        unsafe { std::ptr::read_volatile(self.status_host as *const u32) != 0 }
    }

    /// The largest message (floats) this path takes.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// The largest message (floats) of the lines kernel.
    pub fn lines_max(&self) -> usize {
        self.lines_max
    }

    /// Lowers (or restores) the largest message of the lines kernel from the next call
    /// on, at most what `join` made room for; every rank of the group must set the same.
    /// A benchmark's comparison: 0 sends every message through the flag barrier.
    pub fn set_lines_max(&mut self, floats: usize) {
        self.lines_max = floats.min(2 * self.line_cap);
    }

    /// Enqueues the in-place sum of `buf` over the ranks on `s` (every rank must call it
    /// with the same length, in the same order as its other collectives).
    pub fn all_reduce(&self, s: &Arc<CudaStream>, buf: &mut CudaSlice<f32>) -> Result<()> {
        let n = buf.len();
        let (p, _g) = buf.device_ptr_mut(s);
        self.launch(s, p, p, n, false)
    }

    /// Enqueues the all-gather of every rank's `local` into `out` (`world × local.len()`,
    /// rank-major), as [`Self::all_reduce`] but copying the slots out instead of summing.
    pub fn all_gather(&self, s: &Arc<CudaStream>, local: &CudaSlice<f32>, out: &mut CudaSlice<f32>) -> Result<()> {
        let n = local.len();
        if out.len() != n * self.world {
            let why = format!("output has {} floats for {} × {n}", out.len(), self.world);
            return Err(CudaError::shape("peer_all_reduce_f32", why));
        }
        let (i, _gi) = local.device_ptr(s);
        let (o, _go) = out.device_ptr_mut(s);
        self.launch(s, i, o, n, true)
    }

    /// One call of the kernel over `n` floats at `input`, into `out`.
    fn launch(&self, s: &Arc<CudaStream>, input: u64, out: u64, n: usize, gather: bool) -> Result<()> {
        // An empty message moves nothing, and every rank skips it alike. (Launched, the
        // lines kernel would count a call in which no block waits for a peer, which the
        // reuse of its halves two calls later relies on.)
        if n == 0 {
            return Ok(());
        }
        if n > self.cap {
            return Err(CudaError::shape("peer_all_reduce_f32", format!("{n} floats over a slot of {}", self.cap)));
        }
        if !input.is_multiple_of(16) {
            return Err(CudaError::shape("peer_all_reduce_f32", format!("input at {input:#x} is not 16-byte aligned")));
        }
        let (rank, world, gather) = (self.rank as i32, self.world as i32, i32::from(gather));
        let cfg = LaunchConfig { grid_dim: (BLOCKS, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        // The lines kernel up to `lines_max` floats, over the lines region of `join`'s
        // layout (`line_cap` lines a slot, `2 × line_cap >= n`); above, the flag kernel
        // over the data region (`cap >= n` floats a slot).
        let (func, offset, cap) = if n <= self.lines_max {
            (&self.lines_func, self.lines_offset, self.line_cap)
        } else {
            (&self.func, DATA_OFFSET, self.cap)
        };
        // SAFETY: `input` holds `n` floats and `out` `n` (in place allowed: each block
        // touches only its own slice, of its input before it writes its output) or,
        // gathering, `world` × n of another buffer (the callers' borrows); every base
        // holds the layout of `join`, whose region at `offset` has slots of `cap` for
        // `n`; the arguments match both kernels' signature.
        unsafe {
            s.launch_builder(func)
                .arg(&out)
                .arg(&input)
                .arg(&n)
                .arg(&self.bases)
                .arg(&rank)
                .arg(&world)
                .arg(&offset)
                .arg(&cap)
                .arg(&self.timeout_ns)
                .arg(&self.status_dev)
                .arg(&gather)
                .launch(cfg)
        }?;
        Ok(())
    }
}

/// One zeroed word of pinned host memory mapped into the device: (host, device) address.
fn mapped_word() -> Result<(usize, CUdeviceptr)> {
    let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: allocates 4 bytes of pinned, mapped host memory; freed on drop.
    check(unsafe { sys::cuMemHostAlloc(&mut host, 4, sys::CU_MEMHOSTALLOC_DEVICEMAP) }, "cuMemHostAlloc")?;
    // SAFETY: `host` holds 4 writable bytes.
    unsafe { std::ptr::write_volatile(host as *mut u32, 0) };
    let mut dev: CUdeviceptr = 0;
    // SAFETY: `host` was allocated with DEVICEMAP above.
    let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) };
    if let Err(e) = check(r, "cuMemHostGetDevicePointer") {
        // SAFETY: allocated above, not shared.
        unsafe { sys::cuMemFreeHost(host) };
        return Err(e);
    }
    Ok((host as usize, dev))
}

/// Enables this context's access to the primary context of the device at `pci` (the
/// same process; already enabled counts as done).
fn enable_peer(pci: &[u32]) -> Result<()> {
    let peer = device_of(pci).ok_or_else(|| CudaError::Collective("peer all-reduce: peer device not found".into()))?;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: retains the peer device's primary context (kept alive by its own rank too);
    // released right after access is enabled, which outlives the retain.
    check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, peer) }, "cuDevicePrimaryCtxRetain")?;
    // SAFETY: `ctx` is a live context of another device.
    let r = unsafe { sys::cuCtxEnablePeerAccess(ctx, 0) };
    // SAFETY: balances the retain above.
    unsafe { sys::cuDevicePrimaryCtxRelease_v2(peer) };
    if r == CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        return Ok(());
    }
    check(r, "cuCtxEnablePeerAccess")
}

impl Drop for PeerReduce {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        for &p in &self.opened {
            // SAFETY: opened by cuIpcOpenMemHandle in `join`, closed once.
            unsafe { sys::cuIpcCloseMemHandle(p) };
        }
        // SAFETY: allocated in `join`, freed once; the owner synchronizes its stream first.
        unsafe {
            sys::cuMemFree_v2(self.local);
            sys::cuMemFreeHost(self.status_host as *mut std::ffi::c_void);
        }
    }
}
