// The per-token kernels of the CUDA backend's forward pass (crates/mlaserve-cuda/src/ops.rs):
// embedding gather, RMSNorm over f32 rows, residual add, conversions and row gathers,
// YaRN RoPE + paged latent-cache write, query absorption (q_lat = W_UK^T q_nope), a
// varlen causal absorbed MLA attention over the paged cache, the W_UV up-projection,
// MoE routing (every variant the config names: topk_method, scoring_func, groups) and the weighted expert combine, and a
// batch-invariant bf16 linear layer.
//
// Every reduction runs in an order fixed by the row's own data (thread-strided partial
// sums, then a fixed tree), never by how many rows share the launch: a token's result is
// bit-identical whatever batch it is in. Activations are f32 between kernels; weights
// and the latent cache are bf16.
#include "common.cuh"
#include "mla_varlen.cuh"
#include "moe_route.cuh"

namespace bops {

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(bf16* p, float v) { *p = __float2bfloat16_rn(v); }
// Four consecutive values at p (16-byte aligned for f32, 8-byte for bf16).
__device__ __forceinline__ void store4(float* p, float a, float b, float c, float d) {
    *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
}
__device__ __forceinline__ void store4(bf16* p, float a, float b, float c, float d) {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf16x2(a, b), pack_bf16x2(c, d));
}
}  // namespace bops

// out[r] = table[tokens[r] - lo] (zeros when the token is outside [lo, lo + rows), or when
// zero_pos0 and positions[r] == 0: vLLM's MTP convention). grid = (n rows, column
// blocks striding gridDim.y · blockDim.x).
extern "C" __global__ void embed_gather_f32(float* __restrict__ out, const bf16* __restrict__ table,
                                            const int* __restrict__ tokens, const int* __restrict__ positions,
                                            int h, int lo, int rows, int zero_pos0) {
    const int r = blockIdx.x;
    const int t = tokens[r] - lo;
    const bool zero = t < 0 || t >= rows || (zero_pos0 && positions[r] == 0);
    float* o = out + static_cast<size_t>(r) * h;
    const bf16* src = table + static_cast<size_t>(zero ? 0 : t) * h;
    const int first = blockIdx.y * blockDim.x + threadIdx.x, step = gridDim.y * blockDim.x;
    if (h % 8 == 0 && ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(o)) % 16) == 0) {
        // Eight values a thread: one 16-byte load, two 16-byte stores.
        for (int c = first; c < h / 8; c += step) {
            float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            if (!zero) {
                const uint4 p = reinterpret_cast<const uint4*>(src)[c];
                const bf16* b = reinterpret_cast<const bf16*>(&p);
#pragma unroll
                for (int j = 0; j < 8; ++j) v[j] = __bfloat162float(b[j]);
            }
            reinterpret_cast<float4*>(o)[2 * c] = make_float4(v[0], v[1], v[2], v[3]);
            reinterpret_cast<float4*>(o)[2 * c + 1] = make_float4(v[4], v[5], v[6], v[7]);
        }
        return;
    }
#pragma unroll 4
    for (int c = first; c < h; c += step) o[c] = zero ? 0.f : __bfloat162float(src[c]);
}

