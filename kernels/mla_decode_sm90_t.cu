// Absorbed-MLA decode attention for tiles of at most 32 query rows, Hopper (sm_90a):
// S computed transposed.
//
// Same contract, split-KV partial format and merges as mla_decode_wgmma_ss_* in
// mla_decode_sm90_ss.cu (64-token pages, KV by TMA from the cache's tensor map, the
// splits merged in the launch: by the last CTA of a (tile, request) through `counters`,
// or in the _c2 entries by the two CTAs of a cluster through distributed shared memory).
//
// Why: with 16 heads x q_len 1-2 (or 32 heads x q_len 1) the tile has 16-32 rows, and
// S = Q K^T as wgmma m64 computes 64 rows, 2-4x the useful tensor work, while the
// kernel should be limited by HBM alone. Transposed, S^T = K Q^T puts the 64 tokens of
// a block on M and the query rows on N (m64n16/m64n32), so no padded row is computed;
// O^T (512 x rows) += V^T (512 x 64 tokens) P^T (64 tokens x rows) likewise, with V^T
// read from the same shared copy of the block as the transposed A operand.
//
// Layout: 256 threads = 2 warpgroups that are independent flash-decode pipelines:
// warpgroup g takes blocks g, g + 2, g + 4, ... of the split, each into its own slot
// (one 64-token block, 73,728 B) on its own mbarrier, with its own running max / sum
// and its own O^T (8 tiles of 64 dims x rows in registers). Its elected thread refills
// the slot by TMA as soon as the P V that read it has completed, so while one
// warpgroup computes, the other's block is in flight, and no barrier spans both
// warpgroups until the end, where their (O, m, l) are merged through shared memory.
//
// Per block and warpgroup (S^T fragment: warp w holds tokens 16w..16w+15, lane holds
// tokens lane/4 and lane/4 + 8 of them and columns (= query rows) 2(lane%4) + {0,1} + 8j):
//   S^T  = 36 wgmma m64nNk16, A = K (slot, K-major), B = Q (shared, K-major)
//   mask, column max over the 64 tokens (shuffles, then the 4 warps through shared),
//   P^T  = exp2(S^T * scale_log2 - m) as bf16 into a shared [row][64 tokens] buffer
//   O^T += 32 wgmma m64nNk16 (8 dim tiles x 4 token steps), A = V^T (slot, M-major),
//          B = P^T (shared, K-major)
// Shared tiles use the canonical 128-byte swizzle, chunk ^ (row % 8) in 1024-byte atoms.
#include <cuda.h>  // CUtensorMap

#include "common.cuh"
#include "mla_decode.cuh"
#include "wgmma.cuh"

