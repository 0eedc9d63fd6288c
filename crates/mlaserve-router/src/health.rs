//! `grpc.health.v1`: SERVING while at least one group is ready and the router is not
//! draining; NOT_SERVING otherwise. Reported for the whole server ("") and for
//! `mlaserve.v1.Generation`.

use crate::pool::Pool;
use mlaserve_proto::v1::generation_server::GenerationServer;
use tokio::sync::watch;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// Keeps `reporter` in step with the pool and the drain flag until both senders close.
pub async fn follow(reporter: HealthReporter, pool: Pool, mut draining: watch::Receiver<bool>) {
    let mut ready = pool.ready_watch();
    loop {
        let serving = *ready.borrow_and_update() > 0 && !*draining.borrow_and_update();
        set(&reporter, serving).await;
        tokio::select! {
            r = ready.changed() => if r.is_err() { return },
            r = draining.changed() => if r.is_err() { return },
        }
    }
}

/// Sets the status of "" and `mlaserve.v1.Generation`.
pub async fn set(reporter: &HealthReporter, serving: bool) {
    let status = if serving { ServingStatus::Serving } else { ServingStatus::NotServing };
    reporter.set_service_status("", status).await;
    if serving {
        reporter.set_serving::<GenerationServer<crate::service::GenerationService>>().await;
    } else {
        reporter.set_not_serving::<GenerationServer<crate::service::GenerationService>>().await;
    }
}
