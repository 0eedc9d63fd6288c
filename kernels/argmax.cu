// Greedy decoding on the device: the index of each row's largest logit, ties to the
// lowest index (as the CPU backend's first-maximum scan), NaN never wins. Only the
// indices cross PCIe, never the full logits.
#include "common.cuh"

namespace amax {
constexpr int THREADS = 512;

// (v, i) better than (bv, bi)?
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// Block-wide best (value, index) of row blockIdx.x, valid in thread 0 (index 0x7fffffff
// when the row holds only NaN).
template <typename T>
__device__ __forceinline__ void best_of_row(const T* __restrict__ logits, int vocab, float& bv_out, int& bi_out) {
    __shared__ float sv[THREADS / 32];
    __shared__ int si[THREADS / 32];
    const T* row = logits + static_cast<size_t>(blockIdx.x) * vocab;
    float bv = -MLAS_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += THREADS) {
        const float v = static_cast<float>(row[i]);
        if (better(v, i, bv, bi)) {  // false for NaN
            bv = v;
            bi = i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < THREADS / 32; ++w)
            if (better(sv[w], si[w], bv, bi)) {
                bv = sv[w];
                bi = si[w];
            }
        bv_out = bv;
        bi_out = bi;
    }
}

template <typename T>
__device__ __forceinline__ void body(const T* __restrict__ logits, int* __restrict__ out, int vocab) {
    float bv;
    int bi;
    best_of_row(logits, vocab, bv, bi);
    if (threadIdx.x == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;  // an all-NaN row gives 0
}
}  // namespace amax

// out[r] = argmax(logits[r][0..vocab)); grid = rows, 512 threads.
extern "C" __global__ void __launch_bounds__(amax::THREADS) argmax_f32(const float* logits, int* out, int vocab) {
    amax::body<float>(logits, out, vocab);
}
extern "C" __global__ void __launch_bounds__(amax::THREADS) argmax_bf16(const bf16* logits, int* out, int vocab) {
    amax::body<bf16>(logits, out, vocab);
}

// The vocabulary-parallel form: out[2r] = the row's largest logit, out[2r + 1] = its index
// + offset (this rank's first vocabulary id), as floats (exact below 2^24); an all-NaN row
// gives (NaN, offset). The ranks' pairs, all-gathered, give the group's id by the same
// rule (`argmax_pairs_best` below, or the host). grid = rows.
extern "C" __global__ void __launch_bounds__(amax::THREADS) argmax_pair_f32(const float* logits, float* out, int vocab,
                                                                           int offset) {
    float bv;
    int bi;
    amax::best_of_row<float>(logits, vocab, bv, bi);
    if (threadIdx.x == 0) {
        out[2 * blockIdx.x] = bi == 0x7fffffff ? __int_as_float(0x7fc00000) : bv;
        out[2 * blockIdx.x + 1] = static_cast<float>((bi == 0x7fffffff ? 0 : bi) + offset);
    }
}

// The vocabulary-parallel choice across ranks, on the device: `pairs` holds every rank's
// argmax_pair_f32 output, rank-major ([world][rows][2]); ids[r] = the id of the largest
// value over the ranks in rank order (a later rank only on a strictly larger value, NaN
// skipped, 0 when every value is NaN) — the host's rule (`vocab::best_of_ranks`), so every
// rank of a group gets the same id and can keep it for the next drafting stage. One
// thread per row.
extern "C" __global__ void argmax_pairs_best(const float* pairs, int* ids, int rows, int world) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    bool any = false;
    float bv = 0.f;
    int bi = 0;
    for (int rk = 0; rk < world; ++rk) {
        const size_t at = (static_cast<size_t>(rk) * rows + r) * 2;
        const float v = pairs[at];
        if (!isnan(v) && (!any || v > bv)) {
            any = true;
            bv = v;
            bi = static_cast<int>(pairs[at + 1]);
        }
    }
    ids[r] = bi;
}
