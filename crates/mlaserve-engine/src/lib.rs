//! mlaserve-engine: continuous batching with a paged KV block manager, mixed
//! prefill/decode steps, padded MTP speculative decoding and lossless verification,
//! generic over [`mlaserve_core::Backend`].
//!
//! Two layers: the synchronous, deterministic [`Engine`] (`add_request`, `abort`,
//! `step` → events), which the tests drive directly, and the async [`EngineHandle`],
//! which runs the engine's step loop on one dedicated thread owning the backend.
//! The public vocabulary lives in [`api`]; `docs/engine.md` explains the decisions.

pub mod api;
pub mod bench;
pub mod block;
mod draft;
mod engine;
pub mod error;
mod handle;
mod penalty;
mod prefix;
pub mod rng;
pub mod sampling;
mod scheduler;
mod sequence;
mod speculation;
pub mod testing;

pub use api::{
    EngineConfig, EngineStats, Event, FinishReason, Load, Request, RequestId, SamplingParams, SpecStats, Speculation,
    StepTimes, StopMatch, Usage, MAX_SPECULATIVE_TOKENS,
};
pub use bench::{bench_engine, BenchConfig, BenchReport};
pub use engine::{Calibration, Engine};
pub use error::{EngineError, Result};
pub use handle::{EngineHandle, EngineInfo};
pub use mlaserve_core::RowLogprobs;
pub use prefix::PrefixStats;
pub use speculation::AdaptiveK;
