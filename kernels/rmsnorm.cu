// RMSNorm, plain and fused with the residual add (vLLM's fused_add_rms_norm semantics):
//   rmsnorm:          out[r] = x[r] / rms(x[r]) * w
//   fused_add_rmsnorm: z = x[r] + residual[r] (f32); residual[r] = bf16(z);
//                      x[r] = bf16(bf16(z) / rms(z) * w)      (in place)
// rms(v) = sqrt(mean(v^2) + eps), accumulated in f32. One block per row, 256 threads,
// 16-byte (8 x bf16) accesses when the width allows, scalar otherwise.
#include "common.cuh"

namespace rmsn {
constexpr int THREADS = 256;

__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) t += red[w];
    __syncthreads();  // red may be reused
    return t;
}

// 8 bf16 <-> 8 floats through one 16-byte word.
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 p = __bfloat1622float2(h[i]);
        f[2 * i] = p.x;
        f[2 * i + 1] = p.y;
    }
}
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
    uint4 u;
    uint32_t* w = reinterpret_cast<uint32_t*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = pack_bf16x2(f[2 * i], f[2 * i + 1]);
    return u;
}
}  // namespace rmsn

// out, x: [rows][h]; w: [h]. grid = rows.
extern "C" __global__ void __launch_bounds__(rmsn::THREADS)
    rmsnorm_bf16(bf16* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w, int h, float eps) {
    __shared__ float red[rmsn::THREADS / 32];
    const size_t base = static_cast<size_t>(blockIdx.x) * h;
    const bool vec = (h % 8) == 0;
    float ss = 0.f;
    if (vec) {
        for (int i = threadIdx.x; i < h / 8; i += rmsn::THREADS) {
            float f[8];
            rmsn::unpack8(reinterpret_cast<const uint4*>(x + base)[i], f);
#pragma unroll
            for (int k = 0; k < 8; ++k) ss += f[k] * f[k];
        }
    } else {
        for (int i = threadIdx.x; i < h; i += rmsn::THREADS) {
            const float v = __bfloat162float(x[base + i]);
            ss += v * v;
        }
    }
    const float inv = rsqrtf(rmsn::block_sum(ss, red) / h + eps);
    if (vec) {
        for (int i = threadIdx.x; i < h / 8; i += rmsn::THREADS) {
            float f[8], g[8];
            rmsn::unpack8(reinterpret_cast<const uint4*>(x + base)[i], f);
            rmsn::unpack8(reinterpret_cast<const uint4*>(w)[i], g);
#pragma unroll
            for (int k = 0; k < 8; ++k) f[k] = f[k] * inv * g[k];
            reinterpret_cast<uint4*>(out + base)[i] = rmsn::pack8(f);
        }
    } else {
        for (int i = threadIdx.x; i < h; i += rmsn::THREADS)
            out[base + i] = __float2bfloat16_rn(__bfloat162float(x[base + i]) * inv * __bfloat162float(w[i]));
    }
}

// x, residual: [rows][h] (both updated in place); w: [h]. grid = rows.
extern "C" __global__ void __launch_bounds__(rmsn::THREADS)
    fused_add_rmsnorm_bf16(bf16* __restrict__ x, bf16* __restrict__ residual, const bf16* __restrict__ w, int h,
                           float eps) {
    __shared__ float red[rmsn::THREADS / 32];
    const size_t base = static_cast<size_t>(blockIdx.x) * h;
    const bool vec = (h % 8) == 0;
    float ss = 0.f;
    // Pass 1: z = x + residual; residual = bf16(z); sum z^2 (unrounded, as vLLM).
    if (vec) {
        for (int i = threadIdx.x; i < h / 8; i += rmsn::THREADS) {
            float a[8], r[8];
            rmsn::unpack8(reinterpret_cast<const uint4*>(x + base)[i], a);
            rmsn::unpack8(reinterpret_cast<const uint4*>(residual + base)[i], r);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                a[k] += r[k];
                ss += a[k] * a[k];
            }
            reinterpret_cast<uint4*>(residual + base)[i] = rmsn::pack8(a);
        }
    } else {
        for (int i = threadIdx.x; i < h; i += rmsn::THREADS) {
            const float z = __bfloat162float(x[base + i]) + __bfloat162float(residual[base + i]);
            ss += z * z;
            residual[base + i] = __float2bfloat16_rn(z);
        }
    }
    const float inv = rsqrtf(rmsn::block_sum(ss, red) / h + eps);
    // Pass 2 reads back what this same thread wrote in pass 1 (same indices): no barrier needed.
    if (vec) {
        for (int i = threadIdx.x; i < h / 8; i += rmsn::THREADS) {
            float z[8], g[8];
            rmsn::unpack8(reinterpret_cast<const uint4*>(residual + base)[i], z);
            rmsn::unpack8(reinterpret_cast<const uint4*>(w)[i], g);
#pragma unroll
            for (int k = 0; k < 8; ++k) z[k] = z[k] * inv * g[k];
            reinterpret_cast<uint4*>(x + base)[i] = rmsn::pack8(z);
        }
    } else {
        for (int i = threadIdx.x; i < h; i += rmsn::THREADS)
            x[base + i] = __float2bfloat16_rn(__bfloat162float(residual[base + i]) * inv * __bfloat162float(w[i]));
    }
}
