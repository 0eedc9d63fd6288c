//! mlaserve-cuda: the GPU backend of mlaserve.
//!
//! It owns `kernels/*.cu` (compiled by `build.rs` with nvcc into fatbins embedded in the
//! binary) and one typed launch wrapper per kernel on cudarc's safe API. Without the
//! `cuda` feature the crate needs no CUDA at all and exposes only what runs on the CPU:
//! the attention shapes ([`dims`]), the launch planning ([`plan`], [`layout`], the host
//! half of [`prefill`], the fp8 GEMMs' [`fp8_plan`]) and the RoPE tables ([`rope`]), so
//! they are unit-tested in CI.
//! Benchmarks, checks, the f64 references and random weights live in the
//! `mlaserve-cuda-lab` crate.
//!
//! With `cuda`, bottom up (a module imports only those listed before it):
//! - leaves: [`error`](CudaError), [`Gpu`] (one device's context and stream plus the
//!   loaded modules), [`kernels`] (the images), `launch` (shared launch helpers),
//!   `tensor_map` (TMA descriptors);
//! - kernels: [`linear`] (projections: cuBLAS or the batch-invariant GEMMs), [`fp8`]
//!   (fp8 block-scaled projections: activation quantisation, the weight-streaming and
//!   the Hopper wgmma GEMMs), [`router`]
//!   (the MoE router's batch-invariant f32 logits), [`ops`] (the forward pass's per-token
//!   kernels, by family), [`MlaDecode`] (the FlashMLA-style padded decode attention,
//!   docs/cuda.md), [`prefill::MlaPrefill`] (the expanded-form prefill attention),
//!   [`elementwise`] (RMSNorm, SiLU-mul, argmax), [`sample`] (the sampling rule);
//! - `peer` (the one-shot all-reduce over peer memory), [`comm`] (the tensor-parallel
//!   collectives on the device) and [`CudaBackend`], the
//!   `mlaserve_core::Backend` on one GPU.
//!
//! [`profile`] is the memory planner's profiling step (host arithmetic).
//!
//! `tests/module_graph.rs` fails on an import cycle between these modules.

pub mod dims;
pub mod fp8_plan;
pub mod layout;
pub mod plan;
pub mod prefill;
pub mod profile;
pub mod rope;
pub mod vocab;

#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
pub mod comm;
#[cfg(feature = "cuda")]
pub mod elementwise;
#[cfg(feature = "cuda")]
mod error;
#[cfg(feature = "cuda")]
pub mod fp8;
#[cfg(feature = "cuda")]
pub mod fp8_dequant;
#[cfg(feature = "cuda")]
pub mod fp8_grouped;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(feature = "cuda")]
pub mod kernels;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
pub mod linear;
#[cfg(feature = "cuda")]
pub mod logit_ops;
#[cfg(feature = "cuda")]
mod mla_decode;
#[cfg(feature = "cuda")]
pub mod ops;
#[cfg(feature = "cuda")]
mod peer;
#[cfg(feature = "cuda")]
pub mod router;
#[cfg(feature = "cuda")]
pub mod sample;
#[cfg(feature = "cuda")]
pub mod stage;
#[cfg(feature = "cuda")]
mod tensor_map;

#[cfg(feature = "cuda")]
pub use backend::{
    CaptureMode, CudaBackend, CudaHidden, CudaOptions, GraphStats, PrefillPath, WeightBytes, WeightFill,
    ABSORBED_MAX_ROWS, INVARIANT_SPLIT_BLOCKS, PEER_ALL_REDUCE_BYTES, PEER_LINES_BYTES,
};
#[cfg(feature = "cuda")]
pub use comm::{DeviceComm, TpInit};
#[cfg(feature = "cuda")]
pub use error::{CudaError, Result};
#[cfg(feature = "cuda")]
pub use gpu::Gpu;
#[cfg(feature = "cuda")]
pub use mla_decode::{MlaDecode, MlaDecodeShape, MlaKernel, MlaOut, MlaWorkspace, SplitMerge};
