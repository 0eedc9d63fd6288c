//! Helpers shared by the serving test binaries: the tiny test model, servers on
//! loopback (each in a runtime of its own, so a test can kill one abruptly), clients,
//! and stream collection.

#![allow(dead_code, clippy::unwrap_used)]

use mlaserve::serve::{ServeArgs, ServeHandle};
use mlaserve_engine::EngineHandle;
use mlaserve_proto::v1::{
    generate_request::Prompt, generation_client::GenerationClient, Finish, GenerateRequest, GenerateResponse,
    SamplingParams, StoppingCriteria, TokenIds,
};
use mlaserve_worker::{WorkerArgs, WorkerHandle};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

/// The tiny random-weight DeepSeek-V3 checkpoint (`gen-model tiny-v3`), written once
/// per test binary.
pub fn model_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        mlaserve_model::presets::generate("tiny-v3", d.path()).unwrap();
        d
    })
    .path()
}

pub fn model_path() -> PathBuf {
    model_dir().to_path_buf()
}

/// A server (router + one CPU group) on its own runtime thread; it lives until
/// dropped or [`Background::kill`]ed.
pub struct Background<H> {
    pub handle: Option<H>,
    rt: Option<tokio::runtime::Runtime>,
}

impl<H: Send + 'static> Background<H> {
    /// Runs `start` on a fresh 2-thread runtime (built on a thread of its own, so this
    /// works from inside a test's runtime) and keeps that runtime for the server.
    pub fn start<F, Fut>(start: F) -> Self
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = H>,
    {
        let (rt, handle) = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            let handle = rt.block_on(start());
            (rt, handle)
        })
        .join()
        .expect("server start panicked");
        Background { handle: Some(handle), rt: Some(rt) }
    }

    pub fn get(&self) -> &H {
        self.handle.as_ref().unwrap()
    }

    /// Stops the runtime at once: every task and connection of the server dies, as if
    /// the process had been killed (an etcd lease is then left to expire).
    pub fn kill(&mut self) {
        if let Some(rt) = self.rt.take() {
            let h = self.handle.take();
            rt.shutdown_background();
            // The engine thread notices its handles are gone and stops by itself.
            drop(h);
        }
    }
}

impl<H> Drop for Background<H> {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            let h = self.handle.take();
            rt.shutdown_background();
            drop(h);
        }
    }
}

/// `serve` (router + one CPU group) on loopback with `customize`d settings.
pub fn serve(customize: impl FnOnce(&mut ServeArgs)) -> Background<ServeHandle> {
    let mut args = ServeArgs::new(model_path());
    args.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    args.engine.kv_blocks = Some(256);
    customize(&mut args);
    Background::start(move || async move {
        let engine = cpu_engine(&args.worker_args()).await;
        let h = mlaserve::serve::start_with_engine(&args, engine).await.unwrap();
        assert!(h.wait_ready(Duration::from_secs(10)).await, "the group never became ready");
        h
    })
}

/// The engine of a worker group on the CPU reference backend.
pub async fn cpu_engine(args: &WorkerArgs) -> EngineHandle {
    let (dir, blocks) = (args.model.clone(), args.engine.kv_blocks_or_default());
    EngineHandle::spawn(move || mlaserve_cpu::CpuBackend::load(&dir, blocks), args.engine.engine_config())
        .await
        .unwrap()
}

/// A single-rank worker group on the CPU backend.
pub async fn start_cpu_worker(args: WorkerArgs) -> WorkerHandle {
    let engine = cpu_engine(&args).await;
    mlaserve_worker::start(args, engine, 1).await.unwrap()
}

/// A single-rank CPU worker group registered in etcd under `cluster` as `group`, with a
/// lease of `lease_ttl_s`.
pub fn etcd_worker(etcd: &str, cluster: &str, group: &str, lease_ttl_s: u64) -> Background<WorkerHandle> {
    let mut a = WorkerArgs::new(model_path());
    a.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    a.etcd = vec![etcd.to_string()];
    a.cluster = cluster.into();
    a.group = Some(group.into());
    a.lease_ttl_s = lease_ttl_s;
    a.engine.kv_blocks = Some(256);
    Background::start(move || async move { start_cpu_worker(a).await })
}

/// A router discovering the groups of `cluster` in etcd.
pub fn etcd_router(etcd: &str, cluster: &str) -> Background<mlaserve_router::RouterHandle> {
    let mut a = mlaserve_router::RouterArgs::new(model_path());
    a.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    a.etcd = vec![etcd.to_string()];
    a.cluster = cluster.into();
    Background::start(move || async move { mlaserve_router::start(a).await.unwrap() })
}

pub async fn client(addr: SocketAddr) -> GenerationClient<Channel> {
    GenerationClient::connect(format!("http://{addr}")).await.unwrap().max_decoding_message_size(64 << 20)
}

pub fn text_request(prompt: &str, max_new_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        prompt: Some(Prompt::Text(prompt.into())),
        stopping: Some(StoppingCriteria { max_new_tokens: Some(max_new_tokens), ..Default::default() }),
        ..Default::default()
    }
}

