//! A tensor-parallel group running the engine: rank 0 drives `Engine<TpLeader<..>>`,
//! the other ranks follow its plans. Greedy outputs of TP > 1 must equal TP = 1 token for
//! token (32 concurrent requests, speculation on and off, plans over the collective and
//! over shared memory), with one plan per step.
//!
//! CI runs the group as threads over `LocalGroup`; with `--features nccl` on a machine
//! with GPUs, the same check runs with one OS process per rank over real NCCL, and a
//! killed rank must make the leader fail within 30 s.

use mlaserve_core::{Backend, Collective};
use mlaserve_cpu::{CpuBackend, CpuOptions};
use mlaserve_engine::testing::{random_requests, run_to_completion};
use mlaserve_engine::{Engine, EngineConfig, Event, Request};
use mlaserve_tp::{LocalGroup, Plans, TpLeader};
use std::path::Path;
use std::time::Duration;

const BLOCKS: usize = 128;

/// 32 requests of random prompts (1..=100 tokens) and lengths (1..=32 new tokens).
fn workload() -> Vec<Request> {
    random_requests(12345, 32, 100, 32, 512)
}

/// Runs every request to completion; returns each one's tokens, in submission order.
fn run<B: Backend>(backend: B, k: usize) -> mlaserve_core::Result<Vec<Vec<u32>>> {
    Ok(run_engine(backend, k)?.0)
}

/// [`run`], also returning the engine.
fn run_engine<B: Backend>(backend: B, k: usize) -> mlaserve_core::Result<(Vec<Vec<u32>>, Engine<B>)> {
    let cfg = EngineConfig { num_speculative_tokens: Some(k), max_batch_tokens: 256, ..Default::default() };
    let mut e = Engine::new(backend, cfg).map_err(|e| mlaserve_core::Error::Backend(e.to_string()))?;
    let ids: Vec<_> = workload().into_iter().map(|r| e.add_request(r).expect("admit")).collect();
    let out = run_to_completion(&mut e, &ids).map_err(mlaserve_core::Error::Backend)?;
    Ok((out, e))
}

fn load(dir: &Path, comm: Box<dyn Collective>) -> CpuBackend {
    CpuBackend::load_with(dir, CpuOptions { num_blocks: BLOCKS, ..Default::default() }, comm).expect("load")
}

fn model() -> tempfile::TempDir {
    let t = tempfile::tempdir().expect("tempdir");
    mlaserve_model::presets::generate("tiny-v3", t.path()).expect("preset");
    t
}

#[test]
fn tp_2_and_4_threads_equal_tp_1_with_and_without_speculation() {
    let t = model();
    let dir = t.path();
    for k in [3, 0] {
        let want = run(CpuBackend::load(dir, BLOCKS).expect("load"), k).expect("tp1");
        assert!(want.iter().map(Vec::len).sum::<usize>() > 32 * 4, "the workload generates tokens");
        // Plans over the collective, and over the shared-memory ring.
        for (world, shared) in [(2, false), (4, false), (2, true), (4, true)] {
            let got = std::thread::scope(|s| {
                let mut inner = LocalGroup::new(world, Duration::from_secs(60));
                let mut plans = LocalGroup::new(world, Duration::from_secs(60));
                let channel = move |p| Plans::connect(p, shared).expect("plan channel").0;
                let followers: Vec<_> = inner
                    .drain(1..)
                    .zip(plans.drain(1..))
                    .map(|(g, p)| s.spawn(move || mlaserve_tp::run_follower(&mut load(dir, Box::new(g)), &channel(p))))
                    .collect();
                let plans = channel(plans.pop().expect("rank 0"));
                assert_eq!(matches!(plans, Plans::Shared(_)), shared && Path::new("/dev/shm").is_dir());
                let leader = TpLeader::new(load(dir, Box::new(inner.pop().expect("rank 0"))), plans).expect("leader");
                let got = run_engine(leader, k).map(|(got, e)| (got, e.backend().plans_sent(), e.stats().times.steps));
                // Dropping the leader's plan channel releases the followers.
                for f in followers {
                    let _ = f.join();
                }
                got.expect("tp run")
            });
            let (got, plans, steps) = got;
            assert_eq!(got, want, "TP={world} k={k} (shared-memory plans: {shared}) differs from TP=1");
            // A step crosses as one plan: its target forward, with the drafting pass
            // after it planned (here three stages: two MTP layers, then the last reused,
            // joined with rows kept from the step before).
            assert_eq!(plans, steps, "{plans} plans for {steps} steps, k = {k}");
        }
    }
}

