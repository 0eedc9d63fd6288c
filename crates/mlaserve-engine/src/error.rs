//! The engine's error type: bad requests (naming the field), backpressure, shutdown,
//! configuration and backend failures.

/// Errors returned by [`crate::Engine`] and [`crate::EngineHandle`].
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request is invalid; `field` names the offending request field.
    #[error("invalid request field `{field}`: {msg}")]
    InvalidRequest { field: &'static str, msg: String },
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

impl EngineError {
    pub(crate) fn invalid(field: &'static str, msg: impl Into<String>) -> Self {
        EngineError::InvalidRequest { field, msg: msg.into() }
    }
}

/// Result alias of this crate.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
