//! Cache-aware routing: two CPU worker groups behind one router, each with a KV cache
//! that holds about half of the workload's system prompts. The shared-prefix workload
//! of `bench serve` (two-turn conversations over 8 system prompts of 320 tokens, 4 at
//! once) finds more of its prompt tokens in the prefix caches with `--routing-policy
//! prefix-affinity` than with `least-loaded` (at least 1.1×; ~1.2× measured, 65% vs
//! 54%), and no group is ever loaded past the affinity bound by more than the one
//! request a decision can add. Least-loaded is affine by accident here: a turn's group
//! is the least loaded one the moment that turn finishes, so the next turn mostly
//! follows it.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use mlaserve::client::{bench, BenchArgs, BenchReport, Workload};
use mlaserve_router::balance::RoutingPolicy;
use mlaserve_router::{RouterArgs, RouterHandle};
use mlaserve_worker::{WorkerArgs, WorkerHandle};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const SLACK: u64 = 512;
const SYSTEM: usize = 320;
const TURNS: usize = 2;
const USER: usize = 32;
const NEW: u32 = 32;

fn worker() -> Background<WorkerHandle> {
    let mut a = WorkerArgs::new(model_path());
    a.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    a.engine.kv_blocks = Some(30);
    a.engine.max_num_seqs = 4;
    Background::start(move || async move { start_cpu_worker(a).await })
}

/// Runs the workload through a router with `policy` over two fresh groups; returns the
/// report and the most any group's outstanding tokens exceeded the bound.
async fn run(policy: RoutingPolicy) -> (BenchReport, i64) {
    let (a, b) = (worker(), worker());
    let r: Background<RouterHandle> = {
        let mut args = RouterArgs::new(model_path());
        args.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        args.workers = vec![format!("http://{}", a.get().addr), format!("http://{}", b.get().addr)];
        args.routing_policy = policy;
        args.affinity_slack_tokens = SLACK;
        Background::start(move || async move { mlaserve_router::start(args).await.unwrap() })
    };
    let pool = r.get().pool().clone();
    assert!(eventually(Duration::from_secs(10), || pool.ready_count() == 2).await);
    // Watch both groups' load while the workload runs.
    let (ea, eb) = (a.get().engine.clone(), b.get().engine.clone());
    let (stop, worst) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicI64::new(i64::MIN)));
    let watch = {
        let (stop, worst) = (stop.clone(), worst.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let (x, y) = (ea.load().outstanding_tokens, eb.load().outstanding_tokens);
                let over = x.max(y) as i64 - (2 * x.min(y) + SLACK) as i64;
                worst.fetch_max(over, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let mut args = BenchArgs::new(format!("http://{}", r.get().addr));
    args.workload = Workload::SharedPrefix;
    args.system_prompts = 8;
    args.system_prompt_tokens = (SYSTEM, SYSTEM);
    args.turns = TURNS;
    args.prompt_tokens = USER;
    args.max_new_tokens = NEW;
    args.requests = 96;
    args.concurrency = 4;
    args.vocab = 500;
    args.time_limit_s = 300;
    let report = bench(&args).await.unwrap();
    stop.store(true, Ordering::Relaxed);
    watch.await.unwrap();
    (report, worst.load(Ordering::Relaxed))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_affinity_finds_more_of_the_prompts_cached() {
    let (ll, ll_over) = run(RoutingPolicy::LeastLoaded).await;
    let (pa, pa_over) = run(RoutingPolicy::PrefixAffinity).await;
    for (name, r, over) in [("least-loaded", &ll, ll_over), ("prefix-affinity", &pa, pa_over)] {
        println!(
            "{name}: {:.1}% of {} prompt tokens cached, TTFT p50 {:.1} ms p99 {:.1} ms, {:.1} tokens/s, \
             worst excess over the bound {over} tokens",
            100.0 * r.cached_ratio(),
            r.prompt_tokens,
            r.ttft.p50,
            r.ttft.p99,
            r.tokens_per_s()
        );
        assert_eq!((r.ok, r.requests), (96, 96), "{name}: {:?}", r.errors);
    }
    assert!(
        pa.cached_ratio() >= 1.1 * ll.cached_ratio(),
        "prefix affinity {:.3} vs least loaded {:.3}",
        pa.cached_ratio(),
        ll.cached_ratio()
    );
    // A decision keeps the chosen group within the bound; the request it adds is at
    // most its prompt and new tokens.
    let one_request = (SYSTEM + TURNS * (USER + NEW as usize)) as i64;
    assert!(pa_over <= one_request, "a group went {pa_over} tokens past the affinity bound");
}
