// Absorbed-MLA decode attention, Hopper "seesaw" schedule (wgmma, sm_90a): 64-token
// blocks, each warpgroup computes S for every other block over all 576 dims.
//
// Same contract, grid and split-KV partial format as mla_decode_splitkv_* in
// mla_decode.cu, except that a split is made of whole 64-token blocks (pages)
// instead of 32-token chunks, that the KV arrives by TMA (the cache's tensor map is the
// first argument), and that the splits can be merged in this launch instead
// of by the combine kernel:
//   - with `counters` (not null), by the last CTA of each (request, tile) (combine_last);
//   - in the _c2 entries (exactly two splits), by the two CTAs of a cluster (1 x 2 x 1:
//     the two splits of one request and tile) through distributed shared memory
//     (pair_epilogue): no partial goes to global memory and no combine kernel runs.
//
// Why: the 32-token kernel splits S's 576 dims between its two warpgroups, swaps the
// partial S through shared memory (four barriers per chunk), runs the same softmax in
// both, and issues S as m64n32 (Q re-read from shared memory for every 32 tokens). On
// the H200 that kept the tensor pipe ~1/3 busy. Here (the schedule FlashMLA's write-up
// calls "seesaw"):
//   - warpgroup 0 owns O[:, 0..256) and computes S0 = Q K0ᵀ of the even block of each
//     pair, warpgroup 1 owns O[:, 256..512) and computes S1 = Q K1ᵀ of the odd block:
//     36 wgmma m64n64k16 each, no partial-S exchange, no duplicated softmax;
//   - the running max m is shared: warpgroup 0 moves it with S0 (m_a), warpgroup 1 then
//     with S1 (m_b). Each hands its P (bf16, already in the wgmma A-fragment layout) and
//     its max to the other through shared memory, warp w to warp w of the other group
//     (the rows of warp w are the same in both), so only pairs of warps ever wait;
//   - O_L = (O_L·α0 + P0 V0L)·α1 + P1 V1L,  O_R = O_R·α0·α1 + (P0·α1) V0R + P1 V1R,
//     with α0 = 2^(m_prev - m_a), α1 = 2^(m_a - m_b); lazy rescaling (the max moves only
//     when a block's max exceeds it by > 8 in log2 units) makes α = 1 nearly always, and
//     a warp skips the multiplies then;
//   - two cache slots (all shared memory holds beside the 64-row Q), each in two groups
//     with their own mbarrier: X = the dims warpgroup 0 reads last (c_kv 0..255, plus
//     the rope dims for slot 0) and Y = those warpgroup 1 reads last (c_kv 256..511, plus
//     rope for slot 1). The warpgroup that reads a group last refills it with the block
//     two ahead as soon as its P·V on it has completed, and S issues the group that
//     arrives first first.
// Rows: 64 query rows per CTA (row = s_idx * heads + head), zero-filled past `rows`;
// garbage-free because those rows are zero, and never written out.
#include <cuda.h>  // CUtensorMap

#include "common.cuh"
#include "mla_decode.cuh"
#include "wgmma.cuh"

