//! The `mlaserve.v1.Generation` service: one request's life from arrival to its final
//! message (see the crate docs for the flow).

use crate::admission::Admission;
use crate::detok::IncrementalDecoder;
use crate::error::RouterError;
use crate::group::{GroupEvent, Submission};
use crate::pool::Pool;
use crate::stop::StopMatcher;
use crate::validate::{self, validate, ModelLimits, ValidRequest};
use mlaserve_proto::v1::{
    generation_server::Generation, Finish, FinishReason, GenerateRequest, GenerateResponse, GetModelInfoRequest,
    ModelInfo, TokenLogprobs, TokenizeRequest, TokenizeResponse, Usage,
};
use mlaserve_proto::worker::{self as wire};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status};
use tracing::Instrument as _;

/// Prompts longer than this (bytes) are tokenized on the blocking pool.
const BLOCKING_TOKENIZE_BYTES: usize = 16 << 10;
/// `Tokenize` calls tokenizing at once; the others wait their turn (admitted already).
const TOKENIZE_SLOTS: usize = 4;
/// Messages buffered per client stream before the router waits for the client.
const STREAM_BUFFER: usize = 64;

/// State shared by every request of a router.
#[derive(Debug)]
pub struct RouterState {
    pub tokenizer: Arc<mlaserve_model::Tokenizer>,
    pub model_name: String,
    /// From the model's `config.json`; the groups' own limits take precedence.
    pub config_limits: ModelLimits,
    /// The limits of the last ready groups (see [`RouterState::limits`]).
    known_limits: std::sync::Mutex<Option<ModelLimits>>,
    pub pool: Pool,
    pub admission: Admission,
    /// Texts being tokenized at once by `Tokenize` (each takes ~200× its size).
    pub tokenize_slots: tokio::sync::Semaphore,
    pub draining: AtomicBool,
    next_request: AtomicU64,
}

impl RouterState {
    pub fn new(
        tokenizer: mlaserve_model::Tokenizer,
        model_name: String,
        limits: ModelLimits,
        pool: Pool,
        queue: usize,
    ) -> Self {
        RouterState {
            tokenizer: Arc::new(tokenizer),
            model_name,
            config_limits: limits,
            known_limits: std::sync::Mutex::new(None),
            pool,
            admission: Admission::new(queue),
            tokenize_slots: tokio::sync::Semaphore::new(TOKENIZE_SLOTS),
            draining: AtomicBool::new(false),
            next_request: AtomicU64::new(1),
        }
    }

    /// What validation enforces and `GetModelInfo` reports: the strictest of the config
    /// and the ready groups. While no group is ready, the last groups' limits stand (a
    /// client sees the same limits whether or not a group is up at that moment).
    pub fn limits(&self) -> ModelLimits {
        let groups = self.pool.ready_groups();
        let mut known = lock(&self.known_limits);
        if groups.is_empty() {
            return known.unwrap_or(self.config_limits);
        }
        let mut l = self.config_limits;
        for g in groups {
            if g.info.max_context_tokens > 0 {
                l.max_context = l.max_context.min(g.info.max_context_tokens);
            }
            if g.info.vocab_size > 0 {
                l.vocab_size = l.vocab_size.min(g.info.vocab_size);
            }
        }
        *known = Some(l);
        l
    }

    fn tokenize_blocking(tok: &mlaserve_model::Tokenizer, text: &str) -> Result<Vec<u32>, RouterError> {
        tok.encode(text, true).map_err(|e| RouterError::invalid("prompt.text", format!("cannot tokenize: {e}")))
    }
}

/// The gRPC service (a cheap handle on [`RouterState`]).
#[derive(Debug, Clone)]
pub struct GenerationService {
    pub state: Arc<RouterState>,
}

type GenerateStream = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<GenerateResponse, Status>> + Send>>;

