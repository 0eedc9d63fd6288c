// Absorbed-MLA decode attention over the paged latent cache (docs/cuda.md, "MLA decode").
//
// Per request b (uniform query length s for the whole batch, heads h):
//   rows  = s * h, packed row = s_idx * h + head, in 64-row tiles
//   q     [batch][rows][dqk]           bf16, dqk = dlat + drope: [q_lat | q_pe]
//   cache [num_blocks][64][dqk]        bf16 pages of 64 tokens: [c_kv | k_pe]
//   key   = [c_kv | k_pe] (dqk), value = c_kv (dv = dlat)
//   out   [batch][rows][dlat]          bf16 or f32; lse [batch][rows] f32 (natural log,
//                                      of sum exp(scale * q.k))
//   mask: query s_idx sees positions p < seq_len - (s - 1 - s_idx)  (bottom-right causal;
//         seq_len counts the drafts)
//
// Fast path (dlat = 512, drope = 64, every model of the V2/V3/K2 family):
//   grid (tiles, splits, batch), 256 threads = 8 warps. Warp w owns rows
//   16*(w/2)..+15 of the tile and half (w%2) of the 512 output columns, so the O
//   accumulator (64 x 512 f32) lives in registers, 128 per thread. For S = Q K^T each
//   warp of a pair computes the partial dot product over its half of the 576 dims
//   (256 of c_kv + 32 of k_pe), the pair swaps partials through shared memory and both
//   add them: both warps then hold the identical S (fp addition commutes), so each runs
//   the same online softmax and no max/sum crosses warps. mma.sync m16n8k16 bf16, f32
//   accumulation; the KV chunk (32 tokens x 1152 B) is loaded with cp.async into a
//   3-stage ring in an XOR-swizzled layout (conflict-free ldmatrix); K^T and V are read
//   from the same shared copy (V through ldmatrix.trans).
//   Split-KV: split k of a request covers a contiguous range of 32-token chunks; with
//   one split the kernel writes the final output, else f32 partials + their LSE, which
//   mla_decode_combine merges.
// Generic path (any dims, e.g. the tiny test models: dlat 32, drope 8): one block per
//   (row, request), f32 math, no split. Correct and slow; not for real models.
#include "common.cuh"

#include "mla_decode.cuh"

