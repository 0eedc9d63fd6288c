// fp8 e4m3 weights with block scales to bf16, on the device: the load path of the
// weights that stay in bf16 (kv_b_proj's absorbed halves, and every projection until
// its fp8 kernel runs), so no f32 or bf16 host copy of the model is made.
//
// out[r][c] = bf16_rn(e4m3(q[r][c]) * s[r / block_rows][c / block_cols]) with the
// product in f32: the same bits as the host's dequantisation (mlaserve-model's
// `f32_shard`, then round to nearest even), which the GPU test asserts.
#include "common.cuh"

// e4m3 (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, S.1111.111
// is NaN) to f32, exactly.
__device__ __forceinline__ float e4m3_to_f32(uint8_t x) {
    const uint32_t sign = (uint32_t)(x & 0x80) << 24;
    const uint32_t e = (x >> 3) & 0xf;
    const uint32_t m = x & 0x7;
    if (e == 0xf && m == 0x7) return __int_as_float(sign | 0x7fc00000u);
    if (e == 0) {
        // Subnormal: m · 2^-9.
        const float v = (float)m * 0.001953125f;
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

// One thread per output element, grid-stride; `out` is a row-major [rows][cols] slice
// (possibly inside a larger buffer: the caller offsets it).
extern "C" __global__ void fp8_dequant_bf16(const uint8_t* __restrict__ q, const float* __restrict__ s,
                                            bf16* __restrict__ out, int rows, int cols, int scale_cols,
                                            int block_rows, int block_cols) {
    const long long n = (long long)rows * cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const int r = (int)(i / cols), c = (int)(i % cols);
        const float v = e4m3_to_f32(q[i]) * s[(r / block_rows) * scale_cols + c / block_cols];
        out[i] = __float2bfloat16_rn(v);
    }
}
