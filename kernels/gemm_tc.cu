// Projections on tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate). One tile
// routine (gtc_tile) is behind the first two kernels below; linear_tc_big (more than 64
// rows) is described where it is defined. (The absorbed form's per-head W_UK / W_UV:
// heads_tc.cu.)
//
// - moe_grouped_tc_*: the MoE experts as one launch (fast mode): rows [off[g], off[g +
//   1]) of x (sorted by expert, `k` wide, bf16) times the weight of expert experts[g]
//   (w[experts[g]], `[n][k]` bf16; expert g when `experts` is null) into the same rows of
//   y (`n` wide, bf16 or f32), as `moe_grouped_*` in backend_ops.cu computes it but on
//   tensor cores. grid = (ceil(n / BN), experts): a block owns BN = 64 output columns of
//   one expert and takes the expert's rows ROWS = 64 at a time. An expert with ≤ 64 rows
//   (decode: ~8) reads each weight element once; longer experts (prefill) re-read the
//   slice per chunk.
// - linear_tc_*: a dense projection y = x Wᵀ that is batch-invariant (GemmMode::
//   InvariantTc): grid = (ceil(m / 64), ksplit, ceil(n / BN)). A block owns 64 rows × BN
//   columns and the k range [ks·kchunk, (ks + 1)·kchunk); with ksplit > 1 it writes an f32
//   partial and linear_tc_reduce sums the partials in ks order. ksplit and kchunk come
//   from the weight's shape alone (linear.rs), never from m, and a row's sum runs the same
//   mma sequence wherever the row sits in its tile, so a row's result does not depend on
//   the other rows of the call. Row chunks are blockIdx.x, so the blocks that share a
//   weight slice run together and the slice is read from HBM about once.
//
// The sum order differs from `linear_inv`'s (CUDA cores), so the two invariant modes
// agree only to rounding. In a tile, every warp runs its 16 columns (2 n-tiles) over the
// chunk's m-tiles (4 of 16 rows; rows past the end are zero-filled in shared memory and
// never stored), the weight slice [BN][BK] and the rows stream through a 3-stage cp.async
// ring (BK = 64 of k per stage). Shared tiles are [row][64] bf16 (128 B rows) with the
// 16-byte chunk index XOR (row & 7), so ldmatrix's 8 row addresses hit 8 different bank
// groups. Needs k % 8 == 0 (16-byte rows), 16-byte aligned x and weights, and k ranges
// starting at multiples of 8; k past the range's end is zero-filled.
#include <cuda.h>  // CUtensorMap

#include "common.cuh"
#include "wgmma.cuh"

namespace gtc {
constexpr int BN = 64, BK = 64, MT = 4, ROWS = MT * 16, STAGES = 3, THREADS = 128;
constexpr int CHUNKS = BK / 8;  // 16-byte chunks per tile row
}  // namespace gtc

// Element offset of (row, 16-byte chunk c) in a swizzled [row][BK] tile.
__device__ __forceinline__ int gtc_at(int row, int c) { return row * gtc::BK + ((c ^ (row & 7)) * 8); }

template <typename T>
__device__ __forceinline__ void gtc_store(T* __restrict__ y, size_t row, int col, int n, float a, float b) {
    T* p = y + row * n + col;
    if (col + 1 < n && (n & 1) == 0) {  // even n: (row * n + col) is even, the pair is aligned
        store2(p, a, b);
    } else {
        if (col < n) p[0] = from_f32<T>(a);
        if (col + 1 < n) p[1] = from_f32<T>(b);
    }
}

struct GtcSmem {
    bf16 ws[gtc::STAGES][gtc::BN * gtc::BK];
    bf16 xs[gtc::STAGES][gtc::ROWS * gtc::BK];
};

