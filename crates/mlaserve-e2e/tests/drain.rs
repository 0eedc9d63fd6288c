//! A worker group stopping gracefully behind a router over static `--worker` addresses:
//! it leaves the router's choice at once, the streams it holds finish, and no request
//! that had not started streaming fails (a refusal before the first token is retried on
//! the other group).

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use mlaserve_router::{RouterArgs, RouterHandle};
use mlaserve_worker::{WorkerArgs, WorkerHandle};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn worker() -> Background<WorkerHandle> {
    let mut a = WorkerArgs::new(model_path());
    a.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    a.engine.max_num_seqs = 8;
    a.engine.kv_blocks = Some(128);
    Background::start(move || async move { start_cpu_worker(a).await })
}

/// Sends short requests until `stop`, one at a time (`width` 1) or `width` at once;
/// returns every request's outcome.
async fn load(
    c: mlaserve_proto::v1::generation_client::GenerationClient<tonic::transport::Channel>,
    width: u32,
    stop: Arc<AtomicBool>,
) -> Vec<Collected> {
    let mut out = Vec::new();
    let mut round = 0u32;
    while !stop.load(Ordering::Acquire) {
        let mut set = tokio::task::JoinSet::new();
        for i in 0..width {
            let mut c = c.clone();
            let prompt = (0..6).map(|k| 3 + (k + i + round) % 400).collect();
            set.spawn(async move { collect(&mut c, ids_request(prompt, 6)).await });
        }
        while let Some(r) = set.join_next().await {
            out.push(r.unwrap());
        }
        round += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_worker_stop_under_load_fails_no_request() {
    let mut a = worker();
    let b = worker();
    let r: Background<RouterHandle> = {
        let mut args = RouterArgs::new(model_path());
        args.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        args.workers = vec![format!("http://{}", a.get().addr), format!("http://{}", b.get().addr)];
        Background::start(move || async move { mlaserve_router::start(args).await.unwrap() })
    };
    let pool = r.get().pool().clone();
    assert!(eventually(READY, || pool.ready_count() == 2).await);
    let c = client(r.get().addr).await;

    // Long streams on both groups (the router spreads them by outstanding tokens).
    let room = c
        .clone()
        .get_model_info(mlaserve_proto::v1::GetModelInfoRequest {})
        .await
        .unwrap()
        .into_inner()
        .max_context_tokens
        - 16;
    let mut long = tokio::task::JoinSet::new();
    for i in 0..4u32 {
        let mut c = c.clone();
        long.spawn(async move { collect(&mut c, ids_request((0..8).map(|k| 5 + k + 8 * i).collect(), room)).await });
    }
    let engine_a = a.get().engine.clone();
    assert!(
        eventually(Duration::from_secs(10), || engine_a.load().running_requests > 0).await,
        "a long stream must run on the group that stops"
    );

    // Sequential and concurrent short requests throughout the stop.
    let stop = Arc::new(AtomicBool::new(false));
    let sequential = tokio::spawn(load(c.clone(), 1, stop.clone()));
    let concurrent = tokio::spawn(load(c.clone(), 6, stop.clone()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        eventually(Duration::from_secs(5), || engine_a.load().running_requests > 0).await,
        "A must still hold a long stream when told to stop: {:?}",
        engine_a.load()
    );

    // Stop group A gracefully, on a runtime of its own (as `mlaserve worker` on SIGTERM).
    let h = a.handle.take().unwrap();
    let a_addr = format!("http://{}", h.addr);
    let stopper = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(h.shutdown());
    });
    // The router stops picking A at once, long before A's streams end.
    assert!(
        eventually(Duration::from_millis(300), || !pool
            .ready_groups()
            .iter()
            .any(|g| g.addr == a_addr && g.accepts_work()))
        .await,
        "the router must stop picking a draining group at once"
    );
    assert!(!stopper.is_finished(), "A must still be draining its long streams");
    let finished = eventually(Duration::from_secs(40), || stopper.is_finished()).await;
    assert!(finished, "the worker must stop within its drain timeout");
    stopper.join().unwrap();
    // Keep sending for a while after A is gone.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, Ordering::Release);
    let mut short = sequential.await.unwrap();
    let n_sequential = short.len();
    short.extend(concurrent.await.unwrap());

    let unstarted: Vec<_> = short.iter().filter(|c| c.error.is_some() && c.messages.is_empty()).collect();
    assert!(
        unstarted.is_empty(),
        "{} of {} requests failed before streaming ({} sequential): first {:?}",
        unstarted.len(),
        short.len(),
        n_sequential,
        unstarted[0].error
    );
    for s in &short {
        assert!(s.error.is_none(), "a short request failed mid-stream: {:?}", s.error);
        assert_eq!(s.finals, 1);
    }
    // The streams A held when it was told to stop finish normally.
    while let Some(l) = long.join_next().await {
        let l = l.unwrap();
        assert!(l.error.is_none(), "a long stream failed: {:?}", l.error);
        assert_eq!((l.finals, l.tokens.len()), (1, room as usize));
    }
    assert_still_serves(&mut c.clone()).await;
    drop(a);
}

/// Runs `f` to completion on a runtime of its own (as `mlaserve` does on SIGTERM), from
/// inside the test's runtime.
fn on_own_runtime(f: impl std::future::Future<Output = ()> + Send + 'static) {
    std::thread::spawn(move || tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f))
        .join()
        .unwrap();
}

