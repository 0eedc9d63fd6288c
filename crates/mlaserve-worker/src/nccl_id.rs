//! NCCL unique-id exchange through etcd (DESIGN §6), for multi-process TP groups whose
//! ranks reach etcd: the leader publishes the group's ids under
//! `/mlaserve/<cluster>/groups/<group>/nccl_id` with a lease it keeps alive while it
//! lives; followers wait for the key. (Without etcd the ranks use the TCP rendezvous of
//! `mlaserve-tp`.) The router's discovery ignores keys below a group's own key.

use mlaserve_router::etcd::{Etcd, EtcdError};
use std::time::{Duration, Instant};

/// The key of a group's NCCL ids.
pub fn key(cluster: &str, group: &str) -> String {
    format!("/mlaserve/{cluster}/groups/{group}/nccl_id")
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &[u8]) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    s.chunks(2).map(|p| u8::from_str_radix(std::str::from_utf8(p).ok()?, 16).ok()).collect()
}

/// The leader's published ids; the lease is revoked when this is dropped or stopped.
#[derive(Debug)]
pub struct Published {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Published {
    /// Revokes the lease (the key disappears at once).
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for Published {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// Publishes `ids` for `group` under a lease of `ttl`, kept alive in the background.
pub async fn publish(
    endpoints: &[String],
    cluster: &str,
    group: &str,
    ids: &[u8],
    ttl: Duration,
) -> Result<Published, EtcdError> {
    let etcd = Etcd::connect(endpoints).await?;
    let ttl_s = ttl.as_secs().max(1) as i64;
    let lease = etcd.grant(ttl_s).await?;
    etcd.put(key(cluster, group).as_bytes(), hex(ids).as_bytes(), lease).await?;
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let period = Duration::from_millis((ttl_s as u64 * 1000 / 3).max(200));
        let mut keeper = None;
        loop {
            tokio::select! {
                _ = &mut stop_rx => {
                    let _ = etcd.revoke(lease).await;
                    return;
                }
                _ = tokio::time::sleep(period) => {}
            }
            let alive = match keeper.as_mut() {
                Some(k) => {
                    matches!(tokio::time::timeout(period, mlaserve_router::etcd::KeepAlive::refresh(k)).await, Ok(Ok(t)) if t > 0)
                }
                None => match etcd.keep_alive(lease).await {
                    Ok((k, t)) => {
                        keeper = Some(k);
                        t > 0
                    }
                    Err(_) => false,
                },
            };
            if !alive {
                tracing::warn!("lost the etcd lease of the group's NCCL ids");
                keeper = None;
            }
        }
    });
    Ok(Published { stop: Some(stop_tx), task })
}

/// Waits (polling) until the group's ids appear, up to `timeout`.
pub async fn fetch(endpoints: &[String], cluster: &str, group: &str, timeout: Duration) -> Result<Vec<u8>, EtcdError> {
    let deadline = Instant::now() + timeout;
    let k = key(cluster, group);
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

#[cfg(test)]
mod tests {
    #[test]
    fn hex_round_trip() {
        let b: Vec<u8> = (0..=255).collect();
        assert_eq!(super::unhex(super::hex(&b).as_bytes()).unwrap(), b);
        assert!(super::unhex(b"abc").is_none());
    }
}
