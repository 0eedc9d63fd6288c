//! The `mlaserve.worker.v1.Worker` service on a group's leader: sessions from routers
//! over the engine's async handle.
//!
//! Per session: a reader takes `RouterBatch`es and starts one forwarder task per
//! submission (all of a batch reach the engine's command queue together, so they join
//! the same step); forwarders push the engine's events into one session queue; a
//! writer drains that queue into `WorkerBatch`es, each with the group's load. Aborting
//! a request drops its event receiver, which the engine turns into an abort at its next
//! iteration. When the session ends — the router left or its connection broke — every
//! request it submitted is aborted, so a dead router never leaks KV blocks.
//!
//! Stopping is shared by every session through [`Lifecycle`]: while the group drains,
//! each session pushes a load report with `draining` set at once and refuses new
//! submissions with UNAVAILABLE (no token streamed, so the router retries elsewhere);
//! once stopped, each session sends what its requests produced and ends.

use mlaserve_engine::{EngineError, EngineHandle, Event as EngineEvent, FinishReason, Request, SamplingParams};
use mlaserve_proto::worker::{
    self as wire, worker_server::Worker, Event, Finished, GetInfoRequest, GetLoadRequest, GroupInfo, Load, RouterBatch,
    WorkerBatch,
};
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::{Stream, StreamExt};
use tonic::{Code, Request as GrpcRequest, Response, Status, Streaming};

/// Most events in one `WorkerBatch`.
const MAX_EVENTS: usize = 4096;
/// Load is pushed at least this often while a session is idle.
const LOAD_PERIOD: Duration = Duration::from_millis(200);

/// The worker service (cheap to clone).
#[derive(Debug, Clone)]
pub struct WorkerService {
    pub engine: EngineHandle,
    pub info: GroupInfo,
    pub life: Arc<Lifecycle>,
}

/// Where the group is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Serving,
    /// Refusing new submissions; the requests it holds run to the end.
    Draining,
    /// Sessions flush their events and end; whatever still runs is aborted.
    Stopped,
}

/// The group's phase, watched by every session, and its live requests across sessions.
#[derive(Debug)]
pub struct Lifecycle {
    phase: watch::Sender<Phase>,
    live: AtomicUsize,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle { phase: watch::channel(Phase::Serving).0, live: AtomicUsize::new(0) }
    }
}

impl Lifecycle {
    pub fn phase(&self) -> Phase {
        *self.phase.borrow()
    }

    /// Moves to `phase` (never back) and wakes every session.
    pub fn set(&self, phase: Phase) {
        self.phase.send_if_modified(|p| {
            let later = phase as u8 > *p as u8;
            if later {
                *p = phase;
            }
            later
        });
    }

    /// Requests submitted on any session whose final event has not been queued yet.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }
}

/// Counts a request as live until dropped (its forwarder ended or was aborted).
struct LiveGuard(Arc<Lifecycle>);

impl LiveGuard {
    fn new(life: &Arc<Lifecycle>) -> Self {
        life.live.fetch_add(1, Ordering::AcqRel);
        LiveGuard(life.clone())
    }
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The group's load in wire form.
pub fn wire_load(engine: &EngineHandle, life: &Lifecycle) -> Load {
    let l = engine.load();
    Load {
        running: l.running_requests as u32,
        waiting: l.queued_requests as u32,
        outstanding_tokens: l.outstanding_tokens,
        kv_blocks_total: l.kv_blocks_total as u32,
        kv_blocks_free: l.kv_blocks_free as u32,
        draining: life.phase() != Phase::Serving,
    }
}

type SessionStream = Pin<Box<dyn Stream<Item = Result<WorkerBatch, Status>> + Send>>;

#[tonic::async_trait]
impl Worker for WorkerService {
    type SessionStream = SessionStream;

    async fn session(&self, req: GrpcRequest<Streaming<RouterBatch>>) -> Result<Response<SessionStream>, Status> {
        let inbound = req.into_inner();
        let (out_tx, out_rx) = mpsc::channel(64);
        let (ev_tx, ev_rx) = mpsc::unbounded_channel();
        let live: Live = Arc::default();
        let writer = tokio::spawn(write_session(self.engine.clone(), self.life.clone(), ev_rx, out_tx));
        tokio::spawn(read_session(self.engine.clone(), self.life.clone(), inbound, ev_tx, live, writer));
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(out_rx))))
    }

    async fn get_info(&self, _r: GrpcRequest<GetInfoRequest>) -> Result<Response<GroupInfo>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    async fn get_load(&self, _r: GrpcRequest<GetLoadRequest>) -> Result<Response<Load>, Status> {
        Ok(Response::new(wire_load(&self.engine, &self.life)))
    }
}

/// Forwarder tasks of a session's live requests, by router id.
type Live = Arc<Mutex<HashMap<u64, JoinHandle<()>>>>;

