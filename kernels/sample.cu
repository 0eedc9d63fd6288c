// Sampling on the device: for each sampled row, the token that mlaserve_core::sample_token
// (crates/mlaserve-core/src/sampling.rs states the rule) picks from the row's f32 logits
// with the row's temperature, top-k, top-p and uniform u. A cluster of CL = 4 blocks per
// row, each over a contiguous quarter of the ids (its slice); only the ids leave the GPU.
// (One H200, vocabulary 129280: CL = 8 was faster for one row, 32 / 158 / 103 µs against
// 45 / 265 / 156 µs for T = 1 / top-p / top-k + top-p, but slower at 256 rows, 676 / 2911 /
// 1886 µs against 592 / 2554 / 1470; one block per row took 129 / 818 / 427 µs and
// 550 / 2444 / 1250 µs.)
//
// The rule, as this kernel runs it:
//   candidates  non-NaN ids; none, or a largest logit of ±inf: the argmax rule.
//   top-k       the k first by (logit descending in IEEE total order, id ascending).
//   p_i         exp(((l_i - max) as f32) as f64 / T), f64.
//   top-p       the smallest prefix, in the same order, whose summed p reaches top_p * Z.
//   draw        the first kept id, ascending, whose cumulative p exceeds u * (kept sum).
// Order without sorting: a float's bits map to a u32 key that orders like the IEEE total
// order (`fkey`). The k-th key (by count) and the nucleus cut (by mass) are found by a
// search over the key, 4 bits per pass from the top: a pass sums, over the candidates in
// the current range, the count and the mass at or above each of the 16 next digits (16
// accumulators in registers, no atomics), and keeps the largest digit that still reaches
// the target. At most 8 passes give the exact cut key; the candidates at that key are tied
// (the same logit, the same p), and the lowest ids among them are taken, counted in id
// order. A pass reads the row again but computes exp only for candidates in its range,
// so after the first pass it is cheap. After a top-k cut of at most LIST_CAP ids, the
// candidates are compacted (in id order) into shared memory and every later pass runs
// there.
//
// Cluster: every block reduces its slice as one block did the whole row; the cluster's
// totals are the blocks' values read through distributed shared memory and combined in
// block-rank order (`cl_*`), so every block of the cluster takes the same decisions. A
// block's compacted list (after a top-k cut) holds its slice's candidates; the
// inverse-CDF pass starts each block at the kept mass of the slices before it.
//
// Determinism: every sum runs in a fixed order (per thread in its element order, a fixed
// shuffle tree per warp, warps in order, blocks in rank order), so a row's token never
// depends on timing or on the other rows. Sums are f64 of the unnormalised p like the reference's, in another
// order, so the device and the reference can differ only where a cumulative sum lies
// within rounding of top_p * Z or of u * (kept sum) — never for sums that are exact (equal
// or integral weights); every comparison of logits is exact.
#include <cooperative_groups.h>

#include "common.cuh"

namespace cg = cooperative_groups;

