// Absorbed-MLA decode attention, Hopper path: warpgroup MMA (wgmma, sm_90a).
//
// Same contract, grid and split-KV partial format as mla_decode_splitkv_* in
// mla_decode.cu (see the header there); the combine kernel there merges the splits.
//
// Why: the mma.sync kernel gives each warp 16 rows, so every warp re-reads the whole KV
// chunk from shared memory; at ~16 FLOP per shared byte it is capped by shared-memory
// bandwidth near a third of the tensor-core peak. wgmma computes 64 rows per
// warpgroup straight from shared memory (4x the operand reuse).
//
// Layout: 256 threads = 2 warpgroups. Warpgroup g owns O[:, 256g .. 256g+256) (64 x 256
// f32 = 128 registers per thread) and, for S = Q K^T, the partial dot product over its
// half of the 576 dims (c_kv[256g, +256) and k_pe[32g, +32)): 18 wgmma m64n32k16 with Q
// and K from shared memory. The two partials are swapped through shared memory and
// added (both warpgroups then hold the identical S: fp addition commutes), so each
// runs the same online softmax. P (bf16, registers, the mma A-fragment layout) times V
// (the c_kv rows of the same shared copy, read N-major) is 2 wgmma m64n256k16 per chunk.
// Shared tiles use the canonical 128-byte-swizzle layout: [64-dim block][row][128 B],
// chunk ^ (row % 8), each block 1024-byte aligned; one copy serves as K (K-major) and
// as V (N-major). Loads: TMA (or cp.async) into a 4-5 stage ring of 32-token chunks.
// Software pipeline: the S of chunk i + 1 is issued before chunk i's exchange and
// softmax, so the tensor cores work while the ALUs do (see the loop).
#include <cuda.h>  // CUtensorMap

#include "common.cuh"
#include "mla_decode.cuh"
#include "wgmma.cuh"