namespace mlass {
using namespace mla;

constexpr int DLAT = 512, DQK = 576;
constexpr int CHUNKS = DQK / 8;         // 16-byte chunks per row (72)
constexpr int TOK = 64;                 // tokens per block (one page)
constexpr int PIECE = TOK * 128;        // one 64-dim block of a slot: 64 tokens x 128 B
constexpr int SLOT = 9 * PIECE;         // 73,728 B
constexpr int Q_BYTES = 64 * 128 * 9;   // 64 rows x 576 dims, [piece][row][128 B]
constexpr int QPIECE = 64 * 128;        // bytes between Q's 64-dim blocks
constexpr int P_BYTES = 4 * 16 * 32 * 4;  // P fragments: [warp][16 regs][32 lanes] u32
// Layout from the 1024-aligned base: Q | slot 0 | slot 1 | P | m_a[64] | m_b[64] | 4 mbarriers.
constexpr int OFF_SLOT = Q_BYTES;
constexpr int OFF_P = OFF_SLOT + 2 * SLOT;
constexpr int OFF_MA = OFF_P + P_BYTES;
constexpr int OFF_MB = OFF_MA + 64 * 4;
constexpr int OFF_BAR = OFF_MB + 64 * 4;
constexpr int SMEM_BYTES = 1024 + OFF_BAR + 4 * 8;  // 230,960
static_assert(SMEM_BYTES <= 227 * 1024, "exceeds the opt-in shared memory of sm_90");

// Hardware barrier ids: 1..4 = "P0 ready" for warp pair w, 5..8 = "P1 ready", 9/10 =
// warpgroup 0/1 alone. (0 is __syncthreads.)
constexpr int BAR_P0 = 1, BAR_P1 = 5, BAR_WG = 9;

template <int ROWS>
__device__ __forceinline__ uint32_t sw128(int r, int c) {
    return static_cast<uint32_t>((c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }

// bf16x2 times a scalar (the P fragments of the other warpgroup, rescaled by α1).
__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t v, float s) {
    __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&v);
    float2 f = __bfloat1622float2(h);
    return pack_bf16x2(f.x * s, f.y * s);
}

// The reference max actually subtracted: a row with no visible token yet keeps -inf as
// its max and subtracts 0 (so exp2(-inf - 0) = 0, never NaN).
__device__ __forceinline__ float msub(float m) { return m == -MLAS_INF ? 0.f : m; }

// The split-KV merge, fused: every CTA of a (request, tile) has written its partial; the
// last one to finish (an atomic counter per (request, tile), zero before the launch and
// reset to zero here) merges them (merge_splits_row, a warp per row), so no second
// kernel launch and no pass over the partials by a separate grid.
template <typename OutT>
__device__ __forceinline__ void combine_last(OutT* __restrict__ out, float* __restrict__ lse,
                                             const float* __restrict__ o_acc, const float* __restrict__ lse_acc,
                                             unsigned* __restrict__ counters, int rows, int row0, int valid_rows,
                                             int num_splits) {
    __shared__ int is_last;
    const int b = blockIdx.z, tid = threadIdx.x, warp = tid >> 5;
    __threadfence();  // this CTA's partials before its arrival
    __syncthreads();
    if (tid == 0) {
        unsigned* c = counters + static_cast<size_t>(b) * gridDim.x + blockIdx.x;
        is_last = atomicAdd(c, 1u) == static_cast<unsigned>(num_splits - 1);
        if (is_last) *c = 0u;  // every other CTA of this tile has arrived: ready for the next launch
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();  // the other CTAs' partials (written on other SMs) after their arrivals
    for (int lr = warp; lr < valid_rows; lr += NTHREADS / 32) {
        const int row = row0 + lr;
        merge_splits_row(o_acc, lse_acc, static_cast<size_t>(b) * num_splits * rows + row, static_cast<size_t>(rows),
                         num_splits, DLAT, out + (static_cast<size_t>(b) * rows + row) * DLAT,
                         lse + static_cast<size_t>(b) * rows + row);
    }
}

template <typename OutT>
__device__ __forceinline__ void pair_epilogue(uint8_t* smem, const float (&o)[128], const float (&inv)[2],
                                              const float (&row_lse)[2], OutT* __restrict__ out,
                                              float* __restrict__ lse, int b, int rows, int row0, int valid_rows,
                                              int wg, int w, int lane) {
    const int rank = static_cast<int>(cluster_ctarank());
    const int wtid = threadIdx.x & 127;
    float* recv = reinterpret_cast<float*>(smem + OFF_SLOT);  // [32][128 threads] float4, then lse [64]
    float* recv_lse = recv + 32 * 128 * 4;
    const int r0 = w * 16 + (lane >> 2);  // this thread's rows: r0, r0 + 8
    cluster_sync();  // both CTAs are past their loops: the peer's slots are free
    if (wg != rank) {
        const uint32_t peer = cluster_map(smem_u32(recv), static_cast<uint32_t>(rank ^ 1));
#pragma unroll
        for (int k = 0; k < 32; ++k)
            st_cluster_f32x4(peer + (k * 128 + wtid) * 16, o[4 * k] * inv[0], o[4 * k + 1] * inv[0],
                             o[4 * k + 2] * inv[1], o[4 * k + 3] * inv[1]);
        if ((lane & 3) == 0) {
            st_cluster_f32(peer + (32 * 128 * 4 + r0) * 4, row_lse[0]);
            st_cluster_f32(peer + (32 * 128 * 4 + r0 + 8) * 4, row_lse[1]);
        }
    }
    cluster_sync();  // the other split's half is here
    if (wg != rank) return;
    float wm[2], wp[2], total[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        total[i] = merge2_lse(row_lse[i], recv_lse[r0 + 8 * i], wm[i], wp[i]);
        wm[i] *= inv[i];
    }
    const float4* pr = reinterpret_cast<const float4*>(recv) + wtid;
    OutT* ob0 = out + (static_cast<size_t>(b) * rows + row0 + r0) * DLAT + wg * 256 + 2 * (lane & 3);
    OutT* ob1 = ob0 + 8 * DLAT;
    const bool ok0 = r0 < valid_rows, ok1 = r0 + 8 < valid_rows;
#pragma unroll
    for (int n = 0; n < 32; ++n) {
        const float4 v = pr[n * 128];
        if (ok0) store2(ob0 + n * 8, o[4 * n] * wm[0] + v.x * wp[0], o[4 * n + 1] * wm[0] + v.y * wp[0]);
        if (ok1) store2(ob1 + n * 8, o[4 * n + 2] * wm[1] + v.z * wp[1], o[4 * n + 3] * wm[1] + v.w * wp[1]);
    }
    if (rank == 0 && (lane & 3) == 0) {
        if (ok0) lse[static_cast<size_t>(b) * rows + row0 + r0] = total[0];
        if (ok1) lse[static_cast<size_t>(b) * rows + row0 + r0 + 8] = total[1];
    }
}

template <typename OutT, bool PAIR>
__device__ __forceinline__ void body(const CUtensorMap* tmap, const bf16* __restrict__ q,
                                     const int* __restrict__ block_table, const int* __restrict__ seq_lens,
                                     OutT* __restrict__ out, float* __restrict__ lse, float* __restrict__ o_acc,
                                     float* __restrict__ lse_acc, unsigned* __restrict__ counters, int heads,
                                     int q_len, int bt_stride, int num_blocks, int num_splits, int split_blocks,
                                     float scale_log2) {
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t base = (raw + 1023u) & ~1023u;  // swizzle atoms start on 1024-byte boundaries
    uint8_t* smem = smem_raw + (base - raw);
    const uint32_t sQ = base, sKV = base + OFF_SLOT;
    uint4* sP = reinterpret_cast<uint4*>(smem + OFF_P);
    float* sMa = reinterpret_cast<float*>(smem + OFF_MA);
    float* sMb = reinterpret_cast<float*>(smem + OFF_MB);
    // mbarriers: X(slot) at +0/+8, Y(slot) at +16/+24.
    const uint32_t sBar = base + OFF_BAR;
    auto bar_x = [&](int slot) { return sBar + 8 * slot; };
    auto bar_y = [&](int slot) { return sBar + 16 + 8 * slot; };

    const int tile = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform: descriptors stay uniform
    const int wtid = tid & 127;
    const int w = (tid >> 5) & 3;  // warp within the warpgroup: rows 16w..16w+15
    const int rows = heads * q_len;
    const int row0 = tile * BM;
    const int valid_rows = min(BM, rows - row0);
    const int seq_len = max(0, min(seq_lens[b], bt_stride * PAGE));

    // Split `split` covers blocks [blk0, blk_end) of this request: the request's blocks
    // shared evenly, or with split_blocks > 0 (batch-invariant mode) split_blocks each from
    // block 0, whatever the request's length, so a row's key ranges and their order depend
    // on nothing else in the batch (the last split takes any blocks left).
    // Causal: the tile's last row sees keys below `seen`, so blocks from n_vis on are
    // masked for every row of the tile and are skipped (a long prefill window's early
    // tokens skip most of it). A masked block leaves a row's max, sum and O as they were,
    // so skipping it changes no bit of any row: the split ranges stay those of n_blk.
    const int n_blk = (seq_len + TOK - 1) / TOK;
    const int seen = seq_len - (q_len - 1 - min((row0 + valid_rows - 1) / heads, q_len - 1));
    const int n_vis = min(n_blk, (max(seen, 0) + TOK - 1) / TOK);
    const int per = split_blocks > 0 ? split_blocks : (n_blk + num_splits - 1) / num_splits;
    const int blk0 = min(split * per, n_vis);
    const int blk_end = split == num_splits - 1 ? n_vis : min(blk0 + per, n_vis);
    const int* bt = block_table + static_cast<size_t>(b) * bt_stride;

    {
        const bf16* qb = q + (static_cast<size_t>(b) * rows + row0) * DQK;
        for (int i = tid; i < 64 * CHUNKS; i += NTHREADS) {
            const int r = i / CHUNKS, c = i % CHUNKS;
            const bool ok = r < valid_rows;
            cp_async_16(sQ + sw128<64>(r, c), ok ? qb + r * DQK + c * 8 : q, ok ? 16 : 0);
        }
        cp_async_commit();
    }
    // Pieces [p0, p0 + n) of block `blk` into `slot`, completing on `bar`.
    auto load = [&](int blk, int slot, int p0, int n, bool rope, uint32_t bar) {
        const int page = min(static_cast<unsigned>(bt[blk]), static_cast<unsigned>(num_blocks - 1));
        mbar_arrive_expect_tx(bar, (n + (rope ? 1 : 0)) * PIECE);
        const uint32_t dst = sKV + slot * SLOT;
        for (int p = p0; p < p0 + n; ++p) tma_load_3d(dst + p * PIECE, tmap, 0, page * PAGE, p, bar);
        if (rope) tma_load_3d(dst + 8 * PIECE, tmap, 0, page * PAGE, 8, bar);
    };
    // Group X of a slot: c_kv 0..255 (+ rope for slot 0); group Y: c_kv 256..511 (+ rope
    // for slot 1). The rope piece goes with the group its block's S owner refills.
    auto load_x = [&](int blk, int slot) { load(blk, slot, 0, 4, slot == 0, bar_x(slot)); };
    auto load_y = [&](int blk, int slot) { load(blk, slot, 4, 4, slot == 1, bar_y(slot)); };
    if (tid == 0) {
        for (int i = 0; i < 4; ++i) mbar_init(sBar + 8 * i, 1);
        fence_mbar_init();
        for (int s = 0; s < 2; ++s)
            if (blk0 + s < blk_end) {
                load_x(blk0 + s, s);
                load_y(blk0 + s, s);
            }
    }
    cp_async_wait<0>();
    fence_proxy_async_smem();  // Q (cp.async, generic proxy) -> wgmma (async proxy)
    __syncthreads();           // barriers initialised, Q visible

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m[2] = {-MLAS_INF, -MLAS_INF};  // running reference max per row (log2 units, scaled)
    float l[2] = {0.f, 0.f};              // this warpgroup's partial row sums (own blocks' P)
    const int min_limit = seq_len - (q_len - 1);
    int limit[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int row = row0 + w * 16 + (lane >> 2) + 8 * i;  // row = s_idx * heads + head
        const int s_idx = min(row / heads, q_len - 1);
        limit[i] = seq_len - (q_len - 1 - s_idx);
    }

    // S of block `blk` (in `slot`) over all 576 dims: the first-arriving group first.
    const uint64_t dq = gmma_desc_sw128(sQ, 16, 1024);
    const uint64_t dk = gmma_desc_sw128(sKV, 16, 1024);
    auto compute_s = [&](int slot, int use, float (&s)[32]) {
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = 0.f;
        fence_operands(s);
        const uint32_t so = slot * SLOT;
        const uint32_t first = slot == 0 ? bar_x(0) : bar_y(1);
        const uint32_t second = slot == 0 ? bar_y(0) : bar_x(1);
        const int pf = slot == 0 ? 0 : 4;  // first group's c_kv pieces
        const int ps = slot == 0 ? 4 : 0;
        mbar_wait(first, use & 1);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)  // rope (piece 8) travels with the first group
            wgmma_m64n64k16_ss(s, gmma_desc_add(dq, 8 * QPIECE + ks * 32), gmma_desc_add(dk, so + 8 * PIECE + ks * 32));
#pragma unroll
        for (int ks = 0; ks < 16; ++ks) {
            const int p = pf + (ks >> 2);
            wgmma_m64n64k16_ss(s, gmma_desc_add(dq, p * QPIECE + (ks & 3) * 32),
                               gmma_desc_add(dk, so + p * PIECE + (ks & 3) * 32));
        }
        mbar_wait(second, use & 1);
#pragma unroll
        for (int ks = 0; ks < 16; ++ks) {
            const int p = ps + (ks >> 2);
            wgmma_m64n64k16_ss(s, gmma_desc_add(dq, p * QPIECE + (ks & 3) * 32),
                               gmma_desc_add(dk, so + p * PIECE + (ks & 3) * 32));
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_operands(s);
    };
    // Mask, max and P of block `blk` given the previous max `mp` (both rows): returns the
    // new max in `mn`, adds the row sums (f32 P) to `rs`, writes bf16 P fragments.
    auto softmax = [&](int blk, float (&s)[32], const float (&mp)[2], float (&mn)[2], float (&rs)[2],
                       uint32_t (&pa)[16]) {
        const int tok0 = blk * TOK;
        if (tok0 + TOK > min_limit) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int tok = tok0 + j * 8 + 2 * (lane & 3) + (e & 1);
                    if (tok >= limit[e >> 1]) s[4 * j + e] = -MLAS_INF;
                }
        }
        float mx[2] = {-MLAS_INF, -MLAS_INF};
#pragma unroll
        for (int i = 0; i < 32; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
        float ms[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            const float cand = mx[i] == -MLAS_INF ? -MLAS_INF : mx[i] * scale_log2;
            mn[i] = cand > mp[i] + 8.f ? cand : mp[i];
            ms[i] = msub(mn[i]);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                p[e] = fast_exp2(s[4 * j + e] * scale_log2 - ms[e >> 1]);
                rs[e >> 1] += p[e];
            }
            // A fragment of k-step j/2: regs 0/1 = tokens 0..7 of the step (rows g, g+8),
            // regs 2/3 = tokens 8..15.
            pa[(j >> 1) * 4 + (j & 1) * 2 + 0] = pack_bf16x2(p[0], p[1]);
            pa[(j >> 1) * 4 + (j & 1) * 2 + 1] = pack_bf16x2(p[2], p[3]);
        }
    };
    // The last block of the sequence may end inside its page: slots past seq_len hold
    // whatever the cache holds (NaN included), and 0 * NaN in P V would poison every
    // row, so zero those tokens of pieces [p0, p0 + 4) before this warpgroup's P V.
    auto zero_tail = [&](int blk, int slot, int p0) {
        const int valid = seq_len - blk * TOK;
        if (valid >= TOK) return;
        const int n16 = (TOK - valid) * 8;  // 16-byte words past the valid tokens, per piece
        for (int i = wtid; i < 4 * n16; i += 128) {
            const uint32_t a = sKV + slot * SLOT + (p0 + i / n16) * PIECE + valid * 128 + (i % n16) * 16;
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(a), "r"(0) : "memory");
        }
        fence_proxy_async_smem();
        named_barrier_sync(BAR_WG + wg, 128);
    };
    // O[:, 256 wg ..] += P (64 x 64 tokens) V (64 tokens x 256 dims) of `slot`, V N-major.
    const uint64_t dv = gmma_desc_sw128(sKV + 4 * wg * PIECE, PIECE, 1024);
    auto issue_pv = [&](int slot, const uint32_t (&pa)[16]) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
            wgmma_m64n256k16_rs_tb(o, a, gmma_desc_add(dv, slot * SLOT + kk * 16 * 128));
        }
    };
    auto rescale_o = [&](const float (&alpha)[2]) {
        if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
            for (int i = 0; i < 128; ++i) o[i] *= alpha[(i >> 1) & 1];
        }
    };
    // Fragment exchange: warp w's 16 P registers per lane, as 4 x uint4, conflict-free.
    uint4* p_mine = sP + w * 4 * 32 + lane;
    const int last_blk = n_blk - 1;

    for (int pair = 0; blk0 + 2 * pair < blk_end; ++pair) {
        const int b0 = blk0 + 2 * pair, b1 = b0 + 1;
        const bool has1 = b1 < blk_end;
        float s[32];
        uint32_t p0[16], p1[16];
        if (wg == 0) {
            compute_s(0, pair, s);
            float ma[2], rs[2] = {0.f, 0.f}, alpha0[2];
            softmax(b0, s, m, ma, rs, p0);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                alpha0[i] = fast_exp2(m[i] - msub(ma[i]));
                l[i] = l[i] * alpha0[i] + rs[i];
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) p_mine[r * 32] = make_uint4(p0[4 * r], p0[4 * r + 1], p0[4 * r + 2], p0[4 * r + 3]);
            if ((lane & 3) == 0) {
                sMa[w * 16 + (lane >> 2)] = ma[0];
                sMa[w * 16 + (lane >> 2) + 8] = ma[1];
            }
            bar_arrive(BAR_P0 + w, 64);
            rescale_o(alpha0);
            if (b0 == last_blk) zero_tail(b0, 0, 0);
            fence_operands(o);
            wgmma_fence();
            issue_pv(0, p0);
            wgmma_commit();
            float mb[2] = {ma[0], ma[1]};
            if (has1) {
                named_barrier_sync(BAR_P1 + w, 64);
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const uint4 v = p_mine[r * 32];
                    p1[4 * r] = v.x, p1[4 * r + 1] = v.y, p1[4 * r + 2] = v.z, p1[4 * r + 3] = v.w;
                }
                mb[0] = sMb[w * 16 + (lane >> 2)];
                mb[1] = sMb[w * 16 + (lane >> 2) + 8];
                float alpha1[2];
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    alpha1[i] = fast_exp2(ma[i] - msub(mb[i]));
                    l[i] *= alpha1[i];
                }
                if (!__all_sync(0xffffffffu, alpha1[0] == 1.f && alpha1[1] == 1.f)) {
                    wgmma_wait<0>();  // P0 V0L accumulates into O: let it land first
                    fence_operands(o);
#pragma unroll
                    for (int i = 0; i < 128; ++i) o[i] *= alpha1[(i >> 1) & 1];
                }
                mbar_wait(bar_x(1), pair & 1);  // this warpgroup's own view of slot 1's X group
                if (b1 == last_blk) zero_tail(b1, 1, 0);
                fence_operands(o);
                wgmma_fence();
                issue_pv(1, p1);
            }
            // Always a second group (empty without an odd block), so the waits below are
            // the same on every path: ptxas serialises wgmma when it cannot prove them.
            wgmma_commit();
