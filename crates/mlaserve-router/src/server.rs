//! Starting, draining and stopping a router: the gRPC server (Generation, health,
//! reflection), discovery, and the metrics endpoint.

use crate::args::RouterArgs;
use crate::discovery;
use crate::group::Link;
use crate::pool::Pool;
use crate::service::{GenerationService, RouterState};
use crate::validate::ModelLimits;
use mlaserve_cluster::auth::{Keys, OnRefusal, RequireBearer, HEALTH_PATH};
use mlaserve_cluster::tls::{ClientTls, RefusalLog, ServerTls, TlsIncoming};
use mlaserve_proto::v1::generation_server::GenerationServer;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{oneshot, watch};
use tokio_rustls::rustls::ServerConfig;
use tonic::transport::server::TcpIncoming;

/// Why a router could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("model: {0}")]
    Model(#[from] mlaserve_core::Error),
    #[error("cannot listen on {0}: {1}")]
    Bind(SocketAddr, std::io::Error),
    #[error("reflection: {0}")]
    Reflection(String),
    /// A TLS or key setting (names the flag and file).
    #[error("{0}")]
    Access(String),
    /// The HTTP API's setting or the model's chat template (names the flag or file).
    #[error("{0}")]
    Http(String),
}

/// The public API's keys and TLS, and the link to the workers, from the flags (files
/// read and checked now, so a bad one stops the start naming the flag).
fn access(args: &RouterArgs) -> Result<(Keys, Option<Arc<ServerConfig>>, Link), StartError> {
    let bad = |e: &dyn std::fmt::Display| StartError::Access(e.to_string());
    let a = &args.access;
    let keys = Keys::load(&a.api_keys, &a.api_key_files, "--api-key-file").map_err(|e| bad(&e))?;
    let tls = ServerTls::config_from_flags(a.tls_cert.as_deref(), a.tls_key.as_deref(), a.tls_client_ca.as_deref())
        .map_err(|e| bad(&e))?;
    let l = &args.link;
    let identity = match (&l.worker_tls_cert, &l.worker_tls_key) {
        (Some(c), Some(k)) => Some((c.clone(), k.clone())),
        (None, None) => None,
        (Some(_), None) => return Err(StartError::Access("--worker-tls-cert needs --worker-tls-key".into())),
        (None, Some(_)) => return Err(StartError::Access("--worker-tls-key needs --worker-tls-cert".into())),
    };
    let link_tls = if l.worker_tls_ca.is_some() || identity.is_some() {
        let c = ClientTls { ca: l.worker_tls_ca.clone(), identity, server_name: l.worker_tls_server_name.clone() };
        Some(c.config(["--worker-tls-ca", "--worker-tls-cert", "--worker-tls-key"]).map_err(|e| bad(&e))?)
    } else {
        None
    };
    let secret = match (&l.worker_secret, &l.worker_secret_file) {
        (Some(s), _) => Some(s.clone()),
        (None, Some(f)) => {
            let text = std::fs::read_to_string(f)
                .map_err(|e| StartError::Access(format!("--worker-secret-file {}: {e}", f.display())))?;
            Some(text.trim().to_string())
        }
        (None, None) => None,
    };
    let secret = secret
        .map(|s| {
            tonic::metadata::MetadataValue::try_from(format!("Bearer {s}"))
                .ok()
                .filter(|_| !s.is_empty() && !s.contains(char::is_whitespace))
                .ok_or_else(|| {
                    StartError::Access("--worker-secret-file: the secret must be one word of visible ASCII".into())
                })
        })
        .transpose()?;
    Ok((keys, tls, Link { tls: link_tls, secret }))
}

/// A running router.
#[derive(Debug)]
pub struct RouterHandle {
    /// Where the public API listens.
    pub addr: SocketAddr,
    /// Where the OpenAI-compatible HTTP API listens, when enabled.
    pub http_addr: Option<SocketAddr>,
    http: Option<(oneshot::Sender<()>, tokio::task::JoinHandle<()>)>,
    /// Where `/metrics` is served, when enabled.
    pub metrics_addr: Option<SocketAddr>,
    /// Where the plain-text health endpoint listens, when enabled.
    pub health_addr: Option<SocketAddr>,
    pub state: Arc<RouterState>,
    drain_tx: watch::Sender<bool>,
    health: tonic_health::server::HealthReporter,
    shutdown_tx: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    discovery: Option<tokio::task::JoinHandle<()>>,
}