#[cfg(feature = "nccl")]
mod nccl {
    //! One OS process per rank over real NCCL (GPU machines only).

    use super::*;
    use mlaserve_tp::nccl::{device_count, group_comms, new_group_ids, NcclCollective};
    use mlaserve_tp::rendezvous;
    use std::net::{SocketAddr, TcpListener};
    use std::process::{Child, Command};
    use std::time::Instant;

    const ROLE: &str = "MLASERVE_TP_TEST_FOLLOWER";

    /// Both communicators of a rank: one inside the backend, one for the plans.
    fn comms(rank: usize, world: usize, ids: &[u8]) -> (NcclCollective, NcclCollective) {
        let ordinal = rank % device_count().expect("CUDA").max(1);
        group_comms(ordinal, rank, world, ids, Duration::from_secs(10)).expect("communicators")
    }

    /// The follower side: runs when this test binary is re-executed with `ROLE` set.
    #[test]
    fn follower_entry() {
        let Ok(spec) = std::env::var(ROLE) else { return };
        let mut it = spec.split(',');
        let (addr, rank, world, shared, dir) = (
            it.next().expect("addr").parse::<SocketAddr>().expect("addr"),
            it.next().expect("rank").parse::<usize>().expect("rank"),
            it.next().expect("world").parse::<usize>().expect("world"),
            it.next().expect("shared") == "true",
            it.next().expect("dir").to_string(),
        );
        let ids = rendezvous::join(addr, "test", rank, world, Duration::from_secs(30)).expect("rendezvous");
        let (a, b) = comms(rank, world, &ids);
        let mut backend = load(Path::new(&dir), Box::new(a));
        let b = Plans::connect(b, shared).expect("plan channel").0;
        // Returns Ok on shutdown; an error when the leader vanishes.
        let r = mlaserve_tp::run_follower(&mut backend, &b);
        eprintln!("follower {rank}: {r:?}");
    }

    /// A collective that NCCL refuses at once (here: an error from the enqueue itself)
    /// aborts the communicator like a timeout: a group error, and every later call fails.
    #[test]
    fn a_synchronous_nccl_error_fails_the_group_like_a_timeout() {
        use mlaserve_tp::nccl::NcclComm;
        let ctx = cudarc::driver::CudaContext::new(0).expect("CUDA device 0");
        let stream = ctx.new_stream().expect("stream");
        let id = mlaserve_tp::nccl::new_id().expect("NCCL id");
        let comm = NcclComm::join(&stream, 0, 1, &id, Duration::from_secs(10)).expect("a world of one");
        comm.with("all_reduce", |_| Ok(())).expect("a healthy call");
        let e = comm
            .with("all_reduce", |_| -> mlaserve_core::Result<()> {
                Err(mlaserve_core::Error::Collective("ncclAllReduce: ncclInvalidArgument".into()))
            })
            .expect_err("refused");
        assert!(matches!(e, mlaserve_core::Error::Collective(_)), "{e:?}");
        assert!(e.to_string().contains("communicator aborted"), "{e}");
        let later = comm.with("broadcast", |_| Ok(())).expect_err("aborted for good");
        assert!(later.to_string().contains("aborted after an earlier failure"), "{later}");
    }

    fn spawn_followers(addr: SocketAddr, world: usize, shared: bool, dir: &Path) -> Vec<Child> {
        let exe = std::env::current_exe().expect("exe");
        (1..world)
            .map(|r| {
                Command::new(&exe)
                    .args(["--exact", "nccl::follower_entry", "--nocapture", "--test-threads=1"])
                    .env(ROLE, format!("{addr},{r},{world},{shared},{}", dir.display()))
                    .spawn()
                    .expect("spawn follower")
            })
            .collect()
    }

