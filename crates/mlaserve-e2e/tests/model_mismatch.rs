//! A router refuses a worker group that serves another model: the group is logged and
//! kept out of the pool (health stays NOT_SERVING, requests get UNAVAILABLE rather than
//! another model's tokens), while a group serving the router's model joins as usual.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use mlaserve_router::{RouterArgs, RouterHandle};
use mlaserve_worker::{WorkerArgs, WorkerHandle};
use std::net::SocketAddr;
use std::time::Duration;
use tonic::Code;

fn worker(model: std::path::PathBuf) -> Background<WorkerHandle> {
    let mut a = WorkerArgs::new(model);
    a.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    a.engine.kv_blocks = Some(128);
    Background::start(move || async move { start_cpu_worker(a).await })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_serving_another_model_is_refused() {
    let other = tempfile::tempdir().unwrap();
    mlaserve_model::presets::generate("tiny-v2", other.path()).unwrap();
    let stranger = worker(other.path().to_path_buf());
    let r: Background<RouterHandle> = {
        let mut args = RouterArgs::new(model_path());
        args.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        args.workers = vec![format!("http://{}", stranger.get().addr)];
        Background::start(move || async move { mlaserve_router::start(args).await.unwrap() })
    };
    let pool = r.get().pool().clone();
    // Long enough for the supervisor to connect, ask GetInfo and decide.
    assert!(!eventually(Duration::from_secs(3), || pool.ready_count() > 0).await, "the stranger joined the pool");
    let mut c = client(r.get().addr).await;
    let e = collect(&mut c, ids_request(vec![2, 3, 4], 4)).await.error.expect("no group may serve it");
    assert_eq!(e.code(), Code::Unavailable, "{}", e.message());

    // A group serving the router's model joins; the stranger stays out.
    let own = worker(model_path());
    pool.upsert("own", &format!("http://{}", own.get().addr));
    assert!(eventually(READY, || pool.ready_count() == 1).await, "the matching group must join");
    let ok = collect(&mut c, ids_request(vec![2, 3, 4], 4)).await;
    assert!(ok.error.is_none(), "{:?}", ok.error);
    assert_eq!(ok.tokens.len(), 4);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(pool.ready_count(), 1, "only the matching group is ready");
}
