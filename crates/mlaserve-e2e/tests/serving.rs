//! Serving end to end on the CPU backend: router → group leader over real gRPC on
//! loopback. Greedy parity with the engine, every bad input (each followed by a check
//! that the server still serves), overload, cancellation, deadlines, stop strings,
//! health, reflection, metrics and drain.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use mlaserve::serve::ServeHandle;
use mlaserve_proto::v1::{FinishReason, GetModelInfoRequest, SamplingParams, StoppingCriteria, TokenizeRequest};
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;
use tonic::Code;

/// One server shared by the tests that do not need settings of their own.
fn shared() -> SocketAddr {
    static S: OnceLock<std::sync::Mutex<Background<ServeHandle>>> = OnceLock::new();
    let s = S.get_or_init(|| std::sync::Mutex::new(serve(|_| {})));
    s.lock().unwrap().get().addr()
}

#[tokio::test]
async fn stream_equals_engine_greedy_output() {
    let addr = shared();
    let mut c = client(addr).await;
    let prompt = "The quick brown fox";
    let ids = c
        .tokenize(TokenizeRequest { text: prompt.into(), add_special_tokens: true })
        .await
        .unwrap()
        .into_inner()
        .token_ids;
    let mut req = text_request(prompt, 40);
    req.echo_prompt_ids = true;
    let got = collect(&mut c, req).await;
    assert!(got.error.is_none(), "{:?}", got.error);
    assert_eq!(got.finals, 1);
    assert_eq!(got.messages[0].prompt_token_ids, ids, "the router tokenizes as Tokenize does");
    let want = engine_greedy(&ids, mlaserve_engine::SamplingParams { max_new_tokens: 40, ..Default::default() }, 64);
    assert_eq!(got.tokens, want, "router stream != engine greedy output");
    let f = got.finish.unwrap();
    let usage = f.usage.unwrap();
    assert_eq!(usage.completion_tokens as usize, want.len());
    assert_eq!(usage.prompt_tokens as usize, ids.len());
    assert!(usage.mean_acceptance_length >= 1.0);
    // The streamed text is the detokenized output (special tokens skipped).
    let tok =
        mlaserve_model::Tokenizer::from_dir(model_dir(), &mlaserve_model::load_config(model_dir()).unwrap()).unwrap();
    assert_eq!(got.text, tok.decode(&want, true).unwrap());
    let expect_reason = if want.len() == 40 { FinishReason::Length } else { FinishReason::StopToken };
    assert_eq!(f.reason, expect_reason as i32);
}

#[tokio::test]
async fn token_id_prompts_and_ignore_eos() {
    let mut c = client(shared()).await;
    let ids: Vec<u32> = (10..30).collect();
    let got = collect(&mut c, ids_request(ids.clone(), 24)).await;
    assert!(got.error.is_none(), "{:?}", got.error);
    let want = engine_greedy(
        &ids,
        mlaserve_engine::SamplingParams { max_new_tokens: 24, ignore_eos: true, ..Default::default() },
        64,
    );
    assert_eq!(got.tokens, want);
    assert_eq!(got.tokens.len(), 24);
    assert_eq!(got.finish.unwrap().reason, FinishReason::Length as i32);
}

#[tokio::test]
async fn stop_string_cuts_the_text() {
    let mut c = client(shared()).await;
    let full = collect(&mut c, ids_request((40..60).collect(), 48)).await;
    assert!(full.error.is_none());
    // A stop string from the middle of the greedy text.
    let chars: Vec<char> = full.text.chars().collect();
    assert!(chars.len() > 12, "need some text, got {:?}", full.text);
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let mut req = ids_request((40..60).collect(), 48);
    req.stopping.as_mut().unwrap().stop = vec![stop.clone()];
    let cut = collect(&mut c, req).await;
    assert!(cut.error.is_none());
    let at = full.text.find(&stop).unwrap();
    assert_eq!(cut.text, full.text[..at], "text must end right before the stop string");
    let f = cut.finish.unwrap();
    assert_eq!(f.reason, FinishReason::StopString as i32);
    assert_eq!(f.matched_stop, stop);
    assert_eq!(cut.finals, 1);
    assert_still_serves(&mut c).await;
}

