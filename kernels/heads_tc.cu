// The absorbed form's per-head projections on tensor cores (mma.sync m16n8k16, bf16 in,
// f32 accumulate): heads_tc and its split-K reduces, described below.
#include "common.cuh"
#include "fp8_quant.cuh"

// Per-head projections of the absorbed form on tensor cores (heads_tc_*): for row r and
// head h = blockIdx.z, y[r][h][c] = Σ_k x[r][h][k] · W_h[k][c] over K inputs and N outputs,
// x f32 (row r, head h at x + (r·heads + h)·x_stride), W bf16 per head (K·N elements at
// w + h·K·N), laid [N][K] (W_UV: `wt` = 0) or [K][N] (W_UK: `wt` = 1, B fragments by
// ldmatrix.trans). x is split into bf16 hi + lo (x − hi, rounded), both through the mma,
// so the sum keeps about 16 bits of x (f32 accumulate), not bf16's 8. Block = 64 rows × 64
// columns of one head, 4 warps of 16 columns as in gtc_tile, BK = 64 per stage (K past its
// end zero-filled); the next stage's x is loaded into registers while a stage is multiplied. Outputs: y (f32, may be null) and yb (bf16) at (r·heads + h)·y_stride
// + c. With rope > 0 (the absorbed query) the blocks also write the rotated q_pe: x's
// elements K.. K + rope of the row, at position pos[r], into y/yb columns N.. N + rope
// (spread over the column blocks). Split K (`part` not null, rope 0): grid.y runs over
// (column block, k range z) and block z sums only k in [z·kchunk, (z + 1)·kchunk), into
// part[z][r·heads + h][c] (f32, rows of N); heads_tc_reduce then adds the ranges in order
// and writes y / yb. The ranges come from K alone, so a row's result depends on that row
// alone either way (fixed k order). Needs K, N, x_stride multiples of 8, 8, 4 (16-byte
// loads), y_stride even, kchunk a multiple of BK.
namespace hts {
constexpr int BM = 64, BN = 64, BK = 64, THREADS = 128, MT = 4, CHUNKS = BK / 8;
// (row, chunk) pieces of an x tile per thread.
constexpr int XPT = BM * CHUNKS / THREADS;
static_assert(BM * CHUNKS % THREADS == 0, "x tile pieces per thread");
}

// Element offset of (row, 16-byte chunk c) in a swizzled [row][BK] tile (chunks XORed with
// the row's low bits: ldmatrix's eight rows fall in distinct bank groups).
__device__ __forceinline__ int hts_at(int row, int c) { return row * hts::BK + ((c ^ (row & 7)) * 8); }

