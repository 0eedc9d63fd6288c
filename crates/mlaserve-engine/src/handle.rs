//! The async shell: [`EngineHandle`] owns one OS thread that builds the backend and
//! runs the step loop (a backend, and a TP rank's NCCL communicator in it, is used from one thread). Callers talk to
//! it through a bounded command channel with `oneshot` replies; each request's events
//! come back on its own channel.
//!
//! A request's event channel is bounded at `max_new_tokens + 2`: a step sends a request
//! at most one `Tokens` event, so the engine thread never blocks on a slow reader.
//! Dropping the receiver aborts the request at the next loop iteration.

use crate::api::{EngineConfig, EngineStats, Event, Load, Request, RequestId};
use crate::engine::Engine;
use crate::error::{EngineError, Result};
use mlaserve_core::Backend;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

/// Capacity of the command channel: submits beyond it wait (backpressure).
const COMMAND_CAPACITY: usize = 1024;

type SubmitReply = oneshot::Sender<Result<(RequestId, mpsc::Receiver<Event>)>>;

enum Command {
    Submit { req: Request, reply: SubmitReply },
    Abort { id: RequestId, reply: oneshot::Sender<Result<()>> },
    Stats { reply: oneshot::Sender<EngineStats> },
    Shutdown { reply: oneshot::Sender<()> },
}

/// Facts about a running engine that do not change.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineInfo {
    pub num_speculative_tokens: usize,
    pub max_model_len: usize,
    pub kv_blocks_total: usize,
    /// The backend's memory plan (the CUDA backend under `--gpu-memory-utilization`).
    pub memory: Option<mlaserve_core::memory::MemoryPlan>,
}

/// Cloneable async handle to an engine running on its own thread.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    load: Arc<Mutex<Load>>,
    info: EngineInfo,
}

impl EngineHandle {
    /// Starts the engine thread: `make_backend` runs on it (the backend never leaves
    /// it), then the engine is built with `config`. Returns once both succeeded.
    pub async fn spawn<B, F>(make_backend: F, config: EngineConfig) -> Result<EngineHandle>
    where
        B: Backend + 'static,
        F: FnOnce() -> std::result::Result<B, mlaserve_core::Error> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(COMMAND_CAPACITY);
        let (init_tx, init_rx) = oneshot::channel();
        let load = Arc::new(Mutex::new(Load::default()));
        let load2 = load.clone();
        std::thread::Builder::new()
            .name("mlaserve-engine".into())
            .spawn(move || {
                let prep = (config.calibration_rows, config.warm_up_graphs, config.max_num_seqs);
                let engine = make_backend()
                    .map_err(EngineError::from)
                    .and_then(|b| Engine::new(b, config))
                    .and_then(|mut e| prepare(&mut e, prep).map(|()| e));
                match engine {
                    Ok(engine) => {
                        let info = EngineInfo {
                            num_speculative_tokens: engine.num_speculative_tokens(),
                            max_model_len: engine.max_model_len(),
                            kv_blocks_total: engine.load().kv_blocks_total,
                            memory: engine.memory_plan(),
                        };
                        if init_tx.send(Ok(info)).is_ok() {
                            run_loop(engine, rx, &load2);
                        }
                    }
                    Err(e) => {
                        let _ = init_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| EngineError::Config(format!("cannot start the engine thread: {e}")))?;
        let info = init_rx.await.map_err(|_| EngineError::Stopped)??;
        Ok(EngineHandle { tx, load, info })
    }

    pub fn info(&self) -> EngineInfo {
        self.info
    }

    /// Queues a request; returns its id and the stream of its events (zero or more
    /// `Tokens`, then one `Finished`). Dropping the receiver aborts the request.
    pub async fn submit(&self, req: Request) -> Result<(RequestId, mpsc::Receiver<Event>)> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Command::Submit { req, reply }).await.map_err(|_| EngineError::Stopped)?;
        rx.await.map_err(|_| EngineError::Stopped)?
    }

