//! One worker group as the router sees it: a gRPC channel to its leader and one
//! long-lived `Session` stream that carries batches of submissions and aborts out and
//! batches of token events and load reports back.
//!
//! Submissions queued while the previous batch was being written go out together, so
//! under load the router hands the leader batches rather than single requests. The
//! command channel is unbounded on purpose: its producers are admitted requests, which
//! [`crate::admission`] bounds, and aborts must be sendable from `Drop`.

use mlaserve_proto::worker::{
    self as wire, worker_client::WorkerClient, Event, Finished, GroupInfo, Load, RouterBatch, Submit,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tonic::transport::{Channel, Endpoint};

/// Most submissions/aborts in one `RouterBatch`.
const MAX_BATCH: usize = 256;

/// What a request hears from its group.
#[derive(Debug, Clone, PartialEq)]
pub enum GroupEvent {
    /// New tokens, their log-probabilities when the request asked (else empty), and when
    /// the router received them.
    Tokens(Vec<u32>, Vec<mlaserve_proto::worker::TokenLogprobs>, std::time::Instant),
    Finished(Finished),
    /// The session broke (the group died or hung); no more events will come.
    Lost(String),
}

enum Cmd {
    Submit(Submit),
    Abort(u64),
}

struct Inflight {
    tx: mpsc::UnboundedSender<GroupEvent>,
    /// Tokens this request still owes the group (prompt until its first token, then
    /// the new tokens left): the router's own view of the group's outstanding work.
    owed: u64,
    prompt: u64,
    started: bool,
}

/// A connected group (see the module docs). [`crate::pool::Pool`] owns the session's
/// lifetime; requests hold `Arc`s while they stream.
#[derive(Debug)]
pub struct Group {
    pub name: String,
    pub addr: String,
    pub info: GroupInfo,
    cmd: mpsc::UnboundedSender<Cmd>,
    state: Arc<Shared>,
}

struct Shared {
    inflight: Mutex<HashMap<u64, Inflight>>,
    owed: AtomicU64,
    reported: Mutex<Load>,
    alive: AtomicBool,
    /// The group said it is stopping: no new work goes to it.
    draining: AtomicBool,
    next_id: AtomicU64,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("owed", &self.owed).field("alive", &self.alive).finish()
    }
}

/// A request submitted to a group. Dropping it before the request finished aborts
/// the request in the group (abort on drop).
#[derive(Debug)]
pub struct Submission {
    pub id: u64,
    pub group: Arc<Group>,
    pub events: mpsc::UnboundedReceiver<GroupEvent>,
    done: bool,
}

impl Submission {
    /// The request has finished (or was lost): nothing to abort on drop.
    pub fn mark_done(&mut self) {
        self.done = true;
    }
}

impl Drop for Submission {
    fn drop(&mut self) {
        if !self.done {
            self.group.abort(self.id);
        }
    }
}

/// Channel settings: HTTP/2 keep-alive notices a hung leader within ~6 s even when the
/// TCP connection stays up (a killed leader's connection closes at once). Not tighter:
/// on a CPU-saturated host a busy but healthy leader must not be declared dead.
pub fn endpoint(addr: &str, link: &Link) -> Result<Endpoint, tonic::transport::Error> {
    let addr = match (&link.tls, addr.strip_prefix("http://")) {
        (Some(_), Some(rest)) => format!("https://{rest}"),
        _ => addr.to_string(),
    };
    let e = Endpoint::from_shared(addr)?
        .connect_timeout(Duration::from_secs(3))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(2))
        .keep_alive_timeout(Duration::from_secs(4))
        .keep_alive_while_idle(true);
    match &link.tls {
        Some(tls) => e.tls_config(tls.clone()),
        None => Ok(e),
    }
}

/// An error with its causes (a transport error's own text is only "transport error").
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

/// Prefix of a connect error that means the group does not accept this router (its
/// certificate or group secret), not that the group is down.
pub const REFUSED: &str = "refused: ";

