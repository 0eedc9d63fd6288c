//! The model load as an operator watches it: a checkpoint of hundreds of GB takes
//! minutes, so the worker serves `/metrics` from the start and publishes the load's
//! progress there (bytes read, of how many, rate, time left) while the backend loads.

use mlaserve_model::progress::{LoadProgress, ProgressSnapshot};
use std::sync::Arc;
use std::time::Duration;

/// How often the gauges follow the load.
const PERIOD: Duration = Duration::from_millis(500);

/// Sets the load gauges from `s`.
pub fn record(s: &ProgressSnapshot) {
    metrics::gauge!("mlaserve_model_load_bytes_done").set(s.bytes_done as f64);
    metrics::gauge!("mlaserve_model_load_bytes_expected").set(s.bytes_total as f64);
    metrics::gauge!("mlaserve_model_load_bytes_per_second").set(s.gb_per_s() * 1e9);
    metrics::gauge!("mlaserve_model_load_remaining_seconds").set(s.eta().map_or(0.0, |d| d.as_secs_f64()));
}

/// Follows `progress` on the gauges until the returned handle is dropped or aborted
/// (call [`finish`] once the backend is loaded, for the final values).
pub fn follow(progress: Arc<LoadProgress>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            record(&progress.snapshot());
            tokio::time::sleep(PERIOD).await;
        }
    })
}

/// Stops following and records the final values.
pub fn finish(task: tokio::task::JoinHandle<()>, progress: &LoadProgress) {
    task.abort();
    let s = progress.finish();
    record(&s);
    tracing::info!("model loaded: {s}");
}