// acc = rows [0, nr) of xr (k wide) times columns [n0, n0 + BN) of we ([n][k]) over k in
// [k0, k1), nr ≤ ROWS. Starts with a barrier (the caller's previous tile may still read
// the ring) and leaves no cp.async group in flight.
template <bool HOIST>
__device__ __forceinline__ void gtc_tile(float (&acc)[gtc::MT][2][4], GtcSmem& sm, const bf16* __restrict__ xr,
                                         int nr, const bf16* __restrict__ we, int n0, int n, int k, int k0, int k1) {
    using namespace gtc;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int mts = (nr + 15) / 16;  // m-tiles holding the rows
    const int ksteps = (k1 - k0 + BK - 1) / BK;
    // Stage kt of the range into ring slot st: BN weight rows and the mts·16 x rows;
    // sources past n, past nr or past k1 read nothing and write zeros.
    auto load = [&](int kt, int st) {
        const uint32_t wdst = smem_u32(sm.ws[st]), xdst = smem_u32(sm.xs[st]);
#pragma unroll
        for (int j = 0; j < BN * CHUNKS / THREADS; ++j) {
            const int i = tid + j * THREADS, row = i / CHUNKS, c = i % CHUNKS, kk = k0 + kt * BK + c * 8;
            const bool ok = n0 + row < n && kk < k1;
            const bf16* src = ok ? we + static_cast<size_t>(n0 + row) * k + kk : we;
            cp_async_16(wdst + 2 * gtc_at(row, c), src, ok ? 16 : 0);
        }
        for (int i = tid; i < mts * 16 * CHUNKS; i += THREADS) {
            const int row = i / CHUNKS, c = i % CHUNKS, kk = k0 + kt * BK + c * 8;
            const bool ok = row < nr && kk < k1;
            const bf16* src = ok ? xr + static_cast<size_t>(row) * k + kk : xr;
            cp_async_16(xdst + 2 * gtc_at(row, c), src, ok ? 16 : 0);
        }
    };
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[m][t][q] = 0.f;

    __syncthreads();  // the previous tile's last reads of the ring are done
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ksteps) load(s, s);
        cp_async_commit();  // one group per stage, empty or not, keeps the count uniform
    }
    for (int kt = 0; kt < ksteps; ++kt) {
        cp_async_wait<STAGES - 2>();  // group kt (stage kt) has landed for this thread
        __syncthreads();              // ... for every thread; slot (kt - 1) % STAGES is free
        if (kt + STAGES - 1 < ksteps) load(kt + STAGES - 1, (kt + STAGES - 1) % STAGES);
        cp_async_commit();
        const int st = kt % STAGES;
        const uint32_t wsb = smem_u32(sm.ws[st]), xsb = smem_u32(sm.xs[st]);
#pragma unroll
        for (int k16 = 0; k16 < BK / 16; ++k16) {
            // B: this warp's 16 columns (n-tiles 0, 1) × k16 — matrices (nt0 k0-7, nt0
            // k8-15, nt1 k0-7, nt1 k8-15) from lanes 0-7, 8-15, 16-23, 24-31.
            uint32_t b[4];
            {
                const int row = warp * 16 + (lane & 7) + (lane >> 4) * 8;
                const int c = k16 * 2 + ((lane >> 3) & 1);
                ldmatrix_x4(b, wsb + 2 * gtc_at(row, c));
            }
            // A: rows m·16 + 0-7 / 8-15 × k 0-7 / 8-15 in mma's a0..a3 order. HOIST loads
            // every m-tile holding rows before the mma (guards, not a break, so the loops
            // unroll and the loads overlap: linear_tc at 64 rows 10-18% faster); the
            // experts keep the loop that stops at the last m-tile (fewer registers, more
            // blocks per SM: their decode calls of ~8 rows per expert were 8% slower hoisted).
            // The mma sequence per output element is the same either way.
            if constexpr (HOIST) {
                uint32_t a[MT][4];
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    if (m < mts) {
                        const int row = m * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                        const int c = k16 * 2 + (lane >> 4);
                        ldmatrix_x4(a[m], xsb + 2 * gtc_at(row, c));
                    }
                }
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    if (m < mts) {
                        mma_bf16_16816(acc[m][0], a[m], b[0], b[1]);
                        mma_bf16_16816(acc[m][1], a[m], b[2], b[3]);
                    }
                }
            } else {
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    if (m >= mts) break;
                    uint32_t a[4];
                    const int row = m * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                    const int c = k16 * 2 + (lane >> 4);
                    ldmatrix_x4(a, xsb + 2 * gtc_at(row, c));
                    mma_bf16_16816(acc[m][0], a, b[0], b[1]);
                    mma_bf16_16816(acc[m][1], a, b[2], b[3]);
                }
            }
        }
    }
    cp_async_wait<0>();  // only empty groups can remain; drained before the ring is reused
}