namespace smp {
constexpr int THREADS = 512;
constexpr int CL = 4;  // blocks per row (a cluster)
constexpr int WARPS = THREADS / 32;
// Candidates kept in shared memory after a top-k cut (key + id: 32 KiB).
constexpr int LIST_CAP = 4096;
// Consecutive candidates per thread in the inverse-CDF pass (one tile = THREADS * RUN).
constexpr int RUN = 8;
constexpr int NONE = 0x7fffffff;
constexpr unsigned FULL = 0xffffffffu;
constexpr uint32_t KEY_NEG_INF = 0x007fffffu;  // fkey(-inf): the smallest non-NaN key
constexpr uint32_t KEY_POS_INF = 0xff800000u;  // fkey(+inf): the largest

// Order-preserving key of a non-NaN float's bits: a < b in IEEE total order (-0 < +0)
// <=> fkey(a) < fkey(b).
__device__ __forceinline__ uint32_t fkey(uint32_t b) { return (b & 0x80000000u) ? ~b : (b | 0x80000000u); }
__device__ __forceinline__ float key_float(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ bool nan_bits(uint32_t b) { return (b & 0x7fffffffu) > 0x7f800000u; }

// The rule's unnormalised probability: the f32 difference, then f64.
__device__ __forceinline__ double weight(float v, float mx, double t) {
    return exp(static_cast<double>(__fsub_rn(v, mx)) / t);
}

struct Smem {
    uint32_t keys[LIST_CAP];
    int ids[LIST_CAP];
    double wsum[WARPS][16];
    uint32_t wcnt[WARPS][16];
    double sum[16];
    uint32_t cnt[16];
    double wpart[WARPS];
    double wexcl[WARPS];
    double total;
    int wcount[WARPS];
    uint32_t wkey[WARPS];
    int wa[WARPS], wb[WARPS], wc[WARPS];
    int found;
    // What this block offers its cluster (read by every block through DSMEM), and the
    // cluster's combined values.
    double xd;
    int xi[3];
    uint32_t xk;
    double gsum[16];
    uint32_t gcnt[16];
};

// The cluster's sum of one double per block (every thread passes its block's value, the
// same in every thread), in block-rank order; every thread gets it.
__device__ __forceinline__ double cl_sum(double v, Smem& sh) {
    cg::cluster_group cl = cg::this_cluster();
    if (threadIdx.x == 0) sh.xd = v;
    cl.sync();
    double t = 0.0;
    for (int r = 0; r < CL; ++r) t += cl.map_shared_rank(&sh.xd, r)[0];
    cl.sync();  // every block has read every xd before one changes
    return t;
}

// The cluster's exclusive prefix (blocks of lower rank) and total of one double per block.
__device__ __forceinline__ double cl_exclusive(double v, double& total, Smem& sh) {
    cg::cluster_group cl = cg::this_cluster();
    const int me = static_cast<int>(cl.block_rank());
    if (threadIdx.x == 0) sh.xd = v;
    cl.sync();
    double t = 0.0, before = 0.0;
    for (int r = 0; r < CL; ++r) {
        if (r == me) before = t;
        t += cl.map_shared_rank(&sh.xd, r)[0];
    }
    cl.sync();
    total = t;
    return before;
}

// The cluster's exclusive prefix and total of one int per block (rank order).
__device__ __forceinline__ int cl_exclusive_int(int v, int& total, Smem& sh) {
    cg::cluster_group cl = cg::this_cluster();
    const int me = static_cast<int>(cl.block_rank());
    if (threadIdx.x == 0) sh.xi[0] = v;
    cl.sync();
    int t = 0, before = 0;
    for (int r = 0; r < CL; ++r) {
        if (r == me) before = t;
        t += cl.map_shared_rank(&sh.xi[0], r)[0];
    }
    cl.sync();
    total = t;
    return before;
}

// The cluster's minimum (MIN) or maximum of one int per block.
template <bool MIN>
__device__ __forceinline__ int cl_minmax(int v, Smem& sh) {
    cg::cluster_group cl = cg::this_cluster();
    if (threadIdx.x == 0) sh.xi[1] = v;
    cl.sync();
    int m = v;
    for (int r = 0; r < CL; ++r) {
        const int x = cl.map_shared_rank(&sh.xi[1], r)[0];
        m = MIN ? (x < m ? x : m) : (x > m ? x : m);
    }
    cl.sync();
    return m;
}

// The row's candidates: non-NaN ids that pass the top-k cut (key > tk_key, or key ==
// tk_key and id <= tk_id). Without a cut, tk_key = 0 (below every non-NaN key).
struct RowSrc {
    const float* __restrict__ row;
    int lo;  // this block's slice: ids lo .. lo + n
    int n;
    uint32_t tk_key;
    int tk_id;
    __device__ __forceinline__ bool get(int i, int& id, uint32_t& key, float& v) const {
        i += lo;
        const uint32_t b = __float_as_uint(row[i]);
        id = i;
        v = __uint_as_float(b);
        key = fkey(b);
        return !nan_bits(b) && (key > tk_key || (key == tk_key && i <= tk_id));
    }
};

// Candidates compacted into shared memory, in id order.
struct ListSrc {
    const uint32_t* keys;
    const int* ids;
    int n;
    __device__ __forceinline__ bool get(int i, int& id, uint32_t& key, float& v) const {
        key = keys[i];
        id = ids[i];
        v = key_float(key);
        return true;
    }
};

// Candidate i of src (i may be past its end: false), its id and key.
template <class Src>
__device__ __forceinline__ bool cand_at(const Src& src, int i, int& id, uint32_t& key) {
    float v;
    return i < src.n && src.get(i, id, key, v);
}

// A cut of the candidates: kept = key > tau, or key == tau and id <= id_cut; `mass` is
// the kept candidates' summed weight (mass searches only).
struct Cut {
    uint32_t tau;
    int id_cut;
    double mass;
};

// Rank of this thread among the flagged threads before it (thread order) and the number
// of flagged threads in the block. Every thread must call it.
__device__ __forceinline__ int block_rank(bool flag, int& total, Smem& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned bal = __ballot_sync(FULL, flag);
    if (lane == 0) sh.wcount[warp] = __popc(bal);
    __syncthreads();
    int off = 0, tot = 0;
    for (int w = 0; w < WARPS; ++w) {
        const int c = sh.wcount[w];
        off += w < warp ? c : 0;
        tot += c;
    }
    __syncthreads();
    total = tot;
    return off + __popc(bal & ((1u << lane) - 1u));
}

// Sum over the block in a fixed order; every thread gets the same value.
__device__ __forceinline__ double block_sum(double x, Smem& sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL, x, o);
    if ((threadIdx.x & 31) == 0) sh.wpart[threadIdx.x >> 5] = x;
    __syncthreads();
    double t = 0.0;
    for (int w = 0; w < WARPS; ++w) t += sh.wpart[w];
    __syncthreads();
    return t;
}

// Exclusive prefix sum over the threads (thread order, fixed association); `total` = the
// block's sum. Every thread must call it.
__device__ __forceinline__ double block_exclusive(double x, double& total, Smem& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    double inc = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double y = __shfl_up_sync(FULL, inc, o);
        if (lane >= o) inc = y + inc;
    }
    double excl = __shfl_up_sync(FULL, inc, 1);
    if (lane == 0) excl = 0.0;
    if (lane == 31) sh.wpart[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        const double v = lane < WARPS ? sh.wpart[lane] : 0.0;
        double vi = v;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const double y = __shfl_up_sync(FULL, vi, o);
            if (lane >= o) vi = y + vi;
        }
        double ve = __shfl_up_sync(FULL, vi, 1);
        if (lane == 0) ve = 0.0;
        if (lane < WARPS) sh.wexcl[lane] = ve;
        if (lane == WARPS - 1) sh.total = vi;
    }
    __syncthreads();
    const double r = sh.wexcl[warp] + excl;
    total = sh.total;
    __syncthreads();
    return r;
}

