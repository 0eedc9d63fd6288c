//! The shared-memory plan channel: ranks as threads, each mapping the ring's file itself
//! as a process would. Plans of every size cross whole and in order (through a ring far
//! smaller than some of them), a stalled follower or leader fails the other side within
//! the timeout, a leader that leaves releases its followers at once, and a ring that some
//! rank cannot map leaves the whole group on the collective.

use mlaserve_tp::plans::{PlanChannel, Plans};
use mlaserve_tp::shm::SharedPlans;
use mlaserve_tp::LocalGroup;
use std::path::Path;
use std::time::{Duration, Instant};

/// Every rank's end of a ring of `capacity` words under `dir`.
fn connect(world: usize, dir: &Path, capacity: usize, timeout: Duration) -> Vec<SharedPlans> {
    let group = LocalGroup::new(world, timeout);
    std::thread::scope(|s| {
        let ends: Vec<_> = group
            .iter()
            .map(|c| s.spawn(move || SharedPlans::connect(c, dir, capacity).expect("collective").expect("mapped")))
            .collect();
        ends.into_iter().map(|h| h.join().expect("rank")).collect()
    })
}

fn plan(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_add(seed).wrapping_mul(2_654_435_761)).collect()
}

#[test]
fn plans_of_every_size_cross_whole_and_in_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    const CAP: usize = 64;
    let sizes = [0, 1, CAP - 2, CAP - 1, CAP, CAP + 1, 5 * CAP + 3, 7, 1000, 0, 3];
    for world in [2, 4] {
        let mut ends = connect(world, dir.path(), CAP, Duration::from_secs(20));
        let leader = ends.remove(0);
        std::thread::scope(|s| {
            let readers: Vec<_> = ends
                .into_iter()
                .map(|f| s.spawn(move || sizes.iter().map(|_| f.receive_plan().expect("plan")).collect::<Vec<_>>()))
                .collect();
            for (i, &n) in sizes.iter().enumerate() {
                leader.send_plan(&plan(n, i as u32)).expect("send");
            }
            for (r, h) in readers.into_iter().enumerate() {
                let got = h.join().expect("follower");
                for (i, (&n, w)) in sizes.iter().zip(&got).enumerate() {
                    assert_eq!(*w, plan(n, i as u32), "rank {} plan {i} of {n} words (TP {world})", r + 1);
                }
            }
        });
        // The file is gone once the ranks agreed; their mappings stay.
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0, "the ring's file was unlinked");
    }
}

#[test]
fn a_follower_that_stops_reading_fails_the_leader_within_the_timeout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let t = Duration::from_millis(500);
    let ends = connect(2, dir.path(), 16, t);
    // The follower reads nothing: 16 words fit, the next plan waits out the timeout.
    ends[0].send_plan(&plan(15, 0)).expect("fits");
    let start = Instant::now();
    let err = ends[0].send_plan(&plan(1, 1)).expect_err("the ring is full").to_string();
    let waited = start.elapsed();
    assert!(err.contains("rank 1 has not read the step plans"), "{err}");
    assert!(waited >= t && waited < t + Duration::from_secs(2), "failed after {waited:?}");
    // What was sent is still there to read.
    assert_eq!(ends[1].receive_plan().expect("plan"), plan(15, 0));
}

#[test]
fn a_follower_fails_within_the_timeout_when_no_plan_comes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let t = Duration::from_millis(500);
    let ends = connect(2, dir.path(), 1024, t);
    let start = Instant::now();
    let err = ends[1].receive_plan().expect_err("no plan").to_string();
    let waited = start.elapsed();
    assert!(err.contains("no step plan from rank 0"), "{err}");
    assert!(waited >= t && waited < t + Duration::from_secs(2), "failed after {waited:?}");
}

#[test]
fn a_leader_that_leaves_releases_its_followers_after_its_last_plan() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut ends = connect(3, dir.path(), 1024, Duration::from_secs(60));
    let leader = ends.remove(0);
    leader.send_plan(&plan(10, 7)).expect("send");
    drop(leader);
    for f in &ends {
        assert_eq!(f.receive_plan().expect("the last plan"), plan(10, 7));
        let start = Instant::now();
        let err = f.receive_plan().expect_err("closed").to_string();
        assert!(err.contains("closed the step-plan channel"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(1), "not waited out: {:?}", start.elapsed());
    }
}

#[test]
fn a_ring_some_rank_cannot_map_leaves_the_group_on_the_collective() {
    // Rank 0 cannot make its file (no such directory): every rank says why and falls back.
    let group = LocalGroup::new(2, Duration::from_secs(20));
    let missing = Path::new("/nonexistent-mlaserve-dir");
    std::thread::scope(|s| {
        let hs: Vec<_> = group.iter().map(|c| s.spawn(move || SharedPlans::connect(c, missing, 64))).collect();
        for h in hs {
            let why = h.join().expect("rank").expect("collective").expect_err("no ring");
            assert!(!why.is_empty());
        }
    });
    // Through `Plans`, a group whose ranks share /dev/shm takes the ring; the collective
    // when told not to, and then plans cross by the collective's frames.
    for shared in [true, false] {
        let group = LocalGroup::new(2, Duration::from_secs(20));
        std::thread::scope(|s| {
            let hs: Vec<_> = group.into_iter().map(|c| s.spawn(move || Plans::connect(c, shared))).collect();
            let mut ends: Vec<_> = hs.into_iter().map(|h| h.join().expect("rank").expect("connect")).collect();
            let (follower, how) = ends.pop().expect("rank 1");
            let (leader, _) = ends.pop().expect("rank 0");
            let on_shm = Path::new("/dev/shm").is_dir();
            assert_eq!(matches!(leader, Plans::Shared(_)), shared && on_shm, "{how}");
            let f = s.spawn(move || follower.receive_plan());
            leader.send_plan(&plan(5000, 3)).expect("send");
            assert_eq!(f.join().expect("follower").expect("plan"), plan(5000, 3));
        });
    }
}
