//! The OpenAI-compatible HTTP API (`--http-listen`), beside gRPC on the same router:
//! `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, and `GET
//! /health` (the process is up) and `GET /ready` (it takes requests: a group is ready
//! and it is not draining) for HTTP load balancers.
//!
//! Every generation goes through the gRPC service in-process ([`GenerationService`]):
//! the same admission, validation, group picking, detokenization, stop strings and
//! metrics. Streaming is server-sent events (`stream: true`, with
//! `stream_options.include_usage`); a client that goes away drops the stream, which
//! aborts the request in its group. Errors are OpenAI's error object with its status
//! codes (400 naming the parameter, 401, 404 for another model, 429 when the router's
//! queue is full, 503 when no group can serve, 504 past a deadline).

pub mod chat;
pub mod logprobs;
pub mod openai;
pub mod reasoning;
pub mod tools;

use crate::service::{record_relay, GenerationService, Timed};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use chat::ChatTemplate;
use mlaserve_cluster::auth::Keys;
use mlaserve_proto::v1::{self as pb, generate_request::Prompt};
use openai::{ApiError, ChatRequest, Common, CompletionRequest};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio_stream::{Stream, StreamExt};

/// What the HTTP handlers share.
#[derive(Debug)]
pub struct HttpState {
    pub svc: GenerationService,
    pub template: Option<ChatTemplate>,
    pub keys: Keys,
    /// The largest request body (`--max-message-bytes`, as for gRPC).
    pub max_body: usize,
    next_id: AtomicU64,
}

impl HttpState {
    pub fn new(svc: GenerationService, template: Option<ChatTemplate>, keys: Keys, max_body: usize) -> Self {
        HttpState { svc, template, keys, max_body, next_id: AtomicU64::new(0) }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The rest of the body is left unread, so the connection cannot carry another
            // request: say so, or a client may reuse it and find it closed under it.
            r.headers_mut().insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
        }
        r
    }
}

/// The routes (see the module docs).
pub fn router(st: Arc<HttpState>) -> axum::Router {
    let limit = axum::extract::DefaultBodyLimit::max(st.max_body);
    axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .layer(limit)
        .with_state(st)
}

async fn ready(State(st): State<Arc<HttpState>>) -> Response {
    let s = &st.svc.state;
    if s.draining.load(Ordering::Acquire) {
        (StatusCode::SERVICE_UNAVAILABLE, "draining").into_response()
    } else if s.pool.ready_count() == 0 {
        (StatusCode::SERVICE_UNAVAILABLE, "no worker group is ready").into_response()
    } else {
        "ready".into_response()
    }
}

fn authorize(st: &HttpState, headers: &HeaderMap) -> Result<(), ApiError> {
    if st.keys.is_empty() || st.keys.accepts(headers.get("authorization").map(|v| v.as_bytes())) {
        return Ok(());
    }
    Err(ApiError::from_status(&tonic::Status::unauthenticated("a valid API key is required"), false))
}

fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

async fn models(State(st): State<Arc<HttpState>>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    authorize(&st, &headers)?;
    let s = &st.svc.state;
    let card = openai::ModelCard {
        id: s.model_name.clone(),
        object: "model",
        created: now_s(),
        owned_by: "mlaserve",
        max_model_len: s.limits().max_context,
    };
    Ok(Json(json!({"object": "list", "data": [card]})))
}

/// The body, or 413 (over `--max-message-bytes`) as an OpenAI error.
type Body = Result<Bytes, axum::extract::rejection::BytesRejection>;

fn parse<T: serde::de::DeserializeOwned>(body: &Body) -> Result<T, ApiError> {
    let body = body.as_ref().map_err(|e| ApiError {
        status: e.status(),
        message: format!("the request body cannot be read: {}", e.body_text()),
        kind: "invalid_request_error",
        param: None,
        code: (e.status() == StatusCode::PAYLOAD_TOO_LARGE).then_some("request_too_large"),
    })?;
    serde_json::from_slice(body).map_err(|e| ApiError {
        status: StatusCode::BAD_REQUEST,
        message: format!("the request body is not a valid request: {e}"),
        kind: "invalid_request_error",
        param: None,
        code: None,
    })
}

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    /// Chat; `thinking` when the template opened a reasoning block, `tools` when tool
    /// calls are parsed out of the output.
    Chat {
        thinking: bool,
        tools: bool,
    },
}