#[tokio::test]
async fn model_info_and_tokenize() {
    let mut c = client(shared()).await;
    let info = c.get_model_info(GetModelInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.vocab_size, 512);
    let config = mlaserve_model::load_config(model_dir()).unwrap();
    assert!(info.max_context_tokens > 0 && info.max_context_tokens as usize <= config.max_position_embeddings);
    assert_eq!(info.ready_groups, 1);
    let t = c.tokenize(TokenizeRequest { text: "hi".into(), add_special_tokens: false }).await.unwrap().into_inner();
    assert_eq!(t.token_ids.len(), t.tokens.len());
}

// ---- bad input: one test each, each followed by a check that the server still serves.

async fn refused(req: mlaserve_proto::v1::GenerateRequest, code: Code, field: &str) {
    let mut c = client(shared()).await;
    assert_refused(&mut c, req, code, field).await;
    assert_still_serves(&mut c).await;
}

fn sampling(s: SamplingParams) -> mlaserve_proto::v1::GenerateRequest {
    with_sampling(text_request("hello", 4), s)
}

fn stopping(s: StoppingCriteria) -> mlaserve_proto::v1::GenerateRequest {
    mlaserve_proto::v1::GenerateRequest { stopping: Some(s), ..text_request("hello", 4) }
}

#[tokio::test]
async fn bad_empty_prompt() {
    refused(text_request("", 4), Code::InvalidArgument, "prompt.text").await;
    refused(ids_request(vec![], 4), Code::InvalidArgument, "prompt.token_ids").await;
}

async fn max_context() -> usize {
    let mut c = client(shared()).await;
    c.get_model_info(GetModelInfoRequest {}).await.unwrap().into_inner().max_context_tokens as usize
}

#[tokio::test]
async fn bad_prompt_longer_than_context() {
    let ctx = max_context().await;
    refused(ids_request(vec![7; ctx + 1], 4), Code::InvalidArgument, "prompt.token_ids").await;
    // Pseudo-random letters: far more than `ctx` tokens whatever the merges.
    let text: String = (0..8 * ctx).map(|i| (b'a' + ((i * 7919 + i / 3) % 26) as u8) as char).collect();
    refused(text_request(&text, 4), Code::InvalidArgument, "prompt.text").await;
}

#[tokio::test]
async fn bad_max_new_tokens_zero() {
    refused(
        stopping(StoppingCriteria { max_new_tokens: Some(0), ..Default::default() }),
        Code::InvalidArgument,
        "stopping.max_new_tokens",
    )
    .await;
}

#[tokio::test]
async fn bad_max_new_tokens_beyond_context() {
    refused(
        stopping(StoppingCriteria { max_new_tokens: Some(100_000), ..Default::default() }),
        Code::InvalidArgument,
        "stopping.max_new_tokens",
    )
    .await;
}

#[tokio::test]
async fn bad_temperature_negative() {
    refused(
        sampling(SamplingParams { temperature: Some(-0.5), ..Default::default() }),
        Code::InvalidArgument,
        "sampling.temperature",
    )
    .await;
}

#[tokio::test]
async fn bad_temperature_nan() {
    refused(
        sampling(SamplingParams { temperature: Some(f32::NAN), ..Default::default() }),
        Code::InvalidArgument,
        "sampling.temperature",
    )
    .await;
}

#[tokio::test]
async fn bad_top_p_zero() {
    refused(
        sampling(SamplingParams { top_p: Some(0.0), ..Default::default() }),
        Code::InvalidArgument,
        "sampling.top_p",
    )
    .await;
}

#[tokio::test]
async fn bad_top_p_above_one() {
    refused(
        sampling(SamplingParams { top_p: Some(1.5), ..Default::default() }),
        Code::InvalidArgument,
        "sampling.top_p",
    )
    .await;
}

#[tokio::test]
async fn bad_top_k_negative() {
    refused(
        sampling(SamplingParams { top_k: Some(-1), ..Default::default() }),
        Code::InvalidArgument,
        "sampling.top_k",
    )
    .await;
}

#[tokio::test]
async fn bad_token_id_beyond_vocabulary() {
    refused(ids_request(vec![5, 512, 6], 4), Code::InvalidArgument, "prompt.token_ids[1]").await;
}