// Block totals of the 16 per-thread accumulators into sh.cnt / sh.sum.
template <bool MASS>
__device__ __forceinline__ void reduce16(const uint32_t (&c)[16], const double (&m)[16], Smem& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const uint32_t cj = __reduce_add_sync(FULL, c[j]);
        double mj = m[j];
        if (MASS) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mj += __shfl_xor_sync(FULL, mj, o);
        }
        if (lane == 0) {
            sh.wcnt[warp][j] = cj;
            if (MASS) sh.wsum[warp][j] = mj;
        }
    }
    __syncthreads();
    if (threadIdx.x < 16) {
        uint32_t cj = 0;
        double mj = 0.0;
        for (int w = 0; w < WARPS; ++w) {
            cj += sh.wcnt[w][threadIdx.x];
            if (MASS) mj += sh.wsum[w][threadIdx.x];
        }
        sh.cnt[threadIdx.x] = cj;
        sh.sum[threadIdx.x] = mj;
    }
    // The cluster's totals, blocks in rank order, into gcnt / gsum.
    cg::cluster_group cl = cg::this_cluster();
    cl.sync();
    if (threadIdx.x < 16) {
        uint32_t cj = 0;
        double mj = 0.0;
        for (int r = 0; r < CL; ++r) {
            cj += cl.map_shared_rank(&sh.cnt[threadIdx.x], r)[0];
            if (MASS) mj += cl.map_shared_rank(&sh.sum[threadIdx.x], r)[0];
        }
        sh.gcnt[threadIdx.x] = cj;
        sh.gsum[threadIdx.x] = mj;
    }
    cl.sync();  // every block has read every cnt / sum; gcnt / gsum are visible
}

