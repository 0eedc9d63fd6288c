//! Reports an over-size request as RESOURCE_EXHAUSTED (as grpc-go and grpc-core do).
//!
//! tonic refuses a message over `max_decoding_message_size` before reading it, but
//! with OUT_OF_RANGE and inside generated code the service never sees. This layer
//! rewrites exactly that refusal on the way out; every other status passes untouched.

use http::{HeaderValue, Response};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use tower::{Layer, Service};

/// tonic's message for the refusal (percent-encoded in `grpc-message`).
const TOO_LARGE: &str = "decoded%20message%20length%20too%20large";

/// The layer (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct OversizeIsResourceExhausted;

impl<S> Layer<S> for OversizeIsResourceExhausted {
    type Service = Rewrite<S>;
    fn layer(&self, inner: S) -> Rewrite<S> {
        Rewrite(inner)
    }
}

/// The service the layer wraps around.
#[derive(Debug, Clone)]
pub struct Rewrite<S>(S);

impl<S, Req, B> Service<Req> for Rewrite<S>
where
    S: Service<Req, Response = Response<B>>,
    S::Future: Send + 'static,
{
    type Response = Response<B>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<B>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let fut = self.0.call(req);
        Box::pin(async move {
            let mut resp = fut.await?;
            let h = resp.headers_mut();
            let oversize = h.get("grpc-status").is_some_and(|v| v == "11")
                && h.get("grpc-message").and_then(|m| m.to_str().ok()).is_some_and(|m| m.contains(TOO_LARGE));
            if oversize {
                h.insert("grpc-status", HeaderValue::from_static("8"));
            }
            Ok(resp)
        })
    }
}