// out[r*out_stride + c] = x[r*x_stride + c] / rms(x row) * w[c], c < dim. grid = rows.
// 16-byte loads (and 8/16-byte stores) when the row, the weight and the output allow,
// unrolled so that a single row (a decode step's) keeps several loads in flight; the
// sum's order depends only on the width and the alignment of the rows, never on how
// many rows the launch has.
template <typename T>
__device__ void rmsnorm_rows(T* __restrict__ out, int out_stride, const float* __restrict__ x, int x_stride,
                             const float* __restrict__ w, int dim, float eps) {
    __shared__ float red[32];
    const float* xr = x + static_cast<size_t>(blockIdx.x) * x_stride;
    T* o = out + static_cast<size_t>(blockIdx.x) * out_stride;
    const bool vec = dim % 4 == 0 &&
                     ((reinterpret_cast<uintptr_t>(xr) | reinterpret_cast<uintptr_t>(w)) % 16) == 0 &&
                     reinterpret_cast<uintptr_t>(o) % (4 * sizeof(T)) == 0;
    float ss = 0.f;
    const int n4 = dim / 4, nt = blockDim.x;
    if (vec && n4 <= NORM_REGS * nt) {
        // The row and the weight loaded once, all at the start, and kept in registers.
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        float4 v[NORM_REGS], g[NORM_REGS];
#pragma unroll
        for (int j = 0; j < NORM_REGS; ++j) {
            const int i = threadIdx.x + j * nt;
            if (i < n4) v[j] = x4[i], g[j] = w4[i];
        }
#pragma unroll
        for (int j = 0; j < NORM_REGS; ++j)
            if (threadIdx.x + j * nt < n4) ss += sq4(v[j]);
        const float inv = rsqrtf(block_sum(ss, red) / dim + eps);
#pragma unroll
        for (int j = 0; j < NORM_REGS; ++j) {
            const int i = threadIdx.x + j * nt;
            if (i < n4)
                bops::store4(o + 4 * i, v[j].x * inv * g[j].x, v[j].y * inv * g[j].y, v[j].z * inv * g[j].z,
                             v[j].w * inv * g[j].w);
        }
        return;
    }
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
#pragma unroll 4
        for (int i = threadIdx.x; i < dim / 4; i += blockDim.x) ss += sq4(x4[i]);
    } else {
#pragma unroll 4
        for (int c = threadIdx.x; c < dim; c += blockDim.x) ss += xr[c] * xr[c];
    }
    const float inv = rsqrtf(block_sum(ss, red) / dim + eps);
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const float4* w4 = reinterpret_cast<const float4*>(w);
#pragma unroll 4
        for (int i = threadIdx.x; i < dim / 4; i += blockDim.x) {
            const float4 v = x4[i], g = w4[i];
            bops::store4(o + 4 * i, v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w);
        }
    } else {
#pragma unroll 4
        for (int c = threadIdx.x; c < dim; c += blockDim.x) bops::store(o + c, xr[c] * inv * w[c]);
    }
}
// The residual add and the RMSNorm after it, in one pass over the row: x[r] += a[r]
// (f32, as add_f32), then the normed row x[r] / rms(x[r]) * w into `of` (f32) and/or `ob`
// (bf16), either may be null, both rows of width dim (x, a, of, ob dense [rows][dim]).
// The sum of squares runs as rmsnorm_rows' does (the same per-thread order and block
// reduction over 256 threads), so the outputs have the bits of add_f32 followed by
// rmsnorm_f32_of32 / _obf16. grid = rows, 256 threads.
extern "C" __global__ void __launch_bounds__(256)
    add_rmsnorm_f32(float* __restrict__ x, const float* __restrict__ a, float* __restrict__ of,
                    bf16* __restrict__ ob, const float* __restrict__ w, int dim, float eps) {
    __shared__ float red[32];
    const size_t base = static_cast<size_t>(blockIdx.x) * dim;
    float* xr = x + base;
    const float* ar = a + base;
    const bool vec = dim % 4 == 0 &&
                     ((reinterpret_cast<uintptr_t>(xr) | reinterpret_cast<uintptr_t>(ar) |
                       reinterpret_cast<uintptr_t>(w) | reinterpret_cast<uintptr_t>(of ? of + base : nullptr)) %
                      16) == 0 &&
                     reinterpret_cast<uintptr_t>(ob ? ob + base : nullptr) % 8 == 0;
    float ss = 0.f;
    const int n4 = dim / 4, nt = blockDim.x;
    if (vec && n4 <= NORM_REGS * nt) {
        // Both rows and the weight loaded once, all at the start; the sum kept in registers.
        float4* x4 = reinterpret_cast<float4*>(xr);
        const float4* a4 = reinterpret_cast<const float4*>(ar);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        float4 v[NORM_REGS], d[NORM_REGS], g[NORM_REGS];
#pragma unroll
        for (int j = 0; j < NORM_REGS; ++j) {
            const int i = threadIdx.x + j * nt;
            if (i < n4) v[j] = x4[i], d[j] = a4[i], g[j] = w4[i];
        }
#pragma unroll
        for (int j = 0; j < NORM_REGS; ++j) {
            const int i = threadIdx.x + j * nt;
            if (i < n4) {
                v[j].x += d[j].x, v[j].y += d[j].y, v[j].z += d[j].z, v[j].w += d[j].w;
                x4[i] = v[j];
                ss += sq4(v[j]);
            }
        }
        const float inv = rsqrtf(block_sum(ss, red) / dim + eps);
#pragma unroll
        for (int j = 0; j < NORM_REGS; ++j) {
            const int i = threadIdx.x + j * nt;
            if (i < n4) {
                const float p = v[j].x * inv * g[j].x, q = v[j].y * inv * g[j].y, r = v[j].z * inv * g[j].z,
                            t = v[j].w * inv * g[j].w;
                if (of) bops::store4(of + base + 4 * i, p, q, r, t);
                if (ob) bops::store4(ob + base + 4 * i, p, q, r, t);
            }
        }
        return;
    }
    if (vec) {
        float4* x4 = reinterpret_cast<float4*>(xr);
        const float4* a4 = reinterpret_cast<const float4*>(ar);
#pragma unroll 4
        for (int i = threadIdx.x; i < dim / 4; i += blockDim.x) {
            float4 v = x4[i];
            const float4 d = a4[i];
            v.x += d.x, v.y += d.y, v.z += d.z, v.w += d.w;
            x4[i] = v;
            ss += sq4(v);
        }
    } else {
#pragma unroll 4
        for (int c = threadIdx.x; c < dim; c += blockDim.x) {
            const float v = xr[c] + ar[c];
            xr[c] = v;
            ss += v * v;
        }
    }
    const float inv = rsqrtf(block_sum(ss, red) / dim + eps);
    // Each thread reads back only the elements it wrote above: no barrier needed.
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const float4* w4 = reinterpret_cast<const float4*>(w);
#pragma unroll 4
        for (int i = threadIdx.x; i < dim / 4; i += blockDim.x) {
            const float4 v = x4[i], g = w4[i];
            const float p = v.x * inv * g.x, q = v.y * inv * g.y, r = v.z * inv * g.z, t = v.w * inv * g.w;
            if (of) bops::store4(of + base + 4 * i, p, q, r, t);
            if (ob) bops::store4(ob + base + 4 * i, p, q, r, t);
        }
    } else {
#pragma unroll 4
        for (int c = threadIdx.x; c < dim; c += blockDim.x) {
            const float v = xr[c] * inv * w[c];
            if (of) of[base + c] = v;
            if (ob) ob[base + c] = __float2bfloat16_rn(v);
        }
    }
}
extern "C" __global__ void rmsnorm_f32_of32(float* out, int out_stride, const float* x, int x_stride,
                                            const float* w, int dim, float eps) {
    rmsnorm_rows(out, out_stride, x, x_stride, w, dim, eps);
}
extern "C" __global__ void rmsnorm_f32_obf16(bf16* out, int out_stride, const float* x, int x_stride,
                                             const float* w, int dim, float eps) {
    rmsnorm_rows(out, out_stride, x, x_stride, w, dim, eps);
}

