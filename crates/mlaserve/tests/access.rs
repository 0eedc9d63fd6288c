//! Who may connect, over real `mlaserve router` and `mlaserve worker` processes: API
//! keys on the public API, TLS on the public API, mutual TLS and the group secret
//! between router and workers. Certificates are made here, per test.

mod common;

use common::{client, request, router, wait_serving, worker};
use mlaserve_proto::v1::generation_client::GenerationClient;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};

/// A CA that writes its own certificate and the leaf certificates it signs as PEM files.
struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
    dir: PathBuf,
    name: &'static str,
}

impl Ca {
    fn new(dir: &Path, name: &'static str) -> Ca {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
        p.distinguished_name.push(DnType::CommonName, format!("mlaserve test CA {name}"));
        let issuer = CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap();
        let ca = Ca { issuer, dir: dir.to_path_buf(), name };
        std::fs::write(ca.cert_path(), ca.issuer.pem()).unwrap();
        ca
    }

    fn cert_path(&self) -> PathBuf {
        self.dir.join(format!("{}-ca.pem", self.name))
    }

    /// A leaf for `localhost`/127.0.0.1, usable as server and client; its (cert, key) files.
    fn leaf(&self, who: &str) -> (String, String) {
        let mut p = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
        p.distinguished_name.push(DnType::CommonName, who);
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        let c = self.dir.join(format!("{}-{who}.pem", self.name));
        let k = self.dir.join(format!("{}-{who}.key", self.name));
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c.display().to_string(), k.display().to_string())
    }
}

fn with_key<T>(msg: T, key: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut().insert("authorization", key.parse().unwrap());
    r
}

