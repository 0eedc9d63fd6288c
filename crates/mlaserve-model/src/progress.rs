//! Load progress: bytes of the checkpoint done, throughput and time left.
//!
//! A loader ticks [`LoadProgress::add`] as it goes (any thread; the counter is atomic),
//! anyone may read a [`ProgressSnapshot`] at any time (a worker can put it on its health
//! or metrics endpoint), and a line is logged through `tracing` at most every
//! [`LOG_EVERY`] or every 5% of the total, whichever comes first, plus once at the end.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Longest interval between two progress lines while loading.
pub const LOG_EVERY: Duration = Duration::from_secs(2);
/// A line is also due whenever this fraction of the total has passed since the last one.
pub const LOG_FRACTION: f64 = 0.05;

/// A point-in-time view of a load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProgressSnapshot {
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub elapsed: Duration,
}

impl ProgressSnapshot {
    /// Done over total in `[0, 1]` (1 for an empty load).
    pub fn fraction(&self) -> f64 {
        if self.bytes_total == 0 {
            1.0
        } else {
            (self.bytes_done as f64 / self.bytes_total as f64).min(1.0)
        }
    }

    /// Average throughput so far in GB/s (10^9 bytes); 0 before any time has passed.
    pub fn gb_per_s(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s > 0.0 {
            self.bytes_done as f64 / 1e9 / s
        } else {
            0.0
        }
    }

    /// Time left at the average throughput so far; `None` until a byte is done.
    pub fn eta(&self) -> Option<Duration> {
        if self.bytes_done >= self.bytes_total {
            return Some(Duration::ZERO);
        }
        if self.bytes_done == 0 || self.elapsed.is_zero() {
            return None;
        }
        let left = (self.bytes_total - self.bytes_done) as f64;
        Some(Duration::from_secs_f64(self.elapsed.as_secs_f64() * left / self.bytes_done as f64))
    }
}

impl std::fmt::Display for ProgressSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.2}/{:.2} GB ({:.1}%), {:.2} GB/s",
            self.bytes_done as f64 / 1e9,
            self.bytes_total as f64 / 1e9,
            100.0 * self.fraction(),
            self.gb_per_s()
        )?;
        match self.eta() {
            Some(t) => write!(f, ", {:.1} s left", t.as_secs_f64()),
            None => write!(f, ", time left unknown"),
        }
    }
}

/// Progress of one load; share it behind an `Arc` between the loader and readers.
#[derive(Debug)]
pub struct LoadProgress {
    what: String,
    total: AtomicU64,
    done: AtomicU64,
    started: Instant,
    /// When the last line was logged, and the bytes done then.
    last_log: Mutex<(Instant, u64)>,
}

impl LoadProgress {
    /// A job of `total` bytes called `what` in the log (e.g. "loading /models/v3").
    pub fn new(what: impl Into<String>, total: u64) -> Self {
        Self::starting_at(what, total, Instant::now())
    }

    fn starting_at(what: impl Into<String>, total: u64, now: Instant) -> Self {
        LoadProgress {
            what: what.into(),
            total: AtomicU64::new(total),
            done: AtomicU64::new(0),
            started: now,
            last_log: Mutex::new((now, 0)),
        }
    }

    /// Sets the total once it is known (a reader may hold the progress before the loader
    /// has opened the checkpoint).
    pub fn set_total(&self, total: u64) {
        self.total.store(total, Ordering::Relaxed);
    }

    /// Counts `bytes` more as done and logs a line when one is due.
    pub fn add(&self, bytes: u64) {
        let done = self.done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        let now = Instant::now();
        if self.due(done, now) {
            tracing::info!(target: "mlaserve::load", "{}: {}", self.what, self.snapshot_at(now));
        }
    }

    /// Logs the final line (whatever the cadence) and returns the last snapshot.
    pub fn finish(&self) -> ProgressSnapshot {
        let s = self.snapshot();
        tracing::info!(target: "mlaserve::load", "{}: done, {}", self.what, s);
        s
    }