namespace mla90t {
using namespace mla;  // PAGE, NTHREADS

inline constexpr int DLAT = 512, DQK = 576;
inline constexpr int PIECES = DQK / 64;                  // 64-dim pieces of a cache row (9)
inline constexpr int VPIECES = DLAT / 64;                // of which V (c_kv): 8
inline constexpr int PIECE_BYTES = PAGE * 128;           // one piece of a block: 64 tokens x 128 B
inline constexpr int SLOT_BYTES = PIECES * PIECE_BYTES;  // one 64-token block: 73,728
inline constexpr int CHUNKS = DQK / 8;                   // 16-byte chunks per Q row (72)
inline constexpr int WG_THREADS = 128;
// Floats per row of the merge buffer: 512 + 4, so that the 4 rows a warp's store
// touches (row = 2(lane%4) + ...) fall on banks 8 apart instead of the same bank.
inline constexpr int O_STRIDE = DLAT + 4;

// Shared memory, offsets from the 1024-aligned base (QROWS = 16 | 32):
//   Q      QROWS x 1152          [9 pieces][QROWS][128 B]            18,432 | 36,864
//   slots  2 x 73,728            [9 pieces][64 tokens][128 B] each  147,456
//   P^T    2 x QROWS x 128       [QROWS][64 tokens bf16] each         4,096 |  8,192
//   red    2 x QROWS x 4 f32     per column, the 4 warps' block max     512 |  1,024
//   L      2 x 4 x QROWS f32     per warp, the final column sums        512 |  1,024
//   M      2 x QROWS f32         per warpgroup, the reference max       128 |    256
//   bars   2 x 8                 one mbarrier per slot                   16 |     16
// + 1024 alignment slack = SMEM_BYTES: 172,176 | 195,856 (the host passes this).
// After the loop the slots hold the merge buffer: 2 x QROWS x O_STRIDE f32.
template <int QROWS>
struct Geo {
    static constexpr int Q_PIECE = QROWS * 128;  // bytes between Q's 64-dim pieces
    static constexpr int Q_BYTES = PIECES * Q_PIECE;
    static constexpr int P_BYTES = QROWS * 128;
    static constexpr int OFF_SLOT = Q_BYTES;
    static constexpr int OFF_P = OFF_SLOT + 2 * SLOT_BYTES;
    static constexpr int OFF_RED = OFF_P + 2 * P_BYTES;
    static constexpr int OFF_L = OFF_RED + 2 * QROWS * 4 * 4;
    static constexpr int OFF_M = OFF_L + 2 * 4 * QROWS * 4;
    static constexpr int OFF_BAR = OFF_M + 2 * QROWS * 4;
    static constexpr int SMEM_BYTES = 1024 + OFF_BAR + 2 * 8;
    static_assert(QROWS == 16 || QROWS == 32, "16 or 32 query rows");
    static_assert(SMEM_BYTES <= 227 * 1024, "exceeds the opt-in shared memory of sm_90");
    static_assert(2 * QROWS * O_STRIDE * 4 <= 2 * SLOT_BYTES, "merge buffer must fit in the slots");
    static_assert(QROWS != 16 || SMEM_BYTES == 172176, "update the layout comment and the host");
    static_assert(QROWS != 32 || SMEM_BYTES == 195856, "update the layout comment and the host");
    static_assert(OFF_SLOT % 1024 == 0 && OFF_P % 1024 == 0 && P_BYTES % 1024 == 0, "swizzle atoms 1024-aligned");
};

// Byte offset of 16-byte chunk c (dims 8c..8c+7) of row r in a [piece][ROWS][128 B] tile.
template <int ROWS>
__device__ __forceinline__ uint32_t sw128(int r, int c) {
    return static_cast<uint32_t>((c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// S^T (64 tokens x QROWS) += K (64 x 16, K-major) * Q^T (16 x QROWS, K-major) with
// TRANS_A = 0; O^T (64 dims x QROWS) += V^T (64 x 16 tokens, M-major) * P^T (16 x QROWS,
// K-major) with TRANS_A = 1.
template <int QROWS, int TRANS_A>
__device__ __forceinline__ void mma_t(float (&d)[QROWS / 2], uint64_t da, uint64_t db) {
    if constexpr (QROWS == 16) {
        wgmma_m64n16k16_ss<TRANS_A>(d, da, db);
    } else {
        wgmma_m64n32k16_ss<TRANS_A>(d, da, db);
    }
}

template <int QROWS, typename OutT, bool PAIR>
__device__ __forceinline__ void body(const CUtensorMap* tmap, const bf16* __restrict__ q,
                                     const int* __restrict__ block_table, const int* __restrict__ seq_lens,
                                     OutT* __restrict__ out, float* __restrict__ lse, float* __restrict__ o_acc,
                                     float* __restrict__ lse_acc, unsigned int* __restrict__ counters, int heads,
                                     int q_len, int bt_stride, int num_blocks, int num_splits, float scale_log2) {
    using G = Geo<QROWS>;
    constexpr int NF = QROWS / 2;  // accumulator floats per thread of one 64 x QROWS tile
    constexpr int NJ = QROWS / 8;  // 8-column groups of a tile
    constexpr int NC = QROWS / 4;  // columns (query rows) a thread holds: 2 per group

    extern __shared__ uint8_t smem_raw[];
    // Swizzle atoms must start on 1024-byte boundaries.
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t base = (raw + 1023u) & ~1023u;
    uint8_t* smem = smem_raw + (base - raw);

    const int tid = threadIdx.x, lane = tid & 31;
    // Read through a shuffle so the compiler knows it is warp-uniform and keeps the wgmma
    // descriptors in uniform registers.
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const int wtid = tid & (WG_THREADS - 1);
    const int w = (tid >> 5) & 3;  // warp within the warpgroup: tokens / dims 16w..16w+15
    const int split = blockIdx.y, b = blockIdx.z;
    const int rows = heads * q_len;
    const int row0 = blockIdx.x * QROWS;
    const int valid_rows = min(QROWS, rows - row0);
    // Clamped so that bad device-side metadata gives a wrong answer, never a wild read.
    const int seq_len = max(0, min(seq_lens[b], bt_stride * PAGE));

    // Split y covers blocks [y * per, min((y + 1) * per, n_blk)); warpgroup wg takes
    // blocks blk_begin + wg + 2k, k < my_n.
    const int n_blk = (seq_len + PAGE - 1) / PAGE;
    const int per = (n_blk + num_splits - 1) / num_splits;
    const int blk_begin = min(split * per, n_blk);
    const int blk_end = min(blk_begin + per, n_blk);
    const int my_n = max(0, blk_end - blk_begin - wg + 1) / 2;
    const int* bt = block_table + static_cast<size_t>(b) * bt_stride;

    const uint32_t sQ = base;
    const uint32_t slot = base + G::OFF_SLOT + wg * SLOT_BYTES;
    const uint32_t sP = base + G::OFF_P + wg * G::P_BYTES;
    float* red = reinterpret_cast<float*>(smem + G::OFF_RED) + wg * QROWS * 4;  // [column][warp]
    float* sL = reinterpret_cast<float*>(smem + G::OFF_L);                      // [wg][warp][column]
    float* sM = reinterpret_cast<float*>(smem + G::OFF_M);                      // [wg][column]
    const uint32_t bar = base + G::OFF_BAR + 8 * wg;

    {
        // Rows past `rows` are padding: zero-filled, so their S is finite and never written.
        const bf16* qb = q + (static_cast<size_t>(b) * rows + row0) * DQK;
        for (int i = tid; i < QROWS * CHUNKS; i += NTHREADS) {
            const int r = i / CHUNKS, c = i % CHUNKS;
            const bool ok = r < valid_rows;
            cp_async_16(sQ + sw128<QROWS>(r, c), ok ? qb + r * DQK + c * 8 : q, ok ? 16 : 0);
        }
        cp_async_commit();
    }
    // Block `blk` of the request into this warpgroup's slot: 9 boxes of 64 dims x 64
    // tokens, piece p landing at slot + p * 8192 as [token][128 B] (swizzled by the map).
    auto load_block = [&](int blk) {
        const int page = min(max(bt[blk], 0), num_blocks - 1);
        mbar_arrive_expect_tx(bar, SLOT_BYTES);
#pragma unroll
        for (int p = 0; p < PIECES; ++p) tma_load_3d(slot + p * PIECE_BYTES, tmap, 0, page * PAGE, p, bar);
    };
    if (wtid == 0) {  // the thread that initialises the barrier is the one issuing the copies
        mbar_init(bar, 1);
        fence_mbar_init();
        if (my_n > 0) load_block(blk_begin + wg);
    }
    cp_async_wait<0>();
    fence_proxy_async_smem();  // Q (cp.async) -> wgmma
    __syncthreads();           // barriers initialised for the waiters, Q visible

    // Descriptors computed once and stepped by constants. K and Q^T: K-major (SBO = 1024 B
    // between 8-row groups, k16 step = 32 B, piece step = its size). V^T: the same slot
    // read M-major (LBO = 8192 B between 64-dim pieces, SBO = 1024 B between 8-token
    // groups, k16 step = 16 tokens = 2048 B). P^T: K-major like Q.
    const uint64_t dk = gmma_desc_sw128(slot, 16, 1024);
    const uint64_t dq = gmma_desc_sw128(sQ, 16, 1024);
    const uint64_t dv = gmma_desc_sw128(slot, PIECE_BYTES, 1024);
    const uint64_t dp = gmma_desc_sw128(sP, 16, 1024);

    // Query row of this thread's local column k = 2j + c is row0 + 8j + 2(lane%4) + c.
    // A column sees tokens t < limit = seq_len - (q_len - 1 - s_idx), s_idx = row / heads;
    // min_limit (s_idx = 0) bounds every column, so blocks below it need no mask.
    const int min_limit = seq_len - (q_len - 1);

    float o[VPIECES][NF];  // O^T tile i: dims 64i + 16w + lane/4 + 8(e>>1), columns as S^T
#pragma unroll
    for (int i = 0; i < VPIECES; ++i)
#pragma unroll
        for (int e = 0; e < NF; ++e) o[i][e] = 0.f;
    float m[NC], l[NC];  // reference max (times scale_log2, log2 units); partial sum
#pragma unroll
    for (int k = 0; k < NC; ++k) {
        m[k] = -MLAS_INF;
        l[k] = 0.f;
    }

    for (int it = 0; it < my_n; ++it) {
        const int blk = blk_begin + wg + 2 * it;
        mbar_wait(bar, it & 1);  // phase = uses of this slot so far

        // S^T = K Q^T over all 576 dims: 9 pieces x 4 k16 steps.
        float s[NF];
#pragma unroll
        for (int e = 0; e < NF; ++e) s[e] = 0.f;
        fence_operands(s);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 4 * PIECES; ++ks) {
            const uint32_t off_k = (ks >> 2) * PIECE_BYTES + (ks & 3) * 32;
            const uint32_t off_q = (ks >> 2) * G::Q_PIECE + (ks & 3) * 32;
            mma_t<QROWS, 0>(s, gmma_desc_add(dk, off_k), gmma_desc_add(dq, off_q));
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_operands(s);

        // s[4j + e]: token 16w + lane/4 + 8(e>>1) of the block, column 8j + 2(lane%4) + (e&1).
        const int tok = blk * PAGE + 16 * w + (lane >> 2);
        if (blk * PAGE + PAGE > min_limit) {
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int row = row0 + 8 * j + 2 * (lane & 3) + c;  // row = s_idx * heads + head
                    const int s_idx = min(row / heads, q_len - 1);
                    const int limit = seq_len - (q_len - 1 - s_idx);
                    // Assigned, not added: slots past seq_len may hold NaN.
                    if (tok >= limit) s[4 * j + c] = -MLAS_INF;
                    if (tok + 8 >= limit) s[4 * j + 2 + c] = -MLAS_INF;
                }
        }

        // Column max over the block's 64 tokens: the 8 lanes sharing lane%4 (16 tokens of
        // this warp), then the warpgroup's 4 warps through `red`.
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
        // Also: every warp's S^T wgmma has completed, so the slot may be written below.
        // (red's previous reads came before the previous block's P barrier.)
        named_barrier_sync(1 + wg, WG_THREADS);
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float4 r4 = *reinterpret_cast<const float4*>(red + (8 * j + 2 * (lane & 3) + c) * 4);
                mx[2 * j + c] = fmaxf(fmaxf(r4.x, r4.y), fmaxf(r4.z, r4.w));
            }

        // The last block's slots past seq_len hold whatever the cache holds (NaN
        // included); their P is 0, but 0 * NaN in P V would poison every column: zero
        // their V (pieces 0..7; the rope piece enters only S, which the mask overwrote).
        const int valid_tok = seq_len - blk * PAGE;
        if (valid_tok < PAGE) {
            const int n16 = (PAGE - valid_tok) * 8;  // 16-byte words per piece
            for (int i = wtid; i < VPIECES * n16; i += WG_THREADS) {
                const uint32_t a = slot + (i / n16) * PIECE_BYTES + valid_tok * 128 + (i % n16) * 16;
                asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(a), "r"(0) : "memory");
            }
        }

        float ms[NC], alpha[NC];
#pragma unroll
        for (int k = 0; k < NC; ++k) {
            // Lazy rescaling: the reference max moves only when the block max exceeds it
            // by more than 8 (log2 units), so P <= 2^8 (well inside bf16) and O is
            // rescaled a few times per column instead of whenever the max grows. O / l
            // and m + log2(l) do not depend on the reference.
            const float cand = mx[k] == -MLAS_INF ? -MLAS_INF : mx[k] * scale_log2;
            const float ref = cand > m[k] + 8.f ? cand : m[k];
            ms[k] = ref == -MLAS_INF ? 0.f : ref;
            // Before a column's first visible token its O and l are 0: alpha = 1 keeps
            // the first block from paying the rescale.
            alpha[k] = m[k] == -MLAS_INF ? 1.f : fast_exp2(m[k] - ms[k]);
            m[k] = ref;
        }
        // P^T = exp2(s * scale_log2 - m), packed per 8x8 matrix (j, h): tokens
        // 16w + 8h + lane/4, columns 8j + 2(lane%4) + {0,1}.
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
        // Partial sums: each thread keeps its 2 tokens' share of each column; they share
        // the column's reference, so rescaling them is exact and one reduction at the end
        // suffices.
#pragma unroll
        for (int k = 0; k < NC; ++k) l[k] = l[k] * alpha[k] + rs[k];
        // P^T into the [column][64 tokens] buffer (K-major, 128-byte swizzle): matrix (j, h)
        // lands in rows (columns) 8j + r, token chunk 2w + h, at chunk position (2w + h) ^ r.
        {
            const int mi = lane >> 3, r = lane & 7, h = mi & 1;
#pragma unroll
            for (int qq = 0; qq < NJ / 2; ++qq) {
                const int j = 2 * qq + (mi >> 1);
                const uint32_t a = sP + (8 * j + r) * 128 + (((2 * w + h) ^ r) << 4);
                stmatrix_x4_trans(a, pk[2 * qq][0], pk[2 * qq][1], pk[2 * qq + 1][0], pk[2 * qq + 1][1]);
            }
        }
        // Once the reference settles alpha is exactly 1: skip the multiplies.
        bool settled = true;
#pragma unroll
        for (int k = 0; k < NC; ++k) settled = settled && alpha[k] == 1.f;
        if (!__all_sync(0xffffffffu, settled)) {
#pragma unroll
            for (int i = 0; i < VPIECES; ++i)
#pragma unroll
                for (int j = 0; j < NJ; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) o[i][4 * j + e] *= alpha[2 * j + (e & 1)];
        }
        fence_proxy_async_smem();  // P^T and the zeroed V (st.shared) -> wgmma reads
        named_barrier_sync(3 + wg, WG_THREADS);

        // O^T += V^T P^T: 8 dim tiles x 4 k16 token steps.
#pragma unroll
        for (int i = 0; i < VPIECES; ++i) fence_operands(o[i]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < PAGE / 16; ++kk)
#pragma unroll
            for (int i = 0; i < VPIECES; ++i)
                mma_t<QROWS, 1>(o[i], gmma_desc_add(dv, i * PIECE_BYTES + kk * 16 * 128), gmma_desc_add(dp, kk * 32));
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < VPIECES; ++i) fence_operands(o[i]);
        // Every warp's P V is done with the slot (and P^T): refill it.
        named_barrier_sync(5 + wg, WG_THREADS);
        if (wtid == 0 && it + 1 < my_n) load_block(blk + 2);
    }