namespace mla {

template <int DLAT, int DROPE>
struct Cfg {
    static constexpr int DQK = DLAT + DROPE;
    static constexpr int ROW_BYTES = DQK * 2;
    static constexpr int CHUNKS = DQK / 8;  // 16-byte chunks per row
    static constexpr int Q_BYTES = BM * ROW_BYTES;
    static constexpr int KV_BYTES = BN * ROW_BYTES;
    static constexpr int X_BYTES = 8 * 32 * 16 * 4;  // per warp: 16 rows x 32 tokens f32
    static constexpr int SMEM_BYTES = Q_BYTES + STAGES * KV_BYTES + X_BYTES;
    static constexpr int DV_HALF = DLAT / 2;          // output columns per warp
    static constexpr int NT_O = DV_HALF / 8;          // n8 tiles of O per warp
    static constexpr int KS_LAT = DV_HALF / 16;       // k16 steps over own c_kv half
    static constexpr int KS_ROPE = DROPE / 2 / 16;    // k16 steps over own k_pe half
    static_assert(CHUNKS % 8 == 0, "swizzle needs a multiple of 8 chunks per row");
    static_assert(DV_HALF % 16 == 0 && (DROPE / 2) % 16 == 0, "fast path needs 16-aligned halves");
};

// Byte offset of 16-byte chunk `c` of row `r` in a [rows][DQK] bf16 tile. Rows are
// 1152 B (a multiple of 128), so without the XOR the 8 rows of an ldmatrix would hit
// the same banks; chunk ^ (row & 7) spreads them over all 32.
template <int ROW_BYTES>
__device__ __forceinline__ uint32_t swz(int r, int c) {
    return static_cast<uint32_t>(r * ROW_BYTES + ((c ^ (r & 7)) << 4));
}

template <int DLAT, int DROPE, typename OutT>
__device__ __forceinline__ void splitkv_body(const bf16* __restrict__ q, const bf16* __restrict__ kv,
                                             const int* __restrict__ block_table,
                                             const int* __restrict__ seq_lens, OutT* __restrict__ out,
                                             float* __restrict__ lse, float* __restrict__ o_acc,
                                             float* __restrict__ lse_acc, int heads, int q_len,
                                             int bt_stride, int num_blocks, int num_splits, float scale_log2) {
    using C = Cfg<DLAT, DROPE>;
    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t* sQ = smem;
    uint8_t* sKV = smem + C::Q_BYTES;
    float* sX = reinterpret_cast<float*>(sKV + STAGES * C::KV_BYTES);

    const int tile = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int rg = warp >> 1;    // 16-row group of the tile
    const int half = warp & 1;   // which half of the dims / output columns
    const int rows = heads * q_len;
    const int row0 = tile * BM;
    const int valid_rows = min(BM, rows - row0);
    // Clamped so that bad device-side metadata gives a wrong answer, never a wild read.
    const int seq_len = max(0, min(seq_lens[b], bt_stride * PAGE));

    // Split k covers chunks [c_begin, c_end) of this request.
    const int n_chunks = (seq_len + BN - 1) / BN;
    const int per = (n_chunks + num_splits - 1) / num_splits;
    const int c_begin = min(split * per, n_chunks);
    const int n_iter = min(c_begin + per, n_chunks) - c_begin;
    const int* bt = block_table + static_cast<size_t>(b) * bt_stride;

    // Q tile; rows past `rows` are zero-filled.
    {
        const bf16* qb = q + (static_cast<size_t>(b) * rows + row0) * C::DQK;
        for (int i = tid; i < BM * C::CHUNKS; i += NTHREADS) {
            const int r = i / C::CHUNKS, c = i % C::CHUNKS;
            const bool ok = r < valid_rows;
            cp_async_16(smem_u32(sQ) + swz<C::ROW_BYTES>(r, c), ok ? qb + r * C::DQK + c * 8 : q, ok ? 16 : 0);
        }
    }
    auto load_chunk = [&](int it, int stage) {
        const int tok0 = (c_begin + it) * BN;
        const int page = min(static_cast<unsigned>(bt[tok0 / PAGE]), static_cast<unsigned>(num_blocks - 1));
        const bf16* src = kv + (static_cast<size_t>(page) * PAGE + (tok0 % PAGE)) * C::DQK;
        const uint32_t dst = smem_u32(sKV + stage * C::KV_BYTES);
        for (int i = tid; i < BN * C::CHUNKS; i += NTHREADS) {
            const int r = i / C::CHUNKS, c = i % C::CHUNKS;
            const bool ok = tok0 + r < seq_len;  // slots past seq_len may hold anything
            cp_async_16(dst + swz<C::ROW_BYTES>(r, c), ok ? src + r * C::DQK + c * 8 : src, ok ? 16 : 0);
        }
    };
    // Group 0 = Q + chunk 0; then one group per chunk (empty groups keep the count uniform).
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n_iter) load_chunk(s, s);
        cp_async_commit();
    }

    const int min_limit = seq_len - (q_len - 1);  // what the first query of s sees
    const bool active = rg * 16 < valid_rows;  // warp-uniform: skip all-padding row groups

    float o[C::NT_O][4];