// The id of the j-th (1-based) candidate of this block's source, in id order, whose key
// is tau; NONE if there are fewer.
template <class Src>
__device__ int nth_with_key_local(const Src& src, uint32_t tau, int j, Smem& sh) {
    if (threadIdx.x == 0) sh.found = NONE;
    int seen = 0;
    for (int base = 0; base < src.n && seen < j; base += THREADS) {
        int id = 0;
        uint32_t key = 0;
        const bool f = cand_at(src, base + threadIdx.x, id, key) && key == tau;
        int tile;
        const int r = block_rank(f, tile, sh);
        if (f && seen + r + 1 == j) sh.found = id;
        seen += tile;
    }
    __syncthreads();
    const int id = sh.found;
    __syncthreads();
    return id;
}

// The id of the j-th (1-based) candidate of the cluster's sources, in id order, whose key
// is tau; NONE if there are fewer. Every block of the cluster gets it.
template <class Src>
__device__ int nth_with_key(const Src& src, uint32_t tau, int j, Smem& sh) {
    // This block's count of such candidates, then the j-th's block finds it locally.
    int mine = 0;
    for (int base = 0; base < src.n; base += THREADS) {
        int id = 0;
        uint32_t key = 0;
        mine += __syncthreads_count(cand_at(src, base + threadIdx.x, id, key) && key == tau);
    }
    int all;
    const int before = cl_exclusive_int(mine, all, sh);
    int local = NONE;
    if (j > before && j <= before + mine) local = nth_with_key_local(src, tau, j - before, sh);
    return cl_minmax<true>(local, sh);
}