    // With an odd block count warpgroup 1 ran one iteration less. compute-sanitizer's
    // racecheck pairs up the barriers a thread has passed, so unequal counts show as
    // (false) hazards across the __syncthreads below; passing the three barriers once
    // more costs nothing, since this warpgroup would wait there anyway.
    if (my_n < max(0, blk_end - blk_begin - (wg ^ 1) + 1) / 2) {
        named_barrier_sync(1 + wg, WG_THREADS);
        named_barrier_sync(3 + wg, WG_THREADS);
        named_barrier_sync(5 + wg, WG_THREADS);
    }

    // ---- Merge the two warpgroups' (O, m, l) and write out. ----
    // Column sums: the 8 lanes sharing lane%4, then (below) the 4 warps.
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
                sL[(wg * 4 + w) * QROWS + col] = l[2 * j + c];
                if (w == 0) sM[wg * QROWS + col] = m[2 * j + c];
            }
    }
    // Both loops done: no copy in flight (a warpgroup loads only blocks it computes) and
    // every wgmma waited for, so the slots are free for the merge buffer.
    __syncthreads();

    // Column totals relative to M = max(m_0, m_1): L = sum_g l_g * 2^(m_g - M). The value
    // of column n is (O_0 2^(m_0 - M) + O_1 2^(m_1 - M)) / L.
    auto col_stats = [&](int col, float& mm, float& ll, float& f0, float& f1) {
        const float m0 = sM[col], m1 = sM[QROWS + col];
        float l0 = 0.f, l1 = 0.f;
#pragma unroll
        for (int ww = 0; ww < 4; ++ww) {
            l0 += sL[ww * QROWS + col];
            l1 += sL[(4 + ww) * QROWS + col];
        }
        mm = fmaxf(m0, m1);
        f0 = m0 == -MLAS_INF ? 0.f : exp2f(m0 - mm);
        f1 = m1 == -MLAS_INF ? 0.f : exp2f(m1 - mm);
        ll = l0 * f0 + l1 * f1;
    };
    float* sO = reinterpret_cast<float*>(smem + G::OFF_SLOT);  // [wg][column][O_STRIDE]
    {
        float f[NC];
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                float mm, ll, f0, f1;
                col_stats(8 * j + 2 * (lane & 3) + c, mm, ll, f0, f1);
                f[2 * j + c] = ll > 0.f ? (wg ? f1 : f0) / ll : 0.f;
            }
        float* mine = sO + wg * QROWS * O_STRIDE;