async fn read_session(
    engine: EngineHandle,
    life: Arc<Lifecycle>,
    mut inbound: Streaming<RouterBatch>,
    ev_tx: mpsc::UnboundedSender<Event>,
    live: Live,
    writer: JoinHandle<()>,
) {
    let mut phase = life.phase.subscribe();
    let stopped = loop {
        let next = tokio::select! {
            b = inbound.next() => b,
            _ = phase.wait_for(|p| *p == Phase::Stopped) => break true,
        };
        let batch = match next {
            Some(Ok(b)) => b,
            Some(Err(s)) => {
                tracing::info!(status = %s, "router session broke");
                break false;
            }
            None => break false,
        };
        for id in batch.abort {
            if let Some(task) = lock(&live).remove(&id) {
                task.abort();
            }
        }
        for s in batch.submit {
            let id = s.id;
            if life.phase() != Phase::Serving {
                // Before any token: the router takes this as "try another group".
                let refused = refusal(Code::Unavailable, "the worker group is draining (stopping)".into());
                let _ = ev_tx.send(Event { id, finished: Some(refused), ..Default::default() });
                continue;
            }
            // Insert under the lock the task itself takes to remove its entry, so a
            // request that ends at once cannot leave a stale entry behind.
            let mut g = lock(&live);
            let guard = LiveGuard::new(&life);
            let task = tokio::spawn(forward(engine.clone(), s, ev_tx.clone(), live.clone(), guard));
            g.insert(id, task);
        }
    };
    // The router is gone, or the group stopped: abort everything it submitted (after a
    // drain nothing is left).
    let tasks: Vec<(u64, JoinHandle<()>)> = lock(&live).drain().collect();
    for (id, t) in tasks {
        t.abort();
        if stopped {
            // Say what happened: the client sees this, not a broken session.
            let why = DRAIN_TIMEOUT_ABORT.to_string();
            let _ = ev_tx.send(Event { id, finished: Some(refusal(Code::Unavailable, why)), ..Default::default() });
        }
    }
    if stopped {
        // The writer sends the events already queued and ends the session.
        drop(ev_tx);
        let _ = writer.await;
    } else {
        writer.abort();
    }
}

/// What a request still running when the drain timeout passes ends with.
const DRAIN_TIMEOUT_ABORT: &str =
    "aborted: the worker group is stopping and its drain timeout (--drain-timeout-s) passed before this request finished";

/// A request's final event when the group could not run it.
fn refusal(code: Code, error: String) -> Finished {
    Finished { reason: wire::FinishReason::Error as i32, usage: None, error, status_code: code as i32 }
}

/// A token's log-probabilities on the wire.
fn wire_logprobs(l: mlaserve_engine::RowLogprobs) -> wire::TokenLogprobs {
    wire::TokenLogprobs {
        logprob: l.logprob,
        top_token_ids: l.top.iter().map(|t| t.0).collect(),
        top_logprobs: l.top.iter().map(|t| t.1).collect(),
    }
}

