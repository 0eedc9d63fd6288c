// Device pieces shared by the fp8 GEMM kernels (fp8_gemm.cu: the dense projections;
// fp8_grouped.cu: the routed experts): activation quantisation, the mma.sync and
// wgmma e4m3 instructions, the TMA rings, promotion, the split-K reduction, and the
// kernels' bodies as templates. fp8_gemm.cu says what the kernels compute.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_fp8.h>

#include "common.cuh"
#include "fp8_quant.cuh"
#include "wgmma.cuh"

// The (row, 128-group) a warp of a quantiser quantises (one warp per group, 8 warps a
// block, `m` rows of `k` channels) and its lane's first channel; false for the warps past
// the last group.
struct QuantSlot {
    size_t row;
    int g, groups, ch, lane;
};
__device__ __forceinline__ bool quant_slot(int m, int k, QuantSlot& t) {
    t.groups = k / f8::QB;
    const size_t wid = static_cast<size_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
    if (wid >= static_cast<size_t>(m) * t.groups) return false;
    t.lane = threadIdx.x & 31;
    t.row = wid / t.groups;
    t.g = static_cast<int>(wid % t.groups);
    t.ch = t.g * f8::QB + 4 * t.lane;
    return true;
}

// q [m][k] e4m3, s [m][k / 128] from x [m][kx] (kx <= k, kx % 4 == 0): channels kx..k
// read as zeros, so a weight whose input width is padded to whole 128-groups with zero
// columns sees the same groups and scales as the unpadded row's (its last group holds
// kx % 128 channels). 8 warps per block, warp = (row, group) in row-major order.
template <typename Tin>
__device__ void act_quant(const Tin* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ s, int m, int k,
                          int kx) {
    QuantSlot t;
    if (!quant_slot(m, k, t)) return;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (t.ch < kx) load4(x + t.row * kx + t.ch, v);
    quant_group(v, q, t.row * k + t.ch, s + t.row * t.groups + t.g, t.lane);
}

// ---------------------------------------------------------------- shared pieces

