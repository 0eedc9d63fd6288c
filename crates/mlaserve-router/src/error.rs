//! The router's error type and its one mapping to gRPC status codes.

use tonic::{Code, Status};

/// Everything a client request can fail with. Each variant keeps the status code it
/// maps to; [`From<RouterError> for Status`] is the only place codes are chosen.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouterError {
    /// Bad input; `field` names the request field (`sampling.top_p`, `prompt.token_ids[3]`).
    #[error("{field}: {msg}")]
    Invalid { field: String, msg: String },
    /// The admission queue is full.
    #[error("admission queue full: {0} requests in flight; retry later")]
    QueueFull(usize),
    /// No worker group is ready (none registered, or all down).
    #[error("no worker group is ready to serve")]
    NoGroup,
    /// The router is draining (SIGTERM) and takes no new requests.
    #[error("the router is shutting down")]
    Draining,
    /// The group serving the request went away after tokens had been streamed.
    #[error("worker group `{group}` failed mid-stream: {msg}")]
    GroupLost { group: String, msg: String },
    /// The client's `grpc-timeout` expired.
    #[error("deadline exceeded after {0:?}")]
    Deadline(std::time::Duration),
    /// The group refused or failed the request with its own status code.
    #[error("worker group `{group}`: {msg}")]
    Worker { group: String, code: Code, msg: String },
    /// A bug or an unexpected failure inside the router.
    #[error("internal error: {0}")]
    Internal(String),
}

impl RouterError {
    pub fn invalid(field: impl Into<String>, msg: impl Into<String>) -> Self {
        RouterError::Invalid { field: field.into(), msg: msg.into() }
    }

    /// The gRPC code this error is reported with.
    pub fn code(&self) -> Code {
        match self {
            RouterError::Invalid { .. } => Code::InvalidArgument,
            RouterError::QueueFull(_) => Code::ResourceExhausted,
            RouterError::NoGroup | RouterError::Draining | RouterError::GroupLost { .. } => Code::Unavailable,
            RouterError::Deadline(_) => Code::DeadlineExceeded,
            RouterError::Worker { code, .. } => *code,
            RouterError::Internal(_) => Code::Internal,
        }
    }
}

impl From<RouterError> for Status {
    fn from(e: RouterError) -> Status {
        Status::new(e.code(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_names_the_field() {
        let s: Status = RouterError::invalid("sampling.top_p", "must be in (0, 1], got 0").into();
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(s.message().starts_with("sampling.top_p:"), "{}", s.message());
    }

    #[test]
    fn codes() {
        assert_eq!(RouterError::QueueFull(3).code(), Code::ResourceExhausted);
        assert_eq!(RouterError::NoGroup.code(), Code::Unavailable);
        assert_eq!(RouterError::Deadline(std::time::Duration::from_secs(1)).code(), Code::DeadlineExceeded);
    }
}
