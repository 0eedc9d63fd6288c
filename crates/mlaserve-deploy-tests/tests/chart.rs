//! Static checks of the deployment files: every non-template YAML parses; the chart's
//! values, its templates and `docs/deploy.md` agree; `values.yaml` documents every
//! key; Helm renders the chart (and `helm lint` passes) under every documented values
//! variant, to manifests that the Kubernetes API schemas accept; the image bundles the
//! model the chart points at.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::chart::{set_value, Chart, VARIANTS};
use common::k8s::{to_yaml_stream, Tools, CRD_GROUPS};
use common::*;
use serde_yaml_ng::Value;
use std::path::{Path, PathBuf};

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            // Templates are Go templates, not YAML, until rendered (checked below).
            if p.file_name().is_some_and(|n| n != "templates") {
                yaml_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            out.push(p);
        }
    }
}

#[test]
fn every_non_template_yaml_parses() {
    let root = repo_root();
    let mut files = Vec::new();
    yaml_files(&root.join("helm"), &mut files);
    yaml_files(&root.join("deploy"), &mut files);
    for must in ["helm/mlaserve/Chart.yaml", "helm/mlaserve/values.yaml", "deploy/compose.yaml"] {
        assert!(files.contains(&root.join(must)), "{must} missing");
    }
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let v: Value = serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        assert!(v.is_mapping(), "{}: not a mapping", f.display());
    }

    let chart: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(chart_dir().join("Chart.yaml")).unwrap()).unwrap();
    assert_eq!(chart["apiVersion"], "v2");
    assert_eq!(chart["name"], "mlaserve");
    for key in ["version", "appVersion", "description"] {
        assert!(chart[key].as_str().is_some_and(|s| !s.is_empty()), "Chart.yaml: {key}");
    }

    let compose: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(root.join("deploy/compose.yaml")).unwrap()).unwrap();
    for svc in ["etcd", "router", "worker"] {
        assert!(compose["services"][svc].is_mapping(), "compose.yaml: service {svc}");
    }
    assert_eq!(compose["services"]["router"]["command"][0], "router");
    assert_eq!(compose["services"]["worker"]["command"][0], "worker");
}

#[test]
fn values_and_templates_agree() {
    let chart = Chart::load(&chart_dir());
    let used = used_value_paths(&chart);
    assert!(!used.is_empty());
    for p in &used {
        assert!(lookup(&chart.values, p).is_some(), "templates use .Values.{p}, which values.yaml lacks");
    }
    for p in value_paths(&chart.values, &used) {
        assert!(
            used.iter().any(|u| u == &p || p.starts_with(&format!("{u}."))),
            "values.yaml has `{p}`, which no template uses"
        );
    }
}

#[test]
fn values_yaml_documents_every_key() {
    let text = std::fs::read_to_string(chart_dir().join("values.yaml")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        if t.is_empty() || t.starts_with('#') || t.starts_with('-') || !t.contains(':') {
            continue;
        }
        // A key line inside a list item (e.g. a toleration's fields) is data, not a value.
        let indent = line.len() - t.len();
        let in_list = lines[..i].iter().rev().find(|l| {
            let lt = l.trim_start();
            !lt.is_empty() && !lt.starts_with('#') && l.len() - lt.len() < indent
        });
        if in_list.is_some_and(|l| l.trim_start().starts_with('-')) {
            continue;
        }
        let commented_above = i > 0 && lines[i - 1].trim_start().starts_with('#');
        let trailing = t.contains(" # ");
        assert!(commented_above || trailing, "values.yaml line {}: `{}` has no comment", i + 1, t);
    }
}