fn describe(context: &str, text: &str, code: Option<tonic::Code>, link: &Link) -> String {
    let refused = matches!(code, Some(tonic::Code::Unauthenticated | tonic::Code::PermissionDenied))
        || text.contains("fatal alert")
        || text.contains("invalid peer certificate");
    // With TLS 1.3 a server that rejects the client's certificate says so after the
    // handshake completed on the client's side: the client may then see only the
    // connection closing under its first request instead of the alert.
    let closed_after_tls = link.tls.is_some()
        && ["broken pipe", "connection closed", "connection reset", "operation was canceled"]
            .iter()
            .any(|t| text.contains(t));
    if refused {
        format!("{REFUSED}{context}: {text}")
    } else if closed_after_tls {
        format!("{REFUSED}{context}: the worker closed the TLS connection (does it trust this router's certificate?): {text}")
    } else {
        format!("{context}: {text}")
    }
}

/// How the router reaches its workers: TLS settings (files already read) and the group
/// secret sent as `authorization: Bearer` on every call.
#[derive(Debug, Clone, Default)]
pub struct Link {
    pub tls: Option<tonic::transport::ClientTlsConfig>,
    pub secret: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

impl Link {
    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        if let Some(s) = &self.secret {
            r.metadata_mut().insert("authorization", s.clone());
        }
        r
    }
}

impl Group {
    /// Connects to the leader at `addr`, fetches its info and opens the session.
    /// Returns the group and a future that resolves when the session ends.
    pub async fn connect(
        name: &str,
        addr: &str,
        link: &Link,
    ) -> Result<(Arc<Group>, tokio::task::JoinHandle<String>), String> {
        let channel: Channel = endpoint(addr, link)
            .map_err(|e| format!("bad address {addr}: {e}"))?
            .connect()
            .await
            .map_err(|e| describe(&format!("connect {addr}"), &chain(&e), None, link))?;
        let mut client = WorkerClient::new(channel).max_decoding_message_size(64 << 20);
        let info = client
            .get_info(link.request(wire::GetInfoRequest {}))
            .await
            .map_err(|e| describe("GetInfo", &chain(&e), Some(e.code()), link))?
            .into_inner();
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (out_tx, out_rx) = mpsc::channel::<RouterBatch>(64);
        let inbound = client
            .session(link.request(tokio_stream::wrappers::ReceiverStream::new(out_rx)))
            .await
            .map_err(|e| describe("Session", &chain(&e), Some(e.code()), link))?
            .into_inner();
        let state = Arc::new(Shared {
            inflight: Mutex::new(HashMap::new()),
            owed: AtomicU64::new(0),
            reported: Mutex::new(Load::default()),
            alive: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
        });
        let group = Arc::new(Group { name: name.to_string(), addr: addr.to_string(), info, cmd: cmd_tx, state });
        tokio::spawn(batcher(cmd_rx, out_tx));
        let g = group.clone();
        let task = tokio::spawn(async move {
            let why = receive(&g, inbound).await;
            g.fail_all(&why);
            why
        });
        Ok((group, task))
    }

    /// Submits a request; its events arrive on the returned submission.
    pub fn submit(
        self: &Arc<Self>,
        prompt: Vec<u32>,
        sampling: wire::SamplingParams,
        stopping: wire::StoppingCriteria,
    ) -> Submission {
        let id = self.state.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let owed = prompt.len() as u64 + stopping.max_new_tokens as u64;
        let mut done = false;
        {
            let mut inflight = lock(&self.state.inflight);
            if self.is_alive() {
                inflight.insert(id, Inflight { tx: tx.clone(), owed, prompt: prompt.len() as u64, started: false });
                self.state.owed.fetch_add(owed, Ordering::Relaxed);
            } else {
                let _ = tx.send(GroupEvent::Lost("group is down".into()));
                done = true;
            }
        }
        if !done
            && self
                .cmd
                .send(Cmd::Submit(Submit { id, prompt, sampling: Some(sampling), stopping: Some(stopping) }))
                .is_err()
        {
            self.fail_all("session closed");
        }
        Submission { id, group: self.clone(), events: rx, done }
    }

    /// Stops a request in the group; its events stop at once.
    pub fn abort(&self, id: u64) {
        let removed = lock(&self.state.inflight).remove(&id);
        if let Some(r) = removed {
            self.state.owed.fetch_sub(r.owed, Ordering::Relaxed);
            let _ = self.cmd.send(Cmd::Abort(id));
        }
    }

