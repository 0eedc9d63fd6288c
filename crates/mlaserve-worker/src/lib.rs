//! mlaserve-worker: a worker group's leader as a gRPC server.
//!
//! [`service`] speaks `mlaserve.worker.v1` to routers over the engine's async handle;
//! [`start`] brings up the engine-backed server, health, and (with `--etcd`) the
//! group's registration under a lease, which happens only once the group is ready.
//! [`nccl_id`] hands a multi-process group's NCCL ids to its ranks through etcd. The
//! worker knows neither the router nor a particular backend: it serves whatever
//! [`EngineHandle`] it is given.

pub mod args;
pub mod load;
pub mod nccl_id;
pub mod service;

pub use args::{EngineArgs, SpeculationMode, WorkerAccess, WorkerArgs};

use mlaserve_cluster::auth::{Keys, OnRefusal, RequireBearer, HEALTH_PATH};
use mlaserve_cluster::tls::{RefusalLog, ServerTls, TlsIncoming};
use mlaserve_cluster::{keys, LeasedKey, Registration};
use mlaserve_engine::{EngineError, EngineHandle};
use mlaserve_proto::worker::{worker_server::WorkerServer, GroupInfo};
use service::{Lifecycle, Phase, WorkerService};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio_rustls::rustls::ServerConfig;
use tonic::transport::server::TcpIncoming;