/// Starts a router; returns once it listens.
pub async fn start(args: RouterArgs) -> Result<RouterHandle, StartError> {
    let (keys, tls, link) = access(&args)?;
    let config = mlaserve_model::load_config(&args.model)?;
    let tokenizer = mlaserve_model::Tokenizer::from_dir(&args.model, &config)?;
    let limits =
        ModelLimits { vocab_size: config.vocab_size as u32, max_context: config.max_position_embeddings as u32 };
    let model_name = args.model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    // The recorder first: whatever discovery publishes from here on is kept, and
    // `mlaserve_ready_groups` reads 0 (not absent) until a group is ready.
    mlaserve_cluster::metrics::handle();
    let fingerprints = mlaserve_model::Fingerprints::of_dir(&args.model);
    let pool = Pool::expecting(crate::pool::ModelIdentity {
        vocab_size: config.vocab_size as u32,
        eos_token_ids: tokenizer.eos_token_ids().to_vec(),
        config_fingerprint: fingerprints.config,
        tokenizer_fingerprint: fingerprints.tokenizer,
    })
    .with_link(link)
    .with_balancer(crate::balance::balancer(args.routing_policy, args.affinity_slack_tokens));
    crate::metrics::ready_groups(pool.ready_count());
    let state = Arc::new(RouterState::new(tokenizer, model_name, limits, pool.clone(), args.queue_size));

    let discovery = if args.etcd.is_empty() {
        discovery::add_static(&pool, &args.workers);
        None
    } else {
        discovery::add_static(&pool, &args.workers);
        Some(tokio::spawn(discovery::watch_etcd(pool.clone(), args.etcd.clone(), args.cluster.clone())))
    };

    let metrics_addr = match args.metrics_listen {
        Some(a) => Some(mlaserve_cluster::metrics::serve(a).await.map_err(|e| StartError::Bind(a, e))?),
        None => None,
    };

    let (reporter, health) = tonic_health::server::health_reporter();
    let (drain_tx, drain_rx) = watch::channel(false);
    tokio::spawn(crate::health::follow(reporter.clone(), pool.clone(), drain_rx));
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(mlaserve_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .with_service_name("mlaserve.v1.Generation")
        .with_service_name("grpc.health.v1.Health")
        .build_v1()
        .map_err(|e| StartError::Reflection(e.to_string()))?;
    let reflection_alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(mlaserve_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .with_service_name("mlaserve.v1.Generation")
        .with_service_name("grpc.health.v1.Health")
        .build_v1alpha()
        .map_err(|e| StartError::Reflection(e.to_string()))?;

    let health_addr = match args.access.health_listen {
        Some(a) => {
            Some(mlaserve_cluster::probe::serve_health(a, health.clone()).await.map_err(|e| StartError::Bind(a, e))?)
        }
        None => None,
    };
    let generation = GenerationServer::new(GenerationService { state: state.clone() })
        .max_decoding_message_size(args.max_message_bytes);
    let listener = tokio::net::TcpListener::bind(args.listen).await.map_err(|e| StartError::Bind(args.listen, e))?;
    let addr = listener.local_addr().map_err(|e| StartError::Bind(args.listen, e))?;
    let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
    let secured = tls.is_some();
    let router = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(65_536))
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .layer(crate::limit::ClientFaultCodes)
        .layer(RequireBearer::new(keys.clone(), &[HEALTH_PATH], OnRefusal::Count, "API key"))
        .add_service(generation)
        .add_service(health)
        .add_service(reflection)
        .add_service(reflection_alpha);
    let stopped = async {
        let _ = shutdown_rx.await;
    };
    let server = match tls {
        Some(tls) => {
            let incoming = TlsIncoming::new(listener, tls, "router", RefusalLog::Debug);
            tokio::spawn(router.serve_with_incoming_shutdown(incoming, stopped))
        }
        None => {
            let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
            tokio::spawn(router.serve_with_incoming_shutdown(incoming, stopped))
        }
    };
    tracing::info!(%addr, tls = secured, api_keys = !keys.is_empty(), "router listening");
    let (http_addr, http) = match args.http_listen {
        None => (None, None),
        Some(_) if secured => {
            return Err(StartError::Http(
                "--http-listen serves plain HTTP and cannot serve TLS yet; leave it unset with --tls-cert, or put \
                 the HTTP API behind a TLS-terminating proxy"
                    .into(),
            ))
        }
        Some(a) => {
            let template = crate::http::chat::ChatTemplate::load(&args.model).map_err(StartError::Http)?;
            let svc = GenerationService { state: state.clone() };
            let st = Arc::new(crate::http::HttpState::new(svc, template, keys, args.max_message_bytes));
            let listener = tokio::net::TcpListener::bind(a).await.map_err(|e| StartError::Bind(a, e))?;
            let bound = listener.local_addr().map_err(|e| StartError::Bind(a, e))?;
            let (tx, rx) = oneshot::channel::<()>();
            let app = crate::http::router(st);
            let task = tokio::spawn(async move {
                let stopped = async {
                    let _ = rx.await;
                };
                if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(stopped).await {
                    tracing::error!(error = %e, "HTTP API stopped");
                }
            });
            tracing::info!(addr = %bound, "OpenAI-compatible HTTP API listening");
            (Some(bound), Some((tx, task)))
        }
    };
    Ok(RouterHandle {
        http_addr,
        http,
        addr,
        metrics_addr,
        health_addr,
        state,
        drain_tx,
        health: reporter,
        shutdown_tx: Some(shutdown_tx),
        server,
        discovery,
    })
}

impl RouterHandle {
    pub fn pool(&self) -> &Pool {
        &self.state.pool
    }

    /// Stops taking requests (health turns NOT_SERVING, new requests get UNAVAILABLE)
    /// and waits up to `timeout` for the in-flight ones to finish.
    pub async fn drain(&self, timeout: Duration) {
        self.state.draining.store(true, Ordering::Release);
        let _ = self.drain_tx.send(true);
        // Also set it here, so health reads NOT_SERVING as soon as drain() is called.
        crate::health::set(&self.health, false).await;
        let until = tokio::time::Instant::now() + timeout;
        while self.state.admission.in_flight() > 0 && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the server (in-flight streams are cut) and discovery.
    pub async fn shutdown(mut self) {
        if let Some(d) = self.discovery.take() {
            d.abort();
        }
        let why =
            "the router is stopping and its drain timeout (--drain-timeout-s) passed before this request finished";
        for name in self.state.pool.names() {
            self.state.pool.remove_because(&name, why);
        }
        if let Some(tx) = self.shutdown_tx.take() {
            let _ = tx.send(());
        }
        if let Some((tx, mut task)) = self.http.take() {
            let _ = tx.send(());
            let _ = tokio::time::timeout(Duration::from_secs(5), &mut task).await;
            task.abort();
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), &mut self.server).await;
        self.server.abort();
    }
}

/// `mlaserve router`: starts, prints where it listens, serves until SIGTERM or Ctrl-C,
/// then drains and stops.
pub async fn run(args: RouterArgs) -> Result<(), StartError> {
    let drain = Duration::from_secs(args.drain_timeout_s);
    let h = start(args).await?;
    println!("mlaserve router listening on {}", h.addr);
    if let Some(a) = h.http_addr {
        println!("OpenAI-compatible HTTP API on http://{a}/v1");
    }
    if let Some(m) = h.metrics_addr {
        println!("metrics on http://{m}/metrics");
    }
    mlaserve_cluster::shutdown_signal().await;
    tracing::info!("draining");
    h.drain(drain).await;
    h.shutdown().await;
    Ok(())
}