#pragma unroll
            for (int i = 0; i < 2; ++i) m[i] = mb[i];
            // Refill X(0) once P0 V0L is done, X(1) once P1 V1L is.
            wgmma_wait<1>();
            fence_operands(o);
            named_barrier_sync(BAR_WG, 128);
            if (wtid == 0 && b0 + 2 < blk_end) load_x(b0 + 2, 0);
            wgmma_wait<0>();
            fence_operands(o);
            named_barrier_sync(BAR_WG, 128);
            if (wtid == 0 && has1 && b1 + 2 < blk_end) load_x(b1 + 2, 1);
        } else {
            float mb[2], rs[2] = {0.f, 0.f};
            if (has1) compute_s(1, pair, s);
            named_barrier_sync(BAR_P0 + w, 64);
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const uint4 v = p_mine[r * 32];
                p0[4 * r] = v.x, p0[4 * r + 1] = v.y, p0[4 * r + 2] = v.z, p0[4 * r + 3] = v.w;
            }
            const float ma[2] = {sMa[w * 16 + (lane >> 2)], sMa[w * 16 + (lane >> 2) + 8]};
            float alpha0[2], alpha1[2] = {1.f, 1.f};
#pragma unroll
            for (int i = 0; i < 2; ++i) alpha0[i] = fast_exp2(m[i] - msub(ma[i]));
            if (has1) {
                softmax(b1, s, ma, mb, rs, p1);
#pragma unroll
                for (int i = 0; i < 2; ++i) alpha1[i] = fast_exp2(ma[i] - msub(mb[i]));
                // Same words this thread just read: no other thread's P0 is overwritten.
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    p_mine[r * 32] = make_uint4(p1[4 * r], p1[4 * r + 1], p1[4 * r + 2], p1[4 * r + 3]);
                if ((lane & 3) == 0) {
                    sMb[w * 16 + (lane >> 2)] = mb[0];
                    sMb[w * 16 + (lane >> 2) + 8] = mb[1];
                }
                bar_arrive(BAR_P1 + w, 64);
            } else {
                mb[0] = ma[0], mb[1] = ma[1];
            }
            float a01[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                a01[i] = alpha0[i] * alpha1[i];
                l[i] = l[i] * a01[i] + rs[i];
                m[i] = mb[i];
            }
            rescale_o(a01);
            if (!__all_sync(0xffffffffu, alpha1[0] == 1.f && alpha1[1] == 1.f)) {
                // P0 enters O_R after S1 moved the max: (P0 · α1) V0R. Fragment regs 0/2
                // of a k-step are row g, 1/3 row g + 8.
#pragma unroll
                for (int r = 0; r < 16; ++r) p0[r] = scale_bf16x2(p0[r], alpha1[r & 1]);
            }
            mbar_wait(bar_y(0), pair & 1);  // this warpgroup's own view of slot 0's Y group
            if (b0 == last_blk) zero_tail(b0, 0, 4);
            if (has1 && b1 == last_blk) zero_tail(b1, 1, 4);
            fence_operands(o);
            wgmma_fence();
            issue_pv(0, p0);
            wgmma_commit();
            if (has1) issue_pv(1, p1);
            wgmma_commit();
            // Refill Y(0) once P0 V0R is done, Y(1) once P1 V1R is.
            wgmma_wait<1>();
            fence_operands(o);
            named_barrier_sync(BAR_WG + 1, 128);
            if (wtid == 0 && b0 + 2 < blk_end) load_y(b0 + 2, 0);
            wgmma_wait<0>();
            fence_operands(o);
            named_barrier_sync(BAR_WG + 1, 128);
            if (wtid == 0 && has1 && b1 + 2 < blk_end) load_y(b1 + 2, 1);
        }
    }

    // Row sums: quad reduction, then the two warpgroups' partials (same reference max).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    __syncthreads();  // every read of sMa / sMb in the loop is done
    float* l_mine = wg == 0 ? sMa : sMb;
    const float* l_peer = wg == 0 ? sMb : sMa;
    if ((lane & 3) == 0) {
        l_mine[w * 16 + (lane >> 2)] = l[0];
        l_mine[w * 16 + (lane >> 2) + 8] = l[1];
    }
    __syncthreads();
    l[0] += l_peer[w * 16 + (lane >> 2)];
    l[1] += l_peer[w * 16 + (lane >> 2) + 8];

    if constexpr (PAIR) {
        float inv[2], row_lse[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) row_lse[i] = row_inv_lse(l[i], m[i], inv[i]);
        pair_epilogue(smem, o, inv, row_lse, out, lse, b, rows, row0, valid_rows, wg, w, lane);
    } else {
        store_o_rows(o, l, m, w, wg, lane, b, rows, row0, valid_rows, split, num_splits, out, lse, o_acc, lse_acc);
        // Without counters the host merges the splits with the combine kernel.
        if (num_splits > 1 && counters != nullptr)
            combine_last(out, lse, o_acc, lse_acc, counters, rows, row0, valid_rows, num_splits);
    }
}

}  // namespace mlass

