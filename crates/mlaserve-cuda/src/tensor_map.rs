//! TMA tensor maps (`CUtensorMap`) of bf16 and byte (fp8) buffers, as by-value kernel
//! arguments. A leaf shared by the decode, prefill, GEMM, grouped-expert and fp8 wrappers.

use cudarc::driver::{sys, DeviceRepr};

use crate::error::Result;

/// A `CUtensorMap` as a by-value kernel argument (`const __grid_constant__ CUtensorMap`).
#[repr(transparent)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct TensorMapArg(pub(crate) sys::CUtensorMap);
// SAFETY: a plain 128-byte, 128-aligned POD that the driver copies into the kernel's
// parameter space, which is what the kernels declare.
unsafe impl DeviceRepr for TensorMapArg {}

/// A bf16 tensor map (rank = `dims.len()`, ≤ 5) at `ptr` with 128-byte swizzle, unit
/// element strides, 256-byte L2 promotion; out-of-range elements read as zero. `strides`
/// are the byte strides of dims 1.. (multiples of 16); the caller guarantees that `ptr`
/// is a device allocation covering every element the dims address, 16-byte aligned.
pub(crate) fn bf16_tensor_map(
    ptr: sys::CUdeviceptr,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
) -> Result<TensorMapArg> {
    tensor_map(sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, ptr, dims, strides, boxes)
}

/// As [`bf16_tensor_map`] for elements of type `dtype`.
fn tensor_map(
    dtype: sys::CUtensorMapDataType,
    ptr: sys::CUdeviceptr,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
) -> Result<TensorMapArg> {
    assert!(dims.len() <= 5 && strides.len() + 1 == dims.len() && boxes.len() == dims.len());
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    let elem_strides = [1u32; 5];
    // SAFETY: every pointer refers to a live slice of at least the rank the call is given
    // (checked above); the caller vouches for the global address; the map is written in
    // place.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            dims.len() as u32,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()?;
        Ok(TensorMapArg(map.assume_init()))
    }
}

/// A 2-D bf16 tensor map of a row-major `[outer][inner]` matrix at `ptr`, boxes of 64
/// (128 bytes, the swizzle span) × `box_outer` rows; out-of-range elements read as zero.
/// The caller guarantees a device allocation of at least `outer × inner` bf16, 16-byte
/// aligned, with `inner % 8 == 0` (16-byte rows).
pub(crate) fn bf16_matrix_map(
    ptr: sys::CUdeviceptr,
    inner: usize,
    outer: usize,
    box_outer: u32,
) -> Result<TensorMapArg> {
    bf16_tensor_map(ptr, &[inner as u64, outer as u64], &[(inner * 2) as u64], &[64, box_outer])
}

/// A 2-D byte (fp8) tensor map of a row-major `[outer][inner]` matrix at `ptr`, boxes of
/// 128 bytes (the swizzle span) × `box_outer` rows; out-of-range elements read as zero.
/// The caller guarantees a device allocation of at least `outer × inner` bytes, 16-byte
/// aligned, with `inner % 16 == 0`.
pub(crate) fn u8_matrix_map(ptr: sys::CUdeviceptr, inner: usize, outer: usize, box_outer: u32) -> Result<TensorMapArg> {
    tensor_map(
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        ptr,
        &[inner as u64, outer as u64],
        &[inner as u64],
        &[128, box_outer],
    )
}

/// A byte (fp8) `[rows][k]` matrix at `ptr` as 3-D (128 bytes, k / 128 blocks, rows), boxes
/// of 128 bytes × `box_blocks` × `box_rows`: a box lands as `[row][block][128 bytes]`, each
/// 128-byte line swizzled; out-of-range elements read as zero. The caller guarantees a
/// device allocation of at least `rows × k` bytes, 16-byte aligned, `k % 128 == 0`.
pub(crate) fn u8_kblock_map(
    ptr: sys::CUdeviceptr,
    k: usize,
    rows: usize,
    box_blocks: u32,
    box_rows: u32,
) -> Result<TensorMapArg> {
    tensor_map(
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        ptr,
        &[128, (k / 128) as u64, rows as u64],
        &[128, k as u64],
        &[128, box_blocks, box_rows],
    )
}