// Rows [0, nr) of a tile's acc into rows base.. of y (`n` wide; columns ≥ n masked):
// acc[m][t] holds rows m·16 + lane/4 (q 0, 1) and + 8 (q 2, 3), columns n0 + warp·16 +
// t·8 + 2·(lane % 4) (+1).
template <typename T>
__device__ __forceinline__ void gtc_store_tile(const float (&acc)[gtc::MT][2][4], T* __restrict__ y, size_t base,
                                               int nr, int n0, int n) {
    using namespace gtc;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        if (m * 16 >= nr) break;
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            const int col = n0 + warp * 16 + t * 8 + 2 * (lane & 3);
            const int row = m * 16 + (lane >> 2);
            if (row < nr) gtc_store(y, base + row, col, n, acc[m][t][0], acc[m][t][1]);
            if (row + 8 < nr) gtc_store(y, base + row + 8, col, n, acc[m][t][2], acc[m][t][3]);
        }
    }
}

template <typename T>
__device__ void grouped_tc(T* __restrict__ y, const bf16* __restrict__ x, const bf16* const* __restrict__ w,
                           const int* __restrict__ experts, const int* __restrict__ off, int n, int k) {
    using namespace gtc;
    __shared__ __align__(128) GtcSmem sm;
    const int g = blockIdx.y, r0 = off[g], r1 = off[g + 1];
    if (r0 >= r1) return;  // the whole block: no row for this expert
    const int n0 = blockIdx.x * BN;
    const bf16* we = w[experts ? experts[g] : g];
    for (int base = r0; base < r1; base += ROWS) {
        const int nr = min(ROWS, r1 - base);  // real rows of this chunk
        float acc[MT][2][4];
        gtc_tile<false>(acc, sm, x + static_cast<size_t>(base) * k, nr, we, n0, n, k, 0, k);
        gtc_store_tile(acc, y, static_cast<size_t>(base), nr, n0, n);
    }
}

#define MOE_GROUPED_TC(NAME, T)                                                                                 \
    extern "C" __global__ void __launch_bounds__(gtc::THREADS) NAME(T* y, const bf16* x, const bf16* const* w, \
                                                                     const int* experts, const int* off, int n, \
                                                                     int k) {                                   \
        grouped_tc<T>(y, x, w, experts, off, n, k);                                                            \
    }
MOE_GROUPED_TC(moe_grouped_tc_bf16_obf16, bf16)
MOE_GROUPED_TC(moe_grouped_tc_bf16_of32, float)

// y (ksplit = gridDim.y == 1) or part[ks] (f32, [m][n] each) for this block's 64 rows,
// BN columns and k range.
template <typename T>
__device__ void linear_tc(T* __restrict__ y, float* __restrict__ part, const bf16* __restrict__ x,
                          const bf16* __restrict__ w, int m, int n, int k, int kchunk) {
    using namespace gtc;
    __shared__ __align__(128) GtcSmem sm;
    const int base = blockIdx.x * ROWS, ks = blockIdx.y, n0 = blockIdx.z * BN;
    const int nr = min(ROWS, m - base), k0 = ks * kchunk, k1 = min(k, k0 + kchunk);
    if (nr <= 0) return;
    float acc[MT][2][4];
    gtc_tile<true>(acc, sm, x + static_cast<size_t>(base) * k, nr, w, n0, n, k, k0, k1);
    if (gridDim.y == 1)
        gtc_store_tile(acc, y, static_cast<size_t>(base), nr, n0, n);
    else
        gtc_store_tile(acc, part + static_cast<size_t>(ks) * m * n, static_cast<size_t>(base), nr, n0, n);
}

// linear_tc's large tile, for calls of more than 64 rows: 128 rows × BN = 128 columns per
// block (linear_tc_big_*), 8 warps of 64 rows × 32 columns (a 256-column tile with warps of
// 64 × 64 measured no faster on one H200), the same 3-stage ring of BK = 64 in dynamic shared memory. Each warp
// loads all its A and B fragments of a k16 step, then runs its 4 × NT mma (16 or 32 per 6
// or 8 ldmatrix, against 8 per 5 in gtc_tile); rows past the end are zero-filled and
// computed, never stored. An output element still starts at zero and takes the mma of
// each k16 group from k0 up in the same order, so its bits equal linear_tc's: which kernel
// runs depends on the call's row count, a row's result does not.
namespace gtb {
constexpr int BM = 128, BK = gtc::BK, STAGES = 3, THREADS = 256, MT = 4;
constexpr int CHUNKS = BK / 8;
template <int BN>
constexpr int smem_bytes() {
    return STAGES * (BM + BN) * BK * 2;
}
}  // namespace gtb

