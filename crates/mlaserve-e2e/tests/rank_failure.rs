//! A tensor-parallel group that loses a rank mid-stream: the client's stream ends with
//! UNAVAILABLE (the group failed; another group may serve the request), not INTERNAL,
//! and the group refuses new requests the same way. The group is two ranks on the CPU backend, one thread
//! each over the in-process collective; the router and the worker are the real servers
//! on loopback. "Killing" rank 1 ends its thread, so its end of every collective goes
//! away — what a dead process does to NCCL.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use mlaserve_core::{Collective, Result as CoreResult};
use mlaserve_cpu::{CpuBackend, CpuOptions};
use mlaserve_engine::EngineHandle;
use mlaserve_router::{RouterArgs, RouterHandle};
use mlaserve_tp::{run_follower, LocalGroup, TpLeader};
use mlaserve_worker::{WorkerArgs, WorkerHandle};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;
use tonic::Code;

/// A follower's plan channel that fails once `killed` is set: the follower loop returns
/// and the thread drops its ends of both collectives.
struct Killable {
    inner: LocalGroup,
    killed: Arc<AtomicBool>,
}

impl Killable {
    fn check(&self) -> CoreResult<()> {
        if self.killed.load(Ordering::Acquire) {
            return Err(mlaserve_core::Error::Collective("rank killed by the test".into()));
        }
        Ok(())
    }
}

impl Collective for Killable {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> CoreResult<()> {
        self.check()?;
        self.inner.all_reduce_sum(buf)
    }
    fn all_gather(&self, local: &[f32]) -> CoreResult<Vec<f32>> {
        self.check()?;
        self.inner.all_gather(local)
    }
    fn broadcast_u32(&self, buf: &mut [u32], root: usize) -> CoreResult<()> {
        self.check()?;
        self.inner.broadcast_u32(buf, root)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_rank_mid_stream_reaches_the_client_as_unavailable() {
    let model = model_path();
    let opts = CpuOptions { num_blocks: 128, ..Default::default() };
    let timeout = Duration::from_secs(10);
    let (mut inner, mut plans) = (LocalGroup::new(2, timeout), LocalGroup::new(2, timeout));
    let killed = Arc::new(AtomicBool::new(false));
    let follower = {
        let (comm, plans) = (inner.pop().unwrap(), Killable { inner: plans.pop().unwrap(), killed: killed.clone() });
        let dir = model.clone();
        std::thread::spawn(move || {
            let mut backend = CpuBackend::load_with(&dir, opts, Box::new(comm)).unwrap();
            run_follower(&mut backend, &plans)
        })
    };
    let (comm0, plans0) = (inner.pop().unwrap(), plans.pop().unwrap());

    let mut wargs = WorkerArgs::new(model.clone());
    wargs.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    wargs.engine.kv_blocks = Some(128);
    let cfg = wargs.engine.engine_config();
    let worker: Background<WorkerHandle> = Background::start(move || async move {
        let make = move || TpLeader::new(CpuBackend::load_with(&model, opts, Box::new(comm0))?, plans0);
        let engine = EngineHandle::spawn(make, cfg).await.unwrap();
        mlaserve_worker::start(wargs, engine, 2).await.unwrap()
    });
    let worker_addr = format!("http://{}", worker.get().addr);
    let router: Background<RouterHandle> = {
        let mut args = RouterArgs::new(model_path());
        args.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        args.workers = vec![worker_addr];
        Background::start(move || async move { mlaserve_router::start(args).await.unwrap() })
    };
    let pool = router.get().pool().clone();
    assert!(eventually(READY, || pool.ready_count() == 1).await);
    let group = pool.ready_groups().pop().unwrap();
    assert_eq!(group.info.tp_size, 2, "the group reports its real TP size");

    let mut c = client(router.get().addr).await;
    let mut stream = c.generate(ids_request((2..12).collect(), 400)).await.unwrap().into_inner();
    let first = stream.next().await.unwrap().unwrap();
    assert!(!first.token_ids.is_empty(), "the group streams before the kill");
    killed.store(true, Ordering::Release);
    let t0 = Instant::now();
    let status = loop {
        match tokio::time::timeout(Duration::from_secs(30), stream.next()).await.expect("the stream ends") {
            Some(Ok(m)) => assert!(m.finish.is_none(), "the request cannot finish after the kill"),
            Some(Err(s)) => break s,
            None => panic!("the stream ended without a status"),
        }
    };
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("group failed"), "{}", status.message());
    assert!(t0.elapsed() < Duration::from_secs(20), "failed {:?} after the kill", t0.elapsed());
    let err = follower.join().unwrap().expect_err("the killed rank's loop ends with an error");
    assert!(err.to_string().contains("killed"), "{err}");
    // The failed group refuses new requests as UNAVAILABLE too.
    let refused = c.generate(ids_request(vec![2, 3], 4)).await;
    let code = match refused {
        Err(s) => s.code(),
        Ok(r) => r.into_inner().next().await.unwrap().expect_err("no group can serve").code(),
    };
    assert_eq!(code, Code::Unavailable);
}
