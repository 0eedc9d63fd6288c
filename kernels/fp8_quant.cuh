// Per-token activation quantisation of the fp8 GEMMs' inputs (1 × 128 groups, e4m3 with
// an f32 scale each): shared by the fp8 kernels (fp8.cuh) and the kernels that quantise
// their own output for one (heads_tc.cu). Plain CUDA: any architecture.
#pragma once

#include <cuda_fp8.h>

#include "common.cuh"

namespace f8 {
constexpr int QB = 128;           // scale block (k and n)
constexpr float E4M3_MAX = 448.f;  // largest finite e4m3
}  // namespace f8

// ---------------------------------------------------------------- activation quantisation

__device__ __forceinline__ void load4(const bf16* p, float (&v)[4]) {
    const uint2 r = *reinterpret_cast<const uint2*>(p);
    const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&r.x);
    const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&r.y);
    v[0] = __low2float(a), v[1] = __high2float(a), v[2] = __low2float(b), v[3] = __high2float(b);
}
__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
    const float4 r = *reinterpret_cast<const float4*>(p);
    v[0] = r.x, v[1] = r.y, v[2] = r.z, v[3] = r.w;
}

// One (row, 128-group) of a quantised activation from its lanes' four values each (lane
// l holds channels 4l .. 4l + 3 of the group): s = amax / 448 over the warp, codes
// e4m3(v / s) into q[at .. at + 4), the scale into *sc_out by lane 0.
__device__ __forceinline__ void quant_group(const float (&v)[4], uint8_t* __restrict__ q, size_t at,
                                            float* __restrict__ sc_out, int lane) {
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    amax = warp_max(amax);
    // An all-zero group keeps scale 1 (its bytes are then ±0).
    const float sc = amax > 0.f ? __fdiv_rn(amax, f8::E4M3_MAX) : 1.f;
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_fp8_storage_t b = __nv_cvt_float_to_fp8(__fdiv_rn(v[i], sc), __NV_SATFINITE, __NV_E4M3);
        packed |= static_cast<uint32_t>(b) << (8 * i);
    }
    *reinterpret_cast<uint32_t*>(q + at) = packed;
    if (lane == 0) *sc_out = sc;
}