    /// A group of `world` processes, its plans over shared memory when `shared` (the ranks
    /// of one machine always manage to map the ring) or over NCCL.
    fn leader(world: usize, shared: bool, dir: &Path) -> (TpLeader<CpuBackend, Plans<NcclCollective>>, Vec<Child>) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let followers = spawn_followers(l.local_addr().expect("addr"), world, shared, dir);
        let ids = new_group_ids().expect("ids");
        rendezvous::serve(&l, "test", world, &ids, Duration::from_secs(30)).expect("rendezvous");
        let (a, b) = comms(0, world, &ids);
        let (b, how) = Plans::connect(b, shared).expect("plan channel");
        assert_eq!(matches!(b, Plans::Shared(_)), shared, "plans over {how}");
        (TpLeader::new(load(dir, Box::new(a)), b).expect("leader"), followers)
    }

    /// Group sizes to run: `MLASERVE_TP_WORLDS` (comma-separated, default `2`), each no
    /// larger than the GPUs present.
    fn worlds() -> Vec<usize> {
        let spec = std::env::var("MLASERVE_TP_WORLDS").unwrap_or_else(|_| "2".into());
        let w: Vec<usize> = spec.split(',').map(|x| x.trim().parse().expect("MLASERVE_TP_WORLDS")).collect();
        let gpus = device_count().expect("CUDA");
        assert!(w.iter().all(|&n| n <= gpus), "MLASERVE_TP_WORLDS={spec} but {gpus} GPUs");
        w
    }

    /// The bundled model (issue 7), when this runs from the repository root or
    /// `MLASERVE_BUNDLED_MODEL` names it.
    fn bundled() -> Option<std::path::PathBuf> {
        let p = std::env::var("MLASERVE_BUNDLED_MODEL").unwrap_or_else(|_| "models/mla-tiny-code".into());
        let p = std::path::PathBuf::from(p);
        p.join("config.json").exists().then_some(p)
    }

    #[test]
    fn tp_processes_over_nccl_equal_tp1() {
        if std::env::var(ROLE).is_ok() {
            return;
        }
        let t = model();
        let mut models = vec![("tiny-v3", t.path().to_path_buf())];
        match bundled() {
            Some(p) => models.push(("mla-tiny-code", p)),
            None => eprintln!("bundled model not found (run from the repository root): tiny-v3 only"),
        }
        for (name, dir) in &models {
            for k in [3, 0] {
                let want = run(CpuBackend::load(dir, BLOCKS).expect("load"), k).expect("tp1");
                for (world, shared) in worlds().into_iter().flat_map(|w| [(w, true), (w, false)]) {
                    let (mut l, followers) = leader(world, shared, dir);
                    let t0 = Instant::now();
                    let got = run(&mut l, k).expect("tp run");
                    eprintln!(
                        "{name}: TP={world} over NCCL, plans over shared memory: {shared}, k={k}: {} tokens in {:?}",
                        got.iter().map(Vec::len).sum::<usize>(),
                        t0.elapsed()
                    );
                    l.shutdown().expect("shutdown");
                    for mut f in followers {
                        assert!(f.wait().expect("wait").success());
                    }
                    assert_eq!(got, want, "{name}: TP={world} (NCCL, shared plans {shared}) k={k} differs from TP=1");
                }
            }
        }
    }

    #[test]
    fn killing_a_rank_fails_the_leader_within_30s() {
        if std::env::var(ROLE).is_ok() {
            return;
        }
        let t = model();
        let world = *worlds().iter().max().expect("a group size");
        let (mut l, mut followers) = leader(world, true, t.path());
        let mut e = Engine::new(&mut l, EngineConfig { num_speculative_tokens: Some(3), ..Default::default() })
            .expect("engine");
        for r in workload() {
            e.add_request(r).expect("admit");
        }
        for _ in 0..3 {
            e.step();
        }
        // Kill the last rank; the others stay up.
        followers.last_mut().expect("a follower").kill().expect("kill");
        let t0 = Instant::now();
        let err = loop {
            let evs = e.step();
            if let Some(m) = evs.iter().find_map(|(_, ev)| match ev {
                Event::Finished { reason: mlaserve_engine::FinishReason::Unavailable(m), .. } => Some(m.clone()),
                _ => None,
            }) {
                break m;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "no error 30 s after the kill");
            assert!(e.has_work(), "the engine finished without noticing the dead rank");
        };
        let waited = t0.elapsed();
        eprintln!("TP={world}: leader failed {waited:?} after the kill: {err}");
        assert!(waited < Duration::from_secs(30));
        assert!(err.contains("peer rank died") || err.contains("abort") || err.contains("NCCL"), "{err}");
    }
}