/// A message of a generation stream, with when the router received the first of its
/// tokens from the group (`None`: a message without tokens): the front end that writes
/// it out records the router's relay latency (`mlaserve_router_relay_seconds`).
#[derive(Debug)]
pub struct Timed {
    pub msg: GenerateResponse,
    pub from: Option<Instant>,
}

/// Records the router's relay latency of a message leaving through `api`.
pub fn record_relay(from: Option<Instant>, api: &'static str) {
    if let Some(f) = from {
        metrics::histogram!("mlaserve_router_relay_seconds", "api" => api).record(f.elapsed().as_secs_f64());
    }
}

impl GenerationService {
    /// `Generate`, its messages timed ([`Timed`]): the gRPC front and the HTTP front
    /// both drive it.
    #[tracing::instrument(skip_all, fields(request_id))]
    pub async fn generate_timed(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<ReceiverStream<Result<Timed, Status>>, Status> {
        let arrival = Instant::now();

        let st = &self.state;
        let outcome = async {
            if st.draining.load(Ordering::Acquire) {
                return Err(RouterError::Draining);
            }
            let permit = st.admission.try_admit()?;
            let deadline = crate::deadline::grpc_timeout(request.metadata()).map(|d| (arrival + d, d));
            let req = request.into_inner();
            let limits = st.limits();
            let valid = match &req.prompt {
                Some(mlaserve_proto::v1::generate_request::Prompt::Text(t)) if t.len() > BLOCKING_TOKENIZE_BYTES => {
                    let tok = st.tokenizer.clone();
                    let req2 = req.clone();
                    tokio::task::spawn_blocking(move || {
                        validate(&req2, limits, |t| RouterState::tokenize_blocking(&tok, t))
                    })
                    .await
                    .map_err(|e| RouterError::Internal(format!("tokenizer task: {e}")))??
                }
                _ => validate(&req, limits, |t| RouterState::tokenize_blocking(&st.tokenizer, t))?,
            };
            // One admission slot per choice.
            let mut permits = vec![permit];
            for _ in 1..valid.n {
                permits.push(st.admission.try_admit()?);
            }
            if st.pool.ready_count() == 0 {
                return Err(RouterError::NoGroup);
            }
            let id = if req.request_id.is_empty() {
                format!("r{}", st.next_request.fetch_add(1, Ordering::Relaxed))
            } else {
                req.request_id.clone()
            };
            Ok((permits, deadline, valid, id))
        }
        .await;
        let (permits, deadline, valid, id) = match outcome {
            Ok(x) => x,
            Err(e) => {
                metrics::counter!("mlaserve_requests_total", "outcome" => outcome_label(e.code())).increment(1);
                tracing::debug!(error = %e, "request refused");
                return Err(e.into());
            }
        };
        tracing::Span::current().record("request_id", id.as_str());
        metrics::gauge!("mlaserve_router_in_flight").set(st.admission.in_flight() as f64);
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let state = st.clone();
        let span = tracing::info_span!("request", request_id = %id);
        let mut permits = permits.into_iter();
        if valid.n == 1 {
            // One choice: no coordinator, nothing copied.
            let choice = Choice { state, v: valid, id, arrival, deadline };
            tokio::spawn(choice.run(tx, 0, None, permits.next()).instrument(span));
        } else {
            let choices = async move {
                let (first_tx, first_rx) = oneshot::channel();
                let choice = Choice { state: state.clone(), v: valid.clone(), id: id.clone(), arrival, deadline };
                tokio::spawn(choice.run(tx.clone(), 0, Some(first_tx), permits.next()).in_current_span());
                // The others once the first has its prompt cached (or ended).
                let _ = first_rx.await;
                for i in 1..valid.n {
                    let mut v = valid.clone();
                    v.sampling.seed = v.sampling.seed.map(|s| s.wrapping_add(i as u64));
                    let choice = Choice { state: state.clone(), v, id: id.clone(), arrival, deadline };
                    tokio::spawn(choice.run(tx.clone(), i, None, permits.next()).in_current_span());
                }
            };
            tokio::spawn(choices.instrument(span));
        }
        metrics::gauge!("mlaserve_router_in_flight").set(st.admission.in_flight() as f64);
        Ok(ReceiverStream::new(rx))
    }
}

#[tonic::async_trait]
impl Generation for GenerationService {
    type GenerateStream = GenerateStream;