async fn completions(State(st): State<Arc<HttpState>>, headers: HeaderMap, body: Body) -> Response {
    let run = async {
        authorize(&st, &headers)?;
        let req: CompletionRequest = parse(&body)?;
        req.common.check(&st.svc.state.model_name, false)?;
        let prompt = req.prompt.into_prompt()?;
        Ok::<_, ApiError>((req.common, prompt))
    };
    match run.await {
        Ok((common, prompt)) => respond(st, Kind::Completion, common, prompt).await,
        Err(e) => e.into_response(),
    }
}

async fn chat_completions(State(st): State<Arc<HttpState>>, headers: HeaderMap, body: Body) -> Response {
    let run = async {
        authorize(&st, &headers)?;
        let req: ChatRequest = parse(&body)?;
        req.common.check(&st.svc.state.model_name, true)?;
        let messages = req.messages()?;
        let Some(t) = &st.template else {
            return Err(ApiError::invalid(
                "messages",
                "the served model has no chat template (tokenizer_config.json chat_template); use /v1/completions",
            ));
        };
        let tools = req.common.parse_tools();
        let listed = req.common.tools.as_ref().filter(|_| tools);
        let text = t.render_with_tools(&messages, listed, true).map_err(|e| ApiError::invalid("messages", e))?;
        let thinking = reasoning::opens_thinking(&text);
        // The template writes the special tokens itself.
        let tok = st.svc.state.tokenizer.clone();
        let ids = tokio::task::spawn_blocking(move || tok.encode(&text, false))
            .await
            .map_err(|e| ApiError::from_status(&tonic::Status::internal(e.to_string()), true))?
            .map_err(|e| ApiError::invalid("messages", format!("cannot tokenize: {e}")))?;
        Ok::<_, ApiError>((req.common, Prompt::TokenIds(pb::TokenIds { ids }), thinking, tools))
    };
    match run.await {
        Ok((common, prompt, thinking, tools)) => respond(st, Kind::Chat { thinking, tools }, common, prompt).await,
        Err(e) => e.into_response(),
    }
}

/// One choice's stream of `mlaserve.v1` messages.
type Choice = std::pin::Pin<Box<dyn Stream<Item = Result<Timed, tonic::Status>> + Send>>;

/// Runs the request through the generation service — `n` of them for `n` choices —
/// and answers as JSON or SSE. With `n` > 1 the first choice runs alone until its first
/// message (its prompt is then prefilled and in the prefix cache), and the others,
/// submitted then, reuse its blocks. Choice `i` samples with `seed + i` when a seed is
/// given.
async fn respond(st: Arc<HttpState>, kind: Kind, common: Common, prompt: Prompt) -> Response {
    let messages = kind != Kind::Completion;
    let n = common.n.unwrap_or(1).max(1) as usize;
    let start = |i: usize| {
        let mut req = common.request(prompt.clone(), messages);
        if let (Some(seed), Some(sp)) = (common.seed, req.sampling.as_mut()) {
            sp.seed = Some(seed.wrapping_add(i as u64));
        }
        let svc = st.svc.clone();
        async move { svc.generate_timed(tonic::Request::new(req)).await.map(|r| Box::pin(r) as Choice) }
    };
    let mut choices: Vec<Choice> = Vec::with_capacity(n);
    match start(0).await {
        Ok(c) => choices.push(c),
        Err(s) => return ApiError::from_status(&s, messages).into_response(),
    }
    if n > 1 {
        let mut first = choices.pop().map(|c| c.peekable());
        if let Some(f) = first.as_mut() {
            let _ = f.peek().await;
        }
        choices.extend(first.map(|f| Box::pin(f) as Choice));
        for i in 1..n {
            match start(i).await {
                Ok(c) => choices.push(c),
                // Dropping the others aborts them.
                Err(s) => return ApiError::from_status(&s, messages).into_response(),
            }
        }
    }
    let id = st.next_id.fetch_add(1, Ordering::Relaxed);
    let meta = Meta {
        id: match kind {
            Kind::Completion => format!("cmpl-{id}"),
            Kind::Chat { .. } => format!("chatcmpl-{id}"),
        },
        created: now_s(),
        model: st.svc.state.model_name.clone(),
        kind,
        tokenizer: common.logprobs(messages).ok().flatten().map(|_| st.svc.state.tokenizer.clone()),
    };
    let mut merged = tokio_stream::StreamMap::new();
    for (i, c) in choices.into_iter().enumerate() {
        merged.insert(i, c);
    }
    if common.stream {
        Sse::new(events(meta, merged, n, common.include_usage())).into_response()
    } else {
        whole(meta, merged, n).await
    }
}

