// fp8 (e4m3) routed experts with DeepSeek's 128 × 128 block scales, every expert of a
// step in one launch over rows sorted by expert: the semantics of fp8_gemm.cu (its
// header comment) per expert, on the shared pieces of fp8.cuh.

#include "fp8.cuh"

// ---------------------------------------------------------------- grouped experts (Hopper)

// fp8_grouped_wg*: every routed expert's projection in one launch, for rows sorted by
// expert (moe_sort): expert e owns rows off[e] .. off[e + 1] of x [rows][k] and y
// [rows][n] and its weight is rows e·n .. e·n + n of w [E·n][k] with scales ws
// [E][ceil(n / 128)][k / 128]. grid = (ceil(n / 128), E), 256 threads — or, with `act`
// (the experts that have rows, ascending, then -1s: moe_sort), grid.y = min(E, rows)
// and block y runs expert act[y], so a step of few rows launches few blocks; a block streams
// its 128 weight rows of its expert and multiplies them with the expert's rows NT at a
// time (the same swap-AB wgmma, TMA ring and scale ring as fp8_stream_wg, one ring over
// (row tile, k stage) so the next tile's loads overlap this tile's last k blocks); an
// expert without rows exits at once. No split-K: every output is one block's promoted
// sum in kb order, and a row's bits do not depend on the expert's other rows, on where
// the row sits in its tile, or on NT (wgmma computes each output column on its own;
// asserted by the tests). The weight tile's rows past n (n % 128 != 0) belong to the
// next expert or are zero-filled past E·n, and are never stored.
template <typename T, int NT>
__device__ void fp8_grouped_wg(const CUtensorMap* tx, const CUtensorMap* tw, T* __restrict__ y,
                               const float* __restrict__ xs, const float* __restrict__ wsc,
                               const int* __restrict__ off, const int* __restrict__ act, int n, int k) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace f8g;
    using C = Cfg<NT>;
    const int e = act ? act[blockIdx.y] : blockIdx.y;
    if (e < 0) return;
    const int rbeg = off[e], rend = off[e + 1];
    if (rbeg >= rend) return;
    extern __shared__ __align__(1024) unsigned char f8q_smem[];
    __shared__ f8s::F8sScales scl[C::STAGES];
    const uint32_t sbase = (smem_u32(f8q_smem) + 1023u) & ~1023u;
    const uint32_t full = sbase + C::STAGES * C::STAGE;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int kbs = k / f8::QB;
    const int nb = blockIdx.x, nbs = (n + BN - 1) / BN;
    const int nst = (kbs + KS - 1) / KS;
    const int tiles = (rend - rbeg + NT - 1) / NT;
    const int total = tiles * nst;
    const float* const wse = wsc + (static_cast<size_t>(e) * nbs + nb) * kbs;
    const int wrow0 = e * n + nb * BN;

    if (tid == 0) {
        for (int s = 0; s < C::STAGES; ++s) mbar_init(full + 8 * s, 1);
        fence_mbar_init();
    }
    __syncthreads();
    auto issue = [&](int i) {  // row tile i / nst, k blocks KS·(i % nst) .. into slot i % STAGES
        const int st = i % C::STAGES, r0 = rbeg + (i / nst) * NT, kbi = KS * (i % nst);
        const int nr = min(NT, rend - r0);
        if (tid == 0) {
            const uint32_t dst = sbase + st * C::STAGE;
            mbar_arrive_expect_tx(full + 8 * st, C::STAGE);
#pragma unroll
            for (int kbl = 0; kbl < KS; ++kbl) {
                const int kk = (kbi + kbl) * f8::QB;
                tma_load_2d(dst + kbl * TW, tw, kk, wrow0, full + 8 * st);
                tma_load_2d(dst + KS * TW + kbl * C::TX, tx, kk, r0, full + 8 * st);
            }
        }
        if (tid < KS * NT) {
            const int kbl = tid / NT, r = tid % NT, kb = kbi + kbl;
            if (r < nr && kb < kbs)
                cp_async_4(smem_u32(&scl[st].x[kbl][r]), xs + static_cast<size_t>(r0 + r) * kbs + kb, 4);
        } else if (tid >= THREADS - KS) {
            const int kbl = tid - (THREADS - KS), kb = kbi + kbl;
            if (kb < kbs) cp_async_4(smem_u32(&scl[st].w[kbl]), wse + kb, 4);
        }
    };
    for (int i = 0; i < C::STAGES - 1; ++i) {
        if (i < total) issue(i);
        cp_async_commit();
    }
    constexpr int NA = NT / 2;
    float acc[NA], tot[NA];
    const int wrow = nb * BN + 64 * wg + 16 * warp + (lane >> 2);
    for (int i = 0; i < total; ++i) {
        cp_async_wait<C::STAGES - 2>();
        __syncthreads();  // scales of stage i landed; every warp is done with slot (i - 1)
        if (i + C::STAGES - 1 < total) issue(i + C::STAGES - 1);
        cp_async_commit();
        const int st = i % C::STAGES, j = i % nst, r0 = rbeg + (i / nst) * NT;
        const int nr = min(NT, rend - r0);
        if (j == 0) {
#pragma unroll
            for (int q = 0; q < NA; ++q) tot[q] = 0.f;
        }
        const uint32_t wt = sbase + st * C::STAGE, xt = wt + KS * TW;
        mbar_wait(full + 8 * st, (i / C::STAGES) & 1);
#pragma unroll
        for (int kbl = 0; kbl < KS; ++kbl) {
            if (KS * j + kbl >= kbs) break;
            const uint64_t da = gmma_desc_sw128(wt + kbl * TW + wg * 64 * f8::QB, 16, 1024);
            const uint64_t db = gmma_desc_sw128(xt + kbl * C::TX, 16, 1024);
            wgmma_fence();
#pragma unroll
            for (int k32 = 0; k32 < f8::QB / 32; ++k32)
                WgE4m3<NT>::mma(acc, gmma_desc_add(da, k32 * 32), gmma_desc_add(db, k32 * 32), k32 > 0);
            wgmma_commit();
            wgmma_wait<0>();
            fence_operands(acc);
            const float swv = scl[st].w[kbl];
#pragma unroll
            for (int q = 0; q < NA; ++q) {
                const int col = 8 * (q / 4) + 2 * (lane & 3) + (q & 1);
                tot[q] = fmaf(acc[q], (col < nr ? scl[st].x[kbl][col] : 0.f) * swv, tot[q]);
            }
        }
        if (j == nst - 1) {
#pragma unroll
            for (int q = 0; q < NA; ++q) {
                const int col = 8 * (q / 4) + 2 * (lane & 3) + (q & 1), row = wrow + 8 * ((q >> 1) & 1);
                if (col < nr && row < n) y[(static_cast<size_t>(r0) + col) * n + row] = from_f32<T>(tot[q]);
            }
        }
    }
    cp_async_wait<0>();