// D += A(16x32 e4m3, row) * B(32x8 e4m3, col), f32 accumulate (sm_89+).
__device__ __forceinline__ void mma_e4m3_16832(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16 bytes of a streamed weight: read once, kept out of L1.
__device__ __forceinline__ uint4 ldg_stream16(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
    uint4 r;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
    return r;
}

// Two adjacent outputs (col, col + 1) of row `row`, columns ≥ n dropped.
template <typename T>
__device__ __forceinline__ void f8_store(T* __restrict__ y, size_t row, int col, int n, float a, float b) {
    T* p = y + row * n + col;
    if (col + 1 < n && (n & 1) == 0) {  // even n: the pair is aligned
        store2(p, a, b);
    } else {
        if (col < n) p[0] = from_f32<T>(a);
        if (col + 1 < n) p[1] = from_f32<T>(b);
    }
}

// Split-K epilogue of the streaming GEMMs: y[r][c] = Σ_ks part[ks][r][c] in ks order for
// rows r0 .. r0 + nr and columns c0 .. c0 + cols of an [m][n] output, by `nthreads`
// threads (`t` = this one's index). Latency-bound (one block sums a whole tile), so a
// thread takes two runs of 4 columns at a time and issues every load of a batch of 8
// partials of both before adding (the same order per output as one at a time). __ldcg:
// other blocks wrote the partials (L1 is not coherent).
__device__ __forceinline__ float4 ldcg4(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ void add4(float4& s, const float4& v) { s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w; }
template <typename T>
__device__ __forceinline__ void f8_reduce_tile(T* __restrict__ y, const float* __restrict__ part, int m, int n, int r0,
                                               int nr, int c0, int cols, int ks, int t, int nthreads) {
    const size_t plane = static_cast<size_t>(m) * n;
    if ((n & 3) == 0 && (cols & 3) == 0 && (c0 & 3) == 0) {
        const int per_row = cols / 4, quads = nr * per_row;
        for (int e = t; e < quads; e += 2 * nthreads) {
            const bool two = e + nthreads < quads;
            const float* p[2];
            size_t at[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int ee = min(e + h * nthreads, quads - 1);
                at[h] = (static_cast<size_t>(r0) + ee / per_row) * n + c0 + 4 * (ee % per_row);
                p[h] = part + at[h];
            }
            float4 sum[2] = {ldcg4(p[0]), ldcg4(p[1])};
            for (int q = 1; q < ks; q += 8) {
                float4 v[2][8];
#pragma unroll
                for (int u = 0; u < 8; ++u)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        if (q + u < ks) v[h][u] = ldcg4(p[h] + (q + u) * plane);
#pragma unroll
                for (int u = 0; u < 8; ++u)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        if (q + u < ks) add4(sum[h], v[h][u]);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (h == 1 && !two) break;
                store2(y + at[h], sum[h].x, sum[h].y);
                store2(y + at[h] + 2, sum[h].z, sum[h].w);
            }
        }
        return;
    }
    for (int e = t; e < nr * cols; e += nthreads) {
        const int r = e / cols, col = c0 + e % cols;
        const float* p = part + (static_cast<size_t>(r0) + r) * n + col;
        float s = __ldcg(p);
        int q = 1;
        for (; q + 8 <= ks; q += 8) {
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) v[u] = __ldcg(p + (q + u) * plane);
#pragma unroll
            for (int u = 0; u < 8; ++u) s += v[u];
        }
        for (; q < ks; ++q) s += __ldcg(p + q * plane);
        y[(static_cast<size_t>(r0) + r) * n + col] = from_f32<T>(s);
    }
}

// ---------------------------------------------------------------- weight-streaming GEMM

namespace f8s {
constexpr int WARPS = 8, THREADS = WARPS * 32, NW = 16, BN = WARPS * NW, ROWS = 64;
constexpr int KS = 2;                 // k blocks per stage: 256-byte runs of each weight row
constexpr int TW = BN * KS * f8::QB;  // bytes of a stage's weight tile
static_assert(BN == f8::QB, "a block's columns are one scale row");
// Ring depth and blocks per SM by m-tiles (the host's `fp8_plan::stream_smem`): one
// tile runs two blocks per SM of 3 stages (measured faster than one of 6); two and
// four tiles need more than 128 registers (ptxas spills at that bound) and run one
// block of 5 or 4 stages.
template <int MT>
struct Cfg {
    static constexpr int STAGES = MT == 1 ? 3 : MT == 2 ? 5 : 4;
    static constexpr int BLOCKS_PER_SM = MT == 1 ? 2 : 1;
    static constexpr int TX = MT * 16 * KS * f8::QB;  // bytes of a stage's activation tile
    static constexpr int STAGE = TW + TX;
};
// A stage's scales (cp.async beside the TMA): the activation rows' [KS][64] and the
// weight's [KS].
struct F8sScales {
    float x[f8s::KS][f8s::ROWS];
    float w[f8s::KS];
};
}  // namespace f8s

// 16 bytes of logical chunk c (0..7) of k block kbl (0, 1) of row r of a stage tile:
// [row][KS][128 bytes], as the TMA writes a 3-D box (128 bytes, KS blocks, rows) with
// the 128-byte swizzle (chunk c of 128-byte line L = KS·r + kbl at c ^ (L & 7)).
__device__ __forceinline__ uint4 f8s_ld(uint32_t tile, int r, int kbl, int c) {
    const int line = f8s::KS * r + kbl;
    return lds128(tile + line * f8::QB + ((c ^ (line & 7)) << 4));
}

// The TMA tensor maps: x [m][k] and w [n][k] as 3-D (128 bytes, k / 128, rows) u8
// with the 128-byte swizzle; boxes of (128, KS, 16·MT) and (128, KS, 128). In half h of
// a k block, lane (g, t) reads logical chunk (t & 1) + 4(t >> 1) + 2h of its rows: rows
// g and g ^ 1 are swizzled apart by 2, and the four lanes of a row hit chunks {0, 1, 4,
// 5} (or {2, 3, 6, 7}), so no shared-memory bank conflicts.
// With ksplit > 1 each block writes its f32 partial, and the last block of a column
// tile to finish (a counter per tile, `counters`, reset by that block) sums the
// partials in ks order into y, every thread of the block on its own outputs: the same
// order whatever the arrival order.
template <typename T, int MT>
__device__ void fp8_stream(const CUtensorMap* tx, const CUtensorMap* tw, T* __restrict__ y, float* __restrict__ part,
                           unsigned* __restrict__ counters, const float* __restrict__ xs,
                           const float* __restrict__ wsc, int m, int n, int k, int kchunk) {
    using namespace f8s;
    using C = Cfg<MT>;
    extern __shared__ __align__(1024) unsigned char f8s_smem[];
    __shared__ int last;
    __shared__ F8sScales scl[C::STAGES];
    const uint32_t sbase = (smem_u32(f8s_smem) + 1023u) & ~1023u;
    const uint32_t full = sbase + C::STAGES * C::STAGE;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int kbs_all = k / f8::QB;
    const int nb = blockIdx.x, n0 = nb * BN + warp * NW;
    const int kb0 = blockIdx.y * (kchunk / f8::QB);
    const int nkb = min(kchunk / f8::QB, kbs_all - kb0);
    const int nst = (nkb + KS - 1) / KS;
    const int r0 = blockIdx.z * ROWS, nr = min(ROWS, m - r0);
    const int cbase = (t & 1) + 4 * (t >> 1);

    if (tid == 0) {
        for (int s = 0; s < C::STAGES; ++s) mbar_init(full + 8 * s, 1);
        fence_mbar_init();
    }
    __syncthreads();
    auto issue = [&](int i) {  // k blocks kb0 + KS·i .. into slot i % STAGES
        const int st = i % C::STAGES;
        if (tid == 0) {
            const uint32_t dst = sbase + st * C::STAGE;
            mbar_arrive_expect_tx(full + 8 * st, C::STAGE);
            tma_load_3d(dst, tw, 0, kb0 + KS * i, nb * BN, full + 8 * st);
            tma_load_3d(dst + TW, tx, 0, kb0 + KS * i, r0, full + 8 * st);
        }
        // The scales of rows < nr and k blocks < the split's end (the rest never read).
        if (tid < KS * MT * 16) {
            const int kbl = tid / (MT * 16), r = tid % (MT * 16), kb = kb0 + KS * i + kbl;
            if (r < nr && kb < kb0 + nkb)
                cp_async_4(smem_u32(&scl[st].x[kbl][r]), xs + static_cast<size_t>(r0 + r) * kbs_all + kb, 4);
        } else if (tid >= THREADS - KS) {
            const int kbl = tid - (THREADS - KS), kb = kb0 + KS * i + kbl;
            if (kb < kb0 + nkb) cp_async_4(smem_u32(&scl[st].w[kbl]), wsc + static_cast<size_t>(nb) * kbs_all + kb, 4);
        }
    };
    // One cp.async group per stage, empty or not, keeps the wait counts uniform.
    for (int i = 0; i < C::STAGES - 1; ++i) {
        if (i < nst) issue(i);
        cp_async_commit();
    }

    float tot[MT][2][4];
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) tot[a][j][q] = 0.f;

    for (int i = 0; i < nst; ++i) {
        cp_async_wait<C::STAGES - 2>();  // this thread's scales of stage i have landed
        __syncthreads();  // ... every thread's; every warp is done with slot (i - 1) % STAGES
        if (i + C::STAGES - 1 < nst) issue(i + C::STAGES - 1);
        cp_async_commit();
        const int st = i % C::STAGES;
        const uint32_t wt = sbase + st * C::STAGE, xt = wt + TW;
        mbar_wait(full + 8 * st, (i / C::STAGES) & 1);
#pragma unroll
        for (int kbl = 0; kbl < KS; ++kbl) {
            if (KS * i + kbl >= nkb) break;  // the split's last stage may hold one block
            const float swv = scl[st].w[kbl];
            float sl[MT], sh[MT];
#pragma unroll
            for (int a = 0; a < MT; ++a) {
                const int rl = 16 * a + g, rh = rl + 8;
                sl[a] = rl < nr ? scl[st].x[kbl][rl] : 0.f;
                sh[a] = rh < nr ? scl[st].x[kbl][rh] : 0.f;
            }
            float acc[MT][2][4];
#pragma unroll
            for (int a = 0; a < MT; ++a)
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q) acc[a][j][q] = 0.f;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int c = cbase + 2 * h;
                uint4 b[2];
#pragma unroll
                for (int j = 0; j < 2; ++j) b[j] = f8s_ld(wt, warp * NW + 8 * j + g, kbl, c);
#pragma unroll
                for (int a = 0; a < MT; ++a) {
                    const uint4 lo = f8s_ld(xt, 16 * a + g, kbl, c), hi = f8s_ld(xt, 16 * a + g + 8, kbl, c);
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        mma_e4m3_16832(acc[a][j], lo.x, hi.x, lo.y, hi.y, b[j].x, b[j].y);
                        mma_e4m3_16832(acc[a][j], lo.z, hi.z, lo.w, hi.w, b[j].z, b[j].w);
                    }
                }
            }
