// FP8 (e4m3) projections with DeepSeek's 128 × 128 block scales: y = x Wᵀ where the
// weight W [n][k] is e4m3 with f32 scales ws [ceil(n / 128)][k / 128] (w = q · s per
// 128 × 128 block) and the activation x [m][k] is quantised per row and 128 channels
// (act_quant_*: s = amax / 448, q = e4m3(x / s) round-to-nearest-even, saturating).
//
//   y[r][c] = Σ_kb ( Σ_{k in kb} qx[r][k] · qw[c][k] ) · (sx[r][kb] · sw[c / 128][kb])
//
// Every kernel sums each 128-wide k block in a fresh f32 accumulator on the tensor cores
// and then promotes it: tot = fma(acc, sx · sw, tot), kb ascending (Hopper's fp8
// accumulator alone keeps too few bits for a whole row). k must be a multiple of 128.
//
// - act_quant_{bf16,f32}: one warp per (row, 128-group), 4 channels per lane; x's rows
//   may be narrower than k (zeros beyond, for weights padded to whole groups).
// - fp8_stream_*: the weight-streaming GEMM (decode, m ≤ 64 per block; every GPU with
//   fp8 mma.sync and TMA, so also the generic path at any m). grid = (ceil(n / 128),
//   ksplit, ceil(m / 64)), 256 threads: thread 0 keeps a ring of stages in flight by
//   TMA (two k blocks of the block's 128 weight rows, one scale row, and of its 16·MT
//   activation rows), one block barrier per stage frees a slot; warp w multiplies
//   weight rows 16w .. 16w + 15 with mma.sync m16n8k32 e4m3 over a permuted k: lane (g =
//   lane / 4, t = lane % 4) takes one 16-byte chunk of each half of each of its rows, its
//   first 8 bytes as one mma's k 4t..4t+3 and 16+4t.., its last 8 as the next mma's; the
//   same permutation on both operands leaves the dot product unchanged. The k range of
//   block (.., ks, ..) is [ks · kchunk, (ks + 1) · kchunk); ksplit and kchunk come from
//   the weight's shape (fp8_plan.rs), and a row's mma/promotion sequence and the
//   partials' sum order are the same wherever it sits and whatever MT is, so a row's
//   bits do not depend on the other rows of the call (batch invariance). The fp8
//   mma.sync accumulates in full f32 (the checks measure ~1e-7 relative error).
// - fp8_stream_wg*: the same streaming GEMM on Hopper's wgmma, operands swapped (64
//   weight rows as A, the batch's 16/32/64 rows as B; described below); the fp8 path
//   the engine can select as batch-invariant on Hopper. Launched with a cluster of the
//   ksplit blocks of a column tile (cuLaunchKernelEx), it sums the split in distributed
//   shared memory instead of global partials, in the same order (f8g_cluster_reduce).
// - fp8_gemm_wg_*: Hopper (sm_90a) for many rows: a producer warpgroup's one thread
//   fills a 6-stage ring of 128 × 128-byte tiles of x and W by TMA (the maps' 128-byte
//   swizzle is wgmma's K-major layout); two consumer warpgroups each run 64 rows × 128
//   columns as 4 wgmma m64n128k32 e4m3 per k block, wait for them, hand the stage back
//   and promote. wgmma's fp8 accumulator keeps fewer bits than f32 (the checks measure
//   up to ~2.5e-4 relative L2 against the f64 reference), so the wgmma kernels are not
//   bit-identical to fp8_stream.
// - fp8_gemm_wide_*: the same sums over 128 × 256 tiles, persistent (fp8_tile.cuh); the
//   plan picks it where its fewer, larger tiles still fill the SMs (fp8_plan.rs).

#include "fp8_tile.cuh"

extern "C" __global__ void __launch_bounds__(256)
    act_quant_bf16(const bf16* x, uint8_t* q, float* s, int m, int k, int kx) {
    act_quant(x, q, s, m, k, kx);
}
extern "C" __global__ void __launch_bounds__(256)
    act_quant_f32(const float* x, uint8_t* q, float* s, int m, int k, int kx) {
    act_quant(x, q, s, m, k, kx);
}