// The cut by count (MASS = false: the `want` first candidates in (key desc, id asc)
// order) or by mass (MASS = true: the smallest such prefix whose weight reaches top_p * Z;
// Z = the candidates' total weight, summed in the first pass).
template <bool MASS, class Src>
__device__ Cut search(const Src& src, Smem& sh, float mx, double t, uint32_t want, float top_p) {
    uint32_t prefix = 0, mask = 0, above_c = 0;
    double above_m = 0.0, target = 0.0;
    for (int shift = 28;; shift -= 4) {
        uint32_t c[16];
        double m[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            c[j] = 0;
            m[j] = 0.0;
        }
        for (int i = threadIdx.x; i < src.n; i += THREADS) {
            int id;
            uint32_t key;
            float v;
            if (!src.get(i, id, key, v) || (key & mask) != prefix) continue;
            const uint32_t d = (key >> shift) & 15u;
            const double w = MASS ? weight(v, mx, t) : 0.0;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const bool ge = d >= static_cast<uint32_t>(j);
                c[j] += ge ? 1u : 0u;
                if (MASS) m[j] += ge ? w : 0.0;
            }
        }
        reduce16<MASS>(c, m, sh);
        // The first pass covers every candidate: Z, and the weight the nucleus must reach.
        if (MASS && mask == 0) target = static_cast<double>(top_p) * sh.gsum[0];
        // The largest digit whose "at or above" total still reaches the target (its bin is
        // then non-empty); if rounding leaves none (mass only), the lowest non-empty bin.
        int d = -1;
        for (int j = 15; j >= 0 && d < 0; --j) {
            const bool ok = MASS ? above_m + sh.gsum[j] >= target : above_c + sh.gcnt[j] >= want;
            if (ok) d = j;
        }
        for (int j = 0; j < 16 && d < 0; ++j) {
            if (sh.gcnt[j] > (j < 15 ? sh.gcnt[j + 1] : 0u)) d = j;
        }
        if (d < 0) d = 0;  // an empty range cannot happen; stay defined
        const uint32_t hi_c = d < 15 ? sh.gcnt[d + 1] : 0u;
        const double hi_m = d < 15 ? sh.gsum[d + 1] : 0.0;
        const uint32_t bin = sh.gcnt[d] - hi_c;
        const double at_or_above = above_m + sh.gsum[d];
        // Exact fill (count), or a single candidate in the bin (mass): the cut is the bin's
        // lowest key with every candidate at or above it.
        const bool fill = MASS ? bin == 1u : above_c + sh.gcnt[d] == want;
        prefix |= static_cast<uint32_t>(d) << shift;
        mask |= 15u << shift;
        above_c += hi_c;
        above_m += hi_m;
        __syncthreads();  // sh.gcnt / sh.gsum are read by every thread before they change
        if (fill) return Cut{prefix, NONE, at_or_above};
        if (shift == 0) {
            // prefix is the cut key; its `bin` candidates are tied. Take the j lowest ids.
            int j;
            double q = 0.0;
            if (MASS) {
                q = weight(key_float(prefix), mx, t);
                int lo = 1, hi = static_cast<int>(bin);
                while (lo < hi) {
                    const int mid = (lo + hi) / 2;
                    if (above_m + static_cast<double>(mid) * q >= target) {
                        hi = mid;
                    } else {
                        lo = mid + 1;
                    }
                }
                j = lo;
            } else {
                j = static_cast<int>(want - above_c);
            }
            const double mass = above_m + static_cast<double>(j) * q;
            if (j >= static_cast<int>(bin)) return Cut{prefix, NONE, mass};
            return Cut{prefix, nth_with_key(src, prefix, j, sh), mass};
        }
    }
}

// Compacts this block's candidates (at most LIST_CAP: the cluster's are) into sh.keys /
// sh.ids, in id order; returns their number.
template <class Src>
__device__ int compact(const Src& src, Smem& sh) {
    int n = 0;
    for (int base = 0; base < src.n; base += THREADS) {
        int id = 0;
        uint32_t key = 0;
        const bool f = cand_at(src, base + threadIdx.x, id, key);
        int tile;
        const int r = block_rank(f, tile, sh);
        if (f && n + r < LIST_CAP) {
            sh.keys[n + r] = key;
            sh.ids[n + r] = id;
        }
        n += tile;
    }
    __syncthreads();
    return n < LIST_CAP ? n : LIST_CAP;
}

