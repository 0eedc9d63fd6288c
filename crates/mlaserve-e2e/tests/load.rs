//! Load: 1,000 concurrent streaming clients against `serve` on the CPU backend,
//! bounded to 60 s. Every request must get exactly one final message. Prints TTFT
//! percentiles and the router's own added latency (TTFT through the router minus TTFT
//! speaking the worker protocol to the group directly, one request at a time) — the
//! figures recorded in docs/PERFORMANCE.md.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use mlaserve::client::{bench, bench_prompt, timed_request, BenchArgs, Pcts};
use mlaserve_proto::worker::{worker_client::WorkerClient, RouterBatch, SamplingParams, StoppingCriteria, Submit};
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;

const CLIENTS: usize = 1000;
const PROMPT: usize = 16;
const NEW: u32 = 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_streams() {
    let s = serve(|a| {
        a.engine.kv_blocks = Some(1024);
        a.queue_size = 2048;
        a.metrics_listen = None;
        // The embedded group takes only its router: this test talks to it too.
        a.link_secret = "load-test-secret".into();
    });
    let h = s.get();
    let addr = h.addr();

    // Router-added latency at light load: the same request, one at a time, through
    // the router and straight to the group.
    let mut c = client(addr).await;
    let mut via_router = Vec::new();
    for i in 0..30 {
        let smp = timed_request(&mut c, ids_request(bench_prompt(i, PROMPT, 500), 1)).await;
        assert!(smp.error.is_none());
        via_router.push(smp.ttft.unwrap());
    }
    let mut w = WorkerClient::connect(format!("http://{}", h.worker.addr)).await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    // Without the secret the group refuses us: no other local process can act as its router.
    let e = w.get_info(mlaserve_proto::worker::GetInfoRequest {}).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    let mut session = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    session.metadata_mut().insert("authorization", "Bearer load-test-secret".parse().unwrap());
    let mut events = w.session(session).await.unwrap().into_inner();
    let mut direct = Vec::new();
    for i in 0..30u64 {
        let t = Instant::now();
        let sub = Submit {
            id: i + 1,
            prompt: bench_prompt(i as usize, PROMPT, 500),
            sampling: Some(SamplingParams { top_p: 1.0, ..Default::default() }),
            stopping: Some(StoppingCriteria { max_new_tokens: 1, ignore_eos: true, ..Default::default() }),
        };
        tx.send(RouterBatch { submit: vec![sub], abort: vec![] }).await.unwrap();
        let mut first = None;
        while let Some(b) = events.next().await {
            let b = b.unwrap();
            for e in b.events.into_iter().filter(|e| e.id == i + 1) {
                if !e.tokens.is_empty() && first.is_none() {
                    first = Some(t.elapsed());
                }
                if e.finished.is_some() {
                    direct.push(first.unwrap());
                }
            }
            if direct.len() as u64 == i + 1 {
                break;
            }
        }
    }
    drop(tx);
    let (r, d) = (Pcts::of(via_router), Pcts::of(direct));
    println!(
        "light load TTFT: via router p50 {:.2} ms p99 {:.2} ms; direct to group p50 {:.2} ms p99 {:.2} ms; router adds p50 {:.2} ms",
        r.p50,
        r.p99,
        d.p50,
        d.p99,
        r.p50 - d.p50
    );

    // 1,000 concurrent streaming clients.
    let mut args = BenchArgs::new(format!("http://{addr}"));
    args.concurrency = CLIENTS;
    args.requests = CLIENTS;
    args.prompt_tokens = PROMPT;
    args.max_new_tokens = NEW;
    args.connections = 8;
    args.time_limit_s = 60;
    args.vocab = 500;
    let t = Instant::now();
    let report = bench(&args).await.unwrap();
    println!("{CLIENTS} concurrent streams ({PROMPT} prompt + {NEW} new tokens each):\n{report}");
    assert!(t.elapsed() < Duration::from_secs(70), "bounded to 60 s");
    assert_eq!(report.requests, CLIENTS);
    assert_eq!(report.ok, CLIENTS, "errors: {:?}", report.errors);
    for smp in &report.samples {
        assert_eq!(smp.finals, 1, "every request gets exactly one final message");
        assert_eq!(smp.tokens, NEW);
    }
    // Nothing leaks: every KV block and admission slot is back.
    let engine = h.worker.engine.clone();
    let total = engine.info().kv_blocks_total;
    assert!(eventually(Duration::from_secs(10), || engine.load().kv_blocks_free == total).await);
    assert_eq!(h.router.state.admission.in_flight(), 0);
}
