//! [`Gpu`]: one device's context and stream, with the facts launch planning needs.

use std::sync::Arc;

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;

use crate::error::{CudaError, Result};

/// One GPU as a rank uses it: its context, the stream every kernel of this rank runs on
/// (the only one: buffers carry no cross-stream events), and the device facts the
/// wrappers plan with. Owned by one thread.
#[derive(Debug)]
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// Streaming multiprocessors (split-KV planning fills these).
    pub num_sms: usize,
    /// Largest dynamic shared memory a block may opt into, in bytes.
    pub max_smem_optin: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
}

impl Gpu {
    /// Opens device `ordinal` (loads the driver library at run time) on a new stream.
    pub fn new(ordinal: usize) -> Result<Self> {
        // cudarc panics when it cannot load libcuda; ask first so that a machine without
        // a GPU gets an error it can report.
        // SAFETY: only tries to dlopen the driver library by its usual names.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        let ctx = CudaContext::new(ordinal)?;
        // Every buffer of this context is used on the one stream below (collectives
        // included), so cudarc's per-buffer events add nothing but host time (an event
        // record per argument per launch) — and a stream being captured into a CUDA graph
        // must not wait on events recorded outside the capture.
        // SAFETY: set before any buffer exists; nothing here uses a second stream.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        if ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? > 0 {
            keep_pool_memory(&ctx)?;
        }
        let num_sms = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
        let max_smem_optin =
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as usize;
        let name = ctx.name()?;
        let compute_capability = ctx.compute_capability()?;
        Ok(Gpu { ctx, stream, num_sms, max_smem_optin, name, compute_capability })
    }

    /// CUDA devices on this machine (an error when there is no driver).
    pub fn count() -> Result<usize> {
        // SAFETY: as in `new`.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        Ok(CudaContext::device_count()?.max(0) as usize)
    }

    /// Loads an embedded fatbin ([`crate::kernels`]); the driver picks the image for this GPU.
    pub fn load_module(&self, image: &[u8]) -> Result<Arc<CudaModule>> {
        Ok(self.ctx.load_module(Ptx::from_binary(image.to_vec()))?)
    }

    /// Waits for the stream and surfaces any error a kernel raised since the last check.
    pub fn sync(&self) -> Result<()> {
        self.stream.synchronize()?;
        self.ctx.check_err()?;
        Ok(())
    }
}

/// Stream-ordered allocations (cudarc's `alloc`, `alloc_zeros`) come from the device's
/// default memory pool, which by default hands its free memory back to the system at
/// every synchronisation: a step's activations (hundreds of MB in prefill) were then
/// mapped anew in every step. A release threshold of "never" keeps them for the next
/// step, as the caching allocators of other inference engines do.
fn keep_pool_memory(ctx: &CudaContext) -> Result<()> {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: the device handle is the live context's; the pool handle is written by the
    // driver before it is used, and the attribute takes a pointer to a u64.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .result()?;
    }
    Ok(())
}

impl Gpu {
    /// Free device memory and the total, after handing back to the device whatever the
    /// default pool keeps unused (what an earlier backend of this process freed), so
    /// that "free" means free to this load.
    pub fn free_memory(&self) -> Result<(usize, usize)> {
        use cudarc::driver::sys;
        self.sync()?;
        if self.ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? > 0 {
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            // SAFETY: the device handle is the live context's; the pool handle is written
            // by the driver before it is used; trimming releases only unused memory.
            unsafe {
                sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()).result()?;
                sys::cuMemPoolTrimTo(pool, 0).result()?;
            }
        }
        Ok(self.ctx.mem_get_info()?)
    }
}
