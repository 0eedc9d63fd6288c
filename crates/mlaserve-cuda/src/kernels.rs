//! The embedded kernel images: one fatbin per `kernels/*.cu`, compiled by build.rs and
//! named by the file's stem in capitals (`MLA_DECODE`, `GEMM_TC`, …; `BENCH_UTIL` holds
//! the fills and the copy probe that benchmarks and checks use). A leaf.

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
