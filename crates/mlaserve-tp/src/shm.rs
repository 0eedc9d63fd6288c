//! [`SharedPlans`]: the step-plan channel of a group whose ranks share a host's memory.
//!
//! One ring of 32-bit words in a file that every rank maps (under `/dev/shm`). Rank 0
//! writes each plan as its length followed by its words and then publishes its new write
//! position; each follower reads from its own position and publishes how far it has read,
//! so the writer reuses only what every follower has passed. A plan longer than the ring
//! streams through it. The leader waits for nobody unless the ring is full, and a
//! follower sees a plan within microseconds of its writing. (Over NCCL a plan costs a
//! host-to-device copy, a broadcast and a device-to-host copy on each side, and the
//! leader's broadcast waits until the followers have posted theirs.)
//!
//! Waits are bounded by the timeout, as a collective's are: a follower fails when no plan
//! comes within it (the leader died; an idle leader sends keep-alives sooner), the leader
//! when a follower has not made room within it. A leader that drops its end marks the
//! ring closed, and its followers fail as soon as they have read every plan before that.
//!
//! [`SharedPlans::connect`] sets the ring up over the group's collective: rank 0 creates
//! the file (mode 0600) and broadcasts its path and a random token, the others map it and
//! check the token, and the ranks agree through an all-reduce to use it only if every rank
//! did. The file is then unlinked (the mappings stay). Ranks on different hosts, or in
//! containers that do not share `/dev/shm`, cannot open it and keep the collective.

use crate::wait::Waiter;
use memmap2::MmapMut;
use mlaserve_core::{Collective, Error, Result};
use std::cell::Cell;
use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// The ring's words in [`SharedPlans::connect`]'s default (16 MiB; longer plans stream).
pub const DEFAULT_CAPACITY: usize = 1 << 22;
/// Where the ring's file is made: Linux's shared-memory file system.
pub const DEFAULT_DIR: &str = "/dev/shm";

const MAGIC: u64 = 0x6d6c_6173_706c_616e;
/// Bytes a position takes: a cache line each, so ranks do not write the same line.
const LINE: usize = 64;
/// The most ranks a ring serves.
const MAX_WORLD: usize = 64;
/// Line 0: magic, token, capacity, world, closed. Line 1: the write position. Line 1 + r:
/// rank r's read position. The words follow.
const HEADER: usize = LINE * (2 + MAX_WORLD);
const WRITE_AT: usize = LINE;
/// Raised when rank 0's end is dropped: followers fail at once, past the last plan.
const CLOSED_AT: usize = 32;
/// Words of the set-up broadcast: ok, token (2), path length, the path's bytes.
const SETUP_WORDS: usize = 1024;

/// One rank's end of the ring (see the module's text).
#[derive(Debug)]
pub struct SharedPlans {
    map: MmapMut,
    rank: usize,
    world: usize,
    capacity: u64,
    timeout: Option<Duration>,
    /// This rank's position: where the leader writes next, where a follower reads next.
    pos: Cell<u64>,
}

/// A random 64-bit token (std's hash keys are seeded from the OS), mixed with the time.
fn random_token() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.finish()
}

