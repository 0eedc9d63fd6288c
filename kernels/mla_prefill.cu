// Expanded-form (non-absorbed) MLA attention for prefill and chunked-prefill chunks
// (docs/cuda.md, "MLA prefill"), and the two small kernels around it (crates/mlaserve-cuda/src/prefill.rs).
//
// A call covers E sequences. Sequence j has `q_len` new tokens (query rows) at the end of
// its `k_len` keys (positions 0..k_len: the cached prefix, then the new tokens), so query
// i sits at position p = k_len - q_len + i and sees keys 0..=p (causal, bottom-right
// aligned). Its descriptor (`seqs[j]`, SEQ_FIELDS ints): the output row of its first
// query, q_len, its first row in the compact key buffers, k_len, its block-table row.
//
//   q   [rows][heads][nope + rope]  f32, the q_b projection's output (q_pe not rotated)
//   kn  [keys][heads][nope]         bf16, K_nope = c_kv · W_UK[h]^T (one GEMM, all heads)
//   kpe [keys][rope]                bf16, k_pe from the cache (already rotated), shared by
//                                   every head
//   v   [keys][heads][vdim]         bf16, V = c_kv · W_UV[h]^T
//   o   [rows][heads][vdim]         bf16, o_proj's input; only the sequences' query rows
//                                   are written
//   scores: scale * ([q_nope | RoPE(q_pe, p)] · [k_nope | k_pe])
//
// mla_prefill_fwd_*: grid (tiles, heads), 128 threads = 4 warps. A tile is 64 query rows
// of one sequence (the host lists them longest key range first, so the long CTAs start
// first); warp w owns rows 16w..16w+15. The Q tile (RoPE applied on load, rounded to
// bf16) is staged in shared memory once and held as mma A fragments in registers; keys
// come in tiles of 64 through a 2-stage cp.async ring (K: [k_nope | k_pe] rows of QK
// dims, V: rows of VD dims, XOR-swizzled so ldmatrix is conflict-free; K^T via ldmatrix,
// V via ldmatrix.trans). S = Q K^T and O += P V on mma.sync m16n8k16 bf16 with f32
// accumulation; online softmax in exp2 with the running max per row; P is rounded to
// bf16 for the P·V product (as FlashMLA), the row sum l stays f32. QK and VD are the
// padded head widths of the instance (192/128: DeepSeek-V2/V3/K2; 64/64: small test
// models); dims past the real ones are zero-filled in shared memory and add nothing.
//
// A row's result depends only on its own sequence: every row walks the same key tiles
// from key 0 in the same order, and tiles past a row's position (processed because a
// later row of its warp needs them) are fully masked, which adds exact zeros. No split
// over keys, so nothing depends on what else shares the launch (batch invariance).
#include <cuda.h>  // CUtensorMap

#include "common.cuh"
#include "kv_fp8.cuh"
#include "wgmma.cuh"

