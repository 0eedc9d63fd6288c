//! TLS for both servers and for the router's link to its workers, with certificates
//! read from PEM files.
//!
//! A server with TLS accepts connections itself (rather than through tonic's acceptor)
//! so that a refused handshake — a client without a certificate the server trusts, or
//! one speaking plain HTTP/2 — is logged with the peer's address: a worker must say who
//! tried to act as its router. [`TlsIncoming`] yields the finished TLS streams to
//! tonic's `serve_with_incoming`; tonic's `TlsConnectInfo` carries the peer's address
//! and certificates to the services.
//!
//! Mutual TLS: a server given a client CA ([`ServerTls::client_ca`]) requires every
//! client to present a certificate that CA signed; a client given an identity
//! ([`ClientTls::identity`]) presents it.

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_stream::Stream;

/// A TLS setting that cannot be used, naming the file or flag.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{flag} {path}: {msg}")]
    File { flag: &'static str, path: PathBuf, msg: String },
    #[error("{0}")]
    Config(String),
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError::File { flag, path: path.to_path_buf(), msg: e.to_string() })
}

fn certs(flag: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(flag, path)?;
    let bad = |msg: String| TlsError::File { flag, path: path.to_path_buf(), msg };
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(bad("holds no PEM certificate".into()));
    }
    Ok(certs)
}