// Only sm_90a has wgmma; other targets of this fatbin get a trap (the host never
// launches these there). The tensor map views the cache as 64 dims x (num_blocks * 64)
// tokens (stride 1152 B) x 9 dim blocks (stride 128 B), box 64 x 64 x 1, 128-byte swizzle.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MLASS_BODY(OUT, PAIR)                                                                                 \
    mlass::body<OUT, PAIR>(&tmap, q, block_table, seq_lens, out, lse, o_acc, lse_acc, counters, heads, q_len, \
                           bt_stride, num_blocks, num_splits, split_blocks, scale_log2);
#else
#define MLASS_BODY(OUT, PAIR) __trap();
#endif
#define MLASS_ARGS                                                                                            \
    const __grid_constant__ CUtensorMap tmap, const bf16 *q, const bf16 *kv, const int *block_table,           \
        const int *seq_lens, OUT_T *out, float *lse, float *o_acc, float *lse_acc, unsigned *counters,          \
        int heads, int q_len, int bt_stride, int num_blocks, int num_splits, int split_blocks, float scale_log2
#define MLASS_ENTRY(OUT, SUFFIX)                                                                              \
    extern "C" __global__ void __launch_bounds__(mla::NTHREADS, 1) mla_decode_wgmma_ss_d512r64_##SUFFIX(      \
        MLASS_ARGS) {                                                                                         \
        (void)kv;                                                                                             \
        MLASS_BODY(OUT, false)                                                                                \
    }                                                                                                         \
    /* Exactly two splits, merged by the cluster of the two (grid.y = 2); o_acc, lse_acc and */               \
    /* counters are unused. */                                                                                \
    extern "C" __global__ void __cluster_dims__(1, 2, 1) __launch_bounds__(mla::NTHREADS, 1)                  \
        mla_decode_wgmma_ss_c2_d512r64_##SUFFIX(MLASS_ARGS) {                                                 \
        (void)kv;                                                                                             \
        MLASS_BODY(OUT, true)                                                                                 \
    }
#define OUT_T bf16
MLASS_ENTRY(bf16, obf16)
#undef OUT_T
#define OUT_T float
MLASS_ENTRY(float, of32)
#undef OUT_T
