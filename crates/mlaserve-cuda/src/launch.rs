//! Launch helpers every typed wrapper shares: length checks against what a kernel
//! touches, `i32` kernel arguments, the common grid shapes, and loading a function with
//! its dynamic shared-memory allowance. A leaf: it imports nothing of the crate but
//! [`crate::error`].

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtrMut, LaunchConfig, SyncOnDrop};

use crate::error::{CudaError, Result};

/// Fails with a shape error unless `len >= want`.
pub(crate) fn need(kernel: &'static str, what: &str, len: usize, want: usize) -> Result<()> {
    if len < want {
        return Err(CudaError::shape(kernel, format!("{what} has {len} elements, needs {want}")));
    }
    Ok(())
}

/// `v` as a kernel's `int` argument, or a shape error naming the kernel.
pub(crate) fn i32_of(kernel: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::shape(kernel, format!("{v} overflows i32")))
}

/// The device address of an optional buffer (0, the kernels' null, when absent) and the
/// guard that records its use on `s`; a present one must hold `len` elements.
pub(crate) fn opt_ptr_mut<'a, T>(
    kernel: &'static str,
    what: &'static str,
    s: &'a CudaStream,
    buf: Option<&'a mut CudaSlice<T>>,
    len: usize,
) -> Result<(u64, Option<SyncOnDrop<'a>>)> {
    match buf {
        Some(b) => {
            need(kernel, what, b.len(), len)?;
            let (p, g) = b.device_ptr_mut(s);
            Ok((p, Some(g)))
        }
        None => Ok((0, None)),
    }
}

/// One block of `threads` per row.
pub(crate) fn rows_cfg(rows: usize, threads: u32, smem: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem as u32 }
}

/// Blocks of `threads` over (row, column block): the column blocks of a row cover `width`
/// columns at about `per_thread` a thread (kernels that stride by gridDim.y · blockDim.x,
/// so any count is correct; more blocks fill the SMs when rows are few).
pub(crate) fn row_blocks_cfg(rows: usize, width: usize, threads: u32, per_thread: usize) -> LaunchConfig {
    let blocks = width.div_ceil(threads as usize * per_thread.max(1)).clamp(1, 65_535);
    LaunchConfig { grid_dim: (rows as u32, blocks as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// One block of `threads` per (head, row).
pub(crate) fn head_cfg(heads: usize, rows: usize, threads: u32, smem: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (heads as u32, rows as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem as u32 }
}

/// A grid-stride launch: `blocks_per_sm` blocks of 256 threads per SM, independent of the
/// element count.
pub(crate) fn grid_stride(num_sms: usize, blocks_per_sm: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: ((num_sms * blocks_per_sm) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// Function `name` of `m`, allowed `smem` bytes of dynamic shared memory.
pub(crate) fn with_smem(m: &Arc<CudaModule>, name: &str, smem: usize) -> Result<CudaFunction> {
    let f = m.load_function(name)?;
    f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)?;
    Ok(f)
}

/// Calls `f` with a `cuLaunchKernelEx` configuration of `cfg` on `stream` (null for an
/// occupancy query) whose one attribute makes clusters of `cluster` blocks (cudarc's
/// launcher has no cluster attribute); the attribute lives through the call.
fn with_cluster_config<R>(
    cfg: LaunchConfig,
    stream: cudarc::driver::sys::CUstream,
    cluster: (u32, u32, u32),
    f: impl FnOnce(&cudarc::driver::sys::CUlaunchConfig) -> R,
) -> R {
    use cudarc::driver::sys;
    // SAFETY: plain data; every field the driver reads is set below.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim =
        sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: cluster.0, y: cluster.1, z: cluster.2 };
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    f(&config)
}

/// How many clusters of `cluster` blocks of `f` (with `cfg`'s block and shared memory)
/// the GPU runs at once (0 where such a cluster cannot run).
pub(crate) fn max_active_clusters(f: &CudaFunction, cfg: LaunchConfig, cluster: (u32, u32, u32)) -> Result<usize> {
    let mut n = 0;
    with_cluster_config(cfg, std::ptr::null_mut(), cluster, |config| {
        // SAFETY: a live function; the configuration outlives the call, which writes `n`.
        unsafe { cudarc::driver::sys::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), config).result() }
    })?;
    Ok(n.max(0) as usize)
}

/// Launches `f` on `s` as clusters of `cluster` blocks (`cuLaunchKernelEx`), `params`
/// pointing at the kernel's arguments in order.
///
/// # Safety
/// As any launch: `params` must match the kernel's parameters (each entry pointing at a
/// live value of the parameter's type) and the kernel must stay within the buffers it is
/// given; `cluster` must divide the grid.
pub(crate) unsafe fn launch_cluster(
    s: &CudaStream,
    f: &CudaFunction,
    cfg: LaunchConfig,
    cluster: (u32, u32, u32),
    params: &mut [*mut std::ffi::c_void],
) -> Result<()> {
    s.context().bind_to_thread()?;
    with_cluster_config(cfg, s.cu_stream(), cluster, |config| {
        // SAFETY: the caller's contract; the configuration outlives the call.
        unsafe {
            cudarc::driver::sys::cuLaunchKernelEx(config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut())
                .result()
        }
    })?;
    Ok(())
}
