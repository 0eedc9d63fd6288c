// SiLU-and-multiply of the gated MLP (vLLM's SiluAndMul): in = [gate | up] per row,
// out = silu(gate) * up, silu(g) = g / (1 + exp(-g)), f32 math, bf16 in and out.
#include "common.cuh"

// out: [rows][d]; in: [rows][2dp] (dp >= d: gate at 0..d, up at dp..dp + d; dp > d when
// an fp8 gate_up is padded to whole 128-row scale blocks). Grid-stride over rows * d
// elements; 8-wide when d and dp are multiples of 8.
extern "C" __global__ void silu_mul_bf16(bf16* __restrict__ out, const bf16* __restrict__ in, int rows, int d,
                                         int dp) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    const size_t t0 = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (d % 8 == 0 && dp % 8 == 0) {
        const int dv = d / 8;
        const size_t n = static_cast<size_t>(rows) * dv;
        for (size_t i = t0; i < n; i += stride) {
            const size_t r = i / dv, c = i % dv;
            const uint4 g = reinterpret_cast<const uint4*>(in + r * 2 * dp)[c];
            const uint4 u = reinterpret_cast<const uint4*>(in + r * 2 * dp + dp)[c];
            const __nv_bfloat162* gh = reinterpret_cast<const __nv_bfloat162*>(&g);
            const __nv_bfloat162* uh = reinterpret_cast<const __nv_bfloat162*>(&u);
            uint4 o;
            uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float2 gf = __bfloat1622float2(gh[k]);
                const float2 uf = __bfloat1622float2(uh[k]);
                ow[k] = pack_bf16x2(gf.x / (1.f + __expf(-gf.x)) * uf.x, gf.y / (1.f + __expf(-gf.y)) * uf.y);
            }
            reinterpret_cast<uint4*>(out + r * d)[c] = o;
        }
    } else {
        const size_t n = static_cast<size_t>(rows) * d;
        for (size_t i = t0; i < n; i += stride) {
            const size_t r = i / d, c = i % d;
            const float g = __bfloat162float(in[r * 2 * dp + c]);
            const float u = __bfloat162float(in[r * 2 * dp + dp + c]);
            out[i] = __float2bfloat16_rn(g / (1.f + __expf(-g)) * u);
        }
    }
}