// out[i] = sum over r = 0, 1, ..., world-1 of parts[r * n + i], in that order: the
// deterministic all-reduce of tensor parallelism (an all-gather, then this), whose result
// for an element depends only on the ranks' values, never on the buffer's length.
extern "C" __global__ void sum_ranks_f32(float* __restrict__ out, const float* __restrict__ parts, int world,
                                         size_t n) {
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        float t = parts[i];
        for (int r = 1; r < world; ++r) t += parts[static_cast<size_t>(r) * n + i];
        out[i] = t;
    }
}

// out[r][rk * part + c] = parts[rk][r][c]: the vocabulary-parallel head's all-gathered
// logits (rank-major) put in vocabulary order, so one copy brings them to the host.
extern "C" __global__ void interleave_ranks_f32(float* __restrict__ out, const float* __restrict__ parts, int world,
                                                int rows, int part) {
    const size_t total = static_cast<size_t>(world) * rows * part;
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const size_t c = i % part, r = (i / part) % rows, rk = i / (static_cast<size_t>(part) * rows);
        out[(r * world + rk) * part + c] = parts[i];
    }
}

// x[i] += y[i]. Grid-stride.
extern "C" __global__ void add_f32(float* __restrict__ x, const float* __restrict__ y, size_t n) {
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        x[i] += y[i];
}