template <typename T, int BN>
__device__ void linear_tc_big(T* __restrict__ y, float* __restrict__ part, const bf16* __restrict__ x,
                              const bf16* __restrict__ w, int m, int n, int k, int kchunk) {
    using namespace gtb;
    constexpr int WN = BN / 4, NT = WN / 8, STAGE = (BM + BN) * BK;  // warp columns, n-tiles
    extern __shared__ __align__(128) unsigned char gtb_smem[];
    const uint32_t sbase = smem_u32(gtb_smem);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp >> 2, wn = warp & 3;  // the warp's 64-row half and column quarter
    const int base = blockIdx.x * BM, ks = blockIdx.y, n0 = blockIdx.z * BN;
    const int nr = min(BM, m - base), k0 = ks * kchunk, k1 = min(k, k0 + kchunk);
    if (nr <= 0) return;
    const int ksteps = (k1 - k0 + BK - 1) / BK;
    const bf16* xr = x + static_cast<size_t>(base) * k;
    auto load = [&](int kt, int st) {
        const uint32_t wdst = sbase + 2 * st * STAGE, xdst = wdst + 2 * BN * BK;
#pragma unroll
        for (int j = 0; j < BN * CHUNKS / THREADS; ++j) {
            const int i = tid + j * THREADS, row = i / CHUNKS, c = i % CHUNKS, kk = k0 + kt * BK + c * 8;
            const bool ok = n0 + row < n && kk < k1;
            const bf16* src = ok ? w + static_cast<size_t>(n0 + row) * k + kk : w;
            cp_async_16(wdst + 2 * gtc_at(row, c), src, ok ? 16 : 0);
        }
#pragma unroll
        for (int j = 0; j < BM * CHUNKS / THREADS; ++j) {
            const int i = tid + j * THREADS, row = i / CHUNKS, c = i % CHUNKS, kk = k0 + kt * BK + c * 8;
            const bool ok = row < nr && kk < k1;
            const bf16* src = ok ? xr + static_cast<size_t>(row) * k + kk : xr;
            cp_async_16(xdst + 2 * gtc_at(row, c), src, ok ? 16 : 0);
        }
    };
    float acc[MT][NT][4];
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[a][t][q] = 0.f;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ksteps) load(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < ksteps; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (kt + STAGES - 1 < ksteps) load(kt + STAGES - 1, (kt + STAGES - 1) % STAGES);
        cp_async_commit();
        const uint32_t wsb = sbase + 2 * (kt % STAGES) * STAGE, xsb = wsb + 2 * BN * BK;
#pragma unroll
        for (int k16 = 0; k16 < BK / 16; ++k16) {
            // B: columns wn·WN + h·16 .. + 15 as in gtc_tile (n-tiles 2h, 2h + 1).
            uint32_t b[NT / 2][4], af[MT][4];
#pragma unroll
            for (int h = 0; h < NT / 2; ++h) {
                const int row = wn * WN + h * 16 + (lane & 7) + (lane >> 4) * 8;
                const int c = k16 * 2 + ((lane >> 3) & 1);
                ldmatrix_x4(b[h], wsb + 2 * gtc_at(row, c));
            }
#pragma unroll
            for (int a = 0; a < MT; ++a) {
                const int row = wm * 64 + a * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                const int c = k16 * 2 + (lane >> 4);
                ldmatrix_x4(af[a], xsb + 2 * gtc_at(row, c));
            }
#pragma unroll
            for (int a = 0; a < MT; ++a)
#pragma unroll
                for (int h = 0; h < NT / 2; ++h) {
                    mma_bf16_16816(acc[a][2 * h], af[a], b[h][0], b[h][1]);
                    mma_bf16_16816(acc[a][2 * h + 1], af[a], b[h][2], b[h][3]);
                }
        }
    }
    cp_async_wait<0>();
    float* p = gridDim.y > 1 ? part + static_cast<size_t>(ks) * m * n : nullptr;  // split-K partials
#pragma unroll
    for (int a = 0; a < MT; ++a) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const int col = n0 + wn * WN + t * 8 + 2 * (lane & 3);
            const int row = wm * 64 + a * 16 + (lane >> 2);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = row + 8 * half;
                if (r >= nr) continue;
                if (p)
                    gtc_store(p, base + r, col, n, acc[a][t][2 * half], acc[a][t][2 * half + 1]);
                else
                    gtc_store(y, base + r, col, n, acc[a][t][2 * half], acc[a][t][2 * half + 1]);
            }
        }
    }
}

