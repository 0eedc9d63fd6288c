//! Deployment checks (tests only; this library is empty).
//!
//! `tests/chart.rs` parses the Helm chart under `helm/mlaserve/`, `deploy/compose.yaml`
//! and every other non-template YAML file, and checks that the chart's values, its
//! templates and `docs/deploy.md` agree. `tests/chart_run.rs` renders the chart's router
//! and worker containers with a small renderer for the subset of Go templates the chart
//! uses (`tests/common/render.rs`), then runs the real `mlaserve` binary with exactly
//! that command line and environment against a real etcd on loopback and sends a gRPC
//! request through the router, so that the chart and the binary cannot drift apart; it
//! also checks that every flag the chart and `deploy/compose.yaml` pass is one that
//! `mlaserve router --help` / `mlaserve worker --help` lists.
//!
//! The binary is `$MLASERVE_BIN` when set, else built by `cargo build -p mlaserve` from
//! the test (a no-op when it is up to date); etcd is Debian's (`$MLASERVE_ETCD_BIN`, else
//! `/usr/bin/etcd`, else `etcd` on PATH), and its absence fails the test.