// out[i] = bf16(x[i]). Grid-stride.
extern "C" __global__ void to_bf16_f32(bf16* __restrict__ out, const float* __restrict__ x, size_t n) {
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        out[i] = __float2bfloat16_rn(x[i]);
}

// out[i] = in[rows[i]] for rows of width h. grid = (n_out, column blocks striding
// gridDim.y · blockDim.x).
template <typename Tin, typename Tout>
__device__ void gather(Tout* __restrict__ out, const Tin* __restrict__ in, const int* __restrict__ rows, int h) {
    const Tin* ip = in + static_cast<size_t>(rows[blockIdx.x]) * h;
    Tout* op = out + static_cast<size_t>(blockIdx.x) * h;
    const int first = blockIdx.y * blockDim.x + threadIdx.x, step = gridDim.y * blockDim.x;
    if constexpr (sizeof(Tin) == sizeof(Tout)) {
        constexpr int V = 16 / sizeof(Tin);  // values per 16-byte copy
        if (h % V == 0 && ((reinterpret_cast<uintptr_t>(ip) | reinterpret_cast<uintptr_t>(op)) % 16) == 0) {
            for (int c = first; c < h / V; c += step)
                reinterpret_cast<uint4*>(op)[c] = reinterpret_cast<const uint4*>(ip)[c];
            return;
        }
        for (int c = first; c < h; c += step) op[c] = ip[c];
    } else {
        for (int c = first; c < h; c += step) bops::store(op + c, static_cast<float>(ip[c]));
    }
}
extern "C" __global__ void gather_rows_f32(float* out, const float* in, const int* rows, int h) {
    gather(out, in, rows, h);
}
extern "C" __global__ void gather_rows_f32_obf16(bf16* out, const float* in, const int* rows, int h) {
    gather(out, in, rows, h);
}
extern "C" __global__ void gather_rows_bf16(bf16* out, const bf16* in, const int* rows, int h) {
    gather(out, in, rows, h);
}
// dst[pairs[2i]] = src[pairs[2i + 1]] for i < n: a drafting pass's ids kept on the device
// (a draft linked into a stage's token row; a stage's argmax id stored in its slot).
extern "C" __global__ void copy_ids(int* __restrict__ dst, const int* __restrict__ src,
                                    const int* __restrict__ pairs, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[pairs[2 * i]] = src[pairs[2 * i + 1]];
}
// The rows rows[i] of a quantised activation (codes [.][k] e4m3, scales [.][k / 128])
// into row i of q_out / s_out: the routed experts' inputs, quantised once per token.
// k a multiple of 128, the buffers 16-byte aligned. grid = (n_out, column blocks).
extern "C" __global__ void gather_rows_q8(uint8_t* __restrict__ q_out, float* __restrict__ s_out,
                                          const uint8_t* __restrict__ q_in, const float* __restrict__ s_in,
                                          const int* __restrict__ rows, int k) {
    const size_t r = rows[blockIdx.x], i = blockIdx.x;
    const uint4* ip = reinterpret_cast<const uint4*>(q_in + r * k);
    uint4* op = reinterpret_cast<uint4*>(q_out + i * k);
    const int first = blockIdx.y * blockDim.x + threadIdx.x, step = gridDim.y * blockDim.x;
    for (int c = first; c < k / 16; c += step) op[c] = ip[c];
    const int g = k / 128;
    for (int c = first; c < g; c += step) s_out[i * g + c] = s_in[r * g + c];
}


