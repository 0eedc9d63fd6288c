//! Finding worker groups: a static list, or a watch of the groups' keys in etcd (the
//! layout is `mlaserve_cluster::keys`: a group's key exists while its leader lives and
//! every rank is ready).

use crate::pool::Pool;
use mlaserve_cluster::etcd::{Change, Etcd, EtcdError};
use mlaserve_cluster::keys::{groups_prefix, normalize_addr, parse_group};
use std::time::Duration;

/// Adds each static `--worker` address as a group named by its address.
pub fn add_static(pool: &Pool, addrs: &[String]) {
    for a in addrs {
        let addr = normalize_addr(a);
        pool.upsert(&addr, &addr);
    }
}

/// Mirrors the groups registered in etcd into `pool` until the task is dropped.
/// Survives etcd restarts: it re-lists and re-watches, keeping known groups meanwhile.
/// Each restart counts in `mlaserve_etcd_watch_restarts_total`: against a healthy etcd
/// it stays 0.
pub async fn watch_etcd(pool: Pool, endpoints: Vec<String>, cluster: String) {
    let prefix = groups_prefix(&cluster);
    loop {
        if let Err(e) = watch_once(&pool, &endpoints, &prefix).await {
            tracing::warn!(error = %e, "etcd watch failed; retrying");
        }
        crate::metrics::watch_restarted();
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn watch_once(pool: &Pool, endpoints: &[String], prefix: &str) -> Result<(), EtcdError> {
    let etcd = Etcd::connect(endpoints).await?;
    let (kvs, rev) = etcd.list(prefix.as_bytes()).await?;
    let mut present = Vec::new();
    for (key, value) in &kvs {
        if let Some((name, Some(reg))) = parse_group(prefix, key, Some(value)) {
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
                    if let Some((name, Some(reg))) = parse_group(prefix, &key, Some(&value)) {
                        pool.upsert(&name, &reg.addr);
                    }
                }
                Change::Delete { key } => {
                    if let Some((name, _)) = parse_group(prefix, &key, None) {
                        pool.remove(&name);
                    }
                }
            }
        }
    }
    Err(EtcdError::Protocol("watch ended".into()))
}
