//! The router's own metric updates; the recorder, the endpoint and every metric's
//! description live in `mlaserve_cluster::metrics`.

use mlaserve_proto::worker::Load;

/// Publishes a group's load report.
pub fn group_load(group: &str, l: &Load) {
    let g = group.to_string();
    metrics::gauge!("mlaserve_requests_running", "group" => g.clone()).set(l.running as f64);
    metrics::gauge!("mlaserve_requests_waiting", "group" => g.clone()).set(l.waiting as f64);
    let used = if l.kv_blocks_total == 0 { 0.0 } else { 1.0 - l.kv_blocks_free as f64 / l.kv_blocks_total as f64 };
    metrics::gauge!("mlaserve_kv_cache_usage_ratio", "group" => g).set(used);
}

/// The etcd watch broke and is being re-established (see `discovery::watch_etcd`).
pub fn watch_restarted() {
    metrics::counter!("mlaserve_etcd_watch_restarts_total").increment(1);
}