// Latent-cache write: per row r, c_kv = RMSNorm(kv[r][:lora]) * norm_w (eps), k_pe =
// RoPE(kv[r][lora:], pos[r]); cache[slot[r]] = bf16([c_kv, k_pe]). grid = n rows.
extern "C" __global__ void kv_cache_write_bf16(bf16* __restrict__ cache, const float* __restrict__ kv,
                                               const float* __restrict__ norm_w, const float* __restrict__ cos_t,
                                               const float* __restrict__ sin_t, const int* __restrict__ pos,
                                               const long long* __restrict__ slot, long long slots, int lora,
                                               int rope, float eps) {
    __shared__ float red[32];
    const int lat = lora + rope, half = rope / 2;
    const float* x = kv + static_cast<size_t>(blockIdx.x) * lat;
    // A negative slot is a padding row of a CUDA-graph bucket: nothing to write. Slots
    // past the cache (bad metadata) are skipped too, never written out of bounds.
    const long long sl = slot[blockIdx.x];
    if (sl < 0 || sl >= slots) return;
    bf16* dst = cache + static_cast<size_t>(sl) * lat;
    float ss = 0.f;
    for (int c = threadIdx.x; c < lora; c += blockDim.x) ss += x[c] * x[c];
    const float inv = rsqrtf(block_sum(ss, red) / lora + eps);
    for (int c = threadIdx.x; c < lora; c += blockDim.x) dst[c] = __float2bfloat16_rn(x[c] * inv * norm_w[c]);
    const size_t p = static_cast<size_t>(pos[blockIdx.x]) * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float a, b;
        rope_pair(x[lora + 2 * i], x[lora + 2 * i + 1], cos_t[p + i], sin_t[p + i], a, b);
        dst[lora + 2 * i] = __float2bfloat16_rn(a);
        dst[lora + 2 * i + 1] = __float2bfloat16_rn(b);
    }
}

// Absorbed query: for row r, head h (grid = (heads, n)):
//   qa[r][h][:lora] = W_UK[h]^T q_nope (W_UK [heads][nope][lora]),
//   qa[r][h][lora:] = RoPE(q_pe, pos[r]);
// written as f32 (varlen kernel) and bf16 (the decode kernel's q layout, row = token*heads
// + head, which is `s_idx*heads + head` within a uniform window).
extern "C" __global__ void q_absorb_f32(float* __restrict__ qa, bf16* __restrict__ qa_bf16,
                                        const float* __restrict__ q, const bf16* __restrict__ wuk,
                                        const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                        const int* __restrict__ pos, int heads, int nope, int rope, int lora) {
    extern __shared__ float qn[];
    const int h = blockIdx.x, r = blockIdx.y, qk = nope + rope, dqk = lora + rope, half = rope / 2;
    const float* qr = q + (static_cast<size_t>(r) * heads + h) * qk;
    for (int i = threadIdx.x; i < nope; i += blockDim.x) qn[i] = qr[i];
    __syncthreads();
    const size_t o = (static_cast<size_t>(r) * heads + h) * dqk;
    const bf16* w = wuk + static_cast<size_t>(h) * nope * lora;
    for (int c = threadIdx.x; c < lora; c += blockDim.x) {
        float acc = 0.f;
        for (int n = 0; n < nope; ++n) acc += qn[n] * __bfloat162float(w[static_cast<size_t>(n) * lora + c]);
        qa[o + c] = acc;
        qa_bf16[o + c] = __float2bfloat16_rn(acc);
    }
    const size_t p = static_cast<size_t>(pos[r]) * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float a, b;
        rope_pair(qr[nope + 2 * i], qr[nope + 2 * i + 1], cos_t[p + i], sin_t[p + i], a, b);
        qa[o + lora + 2 * i] = a;
        qa[o + lora + 2 * i + 1] = b;
        qa_bf16[o + lora + 2 * i] = __float2bfloat16_rn(a);
        qa_bf16[o + lora + 2 * i + 1] = __float2bfloat16_rn(b);
    }
}

// Varlen causal absorbed attention over the bf16 cache (mla_varlen.cuh).
extern "C" __global__ void mla_attn_varlen_f32(float* __restrict__ o_lat, const float* __restrict__ qa,
                                               const bf16* __restrict__ cache, const int* __restrict__ tables,
                                               const int* __restrict__ row_seq, const int* __restrict__ pos,
                                               int bt_stride, int heads, int lora, int rope, float scale) {
    const int dqk = lora + rope;
    mla_attn_varlen_body(o_lat, qa, tables, row_seq, pos, bt_stride, heads, lora, rope, scale,
                         [=](size_t e, int i) { return __bfloat162float(cache[e * dqk + i]); });
}