#[test]
fn docs_name_every_value() {
    let chart = Chart::load(&chart_dir());
    let used = used_value_paths(&chart);
    let doc = std::fs::read_to_string(repo_root().join("docs/deploy.md")).expect("docs/deploy.md");
    let missing: Vec<String> =
        value_paths(&chart.values, &used).into_iter().filter(|p| !doc.contains(&format!("`{p}`"))).collect();
    assert!(missing.is_empty(), "docs/deploy.md does not name (in backticks): {missing:?}");
    for must in ["helm lint", "helm template", "LoadBalancer", "NCCL_NVLS_ENABLE=0", "tools/ci/install-k8s-validate.sh"]
    {
        assert!(doc.contains(must), "docs/deploy.md does not mention {must}");
    }
    for v in VARIANTS {
        assert!(doc.contains(&format!("`{}`", v.name)), "docs/deploy.md does not list the values variant `{}`", v.name);
    }
}

fn kinds(docs: &[Value]) -> Vec<String> {
    docs.iter()
        .map(|d| format!("{}/{}", d["kind"].as_str().unwrap(), d["metadata"]["name"].as_str().unwrap()))
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind}/{name} in {:?}", kinds(docs)))
}

#[test]
fn chart_renders_valid_manifests() {
    let Some(helm) = Tools::find() else { return };
    let base = Chart::load(&chart_dir());
    let docs = helm.manifests(&base, "r").unwrap_or_else(|e| panic!("{e}"));
    for d in &docs {
        for key in ["apiVersion", "kind"] {
            assert!(d[key].is_string(), "a manifest lacks {key}: {d:?}");
        }
        assert!(d["metadata"]["name"].is_string(), "a manifest lacks metadata.name");
    }
    let names = kinds(&docs);
    for must in [
        "Deployment/r-router",
        "Service/r-router",
        "Service/r-router-metrics",
        "StatefulSet/r-worker",
        "Service/r-worker",
        "PodDisruptionBudget/r-router",
        "PodDisruptionBudget/r-worker",
        "StatefulSet/r-etcd",
        "Service/r-etcd",
    ] {
        assert!(names.iter().any(|n| n == must), "{must} not rendered: {names:?}");
    }
    assert!(!names.iter().any(|n| n.starts_with("ServiceMonitor/")), "ServiceMonitor is off by default");

    let v = &base.values;
    let tp = v["worker"]["tpSize"].as_u64().unwrap();
    // Router: the LoadBalancer Service, probes on the gRPC port.
    let svc = find(&docs, "Service", "r-router");
    assert_eq!(svc["spec"]["type"], "LoadBalancer");
    let router = &find(&docs, "Deployment", "r-router")["spec"]["template"]["spec"];
    let rc = &router["containers"][0];
    let grpc = v["router"]["grpcPort"].as_u64().unwrap();
    assert_eq!(rc["readinessProbe"]["grpc"]["port"].as_u64(), Some(grpc), "readiness: grpc.health.v1");
    assert_eq!(rc["livenessProbe"]["tcpSocket"]["port"].as_u64(), Some(grpc));
    let args: Vec<&str> = rc["args"].as_sequence().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    let listen = args[args.iter().position(|a| *a == "--listen").unwrap() + 1];
    assert_eq!(listen, format!("0.0.0.0:{grpc}"));
    assert_eq!(args[args.iter().position(|a| *a == "--etcd").unwrap() + 1], "r-etcd:2379");
    assert!(
        router["terminationGracePeriodSeconds"].as_u64() > v["router"]["drainTimeoutSeconds"].as_u64(),
        "the grace period must outlast the drain"
    );

    // Worker groups: one pod per group holding tpSize GPUs, /dev/shm in memory, NCCL env.
    let sts = find(&docs, "StatefulSet", "r-worker");
    assert_eq!(sts["spec"]["replicas"], v["worker"]["groups"]);
    let pod = &sts["spec"]["template"]["spec"];
    let wc = &pod["containers"][0];
    for side in ["requests", "limits"] {
        assert_eq!(wc["resources"][side]["nvidia.com/gpu"].as_u64(), Some(tp), "{side}: nvidia.com/gpu = tpSize");
    }
    let env = |name: &str| -> Option<String> {
        wc["env"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .and_then(|e| e["value"].as_str().map(String::from))
    };
    assert_eq!(env("NCCL_NVLS_ENABLE").as_deref(), Some("0"));
    assert_eq!(env("MLASERVE_TP_SIZE"), Some(tp.to_string()));
    let shm = pod["volumes"].as_sequence().unwrap().iter().find(|vol| vol["name"] == "dshm").expect("dshm volume");
    assert_eq!(shm["emptyDir"]["medium"], "Memory");
    assert!(wc["volumeMounts"].as_sequence().unwrap().iter().any(|m| m["mountPath"] == "/dev/shm"));
    let wargs: Vec<&str> = wc["args"].as_sequence().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    let script = wargs[0];
    assert!(!script.contains("$("), "Kubernetes would expand $(...) in the launcher script");
    for flag in ["--world-size", "--tp-addr", "--collective-timeout-s"] {
        assert!(wargs.contains(&flag), "worker args lack {flag}");
    }
    assert_eq!(wargs[wargs.iter().position(|a| *a == "--world-size").unwrap() + 1], tp.to_string());
    assert!(script.contains("--rank"), "the launcher gives each process its --rank");
    // GPUs requested: the group must run on them, never fall back to the CPU.
    assert_eq!(wargs[wargs.iter().position(|a| *a == "--backend").unwrap() + 1], "cuda");

    // Switches: external etcd, a model PVC, no GPU resource, the ServiceMonitor.
    let mut c = base.clone();
    set_value(&mut c.values, "etcd.enabled", false);
    set_value(&mut c.values, "etcd.externalEndpoints", "e1:2379,e2:2379");
    set_value(&mut c.values, "model.persistentVolumeClaim.enabled", true);
    set_value(&mut c.values, "worker.gpuResource", "");
    set_value(&mut c.values, "serviceMonitor.enabled", true);
    set_value(&mut c.values, "serviceMonitor.labels", serde_yaml_ng::from_str::<Value>("release: prom").unwrap());
    set_value(&mut c.values, "router.nodeSelector", serde_yaml_ng::from_str::<Value>("pool: cpu").unwrap());
    let docs = helm.manifests(&c, "r").unwrap_or_else(|e| panic!("{e}"));
    let names = kinds(&docs);
    assert!(!names.iter().any(|n| n.contains("etcd")), "no in-chart etcd when etcd.enabled=false: {names:?}");
    assert_eq!(find(&docs, "ServiceMonitor", "r")["metadata"]["labels"]["release"], "prom");
    let pod = &find(&docs, "StatefulSet", "r-worker")["spec"]["template"]["spec"];
    let wc = &pod["containers"][0];
    assert!(wc["resources"]["limits"]["nvidia.com/gpu"].is_null());
    let wargs: Vec<&str> = wc["args"].as_sequence().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    assert_eq!(wargs[wargs.iter().position(|a| *a == "--backend").unwrap() + 1], "auto", "no GPUs: --backend auto");
    assert_eq!(wargs[wargs.iter().position(|a| *a == "--etcd").unwrap() + 1], "e1:2379,e2:2379");
    assert!(pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .any(|vol| vol["persistentVolumeClaim"]["claimName"].is_string()));
    assert!(wc["volumeMounts"].as_sequence().unwrap().iter().any(|m| m["name"] == "model"));
    let router = &find(&docs, "Deployment", "r-router")["spec"]["template"]["spec"];
    assert_eq!(router["nodeSelector"]["pool"], "cpu");
    assert!(router["volumes"].as_sequence().unwrap().iter().any(|vol| vol["name"] == "model"));
}

#[test]
fn numbers_reach_command_lines_as_integers() {
    // Helm hands numbers from values.yaml to templates as float64: a value of a million
    // or more prints as 4.194304e+06 unless piped through `int`, and clap would refuse it.
    let Some(helm) = Tools::find() else { return };
    let base = Chart::load(&chart_dir());
    let mut bad = Vec::new();
    for v in VARIANTS {
        for d in helm.manifests(&v.apply(&base), "r").unwrap_or_else(|e| panic!("{}: {e}", v.name)) {
            let containers = d["spec"]["template"]["spec"]["containers"].as_sequence().cloned().unwrap_or_default();
            for c in containers {
                for a in c["args"].as_sequence().into_iter().flatten().filter_map(Value::as_str) {
                    if a.parse::<f64>().is_ok() && a.contains(['e', 'E']) {
                        bad.push(format!("{}: {}: {a}", v.name, d["metadata"]["name"].as_str().unwrap_or("?")));
                    }
                }
            }
        }
    }
    assert!(bad.is_empty(), "float-formatted numbers on command lines (pipe them through `int`): {bad:#?}");
}

/// The Kubernetes versions the manifests are checked against: the oldest that
/// `Chart.yaml`'s kubeVersion admits and the newest whose schemas kubernetes-validate
/// bundles (its own version, pinned in tools/ci/install-k8s-validate.sh).
fn kube_versions(chart: &Chart) -> Vec<String> {
    vec![chart.min_kube_version(), "1.37.0".to_string()]
}

#[test]
fn every_values_variant_passes_the_kubernetes_schemas() {
    let Some(helm) = Tools::find() else { return };
    let base = Chart::load(&chart_dir());
    let versions = kube_versions(&base);
    for v in VARIANTS {
        let c = v.apply(&base);
        let rendered = helm.render(&c, "r").unwrap_or_else(|e| panic!("{}: {e}", v.name));
        let stream: String = rendered.iter().map(|(name, text)| format!("---\n# Source: {name}\n{text}\n")).collect();
        let checked = helm.validate(&stream, &versions).unwrap_or_else(|e| panic!("variant `{}`: {e}", v.name));
        let docs = helm.manifests(&c, "r").unwrap();
        let custom = docs
            .iter()
            .filter(|d| CRD_GROUPS.iter().any(|g| d["apiVersion"].as_str().is_some_and(|a| a.starts_with(g))))
            .count();
        assert_eq!(
            checked.passed.len(),
            (docs.len() - custom) * versions.len(),
            "variant `{}`: every built-in resource validated against {versions:?}: {:#?}",
            v.name,
            checked.passed
        );
        println!(
            "{}: {} resources valid against {versions:?}; no schema (CRD): {:?}",
            v.name,
            docs.len() - custom,
            checked.unchecked
        );
    }
}

#[test]
fn the_validator_rejects_invalid_manifests() {
    let Some(helm) = Tools::find() else { return };
    let base = Chart::load(&chart_dir());
    let versions = kube_versions(&base);
    let docs = helm.manifests(&base, "r").unwrap_or_else(|e| panic!("{e}"));
    assert!(helm.validate(&to_yaml_stream(&docs), &versions).is_ok(), "the unchanged manifests are valid");
    let broken = |what: &str, change: &dyn Fn(&mut Value)| -> String {
        let mut docs = docs.clone();
        let sts = docs.iter_mut().find(|d| d["kind"] == "StatefulSet" && d["metadata"]["name"] == "r-worker").unwrap();
        change(sts);
        match helm.validate(&to_yaml_stream(&docs), &versions) {
            Ok(v) => panic!("{what}: the validator accepted it ({} passed)", v.passed.len()),
            Err(e) => e,
        }
    };
    // A wrong type.
    let e = broken("replicas as a word", &|s| s["spec"]["replicas"] = Value::from("two"));
    assert!(e.contains("statefulset/r-worker") && e.contains("replicas"), "{e}");
    // An unknown field (strict validation).
    let e = broken("a misspelt field", &|s| {
        s["spec"]["template"]["spec"]["containers"][0]
            .as_mapping_mut()
            .unwrap()
            .insert("imagePullPolicyy".into(), "Always".into());
    });
    assert!(e.contains("statefulset/r-worker") && e.contains("imagePullPolicyy"), "{e}");
    // A required field missing.
    let e = broken("no selector", &|s| {
        s["spec"].as_mapping_mut().unwrap().remove("selector");
    });
    assert!(e.contains("selector"), "{e}");
    // An apiVersion no Kubernetes serves: no schema is an error, not a pass.
    let e = broken("a mistyped apiVersion", &|s| s["apiVersion"] = Value::from("apps/v1beta9"));
    assert!(e.contains("no schema for StatefulSet apps/v1beta9"), "{e}");
}

#[test]
fn helm_lint_passes_for_every_values_variant() {
    let Some(helm) = Tools::find() else { return };
    let base = Chart::load(&chart_dir());
    for v in VARIANTS {
        let findings = helm.lint(&v.apply(&base)).unwrap_or_else(|e| panic!("{}: {e}", v.name));
        assert!(findings.is_empty(), "helm lint, variant `{}`: {findings:#?}", v.name);
    }
}

/// With `security` set, the router and the workers get the Secrets mounted, the flags
/// that read them, an https advertise address, and probes on the plain-text health port.
#[test]
fn the_secured_variant_mounts_the_secrets_and_moves_the_probes() {
    let Some(helm) = Tools::find() else { return };
    let base = Chart::load(&chart_dir());
    let c = VARIANTS.iter().find(|v| v.name == "secured").unwrap().apply(&base);
    let docs = helm.manifests(&c, "r").unwrap_or_else(|e| panic!("{e}"));
    let health = c.values["security"]["tls"]["healthPort"].as_u64().unwrap();
    let args_of = |c: &Value| -> Vec<String> {
        c["args"].as_sequence().unwrap().iter().map(|a| a.as_str().unwrap().to_string()).collect()
    };
    let mounts = |spec: &Value, c: &Value| -> Vec<(String, String, String)> {
        c["volumeMounts"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|m| {
                let name = m["name"].as_str().unwrap();
                let vol = spec["volumes"].as_sequence().unwrap().iter().find(|v| v["name"] == name).unwrap();
                let secret = vol["secret"]["secretName"].as_str().unwrap_or("").to_string();
                (name.to_string(), m["mountPath"].as_str().unwrap().to_string(), secret)
            })
            .collect()
    };

    let router = &find(&docs, "Deployment", "r-router")["spec"]["template"]["spec"];
    let rc = &router["containers"][0];
    let args = args_of(rc);
    assert_eq!(after(&args, "--api-key-file"), "/etc/mlaserve/api-keys/keys");
    assert_eq!(after(&args, "--tls-cert"), "/etc/mlaserve/tls/tls.crt");
    assert_eq!(after(&args, "--worker-tls-ca"), "/etc/mlaserve/tls/ca.crt");
    assert_eq!(after(&args, "--worker-tls-server-name"), "mlaserve-worker");
    assert_eq!(after(&args, "--health-listen"), format!("0.0.0.0:{health}"));
    assert_eq!(rc["readinessProbe"]["grpc"]["port"].as_u64(), Some(health));
    let m = mounts(router, rc);
    assert!(m.contains(&("api-keys".into(), "/etc/mlaserve/api-keys".into(), "mlaserve-api-keys".into())), "{m:?}");
    assert!(m.contains(&("tls".into(), "/etc/mlaserve/tls".into(), "mlaserve-tls".into())), "{m:?}");

    let worker = &find(&docs, "StatefulSet", "r-worker")["spec"]["template"]["spec"];
    let wc = worker["containers"].as_sequence().unwrap().iter().find(|c| c["name"] == "worker").unwrap();
    let args = args_of(wc);
    assert_eq!(after(&args, "--tls-client-ca"), "/etc/mlaserve/tls/ca.crt");
    assert_eq!(after(&args, "--health-listen"), format!("0.0.0.0:{health}"));
    assert!(after(&args, "--advertise").starts_with("https://"), "{args:?}");
    assert!(!args.iter().any(|a| a == "--api-key-file"), "workers take no API keys");
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(wc[probe]["grpc"]["port"].as_u64(), Some(health), "{probe}");
    }
    let m = mounts(worker, wc);
    assert!(m.contains(&("tls".into(), "/etc/mlaserve/tls".into(), "mlaserve-tls".into())), "{m:?}");
    assert!(!m.iter().any(|(n, _, _)| n == "api-keys"), "{m:?}");
}