/// Runs one request: submit, then relay its events until it finishes.
async fn forward(
    engine: EngineHandle,
    s: wire::Submit,
    ev_tx: mpsc::UnboundedSender<Event>,
    live: Live,
    live_guard: LiveGuard,
) {
    let id = s.id;
    let submitted = Instant::now();
    let (sp, st) = (s.sampling.unwrap_or_default(), s.stopping.unwrap_or_default());
    let sampling = SamplingParams {
        temperature: sp.temperature,
        top_k: sp.top_k,
        top_p: sp.top_p,
        seed: sp.seed,
        max_new_tokens: st.max_new_tokens,
        stop_token_ids: st.stop_token_ids,
        stop_sequences: Vec::new(),
        ignore_eos: st.ignore_eos,
        presence_penalty: sp.presence_penalty,
        frequency_penalty: sp.frequency_penalty,
        repetition_penalty: sp.repetition_penalty.unwrap_or(1.0),
        min_p: sp.min_p,
        logit_bias: sp.logit_bias.iter().map(|b| (b.token_id, b.bias)).collect(),
        logprobs: sp.logprobs,
    };
    let wants_logprobs = sampling.logprobs.is_some();
    let mut rx = match engine.submit(Request::new(s.prompt, sampling)).await {
        Ok((_, rx)) => rx,
        Err(e) => {
            let (code, msg) = match &e {
                EngineError::InvalidRequest { .. } => (Code::InvalidArgument, e.to_string()),
                EngineError::QueueFull(_) => (Code::ResourceExhausted, e.to_string()),
                EngineError::Stopped | EngineError::Failed(_) => (Code::Unavailable, e.to_string()),
                _ => (Code::Internal, e.to_string()),
            };
            let _ = ev_tx.send(Event { id, finished: Some(refusal(code, msg)), ..Default::default() });
            lock(&live).remove(&id);
            return;
        }
    };
    let mut first_token: Option<f32> = None;
    let mut held: Option<Vec<u32>> = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            // With logprobs, the tokens wait for the `Logprobs` event right behind them.
            EngineEvent::Tokens(tokens) if wants_logprobs => {
                first_token.get_or_insert_with(|| submitted.elapsed().as_secs_f32());
                held = Some(tokens);
            }
            EngineEvent::Tokens(tokens) => {
                first_token.get_or_insert_with(|| submitted.elapsed().as_secs_f32());
                if ev_tx.send(Event { id, tokens, ..Default::default() }).is_err() {
                    break;
                }
            }
            EngineEvent::Logprobs(lps) => {
                let tokens = held.take().unwrap_or_default();
                let logprobs = lps.into_iter().map(wire_logprobs).collect();
                if ev_tx.send(Event { id, tokens, finished: None, logprobs }).is_err() {
                    break;
                }
            }
            EngineEvent::Finished { reason, usage } => {
                let (reason, error, code) = match reason {
                    FinishReason::Stop(_) => (wire::FinishReason::StopToken, String::new(), Code::Ok),
                    FinishReason::Length => (wire::FinishReason::Length, String::new(), Code::Ok),
                    // The engine stopping under a drain timeout aborts what it still runs;
                    // that may reach here before the session says why: say it here too.
                    FinishReason::Abort if live_guard.0.phase() == Phase::Stopped => {
                        (wire::FinishReason::Error, DRAIN_TIMEOUT_ABORT.to_string(), Code::Unavailable)
                    }
                    FinishReason::Abort => (wire::FinishReason::Aborted, String::new(), Code::Ok),
                    FinishReason::Error(m) => (wire::FinishReason::Error, m, Code::Internal),
                    FinishReason::Unavailable(m) => (wire::FinishReason::Error, m, Code::Unavailable),
                };
                let usage = wire::Usage {
                    prompt_tokens: usage.prompt_tokens as u32,
                    completion_tokens: usage.generated_tokens as u32,
                    draft_tokens: usage.draft_tokens as u32,
                    accepted_tokens: usage.accepted_tokens as u32,
                    decode_steps: usage.decode_steps as u32,
                    time_to_first_token_s: first_token.unwrap_or(0.0),
                    accepted_per_position: usage.accepted_per_position.iter().map(|&n| n as u32).collect(),
                    cached_prompt_tokens: usage.cached_prompt_tokens as u32,
                };
                let finished = Finished { reason: reason as i32, usage: Some(usage), error, status_code: code as i32 };
                let _ = ev_tx.send(Event {
                    id,
                    tokens: held.take().unwrap_or_default(),
                    finished: Some(finished),
                    logprobs: Vec::new(),
                });
                break;
            }
        }
    }
    lock(&live).remove(&id);
}

/// Drains the session's events into batches, each with the current load.
async fn write_session(
    engine: EngineHandle,
    life: Arc<Lifecycle>,
    mut ev_rx: mpsc::UnboundedReceiver<Event>,
    out: mpsc::Sender<Result<WorkerBatch, Status>>,
) {
    // The first message tells the router the session is up and how loaded we are.
    if out.send(Ok(WorkerBatch { events: Vec::new(), load: Some(wire_load(&engine, &life)) })).await.is_err() {
        return;
    }
    let mut phase = life.phase.subscribe();
    loop {
        let mut events = Vec::new();
        let mut last = false;
        tokio::select! {
            ev = ev_rx.recv() => match ev {
                Some(ev) => events.push(ev),
                None => last = true,
            },
            // A phase change goes out at once: a draining group must stop getting work.
            // The session ends when the reader drops its event sender (after it has
            // queued the final events of a stop), not here.
            _ = phase.changed() => {
                phase.borrow_and_update();
            }
            _ = tokio::time::sleep(LOAD_PERIOD) => {}
        }
        while events.len() < MAX_EVENTS {
            match ev_rx.try_recv() {
                Ok(ev) => events.push(ev),
                Err(_) => break,
            }
        }
        if out.send(Ok(WorkerBatch { events, load: Some(wire_load(&engine, &life)) })).await.is_err() || last {
            return;
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phase_only_moves_forward() {
        let life = Arc::new(Lifecycle::default());
        let mut seen = life.phase.subscribe();
        life.set(Phase::Draining);
        assert!(seen.has_changed().unwrap_or(false));
        seen.mark_unchanged();
        life.set(Phase::Serving);
        assert_eq!(life.phase(), Phase::Draining);
        assert!(!seen.has_changed().unwrap_or(true), "a no-op must not wake the sessions");
        life.set(Phase::Stopped);
        assert_eq!(life.phase(), Phase::Stopped);
    }

    #[test]
    fn live_requests_are_counted_until_their_guard_drops() {
        let life = Arc::new(Lifecycle::default());
        let (a, b) = (LiveGuard::new(&life), LiveGuard::new(&life));
        assert_eq!(life.live(), 2);
        drop(a);
        drop(b);
        assert_eq!(life.live(), 0);
    }
}