// Hopper's warpgroup MMA pieces of linear_wgt_* and moe_grouped_wgt_* (sm_90a only):
// each consumer warpgroup runs wgmma m64nBNk16 on 64 rows × BN columns straight from
// shared memory ([row][64] tiles in wgmma's 128-byte-swizzle K-major layout, 1024-byte
// aligned). An output element starts at zero and takes the wgmma of each k16 group of
// its range from the range's start up, whatever the tile or the row's place in it (the
// same k16 order as linear_tc): the bits of a row depend on that row and the weight only.
//
// k ranges: grid.y = ksplit blocks each run range blockIdx.y and, with ksplit > 1, write
// an f32 partial that linear_tc_reduce sums in range order. With `seq` = 1 (grid.y = 1,
// for calls with rows enough to fill the chip) one block runs every range in turn into a
// fresh accumulator and folds it into the total as the reduce would: total = p0, then
// total += p1, += p2 ..., so both give the same bits and the partials never reach memory.
template <int BN>
struct WgAcc;
template <>
struct WgAcc<64> {
    static __device__ __forceinline__ void mma(float (&d)[32], uint64_t a, uint64_t b) { wgmma_m64n64k16_ss(d, a, b); }
};
template <>
struct WgAcc<128> {
    static __device__ __forceinline__ void mma(float (&d)[64], uint64_t a, uint64_t b) { wgmma_m64n128k16_ss(d, a, b); }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Rows [0, nr) of a tile into rows base.. of y (`n` wide; columns ≥ n masked), from the
// warpgroup whose 64 rows start at tile row `wrow`. Fragment j of v: columns n0 + 8·(j /
// 4) + 2·(lane % 4) (+1), row wrow + 16·warp + lane / 4 (+8 for j % 4 ≥ 2).
template <typename T, int BN>
__device__ __forceinline__ void wg_store(const float (&v)[BN / 2], T* __restrict__ y, size_t base, int nr, int n0,
                                         int n, int wrow) {
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int col = n0 + 8 * j + 2 * (lane & 3);
        const int row = wrow + warp * 16 + (lane >> 2);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = row + 8 * half;
            if (r < nr) gtc_store(y, base + r, col, n, v[4 * j + 2 * half], v[4 * j + 2 * half + 1]);
        }
    }
}
#endif

