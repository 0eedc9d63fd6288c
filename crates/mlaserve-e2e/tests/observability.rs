//! `/metrics` over real servers: every unlabelled metric, `mlaserve_ready_groups`
//! included, is there from the first scrape; a killed group's load gauges read 0 rather
//! than its last report.
//!
//! Its own test binary, one test in phases: the Prometheus recorder is process-wide, so
//! what one router publishes shows on every router's endpoint in this process.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use mlaserve_router::{RouterArgs, RouterHandle};
use mlaserve_worker::{WorkerArgs, WorkerHandle};
use std::net::SocketAddr;
use std::time::Duration;
use tokio_stream::StreamExt;

fn metrics_listen() -> Option<SocketAddr> {
    Some(SocketAddr::from(([127, 0, 0, 1], 0)))
}

fn router(workers: Vec<String>) -> Background<RouterHandle> {
    let mut a = RouterArgs::new(model_path());
    a.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    a.metrics_listen = metrics_listen();
    a.workers = workers;
    Background::start(move || async move { mlaserve_router::start(a).await.unwrap() })
}

fn worker() -> Background<WorkerHandle> {
    let mut a = WorkerArgs::new(model_path());
    a.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    a.engine.kv_blocks = Some(256);
    Background::start(move || async move { start_cpu_worker(a).await })
}

async fn scrape(addr: SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// The value of the series `series` (name and labels as rendered), if present.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The documented metrics without labels: present, at zero if nothing happened yet.
const UNLABELLED: &[&str] = &[
    "mlaserve_ready_groups",
    "mlaserve_router_in_flight",
    "mlaserve_prompt_tokens_total",
    "mlaserve_generation_tokens_total",
    "mlaserve_draft_tokens_total",
    "mlaserve_accepted_tokens_total",
    "mlaserve_engine_steps_total",
    "mlaserve_graph_captures_total",
    "mlaserve_etcd_watch_restarts_total",
    "mlaserve_time_to_first_token_seconds_count",
    "mlaserve_inter_token_latency_seconds_count",
    "mlaserve_request_duration_seconds_count",
    "mlaserve_queue_time_seconds_count",
    "mlaserve_router_overhead_seconds_count",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_from_the_first_scrape_and_after_a_kill() {
    // A router with no group yet: its first scrape already has every unlabelled
    // metric, and zero ready groups.
    let idle = router(Vec::new());
    let text = scrape(idle.get().metrics_addr.unwrap()).await;
    for name in UNLABELLED {
        assert!(value(&text, name).is_some(), "{name} missing from the first scrape:\n{text}");
    }
    assert_eq!(value(&text, "mlaserve_ready_groups"), Some(0.0));
    drop(idle);

    // `mlaserve serve` (router + group in one process): right after it starts, the
    // group is counted.
    let s = serve(|a| a.metrics_listen = metrics_listen());
    let text = scrape(s.get().router.metrics_addr.unwrap()).await;
    assert_eq!(value(&text, "mlaserve_ready_groups"), Some(1.0), "{text}");
    drop(s);

    // A group busy with a long stream is killed: its load gauges go to 0.
    let mut w = worker();
    let r = router(vec![format!("http://{}", w.get().addr)]);
    let pool = r.get().pool().clone();
    assert!(eventually(READY, || pool.ready_count() == 1).await, "the group must be ready");
    let group = pool.names().pop().unwrap();
    let m = r.get().metrics_addr.unwrap();
    let mut c = client(r.get().addr).await;
    let room =
        c.get_model_info(mlaserve_proto::v1::GetModelInfoRequest {}).await.unwrap().into_inner().max_context_tokens - 8;
    let mut stream = c.generate(ids_request((2..10).collect(), room)).await.unwrap().into_inner();
    stream.next().await.unwrap().unwrap();
    let running = format!("mlaserve_requests_running{{group=\"{group}\"}}");
    let waiting = format!("mlaserve_requests_waiting{{group=\"{group}\"}}");
    let usage = format!("mlaserve_kv_cache_usage_ratio{{group=\"{group}\"}}");
    let mut text = String::new();
    for _ in 0..100 {
        text = scrape(m).await;
        if value(&text, &running) == Some(1.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(value(&text, &running), Some(1.0), "the group's report must show the stream:\n{text}");
    assert!(value(&text, &usage).unwrap() > 0.0, "{text}");

    w.kill();
    assert!(eventually(Duration::from_secs(10), || pool.ready_count() == 0).await, "the group must go down");
    let text = scrape(m).await;
    for series in [&running, &waiting, &usage] {
        // Zeroed, or gone: either way no phantom load.
        assert!(value(&text, series).unwrap_or(0.0) == 0.0, "{series} still reports load after the kill:\n{text}");
    }
    assert_eq!(value(&text, "mlaserve_ready_groups"), Some(0.0), "{text}");
}