#pragma unroll
            for (int a = 0; a < MT; ++a) {
                const float s_lo = sl[a] * swv, s_hi = sh[a] * swv;
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    tot[a][j][0] = fmaf(acc[a][j][0], s_lo, tot[a][j][0]);
                    tot[a][j][1] = fmaf(acc[a][j][1], s_lo, tot[a][j][1]);
                    tot[a][j][2] = fmaf(acc[a][j][2], s_hi, tot[a][j][2]);
                    tot[a][j][3] = fmaf(acc[a][j][3], s_hi, tot[a][j][3]);
                }
            }
        }
    }
    cp_async_wait<0>();
    // Rows r0 + 16a + g (+8), columns n0 + 8j + 2t (+1).
    const int ks = gridDim.y;
    T* const yo = ks == 1 ? y : nullptr;
    float* const po = ks == 1 ? nullptr : part + static_cast<size_t>(blockIdx.y) * m * n;
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int r = 16 * a + g + 8 * hf;
                if (r >= nr) continue;
                const size_t row = static_cast<size_t>(r0) + r;
                if (ks == 1)
                    f8_store(yo, row, n0 + 8 * j + 2 * t, n, tot[a][j][2 * hf], tot[a][j][2 * hf + 1]);
                else
                    f8_store(po, row, n0 + 8 * j + 2 * t, n, tot[a][j][2 * hf], tot[a][j][2 * hf + 1]);
            }
    if (ks == 1) return;
    __threadfence();  // this block's partial is visible device-wide before it counts itself
    __syncthreads();
    unsigned* counter = counters + blockIdx.z * gridDim.x + blockIdx.x;
    if (tid == 0) last = atomicAdd(counter, 1u) == static_cast<unsigned>(ks - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();  // acquire: the other blocks' partials
    f8_reduce_tile(y, part, m, n, r0, nr, nb * BN, min(BN, n - nb * BN), ks, tid, THREADS);
    if (tid == 0) *counter = 0;  // ready for the next launch on this stream
}


