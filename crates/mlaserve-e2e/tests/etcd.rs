//! etcd discovery with a real etcd server on loopback: two groups register under
//! leases; killing one mid-stream ends its requests with UNAVAILABLE within 5 s while
//! the other group keeps serving and health stays SERVING; killing both turns health
//! NOT_SERVING.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use mlaserve_router::RouterHandle;
use mlaserve_worker::WorkerHandle;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;
use tonic::Code;
use tonic_health::pb::{health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest};

const CLUSTER: &str = "e2e";

fn worker(etcd: &str, group: &str) -> Background<WorkerHandle> {
    etcd_worker(etcd, CLUSTER, group, 2)
}

fn router(etcd: &str) -> Background<RouterHandle> {
    etcd_router(etcd, CLUSTER)
}

async fn health(addr: SocketAddr) -> i32 {
    let ch = tonic::transport::Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    let mut h = HealthClient::new(ch);
    h.check(HealthCheckRequest { service: String::new() }).await.unwrap().into_inner().status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_groups_kill_one_then_both() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_default())
        .with_test_writer()
        .try_init();
    let etcd = EtcdServer::start();
    let r = router(&etcd.endpoint);
    let addr = r.get().addr;
    assert_eq!(health(addr).await, ServingStatus::NotServing as i32, "no group yet");
    let mut g1 = worker(&etcd.endpoint, "g1");
    let mut g2 = worker(&etcd.endpoint, "g2");
    let pool = r.get().pool().clone();
    assert!(eventually(READY, || pool.ready_count() == 2).await, "both groups must register");
    assert_eq!(health(addr).await, ServingStatus::Serving as i32);

    // Long streams spread over both groups (least outstanding tokens each time).
    let mut c = client(addr).await;
    let room =
        c.get_model_info(mlaserve_proto::v1::GetModelInfoRequest {}).await.unwrap().into_inner().max_context_tokens - 8;
    let mut streams = Vec::new();
    for i in 0..8u32 {
        let mut s =
            c.generate(ids_request((0..8).map(|k| 2 + (k + i * 8) % 500).collect(), room)).await.unwrap().into_inner();
        let first = s.next().await.unwrap().unwrap();
        assert!(!first.token_ids.is_empty() || !first.text.is_empty() || first.finish.is_none());
        streams.push(s);
    }
    let g1_busy = g1.get().engine.load();
    assert!(g1_busy.running_requests + g1_busy.queued_requests > 0, "g1 must have requests in flight: {g1_busy:?}");

    let killed = Instant::now();
    g1.kill();
    let mut unavailable = 0;
    let mut completed = 0;
    for mut s in streams {
        let outcome = tokio::time::timeout(Duration::from_secs(60), async {
            let mut finals = 0;
            while let Some(m) = s.next().await {
                match m {
                    Ok(m) => finals += m.finish.is_some() as usize,
                    Err(e) => return Err((e, killed.elapsed())),
                }
            }
            Ok(finals)
        })
        .await
        .expect("a stream hung after its group died");
        match outcome {
            Ok(finals) => {
                assert_eq!(finals, 1);
                completed += 1;
            }
            Err((e, after)) => {
                assert_eq!(e.code(), Code::Unavailable, "{}", e.message());
                assert!(after < Duration::from_secs(5), "UNAVAILABLE came {after:?} after the kill");
                unavailable += 1;
            }
        }
    }
    assert!(unavailable > 0, "the killed group's streams must fail");
    assert!(completed > 0, "the survivor's streams must complete");

    // New requests go to the survivor; health stays SERVING; the lease expires.
    assert_eq!(health(addr).await, ServingStatus::Serving as i32);
    for _ in 0..4 {
        assert_still_serves(&mut c).await;
    }
    assert!(
        eventually(Duration::from_secs(10), || !pool.names().contains(&"g1".to_string())).await,
        "g1's lease must expire and its key vanish"
    );
    let ready: Vec<String> = pool.ready_groups().iter().map(|g| g.name.clone()).collect();
    assert_eq!(ready, vec!["g2".to_string()], "known: {:?}", pool.names());

    g2.kill();
    let mut not_serving = false;
    for _ in 0..100 {
        if health(addr).await == ServingStatus::NotServing as i32 {
            not_serving = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(not_serving, "health must turn NOT_SERVING with both groups dead");
    let e = collect(&mut c, text_request("anyone?", 2)).await.error.unwrap();
    assert_eq!(e.code(), Code::Unavailable, "{}", e.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_worker_shutdown_deregisters_at_once() {
    let etcd = EtcdServer::start();
    let r = router(&etcd.endpoint);
    let pool = r.get().pool().clone();
    let mut w = worker(&etcd.endpoint, "g-graceful");
    assert!(eventually(READY, || pool.ready_count() == 1).await);
    // The registration carries the group's address and its real TP size.
    let kv = mlaserve_cluster::Etcd::connect(std::slice::from_ref(&etcd.endpoint)).await.unwrap();
    let key = mlaserve_cluster::keys::group_key(CLUSTER, "g-graceful");
    let (kvs, _) = kv.list(key.as_bytes()).await.unwrap();
    let reg: mlaserve_cluster::Registration = serde_json::from_slice(&kvs[0].1).unwrap();
    assert_eq!(reg.addr, format!("http://{}", w.get().addr));
    assert_eq!(reg.tp_size, 1);
    // A lease TTL is 2 s; a graceful stop revokes it, so the key goes at once.
    let h = w.handle.take().unwrap();
    let t = Instant::now();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(h.shutdown());
    })
    .join()
    .unwrap();
    assert!(eventually(Duration::from_secs(2), || pool.names().is_empty()).await);
    assert!(t.elapsed() < Duration::from_secs(2) + Duration::from_millis(900));
}
