//! mlaserve-core: the vocabulary every other crate speaks.
//!
//! It owns the model configuration (HF `config.json`), the error type, sampling
//! parameters and the rules a request must follow ([`request`]), the batch types a
//! backend consumes, and the [`Backend`] and [`Collective`] traits. It knows nothing about CUDA, tonic or the scheduler.

pub mod backend;
pub mod collective;
pub mod config;
pub mod drafting;
pub mod error;
pub mod kv_cache;
pub mod logits;
pub mod memory;
pub mod request;
pub mod sampling;

pub use backend::{argmax, Backend, Batch, ForwardOutput, SeqChunk, BLOCK_SIZE, MAX_DRAFT_SLOTS};
pub use collective::{Collective, SingleRank};
pub use config::{ModelConfig, MoeConfig, RopeScaling, ScoringFunc, TopkMethod};
pub use error::{Error, Result};
pub use kv_cache::{KvCacheDtype, KV_FP8_GROUP};
pub use logits::{
    host_choices, penalty_sub, row_logprobs, Choices, LogitEdit, LogprobRow, RowEdits, RowLogprobs, MAX_TOP_LOGPROBS,
};
pub use request::{InvalidField, RequestLimits};
pub use sampling::{sample_from, sample_token, target_distribution, SampleRow, SamplingParams, TargetDist};