/// The fields every response object carries.
#[derive(Debug, Clone)]
struct Meta {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    /// Set when the request asked for log-probabilities: the token strings come from it.
    tokenizer: Option<Arc<mlaserve_model::Tokenizer>>,
}

impl Meta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat { .. }, false) => "chat.completion",
            (Kind::Chat { .. }, true) => "chat.completion.chunk",
        }
    }

    fn with(&self, chunk: bool, choices: Value, usage: Value) -> Value {
        json!({
            "id": self.id, "object": self.object(chunk), "created": self.created, "model": self.model,
            "choices": choices, "usage": usage,
        })
    }

    /// OpenAI's `logprobs` of a choice's tokens (`offset`: where they start in the
    /// choice's text, advanced past them), or null without them.
    fn logprobs(&self, g: &logprobs::Gathered, offset: &mut usize) -> Value {
        let Some(tok) = &self.tokenizer else { return Value::Null };
        match self.kind {
            Kind::Completion => logprobs::completion(tok, &g.ids, &g.lps, offset),
            Kind::Chat { .. } => json!({"content": logprobs::chat_content(tok, &g.ids, &g.lps)}),
        }
    }

    /// One streamed choice: a text delta (and a reasoning delta) and the finish reason
    /// once known.
    fn choice(&self, index: usize, text: &str, reasoning: &str, finish: Option<&str>, first: bool) -> Value {
        match self.kind {
            Kind::Completion => json!([{"index": index, "text": text, "logprobs": null, "finish_reason": finish}]),
            Kind::Chat { .. } => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                    delta.insert("content".into(), json!(text));
                } else if !text.is_empty() {
                    delta.insert("content".into(), json!(text));
                }
                if !reasoning.is_empty() {
                    delta.insert("reasoning_content".into(), json!(reasoning));
                }
                json!([{"index": index, "delta": delta, "logprobs": null, "finish_reason": finish}])
            }
        }
    }
}

/// The usage of `n` choices of one prompt: the prompt once (as the first choice saw
/// it), the completions summed.
fn total_usage(usages: &[Option<pb::Usage>]) -> Value {
    let Some(first) = usages.iter().flatten().next() else { return Value::Null };
    let completion: u32 = usages.iter().flatten().map(|u| u.completion_tokens).sum();
    openai::usage(&pb::Usage { completion_tokens: completion, ..first.clone() })
}

