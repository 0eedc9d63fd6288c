// Constants shared by the MLA decode kernels (mla_decode.cu: mma.sync path, combine,
// generic; mla_decode_sm90.cu: wgmma path). The Rust wrapper (crates/mlaserve-cuda/
// src/mla_decode.rs) mirrors them.
#pragma once

namespace mla {

constexpr int BM = 64;        // query rows per tile
constexpr int BN = 32;        // cache tokens per pipeline chunk (half a page)
constexpr int PAGE = 64;      // tokens per cache page (FlashMLA's block size)
constexpr int STAGES = 3;     // cp.async ring depth, in chunks
constexpr int NTHREADS = 256; // 8 warps = 2 warpgroups

}  // namespace mla