namespace mlap {

constexpr int BM = 64;         // query rows per CTA (one head)
constexpr int BN = 64;         // keys per pipeline tile
constexpr int NTHREADS = 128;  // 4 warps x 16 rows
constexpr int SEQ_FIELDS = 5;  // mirrored by prefill.rs
constexpr int F_QROW = 0, F_QLEN = 1, F_KOFF = 2, F_KLEN = 3, F_TABLE = 4;
constexpr int PAGE = 64;  // tokens per cache page

template <int QK, int VD>
struct Cfg {
    static constexpr int QK_CHUNKS = QK / 8;  // 16-byte chunks per Q/K row
    static constexpr int V_CHUNKS = VD / 8;
    static constexpr int Q_BYTES = BM * QK * 2;
    static constexpr int K_BYTES = BN * QK * 2;
    static constexpr int V_BYTES = BN * VD * 2;
    static constexpr int STAGE_BYTES = K_BYTES + V_BYTES;
    static constexpr int SMEM_BYTES = Q_BYTES + 2 * STAGE_BYTES;
    static constexpr int KS = QK / 16;    // k16 steps of S = Q K^T
    static constexpr int NT_S = BN / 8;   // n8 tiles of S per warp
    static constexpr int NT_O = VD / 8;   // n8 tiles of O per warp
    static constexpr int KV_STEPS = BN / 16;  // k16 steps of O += P V
    static_assert(QK % 64 == 0 && VD % 64 == 0, "the swizzle needs a multiple of 8 chunks per row");
};

// Byte offset of 16-byte chunk `c` of row `r` in a tile of ROW_BYTES-wide rows. Rows are a
// multiple of 128 B, so the 8 rows an ldmatrix reads would share banks without the XOR;
// c ^ (r & 7) spreads them over all 32 (and stays inside the row: 8 | chunks per row).
template <int ROW_BYTES>
__device__ __forceinline__ uint32_t swz(int r, int c) {
    return static_cast<uint32_t>(r * ROW_BYTES + ((c ^ (r & 7)) << 4));
}

// Interleaved-pair RoPE, as backend_ops.cu's rope_pair (YaRN factor folded into the tables).
__device__ __forceinline__ void rope_pair(float a, float b, float c, float s, float& x, float& y) {
    x = a * c - b * s;
    y = a * s + b * c;
}

// The Q tile of a CTA: rows r < ROWS (query i0 + r of the sequence whose first query row
// is q_row0 and first position base), 16-byte chunks c < QK / 8 of [q_nope | RoPE(q_pe,
// position)] rounded to bf16, stored at dst + at(r, c); rows past n_rows and dims past qk
// are zero. A chunk is 8 dims, all nope or all rope (nope % 8 == 0).
template <int ROWS, int QK, int THREADS, typename At>
__device__ __forceinline__ void load_q_tile(uint8_t* dst, const At& at, const float* __restrict__ q,
                                            const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                            int heads, int h, int nope, int rope, int q_row0, int i0, int base,
                                            int n_rows) {
    constexpr int CHUNKS = QK / 8;
    const int qk = nope + rope, nope_c = nope / 8, qk_c = qk / 8, half = rope / 2;
    for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS) {
        const int r = idx / CHUNKS, c = idx % CHUNKS, i = i0 + r;
        uint32_t w[4] = {0u, 0u, 0u, 0u};
        if (r < n_rows && c < qk_c) {
            const float* src = q + (static_cast<size_t>(q_row0 + i) * heads + h) * qk + c * 8;
            const float4 x0 = *reinterpret_cast<const float4*>(src);
            const float4 x1 = *reinterpret_cast<const float4*>(src + 4);
            float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
            if (c >= nope_c) {
                const size_t tab = static_cast<size_t>(base + i) * half + (c - nope_c) * 4;  // pair index
#pragma unroll
                for (int u = 0; u < 4; ++u)
                    rope_pair(x[2 * u], x[2 * u + 1], cos_t[tab + u], sin_t[tab + u], x[2 * u], x[2 * u + 1]);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) w[u] = pack_bf16x2(x[2 * u], x[2 * u + 1]);
        }
        *reinterpret_cast<uint4*>(dst + at(r, c)) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// The online softmax of one key tile for the thread's two rows, in the mma accumulator
// layout (element e of n8-tile j: row e >> 1, key 8j + 2(lane % 4) + (e & 1)); score(j, e)
// is the masked raw score. Updates the running max m (raw) and the row sums l, packs P =
// exp2(scale_log2 · s − max) as bf16 A fragments of O += P V (n-tiles 2kk, 2kk + 1 are
// k16 step kk) and gives the factors alpha by which O must be rescaled. A row that has
// seen only masked keys keeps max −inf and uses 0 as its reference, so exp2 sees −inf,
// never NaN (only padding rows get there).
template <int NT, typename Score>
__device__ __forceinline__ void softmax_tile(const Score& score, float scale_log2, float (&m)[2], float (&l)[2],
                                             uint32_t (&pa)[NT / 2][4], float (&alpha)[2]) {
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], score(j, e));
    float ms[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        ms[i] = mx[i] == -MLAS_INF ? 0.f : mx[i] * scale_log2;
        // Exactly 1 while the max holds: computed, m·scale − ms is the rounding residual
        // of ms (an FMA keeps it), and a tile wholly past the row's position (a CTA whose
        // rows reach further walks more of them) would rescale the row's sums and change
        // their last bits with the CTA's extent.
        alpha[i] = mx[i] == m[i] ? 1.f : fast_exp2(m[i] * scale_log2 - ms[i]);
        m[i] = mx[i];
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            p[e] = fast_exp2(score(j, e) * scale_log2 - ms[e >> 1]);
            rs[e >> 1] += p[e];
        }
        pa[j >> 1][(j & 1) * 2 + 0] = pack_bf16x2(p[0], p[1]);
        pa[j >> 1][(j & 1) * 2 + 1] = pack_bf16x2(p[2], p[3]);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) l[i] = l[i] * alpha[i] + rs[i];
}

