//! [`LeasedKey`]: one etcd key that lives exactly as long as its owner.
//!
//! The owner puts the key under a fresh lease and a background task refreshes the lease
//! every third of its TTL, each round trip bounded by that period; if the lease is lost
//! (etcd restarted, a partition outlasted the TTL) the task grants a new one and puts
//! the key again. [`LeasedKey::stop`] (or dropping it) revokes the lease, so the key
//! disappears at once; a process that dies leaves the lease to expire within its TTL.
//! A group's registration and its NCCL ids are both kept this way.

use crate::etcd::{Etcd, EtcdError, KeepAlive};
use std::time::Duration;

/// A key kept alive under a lease by a background task.
#[derive(Debug)]
pub struct LeasedKey {
    key: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl LeasedKey {
    /// Puts `key` = `value` under a lease of `ttl` (at least a second) and keeps it
    /// alive. Returns once the first put succeeded.
    pub async fn put(endpoints: &[String], key: String, value: Vec<u8>, ttl: Duration) -> Result<Self, EtcdError> {
        let ttl_s = ttl.as_secs().max(1) as i64;
        let etcd = Etcd::connect(endpoints).await?;
        let mut lease = put_with_lease(&etcd, key.as_bytes(), &value, ttl_s).await?;
        let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel();
        let k = key.clone();
        let task = tokio::spawn(async move {
            let period = Duration::from_millis((ttl_s as u64 * 1000 / 3).max(200));
            let mut keeper: Option<KeepAlive> = None;
            loop {
                tokio::select! {
                    _ = &mut stop_rx => {
                        let _ = etcd.revoke(lease).await;
                        return;
                    }
                    _ = tokio::time::sleep(period) => {}
                }
                // Each round trip is bounded: a hung etcd connection counts as a lost lease.
                let round = async {
                    match keeper.as_mut() {
                        Some(ka) => matches!(ka.refresh().await, Ok(ttl) if ttl > 0),
                        None => match etcd.keep_alive(lease).await {
                            Ok((ka, ttl)) => {
                                keeper = Some(ka);
                                ttl > 0
                            }
                            Err(_) => false,
                        },
                    }
                };
                if !tokio::time::timeout(period, round).await.unwrap_or(false) {
                    keeper = None;
                    tracing::warn!(key = %k, "etcd lease lost; putting the key again");
                    match put_with_lease(&etcd, k.as_bytes(), &value, ttl_s).await {
                        Ok(l) => lease = l,
                        Err(e) => tracing::warn!(key = %k, error = %e, "etcd put failed; retrying"),
                    }
                }
            }
        });
        Ok(LeasedKey { key, stop: Some(stop_tx), task })
    }

    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Revokes the lease (the key disappears now) and waits for the keep-alive to end.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), &mut self.task).await;
    }
}

impl Drop for LeasedKey {
    /// Asks the keep-alive task to revoke the lease; if the runtime is gone the lease
    /// simply expires.
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

async fn put_with_lease(etcd: &Etcd, key: &[u8], value: &[u8], ttl_s: i64) -> Result<i64, EtcdError> {
    let lease = etcd.grant(ttl_s).await?;
    etcd.put(key, value, lease).await?;
    Ok(lease)
}