namespace mla90 {
using namespace mla;

constexpr int DLAT = 512, DROPE = 64, DQK = DLAT + DROPE;
constexpr int CHUNKS = DQK / 8;              // 16-byte chunks per row (72)
constexpr int KV_BYTES = BN * DQK * 2;       // 36864
constexpr int KV_KB_STRIDE = BN * 128;       // bytes between 64-dim blocks of a KV chunk
constexpr int X_BYTES = 2 * 128 * 8 * 4;     // S partials, half at a time: 2 WGs x 128 threads x 8

// QROWS: query rows actually stored (16, 32 or 64). wgmma always computes 64 rows; with
// QROWS < 64 the A descriptor's rows QROWS..63 fall on the next 64-dim block (or the KV
// ring) and yield garbage rows that are never written out (rows are independent in
// Q K^T, the row softmax and P V). The shared memory saved goes to deeper prefetch,
// which is what the memory-bound configurations (16 heads, q_len 1-2) need.
template <int QROWS>
struct Geo {
    static constexpr int STAGES = QROWS == 64 ? 4 : 5;
    static constexpr int Q_BYTES = QROWS * DQK * 2;
    static constexpr int Q_KB_STRIDE = QROWS * 128;
    // +1024: alignment slack; +64: one mbarrier per stage (TMA variant).
    static constexpr int SMEM_BYTES = 1024 + Q_BYTES + STAGES * KV_BYTES + X_BYTES + 64;
    static_assert(SMEM_BYTES <= 227 * 1024, "exceeds the opt-in shared memory of sm_90");
};

// Byte offset of 16-byte chunk c (dims 8c..8c+7) of row r in a tile of `rows` rows.
template <int ROWS>
__device__ __forceinline__ uint32_t sw128(int r, int c) {
    return static_cast<uint32_t>((c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// TMA = true: KV chunks arrive by bulk tensor copy (thread 0 issues one 3-D box per
// chunk: 9 blocks of 64 dims x 32 tokens; completion on a per-stage mbarrier). Those writes belong to the
// async proxy, like wgmma's reads, so no proxy fence is needed per chunk. With cp.async
// (TMA = false) every chunk needs fence.proxy.async before wgmma may read it.
template <int QROWS, bool TMA, typename OutT>
__device__ __forceinline__ void body(const CUtensorMap* tmap, const bf16* __restrict__ q, const bf16* __restrict__ kv,
                                     const int* __restrict__ block_table, const int* __restrict__ seq_lens,
                                     OutT* __restrict__ out, float* __restrict__ lse, float* __restrict__ o_acc,
                                     float* __restrict__ lse_acc, int heads, int q_len, int bt_stride, int num_blocks,
                                     int num_splits, float scale_log2) {
    extern __shared__ uint8_t smem_raw[];
    // Swizzle atoms must start on 1024-byte boundaries.
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t base = (raw + 1023u) & ~1023u;
    uint8_t* smem = smem_raw + (base - raw);
    using G = Geo<QROWS>;
    constexpr int STAGES = G::STAGES;
    const uint32_t sQ = base;
    const uint32_t sKV = base + G::Q_BYTES;
    float* sX = reinterpret_cast<float*>(smem + G::Q_BYTES + STAGES * KV_BYTES);
    const uint32_t sBar = sKV + STAGES * KV_BYTES + X_BYTES;  // STAGES x 8 bytes

    const int tile = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31;
    // Warpgroup: output columns / dims half. Read through a shuffle so the compiler knows
    // it is warp-uniform and keeps the wgmma descriptors in uniform registers.
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const int wtid = tid & 127;       // thread within the warpgroup
    const int rg = (tid >> 5) & 3;    // warp within the warpgroup: rows 16*rg..+15
    const int rows = heads * q_len;
    const int row0 = tile * BM;
    const int valid_rows = min(BM, rows - row0);
    // Clamped so that bad device-side metadata gives a wrong answer, never a wild read.
    const int seq_len = max(0, min(seq_lens[b], bt_stride * PAGE));

    const int n_chunks = (seq_len + BN - 1) / BN;
    const int per = (n_chunks + num_splits - 1) / num_splits;
    const int c_begin = min(split * per, n_chunks);
    const int n_iter = min(c_begin + per, n_chunks) - c_begin;
    const int* bt = block_table + static_cast<size_t>(b) * bt_stride;

    {
        const bf16* qb = q + (static_cast<size_t>(b) * rows + row0) * DQK;
        for (int i = tid; i < QROWS * CHUNKS; i += NTHREADS) {
            const int r = i / CHUNKS, c = i % CHUNKS;
            const bool ok = r < valid_rows;
            cp_async_16(sQ + sw128<QROWS>(r, c), ok ? qb + r * DQK + c * 8 : q, ok ? 16 : 0);
        }
    }
    auto load_chunk = [&](int it, int stage) {
        const int tok0 = (c_begin + it) * BN;
        const int page = min(static_cast<unsigned>(bt[tok0 / PAGE]), static_cast<unsigned>(num_blocks - 1));
        if constexpr (TMA) {
            if (tid == 0) {
                const uint32_t bar = sBar + 8 * stage;
                mbar_arrive_expect_tx(bar, KV_BYTES);
                const int row = page * PAGE + (tok0 % PAGE);  // token row of the cache
                // One box: [9 dim blocks][32 tokens][64 dims], the ring's layout.
                tma_load_3d(sKV + stage * KV_BYTES, tmap, 0, row, 0, bar);
            }
            return;
        }
        const bf16* src = kv + (static_cast<size_t>(page) * PAGE + (tok0 % PAGE)) * DQK;
        const uint32_t dst = sKV + stage * KV_BYTES;
        for (int i = tid; i < BN * CHUNKS; i += NTHREADS) {
            const int r = i / CHUNKS, c = i % CHUNKS;
            const bool ok = tok0 + r < seq_len;  // slots past seq_len may hold anything
            cp_async_16(dst + sw128<BN>(r, c), ok ? src + r * DQK + c * 8 : src, ok ? 16 : 0);
        }
    };
    if constexpr (TMA) {
        if (tid == 0) {  // the thread that initialises the barriers is the one issuing the copies
            for (int st = 0; st < STAGES; ++st) mbar_init(sBar + 8 * st, 1);
            fence_mbar_init();
        }
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n_iter) load_chunk(s, s);
        if constexpr (!TMA) cp_async_commit();
    }
    if constexpr (TMA) {
        cp_async_commit();  // the Q tile
        cp_async_wait<0>();
        fence_proxy_async_smem();  // Q (cp.async) -> wgmma
        __syncthreads();           // barriers initialised for the waiters, Q visible
    }

    const int min_limit = seq_len - (q_len - 1);
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m[2] = {-MLAS_INF, -MLAS_INF};  // reference max per row, times scale_log2
    float l[2] = {0.f, 0.f};
    float* x_mine = sX + wg * (128 * 8);
    const float* x_peer = sX + (wg ^ 1) * (128 * 8);

    // Chunk `it` ready for wgmma in this thread's view (all threads call it; a barrier
    // must follow before any warp reads the chunk).
    auto wait_chunk = [&](int it) {
        if constexpr (TMA) {
            mbar_wait(sBar + 8 * (it % STAGES), (it / STAGES) & 1);
            // The last chunk's slots past seq_len hold whatever the cache holds (NaN
            // included): zero them, or 0 * NaN in P V would poison every row.
            const int valid_tok = seq_len - (c_begin + it) * BN;
            if (valid_tok < BN) {
                const uint32_t sK = sKV + (it % STAGES) * KV_BYTES;
                const int n16 = (BN - valid_tok) * 8;  // 16-byte words per 64-dim block
                for (int i = tid; i < (DQK / 64) * n16; i += NTHREADS) {
                    const int kb = i / n16, w = i % n16;
                    const uint32_t a = sK + kb * KV_KB_STRIDE + valid_tok * 128 + w * 16;
                    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(a), "r"(0) : "memory");
                }
                fence_proxy_async_smem();
            }
        } else {
            // Groups committed so far: the prologue's STAGES - 1 (chunks 0..STAGES-2) and
            // one per finished iteration; chunk `it` is group `it`, waited for in
            // iteration it - 1 (or the prologue for chunk 0).
            if (it == 0) {
                cp_async_wait<STAGES - 2>();
            } else {
                cp_async_wait<STAGES - 3>();
            }
            fence_proxy_async_smem();  // cp.async writes -> wgmma (async proxy) reads
        }
    };
    // Partial S of chunk `it` over this warpgroup's dims, issued and committed (not waited).
    // Descriptors: computed once, stepped by constants (gmma_desc_add). This warpgroup's
    // S dims are c_kv[256 wg, +256) (64-dim blocks 4 wg .. 4 wg + 3) and k_pe[32 wg, +32)
    // (inside block 8); its V columns are the same c_kv blocks, read N-major.
    const uint64_t dq_nope = gmma_desc_sw128(sQ + wg * 4 * G::Q_KB_STRIDE, 16, 1024);
    const uint64_t dq_rope = gmma_desc_sw128(sQ + 8 * G::Q_KB_STRIDE + wg * 64, 16, 1024);
    const uint64_t dk_nope = gmma_desc_sw128(sKV + wg * 4 * KV_KB_STRIDE, 16, 1024);
    const uint64_t dk_rope = gmma_desc_sw128(sKV + 8 * KV_KB_STRIDE + wg * 64, 16, 1024);
    const uint64_t dv0 = gmma_desc_sw128(sKV + 4 * wg * KV_KB_STRIDE, KV_KB_STRIDE, 1024);
    // Partial S of chunk `it` over this warpgroup's dims, issued and committed (not waited).
    auto issue_s = [&](int it, float (&acc)[16]) {
        const uint32_t st = (it % STAGES) * KV_BYTES;
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[i] = 0.f;
        fence_operands(acc);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 16; ++ks) {
            const uint64_t da = gmma_desc_add(dq_nope, (ks >> 2) * G::Q_KB_STRIDE + (ks & 3) * 32);
            const uint64_t db = gmma_desc_add(dk_nope, st + (ks >> 2) * KV_KB_STRIDE + (ks & 3) * 32);
            wgmma_m64n32k16_ss(acc, da, db);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j)
            wgmma_m64n32k16_ss(acc, gmma_desc_add(dq_rope, j * 32), gmma_desc_add(dk_rope, st + j * 32));
        wgmma_commit();
    };

    // Software pipeline, one chunk of 32 tokens per iteration: S of chunk it + 1 runs on
    // the tensor cores while this chunk's S exchange, mask and softmax run on the ALUs;
    // then P V of chunk it. Chunks it and it + 1 stay resident during iteration it, so a
    // slot is refilled STAGES - 2 iterations before its S.
    float s[16], s_next[16];
    if (n_iter > 0) {
        wait_chunk(0);
        __syncthreads();
        issue_s(0, s);
        wgmma_wait<0>();
        fence_operands(s);
    }
    for (int it = 0; it < n_iter; ++it) {
        const bool more = it + 1 < n_iter;
        if (more) wait_chunk(it + 1);
        // Chunk it + 1 visible to every warp; every warp is done with chunk it - 1 (its
        // P V was waited for at the end of iteration it - 1), so that slot is free.
        __syncthreads();
        if (it + STAGES - 1 < n_iter) load_chunk(it + STAGES - 1, (it + STAGES - 1) % STAGES);
        if constexpr (!TMA) cp_async_commit();
        if (more) issue_s(it + 1, s_next);

        // Swap partials with the other warpgroup (same thread index = same positions),
        // in two halves to fit the 4-5 stage ring; the middle barrier keeps the second
        // half's writes behind the peer's reads of the first.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (h) named_barrier_sync(1, NTHREADS);
#pragma unroll
            for (int i = 0; i < 8; ++i) x_mine[i * 128 + wtid] = s[8 * h + i];
            named_barrier_sync(1, NTHREADS);
#pragma unroll
            for (int i = 0; i < 8; ++i) s[8 * h + i] += x_peer[i * 128 + wtid];
        }
        // (The next iteration's first exchange write comes after its __syncthreads, so
        // behind the peer's reads of this one.)

        // Mask + online softmax; s[4j + e]: n-tile j (tokens 8j..), e as in mma C fragments.
        const int tok0 = (c_begin + it) * BN;
        if (tok0 + BN > min_limit) {
            int limit[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int row = row0 + rg * 16 + (lane >> 2) + 8 * i;  // row = s_idx * heads + head
                const int s_idx = min(row / heads, q_len - 1);
                limit[i] = seq_len - (q_len - 1 - s_idx);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int tok = tok0 + j * 8 + 2 * (lane & 3) + (e & 1);
                    if (tok >= limit[e >> 1]) s[4 * j + e] = -MLAS_INF;
                }
        }
        float mx[2] = {-MLAS_INF, -MLAS_INF};
#pragma unroll
        for (int i = 0; i < 16; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
        float ms[2], alpha[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            // Lazy rescaling: the reference max m (scaled, log2 units) moves only when this
            // chunk's max exceeds it by more than 8, so P <= 2^8 (well inside bf16) and O
            // is rescaled a few times per row instead of whenever the max grows. The
            // result does not depend on the reference: O / l and m + log2(l) are exact.
            const float cand = mx[i] == -MLAS_INF ? -MLAS_INF : mx[i] * scale_log2;
            const float ref = cand > m[i] + 8.f ? cand : m[i];
            ms[i] = ref == -MLAS_INF ? 0.f : ref;
            alpha[i] = fast_exp2(m[i] - ms[i]);
            m[i] = ref;
        }
        uint32_t pa[2][4];
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                p[e] = fast_exp2(s[4 * j + e] * scale_log2 - ms[e >> 1]);
                rs[e >> 1] += p[e];
            }
            pa[j >> 1][(j & 1) * 2 + 0] = pack_bf16x2(p[0], p[1]);
            pa[j >> 1][(j & 1) * 2 + 1] = pack_bf16x2(p[2], p[3]);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) l[i] = l[i] * alpha[i] + rs[i];
        // Once the running max settles alpha is exactly 1: skip 128 multiplies.
        if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
            for (int i = 0; i < 128; ++i) o[i] *= alpha[(i >> 1) & 1];
        }

        // O[:, 256wg..] += P (64 x 32) * V (32 tokens x 256 dims), V N-major in shared.
        fence_operands(o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            const uint64_t dv = gmma_desc_add(dv0, (it % STAGES) * KV_BYTES + kk * 16 * 128);
            wgmma_m64n256k16_rs_tb(o, pa[kk], dv);
        }
        wgmma_commit();
        wgmma_wait<0>();  // this P V and the next chunk's S (committed first)
        fence_operands(o);
        fence_operands(s_next);
