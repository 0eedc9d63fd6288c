//! The router's own metric updates; the recorder, the endpoint and every metric's
//! description live in `mlaserve_cluster::metrics`.

use mlaserve_proto::worker::Load;

/// Publishes a group's load report.
pub fn group_load(group: &str, l: &Load) {
    let used = if l.kv_blocks_total == 0 { 0.0 } else { 1.0 - l.kv_blocks_free as f64 / l.kv_blocks_total as f64 };
    set_group(group, l.running as f64, l.waiting as f64, used);
}

/// Zeroes a group's series once it is down or removed, so no dashboard shows the last
/// load of a dead group. Zeroed rather than removed: `metrics-exporter-prometheus`
/// drops a series only when an idle timeout expires, which would also drop gauges that
/// are set only on change (such as `mlaserve_ready_groups`).
pub fn group_gone(group: &str) {
    set_group(group, 0.0, 0.0, 0.0);
}

fn set_group(group: &str, running: f64, waiting: f64, used: f64) {
    let g = group.to_string();
    metrics::gauge!("mlaserve_requests_running", "group" => g.clone()).set(running);
    metrics::gauge!("mlaserve_requests_waiting", "group" => g.clone()).set(waiting);
    metrics::gauge!("mlaserve_kv_cache_usage_ratio", "group" => g).set(used);
}

/// The number of ready groups.
pub fn ready_groups(n: usize) {
    metrics::gauge!("mlaserve_ready_groups").set(n as f64);
}

/// The etcd watch broke and is being re-established (see `discovery::watch_etcd`).
pub fn watch_restarted() {
    metrics::counter!("mlaserve_etcd_watch_restarts_total").increment(1);
}
