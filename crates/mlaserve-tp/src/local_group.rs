//! [`LocalGroup`]: a [`Collective`] over threads of one process.
//!
//! CPU tests run tensor parallelism (TP = 2, 4, 8) with one thread per rank. Reductions
//! add the ranks' buffers in rank order, so every rank gets bit-identical results. A
//! rank that leaves (its handle is dropped, e.g. its thread panicked) or stalls past the
//! timeout makes every other rank's next collective fail with an error naming it, instead
//! of hanging — the same contract the NCCL implementation keeps.

use mlaserve_core::Collective;
use mlaserve_core::{Error, Result};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
struct State {
    /// Each rank's contribution to the collective in flight.
    bufs: Vec<Option<Vec<f32>>>,
    arrived: usize,
    /// All contributions, once every rank has arrived.
    result: Option<Arc<Vec<Vec<f32>>>>,
    departed: usize,
    failed: Option<String>,
}

#[derive(Debug)]
struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

/// One rank's handle on an in-process group.
#[derive(Debug)]
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Shared>,
}

impl LocalGroup {
    /// Handles for ranks `0..world`; a collective waits at most `timeout` for the others.
    pub fn new(world: usize, timeout: Duration) -> Vec<LocalGroup> {
        let shared = Arc::new(Shared {
            world,
            timeout,
            state: Mutex::new(State { bufs: vec![None; world], ..Default::default() }),
            cv: Condvar::new(),
        });
        (0..world).map(|rank| LocalGroup { rank, shared: shared.clone() }).collect()
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.shared.state.lock().map_err(|_| Error::Collective("group state poisoned".into()))
    }

    /// Waits on the condition variable until `done` holds, failing on timeout or when the
    /// group has failed.
    fn wait_until<'a>(
        &self,
        mut g: MutexGuard<'a, State>,
        what: &str,
        done: impl Fn(&State) -> bool,
    ) -> Result<MutexGuard<'a, State>> {
        let deadline = Instant::now() + self.shared.timeout;
        loop {
            // A finished collective completes even if a peer has left since.
            if done(&g) {
                return Ok(g);
            }
            if let Some(f) = &g.failed {
                return Err(Error::Collective(format!("rank {}: {what}: {f}", self.rank)));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..self.shared.world).filter(|&r| g.bufs[r].is_none()).collect();
                let msg = format!("timed out after {:?} waiting for ranks {missing:?}", self.shared.timeout);
                g.failed = Some(msg.clone());
                self.shared.cv.notify_all();
                return Err(Error::Collective(format!("rank {}: {what}: {msg}", self.rank)));
            }
            g = self
                .shared
                .cv
                .wait_timeout(g, deadline - now)
                .map_err(|_| Error::Collective("group state poisoned".into()))?
                .0;
        }
    }

    /// Deposits `data` and returns every rank's contribution, in rank order.
    fn exchange(&self, data: Vec<f32>, what: &str) -> Result<Arc<Vec<Vec<f32>>>> {
        let world = self.shared.world;
        let g = self.lock()?;
        // Wait for the previous collective to drain.
        let mut g = self.wait_until(g, what, |s| s.result.is_none())?;
        g.bufs[self.rank] = Some(data);
        g.arrived += 1;
        if g.arrived == world {
            let all: Vec<Vec<f32>> = g.bufs.iter_mut().map(|b| b.take().unwrap_or_default()).collect();
            g.result = Some(Arc::new(all));
            self.shared.cv.notify_all();
        }
        let mut g = self.wait_until(g, what, |s| s.result.is_some())?;
        let res = g.result.clone().ok_or_else(|| Error::Collective("result vanished".into()))?;
        g.departed += 1;
        if g.departed == world {
            g.arrived = 0;
            g.departed = 0;
            g.result = None;
            self.shared.cv.notify_all();
        }
        Ok(res)
    }
}

impl Drop for LocalGroup {
    fn drop(&mut self) {
        if let Ok(mut g) = self.shared.state.lock() {
            if g.failed.is_none() {
                g.failed = Some(format!("rank {} left the group", self.rank));
            }
            self.shared.cv.notify_all();
        }
    }
}

impl Collective for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.shared.world
    }
    fn timeout(&self) -> Option<Duration> {
        Some(self.shared.timeout)
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let all = self.exchange(buf.to_vec(), "all_reduce")?;
        if all.iter().any(|b| b.len() != buf.len()) {
            return Err(Error::Collective("all_reduce: ranks passed buffers of different lengths".into()));
        }
        for (i, v) in buf.iter_mut().enumerate() {
            *v = all.iter().fold(0.0, |acc, b| acc + b[i]);
        }
        Ok(())
    }
    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        let all = self.exchange(local.to_vec(), "all_gather")?;
        Ok(all.iter().flat_map(|b| b.iter().copied()).collect())
    }
    fn broadcast_u32(&self, buf: &mut [u32], root: usize) -> Result<()> {
        let mine = if self.rank == root { buf.iter().map(|&x| f32::from_bits(x)).collect() } else { Vec::new() };
        let all = self.exchange(mine, "broadcast")?;
        let src = all.get(root).ok_or_else(|| Error::Collective(format!("broadcast: no rank {root}")))?;
        if src.len() != buf.len() {
            return Err(Error::Collective(format!(
                "broadcast: root sent {} values, expected {}",
                src.len(),
                buf.len()
            )));
        }
        for (d, s) in buf.iter_mut().zip(src) {
            *d = s.to_bits();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_gather_broadcast() {
        let handles = LocalGroup::new(3, Duration::from_secs(5));
        let out: Vec<_> = std::thread::scope(|s| {
            let js: Vec<_> = handles
                .into_iter()
                .map(|g| {
                    s.spawn(move || {
                        let r = g.rank() as f32;
                        let mut results = Vec::new();
                        for it in 0..50 {
                            let mut v = vec![r, r * 2.0, it as f32];
                            g.all_reduce_sum(&mut v).unwrap();
                            results.push(v);
                        }
                        let gathered = g.all_gather(&[r]).unwrap();
                        let mut b = if g.rank() == 1 { vec![7, 8] } else { vec![0, 0] };
                        g.broadcast_u32(&mut b, 1).unwrap();
                        (results, gathered, b)
                    })
                })
                .collect();
            js.into_iter().map(|j| j.join().unwrap()).collect()
        });
        for (results, gathered, b) in out {
            for (it, v) in results.iter().enumerate() {
                assert_eq!(v, &vec![3.0, 6.0, 3.0 * it as f32]);
            }
            assert_eq!(gathered, vec![0.0, 1.0, 2.0]);
            assert_eq!(b, vec![7, 8]);
        }
    }

    #[test]
    fn a_dead_rank_fails_the_others_quickly() {
        let mut handles = LocalGroup::new(2, Duration::from_secs(30));
        let dead = handles.pop().unwrap();
        let t = Instant::now();
        let alive = std::thread::spawn(move || {
            let mut v = vec![1.0];
            handles[0].all_reduce_sum(&mut v)
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(dead);
        let e = alive.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("rank 1 left the group"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_stalled_rank_times_out() {
        let handles = LocalGroup::new(2, Duration::from_millis(200));
        let mut v = vec![1.0];
        let e = handles[0].all_reduce_sum(&mut v).unwrap_err().to_string();
        assert!(e.contains("timed out") && e.contains("[1]"), "{e}");
    }
}
