//! Bearer-token access control: the router's `--api-key`s and a worker's shared group
//! secret.
//!
//! [`Keys`] holds the accepted tokens (from flags and files, one per line); [`RequireBearer`]
//! is a tower layer for a tonic server that answers every call outside the open paths
//! (health, for probes) with UNAUTHENTICATED unless it carries
//! `authorization: Bearer <token>` with an accepted token. Tokens are compared in time
//! independent of where they differ.

use http::{Request, Response};
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower::{Layer, Service};

/// The gRPC health service: open to probes whatever the keys.
pub const HEALTH_PATH: &str = "/grpc.health.v1.Health/";

/// Accepted bearer tokens.
#[derive(Clone, Default)]
pub struct Keys(Arc<Vec<Vec<u8>>>);

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Keys({} keys)", self.0.len())
    }
}

/// A key file that cannot be used, naming the flag and the file.
#[derive(Debug, thiserror::Error)]
#[error("{flag} {path}: {msg}")]
pub struct KeyFileError {
    pub flag: &'static str,
    pub path: String,
    pub msg: String,
}

impl Keys {
    /// The keys given on the command line plus those in `files` (one per line; blank
    /// lines and lines starting with `#` are skipped). `flag` names the file flag for
    /// messages. A key may not contain whitespace (it must fit a header).
    pub fn load(keys: &[String], files: &[impl AsRef<Path>], flag: &'static str) -> Result<Keys, KeyFileError> {
        let mut all: Vec<Vec<u8>> = Vec::new();
        let bad = |path: &Path, msg: String| KeyFileError { flag, path: path.display().to_string(), msg };
        for k in keys {
            check_key(k).map_err(|m| bad(Path::new("(command line)"), m))?;
            all.push(k.as_bytes().to_vec());
        }
        for f in files {
            let f = f.as_ref();
            let text = std::fs::read_to_string(f).map_err(|e| bad(f, e.to_string()))?;
            let before = all.len();
            for (i, line) in text.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                check_key(line).map_err(|m| bad(f, format!("line {}: {m}", i + 1)))?;
                all.push(line.as_bytes().to_vec());
            }
            if all.len() == before {
                return Err(bad(f, "holds no key".into()));
            }
        }
        Ok(Keys(Arc::new(all)))
    }

    /// No key configured: everyone is let in.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether an `authorization` header value carries an accepted key.
    pub fn accepts(&self, authorization: Option<&[u8]>) -> bool {
        let Some(token) = authorization.and_then(bearer) else { return false };
        // Every key is compared, each in time independent of the bytes.
        self.0.iter().fold(false, |ok, k| ok | constant_time_eq(k, token))
    }
}

fn check_key(k: &str) -> Result<(), String> {
    if k.is_empty() {
        return Err("an empty key".into());
    }
    if k.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("a key may not contain whitespace or control characters".into());
    }
    Ok(())
}

/// The token of `Bearer <token>` (the scheme is case-insensitive).
fn bearer(v: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = v.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then(|| rest.trim_ascii())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// What a refusal does besides answering UNAUTHENTICATED.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnRefusal {
    /// Count it in `mlaserve_requests_total{outcome="unauthenticated"}` (the router's
    /// public API).
    Count,
    /// Log a warning with the peer's address (a worker: someone tried to act as its
    /// router).
    Warn,
}

/// The layer (see the module docs).
#[derive(Debug, Clone)]
pub struct RequireBearer {
    keys: Keys,
    open: &'static [&'static str],
    on_refusal: OnRefusal,
    what: &'static str,
}

impl RequireBearer {
    /// Requires one of `keys` on every path that does not start with one of `open`;
    /// `what` names the credential in refusals ("API key", "group secret").
    pub fn new(keys: Keys, open: &'static [&'static str], on_refusal: OnRefusal, what: &'static str) -> Self {
        RequireBearer { keys, open, on_refusal, what }
    }
}

impl<S> Layer<S> for RequireBearer {
    type Service = Checked<S>;
    fn layer(&self, inner: S) -> Checked<S> {
        Checked { inner, gate: self.clone() }
    }
}

/// The service the layer wraps around.
#[derive(Debug, Clone)]
pub struct Checked<S> {
    inner: S,
    gate: RequireBearer,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B> Service<Request<B>> for Checked<S>
where
    S: Service<Request<B>, Response = Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let g = &self.gate;
        let path = req.uri().path();
        let open = g.keys.is_empty() || g.open.iter().any(|p| path.starts_with(p));
        if open || g.keys.accepts(req.headers().get(http::header::AUTHORIZATION).map(|v| v.as_bytes())) {
            return Box::pin(self.inner.call(req));
        }
        let msg = if req.headers().contains_key(http::header::AUTHORIZATION) {
            format!("the {} is not valid", g.what)
        } else {
            format!("missing `authorization: Bearer <{}>` metadata", g.what)
        };
        match g.on_refusal {
            OnRefusal::Count => {
                metrics::counter!("mlaserve_requests_total", "outcome" => "unauthenticated").increment(1);
            }
            OnRefusal::Warn => {
                tracing::warn!(peer = %peer(&req).unwrap_or_else(|| "unknown".into()), path, "refused a call: {msg}");
            }
        }
        let resp = tonic::Status::unauthenticated(msg).into_http();
        Box::pin(async move { Ok(resp) })
    }
}

/// The caller's address, over plain TCP or TLS.
fn peer<B>(req: &Request<B>) -> Option<String> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let e = req.extensions();
    e.get::<TcpConnectInfo>()
        .and_then(|i| i.remote_addr())
        .or_else(|| e.get::<TlsConnectInfo<TcpConnectInfo>>().and_then(|i| i.get_ref().remote_addr()))
        .map(|a| a.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(k: &[&str]) -> Keys {
        Keys::load(&k.iter().map(|s| s.to_string()).collect::<Vec<_>>(), &[] as &[&Path], "--api-key-file").unwrap()
    }

    #[test]
    fn only_a_listed_bearer_key_is_accepted() {
        let k = keys(&["alpha", "beta-2"]);
        assert!(k.accepts(Some(b"Bearer alpha")));
        assert!(k.accepts(Some(b"bearer beta-2")));
        assert!(k.accepts(Some(b"BEARER  beta-2 ")));
        for bad in [&b"Bearer alph"[..], b"Bearer alphaa", b"Basic alpha", b"alpha", b"Bearer ", b""] {
            assert!(!k.accepts(Some(bad)), "{}", String::from_utf8_lossy(bad));
        }
        assert!(!k.accepts(None));
        assert!(keys(&[]).is_empty());
    }

    #[test]
    fn key_files_skip_comments_and_name_the_file_when_bad() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("keys");
        std::fs::write(&good, "# team a\nk1\n\n  k2  \n").unwrap();
        let k = Keys::load(&["k0".to_string()], &[&good], "--api-key-file").unwrap();
        for t in ["k0", "k1", "k2"] {
            assert!(k.accepts(Some(format!("Bearer {t}").as_bytes())), "{t}");
        }
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "# nothing\n").unwrap();
        let e = Keys::load(&[], &[&empty], "--api-key-file").unwrap_err().to_string();
        assert!(e.starts_with("--api-key-file ") && e.contains("empty") && e.ends_with("holds no key"), "{e}");
        let spaced = dir.path().join("spaced");
        std::fs::write(&spaced, "a b\n").unwrap();
        let e = Keys::load(&[], &[&spaced], "--api-key-file").unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("whitespace"), "{e}");
        let e = Keys::load(&[], &[dir.path().join("missing")], "--api-key-file").unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");
    }
}