// SiLU-and-multiply fused with the next fp8 GEMM's activation quantisation: for row r and
// channel c < d, v = bf16(silu(gate) · up) with gate at in[r·2dp + c] and up at
// in[r·2dp + dp + c] (silu_mul_bf16's value, rounded as it stores it), channels d .. k
// zero; then act_quant's codes q [m][k] and scales s [m][k / 128] of v: the bytes
// silu_mul_bf16 followed by act_quant_bf16 write. One warp per (row, group), as
// act_quant. Needs d and dp multiples of 4.
extern "C" __global__ void __launch_bounds__(256)
    silu_mul_quant(const bf16* in, uint8_t* q, float* s, int m, int k, int d, int dp) {
    QuantSlot t;
    if (!quant_slot(m, k, t)) return;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (t.ch < d) {
        float gv[4], uv[4];
        load4(in + t.row * 2 * dp + t.ch, gv);
        load4(in + t.row * 2 * dp + dp + t.ch, uv);
#pragma unroll
        for (int i = 0; i < 4; ++i)
            v[i] = __bfloat162float(__float2bfloat16_rn(gv[i] / (1.f + __expf(-gv[i])) * uv[i]));
    }
    quant_group(v, q, t.row * k + t.ch, s + t.row * t.groups + t.g, t.lane);
}

// RMSNorm fused with the activation quantisation of the fp8 GEMM that reads its output:
// row r of x (f32, row stride x_stride, `dim` wide), v = bf16(x / rms(x) · w)
// (rmsnorm_f32_obf16's value, rounded as it stores it), channels dim .. k zero, into
// act_quant's codes q [rows][k] and scales s [rows][k / 128]. The sum of squares runs as
// rmsnorm_rows' 16-byte path does (the same per-thread order over 256 threads and the
// same block reduction), so the bytes are those of rmsnorm_f32_obf16 then
// act_quant_bf16. grid = rows, 256 threads; warp w quantises groups w, w + 8, ... Needs
// dim and x_stride multiples of 4 (16-byte rows of x and w).
extern "C" __global__ void __launch_bounds__(256)
    rmsnorm_quant_f32(const float* __restrict__ x, int x_stride, const float* __restrict__ w, uint8_t* __restrict__ q,
                      float* __restrict__ s, int dim, int k, float eps) {
    __shared__ float red[32];
    const float4* x4 = reinterpret_cast<const float4*>(x + static_cast<size_t>(blockIdx.x) * x_stride);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    float ss = 0.f;
    if (blockDim.x == 256 && k <= 4 * 256 * NORM_REGS) {
        // The row and the weight loaded once, all at the start, and kept in registers:
        // thread (warp w, lane l)'s j-th float4, channel 4(256j + 32w + l), is lane l's
        // part of group w + 8j, the group warp w quantises j-th below.
        const int n4 = dim / 4;
        float4 v[NORM_REGS], g[NORM_REGS];
#pragma unroll
        for (int j = 0; j < NORM_REGS; ++j) {
            const int i = threadIdx.x + 256 * j;
            if (i < n4) v[j] = x4[i], g[j] = w4[i];
        }
#pragma unroll
        for (int j = 0; j < NORM_REGS; ++j)
            if (threadIdx.x + 256 * j < n4) ss += sq4(v[j]);
        const float inv = rsqrtf(block_sum(ss, red) / dim + eps);
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, groups = k / f8::QB;
        const size_t row = blockIdx.x;
#pragma unroll
        for (int j = 0; j < NORM_REGS; ++j) {
            const int gi = warp + 8 * j, ch = gi * f8::QB + 4 * lane;
            if (gi >= groups) break;
            float q4[4] = {0.f, 0.f, 0.f, 0.f};
            if (ch < dim) {
                q4[0] = __bfloat162float(__float2bfloat16_rn(v[j].x * inv * g[j].x));
                q4[1] = __bfloat162float(__float2bfloat16_rn(v[j].y * inv * g[j].y));
                q4[2] = __bfloat162float(__float2bfloat16_rn(v[j].z * inv * g[j].z));
                q4[3] = __bfloat162float(__float2bfloat16_rn(v[j].w * inv * g[j].w));
            }
            quant_group(q4, q, row * k + ch, s + row * groups + gi, lane);
        }
        return;
    }
#pragma unroll 4
    for (int i = threadIdx.x; i < dim / 4; i += blockDim.x) ss += sq4(x4[i]);
    // The block sum of common.cuh's block_sum: warp sums, then every thread adds
    // the warps' in order.
    ss = warp_sum(ss);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < nw; ++i) t += red[i];
    const float inv = rsqrtf(t / dim + eps);
    const int groups = k / f8::QB;
    const size_t row = blockIdx.x;
    for (int g = warp; g < groups; g += nw) {
        const int ch = g * f8::QB + 4 * lane;
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        if (ch < dim) {
            const float4 a = x4[ch / 4], b = w4[ch / 4];
            v[0] = __bfloat162float(__float2bfloat16_rn(a.x * inv * b.x));
            v[1] = __bfloat162float(__float2bfloat16_rn(a.y * inv * b.y));
            v[2] = __bfloat162float(__float2bfloat16_rn(a.z * inv * b.z));
            v[3] = __bfloat162float(__float2bfloat16_rn(a.w * inv * b.w));
        }
        quant_group(v, q, row * k + ch, s + row * groups + g, lane);
    }
}