/// The worker container's args in `c` rendered as release `r`.
/// The value after `flag` in `args` (a panic naming the flag when it is missing).
fn after(args: &[String], flag: &str) -> String {
    args[args.iter().position(|a| a == flag).unwrap_or_else(|| panic!("no {flag} in {args:?}")) + 1].clone()
}

fn worker_args(helm: &Tools, c: &Chart) -> Vec<String> {
    let docs = helm.manifests(c, "r").unwrap_or_else(|e| panic!("{e}"));
    let spec = &find(&docs, "StatefulSet", "r-worker")["spec"]["template"]["spec"];
    let wc = spec["containers"].as_sequence().unwrap().iter().find(|c| c["name"] == "worker").unwrap();
    wc["args"].as_sequence().unwrap().iter().map(|a| a.as_str().unwrap().to_string()).collect()
}

/// By default a worker sizes its KV cache from `worker.gpuMemoryUtilization`; a non-zero
/// `worker.kvBlocks` passes `--kv-blocks` instead.
#[test]
fn workers_size_their_cache_from_gpu_memory_unless_kv_blocks_is_set() {
    let Some(helm) = Tools::find() else { return };
    let base = Chart::load(&chart_dir());
    let worker_args = |c: &Chart| worker_args(helm, c);
    let args = worker_args(&base);
    assert_eq!(after(&args, "--gpu-memory-utilization"), "0.9");
    assert!(!args.iter().any(|a| a == "--kv-blocks"), "{args:?}");
    let mut fixed = base.clone();
    set_value(&mut fixed.values, "worker.kvBlocks", 300);
    let args = worker_args(&fixed);
    assert_eq!(after(&args, "--kv-blocks"), "300");
    assert!(!args.iter().any(|a| a == "--gpu-memory-utilization"), "{args:?}");
}