// ---------------------------------------------------------------- Hopper wgmma GEMM

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace f8w {
constexpr int BM = 128, BN = 128, BK = 128, STAGES = 6;
constexpr int TILE = BM * BK;  // bytes of one x (or W) tile
constexpr int STAGE = 2 * TILE;
}  // namespace f8w

// D[64 x 128] (scale_d ? D : 0) + A[64 x 32] · B[32 x 128], e4m3 from shared memory (both
// K-major), f32 accumulate.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// The pieces of the tile kernels (fp8_gemm_wg, fp8_gemm_wide, fp8_grouped_tile).
// The ring's barriers: `full` (one arrival: the producer's, with the stage's bytes) and
// `empty` (the two consumer warpgroups) per stage, by thread 0; every thread calls it.
__device__ __forceinline__ void f8w_ring_init(uint32_t full, uint32_t empty, int stages) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, 2 * 128);
        }
        fence_mbar_init();
    }
    __syncthreads();
}

// Four wgmma m64n128k32 into a fresh accumulator, committed as one group: this
// warpgroup's 64 rows of the stage's x tile (at `xa`) times 128 W rows (at `wb`).
__device__ __forceinline__ void f8p_issue(float (&acc)[64], uint32_t xa, uint32_t wb) {
    using namespace f8w;
    const uint64_t da = gmma_desc_sw128(xa, 16, 1024), db = gmma_desc_sw128(wb, 16, 1024);
    wgmma_fence();
#pragma unroll
    for (int k32 = 0; k32 < BK / 32; ++k32)
        wgmma_m64n128k32_e4m3(acc, gmma_desc_add(da, k32 * 32), gmma_desc_add(db, k32 * 32), k32 > 0);
    wgmma_commit();
}