    /// The state now.
    pub fn snapshot(&self) -> ProgressSnapshot {
        self.snapshot_at(Instant::now())
    }

    fn snapshot_at(&self, now: Instant) -> ProgressSnapshot {
        ProgressSnapshot {
            bytes_done: self.done.load(Ordering::Relaxed),
            bytes_total: self.total.load(Ordering::Relaxed),
            elapsed: now.saturating_duration_since(self.started),
        }
    }

    /// Whether a line is due at `now` with `done` bytes done; if so, records it as logged.
    fn due(&self, done: u64, now: Instant) -> bool {
        let Ok(mut last) = self.last_log.lock() else { return false };
        let step = (self.total.load(Ordering::Relaxed) as f64 * LOG_FRACTION) as u64;
        let by_time = now.saturating_duration_since(last.0) >= LOG_EVERY;
        let by_bytes = done.saturating_sub(last.1) >= step.max(1);
        if (by_time || by_bytes) && done > last.1 {
            *last = (now, done);
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_arithmetic() {
        let s = ProgressSnapshot {
            bytes_done: 3_000_000_000,
            bytes_total: 12_000_000_000,
            elapsed: Duration::from_secs(2),
        };
        assert_eq!(s.fraction(), 0.25);
        assert_eq!(s.gb_per_s(), 1.5);
        // 9 GB left at 1.5 GB/s.
        assert_eq!(s.eta(), Some(Duration::from_secs(6)));
        assert_eq!(s.to_string(), "3.00/12.00 GB (25.0%), 1.50 GB/s, 6.0 s left");
        let start = ProgressSnapshot { bytes_done: 0, bytes_total: 10, elapsed: Duration::ZERO };
        assert_eq!((start.fraction(), start.gb_per_s(), start.eta()), (0.0, 0.0, None));
        let done = ProgressSnapshot { bytes_done: 12, bytes_total: 10, elapsed: Duration::from_secs(1) };
        assert_eq!((done.fraction(), done.eta()), (1.0, Some(Duration::ZERO)));
        let empty = ProgressSnapshot { bytes_done: 0, bytes_total: 0, elapsed: Duration::ZERO };
        assert_eq!(empty.fraction(), 1.0);
    }

    #[test]
    fn cadence_is_two_seconds_or_five_percent() {
        let t0 = Instant::now();
        let p = LoadProgress::starting_at("x", 1000, t0);
        // 4% after 1 s: not due; 5% since the last line: due.
        assert!(!p.due(40, t0 + Duration::from_secs(1)));
        assert!(p.due(50, t0 + Duration::from_secs(1)));
        // 1% more at once: not due; the same 1% two seconds after the last line: due.
        assert!(!p.due(60, t0 + Duration::from_millis(1500)));
        assert!(p.due(60, t0 + Duration::from_millis(3000)));
        // No new bytes: never due, however long it has been.
        assert!(!p.due(60, t0 + Duration::from_secs(60)));
        p.done.store(250, Ordering::Relaxed);
        let s = p.snapshot_at(t0 + Duration::from_secs(5));
        assert_eq!((s.bytes_done, s.bytes_total, s.elapsed), (250, 1000, Duration::from_secs(5)));
        assert_eq!(s.eta(), Some(Duration::from_secs(15)));
    }

    #[test]
    fn add_counts_from_many_threads() {
        let p = std::sync::Arc::new(LoadProgress::new("x", 0));
        assert_eq!(p.snapshot().fraction(), 1.0, "an empty load is done");
        p.set_total(8 * 1000);
        assert_eq!(p.snapshot().fraction(), 0.0);
        let hs: Vec<_> = (0..8)
            .map(|_| {
                let p = p.clone();
                std::thread::spawn(move || (0..1000).for_each(|_| p.add(1)))
            })
            .collect();
        hs.into_iter().for_each(|h| h.join().unwrap());
        let s = p.finish();
        assert_eq!((s.bytes_done, s.fraction()), (8000, 1.0));
    }
}
