// Absorbed-MLA decode attention over the fp8 latent cache (`--kv-cache-dtype fp8`, layout in
// kv_fp8.cuh: 656-byte entries of 512 e4m3 codes, four f32 group scales, 64 bf16 k_pe),
// Hopper (sm_90a). Same contract, split-KV partial format and merges as the bf16 kernels
// (mla_decode_sm90_ss.cu, mla_decode_sm90_t.cu); the cache argument holds the entries.
//
// A CTA takes one tile of 32 query rows of one (request, split) and walks its 64-token
// blocks in order, its two warpgroups specialised:
//   - warpgroup 1 (the widener) brings each raw page by one TMA bulk copy (41,984 bytes)
//     into a raw buffer, with the page after it prefetched into L2, and widens it into one
//     of two bf16 blocks in shared memory, laid out as the bf16 kernels' TMA lands a block
//     (codes as bf16(code * scale), k_pe copied; entries past seq_len stored as zeros,
//     never read);
//   - warpgroup 0 (the computer) runs the transposed kernel's math on the other block
//     meanwhile, all 32 rows at once: S^T = K Q^T (36 wgmma m64n32k16, the 64 tokens as
//     M), the mask and the column max over its 4 warps, P^T = exp2(S^T * scale_log2 - m)
//     as bf16, O^T += V^T P^T (32 wgmma m64n32k16, V^T read M-major from the block).
// mbarriers hand the blocks over: `full` (widened) and `empty` (its P V done) per block,
// `raw` per page copy.
// Splits as the seesaw kernel's (even, or split_blocks pages each from block 0, the last
// split taking the rest) with the causal skip of blocks no row of the tile sees, so with
// fixed splits a row's result does not depend on its batch or window.
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common.cuh"
#include "kv_fp8.cuh"
#include "mla_decode.cuh"
#include "wgmma.cuh"

namespace mla90f {
using namespace mla;  // PAGE, NTHREADS

inline constexpr int DLAT = 512, DQK = 576;
inline constexpr int PIECES = DQK / 64, VPIECES = DLAT / 64;
inline constexpr int PIECE_BYTES = PAGE * 128;           // one 64-dim piece of a block
inline constexpr int SLOT_BYTES = PIECES * PIECE_BYTES;  // the widened block: 73,728
inline constexpr int QROWS = 32, WROWS = 16;             // rows a tile, rows a warpgroup
inline constexpr int CHUNKS = DQK / 8;                   // 16-byte chunks per Q row
inline constexpr int WG_THREADS = 128;
inline constexpr int O_STRIDE = DLAT + 4;
inline constexpr int ENTRY = 656, RAW_PAGE = PAGE * ENTRY;
static_assert(ENTRY == kvf8::entry_bytes(DLAT, DQK - DLAT), "the fp8 entry of 512 + 64 channels");

// Shared memory, offsets from the 1024-aligned base:
//   Q      32 x 1152       [9 pieces][32 rows][128 B]                  36,864
//   blocks 2 x 73,728      the widened blocks [9 pieces][64][128 B]   147,456
//   raw    41,984          one raw page                                41,984
//   P^T    32 x 128        [32 rows][64 tokens bf16]                    4,096
//   red    32 x 4 f32      per row, the 4 warps' block max                512
//   bars   5 x 8           raw, full[2], empty[2]                          40
// + 1024 alignment slack = SMEM_BYTES (the host passes it). After the loop the raw page
// holds the row sums and maxima, block 0 the normalised rows (32 x O_STRIDE f32), and
// (two-CTA clusters) Q's bytes the peer's half.
inline constexpr int Q_PIECE = QROWS * 128, Q_BYTES = PIECES * Q_PIECE;
inline constexpr int OFF_SLOT = Q_BYTES;
inline constexpr int OFF_RAW = OFF_SLOT + 2 * SLOT_BYTES;
inline constexpr int OFF_P = OFF_RAW + RAW_PAGE;
inline constexpr int P_BYTES = QROWS * 128;
inline constexpr int OFF_RED = OFF_P + P_BYTES;
inline constexpr int OFF_BAR = OFF_RED + QROWS * 4 * 4;
inline constexpr int SMEM_BYTES = 1024 + OFF_BAR + 5 * 8;
static_assert(SMEM_BYTES == 231976, "update the layout comment and the host (FP8_SMEM in mla_decode.rs)");
static_assert(SMEM_BYTES <= 227 * 1024, "exceeds the opt-in shared memory of sm_90");
static_assert(OFF_SLOT % 1024 == 0 && OFF_P % 1024 == 0 && OFF_RAW % 16 == 0, "swizzle atoms, bulk copies");
static_assert(QROWS * O_STRIDE * 4 <= SLOT_BYTES, "the normalised rows must fit in block 0");
static_assert(QROWS * 257 * 4 <= Q_BYTES, "the peer's half must fit in Q's bytes");
static_assert((4 * QROWS + QROWS) * 4 <= RAW_PAGE, "the row sums and maxima must fit in the raw page");

// Byte offset of 16-byte chunk c (dims 8c..8c+7) of row r in a [piece][ROWS][128 B] tile.
template <int ROWS>
__device__ __forceinline__ uint32_t sw128(int r, int c) {
    return static_cast<uint32_t>((c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}
__device__ __forceinline__ uint4 lds_v4(uint32_t a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ void sts_v4(uint32_t a, uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}
// Four e4m3 codes (low byte first) times `sc`, as two packed bf16 pairs.
__device__ __forceinline__ void widen4(uint32_t w, float sc, uint32_t& lo, uint32_t& hi) {
    const __half2 a = __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3));
    const __half2 b = __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3));
    const float2 fa = __half22float2(a), fb = __half22float2(b);
    lo = pack_bf16x2(fa.x * sc, fa.y * sc);
    hi = pack_bf16x2(fb.x * sc, fb.y * sc);
}

