// The MoE router's logits in f32 (`mlaserve_cuda::router`): the tiled CUDA-core GEMM the
// backend runs (router_f32_tile16 / 32 / 64 and router_reduce_f32) and the first router
// kernel (linear_f32_of32), kept as the timing baseline. What they compute and in which
// order is described at each.
#include "common.cuh"

// The MoE router's first kernel (x and w f32, one warp per output, lanes stride k, the
// warp tree): batch-invariant but reads a row of x and of w per output. Kept as the
// baseline of the router's timing test (Router::logits_warp); the backend runs the
// tiled router_f32_tile* below.
extern "C" __global__ void __launch_bounds__(256)
    linear_f32_of32(float* __restrict__ y, const float* __restrict__ x, const float* __restrict__ w, int m, int n,
                    int k) {
    const int col = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (col >= n) return;
    const float* wr = w + static_cast<size_t>(col) * k;
    for (int row = blockIdx.y * 4; row < min(m, static_cast<int>(blockIdx.y) * 4 + 4); ++row) {
        const float* xr = x + static_cast<size_t>(row) * k;
        float d = 0.f;
        for (int i = lane; i < k; i += 32) d += xr[i] * wr[i];
        d = warp_sum(d);
        if (lane == 0) y[static_cast<size_t>(row) * n + col] = d;
    }
}
// The MoE router's logits y[m][n] = x[m][:] · w[n][:] in f32 (x [m][k], w [n][k], both f32;
// DeepSeek: n = 256 experts, k = 7168), on CUDA cores: the choice of experts is discrete,
// so the logits get no bf16 or TF32 rounding. A tiled GEMM with k split into `kchunk`-wide
// ranges; grid = (row tiles, column tiles, k ranges), 256 threads, a 16 × 16 grid of
// threads. Block (i, j, z) owns rows [i·BM, i·BM + BM) × columns [j·BN, j·BN + BN) over k
// range z = [z·kchunk, min(k, z·kchunk + kchunk)): it streams BK-wide k tiles of those x
// and w rows through a STAGES-deep cp.async ring in shared memory (rows k-contiguous as in
// global memory, padded by 4 floats: a thread's float4 reads of rows tx, tx + 16, ...
// fall in distinct bank groups), and each thread keeps TM × TN outputs, rows ty + 16·a and
// columns tx + 16·b (a < TM, b < TN), in registers.
//
// The fixed order: every output's partial p_z is one FMA chain from +0 over its k range in
// increasing k, acc = fma(x[r][kk], w[c][kk], acc), nothing else (no zero-filled padding
// enters it: a short last tile runs a guarded loop); with more than one range the
// partials go to `out` = part[z][m][n] and router_reduce_f32 adds them in range order,
// y = ((p_0 + p_1) + p_2) + ...; with one range the kernel writes y = p_0. `kchunk`
// comes from the weight's shape and the SM count only (plan::router_split), and the tile
// shape decides neither the ranges nor the order within a chain, so y[r][c] depends on
// row r of x and on w alone: not on m, on where the row sits in its tile, or on which of
// the entry points ran (router_f32_tile16 for a few rows, router_f32_tile32 for tens,
// router_f32_tile64 for many), and it equals the same sum on the CPU with f32 fused multiply-adds bit for bit.
// Needs kchunk % 4 == 0 (plan::router_split gives multiples of 64, both entry points' k
// tiles, so only the last range can end in a short tile); any m, n, k (k % 4 != 0 loads
// 4-byte words; rows and columns past m and n are zero-filled and never stored).
namespace router {
constexpr int TX = 16, TY = 16, THREADS = TX * TY;

// 4-byte asynchronous global->shared copy; `src_bytes` 0 writes a zero and reads nothing.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// k tile [kt, kt + BK) ∩ [.., kend) of x rows r0.. (BM of them) and w rows c0.. (BN) into
// stage `st` ([BM + BN][BK + 4]); zeros where the row or k is out of range.
template <int BM, int BN, int BK>
__device__ __forceinline__ void load_tile(float* st, const float* __restrict__ x, const float* __restrict__ w, int m,
                                          int n, int k, int r0, int c0, int kt, int kend) {
    constexpr int LD = BK + 4, C4 = BK / 4;
    for (int s = threadIdx.x; s < (BM + BN) * C4; s += THREADS) {
        const int row = s / C4, kk = kt + (s % C4) * 4;
        const bool is_x = row < BM;
        const int g = is_x ? r0 + row : c0 + row - BM;  // row of x or of w
        const bool in = g < (is_x ? m : n);
        const float* src = (is_x ? x : w) + static_cast<size_t>(in ? g : 0) * k;
        const uint32_t dst = smem_u32(st + row * LD + (s % C4) * 4);
        if (k % 4 == 0) {  // 16-byte rows: kk and kend are multiples of 4
            const bool ok = in && kk < kend;
            cp_async_16(dst, ok ? src + kk : x, ok ? 16 : 0);
        } else {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const bool ok = in && kk + q < kend;
                cp_async_4(dst + 4 * q, ok ? src + kk + q : x, ok ? 4 : 0);
            }
        }
    }
}