// out[r][h*vdim + v] = W_UV[h][v] . o_lat[r][h] (W_UV [heads][vdim][lora]); grid = (heads, n),
// a warp per output. bf16 out: the o_proj GEMM's input.
extern "C" __global__ void wuv_f32_obf16(bf16* __restrict__ out, const float* __restrict__ o_lat,
                                         const bf16* __restrict__ wuv, int heads, int lora, int vdim) {
    extern __shared__ float ol[];
    const int h = blockIdx.x, r = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const float* src = o_lat + (static_cast<size_t>(r) * heads + h) * lora;
    for (int i = threadIdx.x; i < lora; i += blockDim.x) ol[i] = src[i];
    __syncthreads();
    for (int v = warp; v < vdim; v += nw) {
        const bf16* w = wuv + (static_cast<size_t>(h) * vdim + v) * lora;
        float d = 0.f;
        for (int i = lane; i < lora; i += 32) d += ol[i] * __bfloat162float(w[i]);
        d = warp_sum(d);
        if (lane == 0) out[(static_cast<size_t>(r) * heads + h) * vdim + v] = __float2bfloat16_rn(d);
    }
}

// out[t] += sum over its k slots in ascending expert id of weight * y[inv[t*k + j]].
// grid = (tokens, column blocks): block (t, b) sums columns b·blockDim.x + i (float4s
// where h % 4 == 0, else floats), striding gridDim.y·blockDim.x. Threads j < k rank slot
// j among the token's distinct expert ids (k <= COMBINE_MAX_K, checked by the host; a
// repeated id keeps its first slot, a negative one none, which routing never produces);
// every column is then summed in that order, so the bits do not depend on the grid or
// the vector width.
constexpr int COMBINE_MAX_K = 32;
extern "C" __global__ void moe_combine_f32(float* __restrict__ out, const float* __restrict__ y,
                                           const int* __restrict__ ids, const float* __restrict__ weights,
                                           const int* __restrict__ inv, int k, int h) {
    __shared__ int rows_s[COMBINE_MAX_K];
    __shared__ float w_s[COMBINE_MAX_K];
    __shared__ int cnt_s;
    const int t = blockIdx.x;
    const int* id = ids + static_cast<size_t>(t) * k;
    if (threadIdx.x < k) {
        const int j = threadIdx.x, v = id[j];
        // Slot j counts if its id is valid and not repeated earlier; its place is the number
        // of distinct valid ids below it.
        bool first = v >= 0;
        int rank = 0, distinct = 0;
        for (int q = 0; q < k; ++q) {
            const int u = id[q];
            if (q < j && u == v) first = false;
            bool uq = u >= 0;  // u's first slot is q
            for (int p = 0; p < q; ++p) uq = uq && id[p] != u;
            rank += uq && u < v;
            distinct += uq;
        }
        if (first) {
            rows_s[rank] = inv[t * k + j];
            w_s[rank] = weights[static_cast<size_t>(t) * k + j];
        }
        if (j == 0) cnt_s = distinct;
    }
    __syncthreads();
    const int cnt = cnt_s;
    float* o = out + static_cast<size_t>(t) * h;
    const int step = gridDim.y * blockDim.x;
    if (h % 4 == 0) {
        for (int c4 = blockIdx.y * blockDim.x + threadIdx.x; c4 < h / 4; c4 += step) {
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
            for (int i = 0; i < cnt; ++i) {
                const float4 v = reinterpret_cast<const float4*>(y + static_cast<size_t>(rows_s[i]) * h)[c4];
                const float w = w_s[i];
                acc.x = fmaf(w, v.x, acc.x);
                acc.y = fmaf(w, v.y, acc.y);
                acc.z = fmaf(w, v.z, acc.z);
                acc.w = fmaf(w, v.w, acc.w);
            }
            float4 r = reinterpret_cast<float4*>(o)[c4];
            r.x += acc.x, r.y += acc.y, r.z += acc.z, r.w += acc.w;
            reinterpret_cast<float4*>(o)[c4] = r;
        }
    } else {
        for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < h; c += step) {
            float acc = 0.f;
            for (int i = 0; i < cnt; ++i) acc = fmaf(w_s[i], y[static_cast<size_t>(rows_s[i]) * h + c], acc);
            o[c] += acc;
        }
    }
}

