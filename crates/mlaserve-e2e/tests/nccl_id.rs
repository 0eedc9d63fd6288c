//! The NCCL-id exchange of multi-process TP groups through a real etcd on loopback: the
//! leader's ids reach a follower that started first; the key lives under the leader's
//! lease and disappears when the leader stops; a follower with no leader gets a clear
//! error in bounded time.

mod common;

use common::EtcdServer;
use mlaserve_worker::nccl_id;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_travel_through_etcd_under_the_leaders_lease() {
    let etcd = EtcdServer::start();
    let eps = vec![etcd.endpoint.clone()];
    let ids: Vec<u8> = (0..=255u8).collect();
    // The follower starts before the leader and waits.
    let follower = {
        let eps = eps.clone();
        tokio::spawn(async move { nccl_id::fetch(&eps, "c", "g0", Duration::from_secs(10)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let published = nccl_id::publish(&eps, "c", "g0", &ids, Duration::from_secs(2)).await.expect("publish");
    assert_eq!(follower.await.expect("join").expect("fetch"), ids);
    // Kept alive past its TTL while the leader lives.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(nccl_id::fetch(&eps, "c", "g0", Duration::from_millis(100)).await.expect("still there"), ids);
    published.stop().await;
    let t = Instant::now();
    let e = nccl_id::fetch(&eps, "c", "g0", Duration::from_millis(500)).await.expect_err("gone").to_string();
    assert!(e.contains("/mlaserve/c/groups/g0/nccl_id") && e.contains("rank 0"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(3));
}
