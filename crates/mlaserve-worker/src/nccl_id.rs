//! NCCL unique-id exchange through etcd, for multi-process TP groups whose ranks reach
//! etcd: the leader publishes the group's ids at `keys::nccl_id_key` under a lease it
//! keeps alive while it lives; followers wait for the key. (Without etcd the ranks use
//! the TCP rendezvous of `mlaserve-tp`.) Routers ignore keys below a group's own key.

use mlaserve_cluster::keys::{hex, nccl_id_key, unhex};
use mlaserve_cluster::{Etcd, EtcdError, LeasedKey};
use std::time::{Duration, Instant};

/// Publishes `ids` for `group` under a lease of `ttl`, kept alive in the background;
/// stopping or dropping the returned key revokes it.
pub async fn publish(
    endpoints: &[String],
    cluster: &str,
    group: &str,
    ids: &[u8],
    ttl: Duration,
) -> Result<LeasedKey, EtcdError> {
    LeasedKey::put(endpoints, nccl_id_key(cluster, group), hex(ids).into_bytes(), ttl).await
}

/// Waits (polling) until the group's ids appear, up to `timeout`.
pub async fn fetch(endpoints: &[String], cluster: &str, group: &str, timeout: Duration) -> Result<Vec<u8>, EtcdError> {
    let deadline = Instant::now() + timeout;
    let k = nccl_id_key(cluster, group);
    let etcd = Etcd::connect(endpoints).await?;
    loop {
        let (kvs, _) = etcd.list(k.as_bytes()).await?;
        if let Some((_, v)) = kvs.iter().find(|(kk, _)| kk.as_slice() == k.as_bytes()) {
            return unhex(v).ok_or_else(|| EtcdError::Protocol(format!("{k}: value is not hex")));
        }
        if Instant::now() >= deadline {
            return Err(EtcdError::Protocol(format!(
                "{k}: no NCCL ids after {timeout:?} (is rank 0 of the group up?)"
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