fn key(flag: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(flag, path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| TlsError::File {
        flag,
        path: path.to_path_buf(),
        msg: format!("holds no PEM private key: {e}"),
    })
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A server's TLS settings: its certificate chain and key, and optionally the CA its
/// clients' certificates must chain to (mutual TLS).
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

impl ServerTls {
    /// The settings from a server's flags: none when neither file is given, an error
    /// naming the missing flag when only one is. `flags` names the cert, key and
    /// client-CA flags in that order, for messages.
    pub fn from_flags(
        cert: Option<&Path>,
        key: Option<&Path>,
        client_ca: Option<&Path>,
        flags: [&str; 3],
    ) -> Result<Option<ServerTls>, TlsError> {
        match (cert, key) {
            (Some(c), Some(k)) => {
                Ok(Some(ServerTls { cert: c.into(), key: k.into(), client_ca: client_ca.map(Into::into) }))
            }
            (None, None) if client_ca.is_some() => {
                Err(TlsError::Config(format!("{} needs {} and {}", flags[2], flags[0], flags[1])))
            }
            (None, None) => Ok(None),
            (Some(_), None) => Err(TlsError::Config(format!("{} needs {}", flags[0], flags[1]))),
            (None, Some(_)) => Err(TlsError::Config(format!("{} needs {}", flags[1], flags[0]))),
        }
    }

    /// The server configuration the `--tls-cert`, `--tls-key` and `--tls-client-ca`
    /// flags describe (router and worker alike), files read and checked now; `None`
    /// without TLS.
    pub fn config_from_flags(
        cert: Option<&Path>,
        key: Option<&Path>,
        client_ca: Option<&Path>,
    ) -> Result<Option<Arc<ServerConfig>>, TlsError> {
        Self::from_flags(cert, key, client_ca, ["--tls-cert", "--tls-key", "--tls-client-ca"])?
            .map(|t| t.config())
            .transpose()
    }

    /// The rustls configuration (HTTP/2 only, as gRPC wants).
    pub fn config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let chain = certs("--tls-cert", &self.cert)?;
        let key = key("--tls-key", &self.key)?;
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let builder = match &self.client_ca {
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for c in certs("--tls-client-ca", ca)? {
                    roots.add(c).map_err(|e| TlsError::File {
                        flag: "--tls-client-ca",
                        path: ca.clone(),
                        msg: format!("not a usable CA certificate: {e}"),
                    })?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                    .build()
                    .map_err(|e| TlsError::Config(format!("--tls-client-ca {}: {e}", ca.display())))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(chain, key).map_err(|e| TlsError::File {
            flag: "--tls-key",
            path: self.key.clone(),
            msg: format!("does not match --tls-cert {}: {e}", self.cert.display()),
        })?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }
}

/// How long a client may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// TLS connections accepted on a listener (see the module docs).
#[derive(Debug)]
pub struct TlsIncoming {
    rx: mpsc::Receiver<Result<TlsStream<TcpStream>, std::io::Error>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TlsIncoming {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How a refused handshake is logged: a worker warns (a stranger tried to connect), a
/// public server only notes it (scanners and health checkers speaking plain TCP).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalLog {
    Warn,
    Debug,
}

impl TlsIncoming {
    /// Accepts on `listener`, handshaking each connection in its own task.
    pub fn new(listener: TcpListener, config: Arc<ServerConfig>, what: &'static str, log: RefusalLog) -> Self {
        let (tx, rx) = mpsc::channel(64);
        let acceptor = TlsAcceptor::from(config);
        let task = tokio::spawn(async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Per-connection errors (reset before accept, out of descriptors):
                        // keep accepting after a short pause.
                        tracing::debug!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(s)) => {
                            let _ = tx.send(Ok(s)).await;
                        }
                        Ok(Err(e)) => refused(log, what, peer, &e.to_string()),
                        Err(_) => refused(log, what, peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        TlsIncoming { rx, task }
    }
}

fn refused(log: RefusalLog, what: &str, peer: SocketAddr, why: &str) {
    match log {
        RefusalLog::Warn => tracing::warn!(%peer, error = why, "{what}: refused a connection (TLS handshake failed)"),
        RefusalLog::Debug => tracing::debug!(%peer, error = why, "{what}: refused a connection (TLS handshake failed)"),
    }
}

impl Stream for TlsIncoming {
    type Item = Result<TlsStream<TcpStream>, std::io::Error>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

/// The router's side of its link to workers: the CA that signed the workers'
/// certificates, the router's own certificate and key for mutual TLS, and the name the
/// workers' certificates carry when it is not the host of their address.
#[derive(Debug, Clone, Default)]
pub struct ClientTls {
    pub ca: Option<PathBuf>,
    pub identity: Option<(PathBuf, PathBuf)>,
    pub server_name: Option<String>,
}

impl ClientTls {
    /// tonic's client configuration, files read and checked now (an error names the
    /// flag and file). `flags` names the CA, cert and key flags, for messages.
    pub fn config(&self, flags: [&'static str; 3]) -> Result<tonic::transport::ClientTlsConfig, TlsError> {
        let mut c = tonic::transport::ClientTlsConfig::new();
        if let Some(ca) = &self.ca {
            certs(flags[0], ca)?;
            c = c.ca_certificate(tonic::transport::Certificate::from_pem(read(flags[0], ca)?));
        }
        if let Some((cert, key_path)) = &self.identity {
            certs(flags[1], cert)?;
            key(flags[2], key_path)?;
            c = c.identity(tonic::transport::Identity::from_pem(read(flags[1], cert)?, read(flags[2], key_path)?));
        }
        if let Some(name) = &self.server_name {
            c = c.domain_name(name.clone());
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_a_pair_names_the_missing_flag() {
        let f = ["--tls-cert", "--tls-key", "--tls-client-ca"];
        let p = Path::new("x.pem");
        assert!(ServerTls::from_flags(None, None, None, f).unwrap().is_none());
        let e = ServerTls::from_flags(Some(p), None, None, f).unwrap_err().to_string();
        assert_eq!(e, "--tls-cert needs --tls-key");
        let e = ServerTls::from_flags(None, None, Some(p), f).unwrap_err().to_string();
        assert_eq!(e, "--tls-client-ca needs --tls-cert and --tls-key");
    }

    #[test]
    fn bad_files_name_the_flag_and_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not pem").unwrap();
        let missing = dir.path().join("missing.pem");
        let e = ServerTls { cert: missing.clone(), key: junk.clone(), client_ca: None }.config().unwrap_err();
        assert!(e.to_string().starts_with(&format!("--tls-cert {}", missing.display())), "{e}");
        let e = ServerTls { cert: junk.clone(), key: junk.clone(), client_ca: None }.config().unwrap_err();
        assert!(e.to_string().contains("holds no PEM certificate"), "{e}");

        let ca = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let cert = dir.path().join("cert.pem");
        let key = dir.path().join("key.pem");
        std::fs::write(&cert, ca.cert.pem()).unwrap();
        std::fs::write(&key, ca.signing_key.serialize_pem()).unwrap();
        ServerTls { cert: cert.clone(), key: key.clone(), client_ca: None }.config().expect("a good pair");
        let other = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let other_key = dir.path().join("other.pem");
        std::fs::write(&other_key, other.signing_key.serialize_pem()).unwrap();
        let e = ServerTls { cert, key: other_key, client_ca: None }.config().unwrap_err().to_string();
        assert!(e.contains("does not match --tls-cert"), "{e}");
        let e = ClientTls { ca: Some(junk), ..Default::default() }
            .config(["--worker-tls-ca", "--worker-tls-cert", "--worker-tls-key"])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("--worker-tls-ca"), "{e}");
    }
}
