// The one-shot all-reduce of tensor parallelism over peer memory (NVLink), for the small
// messages of a decode step, where NCCL's latency (tens of microseconds a call) and not
// the link sets the pace. One kernel, capturable in a CUDA graph:
//
//   1. each block pushes its slice of the input into slot `rank` of every rank's buffer
//      (its own included), in the half of the buffer that this call's parity picks;
//   2. it raises its flag in every peer's buffer (release, system scope) and waits until
//      every peer's flag for this call is up in its own (acquire);
//   3. it sums its slice over the slots in rank order 0, 1, …, world-1 — exactly
//      `sum_ranks_f32`'s order, so every rank gets the same bits and the result of an
//      element depends only on the ranks' values (batch-invariant by construction);
//      or, as an all-gather (`gather`), copies the slots out rank-major.
//
// Each block counts its own calls (`counters`, on this rank only); every call launches
// the same PR_BLOCKS blocks with the same slicing on every rank, so block b's count is
// the group's call number and its flag value. Two halves make a third barrier needless:
// a rank writes half p again only two calls later, and it cannot start that call before
// every peer has raised its flags for the call in between, which they do only after
// reading half p. A peer that never arrives ends the wait after `timeout_ns`: the rank
// marks itself failed (a word in its buffer, which every later call checks first and
// then returns at once) and raises `status` in mapped host memory, which the host reads
// after each wait, so the step fails with an error instead of spinning forever (the
// host's wait has the same deadline).
//
// Small messages take a second kernel, `peer_all_reduce_lines_f32`, without the flag
// barrier: every 16-byte line a rank pushes carries two values, each beside the call
// number (as NCCL's LL protocol does), so a reader waits on the line itself and no fence
// stands between a push and its use. It costs twice the bytes, which only the small
// messages can spare. Both kernels count their calls in the same counters, launch the
// same blocks and slice alike, so a group may switch between them from call to call.
//
// Layout of a rank's buffer (bytes from its base; the Rust side, `peer.rs`, agrees):
//   [0, 4·PR_BLOCKS·PR_MAX_WORLD)   flags[block][peer], written by the peers
//   then 4·PR_BLOCKS bytes          counters[block], this rank's own
//   then 4 bytes                    failed: set once a wait timed out
//   [PR_DATA_OFFSET, …)            data[parity 2][rank world][cap floats]
//   [lines_offset, …)              lines[parity 2][rank world][line_cap 16-byte lines]

#include <cstddef>
#include <cstdint>

constexpr int PR_MAX_WORLD = 8;
constexpr int PR_BLOCKS = 32;
constexpr int PR_THREADS = 512;
constexpr size_t PR_DATA_OFFSET = 4096;

struct PeerBases {
    unsigned long long p[PR_MAX_WORLD];
};

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// One spin of a wait for a peer, `spins` its count so far (`start` 0 at the wait's
// start): every 1024 spins it reads the clock, and once `timeout_ns` has passed since
// the first reading it marks the rank failed (`failed`, then `status` for the host) and
// returns true: the peer died or stalls, and the wait must end.
__device__ __forceinline__ bool wait_timed_out(uint32_t spins, uint64_t& start, unsigned long long timeout_ns,
                                               volatile uint32_t* failed, unsigned int* status) {
    if ((spins & 1023) != 1023) return false;
    const uint64_t t = global_ns();
    if (start == 0) {
        start = t;
        return false;
    }
    if (t - start <= timeout_ns) return false;
    *failed = 1;
    *reinterpret_cast<volatile unsigned int*>(status) = 1;
    __threadfence_system();
    return true;
}

// `out` may be `in` (the in-place all-reduce): a block reads only its own slice of `in`,
// before the barrier, and writes only that slice of `out`, after it. With `gather`, `out`
// holds `world` × n floats (rank-major) and must not overlap `in`. Both kernels take the
// same arguments: `offset` is where their region of the buffer starts (PR_DATA_OFFSET
// here), `cap` a slot's size in their units (floats here, lines there).
extern "C" __global__ void __launch_bounds__(PR_THREADS)
    peer_all_reduce_f32(float* out, const float* in, size_t n, PeerBases bases, int rank, int world, size_t offset,
                        size_t cap, unsigned long long timeout_ns, unsigned int* status, int gather) {
    char* mine = reinterpret_cast<char*>(bases.p[rank]);
    uint32_t* flags = reinterpret_cast<uint32_t*>(mine);
    uint32_t* counters = flags + PR_BLOCKS * PR_MAX_WORLD;
    volatile uint32_t* failed = counters + PR_BLOCKS;
    if (*failed) return;  // the group failed earlier: no more waits
    const int b = blockIdx.x;
    const uint32_t call = counters[b] + 1;
    const size_t half = static_cast<size_t>(call & 1) * world * cap;

    // This block's slice: whole float4s except at the very end of the message.
    const size_t per = (((n + PR_BLOCKS - 1) / PR_BLOCKS) + 3) & ~static_cast<size_t>(3);
    const size_t lo = min(n, b * per), hi = min(n, lo + per);

    for (int p = 0; p < world; ++p) {
        float* dst = reinterpret_cast<float*>(reinterpret_cast<char*>(bases.p[p]) + offset) + half +
                     static_cast<size_t>(rank) * cap;
        for (size_t i = lo + 4 * threadIdx.x; i < hi; i += 4 * PR_THREADS) {
            if (i + 4 <= hi) {
                *reinterpret_cast<float4*>(dst + i) = *reinterpret_cast<const float4*>(in + i);
            } else {
                for (size_t j = i; j < hi; ++j) dst[j] = in[j];
            }
        }
    }
    __syncthreads();
    if (threadIdx.x < world && static_cast<int>(threadIdx.x) != rank) {
        const int peer = threadIdx.x;
        __threadfence_system();
        st_release_sys(reinterpret_cast<uint32_t*>(bases.p[peer]) + b * PR_MAX_WORLD + rank, call);
        const uint32_t* f = flags + b * PR_MAX_WORLD + peer;
        uint64_t start = 0;
        for (uint32_t spins = 0; static_cast<int32_t>(ld_acquire_sys(f) - call) < 0; ++spins) {
            if (wait_timed_out(spins, start, timeout_ns, failed, status)) break;
        }
    }
    __syncthreads();

    const float* src = reinterpret_cast<const float*>(mine + offset) + half;
    if (gather) {
        for (int r = 0; r < world; ++r) {
            const float* from = src + static_cast<size_t>(r) * cap;
            float* to = out + static_cast<size_t>(r) * n;
            for (size_t i = lo + threadIdx.x; i < hi; i += PR_THREADS) to[i] = __ldcg(from + i);
        }
        if (threadIdx.x == 0) counters[b] = call;
        return;
    }
    for (size_t i = lo + 4 * threadIdx.x; i < hi; i += 4 * PR_THREADS) {
        if (i + 4 <= hi) {
            float4 t = __ldcg(reinterpret_cast<const float4*>(src + i));
            for (int r = 1; r < world; ++r) {
                const float4 u = __ldcg(reinterpret_cast<const float4*>(src + static_cast<size_t>(r) * cap + i));
                t.x += u.x;
                t.y += u.y;
                t.z += u.z;
                t.w += u.w;
            }
            *reinterpret_cast<float4*>(out + i) = t;
        } else {
            for (size_t j = i; j < hi; ++j) {
                float t = __ldcg(src + j);
                for (int r = 1; r < world; ++r) t += __ldcg(src + static_cast<size_t>(r) * cap + j);
                out[j] = t;
            }
        }
    }
    if (threadIdx.x == 0) counters[b] = call;
}