#pragma unroll
        for (int i = 0; i < 16; ++i) s[i] = s_next[i];
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    store_o_rows(o, l, m, rg, wg, lane, b, rows, row0, valid_rows, split, num_splits, out, lse, o_acc, lse_acc);
}

}  // namespace mla90

#define MLA90_ARGS                                                                                        \
    const bf16 *q, const bf16 *kv, const int *block_table, const int *seq_lens, OUT_T *out, float *lse,     \
        float *o_acc, float *lse_acc, int heads, int q_len, int bt_stride, int num_blocks, int num_splits,   \
        float scale_log2
#define MLA90_CALL(TM) \
    (TM, q, kv, block_table, seq_lens, out, lse, o_acc, lse_acc, heads, q_len, bt_stride, num_blocks, num_splits, scale_log2)

// Only sm_90a has wgmma; other targets of this fatbin get a trap (the host never
// launches these there). Suffix: _q16/_q32/_q64 = stored query rows (the host picks
// the smallest that holds q_len * heads; 64 for multi-tile batches). The _tma_ kernels
// take the KV cache's tensor map (3-D: 64 dims, num_blocks*64 tokens at 1152 bytes, 9
// dim blocks at 128 bytes; box 64 x 32 x 9; 128-byte swizzle) as their first argument.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MLA90_BODY(QR, TMA, OUT, TM) mla90::body<QR, TMA, OUT> MLA90_CALL(TM);
#else
#define MLA90_BODY(QR, TMA, OUT, TM) __trap();
#endif
#define MLA90_ENTRY(QR, OUT, SUFFIX)                                                                     \
    extern "C" __global__ void __launch_bounds__(mla::NTHREADS, 1)                                       \
        mla_decode_wgmma_d512r64_q##QR##_##SUFFIX(MLA90_ARGS) {                                          \
        MLA90_BODY(QR, false, OUT, nullptr)                                                              \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(mla::NTHREADS, 1) mla_decode_wgmma_tma_d512r64_q##QR##_##SUFFIX( \
        const __grid_constant__ CUtensorMap tmap, MLA90_ARGS) {                                          \
        MLA90_BODY(QR, true, OUT, &tmap)                                                                 \
    }
#define OUT_T bf16
MLA90_ENTRY(16, bf16, obf16)
MLA90_ENTRY(32, bf16, obf16)
MLA90_ENTRY(64, bf16, obf16)
#undef OUT_T
#define OUT_T float
MLA90_ENTRY(16, float, of32)
MLA90_ENTRY(32, float, of32)
MLA90_ENTRY(64, float, of32)
#undef OUT_T