    /// Aborts a request; its stream then ends with `Finished { Abort }`.
    pub async fn abort(&self, id: RequestId) -> Result<()> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Command::Abort { id, reply }).await.map_err(|_| EngineError::Stopped)?;
        rx.await.map_err(|_| EngineError::Stopped)?
    }

    /// Load as of the end of the last step; never waits for the engine.
    pub fn load(&self) -> Load {
        match self.load.lock() {
            Ok(l) => *l,
            Err(poisoned) => *poisoned.into_inner(),
        }
    }

    /// Full statistics, answered between two steps.
    pub async fn stats(&self) -> Result<EngineStats> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Command::Stats { reply }).await.map_err(|_| EngineError::Stopped)?;
        rx.await.map_err(|_| EngineError::Stopped)
    }

    /// Aborts every request and stops the engine thread; waits until it has stopped and
    /// dropped its backend.
    pub async fn shutdown(&self) -> Result<()> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Command::Shutdown { reply }).await.map_err(|_| EngineError::Stopped)?;
        rx.await.map_err(|_| EngineError::Stopped)
    }
}

/// Before an engine serves: the graph warm-up and the calibration of adaptive
/// speculation its configuration asks for (`(calibration_rows, warm_up_graphs,
/// max_num_seqs)`), each logged.
fn prepare<B: Backend>(e: &mut Engine<B>, (rows, warm, max_seqs): (usize, bool, usize)) -> Result<()> {
    if warm {
        let t = std::time::Instant::now();
        let w = e.warm_up_graphs(max_seqs)?;
        let (graphs, secs) = (e.backend().graph_captures(), t.elapsed().as_secs_f64());
        tracing::info!(sizes = ?w.rows, steps = w.steps, graphs, secs, "CUDA graphs warmed up");
        if let Some(why) = w.stopped {
            tracing::warn!("graph warm-up stopped early: {why}");
        }
    }
    if rows > 0 {
        let t = std::time::Instant::now();
        let cal = e.calibrate(rows)?;
        let (costs, secs) = (e.stats().speculation.costs, t.elapsed().as_secs_f64());
        tracing::info!(rows = ?cal.rows, steps = cal.steps, secs, ?costs, "speculation calibrated (µs per decode row, per bucket and k)");
        if let Some(why) = cal.stopped {
            tracing::warn!("speculation calibration stopped early: {why}");
        }
    }
    Ok(())
}

/// What an idle engine thread waited for.
enum Idle {
    Command(Command),
    /// The backend's idle interval passed: time for a keep-alive.
    Due,
    /// Every handle is gone.
    Closed,
}

/// Waits for the next command, at most until `due` when there is one (on `rt`, a
/// runtime of this thread's own, since a blocking receive has no deadline).
fn wait_idle(rt: Option<&tokio::runtime::Runtime>, rx: &mut mpsc::Receiver<Command>, due: Option<Instant>) -> Idle {
    let got = match (rt, due) {
        (Some(rt), Some(at)) => match rt
            .block_on(async { tokio::time::timeout(at.saturating_duration_since(Instant::now()), rx.recv()).await })
        {
            Ok(got) => got,
            Err(_) => return Idle::Due,
        },
        _ => rx.blocking_recv(),
    };
    got.map_or(Idle::Closed, Idle::Command)
}