// linear_tc on the warpgroup MMA with TMA and warp specialisation (linear_wgt_*, sm_90a
// only): the same k ranges, `seq` folding and k16 order as linear_tc (so the same bits);
// the copies are the TMA unit's: warpgroup 0 (one thread) fills a 5-stage ring of
// [row][64] tiles (the tensor maps' 128-byte swizzle is wgmma's layout; rows past m or n
// and k past its end arrive as zeros) and signals each stage on its `full` barrier; the
// BM / 64 consumer warpgroups each run 64 rows × BN through wgmma and free a stage on its
// `empty` barrier once their wgmma on it has completed, one group kept in flight.
// Tensor maps: x [m][k] (box 64 × BM) and w [n][k] (box 64 × BN), bf16, as
// `const __grid_constant__` parameters.
template <typename T, int BM, int BN>
__device__ void linear_wgt(const CUtensorMap* tx, const CUtensorMap* tw, T* __restrict__ y, float* __restrict__ part,
                           int m, int n, int k, int kchunk, int seq) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BK = 64, STAGES = 5;  // the host's `wgt_smem`
    constexpr int NACC = BN / 2, TILE_W = BN * BK * 2, STAGE = (BM + BN) * BK * 2, CONSUMERS = BM / 64 * 128;
    extern __shared__ __align__(1024) unsigned char gwt_smem[];
    const uint32_t sbase = (smem_u32(gwt_smem) + 1023u) & ~1023u;
    const uint32_t full = sbase + STAGES * STAGE, empty = full + 8 * STAGES;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int base = blockIdx.x * BM, n0 = blockIdx.z * BN;
    const int nr = min(BM, m - base);
    if (nr <= 0) return;
    const int ranges = (k + kchunk - 1) / kchunk;
    const int r0 = seq ? 0 : blockIdx.y, r1 = seq ? ranges : blockIdx.y + 1;
    const int steps_per = kchunk / BK;
    const int total_steps = (min(k, r1 * kchunk) - r0 * kchunk + BK - 1) / BK;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, CONSUMERS);
        }
        fence_mbar_init();
    }
    __syncthreads();
    if (wg == 0) {  // the producer
        if (tid == 0) {
            for (int g = 0; g < total_steps; ++g) {
                const int st = g % STAGES;
                if (g >= STAGES) mbar_wait(empty + 8 * st, ((g / STAGES) - 1) & 1);
                const int kk = (r0 + g / steps_per) * kchunk + (g % steps_per) * BK;
                mbar_arrive_expect_tx(full + 8 * st, STAGE);
                tma_load_2d(sbase + st * STAGE, tw, kk, n0, full + 8 * st);
                tma_load_2d(sbase + st * STAGE + TILE_W, tx, kk, base, full + 8 * st);
            }
        }
        return;
    }
    const int cw = wg - 1;  // consumer warpgroup: rows 64·cw ..
    float acc[NACC], tot[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = tot[i] = 0.f;
    bool prev_free = true;  // step g - 1's stage already handed back
    for (int g = 0; g < total_steps; ++g) {
        const int st = g % STAGES;
        mbar_wait(full + 8 * st, (g / STAGES) & 1);
        const uint32_t ws = sbase + st * STAGE;
        const uint64_t da = gmma_desc_sw128(ws + TILE_W + cw * 64 * BK * 2, 16, 1024), db = gmma_desc_sw128(ws, 16, 1024);
        wgmma_fence();
#pragma unroll
        for (int k16 = 0; k16 < BK / 16; ++k16) WgAcc<BN>::mma(acc, gmma_desc_add(da, k16 * 32), gmma_desc_add(db, k16 * 32));
        wgmma_commit();
        const int prev = (g + STAGES - 1) % STAGES;
        if (seq && ((g + 1) % steps_per == 0 || g + 1 == total_steps)) {
            wgmma_wait<0>();
            fence_operands(acc);
            if (!prev_free) mbar_arrive(empty + 8 * prev);
            mbar_arrive(empty + 8 * st);
            prev_free = true;
            const bool first = g + 1 <= steps_per;
#pragma unroll
            for (int i = 0; i < NACC; ++i) {
                tot[i] = first ? acc[i] : tot[i] + acc[i];
                acc[i] = 0.f;
            }
        } else {
            wgmma_wait<1>();  // step g - 1's wgmma has completed: its stage is free
            if (!prev_free) mbar_arrive(empty + 8 * prev);
            prev_free = false;
        }
    }
    wgmma_wait<0>();
    fence_operands(acc);
    if (seq)
        wg_store<T, BN>(tot, y, base, nr, n0, n, 64 * cw);
    else if (gridDim.y > 1)
        wg_store<float, BN>(acc, part + static_cast<size_t>(blockIdx.y) * m * n, base, nr, n0, n, 64 * cw);
    else
        wg_store<T, BN>(acc, y, base, nr, n0, n, 64 * cw);
#else
    __trap();
#endif
}

// The MoE experts with TMA and warp specialisation (moe_grouped_wgt_*, sm_90a only).
// grid = (ceil(n / 128), experts); a block owns 128 columns of its expert's weight and
// takes the expert's rows up to 192 at a time (a "pass"), so an expert with ≤ 192 rows
// reads its weight slice once (the slices of the resident blocks are far larger than
// L2, so a re-read per 64 rows would come from HBM). Warpgroup 0 (one thread) fills
// a 5-stage ring: per 64 of k, the W tile [128][64] and one [64][64] tile of x per
// 64-row chunk that holds rows of the pass (rows past the expert's end are the next
// expert's, or zeros past the last row: never stored); consumer warpgroup cw runs
// wgmma m64n64k16 for its 64 columns (64·cw ..) over every such chunk, so both
// consumers work even when the expert has ≤ 64 rows. A row's sum is the wgmma of each
// k16 group from k = 0 up, as in moe_grouped_tc, so the two give the same bits (the
// experts test asserts it).
// Tensor maps: x [rows][k] (box 64 × 64) as a parameter; each expert's W [n][k] (box
// 64 × 128) in global memory, 128 bytes each (`wmaps`, indexed like `w`). Dynamic shared
// memory: 1024 bytes of alignment slack, STAGES · STAGE, 16 · STAGES of barriers (the
// host's GROUPED_WGT_SMEM).
namespace gwt {
constexpr int BN = 128, BK = 64, CH = 3, STAGES = 5, CONSUMERS = 2;
constexpr int TILE_W = BN * BK * 2, TILE_X = 64 * BK * 2, STAGE = TILE_W + CH * TILE_X;  // bytes
}  // namespace gwt

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// One pass of a consumer warpgroup of grouped_wgt: NCH chunks of 64 rows from row `base`
// (rows < r1 stored) times its 64 columns, over the ring's steps step0 .. step0 + ksteps.
template <typename T, int NCH>
__device__ __forceinline__ void gwt_pass(uint32_t sbase, uint32_t full, uint32_t empty, int step0, int ksteps, int cw,
                                         T* __restrict__ y, int base, int r1, int n0, int n) {
    using namespace gwt;
    float acc[NCH][32];
#pragma unroll
    for (int c = 0; c < NCH; ++c)
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[c][i] = 0.f;
    bool prev_free = true;  // the previous step's stage already handed back
    for (int kt = 0; kt < ksteps; ++kt) {
        const int step = step0 + kt, st = step % STAGES;
        mbar_wait(full + 8 * st, (step / STAGES) & 1);
        const uint32_t ws = sbase + st * STAGE;
        const uint64_t db = gmma_desc_sw128(ws + cw * 64 * BK * 2, 16, 1024);
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < NCH; ++c) {
            const uint64_t da = gmma_desc_sw128(ws + TILE_W + c * TILE_X, 16, 1024);
#pragma unroll
            for (int k16 = 0; k16 < BK / 16; ++k16)
                wgmma_m64n64k16_ss(acc[c], gmma_desc_add(da, k16 * 32), gmma_desc_add(db, k16 * 32));
        }
        wgmma_commit();
        const int prev = (step + STAGES - 1) % STAGES;
        if (kt + 1 == ksteps) {  // the pass's last step: wait for all, free both stages
            wgmma_wait<0>();
            if (!prev_free) mbar_arrive(empty + 8 * prev);
            mbar_arrive(empty + 8 * st);
        } else {
            wgmma_wait<1>();  // the previous step's wgmma has completed: its stage is free
            if (!prev_free) mbar_arrive(empty + 8 * prev);
            prev_free = false;
        }
    }
    wgmma_wait<0>();  // nothing in flight; unconditional, so ptxas needs no wait of its own