// Batch-invariant linear layer y[m][n] = x[m][:] . w[n][:] (x [m][k], w [n][k], bf16):
// one warp per output column, lanes stride k, a fixed warp tree: y[m][n] depends only on
// row m of x, never on how many rows the call has (unlike cuBLAS, whose algorithm and
// split-K change with m). grid = (ceil(n / 8), ceil(m / 4)), 256 threads.
template <typename T>
__device__ void linear_inv(T* __restrict__ y, const bf16* __restrict__ x, const bf16* __restrict__ w, int m, int n,
                           int k) {
    const int col = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (col >= n) return;
    const bf16* wr = w + static_cast<size_t>(col) * k;
    for (int row = blockIdx.y * 4; row < min(m, blockIdx.y * 4 + 4); ++row) {
        const bf16* xr = x + static_cast<size_t>(row) * k;
        float d = 0.f;
        if (k % 8 == 0) {
            for (int i = lane; i < k / 8; i += 32) {
                const uint4 a = reinterpret_cast<const uint4*>(xr)[i];
                const uint4 b = reinterpret_cast<const uint4*>(wr)[i];
                const __nv_bfloat162* ah = reinterpret_cast<const __nv_bfloat162*>(&a);
                const __nv_bfloat162* bh = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float2 af = __bfloat1622float2(ah[q]), bf = __bfloat1622float2(bh[q]);
                    d += af.x * bf.x + af.y * bf.y;
                }
            }
        } else {
            for (int i = lane; i < k; i += 32) d += __bfloat162float(xr[i]) * __bfloat162float(wr[i]);
        }
        d = warp_sum(d);
        if (lane == 0) bops::store(y + static_cast<size_t>(row) * n + col, d);
    }
}
extern "C" __global__ void __launch_bounds__(256)
    linear_inv_bf16_of32(float* y, const bf16* x, const bf16* w, int m, int n, int k) {
    linear_inv(y, x, w, m, n, k);
}
extern "C" __global__ void __launch_bounds__(256)
    linear_inv_bf16_obf16(bf16* y, const bf16* x, const bf16* w, int m, int n, int k) {
    linear_inv(y, x, w, m, n, k);
}

// The MoE experts as one launch: rows [off[g], off[g + 1]) of x (sorted by expert, `k`
// wide) times the weight of expert experts[g] (w[experts[g]], `[n][k]` bf16; expert g
// when `experts` is null) into the same rows of y (`n` wide). grid = (ceil(n / 32),
// experts), 256 threads: each warp owns 4 output columns of its expert and runs its rows
// 8 at a time, reading each weight row once per 8 rows (the `staged` entry points put the
// 8 rows of x in shared memory for the block). A row's dot product is summed exactly as
// `linear_inv` sums it (lane-strided 8-element chunks, then the warp tree), so the result
// for a token does not depend on which or how many other rows its expert got, nor on the
// entry point. Needs k % 8 == 0.
namespace gmoe {
constexpr int ROWS = 8, COLS = 4;
}
template <typename T, bool STAGE>
__device__ void grouped_linear(T* __restrict__ y, const bf16* __restrict__ x, const bf16* const* __restrict__ w,
                               const int* __restrict__ experts, const int* __restrict__ off, int n, int k) {
    using namespace gmoe;
    // STAGE: the block's 8 rows × 32 chunks of 8 elements of x go through shared memory,
    // read once for the block's 8 warps (each would otherwise read every row of x for its
    // own 4 columns); it pays when experts have several rows, costs barriers when few.
    __shared__ uint4 xs[STAGE ? ROWS : 1][32];
    const int g = blockIdx.y, r0 = off[g], r1 = off[g + 1];
    if (r0 >= r1) return;  // the whole block: no row for this expert
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int col0 = (blockIdx.x * 8 + warp) * COLS;
    const bool active = col0 < n;  // with STAGE, inactive warps still stage x and meet the barriers
    if (!STAGE && !active) return;
    const bf16* we = w[experts ? experts[g] : g];
    const int k8 = k / 8;
    for (int base = r0; base < r1; base += ROWS) {
        const int nr = min(ROWS, r1 - base);
        float d[ROWS][COLS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int c = 0; c < COLS; ++c) d[r][c] = 0.f;
        for (int t = 0; t < k8; t += 32) {
            if (STAGE) {
                if (warp < nr && t + lane < k8)
                    xs[warp][lane] = reinterpret_cast<const uint4*>(x + static_cast<size_t>(base + warp) * k)[t + lane];
                __syncthreads();
            }
            const int i = t + lane;  // each lane's chunks in the same order as linear_inv's
            if (active && i < k8) {
                uint4 wb[COLS];
#pragma unroll
                for (int c = 0; c < COLS; ++c)
                    wb[c] = col0 + c < n ? reinterpret_cast<const uint4*>(we + static_cast<size_t>(col0 + c) * k)[i]
                                         : make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    if (r >= nr) break;
                    const uint4 a = STAGE ? xs[r][lane]
                                          : reinterpret_cast<const uint4*>(x + static_cast<size_t>(base + r) * k)[i];
                    const __nv_bfloat162* ah = reinterpret_cast<const __nv_bfloat162*>(&a);
#pragma unroll
                    for (int c = 0; c < COLS; ++c) {
                        const __nv_bfloat162* bh = reinterpret_cast<const __nv_bfloat162*>(&wb[c]);
#pragma unroll
                        for (int q = 0; q < 4; ++q) {
                            const float2 af = __bfloat1622float2(ah[q]), bf = __bfloat1622float2(bh[q]);
                            d[r][c] += af.x * bf.x + af.y * bf.y;
                        }
                    }
                }
            }
            if (STAGE) __syncthreads();
        }
        if (!active) continue;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (r >= nr) break;
#pragma unroll
            for (int c = 0; c < COLS; ++c) {
                const float s = warp_sum(d[r][c]);
                if (lane == 0 && col0 + c < n) bops::store(y + static_cast<size_t>(base + r) * n + col0 + c, s);
            }
        }
    }
}
#define MOE_GROUPED(NAME, T, STAGE)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) NAME(T* y, const bf16* x, const bf16* const* w,             \
                                                           const int* experts, const int* off, int n, int k) { \
        grouped_linear<T, STAGE>(y, x, w, experts, off, n, k);                                                 \
    }