template <int QK, int VD>
__device__ __forceinline__ void fwd_body(bf16* __restrict__ o, const float* __restrict__ q,
                                         const bf16* __restrict__ kn, const bf16* __restrict__ kpe,
                                         const bf16* __restrict__ v, const float* __restrict__ cos_t,
                                         const float* __restrict__ sin_t, const int* __restrict__ seqs,
                                         const int* __restrict__ tiles, int heads, int nope, int rope, int vdim,
                                         float scale_log2) {
    using C = Cfg<QK, VD>;
    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t* sQ = smem;
    uint8_t* sKV = smem + C::Q_BYTES;

    const int h = blockIdx.y;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int* sd = seqs + tiles[2 * blockIdx.x] * SEQ_FIELDS;
    const int i0 = tiles[2 * blockIdx.x + 1];  // first query (index within the sequence) of the tile
    const int q_row0 = sd[F_QROW], q_len = sd[F_QLEN], k_off = sd[F_KOFF], k_len = sd[F_KLEN];
    const int base = k_len - q_len;               // position of query 0
    const int n_rows = min(BM, q_len - i0);       // valid rows of the tile
    const int n_kt = (base + i0 + n_rows - 1) / BN + 1;  // key tiles up to the last row's position
    const int qk = nope + rope, nope_c = nope / 8, qk_c = qk / 8, v_c = vdim / 8;

    auto load_kv = [&](int jt, int stage) {
        const int k0 = jt * BN;
        const uint32_t kdst = smem_u32(sKV + stage * C::STAGE_BYTES);
        const uint32_t vdst = kdst + C::K_BYTES;
        for (int idx = tid; idx < BN * C::QK_CHUNKS; idx += NTHREADS) {
            const int r = idx / C::QK_CHUNKS, c = idx % C::QK_CHUNKS, t = k0 + r;
            const bf16* src = kpe;
            int bytes = 0;  // keys past k_len and dims past qk: 16 zero bytes, nothing read
            if (t < k_len && c < qk_c) {
                const size_t key = static_cast<size_t>(k_off + t);
                src = c < nope_c ? kn + (key * heads + h) * nope + c * 8 : kpe + key * rope + (c - nope_c) * 8;
                bytes = 16;
            }
            cp_async_16(kdst + swz<QK * 2>(r, c), src, bytes);
        }
        for (int idx = tid; idx < BN * C::V_CHUNKS; idx += NTHREADS) {
            const int r = idx / C::V_CHUNKS, c = idx % C::V_CHUNKS, t = k0 + r;
            const bool ok = t < k_len && c < v_c;
            const bf16* src = ok ? v + (static_cast<size_t>(k_off + t) * heads + h) * vdim + c * 8 : v;
            cp_async_16(vdst + swz<VD * 2>(r, c), src, ok ? 16 : 0);
        }
    };
    load_kv(0, 0);
    cp_async_commit();

    load_q_tile<BM, QK, NTHREADS>(sQ, [](int r, int c) { return swz<QK * 2>(r, c); }, q, cos_t, sin_t, heads, h,
                                  nope, rope, q_row0, i0, base, n_rows);
    __syncthreads();

    // This warp's rows: tile rows 16*warp .. +15; the thread holds rows g and g + 8 of
    // them (g = lane / 4) in the mma layout.
    const int wr = warp * 16;
    const bool active = wr < n_rows;  // warp-uniform: all-padding warps only help load
    const int w_first = base + i0 + wr;                       // position of its first row
    const int w_last = base + i0 + min(wr + 15, n_rows - 1);  // ... and of its last valid row
    int pos_r[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) pos_r[i] = base + i0 + wr + (lane >> 2) + 8 * i;

    uint32_t qf[C::KS][4];
    if (active) {
#pragma unroll
        for (int ks = 0; ks < C::KS; ++ks)
            ldmatrix_x4(qf[ks], smem_u32(sQ) + swz<QK * 2>(wr + (lane & 15), ks * 2 + (lane >> 4)));
    }

    float acc[C::NT_O][4];
#pragma unroll
    for (int n = 0; n < C::NT_O; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float m[2] = {-MLAS_INF, -MLAS_INF};  // running max of the raw scores of rows g, g + 8
    float l[2] = {0.f, 0.f};              // this thread's part of their row sums

    for (int jt = 0; jt < n_kt; ++jt) {
        cp_async_wait<0>();
        // Tile jt is visible to all, and every warp is done with tile jt - 1, whose stage
        // the next load overwrites.
        __syncthreads();
        if (jt + 1 < n_kt) {
            load_kv(jt + 1, (jt + 1) & 1);
            cp_async_commit();
        }
        const int k0 = jt * BN;
        if (!active || k0 > w_last) continue;  // the whole tile lies past this warp's rows
        const uint32_t sK = smem_u32(sKV + (jt & 1) * C::STAGE_BYTES);
        const uint32_t sV = sK + C::K_BYTES;

        // S (16 rows x 64 keys) = Q K^T over QK dims.
        float s[C::NT_S][4];
#pragma unroll
        for (int j = 0; j < C::NT_S; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < C::KS; ++ks) {
#pragma unroll
            for (int np = 0; np < C::NT_S / 2; ++np) {
                uint32_t kb[4];
                const int r = np * 16 + ((lane >> 4) << 3) + (lane & 7);  // key within the tile
                ldmatrix_x4(kb, sK + swz<QK * 2>(r, ks * 2 + ((lane >> 3) & 1)));
                mma_bf16_16816(s[2 * np], qf[ks], kb[0], kb[1]);
                mma_bf16_16816(s[2 * np + 1], qf[ks], kb[2], kb[3]);
            }
        }

        // Causal mask where a key of the tile lies past some row's position: key
        // k0 + 8j + 2(lane % 4) + (e & 1), row (e >> 1). Keys past k_len lie past every
        // valid row's position (<= k_len - 1).
        if (k0 + BN - 1 > w_first) {
#pragma unroll
            for (int j = 0; j < C::NT_S; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + j * 8 + 2 * (lane & 3) + (e & 1);
                    if (key > pos_r[e >> 1]) s[j][e] = -MLAS_INF;
                }
        }

        uint32_t pa[C::KV_STEPS][4];
        float alpha[2];
        softmax_tile<C::NT_S>([&](int j, int e) { return s[j][e]; }, scale_log2, m, l, pa, alpha);
        // Once the running max settles alpha is exactly 1: skip the rescale.
        if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
            for (int n = 0; n < C::NT_O; ++n) {
                acc[n][0] *= alpha[0];
                acc[n][1] *= alpha[0];
                acc[n][2] *= alpha[1];
                acc[n][3] *= alpha[1];
            }
        }

        // O (16 x VD) += P (16 x 64) V (64 x VD).
        const int vkey = ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
        for (int np = 0; np < C::NT_O / 2; ++np) {
            const int c = np * 2 + (lane >> 4);
#pragma unroll
            for (int kk = 0; kk < C::KV_STEPS; ++kk) {
                uint32_t vb[4];
                ldmatrix_x4_trans(vb, sV + swz<VD * 2>(kk * 16 + vkey, c));
                mma_bf16_16816(acc[2 * np], pa[kk], vb[0], vb[1]);
                mma_bf16_16816(acc[2 * np + 1], pa[kk], vb[2], vb[3]);
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
    // A valid row sees key 0, so l >= 1 (its max term is exp2(0)).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = wr + (lane >> 2) + 8 * i;  // row of the tile
        if (r >= n_rows) continue;
        const float inv = 1.f / l[i];
        bf16* dst = o + (static_cast<size_t>(q_row0 + i0 + r) * heads + h) * vdim + 2 * (lane & 3);
#pragma unroll
        for (int n = 0; n < C::NT_O; ++n)
            if (n * 8 < vdim) store2(dst + n * 8, acc[n][2 * i] * inv, acc[n][2 * i + 1] * inv);
    }
}


#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The same attention on Hopper's warpgroup MMA (mla_prefill_wg_*): a CTA owns 128 query
// rows of one head (the host's 128-row tile list, WG_TILE_ROWS) as two warpgroups of 64
// that share every K/V tile, so each tile crosses L2 once per 128 rows instead of once
// per 64. Key tiles of 64 come through a 3-stage cp.async ring (all 256 threads load);
// the masking, online softmax and bf16 P are the mma.sync kernel's, and S of the next
// tile runs on the tensor cores during this tile's softmax. S = Q K^T is wgmma
// m64n64k16 with Q and K read from shared memory, O += P V is wgmma m64nVDk16 with P from
// registers (the S accumulator repacked) and V read N-major. Tiles are laid as wgmma's
// 128-byte-swizzle blocks: [64-dim block][row][128 B], 16-byte chunk c of a row at
// c ^ (row % 8), blocks 1024-byte aligned. A row's result depends on its own sequence
// only: every row takes the key tiles from key 0 in order, and the tiles past its
// position that the CTA runs for its later rows are fully masked, which adds exact zeros
// (p = 0, alpha = 1).
namespace mlaw {
constexpr int WGS = 2, ROWS = 64 * WGS, THREADS = 128 * WGS, STAGES = 3;
}

template <int QK, int VD>
struct WgCfg {
    static constexpr int KV_BLOCK = 64 * 128;          // bytes of a 64-key x 64-dim block
    static constexpr int Q_BLOCK = mlaw::ROWS * 128;  // bytes of a 128-row x 64-dim block
    static constexpr int Q_BYTES = QK / 64 * Q_BLOCK, K_BYTES = QK / 64 * KV_BLOCK, V_BYTES = VD / 64 * KV_BLOCK;
    static constexpr int STAGE_BYTES = K_BYTES + V_BYTES;
    // + alignment slack and the TMA variant's full barriers (8 bytes per stage)
    static constexpr int SMEM_BYTES = 1024 + Q_BYTES + mlaw::STAGES * STAGE_BYTES + 64;
};

// Byte offset of 16-byte chunk c (8 dims) of row r in the block layout (BLOCK bytes per
// 64-dim block).
template <int BLOCK>
__device__ __forceinline__ uint32_t wsw(int r, int c) {
    return static_cast<uint32_t>((c >> 3) * BLOCK + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

template <int VD>
struct WgPV;
template <>
struct WgPV<64> {
    static __device__ __forceinline__ void mma(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
        wgmma_m64n64k16_rs_tb(d, a, b);
    }
};
template <>
struct WgPV<128> {
    static __device__ __forceinline__ void mma(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
        wgmma_m64n128k16_rs_tb(d, a, b);
    }
};

// TMA: the K/V tiles come by TMA instead of cp.async (mla_prefill_wgt_*: DeepSeek's exact
// widths, nope 128, rope 64, v 128). Tensor maps (bf16, 128-byte swizzle, boxes of 64
// dims x 64 keys): tkn over kn [keys][heads * 128], tkpe over kpe [keys][64], tv over v
// [keys][heads * 128]. Thread 0 issues a tile's five boxes on the stage's `full` barrier.
// A box is not clipped at the sequence's k_len: keys past it are the next sequence's
// (finite, and masked for every valid row, so P = 0) or zeros past the buffer's end.
template <int QK, int VD, bool TMA>
__device__ __forceinline__ void fwd_wg_body(bf16* __restrict__ o, const float* __restrict__ q,
                                            const bf16* __restrict__ kn, const bf16* __restrict__ kpe,
                                            const bf16* __restrict__ v, const float* __restrict__ cos_t,
                                            const float* __restrict__ sin_t, const int* __restrict__ seqs,
                                            const int* __restrict__ tiles, int heads, int nope, int rope, int vdim,
                                            float scale_log2, const CUtensorMap* tkn, const CUtensorMap* tkpe,
                                            const CUtensorMap* tv) {
    using C = WgCfg<QK, VD>;
    using namespace mlaw;
    constexpr int QK_CHUNKS = QK / 8, V_CHUNKS = VD / 8, NO = VD / 2;
    extern __shared__ __align__(1024) uint8_t smem_wg[];
    const uint32_t raw = smem_u32(smem_wg), sQ = (raw + 1023u) & ~1023u, sKV = sQ + C::Q_BYTES;
    uint8_t* pQ = smem_wg + (sQ - raw);
    const uint32_t sBar = sKV + STAGES * C::STAGE_BYTES;  // TMA: full barrier of each stage

    const int h = blockIdx.y;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int* sd = seqs + tiles[2 * blockIdx.x] * SEQ_FIELDS;
    const int i0 = tiles[2 * blockIdx.x + 1];
    const int q_row0 = sd[F_QROW], q_len = sd[F_QLEN], k_off = sd[F_KOFF], k_len = sd[F_KLEN];
    const int base = k_len - q_len;
    const int n_rows = min(ROWS, q_len - i0);
    const int n_kt = (base + i0 + n_rows - 1) / BN + 1;
    const int qk = nope + rope, nope_c = nope / 8, qk_c = qk / 8, v_c = vdim / 8;

    auto load_kv = [&](int jt, int stage) {
        const int k0 = jt * BN;
        const uint32_t kdst = sKV + stage * C::STAGE_BYTES, vdst = kdst + C::K_BYTES;
        for (int idx = tid; idx < BN * QK_CHUNKS; idx += THREADS) {
            const int r = idx / QK_CHUNKS, c = idx % QK_CHUNKS, t = k0 + r;
            const bf16* src = kpe;
            int bytes = 0;  // keys past k_len and dims past qk: zeros, nothing read
            if (t < k_len && c < qk_c) {
                const size_t key = static_cast<size_t>(k_off + t);
                src = c < nope_c ? kn + (key * heads + h) * nope + c * 8 : kpe + key * rope + (c - nope_c) * 8;
                bytes = 16;
            }
            cp_async_16(kdst + wsw<C::KV_BLOCK>(r, c), src, bytes);
        }
        for (int idx = tid; idx < BN * V_CHUNKS; idx += THREADS) {
            const int r = idx / V_CHUNKS, c = idx % V_CHUNKS, t = k0 + r;
            const bool ok = t < k_len && c < v_c;
            const bf16* src = ok ? v + (static_cast<size_t>(k_off + t) * heads + h) * vdim + c * 8 : v;
            cp_async_16(vdst + wsw<C::KV_BLOCK>(r, c), src, ok ? 16 : 0);
        }
    };
    // TMA: tile jt's five boxes into `stage`, completing on its barrier (thread 0 only).
    auto load_tma = [&](int jt, int stage) {
        const uint32_t kdst = sKV + stage * C::STAGE_BYTES, vdst = kdst + C::K_BYTES, bar = sBar + 8 * stage;
        const int key = k_off + jt * BN, col = h * 128;
        mbar_arrive_expect_tx(bar, C::STAGE_BYTES);
        tma_load_2d(kdst, tkn, col, key, bar);
        tma_load_2d(kdst + C::KV_BLOCK, tkn, col + 64, key, bar);
        tma_load_2d(kdst + 2 * C::KV_BLOCK, tkpe, 0, key, bar);
        tma_load_2d(vdst, tv, col, key, bar);
        tma_load_2d(vdst + C::KV_BLOCK, tv, col + 64, key, bar);
    };
    // Tiles 0 and 1 (one cp.async group each). Tile 1 even when n_kt = 1 (its keys lie past
    // k_len: zero fill or, by TMA, the next sequence's): the extra step of an odd n_kt
    // (below) multiplies a zero P by that stage's V, which must not hold NaN from
    // uninitialised memory.
    if constexpr (TMA) {
        if (tid == 0) {
            for (int st = 0; st < STAGES; ++st) mbar_init(sBar + 8 * st, 1);
            fence_mbar_init();
            load_tma(0, 0);
            load_tma(1, 1);
        }
    } else {
#pragma unroll
        for (int st = 0; st < STAGES - 1; ++st) {
            load_kv(st, st);
            cp_async_commit();
        }
    }

    load_q_tile<ROWS, QK, THREADS>(pQ, [](int r, int c) { return wsw<C::Q_BLOCK>(r, c); }, q, cos_t, sin_t, heads,
                                   h, nope, rope, q_row0, i0, base, n_rows);
    fence_proxy_async_smem();  // st.shared -> wgmma's reads (the barrier below orders them)

    // The warpgroup's rows start at tile row 64·wg; the thread's are 16·warp + lane / 4
    // (+ 8) of those, as in the mma.sync layout.
    const int wg_first = base + i0 + 64 * wg;  // position of the warpgroup's first row
    int pos_r[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) pos_r[i] = wg_first + warp * 16 + (lane >> 2) + 8 * i;

    const uint64_t dq = gmma_desc_sw128(sQ + wg * 64 * 128, 16, 1024);
    const uint64_t dk0 = gmma_desc_sw128(sKV, 16, 1024);
    const uint64_t dv0 = gmma_desc_sw128(sKV + C::K_BYTES, C::KV_BLOCK, 1024);  // N-major: LBO = 64-dim block

    float acc[NO];
#pragma unroll
    for (int i = 0; i < NO; ++i) acc[i] = 0.f;
    fence_operands(acc);  // materialised here, not sunk past the first S
    float m[2] = {-MLAS_INF, -MLAS_INF};
    float l[2] = {0.f, 0.f};

    // S of tile t into d from stage t % STAGES, issued and committed (not waited).
    auto issue_s = [&](int t, float (&d)[32]) {
        const uint32_t so = (t % STAGES) * C::STAGE_BYTES;
#pragma unroll
        for (int i = 0; i < 32; ++i) d[i] = 0.f;
        fence_operands(d);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < QK / 16; ++ks) {
            const uint32_t qoff = (ks >> 2) * C::Q_BLOCK + (ks & 3) * 32;
            const uint32_t koff = (ks >> 2) * C::KV_BLOCK + (ks & 3) * 32;
            wgmma_m64n64k16_ss(d, gmma_desc_add(dq, qoff), gmma_desc_add(dk0, so + koff));
        }
        wgmma_commit();
    };
    // Tile jt with its S in `cur` (issued by the previous step): S and P V of tile jt - 1
    // are waited for; S(jt + 1) goes into `nxt` and runs on the tensor cores while this
    // warpgroup does tile jt's softmax; then P V of tile jt is issued. Stages: jt (P V),
    // jt + 1 (S), jt + 2 (loading). The two S buffers alternate by step (no copies: a
    // copy between them defines a wgmma accumulator mid-pipeline, and ptxas serialises).
    auto step = [&](int jt, float (&cur)[32], float (&nxt)[32]) {
        wgmma_wait<0>();
        fence_operands(cur);
        fence_operands(acc);
        if constexpr (TMA) {
            // Tile jt + 1 has landed (tile 1 is always loaded: see the prologue).
            if (jt + 1 < max(n_kt, 2)) mbar_wait(sBar + 8 * ((jt + 1) % STAGES), ((jt + 1) / STAGES) & 1);
            __syncthreads();  // every warpgroup is done with stage (jt - 1) % STAGES
            if (tid == 0 && jt + 2 < n_kt) load_tma(jt + 2, (jt + 2) % STAGES);
        } else {
            cp_async_wait<0>();  // tile jt + 1 has landed
            fence_proxy_async_smem();
            __syncthreads();  // ... for all; every warpgroup is done with stage (jt - 1) % STAGES
            if (jt + 2 < n_kt) load_kv(jt + 2, (jt + 2) % STAGES);
            cp_async_commit();
        }
        // Past the last tile this reads a stale stage (nothing writes it any more):
        // unconditional, so no wgmma sits under a branch.
        issue_s(jt + 1, nxt);
        const int k0 = jt * BN;
        const uint32_t so = (jt % STAGES) * C::STAGE_BYTES;

        // Masked scores read from `cur` without writing it back: a write to a wgmma
        // accumulator while S(jt + 1) is in flight makes ptxas serialise every wgmma.
        // Causal mask: key k0 + 8j + 2(lane % 4) + (e & 1) of row (e >> 1).
        const bool masked_tile = k0 + BN - 1 > wg_first;
        auto score = [&](int j, int e) -> float {
            const int key = k0 + j * 8 + 2 * (lane & 3) + (e & 1);
            return masked_tile && key > pos_r[e >> 1] ? -MLAS_INF : cur[4 * j + e];
        };
        uint32_t pa[4][4];
        float alpha[2];
        softmax_tile<8>(score, scale_log2, m, l, pa, alpha);
        if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
            for (int i = 0; i < NO; ++i) acc[i] *= alpha[(i >> 1) & 1];
        }

        // O (64 x VD) += P (64 x 64 keys) V (64 keys x VD), V N-major.
        fence_operands(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) WgPV<VD>::mma(acc, pa[kk], gmma_desc_add(dv0, so + kk * 16 * 128));
        wgmma_commit();  // waited for by the next step
    };
    float s0[32], s1[32];
    if constexpr (TMA) {
        __syncthreads();  // the Q tile and the barriers' initialisation
        mbar_wait(sBar, 0);
    } else {
        cp_async_wait<STAGES - 2>();  // tile 0 has landed (tile 1 may be in flight)
        fence_proxy_async_smem();
        __syncthreads();
    }
    issue_s(0, s0);
    // Steps in pairs. With n_kt odd the last pair's second step runs tile n_kt, past every
    // valid row's position: fully masked, it adds exact zeros (p = 0, alpha = 1). Its stage
    // holds an earlier tile (or tile 1's zero fill when n_kt = 1): finite values.
    for (int jt = 0; jt < n_kt; jt += 2) {
        step(jt, s0, s1);
        step(jt + 1, s1, s0);
    }
    wgmma_wait<0>();  // the last P V (and the unused S past the last tile)
    fence_operands(acc);
    fence_operands(s0);
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = 64 * wg + warp * 16 + (lane >> 2) + 8 * i;
        if (r >= n_rows) continue;
        const float inv = 1.f / l[i];
        bf16* dst = o + (static_cast<size_t>(q_row0 + i0 + r) * heads + h) * vdim + 2 * (lane & 3);
#pragma unroll
        for (int n = 0; n < VD / 8; ++n)
            if (n * 8 < vdim) store2(dst + n * 8, acc[4 * n + 2 * i] * inv, acc[4 * n + 2 * i + 1] * inv);
    }
}
#endif

}  // namespace mlap

