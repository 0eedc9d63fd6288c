// The fp8 latent cache's writer and its CUDA-core reader (layout: kv_fp8.cuh): the cache
// write of a step's rows and the varlen absorbed attention. Each computes what its
// bf16-cache twin in backend_ops.cu does (kv_cache_write_bf16, mla_attn_varlen_f32) with
// the entry quantised on write and read back as code * scale. The other readers: the
// expanded prefill's gather (mla_prefill.cu) and the tensor-core decode kernel
// (mla_decode_sm90_fp8.cu).
#include <cuda_fp8.h>

#include "kv_fp8.cuh"
#include "mla_varlen.cuh"

// The write's shared buffer of normalised latent channels.
constexpr int KV_MAX_LORA = 1024;

// Latent-cache write, fp8: per row r, c_kv = RMSNorm(kv[r][:lora]) * norm_w (eps) and
// k_pe = RoPE(kv[r][lora:], pos[r]) as kv_cache_write_bf16 computes them, then c_kv
// quantised per 128-channel group (s = amax / 448, or 1 for an all-zero group; code =
// e4m3(v / s), saturating) and k_pe rounded to bf16, into the entry of slot[r] (entries
// of `entry` bytes). grid = n rows, block = 128 threads; lora <= 1024, a multiple of 4.
extern "C" __global__ void __launch_bounds__(128)
    kv_cache_write_fp8(uint8_t* __restrict__ cache, const float* __restrict__ kv, const float* __restrict__ norm_w,
                       const float* __restrict__ cos_t, const float* __restrict__ sin_t, const int* __restrict__ pos,
                       const long long* __restrict__ slot, long long slots, int lora, int rope, float eps) {
    __shared__ float red[32];
    __shared__ float v[KV_MAX_LORA];
    const int lat = lora + rope, half = rope / 2, G = kvf8::groups(lora);
    const float* x = kv + static_cast<size_t>(blockIdx.x) * lat;
    // A negative slot is a padding row of a CUDA-graph bucket: nothing to write. Slots
    // past the cache (bad metadata) are skipped too, never written out of bounds.
    const long long sl = slot[blockIdx.x];
    if (sl < 0 || sl >= slots) return;
    uint8_t* dst = cache + static_cast<size_t>(sl) * kvf8::entry_bytes(lora, rope);
    float ss = 0.f;
    for (int c = threadIdx.x; c < lora; c += blockDim.x) ss += x[c] * x[c];
    const float inv = rsqrtf(block_sum(ss, red) / lora + eps);
    for (int c = threadIdx.x; c < lora; c += blockDim.x) v[c] = x[c] * inv * norm_w[c];
    __syncthreads();
    // A warp per group: its amax, then each lane's channels.
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int g = warp; g < G; g += blockDim.x >> 5) {
        const int c0 = g * kvf8::GROUP, c1 = min(c0 + kvf8::GROUP, lora);
        float amax = 0.f;
        for (int c = c0 + lane; c < c1; c += 32) amax = fmaxf(amax, fabsf(v[c]));
        amax = warp_max(amax);
        const float sc = amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;
        for (int c = c0 + lane; c < c1; c += 32)
            dst[c] = __nv_cvt_float_to_fp8(__fdiv_rn(v[c], sc), __NV_SATFINITE, __NV_E4M3);
        if (lane == 0) reinterpret_cast<float*>(dst + lora)[g] = sc;
    }
    bf16* pe = reinterpret_cast<bf16*>(dst + lora + 4 * G);
    const size_t p = static_cast<size_t>(pos[blockIdx.x]) * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float a, b;
        rope_pair(x[lora + 2 * i], x[lora + 2 * i + 1], cos_t[p + i], sin_t[p + i], a, b);
        pe[2 * i] = __float2bfloat16_rn(a);
        pe[2 * i + 1] = __float2bfloat16_rn(b);
    }
}

// Varlen causal absorbed MLA over the fp8 cache (mla_varlen.cuh): entries read back as
// code * scale.
extern "C" __global__ void mla_attn_varlen_fp8(float* __restrict__ o_lat, const float* __restrict__ qa,
                                               const uint8_t* __restrict__ cache, const int* __restrict__ tables,
                                               const int* __restrict__ row_seq, const int* __restrict__ pos,
                                               int bt_stride, int heads, int lora, int rope, float scale) {
    const size_t eb = kvf8::entry_bytes(lora, rope);
    mla_attn_varlen_body(o_lat, qa, tables, row_seq, pos, bt_stride, heads, lora, rope, scale,
                         [=](size_t e, int i) { return kvf8::at(cache + e * eb, lora, i); });
}

// Benchmarks' contexts without a prefill: `entries` fp8 entries of random values in
// about [-1, 1) (codes of either sign, never NaN; group scales in [1/896, 1/448); k_pe
// in [-1, 1)), from `seed`. Grid-stride, a thread per entry.
extern "C" __global__ void kv_fill_fp8(uint8_t* __restrict__ cache, long long entries, int lora, int rope,
                                       unsigned int seed) {
    const int eb = kvf8::entry_bytes(lora, rope), G = kvf8::groups(lora);
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < entries;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        uint8_t* e = cache + i * eb;
        uint32_t h = seed ^ static_cast<uint32_t>(i * 0x9e3779b9u) ^ static_cast<uint32_t>(i >> 32);
        auto next = [&h]() {
            h ^= h << 13;
            h ^= h >> 17;
            h ^= h << 5;
            return h;
        };
        for (int c = 0; c < lora; ++c) {
            uint32_t code = next() & 0xffu;
            if ((code & 0x7fu) == 0x7fu) code ^= 1u;  // S.1111.111 is NaN
            e[c] = static_cast<uint8_t>(code);
        }
        for (int g = 0; g < G; ++g)
            reinterpret_cast<float*>(e + lora)[g] = (1.f + (next() >> 8) * (1.f / 16777216.f)) / 896.f;
        bf16* pe = reinterpret_cast<bf16*>(e + lora + 4 * G);
        for (int c = 0; c < rope; ++c) pe[c] = __float2bfloat16_rn((next() >> 8) * (2.f / 16777216.f) - 1.f);
    }
}