#pragma unroll
        for (int i = 0; i < VPIECES; ++i)
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = 8 * j + 2 * (lane & 3) + (e & 1);
                    const int d = 64 * i + 16 * w + (lane >> 2) + 8 * (e >> 1);
                    mine[col * O_STRIDE + d] = o[i][4 * j + e] * f[2 * j + (e & 1)];
                }
    }
    __syncthreads();

    if constexpr (PAIR) {
        // Two splits in a cluster (rank = split): CTA r writes out dims [256r, 256r + 256).
        // Each CTA sends the other half of its normalised partial, and its rows' lse, into
        // the peer's Q bytes (free once the peer's loop is done), then merges its own half.
        const int rank = static_cast<int>(cluster_ctarank());
        float* recv = reinterpret_cast<float*>(smem);  // [QROWS][256] f32, then lse [QROWS]
        float* recv_lse = recv + QROWS * 256;
        float* wts = reinterpret_cast<float*>(smem + G::OFF_RED);  // [2][QROWS]: own, peer weight
        static_assert(QROWS * 257 * 4 <= G::Q_BYTES, "the received half must fit in Q's bytes");
        cluster_sync();  // both loops done: the peer's Q bytes are free
        const uint32_t peer = cluster_map(smem_u32(recv), static_cast<uint32_t>(rank ^ 1));
        const int dp = 256 * (rank ^ 1), dm = 256 * rank;
        for (int idx = tid; idx < valid_rows * 64; idx += NTHREADS) {
            const int r = idx / 64, d = 4 * (idx % 64);
            const float4 a = *reinterpret_cast<const float4*>(sO + r * O_STRIDE + dp + d);
            const float4 c = *reinterpret_cast<const float4*>(sO + (QROWS + r) * O_STRIDE + dp + d);
            st_cluster_f32x4(peer + (r * 256 + d) * 4, a.x + c.x, a.y + c.y, a.z + c.z, a.w + c.w);
        }
        float own_lse = -MLAS_INF;
        if (tid < valid_rows) {
            float mm, ll, f0, f1;
            col_stats(tid, mm, ll, f0, f1);
            own_lse = ll > 0.f ? (mm + __log2f(ll)) * 0.69314718055994531f : -MLAS_INF;
            st_cluster_f32(peer + (QROWS * 256 + tid) * 4, own_lse);
        }
        cluster_sync();  // the peer's half and lse are here
        if (tid < valid_rows) {
            const float total = merge2_lse(own_lse, recv_lse[tid], wts[tid], wts[QROWS + tid]);
            if (rank == 0) lse[static_cast<size_t>(b) * rows + row0 + tid] = total;
        }
        __syncthreads();
        for (int idx = tid; idx < valid_rows * 64; idx += NTHREADS) {
            const int r = idx / 64, d = 4 * (idx % 64);
            const float4 a = *reinterpret_cast<const float4*>(sO + r * O_STRIDE + dm + d);
            const float4 c = *reinterpret_cast<const float4*>(sO + (QROWS + r) * O_STRIDE + dm + d);
            const float4 p = *reinterpret_cast<const float4*>(recv + r * 256 + d);
            const float wm = wts[r], wp = wts[QROWS + r];
            OutT* ob = out + (static_cast<size_t>(b) * rows + row0 + r) * DLAT + dm + d;
            store2(ob, (a.x + c.x) * wm + p.x * wp, (a.y + c.y) * wm + p.y * wp);
            store2(ob + 2, (a.z + c.z) * wm + p.z * wp, (a.w + c.w) * wm + p.w * wp);
        }
    } else {
        // Row-major, 4 dims per thread: each warp writes 512 contiguous bytes (f32).
        for (int idx = tid; idx < valid_rows * (DLAT / 4); idx += NTHREADS) {
            const int r = idx / (DLAT / 4), d = (idx % (DLAT / 4)) * 4;
            const float4 a = *reinterpret_cast<const float4*>(sO + r * O_STRIDE + d);
            const float4 c = *reinterpret_cast<const float4*>(sO + (QROWS + r) * O_STRIDE + d);
            const float4 v = make_float4(a.x + c.x, a.y + c.y, a.z + c.z, a.w + c.w);
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
            float mm, ll, f0, f1;
            col_stats(tid, mm, ll, f0, f1);
            // Natural-log LSE of s * scale: (M + log2 L) * ln 2; -inf for an empty split.
            const float row_lse = ll > 0.f ? (mm + __log2f(ll)) * 0.69314718055994531f : -MLAS_INF;
            if (num_splits == 1) {
                lse[static_cast<size_t>(b) * rows + row0 + tid] = row_lse;
            } else {
                lse_acc[(static_cast<size_t>(b) * num_splits + split) * rows + row0 + tid] = row_lse;
            }
        }
        // Without counters the host merges the splits with the combine kernel.
        if (num_splits == 1 || counters == nullptr) return;

        // ---- Split-KV combine, fused: the last CTA of (tile, request) merges the splits. ----
        // counters[b * gridDim.x + tile] counts the splits that have published their partial;
        // zero at launch, and the last CTA sets it back to zero for the next launch / replay.
        unsigned int* counter = counters + static_cast<size_t>(b) * gridDim.x + blockIdx.x;
        int* s_last = reinterpret_cast<int*>(smem + G::OFF_RED);  // red is free after the loop
        __threadfence();  // release: this thread's o_acc / lse_acc stores, before the count
        __syncthreads();
        if (tid == 0) {
            const unsigned int old = atomicAdd(counter, 1u);
            const int last = old == static_cast<unsigned int>(num_splits - 1);
            if (last) *counter = 0u;  // all num_splits increments are in: nobody else touches it
            *s_last = last;
        }
        __syncthreads();
        if (!*s_last) return;
        __threadfence();  // acquire: the other splits' partials, read below through L2 only

        // A warp per row, as mla_decode_combine does it (merge_splits_row).
        const int warp = tid >> 5;
        const size_t rbase = static_cast<size_t>(b) * num_splits * rows + row0;  // split 0, row0
        for (int r = warp; r < valid_rows; r += NTHREADS / 32)
            merge_splits_row(o_acc, lse_acc, rbase + r, static_cast<size_t>(rows), num_splits, DLAT,
                             out + (static_cast<size_t>(b) * rows + row0 + r) * DLAT,
                             lse + static_cast<size_t>(b) * rows + row0 + r);
    }
}

}  // namespace mla90t