// DeepSeek-V2/V3/K2 heads: qk = 128 + 64 (up to 192), v up to 128. 104 KiB of shared
// memory: two CTAs per SM.
extern "C" __global__ void __launch_bounds__(mlap::NTHREADS, 2)
    mla_prefill_fwd_qk192_v128(bf16* __restrict__ o, const float* __restrict__ q, const bf16* __restrict__ kn,
                               const bf16* __restrict__ kpe, const bf16* __restrict__ v,
                               const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                               const int* __restrict__ seqs, const int* __restrict__ tiles, int heads, int nope,
                               int rope, int vdim, float scale_log2) {
    mlap::fwd_body<192, 128>(o, q, kn, kpe, v, cos_t, sin_t, seqs, tiles, heads, nope, rope, vdim, scale_log2);
}

// Small heads (test models): qk up to 64, v up to 64.
extern "C" __global__ void __launch_bounds__(mlap::NTHREADS, 2)
    mla_prefill_fwd_qk64_v64(bf16* __restrict__ o, const float* __restrict__ q, const bf16* __restrict__ kn,
                             const bf16* __restrict__ kpe, const bf16* __restrict__ v,
                             const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                             const int* __restrict__ seqs, const int* __restrict__ tiles, int heads, int nope,
                             int rope, int vdim, float scale_log2) {
    mlap::fwd_body<64, 64>(o, q, kn, kpe, v, cos_t, sin_t, seqs, tiles, heads, nope, rope, vdim, scale_log2);
}

