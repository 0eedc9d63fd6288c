//! Admission: a bounded number of requests in flight per router.
//!
//! A request holds a permit from arrival until its stream ends. When all permits are
//! taken the next request gets RESOURCE_EXHAUSTED at once rather than waiting: queueing
//! happens in the groups' schedulers, which see the whole batch, and a client or an L4
//! balancer can retry on another router sooner than a deep queue would drain.

use crate::error::RouterError;
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The bounded admission queue (see the module docs).
#[derive(Debug, Clone)]
pub struct Admission {
    sem: Arc<Semaphore>,
    capacity: usize,
}

/// Proof of admission; dropping it frees the slot.
#[derive(Debug)]
pub struct Permit(#[allow(dead_code)] OwnedSemaphorePermit);

impl Admission {
    pub fn new(capacity: usize) -> Self {
        Admission { sem: Arc::new(Semaphore::new(capacity)), capacity }
    }

    /// Takes a slot now or fails with [`RouterError::QueueFull`].
    pub fn try_admit(&self) -> Result<Permit, RouterError> {
        self.sem.clone().try_acquire_owned().map(Permit).map_err(|_| RouterError::QueueFull(self.capacity))
    }

    /// Requests admitted right now.
    pub fn in_flight(&self) -> usize {
        self.capacity - self.sem.available_permits()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn n_plus_one_is_refused_and_slots_come_back() {
        let a = Admission::new(2);
        let p1 = a.try_admit().expect("1");
        let _p2 = a.try_admit().expect("2");
        assert_eq!(a.try_admit().unwrap_err(), RouterError::QueueFull(2));
        assert_eq!(a.in_flight(), 2);
        drop(p1);
        assert!(a.try_admit().is_ok());
    }
}