impl SharedPlans {
    /// Sets up the ring among `c`'s ranks (a collective call: every rank makes it) in a
    /// file under `dir` holding `capacity` words. `Ok(Err(why))` when some rank could not
    /// map it: every rank then keeps `c`'s channel. The waits take `c`'s timeout.
    pub fn connect<C: Collective>(
        c: &C,
        dir: &Path,
        capacity: usize,
    ) -> Result<std::result::Result<SharedPlans, String>> {
        let (rank, world) = (c.rank(), c.world_size());
        let mut setup = vec![0u32; SETUP_WORDS];
        let mut mine: std::result::Result<SharedPlans, String> = Err(String::new());
        let mut created: Option<PathBuf> = None;
        if rank == 0 {
            let token = random_token();
            let path = dir.join(format!("mlaserve-plans-{}-{token:016x}", std::process::id()));
            mine = Self::create(&path, token, capacity, world, c.timeout());
            if mine.is_ok() {
                created = Some(path.clone());
            }
            let bytes = path.as_os_str().as_encoded_bytes();
            if mine.is_ok() && bytes.len() <= 4 * (SETUP_WORDS - 4) {
                setup[..4].copy_from_slice(&[1, token as u32, (token >> 32) as u32, bytes.len() as u32]);
                for (i, b) in bytes.iter().enumerate() {
                    setup[4 + i / 4] |= u32::from(*b) << (8 * (i % 4));
                }
            }
        }
        let shared: Result<f32> = (|| {
            c.broadcast_u32(&mut setup, 0)?;
            if rank > 0 {
                mine = if setup[0] == 1 {
                    let token = u64::from(setup[1]) | (u64::from(setup[2]) << 32);
                    let bytes: Vec<u8> =
                        (0..setup[3] as usize).map(|i| (setup[4 + i / 4] >> (8 * (i % 4))) as u8).collect();
                    let path = PathBuf::from(String::from_utf8_lossy(&bytes).into_owned());
                    Self::open(&path, token, capacity, rank, world, c.timeout())
                } else {
                    Err("rank 0 could not make the shared-memory ring".into())
                };
            }
            let mut failed = [f32::from(u8::from(mine.is_err()))];
            c.all_reduce_sum(&mut failed)?;
            Ok(failed[0])
        })();
        if let Some(p) = created {
            let _ = std::fs::remove_file(p);
        }
        let failed = shared?;
        Ok(match mine {
            Ok(ring) if failed == 0.0 => Ok(ring),
            Ok(_) => Err(format!("{failed} of {world} ranks could not map the shared-memory ring")),
            Err(why) => Err(why),
        })
    }