template <int BM, int BN, int TM, int TN, int BK, int STAGES>
__device__ __forceinline__ void gemm(float* __restrict__ out, const float* __restrict__ x, const float* __restrict__ w,
                                     int m, int n, int k, int kchunk) {
    static_assert(BM == TM * TY && BN == TN * TX && BK % 4 == 0 && STAGES >= 2, "tile shape");
    constexpr int LD = BK + 4, STAGE = (BM + BN) * LD;
    __shared__ __align__(16) float sm[STAGES * STAGE];
    const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
    const int r0 = blockIdx.x * BM, c0 = blockIdx.y * BN;
    const int kbeg = blockIdx.z * kchunk, kend = min(k, kbeg + kchunk);
    const int steps = kend > kbeg ? (kend - kbeg + BK - 1) / BK : 0;
    // Threads whose rows all lie past m skip the arithmetic (decode: all but row 0's);
    // they still load and meet every barrier.
    const bool live = r0 + ty < m;
    float acc[TM][TN];
#pragma unroll
    for (int a = 0; a < TM; ++a)
#pragma unroll
        for (int b = 0; b < TN; ++b) acc[a][b] = 0.f;

#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) {
        if (p < steps) load_tile<BM, BN, BK>(sm + p * STAGE, x, w, m, n, k, r0, c0, kbeg + p * BK, kend);
        cp_async_commit();  // one group per tile, empty or not: the wait below counts groups
    }
    for (int t = 0; t < steps; ++t) {
        cp_async_wait<STAGES - 2>();  // tile t has landed (this thread's copies) ...
        __syncthreads();              // ... everyone's, and everyone is done with tile t - 1
        const int p = t + STAGES - 1;  // refill the stage tile t - 1 used
        if (p < steps) load_tile<BM, BN, BK>(sm + (p % STAGES) * STAGE, x, w, m, n, k, r0, c0, kbeg + p * BK, kend);
        cp_async_commit();
        if (!live) continue;
        const float* as = sm + (t % STAGES) * STAGE + ty * LD;         // row ty + 16a: as + a·16·LD
        const float* bs = sm + (t % STAGES) * STAGE + (BM + tx) * LD;  // column tx + 16b
        const int kv = min(BK, kend - (kbeg + t * BK));
        if (kv == BK) {
#pragma unroll
            for (int kk = 0; kk < BK; kk += 4) {
                float4 av[TM], bv[TN];
#pragma unroll
                for (int a = 0; a < TM; ++a) av[a] = *reinterpret_cast<const float4*>(as + a * TY * LD + kk);
#pragma unroll
                for (int b = 0; b < TN; ++b) bv[b] = *reinterpret_cast<const float4*>(bs + b * TX * LD + kk);
#pragma unroll
                for (int a = 0; a < TM; ++a)
#pragma unroll
                    for (int b = 0; b < TN; ++b) {
                        // k = kk, kk + 1, kk + 2, kk + 3, in that order
                        acc[a][b] = __fmaf_rn(av[a].x, bv[b].x, acc[a][b]);
                        acc[a][b] = __fmaf_rn(av[a].y, bv[b].y, acc[a][b]);
                        acc[a][b] = __fmaf_rn(av[a].z, bv[b].z, acc[a][b]);
                        acc[a][b] = __fmaf_rn(av[a].w, bv[b].w, acc[a][b]);
                    }
            }
        } else {  // a range's short last tile: only its kv real columns of k
            for (int kk = 0; kk < kv; ++kk)
#pragma unroll
                for (int a = 0; a < TM; ++a)
#pragma unroll
                    for (int b = 0; b < TN; ++b)
                        acc[a][b] = __fmaf_rn(as[a * TY * LD + kk], bs[b * TX * LD + kk], acc[a][b]);
        }
    }

    float* o = out + static_cast<size_t>(blockIdx.z) * m * n;  // this range's partial (y when one range)
