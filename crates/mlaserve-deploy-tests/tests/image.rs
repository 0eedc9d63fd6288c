//! The container image (`deploy/docker/Dockerfile`) read statically, since no Docker
//! engine runs in CI: the default build arguments build the CUDA backend, the runtime
//! stage carries the libraries cudarc loads, and the image agrees with what the Helm
//! chart runs in it (binary, entrypoint, shell, ports, bundled model).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::chart::Chart;
use common::dockerfile::{exec_form, Dockerfile};
use common::*;

fn dockerfile_text() -> String {
    std::fs::read_to_string(repo_root().join("deploy/docker/Dockerfile")).expect("deploy/docker/Dockerfile")
}

/// Why the image that `dockerfile` builds with its default build arguments would have
/// no CUDA backend (empty when it has one).
fn missing_cuda_backend(dockerfile: &str) -> Vec<String> {
    let df = Dockerfile::parse(dockerfile);
    let mut why = Vec::new();
    let Some(build) = df.stages.iter().find(|s| s.all("RUN").iter().any(|r| r.contains("cargo build"))) else {
        return vec!["no stage runs `cargo build`".into()];
    };
    let features = build.arg_default("CARGO_FEATURES", &df.global_args).unwrap_or_default();
    if !features.split([',', ' ']).any(|f| f == "cuda" || f == "mlaserve/cuda") {
        why.push(format!("ARG CARGO_FEATURES defaults to `{features}`, without `cuda`"));
    }
    let cargo = build.all("RUN").into_iter().find(|r| r.contains("cargo build")).unwrap();
    if !(cargo.contains("-p mlaserve") && cargo.contains("CARGO_FEATURES")) {
        why.push(format!("`cargo build` does not build -p mlaserve with $CARGO_FEATURES: {cargo}"));
    }
    // nvcc at build time: crates/mlaserve-cuda/build.rs finds it through CUDA_HOME.
    if !build.from.contains("-devel-") {
        why.push(format!("the build stage's base `{}` is not a CUDA devel image (no nvcc)", build.from));
    }
    if build.env().get("CUDA_HOME").map(String::as_str) != Some("/usr/local/cuda") {
        why.push("the build stage does not set CUDA_HOME=/usr/local/cuda".into());
    }
    why
}

#[test]
fn default_image_builds_the_cuda_backend() {
    let text = dockerfile_text();
    let why = missing_cuda_backend(&text);
    assert!(why.is_empty(), "the default image would run every worker on the CPU: {why:#?}");

    // The check itself fails on the image this crate used to build (`nccl` alone) and on
    // empty features, so a green run means something.
    let nccl_only = text.replace("ARG CARGO_FEATURES=cuda", "ARG CARGO_FEATURES=nccl");
    assert_ne!(nccl_only, text, "the Dockerfile has `ARG CARGO_FEATURES=cuda`");
    assert!(missing_cuda_backend(&nccl_only).iter().any(|w| w.contains("without `cuda`")));
    let none = text.replace("ARG CARGO_FEATURES=cuda", "ARG CARGO_FEATURES=");
    assert!(!missing_cuda_backend(&none).is_empty());
    let runtime_base = text.replace("-devel-", "-runtime-");
    assert!(missing_cuda_backend(&runtime_base).iter().any(|w| w.contains("no nvcc")));

    // The feature is what the mlaserve crate calls it, and it brings the backend.
    let manifest = std::fs::read_to_string(repo_root().join("crates/mlaserve/Cargo.toml")).unwrap();
    let cuda = manifest.lines().find(|l| l.trim_start().starts_with("cuda = [")).expect("mlaserve: feature `cuda`");
    for needs in ["\"nccl\"", "\"mlaserve-cuda/cuda\""] {
        assert!(cuda.contains(needs), "mlaserve's `cuda` feature lacks {needs}: {cuda}");
    }
}

