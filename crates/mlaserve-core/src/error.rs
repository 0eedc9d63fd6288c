//! The error type shared by the library crates. Binaries wrap it with `anyhow`.

use std::path::PathBuf;

/// Errors raised by configuration parsing, weight loading and backends.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A `config.json` field is missing, malformed or has a value we do not support.
    #[error("config field `{field}`: {msg}")]
    Config { field: String, msg: String },
    /// A file could not be read or parsed.
    #[error("{}: {msg}", path.display())]
    File { path: PathBuf, msg: String },
    /// A tensor is missing or has the wrong shape/dtype.
    #[error("tensor `{name}`: {msg}")]
    Tensor { name: String, msg: String },
    /// A batch handed to a backend is inconsistent (a caller bug or a bad request).
    #[error("invalid batch: {0}")]
    Batch(String),
    /// A collective operation failed or timed out.
    #[error("collective: {0}")]
    Collective(String),
    /// Backend-specific failure (CUDA, cuBLAS, NCCL...).
    #[error("backend: {0}")]
    Backend(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl Error {
    pub fn config(field: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Config { field: field.into(), msg: msg.into() }
    }
    pub fn file(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::File { path: path.into(), msg: msg.into() }
    }
    pub fn tensor(name: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Tensor { name: name.into(), msg: msg.into() }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
