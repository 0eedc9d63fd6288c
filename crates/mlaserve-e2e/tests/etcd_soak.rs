//! An etcd soak against a stock etcd (Debian's `etcd-server`, default settings): a
//! router watching one registered group for 35 s keeps its watch — no restart, so no
//! re-list — and the group stays ready throughout. etcd refuses HTTP/2 pings more often
//! than its `--grpc-keepalive-min-time` (5 s by default) and closes the connection, so
//! a client pinging faster loses its watch every few seconds.
//!
//! Its own test binary: it reads the process-wide Prometheus recorder.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use mlaserve_router::RouterHandle;
use mlaserve_worker::WorkerHandle;
use std::time::{Duration, Instant};

const CLUSTER: &str = "soak";
const SOAK: Duration = Duration::from_secs(35);

fn worker(etcd: &str, group: &str) -> Background<WorkerHandle> {
    etcd_worker(etcd, CLUSTER, group, 3)
}

fn router(etcd: &str) -> Background<RouterHandle> {
    etcd_router(etcd, CLUSTER)
}

/// `mlaserve_etcd_watch_restarts_total` as this process's recorder has it.
fn watch_restarts() -> f64 {
    let text = mlaserve_cluster::metrics::handle().expect("the Prometheus recorder is installed").render();
    text.lines()
        .find_map(|l| l.strip_prefix("mlaserve_etcd_watch_restarts_total "))
        .unwrap_or_else(|| panic!("no mlaserve_etcd_watch_restarts_total in:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_holds_against_a_stock_etcd() {
    let etcd = EtcdServer::start();
    let r = router(&etcd.endpoint);
    let _w = worker(&etcd.endpoint, "g-soak");
    let pool = r.get().pool().clone();
    assert!(eventually(READY, || pool.ready_count() == 1).await, "the group must register");
    let before = watch_restarts();

    let start = Instant::now();
    let mut not_ready = Vec::new();
    while start.elapsed() < SOAK {
        if pool.ready_count() != 1 || pool.names() != ["g-soak"] {
            not_ready.push(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let restarts = watch_restarts() - before;
    assert_eq!(restarts, 0.0, "the etcd watch restarted {restarts} times in {SOAK:?}");
    assert!(not_ready.is_empty(), "the group was not ready at {not_ready:?} into the soak");
    let mut c = client(r.get().addr).await;
    assert_still_serves(&mut c).await;
}
