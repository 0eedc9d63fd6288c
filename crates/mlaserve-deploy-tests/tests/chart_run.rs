//! The chart drives the real binary: the router Deployment's and the worker
//! StatefulSet's containers are rendered from `helm/mlaserve/templates/`, and their
//! command lines and environments run as they are — the worker through the chart's own
//! rank launcher — with only what Kubernetes would supply emulated (`$(VAR)` expansion,
//! the downward-API env) and the listen addresses moved to loopback. A real etcd stands
//! in for the in-chart one, the model is the `tiny-v3` test checkpoint, and a gRPC
//! request through the router must succeed. Then both get SIGTERM and must stop
//! cleanly, as in a rolling update. The manifests are rendered by Helm's own engine
//! (`common::k8s`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::chart::{set_value, Chart};
use common::dockerfile::{exec_form, Dockerfile};
use common::k8s::Tools;
use common::*;
use mlaserve_proto::v1::{
    generate_request::Prompt, generation_client::GenerationClient, GenerateRequest, StoppingCriteria,
};
use serde_yaml_ng::Value;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;
use tonic_health::pb::{health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest};

const RELEASE: &str = "deploytest";

/// The container `name` of the `kind` object `object` in the rendered manifests.
fn container<'a>(docs: &'a [Value], kind: &str, object: &str, name: &str) -> &'a Value {
    let obj = docs
        .iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == object)
        .unwrap_or_else(|| panic!("the chart renders no {kind} {object}"));
    obj["spec"]["template"]["spec"]["containers"]
        .as_sequence()
        .expect("containers")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("{kind} {object} has no container {name}"))
}

/// What Kubernetes supplies through the downward API, here on loopback.
fn field_ref(path: &str, pod: &str) -> String {
    match path {
        "metadata.name" => pod.to_string(),
        "status.podIP" => "127.0.0.1".to_string(),
        "metadata.namespace" => "default".to_string(),
        other => panic!("the test does not emulate fieldRef {other}"),
    }
}

/// Kubernetes' `$(VAR)` expansion in command and args (`$$` escapes a `$`).
fn expand(s: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out += &rest[..i];
        let tail = &rest[i..];
        if let Some(t) = tail.strip_prefix("$$") {
            out.push('$');
            rest = t;
        } else if let Some(name) = tail.strip_prefix("$(").and_then(|t| t.split_once(')')).map(|(n, _)| n) {
            match env.get(name) {
                Some(v) => out += v,
                None => out += &tail[..name.len() + 3],
            }
            rest = &tail[name.len() + 3..];
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out + rest
}

/// The argv and environment Kubernetes would give `c` in pod `pod`, with wildcard
/// listen addresses moved to loopback.
fn process_of(c: &Value, pod: &str) -> (Vec<String>, Vec<(String, String)>) {
    let mut env = BTreeMap::new();
    let mut ordered = Vec::new();
    for e in c["env"].as_sequence().map(Vec::as_slice).unwrap_or_default() {
        let name = e["name"].as_str().expect("env name").to_string();
        let value = match (&e["value"], &e["valueFrom"]["fieldRef"]["fieldPath"]) {
            (Value::String(v), _) => expand(v, &env),
            (_, Value::String(p)) => field_ref(p, pod),
            other => panic!("env {name}: unsupported source {other:?} (values must be strings)"),
        };
        env.insert(name.clone(), value.clone());
        ordered.push((name, value));
    }
    let strings = |key: &str| -> Vec<String> {
        c[key]
            .as_sequence()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .map(|a| a.as_str().unwrap_or_else(|| panic!("{key} entries must render as strings: {a:?}")).to_string())
            .collect()
    };
    let mut argv = strings("command");
    assert!(!argv.is_empty(), "the chart must set `command` (the test does not assume the image's entrypoint)");
    argv.extend(strings("args"));
    let argv = argv.iter().map(|a| expand(a, &env).replace("0.0.0.0:", "127.0.0.1:")).collect();
    (argv, ordered)
}

fn flag<'a>(argv: &'a [String], name: &str) -> &'a str {
    let i = argv.iter().position(|a| a == name).unwrap_or_else(|| panic!("no {name} in {argv:?}"));
    &argv[i + 1]
}