#pragma unroll
    for (int n = 0; n < C::NT_O; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {-MLAS_INF, -MLAS_INF};  // running max of raw scores
    float l[2] = {0.f, 0.f};              // this thread's partial row sums

    float* xb_mine = sX + warp * 512;
    const float* xb_peer = sX + (warp ^ 1) * 512;
    const uint32_t sQa = smem_u32(sQ);

    for (int it = 0; it < n_iter; ++it) {
        cp_async_wait<STAGES - 2>();
        // Chunk `it` is visible to all, and every warp is done with chunk it-1, whose
        // stage the next load reuses (and with the exchange buffer of the last round).
        __syncthreads();
        if (it + STAGES - 1 < n_iter) load_chunk(it + STAGES - 1, (it + STAGES - 1) % STAGES);
        cp_async_commit();
        if (!active) continue;

        const uint32_t sK = smem_u32(sKV + (it % STAGES) * C::KV_BYTES);
        float s[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;

        // Partial S over this warp's dims: c_kv[half*256, +256) and k_pe[half*32, +32).
#pragma unroll
        for (int ks = 0; ks < C::KS_LAT + C::KS_ROPE; ++ks) {
            const int kc = ks < C::KS_LAT ? half * (C::DV_HALF / 8) + ks * 2
                                          : DLAT / 8 + half * (DROPE / 16) + (ks - C::KS_LAT) * 2;
            uint32_t a[4];
            {
                const int r = rg * 16 + (lane & 15);
                ldmatrix_x4(a, sQa + swz<C::ROW_BYTES>(r, kc + (lane >> 4)));
            }
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                uint32_t bb[4];
                const int r = np * 16 + ((lane >> 4) << 3) + (lane & 7);  // token
                ldmatrix_x4(bb, sK + swz<C::ROW_BYTES>(r, kc + ((lane >> 3) & 1)));
                mma_bf16_16816(s[2 * np], a, bb[0], bb[1]);
                mma_bf16_16816(s[2 * np + 1], a, bb[2], bb[3]);
            }
        }

        // Swap partials with the peer warp (same lane = same fragment positions).
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) xb_mine[(j * 4 + e) * 32 + lane] = s[j][e];
        named_barrier_sync(1 + rg, 64);
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] += xb_peer[(j * 4 + e) * 32 + lane];

        // Causal mask (only the last chunk(s) can need it) and online softmax.
        const int tok0 = (c_begin + it) * BN;
        if (tok0 + BN > min_limit) {
            // The two rows this thread holds in the mma layout, and how far each sees.
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
                    if (tok >= limit[e >> 1]) s[j][e] = -MLAS_INF;
                }
        }
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
        float ms[2], alpha[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            // A row with everything masked so far keeps max -inf: use 0 as its
            // reference so that exp2 sees -inf, never NaN.
            ms[i] = mx[i] == -MLAS_INF ? 0.f : mx[i] * scale_log2;
            alpha[i] = fast_exp2(m[i] * scale_log2 - ms[i]);
            m[i] = mx[i];
        }
        uint32_t pa[2][4];
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                p[e] = fast_exp2(s[j][e] * scale_log2 - ms[e >> 1]);
                rs[e >> 1] += p[e];
            }
            // S accumulator layout of n-tiles 2kk, 2kk+1 == A fragment of k16 step kk.
            pa[j >> 1][(j & 1) * 2 + 0] = pack_bf16x2(p[0], p[1]);
            pa[j >> 1][(j & 1) * 2 + 1] = pack_bf16x2(p[2], p[3]);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) l[i] = l[i] * alpha[i] + rs[i];
        // Once the running max settles alpha is exactly 1: skip 128 multiplies.
        if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
            for (int n = 0; n < C::NT_O; ++n) {
                o[n][0] *= alpha[0];
                o[n][1] *= alpha[0];
                o[n][2] *= alpha[1];
                o[n][3] *= alpha[1];
            }
        }

        // O[:, half*256 .. +256) += P (16 x 32) * V (32 x 256); V = c_kv rows of the chunk.
        const int vtok = ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
        for (int np = 0; np < C::NT_O / 2; ++np) {
            const int c = half * (C::DV_HALF / 8) + np * 2 + (lane >> 4);
#pragma unroll
            for (int kk = 0; kk < 2; ++kk) {
                uint32_t vb[4];
                ldmatrix_x4_trans(vb, sK + swz<C::ROW_BYTES>(kk * 16 + vtok, c));
                mma_bf16_16816(o[2 * np], pa[kk], vb[0], vb[1]);
                mma_bf16_16816(o[2 * np + 1], pa[kk], vb[2], vb[3]);
            }
        }
    }
    cp_async_wait<0>();  // nothing may be in flight into shared memory at exit

    if (!active) return;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int lr = rg * 16 + (lane >> 2) + 8 * i;
        if (lr >= valid_rows) continue;
        const int row = row0 + lr;
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        // lse = ln(sum_j exp(scale * s_j)) = ln2 * (max * scale*log2e + log2(l))
        const float row_lse = l[i] > 0.f ? (m[i] * scale_log2 + __log2f(l[i])) * 0.69314718055994531f : -MLAS_INF;
        const int d0 = half * C::DV_HALF + 2 * (lane & 3);
        if (num_splits == 1) {
            OutT* ob = out + (static_cast<size_t>(b) * rows + row) * DLAT + d0;
#pragma unroll
            for (int n = 0; n < C::NT_O; ++n) store2(ob + n * 8, o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
            if (half == 0 && (lane & 3) == 0) lse[static_cast<size_t>(b) * rows + row] = row_lse;
        } else {
            const size_t pr = (static_cast<size_t>(b) * num_splits + split) * rows + row;
            float* ob = o_acc + pr * DLAT + d0;
#pragma unroll
            for (int n = 0; n < C::NT_O; ++n) store2(ob + n * 8, o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
            if (half == 0 && (lane & 3) == 0) lse_acc[pr] = row_lse;
        }
    }
}