/// Why a worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("model: {0}")]
    Model(#[from] mlaserve_core::Error),
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    #[error("cannot listen on {0}: {1}")]
    Bind(SocketAddr, std::io::Error),
    #[error("etcd registration: {0}")]
    Etcd(#[from] mlaserve_cluster::EtcdError),
    /// A TLS or secret setting (names the flag and file).
    #[error("{0}")]
    Access(String),
}

/// The group secret and TLS settings from the flags, files read and checked now.
fn access(a: &WorkerAccess) -> Result<(Keys, Option<Arc<ServerConfig>>), WorkerError> {
    let bad = |e: &dyn std::fmt::Display| WorkerError::Access(e.to_string());
    let keys = match (&a.router_secret, &a.router_secret_file) {
        (Some(s), _) => Keys::load(std::slice::from_ref(s), &[] as &[&std::path::Path], "--router-secret-file"),
        (None, Some(f)) => Keys::load(&[], std::slice::from_ref(f), "--router-secret-file"),
        (None, None) => Ok(Keys::default()),
    }
    .map_err(|e| bad(&e))?;
    let tls = ServerTls::config_from_flags(a.tls_cert.as_deref(), a.tls_key.as_deref(), a.tls_client_ca.as_deref())
        .map_err(|e| bad(&e))?;
    Ok((keys, tls))
}

/// A running group leader.
#[derive(Debug)]
pub struct WorkerHandle {
    /// Where the worker API listens.
    pub addr: SocketAddr,
    /// The group's name (its etcd key).
    pub group: String,
    pub engine: EngineHandle,
    registration: Option<LeasedKey>,
    life: Arc<Lifecycle>,
    health: tonic_health::server::HealthReporter,
    drain_timeout: Duration,
    shutdown_tx: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    stats: tokio::task::JoinHandle<()>,
}

/// Serves `engine` (already running the model in `args.model` on `tp_size` ranks);
/// registers in etcd when configured. Returns once the server listens and the group is
/// registered.
pub async fn start(args: WorkerArgs, engine: EngineHandle, tp_size: usize) -> Result<WorkerHandle, WorkerError> {
    let (keys, tls) = access(&args.access)?;
    let config = mlaserve_model::load_config(&args.model)?;
    let fingerprints = mlaserve_model::Fingerprints::of_dir(&args.model);
    let tokenizer_eos = mlaserve_model::Tokenizer::from_dir(&args.model, &config)
        .map(|t| t.eos_token_ids().to_vec())
        .unwrap_or_else(|_| config.eos_token_ids.clone());
    let listener = tokio::net::TcpListener::bind(args.listen).await.map_err(|e| WorkerError::Bind(args.listen, e))?;
    let addr = listener.local_addr().map_err(|e| WorkerError::Bind(args.listen, e))?;
    let group = args.group.clone().unwrap_or_else(|| format!("group-{}", addr.port()));
    let ei = engine.info();
    let info = GroupInfo {
        group: group.clone(),
        model_name: args.model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        vocab_size: config.vocab_size as u32,
        max_context_tokens: ei.max_model_len as u32,
        eos_token_ids: tokenizer_eos,
        speculative_tokens: ei.num_speculative_tokens as u32,
        tp_size: tp_size as u32,
        kv_blocks_total: ei.kv_blocks_total as u32,
        block_size: mlaserve_core::BLOCK_SIZE as u32,
        config_fingerprint: fingerprints.config,
        tokenizer_fingerprint: fingerprints.tokenizer,
        memory: ei.memory.map(|m| mlaserve_proto::worker::MemoryPlan {
            total_bytes: m.total_bytes,
            utilization: m.utilization,
            other_bytes: m.other_bytes,
            weights_bytes: m.weights_bytes,
            activation_bytes: m.activation_bytes,
            graph_bytes: m.graph_bytes,
            kv_bytes: m.kv_bytes,
            kv_blocks: m.kv_blocks,
            kv_block_bytes: m.kv_block_bytes,
            kv_tokens: m.kv_tokens,
        }),
    };
    if let Some(m) = &ei.memory {
        tracing::info!("memory plan: {m}");
    }
    if let Some(m) = args.metrics_listen {
        mlaserve_cluster::metrics::serve(m).await.map_err(|e| WorkerError::Bind(m, e))?;
    }
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<WorkerServer<WorkerService>>().await;
    if let Some(a) = args.access.health_listen {
        mlaserve_cluster::probe::serve_health(a, health.clone()).await.map_err(|e| WorkerError::Bind(a, e))?;
    }
    let life = Arc::new(Lifecycle::default());
    let svc = WorkerServer::new(WorkerService { engine: engine.clone(), info, life: life.clone() })
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20);
    let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
    let secured = (tls.is_some(), !keys.is_empty());
    let router = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(4096))
        .http2_keepalive_interval(Some(Duration::from_secs(2)))
        .http2_keepalive_timeout(Some(Duration::from_secs(4)))
        .layer(RequireBearer::new(keys, &[HEALTH_PATH], OnRefusal::Warn, "group secret"))
        .add_service(svc)
        .add_service(health);
    let stopped = async {
        let _ = shutdown_rx.await;
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let server = match tls {
        Some(tls) => {
            let incoming = TlsIncoming::new(listener, tls, "worker", RefusalLog::Warn);
            tokio::spawn(router.serve_with_incoming_shutdown(incoming, stopped))
        }
        None => tokio::spawn(
            router.serve_with_incoming_shutdown(TcpIncoming::from(listener).with_nodelay(Some(true)), stopped),
        ),
    };
    let stats = tokio::spawn(export_stats(engine.clone(), reporter.clone()));
    // Register only now: the engine runs and the server accepts connections.
    let registration = if args.etcd.is_empty() {
        None
    } else {
        let advertise = args.advertise.clone().unwrap_or_else(|| format!("{scheme}://{addr}"));
        let reg = Registration { addr: keys::normalize_addr(&advertise), tp_size: tp_size as u32 };
        let value = serde_json::to_vec(&reg).map_err(|e| mlaserve_cluster::EtcdError::Protocol(e.to_string()))?;
        let key = keys::group_key(&args.cluster, &group);
        let ttl = Duration::from_secs(args.lease_ttl_s);
        let leased = LeasedKey::put(&args.etcd, key, value, ttl).await?;
        tracing::info!(key = leased.key(), addr = %reg.addr, tp_size, "registered in etcd");
        Some(leased)
    };
    tracing::info!(%addr, group, tls = secured.0, router_secret = secured.1, "worker listening");
    Ok(WorkerHandle {
        addr,
        group,
        engine,
        registration,
        life,
        health: reporter,
        drain_timeout: Duration::from_secs(args.drain_timeout_s),
        shutdown_tx: Some(shutdown_tx),
        server,
        stats,
    })
}

