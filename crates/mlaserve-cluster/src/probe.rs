//! A plain-text gRPC health endpoint beside a TLS server: Kubernetes' gRPC probes (and
//! many load balancers' health checks) cannot speak TLS, so a server whose API is on
//! TLS also serves `grpc.health.v1` alone, without TLS, on `--health-listen`.

use std::net::SocketAddr;
use tonic::transport::server::TcpIncoming;
use tonic_health::pb::health_server::{Health, HealthServer};

/// Serves `health` (the same service the API port serves, so both report alike) on
/// `addr` until the process ends; returns where it listens.
pub async fn serve_health<H: Health>(addr: SocketAddr, health: HealthServer<H>) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    tokio::spawn(async move {
        if let Err(e) = tonic::transport::Server::builder().add_service(health).serve_with_incoming(incoming).await {
            tracing::error!(error = %e, "health endpoint stopped");
        }
    });
    tracing::info!(addr = %local, "plain-text gRPC health endpoint");
    Ok(local)
}