#define FP8_STREAM(NAME, T, MT)                                                                                    \
    extern "C" __global__ void __launch_bounds__(f8s::THREADS, f8s::Cfg<MT>::BLOCKS_PER_SM)                        \
        NAME(const __grid_constant__ CUtensorMap tx, const __grid_constant__ CUtensorMap tw, T* y, float* part,    \
             unsigned* counters, const float* xs, const float* ws, int m, int n, int k, int kchunk) {            \
        fp8_stream<T, MT>(&tx, &tw, y, part, counters, xs, ws, m, n, k, kchunk);                                   \
    }
FP8_STREAM(fp8_stream1_obf16, bf16, 1)
FP8_STREAM(fp8_stream2_obf16, bf16, 2)
FP8_STREAM(fp8_stream4_obf16, bf16, 4)
FP8_STREAM(fp8_stream1_of32, float, 1)
FP8_STREAM(fp8_stream2_of32, float, 2)
FP8_STREAM(fp8_stream4_of32, float, 4)

#define FP8_GEMM_WG(NAME, T)                                                                                      \
    extern "C" __global__ void __launch_bounds__(384, 1)                                  \
        NAME(const __grid_constant__ CUtensorMap tx, const __grid_constant__ CUtensorMap tw, T* y, const float* xs, \
             const float* ws, int m, int n, int k) {                                                              \
        fp8_gemm_wg<T>(&tx, &tw, y, xs, ws, m, n, k);                                                             \
    }
FP8_GEMM_WG(fp8_gemm_wg_obf16, bf16)
FP8_GEMM_WG(fp8_gemm_wg_of32, float)

#define FP8_GEMM_WIDE(NAME, T)                                                                                    \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                          \
        NAME(const __grid_constant__ CUtensorMap tx, const __grid_constant__ CUtensorMap tw, T* y, const float* xs, \
             const float* ws, int m, int n, int k) {                                                              \
        fp8_gemm_wide<T, 256>(&tx, &tw, y, xs, ws, m, n, k);                                                      \
    }
FP8_GEMM_WIDE(fp8_gemm_wide_obf16, bf16)
FP8_GEMM_WIDE(fp8_gemm_wide_of32, float)

#define FP8_STREAM_WG(NAME, T, NT)                                                                                 \
    extern "C" __global__ void __launch_bounds__(f8g::THREADS, f8g::Cfg<NT>::BLOCKS_PER_SM)                        \
        NAME(const __grid_constant__ CUtensorMap tx, const __grid_constant__ CUtensorMap tw, T* y, float* part,    \
             unsigned* counters, const float* xs, const float* ws, int m, int n, int k, int kchunk) {            \
        fp8_stream_wg<T, NT>(&tx, &tw, y, part, counters, xs, ws, m, n, k, kchunk);                                \
    }
FP8_STREAM_WG(fp8_stream_wg16_obf16, bf16, 16)
FP8_STREAM_WG(fp8_stream_wg32_obf16, bf16, 32)
FP8_STREAM_WG(fp8_stream_wg64_obf16, bf16, 64)
FP8_STREAM_WG(fp8_stream_wg16_of32, float, 16)
FP8_STREAM_WG(fp8_stream_wg32_of32, float, 32)
FP8_STREAM_WG(fp8_stream_wg64_of32, float, 64)
