// The varlen causal absorbed attention over the paged latent cache, for any entry layout:
// backend_ops.cu's mla_attn_varlen_f32 (bf16 entries) and kv_fp8.cu's mla_attn_varlen_fp8
// (the fp8 layout) differ only in how a channel is read, `entry(slot, i)`: channel i of
// the entry at cache slot `slot` (page * 64 + position in the page) as f32.
//
// Row r (sequence row_seq[r], position pos[r]) and head h (grid = (heads, n), 128
// threads) attend to cache positions 0..=pos[r] of their sequence: keys [c_kv, k_pe],
// values c_kv. o_lat[r][h] = softmax(scale * qa . k) . c_kv. Dynamic shared memory:
// (lora + rope + pos_max + 1) floats.
#pragma once

#include "common.cuh"

template <typename Entry>
__device__ __forceinline__ void mla_attn_varlen_body(float* __restrict__ o_lat, const float* __restrict__ qa,
                                                     const int* __restrict__ tables, const int* __restrict__ row_seq,
                                                     const int* __restrict__ pos, int bt_stride, int heads, int lora,
                                                     int rope, float scale, Entry entry) {
    extern __shared__ float sm[];
    __shared__ float red[32];
    const int h = blockIdx.x, r = blockIdx.y, dqk = lora + rope;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    float* q = sm;
    float* sc = sm + dqk;
    const float* qsrc = qa + (static_cast<size_t>(r) * heads + h) * dqk;
    for (int i = threadIdx.x; i < dqk; i += blockDim.x) q[i] = qsrc[i];
    __syncthreads();
    const int len = pos[r] + 1;
    const int* table = tables + static_cast<size_t>(row_seq[r]) * bt_stride;
    auto slot = [&](int j) { return static_cast<size_t>(table[j / 64]) * 64 + j % 64; };
    for (int j = warp; j < len; j += nw) {
        const size_t e = slot(j);
        float d = 0.f;
        for (int i = lane; i < dqk; i += 32) d += q[i] * entry(e, i);
        d = warp_sum(d);
        if (lane == 0) sc[j] = d * scale;
    }
    __syncthreads();
    float m = -MLAS_INF;
    for (int j = threadIdx.x; j < len; j += blockDim.x) m = fmaxf(m, sc[j]);
    m = block_max(m, red);
    float s = 0.f;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const float e = __expf(sc[j] - m);
        sc[j] = e;
        s += e;
    }
    const float inv = 1.f / block_sum(s, red);  // block_sum synchronises: sc is complete
    float* out = o_lat + (static_cast<size_t>(r) * heads + h) * lora;
    for (int c = threadIdx.x; c < lora; c += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < len; ++j) acc += sc[j] * entry(slot(j), c);
        out[c] = acc * inv;
    }
}