pub fn ids_request(ids: Vec<u32>, max_new_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        prompt: Some(Prompt::TokenIds(TokenIds { ids })),
        stopping: Some(StoppingCriteria {
            max_new_tokens: Some(max_new_tokens),
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub fn with_sampling(mut r: GenerateRequest, s: SamplingParams) -> GenerateRequest {
    r.sampling = Some(s);
    r
}

/// Everything a stream delivered.
#[derive(Debug, Default)]
pub struct Collected {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: Option<Finish>,
    pub finals: usize,
    pub messages: Vec<GenerateResponse>,
    pub error: Option<tonic::Status>,
}

pub async fn collect(client: &mut GenerationClient<Channel>, req: GenerateRequest) -> Collected {
    let mut c = Collected::default();
    let mut stream = match client.generate(req).await {
        Ok(r) => r.into_inner(),
        Err(e) => {
            c.error = Some(e);
            return c;
        }
    };
    while let Some(m) = stream.next().await {
        match m {
            Ok(m) => {
                c.tokens.extend_from_slice(&m.token_ids);
                c.text += &m.text;
                if m.finish.is_some() {
                    c.finals += 1;
                    c.finish = m.finish.clone();
                }
                c.messages.push(m);
            }
            Err(e) => {
                c.error = Some(e);
                break;
            }
        }
    }
    c
}

/// Asserts a normal request still completes (the server survived what came before).
pub async fn assert_still_serves(client: &mut GenerationClient<Channel>) {
    let c = collect(client, text_request("still there?", 4)).await;
    assert!(c.error.is_none(), "server no longer serves: {:?}", c.error);
    assert_eq!(c.finals, 1);
    assert!(!c.tokens.is_empty());
}

/// Asserts `req` fails with `code` and a message naming `field`.
pub async fn assert_refused(
    client: &mut GenerationClient<Channel>,
    req: GenerateRequest,
    code: tonic::Code,
    field: &str,
) {
    let c = collect(client, req).await;
    let e = c
        .error
        .unwrap_or_else(|| panic!("expected {code:?} naming `{field}`, got a stream of {} tokens", c.tokens.len()));
    assert_eq!(e.code(), code, "{}", e.message());
    assert!(e.message().contains(field), "message `{}` does not name `{field}`", e.message());
    assert!(c.messages.is_empty(), "no message may precede the error");
}

/// Greedy output of the engine run directly (no server), the oracle of the e2e test.
pub fn engine_greedy(prompt: &[u32], sampling: mlaserve_engine::SamplingParams, kv_blocks: usize) -> Vec<u32> {
    let backend = mlaserve_cpu::CpuBackend::load(model_dir(), kv_blocks).unwrap();
    let mut engine = mlaserve_engine::Engine::new(backend, mlaserve_engine::EngineConfig::default()).unwrap();
    let id = engine.add_request(mlaserve_engine::Request::new(prompt.to_vec(), sampling)).unwrap();
    let mut out = Vec::new();
    for _ in 0..10_000 {
        for (rid, ev) in engine.step() {
            assert_eq!(rid, id);
            match ev {
                mlaserve_engine::Event::Tokens(t) => out.extend(t),
                mlaserve_engine::Event::Finished { .. } => return out,
                mlaserve_engine::Event::Logprobs(_) => {}
            }
        }
    }
    panic!("the engine did not finish");
}

/// How long a test waits for worker groups to become ready behind a router: a bound on
/// liveness, not a latency claim (the wait ends as soon as they are). With every test
/// binary running at once on CI's two cores, two CPU groups once took over 10 s.
pub const READY: Duration = Duration::from_secs(60);

/// Polls `cond` every 20 ms for up to `timeout`.
pub async fn eventually(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let until = tokio::time::Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if tokio::time::Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A real etcd server (Debian's `etcd-server` package) on free loopback ports, in a
/// temporary data directory; killed on drop. Panics — never skips — when `etcd` is not
/// installed: the etcd tests are part of the acceptance suite.
pub struct EtcdServer {
    child: std::process::Child,
    pub endpoint: String,
    _dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl EtcdServer {
    pub fn start() -> EtcdServer {
        let bin = std::env::var("MLASERVE_ETCD_BIN").unwrap_or_else(|_| "etcd".into());
        let dir = tempfile::tempdir().unwrap();
        let (client, peer) = (free_port(), free_port());
        let child = std::process::Command::new(&bin)
            .args(["--name", "test", "--data-dir"])
            .arg(dir.path())
            .args([
                "--listen-client-urls",
                &format!("http://127.0.0.1:{client}"),
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{client}"),
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{peer}"),
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{peer}"),
                "--initial-cluster",
                &format!("test=http://127.0.0.1:{peer}"),
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run `{bin}` ({e}): install Debian's etcd-server package (apt-get install etcd-server)")
            });
        let endpoint = format!("127.0.0.1:{client}");
        let mut s = EtcdServer { child, endpoint, _dir: dir };
        // Ready when a range request succeeds.
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let ep = s.endpoint.clone();
        let ok = std::thread::spawn(move || {
            rt.block_on(async {
                for _ in 0..200 {
                    if let Ok(e) = mlaserve_cluster::Etcd::connect(std::slice::from_ref(&ep)).await {
                        if e.list(b"/").await.is_ok() {
                            return true;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                false
            })
        })
        .join()
        .unwrap();
        if !ok {
            let _ = s.child.kill();
            panic!("etcd did not come up on {}", s.endpoint);
        }
        s
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