    pub fn is_alive(&self) -> bool {
        self.state.alive.load(Ordering::Acquire)
    }

    /// Whether new requests may go to the group: its session is up and it is not draining.
    pub fn accepts_work(&self) -> bool {
        self.is_alive() && !self.state.draining.load(Ordering::Acquire)
    }

    /// Outstanding tokens used to pick a group: the larger of the router's own count and
    /// the group's last report (which also covers other routers' requests).
    pub fn score(&self) -> u64 {
        let own = self.state.owed.load(Ordering::Relaxed);
        own.max(lock(&self.state.reported).outstanding_tokens)
    }

    /// The group's last load report.
    pub fn load(&self) -> Load {
        *lock(&self.state.reported)
    }

    pub fn inflight(&self) -> usize {
        lock(&self.state.inflight).len()
    }

    /// Marks the group down and ends every in-flight request with `Lost`.
    pub fn fail_all(&self, why: &str) {
        if self.state.alive.swap(false, Ordering::AcqRel) {
            // Under the load lock, so a report being published cannot bring them back.
            let _reported = lock(&self.state.reported);
            crate::metrics::group_gone(&self.name);
        }
        let drained: Vec<Inflight> = lock(&self.state.inflight).drain().map(|(_, r)| r).collect();
        for r in drained {
            self.state.owed.fetch_sub(r.owed, Ordering::Relaxed);
            let _ = r.tx.send(GroupEvent::Lost(why.to_string()));
        }
    }

    fn on_event(&self, ev: Event) {
        let mut inflight = lock(&self.state.inflight);
        let Some(r) = inflight.get_mut(&ev.id) else { return };
        let mut paid = 0;
        if !ev.tokens.is_empty() {
            if !r.started {
                r.started = true;
                paid += r.prompt;
            }
            paid += ev.tokens.len() as u64;
            let _ = r.tx.send(GroupEvent::Tokens(ev.tokens, ev.logprobs, std::time::Instant::now()));
        }
        let paid = paid.min(r.owed);
        r.owed -= paid;
        self.state.owed.fetch_sub(paid, Ordering::Relaxed);
        if let Some(f) = ev.finished {
            if let Some(r) = inflight.remove(&ev.id) {
                self.state.owed.fetch_sub(r.owed, Ordering::Relaxed);
                let _ = r.tx.send(GroupEvent::Finished(f));
            }
        }
    }
}

/// Writes commands to the session, coalescing whatever is queued into one batch.
async fn batcher(mut rx: mpsc::UnboundedReceiver<Cmd>, out: mpsc::Sender<RouterBatch>) {
    while let Some(first) = rx.recv().await {
        let mut batch = RouterBatch::default();
        let add = |c: Cmd, b: &mut RouterBatch| match c {
            Cmd::Submit(s) => b.submit.push(s),
            Cmd::Abort(id) => b.abort.push(id),
        };
        add(first, &mut batch);
        while batch.submit.len() + batch.abort.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(c) => add(c, &mut batch),
                Err(_) => break,
            }
        }
        metrics::histogram!("mlaserve_router_batch_size").record((batch.submit.len() + batch.abort.len()) as f64);
        if out.send(batch).await.is_err() {
            return;
        }
    }
}

/// Reads the session until it ends; returns why it ended.
async fn receive(g: &Group, mut inbound: tonic::Streaming<wire::WorkerBatch>) -> String {
    loop {
        match inbound.next().await {
            Some(Ok(batch)) => {
                if let Some(load) = batch.load {
                    if load.draining && !g.state.draining.swap(true, Ordering::AcqRel) {
                        tracing::info!(group = %g.name, "worker group draining; no new requests go to it");
                    }
                    // Under the lock fail_all takes: a report that arrives after the group
                    // went down is not published (its gauges stay zeroed).
                    let mut reported = lock(&g.state.reported);
                    *reported = load;
                    if g.is_alive() {
                        crate::metrics::group_load(&g.name, &load);
                    }
                }
                for ev in batch.events {
                    g.on_event(ev);
                }
            }
            Some(Err(status)) => return format!("session with {} failed: {}", g.addr, status.message()),
            None => return format!("session with {} ended", g.addr),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}
