// MoE routing (`Ops::route_split`): the routing kernel moe_route_f32 and its warp helpers,
// included by backend_ops.cu (one module).
#pragma once

#include "common.cuh"

// Experts a lane of moe_route_f32 holds in registers (routers of up to 32 × this many).
constexpr int ROUTE_MAXR = 8;
// warp_argmax's "nothing offered" index.
constexpr int ROUTE_NONE = 0x7fffffff;

// An order-preserving key of a float (a larger float, a larger key; NaN aside).
__device__ __forceinline__ unsigned route_key(float v) {
    const unsigned b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The index offered with the largest key over the warp, ties to the smaller index (a
// lane with nothing to offer gives key 0 and ROUTE_NONE); every lane gets it.
__device__ __forceinline__ int warp_argmax(unsigned key, int idx) {
    const unsigned top = __reduce_max_sync(0xffffffffu, key);
    return static_cast<int>(__reduce_min_sync(0xffffffffu, key == top ? static_cast<unsigned>(idx) : 0xffffffffu));
}

// MoE routing for one token per block (mirrors mlaserve-cpu's moe::route).
// method: 0 greedy, 1 group_limited_greedy (group max), 2 noaux_tc (bias for choice only,
// group = sum of its top 2). scoring: 0 sigmoid, 1 softmax. Ties go to the lower index.
// Scores by the whole block; group scores, group choice and the top k on warp 0 (lanes
// over groups, then over the experts in registers, each pick a warp argmax), giving the
// serial rule's picks.
// With ksplit > 1, `logits` holds the router's k-range partials [ksplit][tokens][experts]
// (router_f32_tile*'s output, tokens = gridDim.x) and each logit is their sum in range
// order, ((p_0 + p_1) + p_2) + ..., as router_reduce_f32 adds them: the same bits, one
// launch fewer.
// Dynamic shared memory: (2 * experts + n_group) floats + (experts + n_group) bytes.
extern "C" __global__ void moe_route_f32(int* __restrict__ ids, float* __restrict__ weights,
                                         const float* __restrict__ logits, const float* __restrict__ bias,
                                         int experts, int k, int n_group, int topk_group, int method, int scoring,
                                         int has_bias, int normalise, float scale, int ksplit) {
    extern __shared__ float rs[];
    __shared__ float red[32];
    float* score = rs;
    float* choice = rs + experts;
    float* gscore = choice + experts;
    unsigned char* taken = reinterpret_cast<unsigned char*>(gscore + n_group);
    unsigned char* gkeep = taken + experts;
    const float* lg = logits + static_cast<size_t>(blockIdx.x) * experts;
    const size_t plane = static_cast<size_t>(gridDim.x) * experts;
    // The logits, parked in score[] (each thread its own experts, in both loops below).
    float m = -INFINITY;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        float v = lg[e];
        // Eight partials loaded at a time, then added in order.
        for (int z0 = 1; z0 < ksplit; z0 += 8) {
            float p[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) p[j] = z0 + j < ksplit ? lg[(z0 + j) * plane + e] : 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (z0 + j < ksplit) v = __fadd_rn(v, p[j]);
        }
        score[e] = v;
        m = fmaxf(m, v);
    }
    m = block_max(m, red);
    float s = 0.f;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        const float l = score[e];
        const float v = scoring == 0 ? 1.f / (1.f + expf(-l)) : expf(l - m);
        score[e] = v;
        s += v;
    }
    s = block_sum(s, red);
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        if (scoring == 1) score[e] /= s;
        choice[e] = score[e] + (method == 2 && has_bias ? bias[e] : 0.f);
        taken[e] = 0;
    }
    __syncthreads();
    // The rest on warp 0. Groups: each lane takes whole groups (their top 2 in order).
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    const int per = experts / n_group;
    for (int g = lane; g < n_group; g += 32) {
        const float* c = choice + g * per;
        float a = -INFINITY, b = -INFINITY;  // the two largest
        // Lane g starts at element g of its group (the two largest values do not depend on
        // the order): lanes reading groups 32 floats apart would all hit one bank.
        for (int i0 = 0, i = g % per; i0 < per; ++i0, i = i + 1 == per ? 0 : i + 1) {
            if (c[i] > a) {
                b = a;
                a = c[i];
            } else if (c[i] > b) {
                b = c[i];
            }
        }
        gscore[g] = method == 2 ? (per >= 2 ? a + b : a) : a;
        gkeep[g] = method == 0;
    }
    __syncwarp();
    // The kept groups: topk_group rounds of a warp argmax over the others (the first
    // maximum, ties to the lower group, as the serial rule).
    if (method != 0) {
        for (int it = 0; it < topk_group; ++it) {
            unsigned key = 0;
            int idx = ROUTE_NONE;
            for (int g = lane; g < n_group; g += 32) {
                if (gkeep[g]) continue;
                const unsigned kg = route_key(gscore[g]);
                if (idx == ROUTE_NONE || kg > key) key = kg, idx = g;
            }
            const int best = warp_argmax(key, idx);
            if (best != ROUTE_NONE && lane == 0) gkeep[best] = 1;
            __syncwarp();
        }
    }
    // Top k, experts of a dropped group competing at -inf (they can still be taken once
    // nothing else is left, as in the serial rule). Lane l holds experts l, l + 32, ...
    // (up to ROUTE_MAXR of them) in registers; each round every lane offers its first
    // maximum not yet taken and a warp argmax picks the largest, ties to the lower expert:
    // the serial scan's pick (the first maximum, ties to the lower index) for values that
    // are not NaN. Wider routers run the same rounds over shared memory.
    float sum = 0.f;
    int* sel = reinterpret_cast<int*>(choice);  // the picks, once choice is read
    if (experts <= 32 * ROUTE_MAXR) {
        float v[ROUTE_MAXR];
        unsigned live = 0;  // bit r: expert lane + 32r exists and is not taken
#pragma unroll
        for (int r = 0; r < ROUTE_MAXR; ++r) {
            const int e = lane + 32 * r;
            v[r] = -INFINITY;
            if (e < experts) {
                v[r] = gkeep[e / per] ? choice[e] : -INFINITY;
                live |= 1u << r;
            }
        }
        __syncwarp();  // every lane has read choice before lane 0 writes sel over it
        for (int it = 0; it < k; ++it) {
            unsigned key = 0;
            int idx = ROUTE_NONE;
#pragma unroll
            for (int r = 0; r < ROUTE_MAXR; ++r) {
                if (!((live >> r) & 1u)) continue;
                const unsigned kr = route_key(v[r]);
                if (idx == ROUTE_NONE || kr > key) key = kr, idx = lane + 32 * r;
            }
            const int best = warp_argmax(key, idx);
            if ((best & 31) == lane) live &= ~(1u << (best >> 5));
            if (lane == 0) {
                sel[it] = best;
                sum += score[best];
            }
        }
    } else {
        for (int e = lane; e < experts; e += 32)
            if (!gkeep[e / per]) choice[e] = -INFINITY;
        __syncwarp();
        for (int it = 0; it < k; ++it) {
            unsigned key = 0;
            int idx = ROUTE_NONE;
            for (int e = lane; e < experts; e += 32) {
                if (taken[e]) continue;
                const unsigned ke = route_key(choice[e]);
                if (idx == ROUTE_NONE || ke > key) key = ke, idx = e;
            }
            const int best = warp_argmax(key, idx);
            if (lane == 0) {
                taken[best] = 1;
                ids[static_cast<size_t>(blockIdx.x) * k + it] = best;
                sum += score[best];
            }
            __syncwarp();
        }
    }
    if (lane != 0) return;
    int* oi = ids + static_cast<size_t>(blockIdx.x) * k;
    float* ow = weights + static_cast<size_t>(blockIdx.x) * k;
    const bool fast = experts <= 32 * ROUTE_MAXR;
    for (int it = 0; it < k; ++it) {
        const int b = fast ? sel[it] : oi[it];
        oi[it] = b;
        ow[it] = (normalise ? score[b] / (sum + 1e-20f) : score[b]) * scale;
    }
}
