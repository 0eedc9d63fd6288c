// What happens to a logits row between the head and the token choice
// (crates/mlaserve-core/src/logits.rs states the rules; the CPU backend is the reference):
//
//   logit_edit_f32     a request's logit bias and repetition / frequency / presence
//                      penalties, one thread per (row, token) edit, in place.
//   min_p_mask_f32     min-p for sampled rows: ids whose weight exp((l - max) / T) is below
//                      min_p become -inf (no mass, never drawn), in place.
//   logprobs_f32       the raw row's log-softmax at the chosen id and at the row's top n.
//
// Every sum runs in a fixed order (per thread in its element order, a fixed shuffle tree
// per warp, warps in order), so results never depend on timing or on the other rows.
#include "common.cuh"

namespace lgt {
constexpr int THREADS = 512;
constexpr int WARPS = THREADS / 32;
constexpr int MAX_TOP = 20;
constexpr unsigned FULL = 0xffffffffu;

__device__ __forceinline__ bool is_nan(float v) { return v != v; }

// Order-preserving key of a float's bits (IEEE total order: -0 < +0).
__device__ __forceinline__ uint32_t fkey(float v) {
    const uint32_t b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Block maximum of the row's non-NaN values (-inf when none), in every thread.
__device__ float row_max(const float* __restrict__ row, int vocab) {
    __shared__ float sm[WARPS];
    float m = -MLAS_INF;
    for (int i = threadIdx.x; i < vocab; i += THREADS) m = fmaxf(m, row[i]);  // fmaxf drops NaN
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, o));
    if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = m;
    __syncthreads();
    float r = sm[0];
    for (int w = 1; w < WARPS; ++w) r = fmaxf(r, sm[w]);
    __syncthreads();
    return r;
}

// Block sum of per-thread f64 values, in a fixed order, in every thread.
__device__ double block_sum(double v) {
    __shared__ double sm[WARPS];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = v;
    __syncthreads();
    double r = 0.0;
    for (int w = 0; w < WARPS; ++w) r += sm[w];
    __syncthreads();
    return r;
}

// (key, id) ranks before (bk, bi) in the order logit descending, id ascending.
__device__ __forceinline__ bool before(uint32_t k, int i, uint32_t bk, int bi) {
    return k > bk || (k == bk && i < bi);
}
}  // namespace lgt

// For e < n: logits[row[e] * vocab + tok[e] - offset] = edit of it with vals[3e..3e+3] =
// (bias, repetition, sub) — l + bias, then / repetition if positive else * repetition
// (repetition 1: untouched), then - sub. Tokens outside [offset, offset + vocab) are this
// rank's neighbours' (the vocabulary-parallel argmax) and are skipped. grid * block >= n.
extern "C" __global__ void logit_edit_f32(float* __restrict__ logits, int vocab, int offset,
                                          const int* __restrict__ row, const int* __restrict__ tok,
                                          const float* __restrict__ vals, int n) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const int t = tok[e] - offset;
    if (t < 0 || t >= vocab) return;
    float* p = logits + static_cast<size_t>(row[e]) * vocab + t;
    const float bias = vals[3 * e], rep = vals[3 * e + 1], sub = vals[3 * e + 2];
    float l = __fadd_rn(*p, bias);
    if (rep != 1.f) l = l > 0.f ? __fdiv_rn(l, rep) : __fmul_rn(l, rep);
    *p = __fsub_rn(l, sub);
}

// Row r (one block each): with (T, min_p) = params[2r], params[2r + 1] and min_p > 0, every
// id whose weight exp(((l - max) as f32) as f64 / T) is below min_p gets -inf (max: the
// row's largest non-NaN logit; a row whose max is not finite is left alone, the argmax
// rule decides it). grid = rows, 512 threads.
extern "C" __global__ void __launch_bounds__(lgt::THREADS)
    min_p_mask_f32(float* __restrict__ logits, int vocab, const double* __restrict__ params) {
    const double t = params[2 * blockIdx.x], min_p = params[2 * blockIdx.x + 1];
    if (!(min_p > 0.0)) return;
    float* row = logits + static_cast<size_t>(blockIdx.x) * vocab;
    const float mx = lgt::row_max(row, vocab);
    if (!isfinite(mx)) return;
    for (int i = threadIdx.x; i < vocab; i += lgt::THREADS) {
        const float v = row[i];
        if (!lgt::is_nan(v) && exp(static_cast<double>(__fsub_rn(v, mx)) / t) < min_p) row[i] = -MLAS_INF;
    }
}

