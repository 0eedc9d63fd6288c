//! How step plans cross from the leader to the followers: the [`PlanChannel`] trait, its
//! implementation over any [`Collective`] (frames broadcast from rank 0) and over the
//! shared-memory ring ([`SharedPlans`]), and [`Plans`], the one a group picks at start.

use crate::shm::SharedPlans;
use mlaserve_core::{Collective, Error, Result};
use std::path::Path;
use std::time::Duration;

/// A one-to-many channel of step plans (words) from rank 0 to the other ranks.
pub trait PlanChannel {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// How long a follower waits for the next plan before it fails (None: no deadline).
    fn timeout(&self) -> Option<Duration>;
    /// Rank 0: sends a plan to every other rank.
    fn send_plan(&self, words: &[u32]) -> Result<()>;
    /// A follower: the next plan from rank 0.
    fn receive_plan(&self) -> Result<Vec<u32>>;
}

/// Words of the frame a plan crosses a collective in: the first holds the plan's length,
/// the rest its start. A follower posts the frame's broadcast before it knows the length,
/// so a plan that fits takes one collective; a longer one sends its remainder in a second
/// broadcast of exactly that many words.
pub const FRAME: usize = 4096;

impl<C: Collective> PlanChannel for C {
    fn rank(&self) -> usize {
        Collective::rank(self)
    }
    fn world_size(&self) -> usize {
        Collective::world_size(self)
    }
    fn timeout(&self) -> Option<Duration> {
        Collective::timeout(self)
    }

    fn send_plan(&self, words: &[u32]) -> Result<()> {
        let len =
            u32::try_from(words.len()).map_err(|_| Error::Collective(format!("a plan of {} words", words.len())))?;
        let head = words.len().min(FRAME - 1);
        let mut frame = vec![0u32; FRAME];
        frame[0] = len;
        frame[1..1 + head].copy_from_slice(&words[..head]);
        self.broadcast_u32(&mut frame, 0)?;
        if words.len() > head {
            self.broadcast_u32(&mut words[head..].to_vec(), 0)?;
        }
        Ok(())
    }

    fn receive_plan(&self) -> Result<Vec<u32>> {
        let mut frame = vec![0u32; FRAME];
        self.broadcast_u32(&mut frame, 0)?;
        let len = frame[0] as usize;
        let head = len.min(FRAME - 1);
        let mut w = frame[1..1 + head].to_vec();
        if len > head {
            let mut rest = vec![0u32; len - head];
            self.broadcast_u32(&mut rest, 0)?;
            w.extend_from_slice(&rest);
        }
        Ok(w)
    }
}

impl PlanChannel for SharedPlans {
    fn rank(&self) -> usize {
        SharedPlans::rank(self)
    }
    fn world_size(&self) -> usize {
        SharedPlans::world_size(self)
    }
    fn timeout(&self) -> Option<Duration> {
        SharedPlans::timeout(self)
    }
    fn send_plan(&self, words: &[u32]) -> Result<()> {
        self.send(words)
    }
    fn receive_plan(&self) -> Result<Vec<u32>> {
        self.receive()
    }
}

/// The plan channel a group runs on: the shared-memory ring when every rank can map it,
/// else the collective's frames.
#[derive(Debug)]
pub enum Plans<C> {
    Shared(SharedPlans),
    Collective(C),
}

impl<C: Collective> Plans<C> {
    /// A collective call on `c`'s group. With `shared`, tries the ring (in
    /// [`crate::shm::DEFAULT_DIR`]); falls back to `c` when a rank cannot map it, and says
    /// which channel the group took and why.
    pub fn connect(c: C, shared: bool) -> Result<(Self, String)> {
        if !shared || c.world_size() < 2 {
            return Ok((Plans::Collective(c), "the collective (shared memory off)".into()));
        }
        let dir = Path::new(crate::shm::DEFAULT_DIR);
        Ok(match SharedPlans::connect(&c, dir, crate::shm::DEFAULT_CAPACITY)? {
            Ok(ring) => (Plans::Shared(ring), "shared memory".into()),
            Err(why) => (Plans::Collective(c), format!("the collective ({why})")),
        })
    }
}

impl<C: Collective> Plans<C> {
    /// The channel the group took.
    fn channel(&self) -> &dyn PlanChannel {
        match self {
            Plans::Shared(s) => s,
            Plans::Collective(c) => c,
        }
    }
}

impl<C: Collective> PlanChannel for Plans<C> {
    fn rank(&self) -> usize {
        self.channel().rank()
    }
    fn world_size(&self) -> usize {
        self.channel().world_size()
    }
    fn timeout(&self) -> Option<Duration> {
        self.channel().timeout()
    }
    fn send_plan(&self, words: &[u32]) -> Result<()> {
        self.channel().send_plan(words)
    }
    fn receive_plan(&self) -> Result<Vec<u32>> {
        self.channel().receive_plan()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plans shorter than, as long as, and longer than a frame cross whole and in order.
    #[test]
    fn plans_cross_in_frames() {
        let sizes = [0, 1, FRAME - 2, FRAME - 1, FRAME, 3 * FRAME + 5, 7];
        let plan = |n: usize| (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect::<Vec<u32>>();
        let mut g = crate::LocalGroup::new(2, std::time::Duration::from_secs(10));
        let (c1, c0) = (g.pop().unwrap(), g.pop().unwrap());
        std::thread::scope(|s| {
            let follower = s.spawn(|| sizes.iter().map(|_| c1.receive_plan().unwrap()).collect::<Vec<_>>());
            for &n in &sizes {
                c0.send_plan(&plan(n)).unwrap();
            }
            let got = follower.join().unwrap();
            for (&n, w) in sizes.iter().zip(&got) {
                assert_eq!(*w, plan(n), "a plan of {n} words");
            }
        });
    }
}