// The raw page at `raw` into `slot` by a warpgroup's 128 threads: thread wtid takes entry
// t = wtid / 2, half h = wtid % 2 of it: codes 256h .. 256h + 255 (16-byte chunks 16h ..
// 16h + 15, groups 2h and 2h + 1: pieces 4h .. 4h + 3) and k_pe 32h .. 32h + 31 (piece
// 8, chunks 4h .. 4h + 3), each code as bf16(code * scale); an entry from `valid` on is
// stored as zeros (not read: past seq_len the cache may hold NaN codes). Straight-line
// code with four chunks' loads ahead of their conversions; a warp's 16-byte accesses
// spread evenly over the bank groups (loads: entries 656 = 41 x 16 bytes apart; stores:
// swizzled).
__device__ __forceinline__ void widen_page(uint32_t raw, uint32_t slot, int valid, int wtid) {
    const int t = wtid >> 1, h = wtid & 1, sw = t & 7;
    const uint32_t src = raw + t * ENTRY, row = slot + t * 128;
    if (t >= valid) {
#pragma unroll
        for (int p = 0; p < 4; ++p)
#pragma unroll
            for (int c = 0; c < 8; ++c) sts_v4(row + (4 * h + p) * PIECE_BYTES + ((c ^ sw) << 4), 0u, 0u, 0u, 0u);
#pragma unroll
        for (int c = 0; c < 4; ++c) sts_v4(row + 8 * PIECE_BYTES + (((4 * h + c) ^ sw) << 4), 0u, 0u, 0u, 0u);
        return;
    }
    float sc0, sc1;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(sc0), "=f"(sc1) : "r"(src + DLAT + 8 * h));
#pragma unroll
    for (int k0 = 0; k0 < 16; k0 += 4) {
        uint4 v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = lds_v4(src + (16 * h + k0 + k) * 16);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int jj = k0 + k;  // chunk 16h + jj: codes 16(16h + jj) .. + 15
            const float sc = jj < 8 ? sc0 : sc1;
            uint32_t w[8];
            widen4(v[k].x, sc, w[0], w[1]);
            widen4(v[k].y, sc, w[2], w[3]);
            widen4(v[k].z, sc, w[4], w[5]);
            widen4(v[k].w, sc, w[6], w[7]);
            const uint32_t pr = row + (4 * h + (jj >> 2)) * PIECE_BYTES;
            const int c = 2 * (jj & 3);
            sts_v4(pr + ((c ^ sw) << 4), w[0], w[1], w[2], w[3]);
            sts_v4(pr + (((c + 1) ^ sw) << 4), w[4], w[5], w[6], w[7]);
        }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const uint4 v = lds_v4(src + (33 + 4 * h + c) * 16);
        sts_v4(row + 8 * PIECE_BYTES + (((4 * h + c) ^ sw) << 4), v.x, v.y, v.z, v.w);
    }
}