#[tokio::test]
async fn bad_too_many_stop_strings() {
    refused(
        stopping(StoppingCriteria { stop: vec!["x".into(); 17], ..Default::default() }),
        Code::InvalidArgument,
        "stopping.stop",
    )
    .await;
}

#[tokio::test]
async fn bad_empty_stop_string() {
    refused(
        stopping(StoppingCriteria { stop: vec!["ok".into(), String::new()], ..Default::default() }),
        Code::InvalidArgument,
        "stopping.stop[1]",
    )
    .await;
}

#[tokio::test]
async fn bad_message_over_size_limit() {
    // 5 MiB of text against the default 4 MiB limit.
    let mut c = client(shared()).await;
    let err = c.generate(text_request(&"a".repeat(5 << 20), 4)).await.expect_err("must be refused");
    assert_eq!(err.code(), Code::ResourceExhausted, "{}", err.message());
    assert!(err.message().contains("message length too large"), "{}", err.message());
    assert_still_serves(&mut c).await;
}

// ---- admission, cancellation, deadlines.

#[tokio::test]
async fn overload_gets_resource_exhausted_at_once() {
    const N: usize = 4;
    let s = serve(|a| a.queue_size = N);
    let addr = s.get().addr();
    let mut c = client(addr).await;
    // N long streams, each admitted (first message seen) and kept open.
    let mut open = Vec::new();
    for i in 0..N {
        let mut stream = c.generate(ids_request(vec![3 + i as u32; 8], 200)).await.unwrap().into_inner();
        let first = stream.next().await.unwrap().unwrap();
        assert!(first.finish.is_none());
        open.push(stream);
    }
    let t = Instant::now();
    let err = collect(&mut c, ids_request(vec![9; 8], 4)).await.error.expect("N+1th must be refused");
    assert_eq!(err.code(), Code::ResourceExhausted, "{}", err.message());
    assert!(t.elapsed() < Duration::from_millis(500), "refusal took {:?}", t.elapsed());
    drop(open);
    // Slots come back once the streams are gone.
    let mut ok = false;
    for _ in 0..50 {
        let r = collect(&mut c, text_request("again", 2)).await;
        if r.error.is_none() {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ok, "admission slots never came back");
}

#[tokio::test]
async fn cancelled_streams_free_the_kv_pool() {
    let s = serve(|a| {
        a.engine.kv_blocks = Some(128);
        a.engine.max_num_seqs = 64;
    });
    let h = s.get();
    let engine = h.worker.engine.clone();
    let total = engine.info().kv_blocks_total;
    let mut c = client(h.addr()).await;
    let mut rng = 0x1234_5678_9abc_def1u64;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..200u32 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        // Cancel after 0..12 messages (0: before any token); some requests end first.
        let cancel_after = (rng % 13) as usize;
        let mut c = c.clone();
        tasks.spawn(async move {
            let req = ids_request((0..(4 + i % 40)).map(|k| 2 + (k * 7 + i) % 500).collect(), 64);
            let Ok(resp) = c.generate(req).await else { return };
            let mut stream = resp.into_inner();
            for _ in 0..cancel_after {
                if stream.next().await.is_none() {
                    return;
                }
            }
            drop(stream); // cancel
        });
    }
    while tasks.join_next().await.is_some() {}
    let freed = eventually(Duration::from_secs(20), || {
        let l = engine.load();
        l.kv_blocks_free == total && l.running_requests == 0 && l.queued_requests == 0
    })
    .await;
    let l = engine.load();
    assert!(freed, "KV pool not free after cancellations: {l:?} (total {total})");
    assert_eq!(h.router.state.admission.in_flight(), 0, "admission slots leaked");
    assert_still_serves(&mut c).await;
}