/// The engine thread's loop: take commands (blocking only when idle), drop requests whose
/// reader went away, step, deliver events, publish the load; and every backend idle
/// interval, idle or not, call [`Engine::keep_alive`] (a backend called since may skip it).
fn run_loop<B: Backend>(mut engine: Engine<B>, mut rx: mpsc::Receiver<Command>, load: &Mutex<Load>) {
    let mut streams: HashMap<RequestId, mpsc::Sender<Event>> = HashMap::new();
    let mut shutdown: Option<oneshot::Sender<()>> = None;
    let interval = engine.backend().idle_interval();
    let rt = interval.and_then(|_| match tokio::runtime::Builder::new_current_thread().enable_time().build() {
        Ok(rt) => Some(rt),
        Err(e) => {
            tracing::error!(error = %e, "no runtime for the idle keep-alives");
            None
        }
    });
    // When the next keep-alive is due, whatever else comes: commands that do not reach the
    // backend (the worker's stats poll, every second) must not put it off.
    let mut due = interval.map(|d| Instant::now() + d);
    loop {
        if let (Some(d), Some(at)) = (interval, due) {
            if Instant::now() >= at {
                engine.keep_alive();
                publish(load, engine.load());
                due = Some(Instant::now() + d);
            }
        }
        if !engine.has_work() {
            match wait_idle(rt.as_ref(), &mut rx, due) {
                Idle::Command(cmd) => handle_command(&mut engine, &mut streams, cmd, &mut shutdown),
                Idle::Due => continue,
                Idle::Closed => break,
            }
        }
        while shutdown.is_none() {
            match rx.try_recv() {
                Ok(cmd) => handle_command(&mut engine, &mut streams, cmd, &mut shutdown),
                Err(_) => break,
            }
        }
        if let Some(reply) = shutdown.take() {
            for id in streams.keys() {
                let _ = engine.abort(*id);
            }
            deliver(&mut engine.step(), &mut streams);
            // The backend goes before the reply: a caller that exits once `shutdown`
            // returns must not tear the process down under its drop (CUDA graphs,
            // communicators being aborted on threads of their own).
            drop(engine);
            let _ = reply.send(());
            return;
        }
        let gone: Vec<RequestId> = streams.iter().filter(|(_, tx)| tx.is_closed()).map(|(id, _)| *id).collect();
        for id in gone {
            streams.remove(&id);
            let _ = engine.abort(id);
        }
        let mut events = engine.step();
        deliver(&mut events, &mut streams);
        publish(load, engine.load());
    }
}

fn publish(load: &Mutex<Load>, l: Load) {
    match load.lock() {
        Ok(mut g) => *g = l,
        Err(poisoned) => *poisoned.into_inner() = l,
    }
}

fn deliver(events: &mut Vec<(RequestId, Event)>, streams: &mut HashMap<RequestId, mpsc::Sender<Event>>) {
    for (id, ev) in events.drain(..) {
        let done = matches!(ev, Event::Finished { .. });
        if let Some(tx) = streams.get(&id) {
            // Capacity covers every event of the request; an error means the reader
            // left, and the next iteration aborts it.
            let _ = tx.try_send(ev);
        }
        if done {
            streams.remove(&id);
        }
    }
}

fn handle_command<B: Backend>(
    engine: &mut Engine<B>,
    streams: &mut HashMap<RequestId, mpsc::Sender<Event>>,
    cmd: Command,
    shutdown: &mut Option<oneshot::Sender<()>>,
) {
    match cmd {
        Command::Submit { req, reply } => {
            // A `Tokens` event per token at most (and a `Logprobs` after each), one `Finished`.
            let per_token = if req.sampling.logprobs.is_some() { 2 } else { 1 };
            let cap = (req.sampling.max_new_tokens as usize).saturating_mul(per_token).saturating_add(2);
            let res = engine.add_request(req).map(|id| {
                let (tx, rx) = mpsc::channel(cap);
                streams.insert(id, tx);
                (id, rx)
            });
            if let Err(Ok((id, _))) = reply.send(res) {
                // The submitter went away before hearing the id.
                streams.remove(&id);
                let _ = engine.abort(id);
            }
        }
        Command::Abort { id, reply } => {
            let _ = reply.send(engine.abort(id));
        }
        Command::Stats { reply } => {
            let _ = reply.send(engine.stats());
        }
        Command::Shutdown { reply } => *shutdown = Some(reply),
    }
}