template <typename OutT, bool PAIR>
__device__ __forceinline__ void body(const bf16* __restrict__ q, const uint8_t* __restrict__ kv,
                                     const int* __restrict__ block_table, const int* __restrict__ seq_lens,
                                     OutT* __restrict__ out, float* __restrict__ lse, float* __restrict__ o_acc,
                                     float* __restrict__ lse_acc, unsigned int* __restrict__ counters, int heads,
                                     int q_len, int bt_stride, int num_blocks, int num_splits, int split_blocks,
                                     float scale_log2) {
    constexpr int NF = QROWS / 2;  // accumulator floats per thread of a 64 x 32 tile
    constexpr int NJ = QROWS / 8;  // 8-column groups
    constexpr int NC = QROWS / 4;  // columns (query rows) a thread holds

    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw0 = smem_u32(smem_raw);
    const uint32_t base = (raw0 + 1023u) & ~1023u;
    uint8_t* smem = smem_raw + (base - raw0);

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const int wtid = tid & (WG_THREADS - 1);
    const int w = (tid >> 5) & 3;
    const int split = blockIdx.y, b = blockIdx.z;
    const int rows = heads * q_len;
    const int row0 = blockIdx.x * QROWS;
    const int valid_rows = min(QROWS, rows - row0);
    const int seq_len = max(0, min(seq_lens[b], bt_stride * PAGE));

    const int n_blk = (seq_len + PAGE - 1) / PAGE;
    const int seen = seq_len - (q_len - 1 - min((row0 + valid_rows - 1) / heads, q_len - 1));
    const int n_vis = min(n_blk, (max(seen, 0) + PAGE - 1) / PAGE);
    const int per = split_blocks > 0 ? split_blocks : (n_blk + num_splits - 1) / num_splits;
    const int blk_begin = min(split * per, n_vis);
    const int blk_end = split == num_splits - 1 ? n_vis : min(blk_begin + per, n_vis);
    const int nb = blk_end - blk_begin;
    const int* bt = block_table + static_cast<size_t>(b) * bt_stride;

    const uint32_t sQ = base, sRaw = base + OFF_RAW, sP = base + OFF_P;
    auto slot_of = [&](int i) { return base + OFF_SLOT + (i & 1) * SLOT_BYTES; };
    float* red = reinterpret_cast<float*>(smem + OFF_RED);  // [column][warp]
    const uint32_t bar_raw = base + OFF_BAR;
    auto bar_full = [&](int i) { return base + OFF_BAR + 8 + 8 * (i & 1); };
    auto bar_empty = [&](int i) { return base + OFF_BAR + 24 + 8 * (i & 1); };

    {
        const bf16* qb = q + (static_cast<size_t>(b) * rows + row0) * DQK;
        for (int i = tid; i < QROWS * CHUNKS; i += NTHREADS) {
            const int r = i / CHUNKS, c = i % CHUNKS;
            const bool ok = r < valid_rows;
            cp_async_16(sQ + sw128<QROWS>(r, c), ok ? qb + r * DQK + c * 8 : q, ok ? 16 : 0);
        }
        cp_async_commit();
    }
    auto page_of = [&](int i) { return kv + static_cast<size_t>(min(max(bt[blk_begin + i], 0), num_blocks - 1)) * RAW_PAGE; };
    // Block i of the split into the raw buffer (the widener's first thread).
    auto load_raw = [&](int i) {
        mbar_arrive_expect_tx(bar_raw, RAW_PAGE);
        bulk_load(sRaw, page_of(i), RAW_PAGE, bar_raw);
        if (i + 1 < nb)
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(page_of(i + 1)), "r"(RAW_PAGE) : "memory");
    };
    if (tid == 0) {
        mbar_init(bar_raw, 1);
        for (int k = 0; k < 2; ++k) {
            mbar_init(bar_full(k), 1);
            mbar_init(bar_empty(k), 1);
        }
        fence_mbar_init();
    }
    cp_async_wait<0>();
    fence_proxy_async_smem();  // Q (cp.async) -> wgmma
    __syncthreads();           // barriers initialised, Q visible

    float o[VPIECES][NF];  // the computer's O^T tile p: dims 64p + 16w + lane/4 + 8(e>>1)
    float m[NC], l[NC];    // reference max (times scale_log2, log2 units); partial sum
    if (wg == 1) {
        // ---- The widener: page i -> raw -> block i % 2, two blocks ahead of the computer at most.
        if (wtid == 0 && nb > 0) load_raw(0);
        for (int i = 0; i < nb; ++i) {
            if (i >= 2) mbar_wait(bar_empty(i), ((i >> 1) - 1) & 1);  // block i % 2's P V is done
            mbar_wait(bar_raw, i & 1);
            widen_page(sRaw, slot_of(i), seq_len - (blk_begin + i) * PAGE, wtid);
            fence_proxy_async_smem();  // the block's stores -> wgmma; the raw reads -> the next copy
            named_barrier_sync(1, WG_THREADS);
            if (wtid == 0) {
                mbar_arrive(bar_full(i));
                if (i + 1 < nb) load_raw(i + 1);
            }
        }
    } else {
        // ---- The computer.
        const uint64_t dq = gmma_desc_sw128(sQ, 16, 1024);
        const uint64_t dp = gmma_desc_sw128(sP, 16, 1024);
        const int min_limit = seq_len - (q_len - 1);
#pragma unroll
        for (int p = 0; p < VPIECES; ++p)
#pragma unroll
            for (int e = 0; e < NF; ++e) o[p][e] = 0.f;
#pragma unroll
        for (int k = 0; k < NC; ++k) {
            m[k] = -MLAS_INF;
            l[k] = 0.f;
        }
        for (int i = 0; i < nb; ++i) {
            const int blk = blk_begin + i;
            const uint32_t slot = slot_of(i);
            const uint64_t dk = gmma_desc_sw128(slot, 16, 1024);
            const uint64_t dv = gmma_desc_sw128(slot, PIECE_BYTES, 1024);
            mbar_wait(bar_full(i), (i >> 1) & 1);

            float s[NF];
#pragma unroll
            for (int e = 0; e < NF; ++e) s[e] = 0.f;
            fence_operands(s);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < 4 * PIECES; ++ks) {
                const uint32_t off_k = (ks >> 2) * PIECE_BYTES + (ks & 3) * 32;
                const uint32_t off_q = (ks >> 2) * Q_PIECE + (ks & 3) * 32;
                wgmma_m64n32k16_ss<0>(s, gmma_desc_add(dk, off_k), gmma_desc_add(dq, off_q));
            }
            wgmma_commit();
            wgmma_wait<0>();
            fence_operands(s);

            // s[4j + e]: token 16w + lane/4 + 8(e>>1), column 8j + 2(lane%4) + (e&1).
            const int tok = blk * PAGE + 16 * w + (lane >> 2);
            if (blk * PAGE + PAGE > min_limit) {
#pragma unroll
                for (int j = 0; j < NJ; ++j)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int row = row0 + 8 * j + 2 * (lane & 3) + c;
                        const int s_idx = min(row / heads, q_len - 1);
                        const int limit = seq_len - (q_len - 1 - s_idx);
                        if (tok >= limit) s[4 * j + c] = -MLAS_INF;
                        if (tok + 8 >= limit) s[4 * j + 2 + c] = -MLAS_INF;
                    }
            }
            float mx[NC];
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) mx[2 * j + c] = fmaxf(s[4 * j + c], s[4 * j + 2 + c]);
#pragma unroll
            for (int k = 0; k < NC; ++k) {
                mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], 4));
                mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], 8));
                mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], 16));
            }
            if (lane < 4) {
#pragma unroll
                for (int j = 0; j < NJ; ++j)
#pragma unroll
                    for (int c = 0; c < 2; ++c) red[(8 * j + 2 * lane + c) * 4 + w] = mx[2 * j + c];
            }
            named_barrier_sync(2, WG_THREADS);
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float4 r4 = *reinterpret_cast<const float4*>(red + (8 * j + 2 * (lane & 3) + c) * 4);
                    mx[2 * j + c] = fmaxf(fmaxf(r4.x, r4.y), fmaxf(r4.z, r4.w));
                }
            float ms[NC], alpha[NC];