async fn generate_code(
    c: &mut GenerationClient<tonic::transport::Channel>,
    r: tonic::Request<mlaserve_proto::v1::GenerateRequest>,
) -> tonic::Code {
    match c.generate(r).await {
        Err(s) => s.code(),
        Ok(resp) => {
            let mut s = resp.into_inner();
            while let Some(m) = tokio_stream::StreamExt::next(&mut s).await {
                if let Err(e) = m {
                    return e.code();
                }
            }
            tonic::Code::Ok
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_the_public_api_but_not_health() {
    let dir = tempfile::tempdir().unwrap();
    let w = worker(dir.path(), "w", &[]);
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "# ops\nfile-key\n").unwrap();
    let r = router(
        dir.path(),
        "r",
        &[&w.addr],
        &["--api-key", "flag-key", "--api-key-file", keys.to_str().unwrap(), "--metrics-listen", "127.0.0.1:0"],
    );
    assert!(wait_serving(&r.addr, Some("flag-key"), Duration::from_secs(30)).await, "{}", r.log());
    let mut c = client(&r.addr).await;
    let unauth = tonic::Code::Unauthenticated;
    assert_eq!(generate_code(&mut c, tonic::Request::new(request(vec![5, 6], 3))).await, unauth);
    assert_eq!(generate_code(&mut c, with_key(request(vec![5, 6], 3), "Bearer wrong")).await, unauth);
    assert_eq!(generate_code(&mut c, with_key(request(vec![5, 6], 3), "flag-key")).await, unauth, "no scheme");
    let e = c.get_model_info(mlaserve_proto::v1::GetModelInfoRequest {}).await.unwrap_err();
    assert_eq!(e.code(), unauth);
    assert!(e.message().contains("Bearer"), "{}", e.message());
    for k in ["Bearer flag-key", "Bearer file-key", "bearer file-key"] {
        assert_eq!(generate_code(&mut c, with_key(request(vec![5, 6], 3), k)).await, tonic::Code::Ok, "{k}");
    }
    // Probes need no key.
    let ch = Endpoint::from_shared(format!("http://{}", r.addr)).unwrap().connect().await.unwrap();
    let h = HealthClient::new(ch).check(HealthCheckRequest { service: String::new() }).await.unwrap().into_inner();
    assert_eq!(h.status, 1, "SERVING");

    // The CLI client sends the key it is given.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mlaserve"))
        .args(["generate", "--addr", &r.addr, "--prompt-ids", "5,6", "--max-new-tokens", "2"])
        .env("MLASERVE_API_KEY", "file-key")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mlaserve"))
        .args(["generate", "--addr", &r.addr, "--prompt-ids", "5,6", "--api-key", "nope"])
        .env_remove("MLASERVE_API_KEY")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("Unauthenticated"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_public_api_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "public");
    let (cert, key) = ca.leaf("router");
    let w = worker(dir.path(), "w", &[]);
    let health_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let health_addr = format!("127.0.0.1:{health_port}");
    let r =
        router(dir.path(), "r", &[&w.addr], &["--tls-cert", &cert, "--tls-key", &key, "--health-listen", &health_addr]);
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(ca.cert_path()).unwrap()))
        .domain_name("localhost");
    let ch = Endpoint::from_shared(format!("https://{}", r.addr)).unwrap().tls_config(tls).unwrap();
    let mut served = false;
    for _ in 0..100 {
        if let Ok(ch) = ch.connect().await {
            let mut c = GenerationClient::new(ch);
            if generate_code(&mut c, tonic::Request::new(request(vec![5, 6], 3))).await == tonic::Code::Ok {
                served = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(served, "{}", r.log());
    // Probes that cannot speak TLS read health on the plain-text health port.
    let ch = Endpoint::from_shared(format!("http://{health_addr}")).unwrap().connect().await.unwrap();
    let h = HealthClient::new(ch).check(HealthCheckRequest { service: String::new() }).await.unwrap().into_inner();
    assert_eq!(h.status, 1, "SERVING");
    // Plain HTTP/2 on the TLS port gets nowhere.
    let plain = Endpoint::from_shared(format!("http://{}", r.addr)).unwrap().connect_timeout(Duration::from_secs(3));
    let plain_ok = match plain.connect().await {
        Err(_) => false,
        Ok(ch) => GenerationClient::new(ch).get_model_info(mlaserve_proto::v1::GetModelInfoRequest {}).await.is_ok(),
    };
    assert!(!plain_ok, "a plain-text client was served on the TLS port");
    // A client that does not trust the router's CA refuses it.
    let other = Ca::new(dir.path(), "other");
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(other.cert_path()).unwrap()))
        .domain_name("localhost");
    let ch = Endpoint::from_shared(format!("https://{}", r.addr)).unwrap().tls_config(tls).unwrap();
    assert!(ch.connect().await.is_err());

    // The CLI client over TLS.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mlaserve"))
        .args(["generate", "--addr", &format!("localhost:{}", r.addr.rsplit(':').next().unwrap())])
        .args(["--tls-ca", ca.cert_path().to_str().unwrap(), "--prompt-ids", "5,6", "--max-new-tokens", "2"])
        .env_remove("MLASERVE_API_KEY")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_take_only_routers_with_a_certificate_from_their_ca() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "cluster");
    let stranger_ca = Ca::new(dir.path(), "stranger");
    let (wc, wk) = ca.leaf("worker");
    let (rc, rk) = ca.leaf("router");
    let (sc, sk) = stranger_ca.leaf("router");
    let ca_pem = ca.cert_path().display().to_string();
    let w = worker(dir.path(), "w", &["--tls-cert", &wc, "--tls-key", &wk, "--tls-client-ca", &ca_pem]);

    // A router with the cluster CA's certificate gets a session and serves.
    let good = router(
        dir.path(),
        "good",
        &[&w.addr],
        &["--worker-tls-ca", &ca_pem, "--worker-tls-cert", &rc, "--worker-tls-key", &rk],
    );
    assert!(wait_serving(&good.addr, None, Duration::from_secs(30)).await, "{}\n{}", good.log(), w.log());

    // A router with a certificate from another CA, or with none, cannot open a session.
    let bad = router(
        dir.path(),
        "bad",
        &[&w.addr],
        &["--worker-tls-ca", &ca_pem, "--worker-tls-cert", &sc, "--worker-tls-key", &sk],
    );
    let anonymous = router(dir.path(), "anon", &[&w.addr], &["--worker-tls-ca", &ca_pem]);
    for r in [&bad, &anonymous] {
        assert!(!wait_serving(&r.addr, None, Duration::from_secs(4)).await, "{}", r.log());
        let e = client(&r.addr).await.generate(request(vec![5], 2)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        assert!(r.log().contains("refused this router"), "{}", r.log());
    }
    let log = w.log();
    assert!(log.matches("refused a connection (TLS handshake failed)").count() >= 2, "{log}");
    // The good router still serves.
    assert!(wait_serving(&good.addr, None, Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_take_only_routers_that_know_the_group_secret() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "s3cret-of-the-group\n").unwrap();
    let wrong = dir.path().join("wrong");
    std::fs::write(&wrong, "guess\n").unwrap();
    let w = worker(dir.path(), "w", &["--router-secret-file", secret.to_str().unwrap()]);
    let good = router(dir.path(), "good", &[&w.addr], &["--worker-secret-file", secret.to_str().unwrap()]);
    assert!(wait_serving(&good.addr, None, Duration::from_secs(30)).await, "{}\n{}", good.log(), w.log());
    let bad = router(dir.path(), "bad", &[&w.addr], &["--worker-secret-file", wrong.to_str().unwrap()]);
    let none = router(dir.path(), "none", &[&w.addr], &[]);
    for r in [&bad, &none] {
        assert!(!wait_serving(&r.addr, None, Duration::from_secs(4)).await, "{}", r.log());
        assert!(r.log().contains("refused this router"), "{}", r.log());
    }
    let log = w.log();
    assert!(log.matches("refused a call").count() >= 2, "{log}");
    // Health stays open to probes.
    let ch = Endpoint::from_shared(format!("http://{}", w.addr)).unwrap().connect().await.unwrap();
    let h = HealthClient::new(ch).check(HealthCheckRequest { service: String::new() }).await.unwrap().into_inner();
    assert_eq!(h.status, 1, "SERVING");
}

#[test]
fn bad_tls_and_key_files_stop_the_start_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "junk").unwrap();
    let model = common::model();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mlaserve"))
            .args(args)
            .env("RUST_LOG", "off")
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).trim().to_string()
    };
    let m = model.to_str().unwrap();
    let j = junk.to_str().unwrap();
    let e = run(&["router", "--model", m, "--listen", "127.0.0.1:0", "--tls-cert", j, "--tls-key", j]);
    assert!(e.contains("--tls-cert") && e.contains("junk.pem"), "{e}");
    let e = run(&["router", "--model", m, "--listen", "127.0.0.1:0", "--tls-cert", j]);
    assert!(e.contains("--tls-cert needs --tls-key"), "{e}");
    let e = run(&["router", "--model", m, "--listen", "127.0.0.1:0", "--api-key-file", "/nonexistent/keys"]);
    assert!(e.contains("--api-key-file /nonexistent/keys"), "{e}");
    let e = run(&[
        "worker",
        "--backend",
        "cpu",
        "--model",
        m,
        "--listen",
        "127.0.0.1:0",
        "--router-secret-file",
        "/nonexistent/s",
    ]);
    assert!(e.contains("--router-secret-file /nonexistent/s"), "{e}");
    let e = run(&["worker", "--backend", "cpu", "--model", m, "--listen", "127.0.0.1:0", "--tls-client-ca", j]);
    assert!(e.contains("--tls-client-ca needs --tls-cert and --tls-key"), "{e}");
}
