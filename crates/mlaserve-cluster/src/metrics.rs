//! Prometheus metrics: one process-wide recorder, rendered as Prometheus text by a tiny
//! HTTP endpoint (`GET /metrics`). Router and worker in one process (`mlaserve serve`)
//! share it. Every metric either server emits is described once, in [`describe`], and
//! every one without labels is registered at zero when the recorder is installed, so it
//! is present from the first scrape (labelled series appear with their first value).

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::net::SocketAddr;
use std::sync::OnceLock;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Latency buckets (seconds) for every `*_seconds` histogram.
const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

/// Finer buckets for the router's relay latency (its goal is well under a millisecond).
const RELAY_BUCKETS: &[f64] = &[0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0];

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// The process's Prometheus recorder, installed on first use. `None` if another
/// recorder was installed first (then metrics go there).
pub fn handle() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
                .ok()?
                .set_buckets_for_metric(Matcher::Full("mlaserve_router_relay_seconds".into()), RELAY_BUCKETS)
                .ok()?;
            let h = builder.install_recorder().ok()?;
            describe();
            register_unlabelled();
            Some(h)
        })
        .clone()
}

/// Serves `GET /metrics` (any path) on `addr`; returns the bound address.
pub async fn serve(addr: SocketAddr) -> std::io::Result<SocketAddr> {
    let handle = handle().ok_or_else(|| std::io::Error::other("a foreign metrics recorder is installed"))?;
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else { continue };
            let h = handle.clone();
            tokio::spawn(async move {
                // Read the request head (we answer every request with the metrics).
                let mut buf = [0u8; 4096];
                let mut seen = Vec::new();
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") && seen.len() < 16384 {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                let body = h.render();
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = sock.write_all(head.as_bytes()).await;
                let _ = sock.write_all(body.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    Ok(bound)
}

/// Registers help texts for every metric the router and the worker emit.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_histogram!(
        "mlaserve_time_to_first_token_seconds",
        Unit::Seconds,
        "Arrival at the router to the first token"
    );
    describe_histogram!(
        "mlaserve_inter_token_latency_seconds",
        Unit::Seconds,
        "Time between token deliveries of a request"
    );
    describe_histogram!(
        "mlaserve_request_duration_seconds",
        Unit::Seconds,
        "Arrival to the final message (end to end)"
    );
    describe_histogram!(
        "mlaserve_queue_time_seconds",
        Unit::Seconds,
        "Submission to a group until its first token (the group's queueing plus prefill)"
    );
    describe_histogram!(
        "mlaserve_router_overhead_seconds",
        Unit::Seconds,
        "Router time before a request reaches a group (validation, tokenization, admission, picking)"
    );
    describe_histogram!(
        "mlaserve_router_relay_seconds",
        Unit::Seconds,
        "Per streamed message with tokens: from the router receiving them from the group to the message leaving \
         the router (label api: grpc when tonic takes it, http when its server-sent event is written)"
    );
    describe_gauge!("mlaserve_requests_running", "Requests holding KV blocks in a group");
    describe_gauge!("mlaserve_requests_waiting", "Requests queued in a group");
    describe_gauge!("mlaserve_kv_cache_usage_ratio", "Fraction of a group's KV blocks in use");
    describe_gauge!("mlaserve_router_in_flight", "Requests admitted by this router and not finished");
    describe_gauge!("mlaserve_ready_groups", "Worker groups ready to serve");
    describe_counter!("mlaserve_prompt_tokens_total", "Prompt tokens of requests sent to groups");
    describe_counter!("mlaserve_generation_tokens_total", "Tokens generated and streamed");
    describe_counter!("mlaserve_draft_tokens_total", "Draft (MTP) tokens proposed");
    describe_counter!("mlaserve_accepted_tokens_total", "Draft tokens accepted");
    describe_counter!(
        "mlaserve_accepted_tokens_by_position_total",
        "Draft tokens accepted, by draft position (1-based)"
    );
    describe_histogram!("mlaserve_router_batch_size", "Submissions and aborts per router-to-group message");
    describe_counter!("mlaserve_requests_total", "Finished requests by outcome");
    describe_counter!(
        "mlaserve_etcd_watch_restarts_total",
        "Times the router's etcd watch broke and was re-established (re-list and re-watch)"
    );
    describe_gauge!(
        "mlaserve_model_load_bytes_done",
        Unit::Bytes,
        "Checkpoint bytes read so far by the worker's model load"
    );
    describe_gauge!(
        "mlaserve_model_load_bytes_expected",
        Unit::Bytes,
        "Checkpoint bytes the worker's model load reads"
    );
    describe_gauge!("mlaserve_model_load_bytes_per_second", "Mean read rate of the worker's model load so far");
    describe_gauge!(
        "mlaserve_model_load_remaining_seconds",
        Unit::Seconds,
        "Estimated time left of the worker's model load (0 when done)"
    );
    describe_counter!(
        "mlaserve_router_routed_total",
        "Requests sent to a group, by why the balancer chose it (affinity, overloaded, least_loaded)"
    );
    describe_counter!("mlaserve_cached_prompt_tokens_total", "Prompt tokens found in the groups' prefix caches");
    describe_counter!("mlaserve_prefix_cache_queried_tokens_total", "Tokens looked up in the prefix cache (worker)");
    describe_counter!("mlaserve_prefix_cache_hit_tokens_total", "Tokens found in the prefix cache (worker)");
    describe_counter!("mlaserve_prefix_cache_evictions_total", "Cached blocks evicted for new content (worker)");
    describe_gauge!("mlaserve_prefix_cache_blocks", "KV blocks indexed by the prefix cache (worker)");
    describe_gauge!("mlaserve_prefix_cache_hit_rate", "Hit tokens over queried tokens since start (worker)");
    describe_counter!("mlaserve_engine_steps_total", "Engine steps (worker)");
    describe_counter!("mlaserve_graph_captures_total", "CUDA graphs the worker's backend captured (rank 0)");
    describe_counter!(
        "mlaserve_engine_step_seconds_total",
        "Wall time of engine steps by phase (worker); rate(seconds)/rate(steps) is the mean step time"
    );
}

/// Registers every metric without labels, at zero. Adding zero (rather than setting it)
/// leaves any value recorded meanwhile as it is.
fn register_unlabelled() {
    for name in [
        "mlaserve_prompt_tokens_total",
        "mlaserve_cached_prompt_tokens_total",
        "mlaserve_generation_tokens_total",
        "mlaserve_draft_tokens_total",
        "mlaserve_accepted_tokens_total",
        "mlaserve_engine_steps_total",
        "mlaserve_graph_captures_total",
        "mlaserve_etcd_watch_restarts_total",
    ] {
        metrics::counter!(name).increment(0);
    }
    for name in [
        "mlaserve_router_in_flight",
        "mlaserve_ready_groups",
        "mlaserve_model_load_bytes_done",
        "mlaserve_model_load_bytes_expected",
        "mlaserve_model_load_bytes_per_second",
        "mlaserve_model_load_remaining_seconds",
    ] {
        metrics::gauge!(name).increment(0.0);
    }
    for name in [
        "mlaserve_time_to_first_token_seconds",
        "mlaserve_inter_token_latency_seconds",
        "mlaserve_request_duration_seconds",
        "mlaserve_queue_time_seconds",
        "mlaserve_router_overhead_seconds",
        "mlaserve_router_batch_size",
    ] {
        // Registering is enough: a histogram without samples renders with zero counts.
        let _ = metrics::histogram!(name);
    }
}