#pragma unroll
    for (int a = 0; a < TM; ++a) {
        const int row = r0 + ty + a * TY;
        if (row >= m) break;
#pragma unroll
        for (int b = 0; b < TN; ++b) {
            const int col = c0 + tx + b * TX;
            if (col < n) o[static_cast<size_t>(row) * n + col] = acc[a][b];
        }
    }
}
}  // namespace router

// A few rows (decode): 16 × 16 outputs, one per thread, 64-wide k tiles 4 deep (three in
// flight while one is summed: the weight stream is what bounds these calls).
extern "C" __global__ void __launch_bounds__(256)
    router_f32_tile16(float* __restrict__ out, const float* __restrict__ x, const float* __restrict__ w, int m, int n,
                      int k, int kchunk) {
    router::gemm<16, 16, 1, 1, 64, 4>(out, x, w, m, n, k, kchunk);
}
// Tens of rows (a decode step of a large batch): 32 × 32 outputs, 2 × 2 per thread,
// 32-wide k tiles 4 deep: four times the blocks of the 64 × 64 tile, three tiles in flight.
extern "C" __global__ void __launch_bounds__(256)
    router_f32_tile32(float* __restrict__ out, const float* __restrict__ x, const float* __restrict__ w, int m, int n,
                      int k, int kchunk) {
    router::gemm<32, 32, 2, 2, 32, 4>(out, x, w, m, n, k, kchunk);
}
// Many rows (prefill): 64 × 64 outputs, 4 × 4 per thread (8 float4 shared loads per 64
// FMAs), 32-wide k tiles double-buffered; several blocks per SM hide the loads.
extern "C" __global__ void __launch_bounds__(256)
    router_f32_tile64(float* __restrict__ out, const float* __restrict__ x, const float* __restrict__ w, int m, int n,
                      int k, int kchunk) {
    router::gemm<64, 64, 4, 4, 32, 2>(out, x, w, m, n, k, kchunk);
}
// y[i] = ((part[0][i] + part[1][i]) + part[2][i]) + ... over `ksplit` partials of `len`
// elements each (router_f32_tile*'s k ranges, summed in range order). grid = ceil(len / 256).
extern "C" __global__ void __launch_bounds__(256)
    router_reduce_f32(float* __restrict__ y, const float* __restrict__ part, size_t len, int ksplit) {
    const size_t i = static_cast<size_t>(blockIdx.x) * 256 + threadIdx.x;
    if (i >= len) return;
    float v = part[i];
#pragma unroll 4
    for (int z = 1; z < ksplit; ++z) v = __fadd_rn(v, part[z * len + i]);
    y[i] = v;
}
