//! Helpers shared by the deployment tests: repository paths, the chart's values as
//! dotted paths, the `mlaserve` binary, a real etcd on loopback, and processes run
//! with a Kubernetes container's command line and environment. The chart's files are
//! in [`chart`], Helm and the Kubernetes schema validator in [`k8s`], the Dockerfile's
//! stages and build arguments in [`dockerfile`].

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod chart;
pub mod dockerfile;
pub mod k8s;

use serde_yaml_ng::Value;
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The workspace root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repo root")
}

/// `helm/mlaserve`.
pub fn chart_dir() -> PathBuf {
    repo_root().join("helm/mlaserve")
}

/// Every `.Values.a.b` path (as `a.b`) that the chart's templates use.
pub fn used_value_paths(chart: &chart::Chart) -> BTreeSet<String> {
    let mut used = BTreeSet::new();
    for (_, src) in &chart.templates {
        let mut rest = src.as_str();
        while let Some(i) = rest.find(".Values.") {
            rest = &rest[i + ".Values.".len()..];
            let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.')).unwrap_or(rest.len());
            used.insert(rest[..end].trim_end_matches('.').to_string());
            rest = &rest[end..];
        }
    }
    used
}

/// The chart's values as dotted paths: a mapping the templates use as a whole (e.g.
/// through `toYaml`) counts as one value; other mappings are walked into.
pub fn value_paths(values: &Value, used: &BTreeSet<String>) -> Vec<String> {
    fn walk(v: &Value, prefix: &str, used: &BTreeSet<String>, out: &mut Vec<String>) {
        match v {
            Value::Mapping(m) if !m.is_empty() && !used.contains(prefix) => {
                for (k, child) in m {
                    let k = k.as_str().expect("string keys in values.yaml");
                    let p = if prefix.is_empty() { k.to_string() } else { format!("{prefix}.{k}") };
                    walk(child, &p, used, out);
                }
            }
            _ => out.push(prefix.to_string()),
        }
    }
    let mut out = Vec::new();
    walk(values, "", used, &mut out);
    out
}

/// Looks up a dotted path.
pub fn lookup<'a>(values: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(values, |v, k| v.get(k))
}

/// A free loopback TCP port (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The `mlaserve` binary: `$MLASERVE_BIN` when set, else built (or found up to date)
/// by `cargo build -p mlaserve --bin mlaserve` in this workspace's target directory —
/// a no-op when `cargo test --workspace` already built it with the same settings.
pub fn mlaserve_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("MLASERVE_BIN") {
            return PathBuf::from(p);
        }
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(repo_root()).args(["build", "-p", "mlaserve", "--bin", "mlaserve", "--message-format=json"]);
        // The same profile as this test binary: .../target/<profile>/deps/<test>.
        let exe = std::env::current_exe().unwrap();
        if exe.parent().and_then(|d| d.parent()).and_then(|d| d.file_name()).is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let out = cmd.stderr(Stdio::inherit()).output().expect("run cargo build -p mlaserve");
        assert!(out.status.success(), "cargo build -p mlaserve failed");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "mlaserve")
            .find_map(|m| m["executable"].as_str().map(PathBuf::from))
            .expect("cargo reported no mlaserve executable")
    })
}

/// A directory holding `mlaserve` (a link to [`mlaserve_bin`]), to put first on PATH
/// so that a container's `mlaserve ...` command line runs as written.
pub fn bin_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(mlaserve_bin(), d.path().join("mlaserve")).unwrap();
        d
    })
    .path()
}

/// Sends a plain HTTP/1.0 GET and returns the status line and body.
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// A real etcd (Debian's `etcd-server`) on free loopback ports in a temporary data
/// directory; killed on drop. Panics — never skips — when etcd is not installed.
#[derive(Debug)]
pub struct Etcd {
    child: Child,
    /// `127.0.0.1:<client port>`.
    pub endpoint: String,
    _dir: tempfile::TempDir,
}

impl Etcd {
    pub fn start() -> Etcd {
        let bin = std::env::var("MLASERVE_ETCD_BIN").unwrap_or_else(|_| {
            if Path::new("/usr/bin/etcd").exists() {
                "/usr/bin/etcd".into()
            } else {
                "etcd".into()
            }
        });
        let dir = tempfile::tempdir().unwrap();
        let (client, peer) = (free_port(), free_port());
        let child = Command::new(&bin)
            .args(["--name", "deploy-test", "--data-dir"])
            .arg(dir.path())
            .arg(format!("--listen-client-urls=http://127.0.0.1:{client}"))
            .arg(format!("--advertise-client-urls=http://127.0.0.1:{client}"))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
            .arg(format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"))
            .arg(format!("--initial-cluster=deploy-test=http://127.0.0.1:{peer}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run `{bin}` ({e}): install Debian's etcd-server package"));
        let mut etcd = Etcd { child, endpoint: format!("127.0.0.1:{client}"), _dir: dir };
        let addr: SocketAddr = etcd.endpoint.parse().unwrap();
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if http_get(addr, "/health").is_ok_and(|r| r.contains("\"health\":\"true\"")) {
                return etcd;
            }
            if let Ok(Some(status)) = etcd.child.try_wait() {
                panic!("etcd exited at start: {status}");
            }
            assert!(Instant::now() < until, "etcd did not become healthy on {}", etcd.endpoint);
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A process started from a container spec; its log goes to a file. Dropping it sends
/// SIGKILL to its process group (the test's own children only).
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `argv` with exactly `env` (plus PATH with [`bin_dir`] first), in a new
    /// process group, logging to `log`.
    pub fn spawn(name: &str, argv: &[String], env: &[(String, String)], log: PathBuf) -> Proc {
        let path = format!("{}:/usr/local/bin:/usr/bin:/bin", bin_dir().display());
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(&argv[0])
            .args(&argv[1..])
            .env_clear()
            .env("PATH", path)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({argv:?}): {e}"));
        Proc { name: name.into(), child, log }
    }

    /// The log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `signal` (e.g. `libc::SIGTERM`) to this process only.
    pub fn signal(&self, signal: i32) {
        let pid = self.pid();
        // SAFETY: kill(2) on our own child, whose pid is > 1 (checked in `pid`).
        unsafe { libc::kill(pid, signal) };
    }

    /// The child's pid (also its process group id), never 0 or 1: a stray kill(0/-1)
    /// would hit far more than this test's processes.
    fn pid(&self) -> i32 {
        let pid = i32::try_from(self.child.id()).expect("pid fits i32");
        assert!(pid > 1, "implausible child pid {pid}");
        pid
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let until = Instant::now() + timeout;
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Panics with the log when the process has exited.
    pub fn assert_running(&mut self) {
        if let Ok(Some(s)) = self.child.try_wait() {
            panic!("{} exited ({s}); its log:\n{}", self.name, self.log());
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // The whole group (a worker launcher's ranks too): the child was started
            // with process_group(0), so its pgid is its pid.
            let pgid = self.pid();
            // SAFETY: kill(2) on the process group of our own child; pgid > 1.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
            let _ = self.child.wait();
        }
    }
}