#pragma unroll
            for (int k = 0; k < NC; ++k) {
                // Lazy rescaling, as the transposed kernel: the reference moves only by > 8.
                const float cand = mx[k] == -MLAS_INF ? -MLAS_INF : mx[k] * scale_log2;
                const float ref = cand > m[k] + 8.f ? cand : m[k];
                ms[k] = ref == -MLAS_INF ? 0.f : ref;
                alpha[k] = m[k] == -MLAS_INF ? 1.f : fast_exp2(m[k] - ms[k]);
                m[k] = ref;
            }
            uint32_t pk[NJ][2];
            float rs[NC];
#pragma unroll
            for (int k = 0; k < NC; ++k) rs[k] = 0.f;
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float p0 = fast_exp2(fmaf(s[4 * j + 2 * h], scale_log2, -ms[2 * j]));
                    const float p1 = fast_exp2(fmaf(s[4 * j + 2 * h + 1], scale_log2, -ms[2 * j + 1]));
                    rs[2 * j] += p0;
                    rs[2 * j + 1] += p1;
                    pk[j][h] = pack_bf16x2(p0, p1);
                }
#pragma unroll
            for (int k = 0; k < NC; ++k) l[k] = l[k] * alpha[k] + rs[k];
            {
                const int mi = lane >> 3, r = lane & 7, h = mi & 1;
#pragma unroll
                for (int qq = 0; qq < NJ / 2; ++qq) {
                    const int j = 2 * qq + (mi >> 1);
                    const uint32_t a = sP + (8 * j + r) * 128 + (((2 * w + h) ^ r) << 4);
                    stmatrix_x4_trans(a, pk[2 * qq][0], pk[2 * qq][1], pk[2 * qq + 1][0], pk[2 * qq + 1][1]);
                }
            }
            bool settled = true;