    fn create(
        path: &Path,
        token: u64,
        capacity: usize,
        world: usize,
        timeout: Option<Duration>,
    ) -> std::result::Result<SharedPlans, String> {
        use std::os::unix::fs::OpenOptionsExt;
        if !(2..=MAX_WORLD).contains(&world) || capacity == 0 {
            return Err(format!("a ring of {capacity} words for {world} ranks"));
        }
        let why = |e: std::io::Error| format!("{}: {e}", path.display());
        let file =
            std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path).map_err(why)?;
        file.set_len((HEADER + 4 * capacity) as u64).map_err(why)?;
        // SAFETY: the file was just made by this process under a random name; the other
        // ranks map it only to share it, and every access goes through atomics.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(why)?;
        let ring = SharedPlans { map, rank: 0, world, capacity: capacity as u64, timeout, pos: Cell::new(0) };
        for (i, v) in [MAGIC, token, capacity as u64, world as u64].into_iter().enumerate() {
            ring.cell(8 * i).store(v, Ordering::Release);
        }
        Ok(ring)
    }

    fn open(
        path: &Path,
        token: u64,
        capacity: usize,
        rank: usize,
        world: usize,
        timeout: Option<Duration>,
    ) -> std::result::Result<SharedPlans, String> {
        let why = |e: std::io::Error| format!("rank {rank}: {}: {e}", path.display());
        let file = std::fs::OpenOptions::new().read(true).write(true).open(path).map_err(why)?;
        let len = file.metadata().map_err(why)?.len();
        if len != (HEADER + 4 * capacity) as u64 {
            return Err(format!("rank {rank}: {} has {len} bytes", path.display()));
        }
        // SAFETY: as in `create`; the size was checked, and the contents are checked next.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(why)?;
        let ring = SharedPlans { map, rank, world, capacity: capacity as u64, timeout, pos: Cell::new(0) };
        let head: Vec<u64> = (0..4).map(|i| ring.cell(8 * i).load(Ordering::Acquire)).collect();
        if head != [MAGIC, token, capacity as u64, world as u64] {
            return Err(format!("rank {rank}: {} is not this group's ring", path.display()));
        }
        Ok(ring)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world
    }

    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// The 64-bit position at byte `at` of the header.
    fn cell(&self, at: usize) -> &AtomicU64 {
        debug_assert!(at.is_multiple_of(8) && at + 8 <= HEADER);
        // SAFETY: in bounds and 8-aligned (the map is page-aligned); shared with other
        // processes, so only ever accessed atomically.
        unsafe { &*(self.map.as_ptr().add(at) as *const AtomicU64) }
    }

    /// The ring's word at position `pos`.
    fn word(&self, pos: u64) -> &AtomicU32 {
        let i = (pos % self.capacity) as usize;
        // SAFETY: `i < capacity`, inside the map's words and 4-aligned; atomics only.
        unsafe { &*(self.map.as_ptr().add(HEADER + 4 * i) as *const AtomicU32) }
    }

    fn read_at(rank: usize) -> usize {
        LINE * (1 + rank)
    }

    /// Rank 0: writes one plan (see the module's text).
    pub fn send(&self, words: &[u32]) -> Result<()> {
        if self.rank != 0 {
            return Err(Error::Collective(format!("rank {} sent a step plan; only rank 0 does", self.rank)));
        }
        let len =
            u32::try_from(words.len()).map_err(|_| Error::Collective(format!("a plan of {} words", words.len())))?;
        let mut items = std::iter::once(len).chain(words.iter().copied());
        let mut left = words.len() as u64 + 1;
        let mut pos = self.pos.get();
        while left > 0 {
            let n = self.room(pos)?.min(left);
            for _ in 0..n {
                self.word(pos).store(items.next().unwrap_or(0), Ordering::Relaxed);
                pos += 1;
            }
            self.cell(WRITE_AT).store(pos, Ordering::Release);
            left -= n;
        }
        self.pos.set(pos);
        Ok(())
    }

    /// Words free to write at `pos`, waiting (bounded) until some are.
    fn room(&self, pos: u64) -> Result<u64> {
        let wait = Waiter::new(self.timeout);
        loop {
            let (lag, read) = (1..self.world)
                .map(|r| (r, self.cell(Self::read_at(r)).load(Ordering::Acquire)))
                .min_by_key(|&(_, p)| p)
                .unwrap_or((0, pos));
            let free = self.capacity - (pos - read);
            if free > 0 {
                return Ok(free);
            }
            if !wait.pause() {
                return Err(Error::Collective(format!(
                    "rank 0 of {}: rank {lag} has not read the step plans within {:?}: it died or stalls",
                    self.world,
                    self.timeout.unwrap_or_default()
                )));
            }
        }
    }

    /// A follower: the next plan.
    pub fn receive(&self) -> Result<Vec<u32>> {
        if self.rank == 0 {
            return Err(Error::Collective("rank 0 waited for a step plan; it sends them".into()));
        }
        let mut pos = self.pos.get();
        let mut avail = self.written(pos)?;
        let len = self.word(pos).load(Ordering::Relaxed) as usize;
        pos += 1;
        avail -= 1;
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            if avail == 0 {
                self.cell(Self::read_at(self.rank)).store(pos, Ordering::Release);
                avail = self.written(pos)?;
            }
            let n = avail.min((len - out.len()) as u64);
            out.extend((0..n).map(|i| self.word(pos + i).load(Ordering::Relaxed)));
            pos += n;
            avail -= n;
        }
        self.cell(Self::read_at(self.rank)).store(pos, Ordering::Release);
        self.pos.set(pos);
        Ok(out)
    }

    /// Words written past `pos`, waiting (bounded) until there is one.
    fn written(&self, pos: u64) -> Result<u64> {
        let wait = Waiter::new(self.timeout);
        loop {
            let w = self.cell(WRITE_AT).load(Ordering::Acquire);
            if w > pos {
                return Ok(w - pos);
            }
            if self.cell(CLOSED_AT).load(Ordering::Acquire) != 0 && self.cell(WRITE_AT).load(Ordering::Acquire) == pos {
                return Err(Error::Collective(format!(
                    "rank {} of {}: rank 0 closed the step-plan channel (the leader left)",
                    self.rank, self.world
                )));
            }
            if !wait.pause() {
                return Err(Error::Collective(format!(
                    "rank {} of {}: no step plan from rank 0 within {:?}: the leader died or stalls",
                    self.rank,
                    self.world,
                    self.timeout.unwrap_or_default()
                )));
            }
        }
    }
}

impl Drop for SharedPlans {
    fn drop(&mut self) {
        if self.rank == 0 {
            self.cell(CLOSED_AT).store(1, Ordering::Release);
        }
    }
}