MOE_GROUPED(moe_grouped_bf16_obf16, bf16, false)
MOE_GROUPED(moe_grouped_bf16_of32, float, false)
MOE_GROUPED(moe_grouped_staged_bf16_obf16, bf16, true)
MOE_GROUPED(moe_grouped_staged_bf16_of32, float, true)

// The MoE slots (token t, choice j) = slot t*k + j sorted by expert on the device, so the
// expert GEMMs need no host round trip: off[e] = first sorted row of expert e (off[E] =
// slots), perm[row] = the row's token, inv[slot] = the slot's row. Within an expert the
// order follows the atomics (not fixed), which changes no result: every row is computed
// on its own and the combine finds each slot's row through inv. One block of 1024
// threads; experts <= 1024; ids must be < experts (moe_route_f32 guarantees it; others
// are counted as expert 0 to stay in bounds). act[..min(experts, slots)]: the experts
// with rows in ascending order, then -1 (the grouped kernels' compact grid).
extern "C" __global__ void __launch_bounds__(1024)
    moe_sort(const int* __restrict__ ids, int slots, int k, int experts, int* __restrict__ off, int* __restrict__ perm,
             int* __restrict__ inv, int* __restrict__ act) {
    __shared__ int cnt[1024];
    for (int e = threadIdx.x; e < experts; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int sl = threadIdx.x; sl < slots; sl += blockDim.x) {
        const int e = ids[sl];
        atomicAdd(&cnt[(e >= 0 && e < experts) ? e : 0], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0, active = 0;
        for (int e = 0; e < experts; ++e) {
            const int c = cnt[e];
            off[e] = run;
            cnt[e] = run;  // now each expert's next free row
            run += c;
            if (c > 0) act[active++] = e;
        }
        off[experts] = run;
        for (int i = active; i < min(experts, slots); ++i) act[i] = -1;
    }
    __syncthreads();
    for (int sl = threadIdx.x; sl < slots; sl += blockDim.x) {
        const int e = ids[sl];
        const int row = atomicAdd(&cnt[(e >= 0 && e < experts) ? e : 0], 1);
        perm[row] = sl / k;
        inv[sl] = row;
    }
}