/// The worker's start-up flags for speculation and graphs reach its command line only
/// when their values are set: by default the worker's own defaults apply.
#[test]
fn workers_get_the_start_up_flags_only_when_set() {
    let Some(helm) = Tools::find() else { return };
    let base = Chart::load(&chart_dir());
    let worker_args = |c: &Chart| worker_args(helm, c);
    let args = worker_args(&base);
    for flag in ["--speculation-calibration-rows", "--warm-up-graphs"] {
        assert!(!args.iter().any(|a| a.starts_with(flag)), "{flag} by default: {args:?}");
    }
    let mut set = base.clone();
    set_value(&mut set.values, "worker.speculationCalibrationRows", 64);
    set_value(&mut set.values, "worker.warmUpGraphs", true);
    let args = worker_args(&set);
    assert_eq!(after(&args, "--speculation-calibration-rows"), "64");
    assert!(args.iter().any(|a| a == "--warm-up-graphs=true"), "{args:?}");
    set_value(&mut set.values, "worker.speculationCalibrationRows", 0);
    set_value(&mut set.values, "worker.warmUpGraphs", false);
    let args = worker_args(&set);
    assert_eq!(after(&args, "--speculation-calibration-rows"), "0", "0 is passed on");
    assert!(args.iter().any(|a| a == "--warm-up-graphs=false"), "false is passed on: {args:?}");
}
