//! Finding worker groups: a static list, or an etcd prefix watch.
//!
//! etcd layout (DESIGN §6–7): a group's leader puts
//! `/mlaserve/<cluster>/groups/<group>` = `{"addr": "http://host:port", ...}` under a
//! lease it keeps alive, and only once every rank is ready; if the leader dies, the
//! lease expires and the key vanishes. Deeper keys under a group (`.../nccl_id`) belong
//! to the rank bootstrap and are ignored here. Both sides of the layout live in this
//! module so they cannot drift apart.

use crate::etcd::{Change, Etcd, EtcdError};
use crate::pool::Pool;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The key prefix under which the groups of `cluster` register.
pub fn groups_prefix(cluster: &str) -> String {
    format!("/mlaserve/{cluster}/groups/")
}

/// The key a group registers under.
pub fn group_key(cluster: &str, group: &str) -> String {
    format!("{}{group}", groups_prefix(cluster))
}

/// What a registered group advertises.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// The leader's gRPC address, `http://host:port`.
    pub addr: String,
    #[serde(default)]
    pub tp_size: u32,
}

/// Adds each static `--worker` address as a group named by its address.
pub fn add_static(pool: &Pool, addrs: &[String]) {
    for a in addrs {
        let addr = normalize_addr(a);
        pool.upsert(&addr, &addr);
    }
}

/// `host:port` → `http://host:port`.
pub fn normalize_addr(a: &str) -> String {
    if a.contains("://") {
        a.to_string()
    } else {
        format!("http://{a}")
    }
}

/// Mirrors the groups registered in etcd into `pool` until the task is dropped.
/// Survives etcd restarts: it re-lists and re-watches, keeping known groups meanwhile.
pub async fn watch_etcd(pool: Pool, endpoints: Vec<String>, cluster: String) {
    let prefix = groups_prefix(&cluster);
    loop {
        if let Err(e) = watch_once(&pool, &endpoints, &prefix).await {
            tracing::warn!(error = %e, "etcd watch failed; retrying");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn watch_once(pool: &Pool, endpoints: &[String], prefix: &str) -> Result<(), EtcdError> {
    let etcd = Etcd::connect(endpoints).await?;
    let (kvs, rev) = etcd.list(prefix.as_bytes()).await?;
    let mut present = Vec::new();
    for (key, value) in &kvs {
        if let Some((name, reg)) = parse(prefix, key, Some(value)) {
            pool.upsert(&name, &reg.addr);
            present.push(name);
        }
    }
    for name in pool.names() {
        if !present.contains(&name) {
            pool.remove(&name);
        }
    }
    let mut changes = etcd.watch(prefix.as_bytes(), rev + 1).await?;
    while let Some(batch) = changes.recv().await {
        for c in batch {
            match c {
                Change::Put { key, value } => {
                    if let Some((name, reg)) = parse(prefix, &key, Some(&value)) {
                        pool.upsert(&name, &reg.addr);
                    }
                }
                Change::Delete { key } => {
                    if let Some((name, _)) = parse(prefix, &key, None) {
                        pool.remove(&name);
                    }
                }
            }
        }
    }
    Err(EtcdError::Protocol("watch ended".into()))
}

/// `(group name, registration)` of a key under `prefix`; `None` for deeper keys or bad values.
fn parse(prefix: &str, key: &[u8], value: Option<&[u8]>) -> Option<(String, Registration)> {
    let key = std::str::from_utf8(key).ok()?;
    let name = key.strip_prefix(prefix)?;
    if name.is_empty() || name.contains('/') {
        return None;
    }
    let reg = match value {
        Some(v) => match serde_json::from_slice::<Registration>(v) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(key, error = %e, "ignoring a malformed group registration");
                return None;
            }
        },
        None => Registration { addr: String::new(), tp_size: 0 },
    };
    Some((name.to_string(), reg))
}

/// A group's registration in etcd, kept alive by a background task until
/// [`Registered::deregister`] or drop (after which the lease lapses within its TTL).
#[derive(Debug)]
pub struct Registered {
    task: tokio::task::JoinHandle<()>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Registered {
    /// Deletes the key now (graceful shutdown) and stops the keep-alive.
    pub async fn deregister(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Registers `group` under a lease of `ttl` and keeps it alive (re-granting and
/// re-putting if etcd lost it). Returns once the first put succeeded.
pub async fn register(
    endpoints: Vec<String>,
    cluster: &str,
    group: &str,
    reg: Registration,
    ttl: Duration,
) -> Result<Registered, EtcdError> {
    let key = group_key(cluster, group).into_bytes();
    let value = serde_json::to_vec(&reg).map_err(|e| EtcdError::Protocol(e.to_string()))?;
    let ttl_s = ttl.as_secs().max(1) as i64;
    let etcd = Etcd::connect(&endpoints).await?;
    let mut lease = put_with_lease(&etcd, &key, &value, ttl_s).await?;
    tracing::info!(key = %String::from_utf8_lossy(&key), addr = %reg.addr, "registered in etcd");
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let period = Duration::from_millis((ttl_s as u64 * 1000 / 3).max(200));
        let mut keeper: Option<crate::etcd::KeepAlive> = None;
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
                    Some(k) => matches!(k.refresh().await, Ok(ttl) if ttl > 0),
                    None => match etcd.keep_alive(lease).await {
                        Ok((k, ttl)) => {
                            keeper = Some(k);
                            ttl > 0
                        }
                        Err(_) => false,
                    },
                }
            };
            let alive = tokio::time::timeout(period, round).await.unwrap_or(false);
            if !alive {
                keeper = None;
                tracing::warn!(key = %String::from_utf8_lossy(&key), "etcd lease lost; registering again");
                match put_with_lease(&etcd, &key, &value, ttl_s).await {
                    Ok(l) => lease = l,
                    Err(e) => tracing::warn!(error = %e, "etcd re-registration failed"),
                }
            }
        }
    });
    Ok(Registered { task, stop: Some(stop_tx) })
}

async fn put_with_lease(etcd: &Etcd, key: &[u8], value: &[u8], ttl_s: i64) -> Result<i64, EtcdError> {
    let lease = etcd.grant(ttl_s).await?;
    etcd.put(key, value, lease).await?;
    Ok(lease)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_parsing() {
        let p = groups_prefix("prod");
        assert_eq!(group_key("prod", "g0"), "/mlaserve/prod/groups/g0");
        let v = br#"{"addr":"http://10.0.0.1:7000","tp_size":8}"#;
        let (name, reg) = parse(&p, b"/mlaserve/prod/groups/g0", Some(v)).expect("parsed");
        assert_eq!(name, "g0");
        assert_eq!(reg.addr, "http://10.0.0.1:7000");
        assert!(parse(&p, b"/mlaserve/prod/groups/g0/nccl_id", Some(b"xx")).is_none(), "deeper keys ignored");
        assert!(parse(&p, b"/mlaserve/prod/groups/g1", Some(b"not json")).is_none());
        assert!(parse(&p, b"/mlaserve/other/groups/g1", Some(v)).is_none());
    }

    #[test]
    fn static_addresses_get_a_scheme() {
        assert_eq!(normalize_addr("127.0.0.1:5"), "http://127.0.0.1:5");
        assert_eq!(normalize_addr("http://h:5"), "http://h:5");
    }
}