#else
    __trap();
#endif
}

#define FP8_GROUPED_WG(NAME, T, NT)                                                                               \
    extern "C" __global__ void __launch_bounds__(f8g::THREADS, f8g::Cfg<NT>::BLOCKS_PER_SM)                       \
        NAME(const __grid_constant__ CUtensorMap tx, const __grid_constant__ CUtensorMap tw, T* y, const float* xs, \
             const float* ws, const int* off, const int* act, int n, int k) {                                     \
        fp8_grouped_wg<T, NT>(&tx, &tw, y, xs, ws, off, act, n, k);                                               \
    }
FP8_GROUPED_WG(fp8_grouped_wg16_obf16, bf16, 16)
FP8_GROUPED_WG(fp8_grouped_wg32_obf16, bf16, 32)
FP8_GROUPED_WG(fp8_grouped_wg64_obf16, bf16, 64)
FP8_GROUPED_WG(fp8_grouped_wg16_of32, float, 16)
FP8_GROUPED_WG(fp8_grouped_wg32_of32, float, 32)
FP8_GROUPED_WG(fp8_grouped_wg64_of32, float, 64)

// fp8_grouped_tile_*: the grouped experts for prefill-sized experts, as fp8_gemm_wg's
// tiles (a producer warpgroup filling a 6-stage TMA ring; two consumer warpgroups of 64
// rows × 128 columns, 4 wgmma m64n128k32 per k block, promoted per k block) over rows
// sorted by expert: grid = (ceil(n / 128), E), 384 threads, block (c, e) runs expert e's
// rows off[e] .. off[e + 1] in tiles of 128 (one ring over (tile, k block)); an expert
// without rows exits at once. Rows of a tile past the expert's end (the next expert's,
// or zero past the last row) are computed with scale 0 and never stored; a consumer
// warpgroup whose 64 rows all lie past it skips its wgmma. A row's bits do
// not depend on the other rows, but differ from fp8_grouped_wg's (wgmma's accumulation
// order differs with the operands' roles).
template <typename T>
__device__ void fp8_grouped_tile(const CUtensorMap* tx, const CUtensorMap* tw, T* __restrict__ y,
                                 const float* __restrict__ xs, const float* __restrict__ wsc,
                                 const int* __restrict__ off, const int* __restrict__ act, int n, int k) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace f8w;
    const int e = act ? act[blockIdx.y] : blockIdx.y;
    if (e < 0) return;
    const int rbeg = off[e], rend = off[e + 1];
    if (rbeg >= rend) return;
    extern __shared__ __align__(1024) unsigned char f8t_smem[];
    const uint32_t sbase = (smem_u32(f8t_smem) + 1023u) & ~1023u;
    const uint32_t full = sbase + STAGES * STAGE, empty = full + 8 * STAGES;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int nb = blockIdx.x, nbs = (n + BN - 1) / BN, n0 = nb * BN;
    const int kbs = k / BK;
    const int total = ((rend - rbeg + BM - 1) / BM) * kbs;
    f8w_ring_init(full, empty, STAGES);
    if (wg == 0) {  // the producer
        if (tid == 0) {
            for (int g = 0; g < total; ++g) {
                const int st = g % STAGES;
                if (g >= STAGES) mbar_wait(empty + 8 * st, ((g / STAGES) - 1) & 1);
                mbar_arrive_expect_tx(full + 8 * st, STAGE);
                tma_load_2d(sbase + st * STAGE, tx, (g % kbs) * BK, rbeg + (g / kbs) * BM, full + 8 * st);
                tma_load_2d(sbase + st * STAGE + TILE, tw, (g % kbs) * BK, e * n + n0, full + 8 * st);
            }
        }
        return;
    }
    const int cw = wg - 1, warp = (tid >> 5) & 3, lane = tid & 31;
    const float* const wse = wsc + (static_cast<size_t>(e) * nbs + nb) * kbs;
    float acc[64], tot[64];
    for (int g = 0; g < total; ++g) {
        const int st = g % STAGES, kb = g % kbs;
        const int half0 = rbeg + (g / kbs) * BM + 64 * cw;
        // A warpgroup whose 64 rows all lie past the expert's end skips its wgmma (the
        // other one then has the tensor cores to itself), yet keeps the ring's protocol.
        const bool live = half0 < rend;
        const int row_lo = half0 + 16 * warp + (lane >> 2), row_hi = row_lo + 8;
        if (kb == 0) {
#pragma unroll
            for (int i = 0; i < 64; ++i) tot[i] = 0.f;
        }
        const float sw = wse[kb];
        const float sa_lo = row_lo < rend ? xs[static_cast<size_t>(row_lo) * kbs + kb] : 0.f;
        const float sa_hi = row_hi < rend ? xs[static_cast<size_t>(row_hi) * kbs + kb] : 0.f;
        mbar_wait(full + 8 * st, (g / STAGES) & 1);
        if (!live) {
            mbar_arrive(empty + 8 * st);
            continue;
        }
        const uint32_t xt = sbase + st * STAGE;
        f8p_issue(acc, xt + cw * 64 * BK, xt + TILE);
        wgmma_wait<0>();
        fence_operands(acc);
        mbar_arrive(empty + 8 * st);
        f8p_promote(acc, sa_lo * sw, sa_hi * sw, tot);
        if (kb == kbs - 1) {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const int col = n0 + 8 * j + 2 * (lane & 3);
                if (row_lo < rend) f8_store(y, row_lo, col, n, tot[4 * j + 0], tot[4 * j + 1]);
                if (row_hi < rend) f8_store(y, row_hi, col, n, tot[4 * j + 2], tot[4 * j + 3]);
            }
        }
    }
#else
    __trap();
#endif
}

#define FP8_GROUPED_TILE(NAME, T)                                                                                 \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                          \
        NAME(const __grid_constant__ CUtensorMap tx, const __grid_constant__ CUtensorMap tw, T* y, const float* xs, \
             const float* ws, const int* off, const int* act, int n, int k) {                                     \
        fp8_grouped_tile<T>(&tx, &tw, y, xs, ws, off, act, n, k);                                                 \
    }
FP8_GROUPED_TILE(fp8_grouped_tile_obf16, bf16)
FP8_GROUPED_TILE(fp8_grouped_tile_of32, float)