/// A group that lost a rank fails every request with an error, reports the failure in
/// its stats and refuses new requests (the worker then turns NOT_SERVING).
#[test]
fn a_lost_rank_fails_the_group_for_good() {
    let t = model();
    let mut inner = LocalGroup::new(2, Duration::from_secs(5));
    let mut plans = LocalGroup::new(2, Duration::from_secs(5));
    // Rank 1 is gone before the first step.
    drop(inner.pop());
    drop(plans.pop());
    let leader = TpLeader::new(load(t.path(), Box::new(inner.pop().expect("rank 0"))), plans.pop().expect("rank 0"))
        .expect("leader");
    let mut e =
        Engine::new(leader, EngineConfig { num_speculative_tokens: Some(3), ..Default::default() }).expect("engine");
    let reqs = workload();
    for r in reqs.iter().take(4).cloned() {
        e.add_request(r).expect("admit");
    }
    let mut errors = 0;
    for _ in 0..3 {
        for (_, ev) in e.step() {
            if let Event::Finished { reason: mlaserve_engine::FinishReason::Unavailable(m), .. } = ev {
                assert!(m.contains("left the group"), "{m}");
                errors += 1;
            }
        }
    }
    assert_eq!(errors, 4, "every request ends UNAVAILABLE with the group's error");
    assert!(e.stats().failed.is_some());
    let refused = e.add_request(reqs[5].clone()).expect_err("refused").to_string();
    assert!(refused.contains("engine failed"), "{refused}");
}

/// A group left idle for several collective timeouts keeps serving: the idle engine
/// thread sends the followers keep-alive plans (`Backend::keep_alive`) before they would
/// give up waiting for the next plan, however often it is asked for stats meanwhile. Run
/// through `EngineHandle`, as the worker runs it.
#[test]
fn an_idle_group_outlives_the_collective_timeout() {
    let t = model();
    let dir = t.path().to_path_buf();
    let timeout = Duration::from_millis(400);
    let mut inner = LocalGroup::new(2, timeout);
    let mut plans = LocalGroup::new(2, timeout);
    let (g, p) = (inner.pop().expect("rank 1"), plans.pop().expect("rank 1"));
    let (g0, p0) = (inner.pop().expect("rank 0"), plans.pop().expect("rank 0"));
    let d1 = dir.clone();
    let follower = std::thread::spawn(move || mlaserve_tp::run_follower(&mut load(&d1, Box::new(g)), &p));
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
    let outs = rt.block_on(async move {
        let cfg = EngineConfig { num_speculative_tokens: Some(3), max_batch_tokens: 256, ..Default::default() };
        let h = mlaserve_engine::EngineHandle::spawn(move || TpLeader::new(load(&dir, Box::new(g0)), p0), cfg)
            .await
            .expect("engine");
        let mut outs = Vec::new();
        for round in 0..2 {
            if round > 0 {
                // Idle for four collective timeouts, asked for stats every eighth of one
                // as the worker asks every second: commands that never reach the backend
                // must not put the keep-alives off.
                let idle_until = tokio::time::Instant::now() + 4 * timeout;
                while tokio::time::Instant::now() < idle_until {
                    tokio::time::sleep(timeout / 8).await;
                    assert!(h.stats().await.expect("stats").failed.is_none(), "the group failed while idle");
                }
            }
            let (_, mut rx) = h.submit(workload()[0].clone()).await.expect("submit");
            let mut toks = Vec::new();
            while let Some(ev) = rx.recv().await {
                match ev {
                    Event::Tokens(t) => toks.extend(t),
                    Event::Finished { reason, .. } => {
                        let ok = matches!(
                            reason,
                            mlaserve_engine::FinishReason::Length | mlaserve_engine::FinishReason::Stop(_)
                        );
                        assert!(ok, "round {round}: {reason:?}");
                    }
                    Event::Logprobs(_) => {}
                }
            }
            outs.push(toks);
        }
        h.shutdown().await.expect("shutdown");
        outs
    });
    // The follower leaves when the leader does (its shard dropped at the shutdown), not
    // before.
    if let Err(e) = follower.join().expect("follower thread") {
        assert!(e.to_string().contains("rank 0 left the group"), "{e}");
    }
    assert!(!outs[0].is_empty());
    assert_eq!(outs[0], outs[1], "the same request after the idle stretch");
}