#pragma unroll
            for (int k = 0; k < NC; ++k) settled = settled && alpha[k] == 1.f;
            if (!__all_sync(0xffffffffu, settled)) {
#pragma unroll
                for (int p = 0; p < VPIECES; ++p)
#pragma unroll
                    for (int j = 0; j < NJ; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) o[p][4 * j + e] *= alpha[2 * j + (e & 1)];
            }
            fence_proxy_async_smem();  // P^T (stmatrix) -> wgmma
            named_barrier_sync(3, WG_THREADS);
#pragma unroll
            for (int p = 0; p < VPIECES; ++p) fence_operands(o[p]);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < PAGE / 16; ++kk)
#pragma unroll
                for (int p = 0; p < VPIECES; ++p)
                    wgmma_m64n32k16_ss<1>(o[p], gmma_desc_add(dv, p * PIECE_BYTES + kk * 16 * 128),
                                          gmma_desc_add(dp, kk * 32));
            wgmma_commit();
            wgmma_wait<0>();
#pragma unroll
            for (int p = 0; p < VPIECES; ++p) fence_operands(o[p]);
            // Every warp's P V is done with the block (and P^T, red): the widener may refill it.
            named_barrier_sync(4, WG_THREADS);
            if (wtid == 0) mbar_arrive(bar_empty(i));
        }
    }
    __syncthreads();  // both loops done: the raw page and block 0 are free

    // ---- The computer's rows, normalised, into block 0; then out / partials by all. ----
    float* sL = reinterpret_cast<float*>(smem + OFF_RAW);  // [warp][column]
    float* sM = sL + 4 * QROWS;                            // [column]
    if (wg == 0) {
#pragma unroll
        for (int k = 0; k < NC; ++k) {
            l[k] += __shfl_xor_sync(0xffffffffu, l[k], 4);
            l[k] += __shfl_xor_sync(0xffffffffu, l[k], 8);
            l[k] += __shfl_xor_sync(0xffffffffu, l[k], 16);
        }
        if (lane < 4) {
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int col = 8 * j + 2 * lane + c;
                    sL[w * QROWS + col] = l[2 * j + c];
                    if (w == 0) sM[col] = m[2 * j + c];
                }
        }
    }
    __syncthreads();
    auto row_stats = [&](int r, float& inv) {
        const float ll = sL[r] + sL[QROWS + r] + sL[2 * QROWS + r] + sL[3 * QROWS + r];
        return row_inv_lse(ll, sM[r], inv);
    };
    float* sO = reinterpret_cast<float*>(smem + OFF_SLOT);  // [row][O_STRIDE]
    if (wg == 0) {
        float f[NC];
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) row_stats(8 * j + 2 * (lane & 3) + c, f[2 * j + c]);
#pragma unroll
        for (int p = 0; p < VPIECES; ++p)
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = 8 * j + 2 * (lane & 3) + (e & 1);
                    const int d = 64 * p + 16 * w + (lane >> 2) + 8 * (e >> 1);
                    sO[r * O_STRIDE + d] = o[p][4 * j + e] * f[2 * j + (e & 1)];
                }
    }
    __syncthreads();

    if constexpr (PAIR) {
        // Two splits in a cluster (rank = split): CTA r writes out dims [256r, 256r + 256),
        // sending the other half of its normalised rows and their lse to the peer.
        const int rank = static_cast<int>(cluster_ctarank());
        float* recv = reinterpret_cast<float*>(smem);  // [QROWS][256] f32, then lse [QROWS]
        float* recv_lse = recv + QROWS * 256;
        float* wts = reinterpret_cast<float*>(smem + OFF_RED);  // [2][QROWS]
        cluster_sync();  // both loops done: the peer's Q bytes are free
        const uint32_t peer = cluster_map(smem_u32(recv), static_cast<uint32_t>(rank ^ 1));
        const int dpe = 256 * (rank ^ 1), dm = 256 * rank;
        for (int idx = tid; idx < valid_rows * 64; idx += NTHREADS) {
            const int r = idx / 64, d = 4 * (idx % 64);
            const float4 a = *reinterpret_cast<const float4*>(sO + r * O_STRIDE + dpe + d);
            st_cluster_f32x4(peer + (r * 256 + d) * 4, a.x, a.y, a.z, a.w);
        }
        float own_lse = -MLAS_INF;
        if (tid < valid_rows) {
            float inv;
            own_lse = row_stats(tid, inv);
            st_cluster_f32(peer + (QROWS * 256 + tid) * 4, own_lse);
        }
        cluster_sync();
        if (tid < valid_rows) {
            const float total = merge2_lse(own_lse, recv_lse[tid], wts[tid], wts[QROWS + tid]);
            if (rank == 0) lse[static_cast<size_t>(b) * rows + row0 + tid] = total;
        }
        __syncthreads();
        for (int idx = tid; idx < valid_rows * 64; idx += NTHREADS) {
            const int r = idx / 64, d = 4 * (idx % 64);
            const float4 a = *reinterpret_cast<const float4*>(sO + r * O_STRIDE + dm + d);
            const float4 p = *reinterpret_cast<const float4*>(recv + r * 256 + d);
            const float wm = wts[r], wp = wts[QROWS + r];
            OutT* ob = out + (static_cast<size_t>(b) * rows + row0 + r) * DLAT + dm + d;
            store2(ob, a.x * wm + p.x * wp, a.y * wm + p.y * wp);
            store2(ob + 2, a.z * wm + p.z * wp, a.w * wm + p.w * wp);
        }
    } else {
        for (int idx = tid; idx < valid_rows * (DLAT / 4); idx += NTHREADS) {
            const int r = idx / (DLAT / 4), d = (idx % (DLAT / 4)) * 4;
            const float4 v = *reinterpret_cast<const float4*>(sO + r * O_STRIDE + d);
            if (num_splits == 1) {
                OutT* ob = out + (static_cast<size_t>(b) * rows + row0 + r) * DLAT + d;
                store2(ob, v.x, v.y);
                store2(ob + 2, v.z, v.w);
            } else {
                float* ob = o_acc + ((static_cast<size_t>(b) * num_splits + split) * rows + row0 + r) * DLAT + d;
                store2(ob, v.x, v.y);
                store2(ob + 2, v.z, v.w);
            }
        }
        if (tid < valid_rows) {
            float inv;
            const float row_lse = row_stats(tid, inv);
            if (num_splits == 1) {
                lse[static_cast<size_t>(b) * rows + row0 + tid] = row_lse;
            } else {
                lse_acc[(static_cast<size_t>(b) * num_splits + split) * rows + row0 + tid] = row_lse;
            }
        }
        if (num_splits == 1 || counters == nullptr) return;

        // The last CTA of (tile, request) merges the splits, as the bf16 kernels do.
        unsigned int* counter = counters + static_cast<size_t>(b) * gridDim.x + blockIdx.x;
        int* s_last = reinterpret_cast<int*>(smem + OFF_RED);
        __threadfence();
        __syncthreads();
        if (tid == 0) {
            const unsigned int old = atomicAdd(counter, 1u);
            const int last = old == static_cast<unsigned int>(num_splits - 1);
            if (last) *counter = 0u;
            *s_last = last;
        }
        __syncthreads();
        if (!*s_last) return;
        __threadfence();
        const int warp = tid >> 5;
        const size_t rbase = static_cast<size_t>(b) * num_splits * rows + row0;
        for (int r = warp; r < valid_rows; r += NTHREADS / 32)
            merge_splits_row(o_acc, lse_acc, rbase + r, static_cast<size_t>(rows), num_splits, DLAT,
                             out + (static_cast<size_t>(b) * rows + row0 + r) * DLAT,
                             lse + static_cast<size_t>(b) * rows + row0 + r);
    }
}

}  // namespace mla90f

