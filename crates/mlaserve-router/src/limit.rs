//! Gives the client's own faults in a request's bytes the codes that say so.
//!
//! tonic refuses a message over `max_decoding_message_size` before reading it, with
//! OUT_OF_RANGE, and a message it cannot decode (malformed protobuf, a wrong wire type,
//! invalid UTF-8 in a string field) with INTERNAL — both inside generated code the
//! service never sees. This layer rewrites exactly those refusals on the way out: an
//! over-size message becomes RESOURCE_EXHAUSTED (as grpc-go and grpc-core report it), an
//! undecodable one INVALID_ARGUMENT, counted in `mlaserve_requests_total` like every
//! other refusal. Every other status passes untouched.

use http::{HeaderValue, Response};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use tower::{Layer, Service};

/// tonic's message for an over-size refusal (percent-encoded in `grpc-message`).
const TOO_LARGE: &str = "decoded%20message%20length%20too%20large";
/// tonic's message for a request that does not decode (percent-encoded).
const UNDECODABLE: &str = "failed%20to%20decode%20Protobuf%20message";

/// The layer (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct ClientFaultCodes;

impl<S> Layer<S> for ClientFaultCodes {
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
            let message = h.get("grpc-message").and_then(|m| m.to_str().ok()).unwrap_or("");
            let status = h.get("grpc-status").and_then(|v| v.to_str().ok()).unwrap_or("");
            if status == "11" && message.contains(TOO_LARGE) {
                h.insert("grpc-status", HeaderValue::from_static("8"));
            } else if status == "13" && message.contains(UNDECODABLE) {
                h.insert("grpc-status", HeaderValue::from_static("3"));
                metrics::counter!("mlaserve_requests_total", "outcome" => "invalid_argument").increment(1);
            }
            Ok(resp)
        })
    }
}
