//! `bench serve --api openai`: one streaming `POST /v1/completions` timed like a gRPC
//! request (`client::timed_request`): time to the first text, the gaps between chunks,
//! end to end; the generated tokens from the final usage chunk. One HTTP/1.1
//! connection per request.

use crate::client::Sample;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use std::time::Instant;
use tokio::net::TcpStream;

/// Where the HTTP API is: `host:port` (from `http://host:port`).
pub fn authority(addr: &str) -> Result<String, String> {
    let a = addr.trim_start_matches("http://").trim_end_matches('/');
    if addr.starts_with("https://") {
        return Err(format!("{addr}: bench serve --api openai speaks plain HTTP"));
    }
    Ok(a.trim_end_matches("/v1").to_string())
}

/// The status code a HTTP status stands for (as `Sample::error` reports gRPC's).
fn code_of(status: u16) -> tonic::Code {
    match status {
        400 | 404 | 422 => tonic::Code::InvalidArgument,
        401 => tonic::Code::Unauthenticated,
        429 => tonic::Code::ResourceExhausted,
        503 => tonic::Code::Unavailable,
        408 | 504 => tonic::Code::DeadlineExceeded,
        _ => tonic::Code::Internal,
    }
}

/// Runs one streaming completion of `prompt` (token ids) and times it.
pub async fn timed_completion(authority: &str, api_key: Option<&str>, prompt: &[u32], max_tokens: u32) -> Sample {
    let start = Instant::now();
    let mut s = Sample::default();
    let body = serde_json::json!({
        "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true, "stream": true,
        "stream_options": {"include_usage": true},
    });
    let res = async {
        let tcp = TcpStream::connect(authority).await.map_err(|_| tonic::Code::Unavailable)?;
        tcp.set_nodelay(true).map_err(|_| tonic::Code::Unavailable)?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .map_err(|_| tonic::Code::Unavailable)?;
        tokio::spawn(conn);
        let mut req = hyper::Request::post("/v1/completions")
            .header("host", authority)
            .header("content-type", "application/json");
        if let Some(k) = api_key {
            req = req.header("authorization", format!("Bearer {k}"));
        }
        let req = req.body(Full::new(Bytes::from(body.to_string()))).map_err(|_| tonic::Code::Internal)?;
        let resp = send.send_request(req).await.map_err(|_| tonic::Code::Unavailable)?;
        if resp.status() != 200 {
            return Err(code_of(resp.status().as_u16()));
        }
        let mut body = resp.into_body();
        let mut buf = Vec::new();
        let mut last: Option<Instant> = None;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|_| tonic::Code::Unavailable)?;
            let Some(data) = frame.data_ref() else { continue };
            buf.extend_from_slice(data);
            // Events end with a blank line.
            while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = buf.drain(..end + 2).collect();
                let Some(json) = std::str::from_utf8(&event).ok().and_then(|e| e.trim().strip_prefix("data: ")) else {
                    continue;
                };
                if json == "[DONE]" {
                    s.finals += 1;
                    return Ok(());
                }
                let v: serde_json::Value = serde_json::from_str(json).map_err(|_| tonic::Code::Internal)?;
                if v.get("error").is_some() {
                    return Err(tonic::Code::Unavailable);
                }
                if v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
                    let now = Instant::now();
                    match last {
                        None => s.ttft = Some(now - start),
                        Some(l) => s.itl.push(now - l),
                    }
                    last = Some(now);
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    s.tokens = u["completion_tokens"].as_u64().unwrap_or(0) as u32;
                    s.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as u32;
                    s.cached_prompt_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) as u32;
                }
            }
        }
        Err(tonic::Code::Unavailable)
    }
    .await;
    if let Err(c) = res {
        s.error = Some(c);
    }
    s.e2e = start.elapsed();
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_codes() {
        assert_eq!(authority("http://127.0.0.1:8000/v1").as_deref(), Ok("127.0.0.1:8000"));
        assert_eq!(authority("127.0.0.1:8000").as_deref(), Ok("127.0.0.1:8000"));
        assert!(authority("https://x:1").is_err());
        assert_eq!(code_of(429), tonic::Code::ResourceExhausted);
        assert_eq!(code_of(503), tonic::Code::Unavailable);
    }
}
