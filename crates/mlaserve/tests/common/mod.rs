//! Real `mlaserve` processes for the tests of this crate: started with flags, their
//! address read from the line they print, their log kept, stopped on drop.

#![allow(dead_code)]

use mlaserve_proto::v1::generation_client::GenerationClient;
use mlaserve_proto::v1::{generate_request::Prompt, GenerateRequest, StoppingCriteria, TokenIds};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tonic::transport::Channel;

/// The bundled model (the tests run from the crate's directory).
pub fn model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/mla-tiny-code")
}

/// A running `mlaserve` process.
#[derive(Debug)]
pub struct Proc {
    pub child: Child,
    /// Where it listens (from its "listening on" line).
    pub addr: String,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `mlaserve <args>` and waits (up to 60 s) for its "listening on" line;
    /// stderr goes to `log`.
    pub fn start(args: &[&str], log: PathBuf) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_mlaserve"))
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("mlaserve starts");
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some((_, addr)) = line.split_once(" listening on ") {
                    let _ = tx.send(addr.trim().to_string());
                }
            }
        });
        let addr = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| {
            let _ = child.kill();
            panic!("mlaserve {args:?} did not start:\n{}", std::fs::read_to_string(&log).unwrap_or_default())
        });
        Proc { child, addr, log }
    }

    /// The process's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let ok = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().expect("kill runs");
        assert!(ok.success());
    }

    /// Waits up to `timeout` for the process to exit; its exit status.
    pub fn wait(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let until = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < until {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A worker group on the CPU backend with `extra` flags.
pub fn worker(dir: &Path, name: &str, extra: &[&str]) -> Proc {
    let model = model();
    let mut args = vec!["worker", "--backend", "cpu", "--listen", "127.0.0.1:0", "--group", name];
    args.extend(["--model", model.to_str().unwrap(), "--kv-blocks", "64"]);
    args.extend(extra);
    Proc::start(&args, dir.join(format!("{name}.log")))
}

/// A router over `workers` with `extra` flags.
pub fn router(dir: &Path, name: &str, workers: &[&str], extra: &[&str]) -> Proc {
    let model = model();
    let mut args = vec!["router", "--listen", "127.0.0.1:0", "--model", model.to_str().unwrap()];
    for w in workers {
        args.extend(["--worker", w]);
    }
    args.extend(extra);
    Proc::start(&args, dir.join(format!("{name}.log")))
}

/// A plain-HTTP/2 client of the router at `addr`.
pub async fn client(addr: &str) -> GenerationClient<Channel> {
    GenerationClient::connect(format!("http://{addr}")).await.expect("connects")
}

/// A greedy request of `n` new tokens for `prompt` token ids.
pub fn request(prompt: Vec<u32>, n: u32) -> GenerateRequest {
    GenerateRequest {
        prompt: Some(Prompt::TokenIds(TokenIds { ids: prompt })),
        stopping: Some(StoppingCriteria { max_new_tokens: Some(n), ignore_eos: true, ..Default::default() }),
        ..Default::default()
    }
}

/// Waits (up to `timeout`) until the router at `addr` has a ready group: a request
/// succeeds (with `key` as its API key, if any).
pub async fn wait_serving(addr: &str, key: Option<&str>, timeout: Duration) -> bool {
    let until = tokio::time::Instant::now() + timeout;
    let mut c = client(addr).await;
    while tokio::time::Instant::now() < until {
        let mut r = tonic::Request::new(request(vec![5, 6, 7], 2));
        if let Some(k) = key {
            r.metadata_mut().insert("authorization", format!("Bearer {k}").parse().unwrap());
        }
        if let Ok(resp) = c.generate(r).await {
            let mut s = resp.into_inner();
            let mut ok = false;
            while let Some(m) = tokio_stream::StreamExt::next(&mut s).await {
                ok = m.is_ok_and(|m| m.finish.is_some()) || ok;
            }
            if ok {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}