// Top-p, then the inverse-CDF draw in id order, over src's candidates (n_cand of them).
template <class Src>
__device__ int draw(const Src& src, int n_cand, float mx, double t, float top_p, double u, Smem& sh) {
    uint32_t tp_key = 0;
    int tp_id = NONE;
    double z2, kept = -1.0;  // kept: this slice's kept mass, once known
    if (top_p < 1.0f && n_cand > 1) {
        const Cut c = search<true>(src, sh, mx, t, 0u, top_p);
        tp_key = c.tau;
        tp_id = c.id_cut;
        z2 = c.mass;
    } else {
        double z = 0.0;
        for (int i = threadIdx.x; i < src.n; i += THREADS) {
            int id;
            uint32_t key;
            float v;
            if (src.get(i, id, key, v)) z += weight(v, mx, t);
        }
        kept = block_sum(z, sh);  // every candidate is kept
        z2 = cl_sum(kept, sh);
    }
    // This block starts at the kept mass of the slices before it (each slice's sum in its
    // own fixed order, the slices in rank order).
    if (kept < 0.0) {
        double k = 0.0;
        for (int i = threadIdx.x; i < src.n; i += THREADS) {
            int id;
            uint32_t key;
            float v;
            if (src.get(i, id, key, v) && (key > tp_key || (key == tp_key && id <= tp_id))) k += weight(v, mx, t);
        }
        kept = block_sum(k, sh);
    }
    double all_kept;
    double carry = cl_exclusive(kept, all_kept, sh);
    // Tiles of THREADS * RUN candidates; thread t owns RUN consecutive ones, so the
    // cumulative sum runs in id order: carry + the threads before + its own so far. The
    // first id past the limit in this slice; the cluster's answer is the lowest block's
    // (a later block's first id with weight is past the limit too).
    const double limit = u * z2;
    if (threadIdx.x == 0) sh.found = NONE;
    int hit_id = NONE;
    int last = -1;  // the largest kept id with weight (the fallback when rounding leaves the limit above)
    for (int base = 0; base < src.n; base += THREADS * RUN) {
        double q[RUN];
        int qid[RUN];
        double local = 0.0;
#pragma unroll
        for (int e = 0; e < RUN; ++e) {
            const int i = base + threadIdx.x * RUN + e;
            int id = 0;
            uint32_t key = 0;
            float v = 0.0f;
            q[e] = 0.0;
            qid[e] = NONE;
            if (i < src.n && src.get(i, id, key, v) && (key > tp_key || (key == tp_key && id <= tp_id))) {
                q[e] = weight(v, mx, t);
                qid[e] = id;
                if (q[e] > 0.0) last = id > last ? id : last;
            }
            local += q[e];
        }
        double tile;
        double run = carry + block_exclusive(local, tile, sh);
        int hit = NONE;
#pragma unroll
        for (int e = 0; e < RUN; ++e) {
            run += q[e];
            if (hit == NONE && q[e] > 0.0 && limit < run) hit = qid[e];
        }
        if (hit != NONE) atomicMin(&sh.found, hit);
        __syncthreads();
        const int f = sh.found;
        __syncthreads();
        if (f != NONE) {
            hit_id = f;
            break;
        }
        carry += tile;
    }
    hit_id = cl_minmax<true>(hit_id, sh);
    // Rounding left the limit above the last cumulative sum: the last kept id with weight.
    last = __reduce_max_sync(FULL, last);
    if ((threadIdx.x & 31) == 0) sh.wa[threadIdx.x >> 5] = last;
    __syncthreads();
    int m = -1;
    for (int w = 0; w < WARPS; ++w) m = sh.wa[w] > m ? sh.wa[w] : m;
    __syncthreads();
    m = cl_minmax<false>(m, sh);
    if (hit_id != NONE) return hit_id;
    return m < 0 ? 0 : m;
}
}  // namespace smp