// tot += acc · scale, rows lo (the accumulator's registers 4j, 4j + 1) and hi (4j + 2,
// 4j + 3): the promotion of one k block.
__device__ __forceinline__ void f8p_promote(const float (&acc)[64], float s_lo, float s_hi, float (&tot)[64]) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        tot[4 * j + 0] = fmaf(acc[4 * j + 0], s_lo, tot[4 * j + 0]);
        tot[4 * j + 1] = fmaf(acc[4 * j + 1], s_lo, tot[4 * j + 1]);
        tot[4 * j + 2] = fmaf(acc[4 * j + 2], s_hi, tot[4 * j + 2]);
        tot[4 * j + 3] = fmaf(acc[4 * j + 3], s_hi, tot[4 * j + 3]);
    }
}
#endif

// Tensor maps: x [m][k] and w [n][k], u8, boxes of 128 × 128 bytes, 128-byte swizzle.
// grid = (ceil(m / 128), ceil(n / 128)), 384 threads, dynamic shared memory 1024 +
// STAGES · STAGE + 16 · STAGES bytes (the host's FP8_WG_SMEM).
template <typename T>
__device__ void fp8_gemm_wg(const CUtensorMap* tx, const CUtensorMap* tw, T* __restrict__ y,
                            const float* __restrict__ xs, const float* __restrict__ wsc, int m, int n, int k) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace f8w;
    extern __shared__ __align__(1024) unsigned char f8w_smem[];
    const uint32_t sbase = (smem_u32(f8w_smem) + 1023u) & ~1023u;
    const uint32_t full = sbase + STAGES * STAGE, empty = full + 8 * STAGES;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int base = blockIdx.x * BM, nb = blockIdx.y, n0 = nb * BN;
    const int kbs = k / BK;
    f8w_ring_init(full, empty, STAGES);
    if (wg == 0) {  // the producer
        if (tid == 0) {
            for (int g = 0; g < kbs; ++g) {
                const int st = g % STAGES;
                if (g >= STAGES) mbar_wait(empty + 8 * st, ((g / STAGES) - 1) & 1);
                mbar_arrive_expect_tx(full + 8 * st, STAGE);
                tma_load_2d(sbase + st * STAGE, tx, g * BK, base, full + 8 * st);
                tma_load_2d(sbase + st * STAGE + TILE, tw, g * BK, n0, full + 8 * st);
            }
        }
        return;
    }
    const int cw = wg - 1, warp = (tid >> 5) & 3, lane = tid & 31;
    const int row_lo = base + 64 * cw + 16 * warp + (lane >> 2), row_hi = row_lo + 8;
    float acc[64], tot[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = tot[i] = 0.f;
    for (int g = 0; g < kbs; ++g) {
        const int st = g % STAGES;
        const float sw = wsc[static_cast<size_t>(nb) * kbs + g];
        const float sa_lo = row_lo < m ? xs[static_cast<size_t>(row_lo) * kbs + g] : 0.f;
        const float sa_hi = row_hi < m ? xs[static_cast<size_t>(row_hi) * kbs + g] : 0.f;
        mbar_wait(full + 8 * st, (g / STAGES) & 1);
        const uint32_t xt = sbase + st * STAGE;
        f8p_issue(acc, xt + cw * 64 * BK, xt + TILE);
        wgmma_wait<0>();
        fence_operands(acc);
        mbar_arrive(empty + 8 * st);
        f8p_promote(acc, sa_lo * sw, sa_hi * sw, tot);
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int col = n0 + 8 * j + 2 * (lane & 3);
        if (row_lo < m) f8_store(y, row_lo, col, n, tot[4 * j + 0], tot[4 * j + 1]);
        if (row_hi < m) f8_store(y, row_hi, col, n, tot[4 * j + 2], tot[4 * j + 3]);
    }
#else
    __trap();
#endif
}


