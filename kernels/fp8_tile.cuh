// The wide fp8 tile GEMM (Hopper, sm_90a): fp8_gemm.cu's semantics (its header comment)
// over 128 × BN output tiles (BN = 256: fp8_gemm_wide_*), persistent and warp-specialised.
//
// - One block per SM walks the tiles t = blockIdx.x, blockIdx.x + gridDim.x, … (row
//   tile t % mt, column tile t / mt: the blocks in flight share few weight tiles).
// - A producer warpgroup gives its registers back (setmaxnreg 40) and one thread keeps a
//   ring of stages (a 128 × 128-byte x tile and a BN × 128-byte W tile each; 4 stages at
//   BN = 256) filled by TMA across tile boundaries, so the next tile's loads run under
//   this tile's last k blocks and its stores.
// - Two consumer warpgroups (setmaxnreg 232) each own 64 rows × BN columns: per k block
//   and 128-column half, four wgmma m64n128k32 into one accumulator, a wait, the
//   promotion into that half's sum; the stage goes back after the last half.
// Why wide: the 128 × 128 kernel (fp8_gemm_wg) moves 32 KB into an SM per 128³ MACs and
// runs at the rate an SM's loads arrive (~7 TB/s over the GPU on an H200, ncu); a 128 ×
// 256 tile moves 48 KB per twice the MACs. The promotion order per output is
// fp8_gemm_wg's (kb ascending, fma(acc, sx · sw, tot)), so the two give the same bits.
// (Tried: two accumulators per warpgroup with the next block's wgmmas issued before the
// previous block's promotion — ptxas serialises every wgmma, it does not follow a
// wait_group 1 across the loop; the two consumer warpgroups issuing in turn on named
// barriers — slower at BN = 256.)

#pragma once
#include "fp8.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void setmaxnreg_dec_40() { asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory"); }
__device__ __forceinline__ void setmaxnreg_inc_232() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
}
#endif

// Tensor maps as fp8_gemm_wg but W's box is BN rows; dynamic shared memory as
// fp8_gemm_wg's (STAGES = 6 at BN = 128, 4 at 256); grid = (min(tiles, SMs)), 384 threads.
template <typename T, int BN>
__device__ void fp8_gemm_wide(const CUtensorMap* tx, const CUtensorMap* tw, T* __restrict__ y,
                              const float* __restrict__ xs, const float* __restrict__ wsc, int m, int n, int k) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using f8w::BM;
    using f8w::BK;
    using f8w::TILE;
    constexpr int NH = BN / 128, STAGE = TILE + BN * BK, STAGES = BN == 128 ? 6 : 4;
    extern __shared__ __align__(1024) unsigned char f8p_smem[];
    const uint32_t sbase = (smem_u32(f8p_smem) + 1023u) & ~1023u;
    const uint32_t full = sbase + STAGES * STAGE, empty = full + 8 * STAGES;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int kbs = k / BK, mt = (m + BM - 1) / BM, nbs = (n + 127) / 128, tiles = mt * ((n + BN - 1) / BN);
    f8w_ring_init(full, empty, STAGES);
    if (wg == 0) {  // the producer
        setmaxnreg_dec_40();
        if (tid == 0) {
            int g = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                const int base = (t % mt) * BM, n0 = (t / mt) * BN;
                for (int kb = 0; kb < kbs; ++kb, ++g) {
                    const int st = g % STAGES;
                    if (g >= STAGES) mbar_wait(empty + 8 * st, ((g / STAGES) - 1) & 1);
                    mbar_arrive_expect_tx(full + 8 * st, STAGE);
                    tma_load_2d(sbase + st * STAGE, tx, kb * BK, base, full + 8 * st);
                    tma_load_2d(sbase + st * STAGE + TILE, tw, kb * BK, n0, full + 8 * st);
                }
            }
        }
        return;
    }
    setmaxnreg_inc_232();
    const int cw = wg - 1, warp = (tid >> 5) & 3, lane = tid & 31;
    int g = 0;  // stages so far
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int base = (t % mt) * BM, n0 = (t / mt) * BN;
        const int row_lo = base + 64 * cw + 16 * warp + (lane >> 2), row_hi = row_lo + 8;
        const float* const xs_lo = xs + static_cast<size_t>(row_lo < m ? row_lo : 0) * kbs;
        const float* const xs_hi = xs + static_cast<size_t>(row_hi < m ? row_hi : 0) * kbs;
        const float on_lo = row_lo < m ? 1.f : 0.f, on_hi = row_hi < m ? 1.f : 0.f;
        float acc[64], tot[NH][64];
#pragma unroll
        for (int h = 0; h < NH; ++h)
#pragma unroll
            for (int i = 0; i < 64; ++i) tot[h][i] = 0.f;
        for (int kb = 0; kb < kbs; ++kb, ++g) {
            const int st = g % STAGES;
            const float a_lo = on_lo * xs_lo[kb], a_hi = on_hi * xs_hi[kb];
            float sw[NH];
#pragma unroll
            for (int h = 0; h < NH; ++h) {
                const int nb = n0 / 128 + h;
                sw[h] = nb < nbs ? wsc[static_cast<size_t>(nb) * kbs + kb] : 0.f;
            }
            mbar_wait(full + 8 * st, (g / STAGES) & 1);
            const uint32_t xt = sbase + st * STAGE;
#pragma unroll
            for (int h = 0; h < NH; ++h) {
                f8p_issue(acc, xt + cw * 64 * BK, xt + TILE + h * 128 * BK);
                wgmma_wait<0>();
                fence_operands(acc);
                if (h + 1 == NH) mbar_arrive(empty + 8 * st);
                f8p_promote(acc, a_lo * sw[h], a_hi * sw[h], tot[h]);
            }
        }
#pragma unroll
        for (int h = 0; h < NH; ++h)
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const int col = n0 + 128 * h + 8 * j + 2 * (lane & 3);
                if (row_lo < m) f8_store(y, row_lo, col, n, tot[h][4 * j + 0], tot[h][4 * j + 1]);
                if (row_hi < m) f8_store(y, row_hi, col, n, tot[h][4 * j + 2], tot[h][4 * j + 3]);
            }
    }
#else
    __trap();
#endif
}