    #[tracing::instrument(skip_all, fields(request_id))]
    async fn generate(&self, request: Request<GenerateRequest>) -> Result<Response<GenerateStream>, Status> {
        use tokio_stream::StreamExt as _;
        let rx = self.generate_timed(request).await?;
        Ok(Response::new(Box::pin(rx.map(|r| {
            r.map(|t| {
                record_relay(t.from, "grpc");
                t.msg
            })
        }))))
    }

    async fn tokenize(&self, request: Request<TokenizeRequest>) -> Result<Response<TokenizeResponse>, Status> {
        let r = request.into_inner();
        // Admitted like a generation (RESOURCE_EXHAUSTED when full), bounded in size, and
        // tokenized a few at a time: each text takes about 200 times its size while the
        // tokenizer runs.
        let _admitted = self.state.admission.try_admit()?;
        validate::check_text_bytes("text", &r.text, self.state.limits())?;
        let _slot = self.state.tokenize_slots.acquire().await.map_err(|_| Status::unavailable("shutting down"))?;
        let tok = self.state.tokenizer.clone();
        let ids = tokio::task::spawn_blocking(move || tok.encode(&r.text, r.add_special_tokens).map(|ids| (ids, tok)))
            .await
            .map_err(|e| Status::internal(format!("tokenizer task: {e}")))?;
        let (ids, tok) = ids.map_err(|e| Status::invalid_argument(format!("text: cannot tokenize: {e}")))?;
        let tokens = ids.iter().map(|&i| tok.inner().id_to_token(i).unwrap_or_default()).collect();
        Ok(Response::new(TokenizeResponse { token_ids: ids, tokens }))
    }

    async fn get_model_info(&self, _r: Request<GetModelInfoRequest>) -> Result<Response<ModelInfo>, Status> {
        let st = &self.state;
        let l = st.limits();
        let groups = st.pool.ready_groups();
        Ok(Response::new(ModelInfo {
            model_name: st.model_name.clone(),
            vocab_size: l.vocab_size,
            max_context_tokens: l.max_context,
            eos_token_ids: st.tokenizer.eos_token_ids().to_vec(),
            speculative_tokens: groups.first().map(|g| g.info.speculative_tokens).unwrap_or(0),
            ready_groups: groups.len() as u32,
            max_stop_strings: validate::MAX_STOP_STRINGS as u32,
            default_max_new_tokens: validate::DEFAULT_MAX_NEW_TOKENS,
        }))
    }
}

fn outcome_label(code: Code) -> &'static str {
    match code {
        Code::InvalidArgument => "invalid_argument",
        Code::ResourceExhausted => "resource_exhausted",
        Code::Unavailable => "unavailable",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::Cancelled => "cancelled",
        _ => "error",
    }
}

/// One choice of a request (`GenerateRequest.n`), ready to run.
struct Choice {
    state: Arc<RouterState>,
    v: ValidRequest,
    id: String,
    arrival: Instant,
    deadline: Option<(Instant, Duration)>,
}

impl Choice {
    /// Drives the choice to its end, sending its messages (tagged `index`) and its error
    /// to `tx`; `first` is told when its first message went out (or it ended). Holds its
    /// admission slot until then.
    async fn run(
        self,
        tx: mpsc::Sender<Result<Timed, Status>>,
        index: u32,
        first: Option<oneshot::Sender<()>>,
        permit: Option<crate::admission::Permit>,
    ) {
        let Choice { state, v, id, arrival, deadline } = self;
        let mut run = Run::new(&state, v, id, arrival, tx.clone());
        run.index = index;
        run.first = first;
        let res = run.drive(deadline).await;
        let label = match &res {
            Ok(reason) => reason,
            Err(e) => outcome_label(e.code()),
        };
        metrics::counter!("mlaserve_requests_total", "outcome" => label).increment(1);
        metrics::histogram!("mlaserve_request_duration_seconds").record(arrival.elapsed().as_secs_f64());
        let ms = arrival.elapsed().as_millis() as u64;
        match &res {
            Ok(reason) => tracing::info!(outcome = reason, ms, index, "request finished"),
            Err(e) => tracing::info!(outcome = label, ms, index, error = %e, "request failed"),
        }
        if let Err(e) = res {
            let _ = tx.send(Err(e.into())).await;
        }
        drop(run);
        drop(permit);
        metrics::gauge!("mlaserve_router_in_flight").set(state.admission.in_flight() as f64);
    }
}