#[tokio::test]
async fn deadline_exceeded_is_honoured_and_frees_the_request() {
    let s = serve(|_| {});
    let h = s.get();
    let engine = h.worker.engine.clone();
    let total = engine.info().kv_blocks_total;
    let mut c = client(h.addr()).await;
    let room = c.get_model_info(GetModelInfoRequest {}).await.unwrap().into_inner().max_context_tokens - 16;
    let mut req = tonic::Request::new(ids_request(vec![11; 16], room));
    req.set_timeout(Duration::from_millis(100));
    let t = Instant::now();
    let mut err = None;
    match c.generate(req).await {
        Err(e) => err = Some(e),
        Ok(r) => {
            let mut stream = r.into_inner();
            while let Some(m) = stream.next().await {
                if let Err(e) = m {
                    err = Some(e);
                    break;
                }
            }
        }
    }
    let err = err.expect("a 100 ms deadline cannot fit hundreds of tokens on the CPU backend");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{}", err.message());
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(eventually(Duration::from_secs(10), || engine.load().kv_blocks_free == total).await);
    assert_still_serves(&mut c).await;
}

// ---- health, reflection, metrics, drain.

#[tokio::test]
async fn health_reflection_metrics_and_drain() {
    use tonic_health::pb::{health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest};
    let s = serve(|a| a.metrics_listen = Some(([127, 0, 0, 1], 0).into()));
    let h = s.get();
    let addr = h.addr();
    let ch = tonic::transport::Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    let mut health = HealthClient::new(ch.clone());
    let check = |svc: &str| HealthCheckRequest { service: svc.into() };
    for svc in ["", "mlaserve.v1.Generation"] {
        // The health service follows the group's readiness asynchronously: poll.
        let until = tokio::time::Instant::now() + Duration::from_secs(10);
        let st = loop {
            let st = health.check(check(svc)).await.unwrap().into_inner().status;
            if st == ServingStatus::Serving as i32 || tokio::time::Instant::now() >= until {
                break st;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(st, ServingStatus::Serving as i32, "service `{svc}`");
    }

    // Reflection lists the public services.
    {
        use tonic_reflection::pb::v1::{
            server_reflection_client::ServerReflectionClient, server_reflection_request::MessageRequest,
            server_reflection_response::MessageResponse, ServerReflectionRequest,
        };
        let mut r = ServerReflectionClient::new(ch.clone());
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut resp = r.server_reflection_info(tokio_stream::iter(vec![req])).await.unwrap().into_inner();
        let msg = resp.next().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = msg.message_response else { panic!("no list") };
        let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        assert!(names.contains(&"mlaserve.v1.Generation".to_string()), "{names:?}");
        assert!(names.contains(&"grpc.health.v1.Health".to_string()), "{names:?}");
    }

    // One request, then the metrics endpoint shows it.
    let mut c = client(addr).await;
    assert_still_serves(&mut c).await;
    let m = h.router.metrics_addr.unwrap();
    let text = http_get(m).await;
    for name in [
        "mlaserve_time_to_first_token_seconds",
        "mlaserve_inter_token_latency_seconds",
        "mlaserve_request_duration_seconds",
        "mlaserve_queue_time_seconds",
        "mlaserve_requests_running",
        "mlaserve_requests_waiting",
        "mlaserve_kv_cache_usage_ratio",
        "mlaserve_prompt_tokens_total",
        "mlaserve_generation_tokens_total",
    ] {
        assert!(text.contains(name), "metric {name} missing from:\n{text}");
    }
    // The engine's next report (once a second) brings the adaptive policy's decisions,
    // per bucket of decode rows: the request decoded alone.
    let series = "mlaserve_speculation_steps_by_rows_total{rows=\"1\",k=\"";
    let mut text = text;
    for _ in 0..50 {
        if text.contains(series) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        text = http_get(m).await;
    }
    assert!(text.contains(series), "{series} missing from:\n{text}");

    // Drain: NOT_SERVING, new requests UNAVAILABLE.
    h.router.drain(Duration::from_millis(100)).await;
    let st = health.check(check("")).await.unwrap().into_inner().status;
    assert_eq!(st, ServingStatus::NotServing as i32);
    let e = collect(&mut c, text_request("late", 2)).await.error.unwrap();
    assert_eq!(e.code(), Code::Unavailable);
}

async fn http_get(addr: SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// `--max-model-len` is the served context: GetModelInfo reports it, and a request past it
/// is refused at the router with INVALID_ARGUMENT naming the limit.
#[tokio::test]
async fn max_model_len_is_the_served_context() {
    let s = serve(|a| a.engine.max_model_len = Some(100));
    let mut c = client(s.get().addr()).await;
    let info = c.get_model_info(GetModelInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.max_context_tokens, 100);
    for (req, field) in
        [(ids_request(vec![7; 100], 4), "prompt.token_ids"), (ids_request(vec![7; 90], 11), "stopping.max_new_tokens")]
    {
        let e = collect(&mut c, req).await.error.expect("refused");
        assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
        assert!(e.message().starts_with(field), "{}", e.message());
        assert!(e.message().contains("max_model_len"), "{}", e.message());
    }
    let ok = collect(&mut c, ids_request(vec![7; 90], 10)).await;
    assert!(ok.error.is_none(), "{:?}", ok.error);
    assert_eq!(ok.tokens.len(), 10);
}

/// The sampling surface over gRPC: log-probabilities (one per token, the chosen one the
/// most likely under greedy), a logit bias that bans the greedy first token, and `n`
/// choices: each tagged with its index and finished on its own, choice i equal to a
/// single request with seed + i.
#[tokio::test]
async fn logprobs_logit_bias_and_n_choices() {
    use mlaserve_proto::v1::LogitBias;
    let mut c = client(shared()).await;
    let req = |s: SamplingParams| with_sampling(ids_request(vec![5, 6, 7, 8], 6), s);
    let greedy = collect(&mut c, req(SamplingParams { logprobs: Some(2), ..Default::default() })).await;
    assert!(greedy.error.is_none(), "{:?}", greedy.error);
    let lps: Vec<_> = greedy.messages.iter().flat_map(|m| m.logprobs.clone()).collect();
    assert_eq!(lps.len(), greedy.tokens.len());
    for (l, &t) in lps.iter().zip(&greedy.tokens) {
        assert_eq!(l.top_token_ids.len(), 2);
        assert_eq!(l.top_token_ids[0], t, "greedy picks the most likely token");
        assert!(l.logprob <= 0.0 && (l.logprob - l.top_logprobs[0]).abs() < 1e-6);
        assert!(l.top_logprobs[0] >= l.top_logprobs[1]);
    }
    let banned = collect(
        &mut c,
        req(SamplingParams {
            logit_bias: vec![LogitBias { token_id: greedy.tokens[0], bias: -100.0 }],
            ..Default::default()
        }),
    )
    .await;
    assert_ne!(banned.tokens[0], greedy.tokens[0], "a -100 bias bans the token");
    assert!(banned.messages.iter().all(|m| m.logprobs.is_empty()), "no logprobs unless asked");

    let sampled =
        SamplingParams { temperature: Some(1.0), seed: Some(40), presence_penalty: Some(0.5), ..Default::default() };
    let mut three = req(sampled.clone());
    three.n = Some(3);
    let got = collect(&mut c, three).await;
    assert!(got.error.is_none(), "{:?}", got.error);
    assert_eq!(got.finals, 3, "one finish per choice");
    for i in 0..3u32 {
        let mine: Vec<u32> = got.messages.iter().filter(|m| m.index == i).flat_map(|m| m.token_ids.clone()).collect();
        let alone = collect(&mut c, req(SamplingParams { seed: Some(40 + i as u64), ..sampled.clone() })).await;
        assert_eq!(mine, alone.tokens, "choice {i} samples with seed + {i}");
    }
    for (n, field) in [(0, "n"), (17, "n")] {
        let mut r = req(SamplingParams::default());
        r.n = Some(n);
        assert_refused(&mut c, r, Code::InvalidArgument, field).await;
    }
    assert_refused(
        &mut c,
        req(SamplingParams { logprobs: Some(21), ..Default::default() }),
        Code::InvalidArgument,
        "sampling.logprobs",
    )
    .await;
    let bad_bias =
        SamplingParams { logit_bias: vec![LogitBias { token_id: 1 << 30, bias: 1.0 }], ..Default::default() };
    assert_refused(&mut c, req(bad_bias), Code::InvalidArgument, "sampling.logit_bias[0]").await;
    assert_refused(
        &mut c,
        req(SamplingParams { min_p: Some(2.0), ..Default::default() }),
        Code::InvalidArgument,
        "sampling.min_p",
    )
    .await;
    assert_still_serves(&mut c).await;
}
