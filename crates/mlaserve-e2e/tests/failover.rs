//! Failover without etcd: a request that has not streamed a token yet when its group
//! dies is retried on another group (and completes with the same greedy tokens); one
//! that has streamed tokens ends with UNAVAILABLE.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use mlaserve_router::{RouterArgs, RouterHandle};
use mlaserve_worker::{WorkerArgs, WorkerHandle};
use std::net::SocketAddr;
use std::time::Duration;
use tokio_stream::StreamExt;
use tonic::Code;

fn worker(max_num_seqs: usize) -> Background<WorkerHandle> {
    let mut a = WorkerArgs::new(model_path());
    a.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    a.engine.max_num_seqs = max_num_seqs;
    a.engine.kv_blocks = Some(128);
    Background::start(move || async move { start_cpu_worker(a).await })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_request_is_retried_on_the_survivor() {
    // Group A runs one request at a time, so a second one waits in its queue.
    let mut a = worker(1);
    let a_addr = format!("http://{}", a.get().addr);
    let r: Background<RouterHandle> = {
        let mut args = RouterArgs::new(model_path());
        args.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        args.workers = vec![a_addr.clone()];
        Background::start(move || async move { mlaserve_router::start(args).await.unwrap() })
    };
    let pool = r.get().pool().clone();
    assert!(eventually(READY, || pool.ready_count() == 1).await);
    let mut c = client(r.get().addr).await;

    // R1 streams tokens from A; R2 waits in A's queue.
    let room =
        c.get_model_info(mlaserve_proto::v1::GetModelInfoRequest {}).await.unwrap().into_inner().max_context_tokens - 8;
    let mut r1 = c.generate(ids_request((2..10).collect(), room)).await.unwrap().into_inner();
    assert!(!r1.next().await.unwrap().unwrap().token_ids.is_empty());
    let r2_prompt: Vec<u32> = (20..36).collect();
    let mut c2 = c.clone();
    let p2 = r2_prompt.clone();
    let r2 = tokio::spawn(async move { collect(&mut c2, ids_request(p2, 12)).await });
    let engine_a = a.get().engine.clone();
    assert!(
        eventually(Duration::from_secs(5), || engine_a.load().queued_requests == 1).await,
        "R2 must wait in A's queue: {:?}",
        engine_a.load()
    );

    // B joins; A dies.
    let b = worker(8);
    pool.upsert("b", &format!("http://{}", b.get().addr));
    assert!(eventually(READY, || pool.ready_count() == 2).await);
    a.kill();

    // R1 had tokens: UNAVAILABLE. R2 had none: retried on B, same greedy tokens.
    let err = loop {
        match tokio::time::timeout(Duration::from_secs(5), r1.next()).await.expect("R1 must end within 5 s") {
            Some(Ok(m)) => assert!(m.finish.is_none(), "R1 cannot finish: A was killed"),
            Some(Err(e)) => break e,
            None => panic!("R1 ended without a status"),
        }
    };
    assert_eq!(err.code(), Code::Unavailable, "{}", err.message());
    let got = r2.await.unwrap();
    assert!(got.error.is_none(), "R2 must be retried, got {:?}", got.error);
    assert_eq!(got.finals, 1);
    let want = engine_greedy(
        &r2_prompt,
        mlaserve_engine::SamplingParams { max_new_tokens: 12, ignore_eos: true, ..Default::default() },
        64,
    );
    assert_eq!(got.tokens, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_go_to_the_group_with_fewer_outstanding_tokens() {
    let a = worker(8);
    let b = worker(8);
    let r: Background<RouterHandle> = {
        let mut args = RouterArgs::new(model_path());
        args.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        args.workers = vec![format!("http://{}", a.get().addr), format!("http://{}", b.get().addr)];
        Background::start(move || async move { mlaserve_router::start(args).await.unwrap() })
    };
    let pool = r.get().pool().clone();
    assert!(eventually(READY, || pool.ready_count() == 2).await);
    let mut c = client(r.get().addr).await;
    let room =
        c.get_model_info(mlaserve_proto::v1::GetModelInfoRequest {}).await.unwrap().into_inner().max_context_tokens;

    // One big request (a long prompt and many new tokens) on one group...
    let big_prompt: Vec<u32> = (0..room / 2).map(|k| 2 + k % 500).collect();
    let mut big = c.generate(ids_request(big_prompt, room / 2 - 8)).await.unwrap().into_inner();
    assert!(!big.next().await.unwrap().unwrap().token_ids.is_empty());
    // ...then six small ones, all owing far fewer tokens together: they go to the other.
    let mut small = tokio::task::JoinSet::new();
    for i in 0..6u32 {
        let mut c = c.clone();
        small.spawn(async move { collect(&mut c, ids_request((0..8).map(|k| 3 + k + i * 8).collect(), 16)).await });
    }
    while let Some(s) = small.join_next().await {
        assert!(s.unwrap().error.is_none());
    }
    let fa = a.get().engine.stats().await.unwrap().finished_requests;
    let fb = b.get().engine.stats().await.unwrap().finished_requests;
    drop(big);
    // The big one may have finished too on a fast machine (7 in all): it counts on its
    // own group, which must have run none of the small ones.
    let big_done = fa + fb - 6;
    let (big_side, small_side) = if fa <= fb { (fa, fb) } else { (fb, fa) };
    assert!(big_done <= 1, "a: {fa}, b: {fb} finished");
    assert_eq!((big_side - big_done, small_side), (0, 6), "a: {fa}, b: {fb} finished (big one done: {big_done})");
}

/// `GetModelInfo` reports the groups' limits whether or not a group is ready right now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_info_keeps_the_groups_limits_while_none_is_ready() {
    let mut a = {
        let mut w = WorkerArgs::new(model_path());
        w.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        w.engine.kv_blocks = Some(128);
        w.engine.max_model_len = Some(100);
        Background::start(move || async move { start_cpu_worker(w).await })
    };
    let r: Background<RouterHandle> = {
        let mut args = RouterArgs::new(model_path());
        args.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        args.workers = vec![format!("http://{}", a.get().addr)];
        Background::start(move || async move { mlaserve_router::start(args).await.unwrap() })
    };
    let pool = r.get().pool().clone();
    assert!(eventually(READY, || pool.ready_count() == 1).await);
    let mut c = client(r.get().addr).await;
    let info = |mut c: mlaserve_proto::v1::generation_client::GenerationClient<tonic::transport::Channel>| async move {
        c.get_model_info(mlaserve_proto::v1::GetModelInfoRequest {}).await.unwrap().into_inner()
    };
    let up = info(c.clone()).await;
    assert_eq!(up.max_context_tokens, 100);
    a.kill();
    assert!(eventually(Duration::from_secs(10), || pool.ready_count() == 0).await);
    let down = info(c.clone()).await;
    assert_eq!((down.max_context_tokens, down.vocab_size), (up.max_context_tokens, up.vocab_size));
    assert_eq!(down.ready_groups, 0);
    let e = collect(&mut c, ids_request(vec![7; 120], 4)).await.error.expect("refused");
    assert_eq!(e.code(), Code::InvalidArgument, "the known limit still applies: {}", e.message());
}
