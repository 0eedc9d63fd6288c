//! The engine's error type: bad requests (naming the field), backpressure, shutdown,
//! configuration and backend failures.

/// Errors returned by [`crate::Engine`] and [`crate::EngineHandle`].
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request is invalid; `field` names the offending field as the public API
    /// names it (`sampling.top_p`, `stopping.max_new_tokens`).
    #[error("invalid request field `{field}`: {msg}")]
    InvalidRequest { field: String, msg: String },
    /// Too many requests are waiting for admission (maps to RESOURCE_EXHAUSTED).
    #[error("engine queue full ({0} requests waiting)")]
    QueueFull(usize),
    /// The engine configuration does not fit the model or the cache.
    #[error("engine config: {0}")]
    Config(String),
    /// The request id is not known to the engine (already finished or never submitted).
    #[error("unknown request {0}")]
    UnknownRequest(crate::api::RequestId),
    /// The backend failed for good (a collective failed: a peer rank died or stalls);
    /// the engine refuses new requests.
    #[error("engine failed: {0}")]
    Failed(String),
    /// The engine thread has stopped (shut down, or it panicked).
    #[error("engine stopped")]
    Stopped,
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] mlaserve_core::Error),
}

impl From<mlaserve_core::InvalidField> for EngineError {
    fn from(e: mlaserve_core::InvalidField) -> Self {
        EngineError::InvalidRequest { field: e.field, msg: e.msg }
    }
}

/// Result alias of this crate.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
