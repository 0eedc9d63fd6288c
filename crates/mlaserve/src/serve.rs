//! `mlaserve serve`: a router and one worker group in one process — the embedded
//! default. The group listens on a private loopback port and the router reaches it
//! over real gRPC, exactly as in a split deployment. Composing the two servers is this
//! crate's job: neither server crate knows the other.

use mlaserve_engine::EngineHandle;
use mlaserve_router::args::at_least_one;
use mlaserve_router::args::{PublicAccess, WorkerLink};
use mlaserve_router::{RouterArgs, RouterHandle, StartError};
use mlaserve_worker::{EngineArgs, WorkerAccess, WorkerArgs, WorkerError, WorkerHandle};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// The bundled small model `serve` runs when given no `--model`.
pub const DEFAULT_MODEL: &str = "models/mla-tiny-code";

/// Settings of `mlaserve serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Address of the public gRPC API.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Address of the Prometheus `/metrics` endpoint; none when unset.
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// Address of the OpenAI-compatible HTTP API (`/v1/chat/completions`,
    /// `/v1/completions`, `/v1/models`, `/health`, `/ready`); `off` serves none.
    #[arg(long, default_value = "127.0.0.1:8000", value_parser = parse_http_listen)]
    pub http_listen: HttpListen,
    /// Model directory (default: the bundled model; a relative path is taken from the
    /// working directory, so the default works from the repository root).
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub model: PathBuf,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Requests admitted at once; the next one gets RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 2048, value_parser = at_least_one())]
    pub queue_size: usize,
    /// Largest request message in bytes.
    #[arg(long, default_value_t = 4 << 20, value_parser = at_least_one())]
    pub max_message_bytes: usize,
    /// On SIGTERM/Ctrl-C: seconds to let in-flight requests finish.
    #[arg(long, default_value_t = 30)]
    pub drain_timeout_s: u64,
    #[command(flatten)]
    pub access: PublicAccess,
    /// The secret the embedded router and group share (random per start), so that no
    /// other local process can act as the group's router.
    #[arg(skip = link_secret())]
    pub link_secret: String,
}

/// 32 random bytes as hex.
/// `--http-listen`: an address, or none (`off`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpListen(pub Option<SocketAddr>);

fn parse_http_listen(s: &str) -> Result<HttpListen, String> {
    if s == "off" {
        return Ok(HttpListen(None));
    }
    s.parse()
        .map(|a| HttpListen(Some(a)))
        .map_err(|e| format!("{s:?}: {e} (an address such as 127.0.0.1:8000, or off)"))
}

fn link_secret() -> String {
    use std::io::Read;
    let mut b = [0u8; 32];
    // The kernel's generator; without it (not Linux) the group relies on loopback only.
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).is_err() {
        let h = std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), 0u8);
        b[..8].copy_from_slice(&h.to_le_bytes());
    }
    mlaserve_cluster::keys::hex(&b)
}

impl ServeArgs {
    pub fn new(model: impl Into<PathBuf>) -> Self {
        let r = RouterArgs::new(model);
        ServeArgs {
            listen: r.listen,
            metrics_listen: None,
            http_listen: HttpListen(None),
            model: r.model,
            engine: EngineArgs::default(),
            queue_size: r.queue_size,
            max_message_bytes: r.max_message_bytes,
            drain_timeout_s: r.drain_timeout_s,
            access: PublicAccess::default(),
            link_secret: link_secret(),
        }
    }

    /// The settings of the embedded worker group.
    pub fn worker_args(&self) -> WorkerArgs {
        WorkerArgs {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            engine: self.engine.clone(),
            group: Some("local".into()),
            access: WorkerAccess { router_secret: Some(self.link_secret.clone()), ..WorkerAccess::default() },
            ..WorkerArgs::new(self.model.clone())
        }
    }

    fn router_args(&self, worker: SocketAddr) -> RouterArgs {
        RouterArgs {
            listen: self.listen,
            metrics_listen: self.metrics_listen,
            http_listen: self.http_listen.0,
            workers: vec![format!("http://{worker}")],
            queue_size: self.queue_size,
            max_message_bytes: self.max_message_bytes,
            drain_timeout_s: self.drain_timeout_s,
            access: self.access.clone(),
            link: WorkerLink { worker_secret: Some(self.link_secret.clone()), ..WorkerLink::default() },
            ..RouterArgs::new(self.model.clone())
        }
    }
}

/// Why `serve` could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Worker(#[from] WorkerError),
    #[error(transparent)]
    Router(#[from] StartError),
}

/// A running router + group.
#[derive(Debug)]
pub struct ServeHandle {
    pub router: RouterHandle,
    pub worker: WorkerHandle,
}

impl ServeHandle {
    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.router.addr
    }

    /// Waits until the router sees the group ready (at most `timeout`).
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let mut w = self.router.pool().ready_watch();
        tokio::time::timeout(timeout, w.wait_for(|n| *n > 0)).await.is_ok_and(|r| r.is_ok())
    }

    /// Drains the router for up to `drain`, then stops both halves.
    pub async fn shutdown(self, drain: Duration) {
        self.router.drain(drain).await;
        self.router.shutdown().await;
        self.worker.shutdown().await;
    }
}

/// Starts the group on `engine`, then the router in front of it.
pub async fn start_with_engine(args: &ServeArgs, engine: EngineHandle) -> Result<ServeHandle, ServeError> {
    let worker = mlaserve_worker::start(args.worker_args(), engine, 1).await?;
    let router = mlaserve_router::start(args.router_args(worker.addr)).await?;
    let h = ServeHandle { router, worker };
    h.wait_ready(Duration::from_secs(10)).await;
    Ok(h)
}

/// `mlaserve serve` once the engine runs: prints where it listens, serves until SIGTERM
/// or Ctrl-C, drains, stops.
pub async fn run_with_engine(args: ServeArgs, engine: EngineHandle) -> Result<(), ServeError> {
    let h = start_with_engine(&args, engine).await?;
    announce(&h);
    mlaserve_cluster::shutdown_signal().await;
    h.shutdown(Duration::from_secs(args.drain_timeout_s)).await;
    Ok(())
}

fn announce(h: &ServeHandle) {
    println!("mlaserve serving on {} (gRPC: mlaserve.v1.Generation, grpc.health.v1, reflection)", h.router.addr);
    if let Some(a) = h.router.http_addr {
        println!("OpenAI-compatible HTTP API on http://{a}/v1");
    }
    if let Some(m) = h.router.metrics_addr {
        println!("metrics on http://{m}/metrics");
    }
}