impl WorkerHandle {
    /// Stops gracefully: tells every router session at once that the group is draining
    /// (routers stop picking it; new submissions are refused with UNAVAILABLE before any
    /// token, which routers retry elsewhere), turns health NOT_SERVING and deregisters,
    /// lets the requests it holds finish for up to `--drain-timeout-s`, then ends the
    /// sessions and stops the server and the engine (whatever still runs is aborted).
    pub async fn shutdown(mut self) {
        tracing::info!(
            requests = self.life.live(),
            drain_timeout_s = self.drain_timeout.as_secs(),
            "draining: no new requests; letting the running ones finish"
        );
        self.life.set(Phase::Draining);
        self.health.set_not_serving::<WorkerServer<WorkerService>>().await;
        self.health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
        if let Some(r) = self.registration.take() {
            r.stop().await;
        }
        let until = tokio::time::Instant::now() + self.drain_timeout;
        while self.life.live() > 0 && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if self.life.live() > 0 {
            tracing::warn!(requests = self.life.live(), "drain timeout: aborting the requests still running");
        }
        self.life.set(Phase::Stopped);
        if let Some(tx) = self.shutdown_tx.take() {
            let _ = tx.send(());
        }
        self.stats.abort();
        let _ = self.engine.shutdown().await;
        let _ = tokio::time::timeout(Duration::from_secs(5), &mut self.server).await;
        self.server.abort();
        tracing::info!("worker stopped");
    }
}

/// Publishes the engine's cumulative step counters once a second.
async fn export_stats(engine: EngineHandle, health: tonic_health::server::HealthReporter) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Ok(s) = engine.stats().await else { return };
        if let Some(why) = &s.failed {
            // The group lost a rank: report it unhealthy (routers and probes stop using it).
            tracing::error!(error = %why, "worker group failed; health NOT_SERVING");
            health.set_not_serving::<WorkerServer<WorkerService>>().await;
            health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
            return;
        }
        let t = s.times;
        metrics::counter!("mlaserve_engine_steps_total").absolute(t.steps);
        metrics::counter!("mlaserve_graph_captures_total").absolute(t.graph_captures);
        // Cumulative seconds as a gauge (metrics counters are integers):
        // rate(step_seconds) / rate(steps) is the mean step time.
        for (phase, us) in
            [("schedule", t.schedule_us), ("forward", t.forward_us), ("verify", t.verify_us), ("draft", t.draft_us)]
        {
            metrics::gauge!("mlaserve_engine_step_seconds_total", "phase" => phase).set(us as f64 / 1e6);
        }
        // Speculation: the k chosen per step (one counter per k), and the accepted drafts
        // the choices expected beside those verification accepted.
        let sp = &s.speculation;
        for (k, n) in sp.steps_per_k.iter().enumerate() {
            metrics::counter!("mlaserve_speculation_steps_total", "k" => k.to_string()).absolute(*n);
        }
        metrics::gauge!("mlaserve_speculation_expected_accepted_tokens_total").set(sp.expected_accepted);
        metrics::counter!("mlaserve_speculation_accepted_tokens_total").absolute(sp.realised_accepted);
        // What the adaptive choice weighs: each (row bucket, k)'s measured cycle time per
        // decode row, and the conditional acceptance rate of each draft position.
        for (rows, per_k) in &sp.costs {
            for (k, c) in per_k.iter().enumerate() {
                if let Some(us) = c {
                    let labels = [("rows", rows.to_string()), ("k", k.to_string())];
                    metrics::gauge!("mlaserve_speculation_cycle_us_per_row", &labels).set(*us);
                }
            }
        }
        // Where the choices fell: per (row bucket, k), the decisions that took k.
        for (rows, per_k) in &sp.decisions {
            for (k, n) in per_k.iter().enumerate() {
                let labels = [("rows", rows.to_string()), ("k", k.to_string())];
                metrics::counter!("mlaserve_speculation_steps_by_rows_total", &labels).absolute(*n);
            }
        }
        for (j, r) in sp.rates.iter().enumerate() {
            metrics::gauge!("mlaserve_speculation_acceptance_rate", "position" => (j + 1).to_string()).set(*r);
        }
        // Prefix cache: rate(hit) / rate(queried) is the hit rate over a window.
        let pc = &s.prefix;
        metrics::counter!("mlaserve_prefix_cache_queried_tokens_total").absolute(pc.queried_tokens);
        metrics::counter!("mlaserve_prefix_cache_hit_tokens_total").absolute(pc.hit_tokens);
        metrics::counter!("mlaserve_prefix_cache_evictions_total").absolute(pc.evictions);
        metrics::gauge!("mlaserve_prefix_cache_blocks").set(pc.cached_blocks as f64);
        let rate = if pc.queried_tokens == 0 { 0.0 } else { pc.hit_tokens as f64 / pc.queried_tokens as f64 };
        metrics::gauge!("mlaserve_prefix_cache_hit_rate").set(rate);
    }
}
