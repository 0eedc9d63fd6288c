//! mlaserve-cuda: the GPU side of mlaserve.
//!
//! It owns `kernels/*.cu` (compiled by `build.rs` with nvcc into fatbins embedded in the
//! binary), one typed launch wrapper per kernel on cudarc's safe API, and the GPU checks
//! and benchmarks. Without the `cuda` feature the crate needs no CUDA at all and exposes
//! only what runs on the CPU: the f32 reference of every kernel ([`reference`]) and the
//! launch planning ([`plan`], the host half of [`prefill`]), so both are unit-tested in CI.
//!
//! With `cuda`: [`Gpu`] is one device's context and stream plus the loaded modules,
//! [`MlaDecode`] the FlashMLA-style padded decode attention (DESIGN.md §4),
//! [`prefill::MlaPrefill`] the expanded-form prefill attention,
//! [`elementwise`] the per-token kernels (RMSNorm, SiLU-mul, argmax), [`sample`] the
//! sampling rule on the device, [`ops`] and
//! [`linear`] the forward pass's kernels and projections, [`router`] the MoE router's
//! batch-invariant f32 logits, [`CudaBackend`] the
//! `mlaserve_core::Backend` on one GPU, [`check`] the
//! kernel-vs-reference checks and [`bench`] / [`bench_prefill`] the roofline benchmarks.

pub mod layout;
pub mod plan;
pub mod prefill;
pub mod reference;
pub mod rng;

#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
pub mod bench;
#[cfg(feature = "cuda")]
pub mod bench_prefill;
#[cfg(feature = "cuda")]
pub mod bench_step;
#[cfg(feature = "cuda")]
pub mod check;
#[cfg(feature = "cuda")]
pub mod comm;
#[cfg(feature = "cuda")]
pub mod elementwise;
#[cfg(feature = "cuda")]
mod error;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(feature = "cuda")]
pub mod kernels;
#[cfg(feature = "cuda")]
pub mod linear;
#[cfg(feature = "cuda")]
mod mla_decode;
#[cfg(feature = "cuda")]
pub mod ops;
#[cfg(feature = "cuda")]
pub mod router;
#[cfg(feature = "cuda")]
pub mod sample;

#[cfg(feature = "cuda")]
pub use backend::{CudaBackend, CudaHidden, CudaOptions, GraphStats, PrefillPath, WeightBytes, ABSORBED_MAX_ROWS};
#[cfg(feature = "cuda")]
pub use comm::{DeviceComm, TpInit};
#[cfg(feature = "cuda")]
pub use error::{CudaError, Result};
#[cfg(feature = "cuda")]
pub use gpu::Gpu;
#[cfg(feature = "cuda")]
pub use mla_decode::{MlaDecode, MlaDecodeShape, MlaKernel, MlaOut, MlaWorkspace, SplitMerge};