// out[r] = the sampled token of logits[r][0..vocab) under params[4r..4r+4) = (temperature,
// top_k, top_p, u), all as f64 (the f32 and u32 values are exact in f64). grid = rows × CL
// blocks of 512 threads, a cluster of CL per row; block rank b takes ids [b·S, (b+1)·S),
// S = ceil(vocab / CL).
extern "C" __global__ void __cluster_dims__(smp::CL, 1, 1) __launch_bounds__(smp::THREADS)
    sample_f32(const float* __restrict__ logits, int vocab, const double* __restrict__ params, int* __restrict__ out) {
    using namespace smp;
    __shared__ Smem sh;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r_row = blockIdx.x / CL;
    const int rank = static_cast<int>(cg::this_cluster().block_rank());
    const int per = (vocab + CL - 1) / CL;
    const int lo = min(vocab, rank * per), hi = min(vocab, lo + per);
    const float* row = logits + static_cast<size_t>(r_row) * vocab;
    const double* p = params + 4 * static_cast<size_t>(r_row);
    const float temp = static_cast<float>(p[0]);
    const uint32_t top_k = static_cast<uint32_t>(p[1]);
    const float top_p = static_cast<float>(p[2]);
    const double u = p[3];
    const double t = (temp > 0.0f && temp <= 3.402823466e38f) ? static_cast<double>(temp) : 1.0;

    // 1. Candidates: their number, the largest key, and what the argmax rule needs.
    uint32_t mk = 0;
    int nv = 0, first_pinf = NONE, first_valid = NONE;
    for (int i = lo + threadIdx.x; i < hi; i += THREADS) {
        const uint32_t b = __float_as_uint(row[i]);
        if (nan_bits(b)) continue;
        ++nv;
        const uint32_t k = fkey(b);
        mk = k > mk ? k : mk;
        if (b == 0x7f800000u && i < first_pinf) first_pinf = i;
        if (i < first_valid) first_valid = i;
    }
    mk = __reduce_max_sync(FULL, mk);
    nv = __reduce_add_sync(FULL, nv);
    first_pinf = __reduce_min_sync(FULL, first_pinf);
    first_valid = __reduce_min_sync(FULL, first_valid);
    if (lane == 0) {
        sh.wkey[warp] = mk;
        sh.wa[warp] = nv;
        sh.wb[warp] = first_pinf;
        sh.wc[warp] = first_valid;
    }
    __syncthreads();
    mk = 0;
    nv = 0;
    first_pinf = NONE;
    first_valid = NONE;
    for (int w = 0; w < WARPS; ++w) {
        mk = sh.wkey[w] > mk ? sh.wkey[w] : mk;
        nv += sh.wa[w];
        first_pinf = sh.wb[w] < first_pinf ? sh.wb[w] : first_pinf;
        first_valid = sh.wc[w] < first_valid ? sh.wc[w] : first_valid;
    }
    __syncthreads();
    // The cluster's: the largest key, the count, the first +inf and first valid ids.
    {
        cg::cluster_group cl = cg::this_cluster();
        if (threadIdx.x == 0) {
            sh.xk = mk;
            sh.xi[0] = nv;
            sh.xi[1] = first_pinf;
            sh.xi[2] = first_valid;
        }
        cl.sync();
        mk = 0;
        nv = 0;
        first_pinf = NONE;
        first_valid = NONE;
        for (int r = 0; r < CL; ++r) {
            const uint32_t k = cl.map_shared_rank(&sh.xk, r)[0];
            const int* x = cl.map_shared_rank(&sh.xi[0], r);
            mk = k > mk ? k : mk;
            nv += x[0];
            first_pinf = x[1] < first_pinf ? x[1] : first_pinf;
            first_valid = x[2] < first_valid ? x[2] : first_valid;
        }
        cl.sync();
    }
    int tok;
    if (nv == 0) {
        tok = 0;  // all NaN
    } else if (mk == KEY_POS_INF) {
        tok = first_pinf;  // the argmax: the first +inf
    } else if (mk == KEY_NEG_INF) {
        tok = first_valid;  // NaN and -inf only: the first non-NaN
    } else {
        const float mx = key_float(mk);
        // 2. Top-k by count over the whole row, then the candidates it keeps.
        RowSrc src{row, lo, hi - lo, 0u, NONE};
        int n_cand = nv;
        if (top_k > 0u && top_k < static_cast<uint32_t>(nv)) {
            const Cut c = search<false>(src, sh, mx, t, top_k, 0.0f);
            src.tk_key = c.tau;
            src.tk_id = c.id_cut;
            n_cand = static_cast<int>(top_k);
        }
        // 3. Top-p and the draw, over a shared-memory list when the candidates fit.
        if (n_cand <= LIST_CAP) {
            const int n = compact(src, sh);
            tok = draw(ListSrc{sh.keys, sh.ids, n}, n_cand, mx, t, top_p, u, sh);
        } else {
            tok = draw(src, n_cand, mx, t, top_p, u, sh);
        }
    }
    if (threadIdx.x == 0 && rank == 0) out[r_row] = tok;
}