/// The whole response as one JSON object.
async fn whole(meta: Meta, mut stream: tokio_stream::StreamMap<usize, Choice>, n: usize) -> Response {
    let mut texts = vec![String::new(); n];
    let mut gathered = vec![logprobs::Gathered::default(); n];
    let mut finishes: Vec<Option<pb::Finish>> = vec![None; n];
    while let Some((i, msg)) = stream.next().await {
        let msg = match msg {
            Ok(m) => m.msg,
            Err(s) => return ApiError::from_status(&s, meta.kind != Kind::Completion).into_response(),
        };
        texts[i].push_str(&msg.text);
        gathered[i].push(&msg);
        if msg.finish.is_some() {
            finishes[i] = msg.finish;
        }
    }
    if finishes.iter().any(|f| f.is_none()) {
        return ApiError::from_status(&tonic::Status::internal("a stream ended without a finish"), false)
            .into_response();
    }
    let usages: Vec<Option<pb::Usage>> = finishes.iter().map(|f| f.as_ref().and_then(|f| f.usage.clone())).collect();
    let choices: Vec<Value> = texts
        .into_iter()
        .zip(&finishes)
        .enumerate()
        .map(|(i, (text, f))| {
            let reason = f.as_ref().map(openai::finish_reason);
            let lp = meta.logprobs(&gathered[i], &mut 0);
            match meta.kind {
                Kind::Completion => json!({"index": i, "text": text, "logprobs": lp, "finish_reason": reason}),
                Kind::Chat { thinking, tools } => {
                    let (reasoning, answer) = reasoning::split(thinking, &text);
                    let mut message = json!({"role": "assistant", "content": answer});
                    if thinking {
                        message["reasoning_content"] = json!(reasoning);
                    }
                    let mut reason = reason;
                    if let Some((answer, calls)) = tools.then(|| tools::parse(&answer)).flatten() {
                        message["content"] = if answer.is_empty() { Value::Null } else { json!(answer) };
                        message["tool_calls"] = tools::to_openai(&format!("{}_{i}", meta.id), &calls);
                        reason = Some("tool_calls");
                    }
                    json!({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
                }
            }
        })
        .collect();
    Json(meta.with(false, Value::Array(choices), total_usage(&usages))).into_response()
}

/// The response as server-sent events: each choice's chunks (tagged with its index), the
/// usage chunk when asked for, `[DONE]`.
fn events(
    meta: Meta,
    mut stream: tokio_stream::StreamMap<usize, Choice>,
    n: usize,
    include_usage: bool,
) -> impl Stream<Item = Result<Event, std::convert::Infallible>> + Send + 'static {
    async_stream(move |tx| async move {
        let send = |v: Value| tx.send(Ok(Event::default().data(v.to_string())));
        let thinking = matches!(meta.kind, Kind::Chat { thinking: true, .. });
        let parse_tools = matches!(meta.kind, Kind::Chat { tools: true, .. });
        let mut splits = vec![reasoning::Splitter::new(thinking); n];
        let mut held = vec![tools::Held::default(); n];
        let mut usages: Vec<Option<pb::Usage>> = vec![None; n];
        let mut offsets = vec![0usize; n];
        if let Kind::Chat { .. } = meta.kind {
            // Each choice's role first, as OpenAI streams it.
            for i in 0..n {
                if send(meta.with(true, meta.choice(i, "", "", None, true), Value::Null)).await.is_err() {
                    return;
                }
            }
        }
        while let Some((i, msg)) = stream.next().await {
            let (msg, relay_from) = match msg {
                Ok(m) => (m.msg, m.from),
                Err(s) => {
                    let _ = send(ApiError::from_status(&s, meta.kind != Kind::Completion).body()).await;
                    return;
                }
            };
            let mut finish = msg.finish.as_ref().map(openai::finish_reason);
            let (mut reasoning, mut text) = splits[i].push(&msg.text);
            if let Some(f) = &msg.finish {
                let (r, t) = splits[i].finish();
                reasoning.push_str(&r);
                text.push_str(&t);
                usages[i] = f.usage.clone();
            }
            let mut calls = None;
            if parse_tools {
                text = held[i].push(&text);
                if finish.is_some() {
                    let (rest, c) = held[i].finish();
                    text.push_str(&rest);
                    calls = c;
                }
            }
            if calls.is_some() {
                finish = Some("tool_calls");
            }
            let mut chunk = meta.choice(i, &text, &reasoning, finish, false);
            let has_lp = meta.tokenizer.is_some() && !msg.token_ids.is_empty();
            if has_lp {
                let mut g = logprobs::Gathered::default();
                g.push(&msg);
                chunk[0]["logprobs"] = meta.logprobs(&g, &mut offsets[i]);
            }
            if let Some(calls) = &calls {
                let list = tools::to_openai(&format!("{}_{i}", meta.id), calls);
                let indexed: Vec<Value> = list
                    .as_array()
                    .into_iter()
                    .flatten()
                    .enumerate()
                    .map(|(j, c)| {
                        let mut c = c.clone();
                        c["index"] = json!(j);
                        c
                    })
                    .collect();
                chunk[0]["delta"]["tool_calls"] = Value::Array(indexed);
            }
            let any = !text.is_empty() || !reasoning.is_empty() || finish.is_some() || has_lp;
            if any {
                if send(meta.with(true, chunk, Value::Null)).await.is_err() {
                    return; // the client went away: dropping `stream` aborts the requests
                }
                record_relay(relay_from, "http");
            }
        }
        if include_usage {
            let _ = send(meta.with(true, json!([]), total_usage(&usages))).await;
        }
        let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
    })
}

/// Removes and returns the start of `held`, keeping back its longest tail that could be
/// the beginning of `marker` (the rest of it may come with the next delta).
fn take_settled(held: &mut String, marker: &str) -> String {
    let keep = (1..marker.len())
        .rev()
        .find(|&n| {
            held.len() >= n && held.is_char_boundary(held.len() - n) && marker.starts_with(&held[held.len() - n..])
        })
        .unwrap_or(0);
    let rest = held.split_off(held.len() - keep);
    std::mem::replace(held, rest)
}

/// A stream fed by the task `f` runs (bounded: the task waits while the client reads).
fn async_stream<T, F, Fut>(f: F) -> impl Stream<Item = T> + Send + 'static
where
    T: Send + 'static,
    F: FnOnce(tokio::sync::mpsc::Sender<T>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(f(tx));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A choice whose messages carry `texts`, the last one finishing with usage.
    fn choice(texts: &[&str]) -> Choice {
        let n = texts.len();
        let msgs: Vec<Result<Timed, tonic::Status>> = texts
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let finish = (i + 1 == n).then(|| pb::Finish {
                    reason: pb::FinishReason::StopToken as i32,
                    usage: Some(pb::Usage { prompt_tokens: 5, completion_tokens: n as u32, ..Default::default() }),
                    ..Default::default()
                });
                let msg = pb::GenerateResponse { text: t.to_string(), finish, ..Default::default() };
                Ok(Timed { msg, from: None })
            })
            .collect();
        Box::pin(tokio_stream::iter(msgs))
    }

    fn meta(kind: Kind) -> Meta {
        Meta { id: "chatcmpl-7".into(), created: 0, model: "m".into(), kind, tokenizer: None }
    }

    async fn body(r: Response) -> String {
        let b = axum::body::to_bytes(r.into_body(), 1 << 20).await.expect("body");
        String::from_utf8(b.to_vec()).expect("utf-8")
    }

    const CALL: [&str; 4] = [
        "Checking",
        ". <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n",
        "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
    ];

    /// The response shaping of a chat with tools: the calls out of the text, whole and
    /// streamed; without tools the same text is plain content.
    #[tokio::test]
    async fn tool_calls_come_out_of_the_text_whole_and_streamed() {
        let kind = Kind::Chat { thinking: false, tools: true };
        let one = |texts: &[&str]| {
            let mut m = tokio_stream::StreamMap::new();
            m.insert(0, choice(texts));
            m
        };
        let v: Value = serde_json::from_str(&body(whole(meta(kind), one(&CALL), 1).await).await).expect("json");
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{v}");
        assert_eq!(c["message"]["content"], "Checking. ");
        assert_eq!(c["message"]["tool_calls"][0]["function"]["name"], "get_weather");
        assert_eq!(c["message"]["tool_calls"][0]["function"]["arguments"], "{\"city\": \"Paris\"}");

        let sse = body(Sse::new(events(meta(kind), one(&CALL), 1, true)).into_response()).await;
        let chunks: Vec<Value> = sse
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).expect("chunk"))
            .collect();
        let content: String =
            chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect::<Vec<_>>().concat();
        assert_eq!(content, "Checking. ", "{sse}");
        let calls: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0]["delta"].get("tool_calls")).collect();
        assert_eq!(calls.len(), 1, "{sse}");
        assert_eq!(calls[0][0]["index"], 0);
        assert_eq!(calls[0][0]["function"]["name"], "get_weather");
        let last =
            chunks.iter().rev().find(|c| !c["choices"].as_array().is_some_and(|a| a.is_empty())).expect("a chunk");
        assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
        assert!(sse.trim_end().ends_with("data: [DONE]"));

        let plain = Kind::Chat { thinking: false, tools: false };
        let v: Value = serde_json::from_str(&body(whole(meta(plain), one(&CALL), 1).await).await).expect("json");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["choices"][0]["message"]["content"], CALL.concat());
    }
}