// ---------------------------------------------------------------- Hopper streaming GEMM

// fp8_stream_wg*: the streaming GEMM on Hopper's wgmma with the operands swapped (a
// decode batch is too short for wgmma's 64-row A): A = 64 weight rows, B = the block's
// NT = 16, 32 or 64 activation rows, D = yᵀ. The same grid, split-K, TMA ring (per stage
// two k blocks, each a [rows][128 bytes] tile in the K-major 128-byte-swizzle layout,
// two 2-D boxes per operand), scale ring and last-block reduction as fp8_stream (or,
// launched as clusters of a tile's k chunks, f8g_cluster_reduce); each
// of the two warpgroups runs 4 wgmma m64nNTk32 per k block into a fresh accumulator,
// waits and promotes it. mma.sync's fp8 rate on Hopper caps fp8_stream near 150
// TFLOP/s (measured), which a decode batch of 64 rows already reaches.
namespace f8g {
constexpr int THREADS = 256, BN = 128, KS = 2;
constexpr int TW = BN * f8::QB;  // one k block of the weight tile
// Ring depth and blocks per SM (the host's `fp8_plan::stream_wg_smem`): 16 rows run two
// blocks per SM of 3 stages, 32 and 64 rows one of 5 or 4. (A warp-specialised form, a
// producer warpgroup refilling slots on `empty` barriers, one block of 6 stages, measured
// 5-20% slower at 1-4 rows on an H200: two blocks per SM keep more copies in flight.)
template <int NT>
struct Cfg {
    static constexpr int STAGES = NT == 16 ? 3 : NT == 32 ? 5 : 4;
    static constexpr int BLOCKS_PER_SM = NT == 16 ? 2 : 1;
    static constexpr int TX = NT * f8::QB;  // one k block of the activation tile
    static constexpr int STAGE = KS * (TW + TX);
};
}  // namespace f8g

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// D[64 x N] (scale_d ? D : 0) + A[64 x 32] · B[32 x N], e4m3 from shared memory (both
// K-major), f32 accumulate: the swap-AB streaming kernel's N = 16, 32, 64 rows.
__device__ __forceinline__ void wgmma_m64n16k32_e4m3(float (&d)[8], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
__device__ __forceinline__ void wgmma_m64n32k32_e4m3(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
__device__ __forceinline__ void wgmma_m64n64k32_e4m3(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
template <int N>
struct WgE4m3;
template <>
struct WgE4m3<16> {
    static __device__ __forceinline__ void mma(float (&d)[8], uint64_t a, uint64_t b, int s) { wgmma_m64n16k32_e4m3(d, a, b, s); }
};
template <>
struct WgE4m3<32> {
    static __device__ __forceinline__ void mma(float (&d)[16], uint64_t a, uint64_t b, int s) { wgmma_m64n32k32_e4m3(d, a, b, s); }
};
template <>
struct WgE4m3<64> {
    static __device__ __forceinline__ void mma(float (&d)[32], uint64_t a, uint64_t b, int s) { wgmma_m64n64k32_e4m3(d, a, b, s); }
};
#endif

// Split-K inside a cluster (the host launches a tile's gridDim.y k chunks as one cluster
// of that many CTAs, at most 8): each CTA parks its partial `tot` in its own idle ring as
// red[col][weight row], then CTA r sums quads [r·Q/ks, (r+1)·Q/ks) of the tile over the
// cluster's partials in ks order (f8_reduce_tile's order and bits) and stores them; no
// global partials, no counters.
template <typename T, int NT>
__device__ __forceinline__ void f8g_cluster_reduce(float* red, const float (&tot)[NT / 2], T* __restrict__ y, int n,
                                                   int r0, int nr, int nb) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace f8g;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    __syncthreads();  // every warpgroup's last wgmma has read the ring
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) {
        const int col = 8 * (j / 4) + 2 * (lane & 3) + (j & 1);
        red[col * BN + 64 * wg + 16 * warp + (lane >> 2) + 8 * ((j >> 1) & 1)] = tot[j];
    }
    cluster_sync();
    const int ks = gridDim.y, rank = static_cast<int>(cluster_ctarank());
    constexpr int Q = BN * NT / 4;
    const uint32_t base = smem_u32(red);
    for (int q = rank * Q / ks + tid; q < (rank + 1) * Q / ks; q += THREADS) {
        const int col = 4 * q / BN, wr = 4 * q % BN;
        float4 v[8];
#pragma unroll
        for (int p = 0; p < 8; ++p)
            if (p < ks) v[p] = ld_cluster_f32x4(cluster_map(base + 16u * q, p));
        float4 sum = v[0];
#pragma unroll
        for (int p = 1; p < 8; ++p)
            if (p < ks) add4(sum, v[p]);
        if (col < nr) {
            f8_store(y, static_cast<size_t>(r0 + col), nb * BN + wr, n, sum.x, sum.y);
            f8_store(y, static_cast<size_t>(r0 + col), nb * BN + wr + 2, n, sum.z, sum.w);
        }
    }
    cluster_sync();  // the other CTAs may still be reading this one's partial
#endif
}

// Tensor maps: x [m][k] (box 128 bytes × NT rows) and w [n][k] (box 128 × 128), u8,
// 128-byte swizzle. grid = (ceil(n / 128), ksplit, ceil(m / NT)), 256 threads, dynamic
// shared memory 1024 + STAGES · STAGE + 8 · STAGES (the host's `stream_wg_smem`).
template <typename T, int NT>
__device__ void fp8_stream_wg(const CUtensorMap* tx, const CUtensorMap* tw, T* __restrict__ y,
                              float* __restrict__ part, unsigned* __restrict__ counters,
                              const float* __restrict__ xs, const float* __restrict__ wsc, int m, int n, int k,
                              int kchunk) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace f8g;
    using C = Cfg<NT>;
    extern __shared__ __align__(1024) unsigned char f8g_smem[];
    __shared__ int last;
    __shared__ f8s::F8sScales scl[C::STAGES];
    const uint32_t sbase = (smem_u32(f8g_smem) + 1023u) & ~1023u;
    const uint32_t full = sbase + C::STAGES * C::STAGE;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int kbs_all = k / f8::QB;
    const int nb = blockIdx.x;
    const int kb0 = blockIdx.y * (kchunk / f8::QB);
    const int nkb = min(kchunk / f8::QB, kbs_all - kb0);
    const int nst = (nkb + KS - 1) / KS;
    const int r0 = blockIdx.z * NT, nr = min(NT, m - r0);

    if (tid == 0) {
        for (int s = 0; s < C::STAGES; ++s) mbar_init(full + 8 * s, 1);
        fence_mbar_init();
    }
    __syncthreads();
    auto issue = [&](int i) {  // k blocks kb0 + KS·i .. into slot i % STAGES
        const int st = i % C::STAGES;
        if (tid == 0) {
            const uint32_t dst = sbase + st * C::STAGE;
            mbar_arrive_expect_tx(full + 8 * st, C::STAGE);
#pragma unroll
            for (int kbl = 0; kbl < KS; ++kbl) {
                const int kk = (kb0 + KS * i + kbl) * f8::QB;
                tma_load_2d(dst + kbl * TW, tw, kk, nb * BN, full + 8 * st);
                tma_load_2d(dst + KS * TW + kbl * C::TX, tx, kk, r0, full + 8 * st);
            }
        }
        if (tid < KS * NT) {
            const int kbl = tid / NT, r = tid % NT, kb = kb0 + KS * i + kbl;
            if (r < nr && kb < kb0 + nkb)
                cp_async_4(smem_u32(&scl[st].x[kbl][r]), xs + static_cast<size_t>(r0 + r) * kbs_all + kb, 4);
        } else if (tid >= THREADS - KS) {
            const int kbl = tid - (THREADS - KS), kb = kb0 + KS * i + kbl;
            if (kb < kb0 + nkb) cp_async_4(smem_u32(&scl[st].w[kbl]), wsc + static_cast<size_t>(nb) * kbs_all + kb, 4);
        }
    };
    for (int i = 0; i < C::STAGES - 1; ++i) {
        if (i < nst) issue(i);
        cp_async_commit();
    }
    // D fragment j of a thread: weight row 64·wg + 16·warp + lane / 4 (+8 for j % 4 ≥ 2),
    // activation row 8·(j / 4) + 2·(lane % 4) + j % 2.
    constexpr int NA = NT / 2;
    float acc[NA], tot[NA];
#pragma unroll
    for (int j = 0; j < NA; ++j) acc[j] = tot[j] = 0.f;
    for (int i = 0; i < nst; ++i) {
        cp_async_wait<C::STAGES - 2>();
        __syncthreads();  // scales of stage i landed; every warp is done with slot (i - 1)
        if (i + C::STAGES - 1 < nst) issue(i + C::STAGES - 1);
        cp_async_commit();
        const int st = i % C::STAGES;
        const uint32_t wt = sbase + st * C::STAGE, xt = wt + KS * TW;
        mbar_wait(full + 8 * st, (i / C::STAGES) & 1);
#pragma unroll
        for (int kbl = 0; kbl < KS; ++kbl) {
            if (KS * i + kbl >= nkb) break;
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
            for (int j = 0; j < NA; ++j) {
                const int col = 8 * (j / 4) + 2 * (lane & 3) + (j & 1);
                tot[j] = fmaf(acc[j], (col < nr ? scl[st].x[kbl][col] : 0.f) * swv, tot[j]);
            }
        }
    }
    cp_async_wait<0>();
    const int ks = gridDim.y;
    if (ks > 1 && cluster_nctarank() > 1) {
        f8g_cluster_reduce<T, NT>(reinterpret_cast<float*>(f8g_smem + (sbase - smem_u32(f8g_smem))), tot, y, n, r0, nr,
                                  nb);
        return;
    }
    const int wrow = nb * BN + 64 * wg + 16 * warp + (lane >> 2);
    T* const yo = ks == 1 ? y : nullptr;
    float* const po = ks == 1 ? nullptr : part + static_cast<size_t>(blockIdx.y) * m * n;
#pragma unroll
    for (int j = 0; j < NA; ++j) {
        const int col = 8 * (j / 4) + 2 * (lane & 3) + (j & 1), row = wrow + 8 * ((j >> 1) & 1);
        if (col >= nr || row >= n) continue;
        const size_t at = (static_cast<size_t>(r0) + col) * n + row;
        if (ks == 1)
            yo[at] = from_f32<T>(tot[j]);
        else
            po[at] = tot[j];
    }
    if (ks == 1) return;
    __threadfence();
    __syncthreads();
    unsigned* counter = counters + blockIdx.z * gridDim.x + blockIdx.x;
    if (tid == 0) last = atomicAdd(counter, 1u) == static_cast<unsigned>(ks - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    f8_reduce_tile(y, part, m, n, r0, nr, nb * BN, min(BN, n - nb * BN), ks, tid, THREADS);
    if (tid == 0) *counter = 0;
#else
    __trap();
#endif
}