/// One request being streamed.
struct Run<'a> {
    st: &'a RouterState,
    v: ValidRequest,
    id: String,
    arrival: Instant,
    tx: mpsc::Sender<Result<Timed, Status>>,
    decoder: IncrementalDecoder,
    stops: StopMatcher,
    completion: u32,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    sent_first: bool,
    /// The choice's index (`GenerateResponse.index`).
    index: u32,
    /// Told when the first message went out.
    first: Option<oneshot::Sender<()>>,
    /// When the router received the oldest tokens not yet sent on.
    relay_from: Option<Instant>,
}

impl<'a> Run<'a> {
    fn new(
        st: &'a RouterState,
        v: ValidRequest,
        id: String,
        arrival: Instant,
        tx: mpsc::Sender<Result<Timed, Status>>,
    ) -> Self {
        let decoder = IncrementalDecoder::new(&v.prompt, !v.keep_special_tokens);
        let stops = StopMatcher::new(v.stop.clone());
        Run {
            st,
            v,
            id,
            arrival,
            tx,
            decoder,
            stops,
            completion: 0,
            first_token: None,
            last_token: None,
            sent_first: false,
            index: 0,
            first: None,
            relay_from: None,
        }
    }

    /// Streams the request; returns the finish label, or the error to end the stream with.
    ///
    /// Until its first token the request may move: a group that was lost (session
    /// broke) or answered UNAVAILABLE (draining, stopped, failed) is left for another
    /// group, each group tried once. After a token nothing is retried: the client has
    /// seen part of one group's output.
    async fn drive(&mut self, deadline: Option<(Instant, Duration)>) -> Result<&'static str, RouterError> {
        let mut tried: Vec<String> = Vec::new();
        let mut last_refusal: Option<RouterError> = None;
        let far = Instant::now() + Duration::from_secs(365 * 24 * 3600);
        let (until, budget) = deadline.unwrap_or((far, Duration::ZERO));
        loop {
            let Some((group, _)) = self.st.pool.pick(&tried, &self.v.prompt) else {
                return Err(match (last_refusal, tried.last()) {
                    (Some(e), _) => e,
                    (None, None) => RouterError::NoGroup,
                    (None, Some(g)) => {
                        RouterError::GroupLost { group: g.clone(), msg: "no other group could take the request".into() }
                    }
                });
            };
            if tried.is_empty() {
                metrics::histogram!("mlaserve_router_overhead_seconds").record(self.arrival.elapsed().as_secs_f64());
                metrics::counter!("mlaserve_prompt_tokens_total").increment(self.v.prompt.len() as u64);
            }
            let mut sub = group.submit(self.v.prompt.clone(), self.v.sampling.clone(), self.v.stopping.clone());
            let client = self.tx.clone();
            let end = tokio::select! {
                biased;
                _ = client.closed() => End::ClientGone,
                _ = tokio::time::sleep_until(until.into()) => End::Failed(RouterError::Deadline(budget)),
                end = self.follow(&mut sub) => end,
            };
            // Anything but a finished request leaves `sub` not done: dropping it aborts
            // the request in the group.
            match end {
                End::Done(label) => return Ok(label),
                End::ClientGone => return Ok("cancelled"),
                End::Failed(RouterError::Worker { code: Code::Unavailable, msg, .. }) if self.first_token.is_none() => {
                    tracing::info!(group = %group.name, reason = %msg, "group refused before the first token; retrying elsewhere");
                    tried.push(group.name.clone());
                    last_refusal =
                        Some(RouterError::Worker { group: group.name.clone(), code: Code::Unavailable, msg });
                }
                End::Failed(RouterError::Worker { code, msg, .. }) => {
                    return Err(RouterError::Worker { group: group.name.clone(), code, msg })
                }
                End::Failed(e) => return Err(e),
                End::Lost(why) if self.first_token.is_none() => {
                    tracing::warn!(group = %group.name, reason = %why, "group lost before the first token; retrying elsewhere");
                    tried.push(group.name.clone());
                    last_refusal = None;
                }
                End::Lost(why) => return Err(RouterError::GroupLost { group: group.name.clone(), msg: why }),
            }
        }
    }

    /// Follows one submission until it ends.
    async fn follow(&mut self, sub: &mut Submission) -> End {
        loop {
            let ev = match sub.events.recv().await {
                Some(ev) => ev,
                None => return End::Lost("the group dropped the request".into()),
            };
            let (tokens, logprobs, finished) = match ev {
                GroupEvent::Tokens(t, l, at) => {
                    self.relay_from.get_or_insert(at);
                    // A finish queued right behind the tokens rides on the same message.
                    match sub.events.try_recv() {
                        Ok(GroupEvent::Finished(f)) => (t, l, Some(f)),
                        Ok(GroupEvent::Lost(why)) => {
                            if let Err(e) = self.on_tokens(&t, l, None).await {
                                return e;
                            }
                            return End::Lost(why);
                        }
                        Ok(GroupEvent::Tokens(more, more_l, _)) => ([t, more].concat(), [l, more_l].concat(), None),
                        Err(_) => (t, l, None),
                    }
                }
                GroupEvent::Finished(f) => (Vec::new(), Vec::new(), Some(f)),
                GroupEvent::Lost(why) => return End::Lost(why),
            };
            if finished.is_some() {
                sub.mark_done();
            }
            match self.on_tokens(&tokens, logprobs, finished).await {
                Ok(()) => {}
                Err(end) => {
                    return end;
                }
            }
        }
    }

    /// Streams new tokens (and the finish, if any). `Err` ends the request.
    async fn on_tokens(
        &mut self,
        tokens: &[u32],
        logprobs: Vec<wire::TokenLogprobs>,
        finished: Option<wire::Finished>,
    ) -> Result<(), End> {
        let now = Instant::now();
        if !tokens.is_empty() {
            match self.last_token {
                None => {
                    self.first_token = Some(now);
                    metrics::histogram!("mlaserve_time_to_first_token_seconds")
                        .record((now - self.arrival).as_secs_f64());
                }
                Some(last) => {
                    metrics::histogram!("mlaserve_inter_token_latency_seconds").record((now - last).as_secs_f64());
                }
            }
            self.last_token = Some(now);
            self.completion += tokens.len() as u32;
            metrics::counter!("mlaserve_generation_tokens_total").increment(tokens.len() as u64);
        }
        let tok = self.st.tokenizer.inner();
        let mut delta = self.decoder.push(tok, tokens).map_err(|e| End::Failed(RouterError::Internal(e)))?;
        let logprobs = logprobs
            .into_iter()
            .map(|l| TokenLogprobs { logprob: l.logprob, top_token_ids: l.top_token_ids, top_logprobs: l.top_logprobs })
            .collect();
        let mut msg = GenerateResponse { token_ids: tokens.to_vec(), logprobs, ..Default::default() };
        if let Some(f) = &finished {
            if f.reason == wire::FinishReason::Error as i32 {
                let code = Code::from_i32(f.status_code);
                let code = if code == Code::Ok { Code::Internal } else { code };
                return Err(End::Failed(RouterError::Worker { group: String::new(), code, msg: f.error.clone() }));
            }
            delta += &self.decoder.finish(tok).map_err(|e| End::Failed(RouterError::Internal(e)))?;
        }
        let out = self.stops.push(&delta);
        msg.text = out.text;
        if let Some(i) = out.matched {
            // The group keeps generating until our abort lands; the client is done now.
            msg.finish = Some(self.finish(FinishReason::StopString, None, self.v.stop[i].clone()));
            self.send(msg).await?;
            return Err(End::Done("stop_string"));
        }
        if let Some(f) = finished {
            msg.text += &self.stops.finish();
            let reason = match wire::FinishReason::try_from(f.reason) {
                Ok(wire::FinishReason::StopToken) => FinishReason::StopToken,
                Ok(wire::FinishReason::Length) => FinishReason::Length,
                Ok(wire::FinishReason::Aborted) => {
                    return Err(End::Failed(RouterError::Worker {
                        group: String::new(),
                        code: Code::Unavailable,
                        msg: "the group aborted the request".into(),
                    }))
                }
                _ => FinishReason::Unspecified,
            };
            let label = if reason == FinishReason::Length { "length" } else { "stop_token" };
            msg.finish = Some(self.finish(reason, f.usage, String::new()));
            self.send(msg).await?;
            return Err(End::Done(label));
        }
        if !msg.token_ids.is_empty() || !msg.text.is_empty() {
            self.send(msg).await?;
        }
        Ok(())
    }

    fn finish(&self, reason: FinishReason, usage: Option<wire::Usage>, matched: String) -> Finish {
        let u = usage.unwrap_or_default();
        metrics::counter!("mlaserve_cached_prompt_tokens_total").increment(u.cached_prompt_tokens as u64);
        if u.draft_tokens > 0 {
            metrics::counter!("mlaserve_draft_tokens_total").increment(u.draft_tokens as u64);
            metrics::counter!("mlaserve_accepted_tokens_total").increment(u.accepted_tokens as u64);
            for (j, n) in u.accepted_per_position.iter().enumerate() {
                metrics::counter!("mlaserve_accepted_tokens_by_position_total", "position" => (j + 1).to_string())
                    .increment(*n as u64);
            }
        }
        if u.time_to_first_token_s > 0.0 {
            metrics::histogram!("mlaserve_queue_time_seconds").record(u.time_to_first_token_s as f64);
        }
        let mean_acceptance_length =
            if u.decode_steps == 0 { 1.0 } else { 1.0 + u.accepted_tokens as f32 / u.decode_steps as f32 };
        Finish {
            reason: reason as i32,
            matched_stop: matched,
            usage: Some(Usage {
                prompt_tokens: self.v.prompt.len() as u32,
                completion_tokens: self.completion,
                draft_tokens: u.draft_tokens,
                accepted_tokens: u.accepted_tokens,
                mean_acceptance_length,
                time_to_first_token_s: self.first_token.map(|t| (t - self.arrival).as_secs_f32()).unwrap_or(0.0),
                total_time_s: self.arrival.elapsed().as_secs_f32(),
                accepted_per_position: u.accepted_per_position,
                cached_prompt_tokens: u.cached_prompt_tokens,
            }),
        }
    }

    async fn send(&mut self, mut msg: GenerateResponse) -> Result<(), End> {
        msg.index = self.index;
        if !self.sent_first {
            if let Some(f) = self.first.take() {
                let _ = f.send(());
            }
            self.sent_first = true;
            msg.request_id = self.id.clone();
            if self.v.echo_prompt_ids {
                msg.prompt_token_ids = self.v.prompt.clone();
            }
        }
        let from = if msg.token_ids.is_empty() { None } else { self.relay_from.take() };
        self.tx.send(Ok(Timed { msg, from })).await.map_err(|_| End::ClientGone)
    }
}

/// How following a submission ended.
enum End {
    Done(&'static str),
    ClientGone,
    Failed(RouterError),
    /// The group went away; retryable while no token was streamed.
    Lost(String),
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}
