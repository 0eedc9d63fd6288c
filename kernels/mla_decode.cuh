// Constants shared by the MLA decode kernels (mla_decode.cu: mma.sync path, combine,
// generic; mla_decode_sm90.cu: wgmma path). The Rust wrapper (crates/mlaserve-cuda/
// src/mla_decode.rs) mirrors them.
#pragma once

#include "common.cuh"

namespace mla {

constexpr int BM = 64;        // query rows per tile
constexpr int BN = 32;        // cache tokens per pipeline chunk (half a page)
constexpr int PAGE = 64;      // tokens per cache page (FlashMLA's block size)
constexpr int STAGES = 3;     // cp.async ring depth, in chunks
constexpr int NTHREADS = 256; // 8 warps = 2 warpgroups

// The merge of two splits of one row, as mla_decode_combine does it for any count:
// lse = log(e^a + e^b), and the weights e^(a - lse), e^(b - lse) of the two normalised
// partials. Two empty splits (-inf, -inf) give lse -inf and zero weights.
__device__ __forceinline__ float merge2_lse(float a, float b, float& wa, float& wb) {
    const float mx = fmaxf(a, b);
    if (mx == -MLAS_INF) {
        wa = wb = 0.f;
        return -MLAS_INF;
    }
    const float total = mx + __logf(__expf(a - mx) + __expf(b - mx));
    wa = __expf(a - total);
    wb = __expf(b - total);
    return total;
}

}  // namespace mla
