// The MoE experts as one launch on tensor cores (fast mode): rows [off[g], off[g + 1]) of
// x (sorted by expert, `k` wide, bf16) times the weight of expert experts[g] (w[experts[g]],
// `[n][k]` bf16; expert g when `experts` is null) into the same rows of y (`n` wide, bf16
// or f32), as `moe_grouped_*` in backend_ops.cu computes it but with mma.sync m16n8k16
// (bf16 in, f32 accumulate). The sum order differs from `linear_inv`'s, so this path is
// for GemmMode::Cublas only; the batch-invariant mode keeps the CUDA-core kernels.
//
// grid = (ceil(n / BN), experts), 128 threads (4 warps). A block owns BN = 64 output
// columns of one expert and takes the expert's rows ROWS = 64 at a time (4 m-tiles of 16;
// rows past the expert's end are zero-filled in shared memory and never stored): per
// 64-row chunk it streams the weight slice [BN][k] once through a 3-stage cp.async ring
// (BK = 64 of k per stage), with the chunk's x rows beside it, and every warp runs its 16
// columns (2 n-tiles) over all the chunk's m-tiles. An expert with ≤ 64 rows (decode: ~8)
// reads each weight element once; longer experts (prefill) re-read the slice per chunk.
// Shared tiles are [row][64] bf16 (128 B rows) with the 16-byte chunk index XOR (row & 7),
// so ldmatrix's 8 row addresses hit 8 different bank groups. Needs k % 8 == 0 (16-byte
// rows) and 16-byte aligned x and weights; k past the end is zero-filled.
#include "common.cuh"

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

template <typename T>
__device__ void grouped_tc(T* __restrict__ y, const bf16* __restrict__ x, const bf16* const* __restrict__ w,
                           const int* __restrict__ experts, const int* __restrict__ off, int n, int k) {
    using namespace gtc;
    __shared__ __align__(128) bf16 ws[STAGES][BN * BK];
    __shared__ __align__(128) bf16 xs[STAGES][ROWS * BK];
    const int g = blockIdx.y, r0 = off[g], r1 = off[g + 1];
    if (r0 >= r1) return;  // the whole block: no row for this expert
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int n0 = blockIdx.x * BN;
    const bf16* we = w[experts ? experts[g] : g];
    const int ksteps = (k + BK - 1) / BK;

    for (int base = r0; base < r1; base += ROWS) {
        const int nr = min(ROWS, r1 - base);  // real rows of this chunk
        const int mts = (nr + 15) / 16;       // m-tiles holding them
        // Stage kt of k into ring slot st: BN weight rows and the chunk's mts·16 x rows;
        // sources past n, past the chunk's rows or past k read nothing and write zeros.
        auto load = [&](int kt, int st) {
            const uint32_t wdst = smem_u32(ws[st]), xdst = smem_u32(xs[st]);
#pragma unroll
            for (int j = 0; j < BN * CHUNKS / THREADS; ++j) {
                const int i = tid + j * THREADS, row = i / CHUNKS, c = i % CHUNKS, kk = kt * BK + c * 8;
                const bool ok = n0 + row < n && kk < k;
                const bf16* src = ok ? we + static_cast<size_t>(n0 + row) * k + kk : we;
                cp_async_16(wdst + 2 * gtc_at(row, c), src, ok ? 16 : 0);
            }
            for (int i = tid; i < mts * 16 * CHUNKS; i += THREADS) {
                const int row = i / CHUNKS, c = i % CHUNKS, kk = kt * BK + c * 8;
                const bool ok = row < nr && kk < k;
                const bf16* src = ok ? x + static_cast<size_t>(base + row) * k + kk : x;
                cp_async_16(xdst + 2 * gtc_at(row, c), src, ok ? 16 : 0);
            }
        };
        float acc[MT][2][4];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int t = 0; t < 2; ++t)
#pragma unroll
                for (int q = 0; q < 4; ++q) acc[m][t][q] = 0.f;

        __syncthreads();  // the previous chunk's last reads of the ring are done
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
            const uint32_t wsb = smem_u32(ws[st]), xsb = smem_u32(xs[st]);
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
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    if (m >= mts) break;
                    // A: rows m·16 + 0-7 / 8-15 × k 0-7 / 8-15 in mma's a0..a3 order.
                    uint32_t a[4];
                    const int row = m * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                    const int c = k16 * 2 + (lane >> 4);
                    ldmatrix_x4(a, xsb + 2 * gtc_at(row, c));
                    mma_bf16_16816(acc[m][0], a, b[0], b[1]);
                    mma_bf16_16816(acc[m][1], a, b[2], b[3]);
                }
            }
        }
        cp_async_wait<0>();  // only empty groups can remain; drained before the ring is reused

        // acc[m][t]: rows m·16 + lane/4 (q 0, 1) and + 8 (q 2, 3), columns
        // n0 + warp·16 + t·8 + 2·(lane % 4) (+1); rows ≥ nr are padding, columns ≥ n masked.
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            if (m >= mts) break;
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                const int col = n0 + warp * 16 + t * 8 + 2 * (lane & 3);
                const int row = m * 16 + (lane >> 2);
                if (row < nr) gtc_store(y, static_cast<size_t>(base + row), col, n, acc[m][t][0], acc[m][t][1]);
                if (row + 8 < nr)
                    gtc_store(y, static_cast<size_t>(base + row + 8), col, n, acc[m][t][2], acc[m][t][3]);
            }
        }
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
