// Constants shared by the MLA decode kernels (mla_decode.cu: mma.sync path, combine,
// generic; mla_decode_sm90_ss.cu and mla_decode_sm90_t.cu: the wgmma paths). The Rust wrapper (crates/mlaserve-cuda/
// src/mla_decode.rs) mirrors them.
#pragma once

#include "common.cuh"

namespace mla {

constexpr int BM = 64;        // query rows per tile
constexpr int BN = 32;        // cache tokens per pipeline chunk (half a page)
constexpr int PAGE = 64;      // tokens per cache page (FlashMLA's block size)
constexpr int STAGES = 3;     // cp.async ring depth, in chunks
constexpr int NTHREADS = 256; // 8 warps = 2 warpgroups

// L2 loads of partials other CTAs may have written in this launch: .cg bypasses L1 (no
// stale line), and the memory clobber keeps them after the fence that orders them.
__device__ __forceinline__ float ld_cg_f32(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float4 ld_cg_f4(const float* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

// The split-KV merge of one (request, row), by one warp (every lane calls it): partial k
// is o_acc[(base + k * rstride) * dv ..] with its natural-log LSE at lse_acc[base + k *
// rstride]. lse = log sum_k exp(lse_k), out = sum_k exp(lse_k - lse) o_k; an empty split
// (lse -inf, its partial possibly never written) is skipped, and a row with no split
// gives lse -inf and zeros. dv is a multiple of 4. Used by mla_decode_combine and by the
// 64-token kernels' last-CTA merge.
template <typename OutT>
__device__ __forceinline__ void merge_splits_row(const float* __restrict__ o_acc, const float* __restrict__ lse_acc,
                                                 size_t base, size_t rstride, int num_splits, int dv,
                                                 OutT* __restrict__ out_row, float* __restrict__ lse_out) {
    const int lane = threadIdx.x & 31;
    float mx = -MLAS_INF;
    for (int k = lane; k < num_splits; k += 32) mx = fmaxf(mx, ld_cg_f32(lse_acc + base + k * rstride));
    mx = warp_max(mx);
    float sum = 0.f;
    if (mx != -MLAS_INF)
        for (int k = lane; k < num_splits; k += 32) sum += __expf(ld_cg_f32(lse_acc + base + k * rstride) - mx);
    sum = warp_sum(sum);
    const float total = sum > 0.f ? mx + __logf(sum) : -MLAS_INF;
    // 512 dims per pass (DeepSeek's dv: one pass), four float4 loads per split. The
    // splits' LSEs are read 32 at a time (one per lane) and handed round by shuffles, so
    // a split's loads wait on no other load and several splits' are in flight at once;
    // the sum's order (k ascending) is the serial one.
    for (int d0 = 0; d0 < dv; d0 += 512) {
        float4 acc[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int k0 = 0; k0 < num_splits; k0 += 32) {
            const float mine = k0 + lane < num_splits ? ld_cg_f32(lse_acc + base + (k0 + lane) * rstride) : -MLAS_INF;
            const int nk = min(32, num_splits - k0);
#pragma unroll 4
            for (int j = 0; j < nk; ++j) {
                const float lk = __shfl_sync(0xffffffffu, mine, j);
                if (lk == -MLAS_INF) continue;
                const size_t pr = base + (k0 + j) * rstride;
                const float w = __expf(lk - total);
                float4 v[4];
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int d = d0 + 128 * c + 4 * lane;
                    v[c] = d < dv ? ld_cg_f4(o_acc + pr * dv + d) : make_float4(0.f, 0.f, 0.f, 0.f);
                }
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    acc[c].x += w * v[c].x;
                    acc[c].y += w * v[c].y;
                    acc[c].z += w * v[c].z;
                    acc[c].w += w * v[c].w;
                }
            }
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int d = d0 + 128 * c + 4 * lane;
            if (d < dv) {
                store2(out_row + d, acc[c].x, acc[c].y);
                store2(out_row + d + 2, acc[c].z, acc[c].w);
            }
        }
    }
    if (lane == 0) *lse_out = total;
}

// A finished row's 1 / sum and natural-log LSE from its sum l and reference max m (log2
// units, scaled): 0 and -inf for a row that saw no token.
__device__ __forceinline__ float row_inv_lse(float l, float m, float& inv) {
    inv = l > 0.f ? 1.f / l : 0.f;
    return l > 0.f ? (m + __log2f(l)) * 0.69314718055994531f : -MLAS_INF;
}

// The output of the 64-row wgmma kernels (dv = 512): the thread (row group rg = warp
// within its warpgroup, lane) holds O's rows 16 rg + lane/4 and + 8, columns 256 wg + 8n
// + 2(lane%4) and + 1 (n < 32), in the m64n256 accumulator layout, with those rows' sums
// l and reference maxima m (log2 units, scaled). Writes the normalised rows past none of
// valid_rows: to out / lse with one split, else to this split's partial in o_acc /
// lse_acc (natural-log LSE, -inf for a row that saw no token).
template <typename OutT>
__device__ __forceinline__ void store_o_rows(const float (&o)[128], const float (&l)[2], const float (&m)[2], int rg,
                                             int wg, int lane, int b, int rows, int row0, int valid_rows, int split,
                                             int num_splits, OutT* __restrict__ out, float* __restrict__ lse,
                                             float* __restrict__ o_acc, float* __restrict__ lse_acc) {
    constexpr int DV = 512;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int lr = rg * 16 + (lane >> 2) + 8 * i;
        if (lr >= valid_rows) continue;
        const int row = row0 + lr;
        float inv;
        const float row_lse = row_inv_lse(l[i], m[i], inv);
        const int d0 = wg * 256 + 2 * (lane & 3);
        if (num_splits == 1) {
            OutT* ob = out + (static_cast<size_t>(b) * rows + row) * DV + d0;
#pragma unroll
            for (int n = 0; n < 32; ++n) store2(ob + n * 8, o[4 * n + 2 * i] * inv, o[4 * n + 2 * i + 1] * inv);
            if (wg == 0 && (lane & 3) == 0) lse[static_cast<size_t>(b) * rows + row] = row_lse;
        } else {
            const size_t pr = (static_cast<size_t>(b) * num_splits + split) * rows + row;
            float* ob = o_acc + pr * DV + d0;
#pragma unroll
            for (int n = 0; n < 32; ++n) store2(ob + n * 8, o[4 * n + 2 * i] * inv, o[4 * n + 2 * i + 1] * inv);
            if (wg == 0 && (lane & 3) == 0) lse_acc[pr] = row_lse;
        }
    }
}

// The merge of two splits of one row, as merge_splits_row does it for any count:
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
