// The fp8 latent-cache entry (`--kv-cache-dtype fp8`), shared by its writer and readers
// (kv_fp8.cu, and the fp8 decode kernel in mla_decode_sm90_t.cu). One token's entry of
// `lora` latent channels and `rope` RoPE channels is, in bytes:
//   [0, lora)                  c_kv as e4m3 codes, quantised per 128-channel group
//   [lora, lora + 4G)          the G = ceil(lora / 128) f32 group scales (amax / 448)
//   [lora + 4G, + 2 rope)      k_pe as bf16
// DeepSeek's layout at lora 512, rope 64: 512 + 16 + 128 = 656 bytes. A channel reads
// back as e4m3(code) * scale in f32, what the CPU backend's fp8 cache computes. Entries
// lie back to back, 64 to a page, so a page is 64 * entry bytes.
#pragma once

#include "common.cuh"

namespace kvf8 {

constexpr int GROUP = 128;

__host__ __device__ constexpr int groups(int lora) { return (lora + GROUP - 1) / GROUP; }
__host__ __device__ constexpr int entry_bytes(int lora, int rope) { return lora + 4 * groups(lora) + 2 * rope; }

// Channel d (< lora + rope) of the entry at e, as f32.
__device__ __forceinline__ float at(const uint8_t* e, int lora, int d) {
    if (d < lora) return e4m3_to_f32(e[d]) * reinterpret_cast<const float*>(e + lora)[d / GROUP];
    return __bfloat162float(reinterpret_cast<const bf16*>(e + lora + 4 * groups(lora))[d - lora]);
}

}  // namespace kvf8