extern "C" __global__ void __launch_bounds__(hts::THREADS)
    heads_tc(float* __restrict__ y, bf16* __restrict__ yb, const float* __restrict__ x, const bf16* __restrict__ w,
             int m, int heads, int K, int N, int x_stride, int y_stride, int wt, const float* __restrict__ cos_t,
             const float* __restrict__ sin_t, const int* __restrict__ pos, int rope, float* __restrict__ part,
             int kchunk) {
    using namespace hts;
    __shared__ __align__(128) bf16 ws[BN * BK];
    __shared__ __align__(128) bf16 xh[BM * BK];
    __shared__ __align__(128) bf16 xl[BM * BK];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int nblocks = (N + BN - 1) / BN, nb = blockIdx.y % nblocks, z = blockIdx.y / nblocks;
    const int r0 = blockIdx.x * BM, n0 = nb * BN, h = blockIdx.z;
    const int kbeg = part ? z * kchunk : 0, kend = part ? min(K, kbeg + kchunk) : K;
    const int nr = min(BM, m - r0);
    const int mts = (nr + 15) / 16;
    const bf16* wh = w + static_cast<size_t>(h) * K * N;
    float acc[MT][2][4];
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[a][t][q] = 0.f;
    const uint32_t wsb = smem_u32(ws), xhb = smem_u32(xh), xlb = smem_u32(xl);
    // x tile of k block k0: each thread's XPT (row, 8-channel chunk) pieces as f32, all
    // loads issued before any is used (zeros past nr rows / kend).
    float v[XPT][8];
    auto load_x = [&](int k0) {
#pragma unroll
        for (int u = 0; u < XPT; ++u) {
            const int i = tid + u * THREADS, row = i / CHUNKS, kk = k0 + (i % CHUNKS) * 8;
            if (row < nr && kk < kend) {
                const float4* src = reinterpret_cast<const float4*>(
                    x + (static_cast<size_t>(r0 + row) * heads + h) * x_stride + kk);
                const float4 p = src[0], q = src[1];
                v[u][0] = p.x, v[u][1] = p.y, v[u][2] = p.z, v[u][3] = p.w;
                v[u][4] = q.x, v[u][5] = q.y, v[u][6] = q.z, v[u][7] = q.w;
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) v[u][j] = 0.f;
            }
        }
    };
    if (kbeg < kend) load_x(kbeg);
    for (int k0 = kbeg; k0 < kend; k0 += BK) {
        __syncthreads();  // the previous stage's reads are done
        // W tile: [n][k] rows (wt = 0) or [k][n] rows (wt = 1), 64 × 64, zero past kend / N.
        for (int i = tid; i < 64 * CHUNKS; i += THREADS) {
            const int row = i / CHUNKS, c = i % CHUNKS;
            const bf16* src;
            bool ok;
            if (wt) {
                ok = k0 + row < kend && n0 + c * 8 < N;
                src = wh + static_cast<size_t>(k0 + row) * N + n0 + c * 8;
            } else {
                ok = n0 + row < N && k0 + c * 8 < kend;
                src = wh + static_cast<size_t>(n0 + row) * K + k0 + c * 8;
            }
            cp_async_16(wsb + 2 * hts_at(row, c), ok ? src : w, ok ? 16 : 0);
        }
        cp_async_commit();
        // The loaded x pieces -> hi and lo bf16 chunks; then the next k block's x is
        // loaded into registers while this one is multiplied.
#pragma unroll
        for (int u = 0; u < XPT; ++u) {
            const int i = tid + u * THREADS, row = i / CHUNKS, c = i % CHUNKS;
            uint4 hi, lo;
            uint32_t* hp = reinterpret_cast<uint32_t*>(&hi);
            uint32_t* lp = reinterpret_cast<uint32_t*>(&lo);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float a = __bfloat162float(__float2bfloat16_rn(v[u][2 * j]));
                const float b = __bfloat162float(__float2bfloat16_rn(v[u][2 * j + 1]));
                hp[j] = pack_bf16x2(a, b);
                lp[j] = pack_bf16x2(v[u][2 * j] - a, v[u][2 * j + 1] - b);
            }
            *reinterpret_cast<uint4*>(xh + hts_at(row, c)) = hi;
            *reinterpret_cast<uint4*>(xl + hts_at(row, c)) = lo;
        }
        if (k0 + BK < kend) load_x(k0 + BK);
        cp_async_wait<0>();
        __syncthreads();
#pragma unroll
        for (int k16 = 0; k16 < BK / 16; ++k16) {
            uint32_t b[4];
            if (wt) {
                // Matrices (n-tile 0, k 0-7), (0, k 8-15), (1, k 0-7), (1, k 8-15), stored k-major.
                const int mi = lane >> 3;
                ldmatrix_x4_trans(b, wsb + 2 * hts_at(k16 * 16 + (lane & 7) + (mi & 1) * 8, warp * 2 + (mi >> 1)));
            } else {
                const int row = warp * 16 + (lane & 7) + (lane >> 4) * 8;
                ldmatrix_x4(b, wsb + 2 * hts_at(row, k16 * 2 + ((lane >> 3) & 1)));
            }
#pragma unroll
            for (int a = 0; a < MT; ++a) {
                if (a >= mts) break;
                const int row = a * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                const int c = k16 * 2 + (lane >> 4);
                uint32_t ah[4], al[4];
                ldmatrix_x4(ah, xhb + 2 * hts_at(row, c));
                ldmatrix_x4(al, xlb + 2 * hts_at(row, c));
                mma_bf16_16816(acc[a][0], ah, b[0], b[1]);
                mma_bf16_16816(acc[a][1], ah, b[2], b[3]);
                mma_bf16_16816(acc[a][0], al, b[0], b[1]);
                mma_bf16_16816(acc[a][1], al, b[2], b[3]);
            }
        }
    }