// Row r (one block each) of raw logits: lp[r] = logprob of id chosen[r]; for j < top[r]
// (at most 20): top_id[20r + j], top_lp[20r + j] = the j-th id in the order (logit
// descending, id ascending; NaN never) and its logprob. logprob_i = (l_i - m) as f64 -
// ln sum_j exp((l_j - m) as f64), m the largest non-NaN logit; when m is not finite: 0 for
// the ids equal to m, -inf for the others, NaN for NaN. grid = rows, 512 threads.
extern "C" __global__ void __launch_bounds__(lgt::THREADS)
    logprobs_f32(const float* __restrict__ logits, int vocab, const int* __restrict__ chosen,
                 const int* __restrict__ top, float* __restrict__ lp, int* __restrict__ top_id,
                 float* __restrict__ top_lp) {
    using namespace lgt;
    __shared__ uint32_t wk[WARPS];
    __shared__ int wi[WARPS];
    const float* row = logits + static_cast<size_t>(blockIdx.x) * vocab;
    const float m = row_max(row, vocab);
    double lz = 0.0;
    if (isfinite(m)) {
        double s = 0.0;
        for (int i = threadIdx.x; i < vocab; i += THREADS) {
            const float v = row[i];
            if (!is_nan(v)) s += exp(static_cast<double>(__fsub_rn(v, m)));
        }
        lz = log(block_sum(s));
    }
    auto logprob = [&](float v) -> float {
        if (is_nan(v)) return v;
        if (!isfinite(m)) return v == m ? 0.f : -MLAS_INF;
        return static_cast<float>(static_cast<double>(__fsub_rn(v, m)) - lz);
    };
    if (threadIdx.x == 0) {
        const int c = chosen[blockIdx.x];
        lp[blockIdx.x] = (c >= 0 && c < vocab) ? logprob(row[c]) : __int_as_float(0x7fc00000);
    }
    const int n = min(top[blockIdx.x], MAX_TOP);
    if (threadIdx.x == 0)
        for (int j = 0; j < MAX_TOP; ++j) top_id[MAX_TOP * blockIdx.x + j] = -1;  // -1: none
    // The j-th: the best (key, id) ranking after the (j-1)-th.
    uint32_t pk = 0xffffffffu;
    int pi = -1;
    for (int j = 0; j < n; ++j) {
        uint32_t bk = 0;
        int bi = 0x7fffffff;
        for (int i = threadIdx.x; i < vocab; i += THREADS) {
            const float v = row[i];
            if (is_nan(v)) continue;
            const uint32_t k = fkey(v);
            const bool after_prev = k < pk || (k == pk && i > pi);
            if (after_prev && before(k, i, bk, bi)) {
                bk = k;
                bi = i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const uint32_t ok = __shfl_xor_sync(FULL, bk, o);
            const int oi = __shfl_xor_sync(FULL, bi, o);
            if (before(ok, oi, bk, bi)) {
                bk = ok;
                bi = oi;
            }
        }
        if ((threadIdx.x & 31) == 0) {
            wk[threadIdx.x >> 5] = bk;
            wi[threadIdx.x >> 5] = bi;
        }
        __syncthreads();
        bk = wk[0];
        bi = wi[0];
        for (int w = 1; w < WARPS; ++w)
            if (before(wk[w], wi[w], bk, bi)) {
                bk = wk[w];
                bi = wi[w];
            }
        __syncthreads();
        if (bi == 0x7fffffff) break;  // fewer non-NaN ids than asked
        if (threadIdx.x == 0) {
            top_id[MAX_TOP * blockIdx.x + j] = bi;
            top_lp[MAX_TOP * blockIdx.x + j] = logprob(row[bi]);
        }
        pk = bk;
        pi = bi;
    }
}