// Merges the splits of each (request, row): lse = log sum_k exp(lse_k),
// out = sum_k exp(lse_k - lse) * o_k. One warp per row, float4 over dv.
template <typename OutT>
__device__ __forceinline__ void combine_body(const float* __restrict__ o_acc, const float* __restrict__ lse_acc,
                                             OutT* __restrict__ out, float* __restrict__ lse, int rows,
                                             int num_splits, int dv) {
    const int b = blockIdx.y;
    const int row = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (row >= rows) return;
    const size_t base = static_cast<size_t>(b) * num_splits * rows + row;  // split k at base + k*rows
    merge_splits_row(o_acc, lse_acc, base, static_cast<size_t>(rows), num_splits, dv,
                     out + (static_cast<size_t>(b) * rows + row) * dv, lse + static_cast<size_t>(b) * rows + row);
}

// Generic reference-grade kernel: block (row, request), 128 threads, f32 throughout.
// Thread t owns output dims t, t+128, ... (dv <= 1024). Dynamic smem: dqk floats.
constexpr int GEN_THREADS = 128;
constexpr int GEN_MAX_DV_PER_THREAD = 8;

template <typename OutT>
__device__ __forceinline__ void generic_body(const bf16* __restrict__ q, const bf16* __restrict__ kv,
                                             const int* __restrict__ block_table, const int* __restrict__ seq_lens,
                                             OutT* __restrict__ out, float* __restrict__ lse, int heads, int q_len,
                                             int bt_stride, int num_blocks, int dlat, int drope, float scale_log2) {
    extern __shared__ float gsm[];  // [dqk] query, then [GEN_THREADS/32] partial sums
    const int dqk = dlat + drope;
    float* red = gsm + dqk;
    const int row = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
    const int rows = heads * q_len;
    const int s_idx = row / heads;
    const int seq_len = max(0, min(seq_lens[b], bt_stride * PAGE));
    const int limit = seq_len - (q_len - 1 - s_idx);
    const bf16* qr = q + (static_cast<size_t>(b) * rows + row) * dqk;
    for (int d = tid; d < dqk; d += GEN_THREADS) gsm[d] = __bfloat162float(qr[d]);
    __syncthreads();
    float o[GEN_MAX_DV_PER_THREAD];
#pragma unroll
    for (int k = 0; k < GEN_MAX_DV_PER_THREAD; ++k) o[k] = 0.f;
    float m = -MLAS_INF, l = 0.f;
    const int* bt = block_table + static_cast<size_t>(b) * bt_stride;
    for (int t = 0; t < limit; ++t) {
        const int page = min(static_cast<unsigned>(bt[t / PAGE]), static_cast<unsigned>(num_blocks - 1));
        const bf16* kr = kv + (static_cast<size_t>(page) * PAGE + t % PAGE) * dqk;
        float part = 0.f;
        for (int d = tid; d < dqk; d += GEN_THREADS) part += gsm[d] * __bfloat162float(kr[d]);
        part = warp_sum(part);
        if ((tid & 31) == 0) red[tid >> 5] = part;
        __syncthreads();
        float sc = 0.f;
#pragma unroll
        for (int w = 0; w < GEN_THREADS / 32; ++w) sc += red[w];
        __syncthreads();  // red is rewritten next token
        const float mn = fmaxf(m, sc);
        const float alpha = exp2f((m - mn) * scale_log2);
        const float p = exp2f((sc - mn) * scale_log2);
        l = l * alpha + p;
        m = mn;
#pragma unroll
        for (int k = 0; k < GEN_MAX_DV_PER_THREAD; ++k) {
            const int d = tid + k * GEN_THREADS;
            if (d < dlat) o[k] = o[k] * alpha + p * __bfloat162float(kr[d]);
        }
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    OutT* orow = out + (static_cast<size_t>(b) * rows + row) * dlat;
#pragma unroll
    for (int k = 0; k < GEN_MAX_DV_PER_THREAD; ++k) {
        const int d = tid + k * GEN_THREADS;
        if (d < dlat) orow[d] = from_f32<OutT>(o[k] * inv);
    }
    if (tid == 0)
        lse[static_cast<size_t>(b) * rows + row] = l > 0.f ? (m * scale_log2 + log2f(l)) * 0.69314718055994531f : -MLAS_INF;
}

}  // namespace mla