#pragma unroll
    for (int c = 0; c < NCH; ++c) {
        fence_operands(acc[c]);
        wg_store<T, 64>(acc[c], y, base + 64 * c, min(64, r1 - base - 64 * c), n0 + 64 * cw, n, 0);
    }
}
#endif

template <typename T>
__device__ void grouped_wgt(const CUtensorMap* tx, const CUtensorMap* __restrict__ wmaps, T* __restrict__ y,
                            const int* __restrict__ experts, const int* __restrict__ off, int n, int k) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace gwt;
    extern __shared__ __align__(1024) unsigned char gwt_smem[];
    const uint32_t sbase = (smem_u32(gwt_smem) + 1023u) & ~1023u;
    const uint32_t full = sbase + STAGES * STAGE, empty = full + 8 * STAGES;
    const int g = blockIdx.y, r0 = off[g], r1 = off[g + 1];
    if (r0 >= r1) return;  // the whole block: no row for this expert
    const int tid = threadIdx.x, wg = tid >> 7, n0 = blockIdx.x * BN;
    const int ksteps = (k + BK - 1) / BK, passes = (r1 - r0 + 64 * CH - 1) / (64 * CH);
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, CONSUMERS * 128);
        }
        fence_mbar_init();
    }
    __syncthreads();
    if (wg == 0) {  // the producer
        if (tid == 0) {
            const CUtensorMap* tw = wmaps + (experts ? experts[g] : g);
            // The maps were written by a host copy; order that write before the TMA
            // unit's reads of them.
            asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(tw) : "memory");
            int step = 0;
            for (int p = 0; p < passes; ++p) {
                const int base = r0 + p * 64 * CH, nch = min(CH, (r1 - base + 63) / 64);
                for (int kt = 0; kt < ksteps; ++kt, ++step) {
                    const int st = step % STAGES;
                    if (step >= STAGES) mbar_wait(empty + 8 * st, ((step / STAGES) - 1) & 1);
                    const uint32_t dst = sbase + st * STAGE;
                    mbar_arrive_expect_tx(full + 8 * st, TILE_W + nch * TILE_X);
                    tma_load_2d(dst, tw, kt * BK, n0, full + 8 * st);
                    for (int c = 0; c < nch; ++c)
                        tma_load_2d(dst + TILE_W + c * TILE_X, tx, kt * BK, base + 64 * c, full + 8 * st);
                }
            }
        }
        return;
    }
    const int cw = wg - 1;  // consumer warpgroup: columns n0 + 64·cw ..
    int step = 0;
    for (int p = 0; p < passes; ++p) {
        const int base = r0 + p * 64 * CH, nch = min(CH, (r1 - base + 63) / 64);
        // One instance per chunk count: a wgmma under a data-dependent branch inside the
        // k loop makes ptxas serialise every wgmma of the kernel.
        switch (nch) {
            case 1: gwt_pass<T, 1>(sbase, full, empty, step, ksteps, cw, y, base, r1, n0, n); break;
            case 2: gwt_pass<T, 2>(sbase, full, empty, step, ksteps, cw, y, base, r1, n0, n); break;
            default: gwt_pass<T, 3>(sbase, full, empty, step, ksteps, cw, y, base, r1, n0, n); break;
        }
        step += ksteps;
    }