/// The long stream is decoding and has generated a few tokens (so the stop comes while
/// it streams, however fast the engine decodes it): its outstanding tokens, ~all the
/// context at the start (`long_stream`: the context less 16), fell by more than 8.
fn streamed_some(engine: &mlaserve_engine::EngineHandle) -> bool {
    let l = engine.load();
    l.running_requests > 0 && l.outstanding_tokens + 8 < engine.info().max_model_len as u64 - 16
}

/// A request still running when a drain timeout passes ends with an error that says so,
/// whether the worker group or the router is the one stopping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_timeouts_say_what_happened() {
    let start_router = |w: SocketAddr| -> Background<RouterHandle> {
        let mut args = RouterArgs::new(model_path());
        args.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        args.workers = vec![format!("http://{w}")];
        Background::start(move || async move { mlaserve_router::start(args).await.unwrap() })
    };
    let long_stream = |c: &mlaserve_proto::v1::generation_client::GenerationClient<tonic::transport::Channel>| {
        let mut c = c.clone();
        tokio::spawn(async move {
            let room = c
                .get_model_info(mlaserve_proto::v1::GetModelInfoRequest {})
                .await
                .unwrap()
                .into_inner()
                .max_context_tokens
                - 16;
            collect(&mut c, ids_request(vec![5, 6, 7, 8], room)).await
        })
    };

    // The worker's drain timeout passes.
    let mut a = {
        let mut w = WorkerArgs::new(model_path());
        w.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        w.drain_timeout_s = 0;
        Background::start(move || async move { start_cpu_worker(w).await })
    };
    let r = start_router(a.get().addr);
    let pool = r.get().pool().clone();
    assert!(eventually(READY, || pool.ready_count() == 1).await);
    let c = client(r.get().addr).await;
    let stream = long_stream(&c);
    let engine = a.get().engine.clone();
    assert!(eventually(Duration::from_secs(10), || streamed_some(&engine)).await);
    let h = a.handle.take().unwrap();
    on_own_runtime(h.shutdown());
    let got = stream.await.unwrap();
    let e = got.error.expect("the stream was cut");
    assert!(!got.tokens.is_empty(), "it had streamed");
    assert!(e.message().contains("worker group is stopping") && e.message().contains("drain timeout"), "{e:?}");
    drop((r, a));

    // The router's drain timeout passes.
    let b = {
        let mut w = WorkerArgs::new(model_path());
        w.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        Background::start(move || async move { start_cpu_worker(w).await })
    };
    let mut r = start_router(b.get().addr);
    let pool = r.get().pool().clone();
    assert!(eventually(READY, || pool.ready_count() == 1).await);
    let c = client(r.get().addr).await;
    let stream = long_stream(&c);
    let engine = b.get().engine.clone();
    assert!(eventually(Duration::from_secs(10), || streamed_some(&engine)).await);
    let h = r.handle.take().unwrap();
    on_own_runtime(async move {
        h.drain(Duration::from_millis(1)).await;
        h.shutdown().await;
    });
    let got = stream.await.unwrap();
    let e = got.error.expect("the stream was cut");
    assert!(e.message().contains("router is stopping") && e.message().contains("drain timeout"), "{e:?}");
    drop((r, b));
}
