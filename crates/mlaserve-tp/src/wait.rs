//! [`Waiter`]: how a rank waits for another within a deadline (the next step plan, room
//! in the plan ring, a collective's completion).

use std::time::{Duration, Instant};

/// A wait with an optional deadline: it spins through the first microseconds (a
/// healthy step's wait), yields up to 50 ms, then naps, so a peer that stalls does not
/// cost a core and a healthy one does not pay a sleep's latency.
#[derive(Debug)]
pub(crate) struct Waiter {
    start: Instant,
    deadline: Option<Instant>,
}

impl Waiter {
    pub(crate) fn new(timeout: Option<Duration>) -> Self {
        let start = Instant::now();
        Waiter { start, deadline: timeout.map(|t| start + t) }
    }

    /// Pauses once; false when the deadline has passed.
    pub(crate) fn pause(&self) -> bool {
        let waited = self.start.elapsed();
        if waited < Duration::from_micros(20) {
            std::hint::spin_loop();
        } else if waited < Duration::from_millis(50) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
        self.deadline.is_none_or(|d| Instant::now() < d)
    }
}