#else
    __trap();
#endif
}

#define LINEAR_TC(NAME, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(gtc::THREADS)                                             \
        NAME(T* y, float* part, const bf16* x, const bf16* w, int m, int n, int k, int kchunk) {           \
        linear_tc<T>(y, part, x, w, m, n, k, kchunk);                                                       \
    }
LINEAR_TC(linear_tc_bf16_obf16, bf16)
LINEAR_TC(linear_tc_bf16_of32, float)

#define LINEAR_TC_BIG(NAME, T, BN)                                                                           \
    extern "C" __global__ void __launch_bounds__(gtb::THREADS)                                             \
        NAME(T* y, float* part, const bf16* x, const bf16* w, int m, int n, int k, int kchunk) {           \
        linear_tc_big<T, BN>(y, part, x, w, m, n, k, kchunk);                                               \
    }
LINEAR_TC_BIG(linear_tc_big_bf16_obf16, bf16, 128)
LINEAR_TC_BIG(linear_tc_big_bf16_of32, float, 128)

#define MOE_GROUPED_WGT(NAME, T)                                                                            \
    extern "C" __global__ void __launch_bounds__(128 + gwt::CONSUMERS * 128, 1)                              \
        NAME(const __grid_constant__ CUtensorMap tx, const CUtensorMap* wmaps, T* y, const int* experts,     \
             const int* off, int n, int k) {                                                                 \
        grouped_wgt<T>(&tx, wmaps, y, experts, off, n, k);                                                   \
    }
MOE_GROUPED_WGT(moe_grouped_wgt_bf16_obf16, bf16)
MOE_GROUPED_WGT(moe_grouped_wgt_bf16_of32, float)

#define LINEAR_WGT(NAME, T, BM, BN)                                                                                \
    extern "C" __global__ void __launch_bounds__(128 + BM / 64 * 128, 1)                                         \
        NAME(const __grid_constant__ CUtensorMap tx, const __grid_constant__ CUtensorMap tw, T* y, float* part, \
             int m, int n, int k, int kchunk, int seq) {                                                        \
        linear_wgt<T, BM, BN>(&tx, &tw, y, part, m, n, k, kchunk, seq);                                          \
    }
LINEAR_WGT(linear_wgt64_bf16_obf16, bf16, 64, 128)
LINEAR_WGT(linear_wgt64_bf16_of32, float, 64, 128)
LINEAR_WGT(linear_wgt128_bf16_obf16, bf16, 128, 128)
LINEAR_WGT(linear_wgt128_bf16_of32, float, 128, 128)

// y[i] = part[0][i] + part[1][i] + ... + part[ksplit - 1][i] in that order, for i < len
// (= m·n); four elements per thread.
template <typename T>
__device__ void linear_tc_reduce(T* __restrict__ y, const float* __restrict__ part, size_t len, int ksplit) {
    const size_t i = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
    if (i >= len) return;
    if (i + 4 <= len && len % 4 == 0) {
        float4 s = *reinterpret_cast<const float4*>(part + i);
        for (int ks = 1; ks < ksplit; ++ks) {
            const float4 v = *reinterpret_cast<const float4*>(part + ks * len + i);
            s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
        }
        store2(y + i, s.x, s.y);
        store2(y + i + 2, s.z, s.w);
    } else {
        for (size_t j = i; j < min(len, i + 4); ++j) {
            float s = part[j];
            for (int ks = 1; ks < ksplit; ++ks) s += part[ks * len + j];
            y[j] = from_f32<T>(s);
        }
    }
}
extern "C" __global__ void linear_tc_reduce_obf16(bf16* y, const float* part, size_t len, int ksplit) {
    linear_tc_reduce(y, part, len, ksplit);
}
extern "C" __global__ void linear_tc_reduce_of32(float* y, const float* part, size_t len, int ksplit) {
    linear_tc_reduce(y, part, len, ksplit);
}