#pragma unroll
    for (int a = 0; a < MT; ++a) {
        if (a >= mts) break;
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            const int col = n0 + warp * 16 + t * 8 + 2 * (lane & 3);
            if (col >= N) continue;  // N % 8 == 0: a pair is in or out whole
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = a * 16 + (lane >> 2) + 8 * half;
                if (row >= nr) continue;
                if (part) {
                    const size_t o = ((static_cast<size_t>(z) * m + r0 + row) * heads + h) * N + col;
                    store2(part + o, acc[a][t][2 * half], acc[a][t][2 * half + 1]);
                    continue;
                }
                const size_t o = (static_cast<size_t>(r0 + row) * heads + h) * y_stride + col;
                if (y) store2(y + o, acc[a][t][2 * half], acc[a][t][2 * half + 1]);
                store2(yb + o, acc[a][t][2 * half], acc[a][t][2 * half + 1]);
            }
        }
    }
    if (rope > 0 && !part) {
        const int half = rope / 2;
        for (int i = nb * THREADS + tid; i < nr * half; i += nblocks * THREADS) {
            const int row = i / half, j = i % half, r = r0 + row;
            const float* qr = x + (static_cast<size_t>(r) * heads + h) * x_stride + K;
            const size_t p = static_cast<size_t>(pos[r]) * half + j;
            float a, b;
            rope_pair(qr[2 * j], qr[2 * j + 1], cos_t[p], sin_t[p], a, b);
            const size_t o = (static_cast<size_t>(r) * heads + h) * y_stride + N + 2 * j;
            if (y) y[o] = a, y[o + 1] = b;
            yb[o] = __float2bfloat16_rn(a);
            yb[o + 1] = __float2bfloat16_rn(b);
        }
    }
}

// heads_tc's split-K sums: y[r][h][c] = ((part[0] + part[1]) + part[2]) + ... for the m ·
// heads rows of N columns, into y (f32, may be null) and yb (bf16) at (r·heads + h)·
// y_stride + c. grid = ceil(m · heads · N / 256).
extern "C" __global__ void __launch_bounds__(256)
    heads_tc_reduce(float* __restrict__ y, bf16* __restrict__ yb, const float* __restrict__ part, int m, int heads,
                    int N, int y_stride, int ksplit) {
    const size_t len = static_cast<size_t>(m) * heads * N;
    const size_t i = static_cast<size_t>(blockIdx.x) * 256 + threadIdx.x;
    if (i >= len) return;
    float v = part[i];
    for (int z = 1; z < ksplit; ++z) v = __fadd_rn(v, part[z * len + i]);
    const size_t o = (i / N) * y_stride + i % N;
    if (y) y[o] = v;
    yb[o] = __float2bfloat16_rn(v);
}

// heads_tc_reduce's sums for an fp8 GEMM that reads them (W_UV's output, o_proj's input):
// with N = y_stride = 128, head h of row r is the row's 128-channel group h, and the
// value heads_tc_reduce would store, bf16(((part[0] + part[1]) + ...)), is quantised as
// act_quant_bf16 quantises it: codes q [m][heads · 128] and scales s [m][heads], the
// bytes of heads_tc_reduce followed by act_quant_bf16. One warp per (row, head), 8 a
// block; lane l sums channels 4l .. 4l + 3.
extern "C" __global__ void __launch_bounds__(256)
    heads_tc_reduce_quant(uint8_t* __restrict__ q, float* __restrict__ s, const float* __restrict__ part, int m,
                          int heads, int ksplit) {
    const size_t wid = static_cast<size_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
    if (wid >= static_cast<size_t>(m) * heads) return;
    const int lane = threadIdx.x & 31;
    const size_t len = static_cast<size_t>(m) * heads * f8::QB, i = wid * f8::QB + 4 * lane;
    float v[4];
    load4(part + i, v);
    for (int z = 1; z < ksplit; ++z) {
        float p[4];
        load4(part + z * len + i, p);
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = __fadd_rn(v[j], p[j]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = __bfloat162float(__float2bfloat16_rn(v[j]));
    quant_group(v, q, i, s + wid, lane);
}