// Entries: (q, kv = the fp8 cache's bytes, block_table, seq_lens, out, lse, o_acc,
// lse_acc, counters (null: the combine kernel merges), heads, q_len, bt_stride,
// num_blocks, num_splits, split_blocks, scale_log2); grid (tiles of 32 rows, splits,
// batch), 256 threads, mla90f::SMEM_BYTES of dynamic shared memory. The _c2 entries take
// exactly two splits as one cluster (o_acc, lse_acc, counters unused). Only sm_90a has
// wgmma; other targets of this fatbin trap (the host never launches these there).
#define MLA90F_ARGS                                                                                        \
    const bf16 *q, const uint8_t *kv, const int *block_table, const int *seq_lens, OUT_T *out, float *lse, \
        float *o_acc, float *lse_acc, unsigned int *counters, int heads, int q_len, int bt_stride,          \
        int num_blocks, int num_splits, int split_blocks, float scale_log2
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MLA90F_BODY(OUT, PAIR)                                                                                  \
    mla90f::body<OUT, PAIR>(q, kv, block_table, seq_lens, out, lse, o_acc, lse_acc, counters, heads, q_len,     \
                            bt_stride, num_blocks, num_splits, split_blocks, scale_log2);
#else
#define MLA90F_BODY(OUT, PAIR) __trap();
#endif
#define MLA90F_ENTRY(OUT, SUFFIX)                                                                              \
    extern "C" __global__ void __launch_bounds__(mla::NTHREADS, 1)                                             \
        mla_decode_wgmma_fp8_d512r64_##SUFFIX(MLA90F_ARGS) {                                                   \
        MLA90F_BODY(OUT, false)                                                                                \
    }                                                                                                          \
    extern "C" __global__ void __cluster_dims__(1, 2, 1) __launch_bounds__(mla::NTHREADS, 1)                   \
        mla_decode_wgmma_fp8_c2_d512r64_##SUFFIX(MLA90F_ARGS) {                                                \
        MLA90F_BODY(OUT, true)                                                                                 \
    }
#define OUT_T bf16
MLA90F_ENTRY(bf16, obf16)
#undef OUT_T
#define OUT_T float
MLA90F_ENTRY(float, of32)
#undef OUT_T