#[test]
fn runtime_image_carries_what_cudarc_loads() {
    let df = Dockerfile::parse(&dockerfile_text());
    let (build, run) = (&df.stages[0], df.stages.last().unwrap());
    // cudarc loads libraries by soname at run time; its CUDA major version is the
    // image's (`cuda-13000` -> libcublas.so.13).
    let root = std::fs::read_to_string(repo_root().join("Cargo.toml")).unwrap();
    let cudarc = root.lines().find(|l| l.starts_with("cudarc = ")).expect("workspace cudarc");
    assert!(cudarc.contains("\"dynamic-loading\""), "cudarc links CUDA at build time? {cudarc}");
    let major = cudarc.split("\"cuda-").nth(1).map(|v| &v[..2]).expect("cudarc cuda-XXYY0 feature");
    let cuda_version = df.global_args.get("CUDA_VERSION").expect("ARG CUDA_VERSION");
    assert!(cuda_version.starts_with(&format!("{major}.")), "image CUDA {cuda_version}, cudarc built for {major}");
    assert!(run.from.contains("-runtime-"), "runtime stage on a CUDA runtime image: {}", run.from);
    assert_eq!(build.from.replace("-devel-", "-runtime-"), run.from, "build and runtime images of one CUDA release");
    // libcublas.so.13 comes with the runtime image; NCCL only as libnccl.so.2, while
    // cudarc opens libnccl.so: the stage links and checks both at build time.
    let runs = run.all("RUN").join("\n");
    for lib in [format!("libcublas.so.{major}"), "libnccl.so".into()] {
        assert!(runs.contains(&lib), "the runtime stage does not check {lib}");
    }
    assert!(runs.contains("ln -sf \"$nccl\""), "the runtime stage links libnccl.so to libnccl.so.2");
    assert_eq!(run.env().get("NCCL_NVLS_ENABLE").map(String::as_str), Some("0"));
}

#[test]
fn chart_and_image_agree() {
    let df = Dockerfile::parse(&dockerfile_text());
    let run = df.stages.last().unwrap();
    let chart = Chart::load(&chart_dir());

    // The binary: on PATH as `mlaserve`, the image's entrypoint, what the chart's
    // router runs and what the worker launcher execs.
    let entry = exec_form(run.all("ENTRYPOINT").last().expect("ENTRYPOINT"));
    assert_eq!(entry, ["mlaserve"]);
    let copy = run.all("COPY").into_iter().find(|c| c.contains("--from=build")).expect("COPY --from=build");
    assert!(copy.ends_with(" /usr/local/bin/mlaserve"), "binary at /usr/local/bin/mlaserve (on PATH): {copy}");
    let template = |name: &str| &chart.templates.iter().find(|(n, _)| n == name).unwrap().1;
    let router = template("router-deployment.yaml");
    assert!(router.contains("command:\n            - mlaserve\n          args:\n            - router\n"));
    let worker = template("worker-statefulset.yaml");
    assert!(worker.contains("command:\n            - /bin/bash\n"), "the worker launcher is bash");
    assert!(worker.contains("            - mlaserve-group\n            - mlaserve\n            - worker\n"));
    // bash is in the image: the Ubuntu base of NVIDIA's images.
    assert!(
        run.from.ends_with(&format!("-{}", df.global_args["UBUNTU"])) && df.global_args["UBUNTU"].starts_with("ubuntu")
    );

    // The user the pods run as, the ports they expose, the model they load.
    let user = run.all("USER").last().copied().expect("USER");
    for t in [router, worker] {
        assert!(t.contains("runAsUser: 10001") && user.starts_with("10001"), "pods run as the image's user {user}");
    }
    let exposed: Vec<u64> =
        run.all("EXPOSE").iter().flat_map(|e| e.split_whitespace()).map(|p| p.parse().unwrap()).collect();
    for port in ["router.grpcPort", "router.metricsPort", "worker.port", "worker.metricsPort"] {
        let p = lookup(&chart.values, port).and_then(|v| v.as_u64()).unwrap();
        assert!(exposed.contains(&p), "{port} = {p} is not EXPOSEd by the image ({exposed:?})");
    }
    let model = run.arg_default("MODEL", &df.global_args).expect("Dockerfile: ARG MODEL=<dir under models/>");
    assert_eq!(
        chart.values["model"]["path"].as_str(),
        Some(format!("/opt/mlaserve/models/{model}").as_str()),
        "model.path must be where the image puts the bundled model"
    );
    assert!(repo_root().join("models").join(&model).join("config.json").exists(), "models/{model} is not in the repo");
    assert!(run.all("USER").iter().all(|u| !u.contains("root")), "non-root USER");
}
