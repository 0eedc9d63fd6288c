// Device-side helpers for tests and benchmarks: the copy-bandwidth ceiling (grid-stride
// float4 copy) and random fills, so multi-GB benchmark inputs never cross PCIe and are
// never zeros (zeros hide unwritten outputs and run faster than real data).
#include "common.cuh"

// dst[i] = src[i] for n16 16-byte elements. Bytes moved = 2 * 16 * n16 (read + write).
extern "C" __global__ void copy_f4(const float4* __restrict__ src, float4* __restrict__ dst, size_t n16) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n16; i += stride) dst[i] = src[i];
}

// Counter-based hash (splitmix64 finaliser): the same (seed, i) gives the same value on
// any launch geometry.
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ float uniform01(uint64_t seed, size_t i) {
    return static_cast<float>(mix64(seed * 0x100000001b3ull + i) >> 40) * (1.0f / 16777216.0f);
}

// x[i] = lo + (hi - lo) * U(0,1), deterministic in (seed, i).
extern "C" __global__ void fill_uniform_bf16(bf16* __restrict__ x, size_t n, unsigned long long seed, float lo, float hi) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = __float2bfloat16_rn(lo + (hi - lo) * uniform01(seed, i));
}
extern "C" __global__ void fill_uniform_f32(float* __restrict__ x, size_t n, unsigned long long seed, float lo, float hi) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = lo + (hi - lo) * uniform01(seed, i);
}
// Poison: every word set to `bits` (e.g. a NaN pattern) to catch unwritten outputs.
extern "C" __global__ void fill_u32(unsigned int* __restrict__ x, size_t n, unsigned int bits) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) x[i] = bits;
}