#define MLA90T_ARGS                                                                                     \
    const __grid_constant__ CUtensorMap tmap, const bf16 *q, const bf16 *kv, const int *block_table,     \
        const int *seq_lens, OUT_T *out, float *lse, float *o_acc, float *lse_acc, unsigned int *counters, \
        int heads, int q_len, int bt_stride, int num_blocks, int num_splits, float scale_log2

// Only sm_90a has wgmma; other targets of this fatbin get a trap (the host never launches
// these there). Suffix: _q16/_q32 = stored query rows (the host picks the smallest that
// holds q_len * heads). `kv` is unused (the copies go through `tmap`: 3-D, 64 dims x
// num_blocks*64 tokens at 1152 B x 9 pieces at 128 B; box 64 x 64 x 1; 128-byte
// swizzle); it stays for the same argument list as the other decode kernels.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MLA90T_BODY(QR, OUT, PAIR)                                                                            \
    (void)kv;                                                                                                 \
    mla90t::body<QR, OUT, PAIR>(&tmap, q, block_table, seq_lens, out, lse, o_acc, lse_acc, counters, heads,   \
                                q_len, bt_stride, num_blocks, num_splits, scale_log2);
#else
#define MLA90T_BODY(QR, OUT, PAIR) __trap();
#endif
#define MLA90T_ENTRY(QR, OUT, SUFFIX)                                                                     \
    extern "C" __global__ void __launch_bounds__(mla::NTHREADS, 1)                                        \
        mla_decode_wgmma_t_d512r64_q##QR##_##SUFFIX(MLA90T_ARGS) {                                        \
        MLA90T_BODY(QR, OUT, false)                                                                       \
    }                                                                                                     \
    /* Exactly two splits, merged by the cluster of the two (grid.y = 2); o_acc, lse_acc */               \
    /* and counters are unused. */                                                                        \
    extern "C" __global__ void __cluster_dims__(1, 2, 1) __launch_bounds__(mla::NTHREADS, 1)              \
        mla_decode_wgmma_t_c2_d512r64_q##QR##_##SUFFIX(MLA90T_ARGS) {                                     \
        MLA90T_BODY(QR, OUT, true)                                                                        \
    }
#define OUT_T bf16
MLA90T_ENTRY(16, bf16, obf16)
MLA90T_ENTRY(32, bf16, obf16)
#undef OUT_T
#define OUT_T float
MLA90T_ENTRY(16, float, of32)
MLA90T_ENTRY(32, float, of32)
#undef OUT_T