__device__ __forceinline__ void st_line(uint4* p, uint4 v) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ uint4 ld_line(const uint4* p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

// The lines protocol (see the top): a line is {value i, call, value i + 1, call}; a reader
// takes it once both call words are this call's. Line j of a slot holds values 2j, 2j+1.
// A rank writes a half again two calls later only after its previous call read a line
// of every peer's next call, which each peer writes only after its own previous call —
// the reads of that half — is done (block 0 always has values, so every call waits on
// some line). The rank's own values come from `in`, never through memory; the sum runs
// over the ranks in order 0, 1, …, as the flag kernel's does, so both give the same bits.
extern "C" __global__ void __launch_bounds__(PR_THREADS)
    peer_all_reduce_lines_f32(float* out, const float* in, size_t n, PeerBases bases, int rank, int world,
                              size_t lines_offset, size_t line_cap, unsigned long long timeout_ns,
                              unsigned int* status, int gather) {  // as peer_all_reduce_f32's
    char* mine = reinterpret_cast<char*>(bases.p[rank]);
    uint32_t* flags = reinterpret_cast<uint32_t*>(mine);
    uint32_t* counters = flags + PR_BLOCKS * PR_MAX_WORLD;
    volatile uint32_t* failed = counters + PR_BLOCKS;
    if (*failed) return;
    const int b = blockIdx.x;
    const uint32_t call = counters[b] + 1;
    const size_t half = static_cast<size_t>(call & 1) * world * line_cap;
    // This block's slice, an even number of values (whole lines) but at the very end.
    const size_t per = (((n + PR_BLOCKS - 1) / PR_BLOCKS) + 1) & ~static_cast<size_t>(1);
    const size_t lo = min(n, b * per), hi = min(n, lo + per);

    for (size_t i = lo + 2 * threadIdx.x; i < hi; i += 2 * PR_THREADS) {
        const float v1 = i + 1 < hi ? in[i + 1] : 0.f;
        const uint4 line = make_uint4(__float_as_uint(in[i]), call, __float_as_uint(v1), call);
        for (int p = 0; p < world; ++p) {
            if (p == rank) continue;
            uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<char*>(bases.p[p]) + lines_offset) + half +
                         static_cast<size_t>(rank) * line_cap + i / 2;
            st_line(dst, line);
        }
    }

    const uint4* src = reinterpret_cast<const uint4*>(mine + lines_offset) + half;
    bool timed_out = false;
    for (size_t i = lo + 2 * threadIdx.x; i < hi; i += 2 * PR_THREADS) {
        const bool two = i + 1 < hi;
        const float own0 = in[i], own1 = two ? in[i + 1] : 0.f;
        float t0 = 0.f, t1 = 0.f;
        for (int r = 0; r < world; ++r) {
            float a0 = own0, a1 = own1;
            if (r != rank) {
                const uint4* at = src + static_cast<size_t>(r) * line_cap + i / 2;
                uint4 v = ld_line(at);
                uint64_t start = 0;
                for (uint32_t spins = 0; (v.y != call || v.w != call) && !timed_out; ++spins) {
                    timed_out = wait_timed_out(spins, start, timeout_ns, failed, status);
                    v = ld_line(at);
                }
                a0 = __uint_as_float(v.x);
                a1 = __uint_as_float(v.z);
            }
            if (gather) {
                out[static_cast<size_t>(r) * n + i] = a0;
                if (two) out[static_cast<size_t>(r) * n + i + 1] = a1;
            } else if (r == 0) {
                t0 = a0;
                t1 = a1;
            } else {
                t0 += a0;
                t1 += a1;
            }
        }
        if (!gather) {
            out[i] = t0;
            if (two) out[i + 1] = t1;
        }
    }
    __syncthreads();  // every thread has read `counters[b]`
    if (threadIdx.x == 0) counters[b] = call;
}
