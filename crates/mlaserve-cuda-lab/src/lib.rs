//! mlaserve-cuda-lab: the workshop beside the CUDA backend. What production never runs
//! lives here: the f64 CPU references of the kernels ([`reference`]) and a small
//! deterministic generator ([`rng`]) — both built without CUDA, so their unit tests run
//! in CI, as does [`spec_projection`] (tokens per second of each k from step times) —
//! and, with the `cuda` feature, the kernel-vs-reference checks ([`check`], the
//! `mlaserve-cuda-check` binary), the roofline benchmarks ([`bench`], [`bench_prefill`],
//! [`bench_step`], [`bench_sample`], [`bench_comm`]) behind `mlaserve bench` and `benches/`, random
//! weights for them ([`random`]) and the utility kernels they use ([`util`]).

pub mod fp8_ref;
pub mod reference;
pub mod rng;
pub mod spec_projection;

#[cfg(feature = "cuda")]
pub mod bench;
#[cfg(feature = "cuda")]
pub mod bench_comm;
#[cfg(feature = "cuda")]
pub mod bench_fp8;
#[cfg(feature = "cuda")]
pub mod bench_prefill;
#[cfg(feature = "cuda")]
pub mod bench_sample;
#[cfg(feature = "cuda")]
pub mod bench_step;
#[cfg(feature = "cuda")]
pub mod check;
#[cfg(feature = "cuda")]
pub mod check_fp8;
#[cfg(feature = "cuda")]
pub mod check_fp8_grouped;
#[cfg(feature = "cuda")]
pub mod random;
#[cfg(feature = "cuda")]
pub mod util;