// The warpgroup-MMA instances (sm_90a; elsewhere they trap and the host never picks them).
#define MLA_PREFILL_WG(NAME, QK, VD)                                                                              \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                          \
        NAME(bf16* __restrict__ o, const float* __restrict__ q, const bf16* __restrict__ kn,                      \
             const bf16* __restrict__ kpe, const bf16* __restrict__ v, const float* __restrict__ cos_t,           \
             const float* __restrict__ sin_t, const int* __restrict__ seqs, const int* __restrict__ tiles,        \
             int heads, int nope, int rope, int vdim, float scale_log2) {                                         \
        MLA_PREFILL_WG_BODY(QK, VD)                                                                               \
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MLA_PREFILL_WG_BODY(QK, VD)                                                                             \
    mlap::fwd_wg_body<QK, VD, false>(o, q, kn, kpe, v, cos_t, sin_t, seqs, tiles, heads, nope, rope, vdim, \
                                     scale_log2, nullptr, nullptr, nullptr);
#define MLA_PREFILL_WGT_BODY                                                                                     \
    mlap::fwd_wg_body<192, 128, true>(o, q, kn, kpe, v, cos_t, sin_t, seqs, tiles, heads, nope, rope, vdim, \
                                      scale_log2, &tkn, &tkpe, &tv);
#else
#define MLA_PREFILL_WG_BODY(QK, VD) __trap();
#define MLA_PREFILL_WGT_BODY __trap();
#endif
MLA_PREFILL_WG(mla_prefill_wg_qk192_v128, 192, 128)
MLA_PREFILL_WG(mla_prefill_wg_qk64_v64, 64, 64)

// The TMA variant (DeepSeek's widths only: nope 128, rope 64, v 128).
extern "C" __global__ void __launch_bounds__(256, 1)
    mla_prefill_wgt_qk192_v128(bf16* __restrict__ o, const float* __restrict__ q, const bf16* __restrict__ kn,
                               const bf16* __restrict__ kpe, const bf16* __restrict__ v,
                               const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                               const int* __restrict__ seqs, const int* __restrict__ tiles, int heads, int nope,
                               int rope, int vdim, float scale_log2, const __grid_constant__ CUtensorMap tkn,
                               const __grid_constant__ CUtensorMap tkpe, const __grid_constant__ CUtensorMap tv) {
    MLA_PREFILL_WGT_BODY
}

// The gathers' lookups: the last sequence whose keys start at or before key t, and the
// cache slot of its position p (page ids clamped to the cache: bad metadata reads wrong
// rows, never outside).
__device__ __forceinline__ int gather_seq(const int* __restrict__ seqs, int nseq, int t) {
    int lo = 0, hi = nseq - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (seqs[mid * mlap::SEQ_FIELDS + mlap::F_KOFF] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}
__device__ __forceinline__ size_t gather_slot(const int* __restrict__ tables, const int* sd, int p, int bt_stride,
                                              int num_blocks) {
    const int entry = min(p / mlap::PAGE, bt_stride - 1);
    const unsigned page = min(static_cast<unsigned>(tables[static_cast<size_t>(sd[mlap::F_TABLE]) * bt_stride + entry]),
                              static_cast<unsigned>(num_blocks - 1));
    return static_cast<size_t>(page) * mlap::PAGE + p % mlap::PAGE;
}

// The sequences' cached latents, gathered from the paged cache into contiguous rows: key
// t (sequence j = the last with k_off <= t, position p = t - k_off) -> ckv[t] = c_kv
// (lora), kpe[t] = k_pe (rope). A warp per key, 16-byte copies (lora, rope multiples of
// 8). Page ids are clamped to the cache, so bad metadata reads wrong rows, never outside.
extern "C" __global__ void mla_prefill_gather_bf16(bf16* __restrict__ ckv, bf16* __restrict__ kpe,
                                                   const bf16* __restrict__ cache, const int* __restrict__ tables,
                                                   const int* __restrict__ seqs, int nseq, int keys, int bt_stride,
                                                   int num_blocks, int lora, int rope) {
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (t >= keys) return;
    const int* sd = seqs + gather_seq(seqs, nseq, t) * mlap::SEQ_FIELDS;
    const int p = t - sd[mlap::F_KOFF];
    const int lat = lora + rope, lora_c = lora / 8;
    const bf16* src = cache + static_cast<size_t>(gather_slot(tables, sd, p, bt_stride, num_blocks)) * lat;
    for (int c = lane; c < lat / 8; c += 32) {
        const uint4 x = *reinterpret_cast<const uint4*>(src + c * 8);
        bf16* dst = c < lora_c ? ckv + static_cast<size_t>(t) * lora + c * 8
                               : kpe + static_cast<size_t>(t) * rope + (c - lora_c) * 8;
        *reinterpret_cast<uint4*>(dst) = x;
    }
}

// The same gather from the fp8 cache (layout: kv_fp8.cuh): ckv[t] = bf16(code * scale),
// kpe[t] = k_pe; a warp per key, a channel per lane.
extern "C" __global__ void mla_prefill_gather_fp8(bf16* __restrict__ ckv, bf16* __restrict__ kpe,
                                                  const uint8_t* __restrict__ cache, const int* __restrict__ tables,
                                                  const int* __restrict__ seqs, int nseq, int keys, int bt_stride,
                                                  int num_blocks, int lora, int rope) {
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (t >= keys) return;
    const int* sd = seqs + gather_seq(seqs, nseq, t) * mlap::SEQ_FIELDS;
    const int p = t - sd[mlap::F_KOFF];
    const uint8_t* src =
        cache + static_cast<size_t>(gather_slot(tables, sd, p, bt_stride, num_blocks)) * kvf8::entry_bytes(lora, rope);
    for (int c = lane; c < lora + rope; c += 32) {
        const bf16 x = __float2bfloat16_rn(kvf8::at(src, lora, c));
        if (c < lora)
            ckv[static_cast<size_t>(t) * lora + c] = x;
        else
            kpe[static_cast<size_t>(t) * rope + c - lora] = x;
    }
}

// out[rows[b]] = in[b] for rows of `width` bf16 (the absorbed rows' o, computed compact,
// put back in the step's row order). grid = number of rows.
extern "C" __global__ void scatter_rows_bf16(bf16* __restrict__ out, const bf16* __restrict__ in,
                                             const int* __restrict__ rows, int width) {
    const size_t dst = static_cast<size_t>(rows[blockIdx.x]) * width, src = static_cast<size_t>(blockIdx.x) * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) out[dst + c] = in[src + c];
}