async fn serving(addr: SocketAddr) -> Option<i32> {
    let ch = tonic::transport::Channel::from_shared(format!("http://{addr}")).ok()?.connect().await.ok()?;
    let r = HealthClient::new(ch).check(HealthCheckRequest { service: String::new() }).await.ok()?;
    Some(r.into_inner().status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_and_worker_run_as_the_chart_says() {
    let Some(helm) = Tools::find() else { return };
    let bin = mlaserve_bin(); // built before anything starts, so its time is not a timeout
    assert!(bin.exists(), "{} missing", bin.display());
    let etcd = Etcd::start();
    let model = tempfile::tempdir().unwrap();
    mlaserve_model::presets::generate("tiny-v3", model.path()).unwrap();
    let logs = tempfile::tempdir().unwrap();

    let mut chart = Chart::load(&chart_dir());
    let v = &mut chart.values;
    let (grpc, metrics, wport, wmetrics, tp) = (free_port(), free_port(), free_port(), free_port(), free_port());
    set_value(v, "etcd.enabled", false);
    set_value(v, "etcd.externalEndpoints", etcd.endpoint.as_str());
    set_value(v, "model.path", model.path().to_str().unwrap());
    set_value(v, "router.grpcPort", grpc);
    set_value(v, "router.metricsPort", metrics);
    set_value(v, "router.drainTimeoutSeconds", 5);
    set_value(v, "worker.port", wport);
    set_value(v, "worker.metricsPort", wmetrics);
    set_value(v, "worker.tpPort", tp);
    set_value(v, "worker.tpSize", 1); // one rank: the CPU backend
    set_value(v, "worker.gpuResource", "");
    set_value(v, "worker.kvBlocks", 64);
    set_value(v, "worker.speculativeTokens", 2);
    set_value(v, "cluster", "deploy-test");
    let docs = helm.manifests(&chart, RELEASE).unwrap_or_else(|e| panic!("{e}"));

    let router_c = container(&docs, "Deployment", &format!("{RELEASE}-router"), "router");
    let worker_c = container(&docs, "StatefulSet", &format!("{RELEASE}-worker"), "worker");
    let (router_argv, router_env) = process_of(router_c, &format!("{RELEASE}-router-abc12"));
    let (worker_argv, worker_env) = process_of(worker_c, &format!("{RELEASE}-worker-0"));
    assert_eq!(flag(&worker_argv, "--group"), format!("{RELEASE}-worker-0"), "$(POD_NAME) expanded");
    assert_eq!(flag(&worker_argv, "--advertise"), format!("http://127.0.0.1:{wport}"));
    assert_eq!(flag(&router_argv, "--etcd"), etcd.endpoint);

    let mut worker = Proc::spawn("worker", &worker_argv, &worker_env, logs.path().join("worker.log"));
    let mut router = Proc::spawn("router", &router_argv, &router_env, logs.path().join("router.log"));

    // The readiness probe's check: grpc.health.v1 on the router's port turns SERVING
    // once the group registered in etcd.
    let raddr = SocketAddr::from(([127, 0, 0, 1], grpc));
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        worker.assert_running();
        router.assert_running();
        if serving(raddr).await == Some(ServingStatus::Serving as i32) {
            break;
        }
        assert!(
            Instant::now() < until,
            "the router never turned SERVING\n--- worker log:\n{}\n--- router log:\n{}",
            worker.log(),
            router.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A real request through the router.
    let mut client = GenerationClient::connect(format!("http://{raddr}")).await.unwrap();
    let req = GenerateRequest {
        prompt: Some(Prompt::Text("hello from the chart".into())),
        stopping: Some(StoppingCriteria { max_new_tokens: Some(8), ignore_eos: true, ..Default::default() }),
        ..Default::default()
    };
    let mut stream = client.generate(req).await.unwrap_or_else(|e| panic!("Generate refused: {e}")).into_inner();
    let (mut tokens, mut finished) = (0, false);
    while let Some(m) = stream.next().await {
        let m = m.unwrap_or_else(|e| panic!("stream failed: {e}\n--- worker log:\n{}", worker.log()));
        tokens += m.token_ids.len();
        finished |= m.finish.is_some();
    }
    assert!(finished, "the stream ended without a final message");
    assert_eq!(tokens, 8, "max_new_tokens with ignore_eos");

    // The metrics ports the chart scrapes answer.
    for (who, port) in [("router", metrics), ("worker", wmetrics)] {
        let r = http_get(SocketAddr::from(([127, 0, 0, 1], port)), "/metrics").unwrap();
        assert!(r.starts_with("HTTP/1.") && r.contains(" 200 "), "{who} /metrics: {r}");
    }
    let r = http_get(SocketAddr::from(([127, 0, 0, 1], metrics)), "/metrics").unwrap();
    assert!(r.contains("mlaserve_"), "router metrics carry mlaserve_ series");

    // SIGTERM, as Kubernetes sends it: the router drains and exits cleanly; the
    // launcher forwards it to every rank and exits cleanly too.
    router.signal(libc::SIGTERM);
    let s = router.wait_exit(Duration::from_secs(10)).unwrap_or_else(|| panic!("router ignored SIGTERM"));
    assert!(s.success(), "router exit {s}\n{}", router.log());
    worker.signal(libc::SIGTERM);
    let s = worker.wait_exit(Duration::from_secs(10)).unwrap_or_else(|| panic!("worker group ignored SIGTERM"));
    assert!(s.success(), "worker group exit {s}\n{}", worker.log());
    drop(etcd);
}

/// The `--flags` that `mlaserve <sub> --help` lists.
fn help_flags(sub: &str) -> Vec<String> {
    let out = std::process::Command::new(mlaserve_bin()).args([sub, "--help"]).output().unwrap();
    assert!(out.status.success(), "mlaserve {sub} --help failed");
    String::from_utf8_lossy(&out.stdout)
        .split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']' || c == '=')
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(String::from)
        .collect()
}

/// Every flag that the chart, the compose file and the image's default command pass to
/// `router`, `worker` and `serve` is one the binary has (a fast, precise failure before
/// the run above), and the worker's `--backend` is a value it accepts.
#[test]
fn every_flag_the_deployment_files_pass_exists() {
    let Some(helm) = Tools::find() else { return };
    let chart = Chart::load(&chart_dir());
    let docs = helm.manifests(&chart, RELEASE).unwrap_or_else(|e| panic!("{e}"));
    let compose: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(repo_root().join("deploy/compose.yaml")).unwrap()).unwrap();
    let df = Dockerfile::parse(&std::fs::read_to_string(repo_root().join("deploy/docker/Dockerfile")).unwrap());
    let run = df.stages.last().expect("a runtime stage");
    let image_cmd = exec_form(run.all("CMD").last().expect("Dockerfile: CMD"));
    let router = process_of(container(&docs, "Deployment", &format!("{RELEASE}-router"), "router"), "p").0;
    let worker = process_of(container(&docs, "StatefulSet", &format!("{RELEASE}-worker"), "worker"), "p").0;
    // The flags the secured variant adds (TLS, keys) exist too.
    let secured =
        common::chart::VARIANTS.iter().find(|v| v.name == "secured").expect("the secured variant").apply(&chart);
    let sdocs = helm.manifests(&secured, RELEASE).unwrap_or_else(|e| panic!("{e}"));
    let s_router = process_of(container(&sdocs, "Deployment", &format!("{RELEASE}-router"), "router"), "p").0;
    let s_worker = process_of(container(&sdocs, "StatefulSet", &format!("{RELEASE}-worker"), "worker"), "p").0;
    let sub_args = |argv: &[String], sub: &str| -> Vec<String> {
        let i = argv.iter().position(|a| a == sub).unwrap_or_else(|| panic!("no `{sub}` in {argv:?}"));
        argv[i + 1..].to_vec()
    };
    let compose_args = |svc: &str| -> Vec<String> {
        compose["services"][svc]["command"].as_sequence().unwrap().iter().map(|a| a.as_str().unwrap().into()).collect()
    };
    let mut missing = Vec::new();
    for (origin, sub, args) in [
        ("chart router", "router", sub_args(&router, "router")),
        ("chart worker", "worker", [sub_args(&worker, "worker"), vec!["--rank".into()]].concat()),
        ("secured chart router", "router", sub_args(&s_router, "router")),
        ("secured chart worker", "worker", sub_args(&s_worker, "worker")),
        ("compose router", "router", sub_args(&compose_args("router"), "router")),
        ("compose worker", "worker", sub_args(&compose_args("worker"), "worker")),
        ("image CMD", "serve", sub_args(&image_cmd, "serve")),
    ] {
        let known = help_flags(sub);
        for a in args.iter().filter(|a| a.starts_with("--")) {
            let flag = a.split('=').next().unwrap();
            if !known.iter().any(|k| k == flag) {
                missing.push(format!("{origin}: mlaserve {sub} has no {flag}"));
            }
        }
    }
    assert!(missing.is_empty(), "{missing:#?}");

    // `--backend cuda` (GPUs requested, the default values) is one of clap's values.
    let backend = flag(&worker, "--backend");
    assert_eq!(backend, "cuda");
    // Short help (`-h`) lists an enum's values on one line: `[possible values: a, b]`.
    let out = std::process::Command::new(mlaserve_bin()).args(["worker", "-h"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    let values = help.split("--backend").nth(1).and_then(|h| h.split("[possible values:").nth(1)).unwrap_or_default();
    let values: Vec<&str> = values.split(']').next().unwrap_or_default().split(',').map(str::trim).collect();
    assert!(values.contains(&backend), "mlaserve worker --backend takes {values:?}, the chart passes {backend}");
}
