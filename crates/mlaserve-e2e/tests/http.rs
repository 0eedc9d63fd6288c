//! The OpenAI-compatible HTTP API under load: `bench serve --api openai` (streaming
//! `POST /v1/completions`, one connection per request) and `--api grpc` against the same
//! `serve` on the CPU backend (gRPC first to warm the server up, then HTTP, then gRPC
//! again). Every request gets its tokens over both; prints TTFT and inter-token
//! percentiles of each (docs/PERFORMANCE.md). The API's own behaviour is
//! tested through the official openai client by `tests/openai/test_api.py`.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use mlaserve::client::{bench, Api, BenchArgs};
use std::net::SocketAddr;

const STREAMS: usize = 200;
const NEW: u32 = 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_http_streams_get_every_token() {
    let s = serve(|a| {
        a.engine.kv_blocks = Some(1024);
        a.http_listen = mlaserve::serve::HttpListen(Some(SocketAddr::from(([127, 0, 0, 1], 0))));
    });
    let h = s.get();
    let http = h.router.http_addr.expect("the HTTP API listens");
    for (api, addr) in [
        (Api::Grpc, format!("http://{}", h.addr())),
        (Api::Openai, format!("http://{http}")),
        (Api::Grpc, format!("http://{}", h.addr())),
    ] {
        let mut args = BenchArgs::new(addr);
        args.api = api;
        args.concurrency = STREAMS;
        args.requests = STREAMS;
        args.prompt_tokens = 16;
        args.max_new_tokens = NEW;
        args.vocab = 500;
        args.time_limit_s = 120;
        let r = bench(&args).await.unwrap();
        println!(
            "{api:?}, {STREAMS} streams: TTFT p50 {:.1} ms p99 {:.1} ms; inter-token p50 {:.2} ms p99 {:.2} ms; {:.0} tokens/s",
            r.ttft.p50,
            r.ttft.p99,
            r.itl.p50,
            r.itl.p99,
            r.tokens_per_s()
        );
        assert_eq!((r.ok, r.requests), (STREAMS, STREAMS), "{api:?}: {:?}", r.errors);
        assert_eq!(r.tokens, (STREAMS as u64) * NEW as u64, "{api:?}: every token arrives");
        assert!(r.samples.iter().all(|s| s.finals == 1), "{api:?}: one end per stream");
    }
}
