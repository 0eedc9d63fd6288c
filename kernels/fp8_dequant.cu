// fp8 e4m3 weights with block scales to bf16, on the device: the load path of the
// weights that stay in bf16 (kv_b_proj's absorbed halves, and every projection until
// its fp8 kernel runs), so no f32 or bf16 host copy of the model is made.
//
// out[r][c] = bf16_rn(e4m3(q[r][c]) * s[r / block_rows][c / block_cols]) with the
// product in f32: the same bits as the host's dequantisation (mlaserve-model's
// `f32_shard`, then round to nearest even), which the GPU test asserts.
#include "common.cuh"

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
