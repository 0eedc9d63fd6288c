//! Deployment checks (tests only; this library is empty).
//!
//! - `tests/chart.rs`: the Helm chart under `helm/mlaserve/`, `deploy/compose.yaml` and
//!   every other non-template YAML parse; the chart's values, templates and
//!   `docs/deploy.md` agree; Helm renders the chart and `helm lint` passes for every
//!   values variant `docs/deploy.md` lists, and the manifests pass the Kubernetes API
//!   schemas (with a negative test that the validator rejects broken ones).
//! - `tests/image.rs`: `deploy/docker/Dockerfile` read statically: the default build
//!   arguments build the CUDA backend, the runtime stage carries what cudarc loads, and
//!   the image agrees with the chart (binary, entrypoint, user, ports, model).
//! - `tests/chart_run.rs`: every flag the chart, the compose file and the image's
//!   default command pass is one `mlaserve <sub> --help` lists; then the real binary runs
//!   with exactly the rendered router and worker containers' command lines and
//!   environments against a real etcd on loopback and serves a gRPC request through the
//!   router.
//!
//! Rendering and validation use real tools, which CI installs from PyPI into a venv:
//! `tools/ci/install-k8s-validate.sh` puts `helm-python-sdk` (Helm's Go SDK as a shared
//! library, driven by `tests/common/helm.py`) and `kubernetes-validate` (which bundles
//! the API's JSON schemas, so nothing is fetched while testing) into `<repo>/.venv-k8s`;
//! `MLASERVE_K8S_VENV` names another venv. `.ci/run` runs that script before `cargo
//! test`. A test that needs them fails when they are missing and `CI` is set, and is
//! skipped (printing `SKIPPED`) otherwise.
//!
//! The binary is `$MLASERVE_BIN` when set, else built by `cargo build -p mlaserve` from
//! the test (a no-op when it is up to date); etcd is Debian's (`$MLASERVE_ETCD_BIN`, else
//! `/usr/bin/etcd`, else `etcd` on PATH), and its absence fails the test.