// ---- entry points (dtype suffix: input bf16, output _obf16 / _of32) ----

#define MLA_SPLITKV_ARGS                                                                                   \
    const bf16 *q, const bf16 *kv, const int *block_table, const int *seq_lens, OUT_T *out, float *lse,     \
        float *o_acc, float *lse_acc, int heads, int q_len, int bt_stride, int num_blocks, int num_splits,   \
        float scale_log2

#define OUT_T bf16
extern "C" __global__ void __launch_bounds__(mla::NTHREADS, 1) mla_decode_splitkv_d512r64_obf16(MLA_SPLITKV_ARGS) {
    mla::splitkv_body<512, 64, bf16>(q, kv, block_table, seq_lens, out, lse, o_acc, lse_acc, heads, q_len, bt_stride,
                                     num_blocks, num_splits, scale_log2);
}
#undef OUT_T
#define OUT_T float
extern "C" __global__ void __launch_bounds__(mla::NTHREADS, 1) mla_decode_splitkv_d512r64_of32(MLA_SPLITKV_ARGS) {
    mla::splitkv_body<512, 64, float>(q, kv, block_table, seq_lens, out, lse, o_acc, lse_acc, heads, q_len, bt_stride,
                                      num_blocks, num_splits, scale_log2);
}
#undef OUT_T

extern "C" __global__ void __launch_bounds__(128) mla_decode_combine_obf16(const float* o_acc, const float* lse_acc,
                                                                           bf16* out, float* lse, int rows,
                                                                           int num_splits, int dv) {
    mla::combine_body<bf16>(o_acc, lse_acc, out, lse, rows, num_splits, dv);
}
extern "C" __global__ void __launch_bounds__(128) mla_decode_combine_of32(const float* o_acc, const float* lse_acc,
                                                                          float* out, float* lse, int rows,
                                                                          int num_splits, int dv) {
    mla::combine_body<float>(o_acc, lse_acc, out, lse, rows, num_splits, dv);
}

extern "C" __global__ void __launch_bounds__(mla::GEN_THREADS) mla_decode_generic_obf16(
    const bf16* q, const bf16* kv, const int* block_table, const int* seq_lens, bf16* out, float* lse, int heads,
    int q_len, int bt_stride, int num_blocks, int dlat, int drope, float scale_log2) {
    mla::generic_body<bf16>(q, kv, block_table, seq_lens, out, lse, heads, q_len, bt_stride, num_blocks, dlat, drope,
                             scale_log2);
}
extern "C" __global__ void __launch_bounds__(mla::GEN_THREADS) mla_decode_generic_of32(
    const bf16* q, const bf16* kv, const int* block_table, const int* seq_lens, float* out, float* lse, int heads,
    int q_len, int bt_stride, int num_blocks, int dlat, int drope, float scale_log2) {
    mla::generic_body<float>(q, kv, block_table, seq_lens, out, lse, heads, q_len, bt_stride, num_blocks, dlat, drope,
                             scale_log2);
}
