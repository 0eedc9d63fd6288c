//! `mlaserve worker`: one rank of a worker group.
//!
//! With `--world-size 1` (the default) the process is the whole group. With N > 1 it is
//! rank `--rank` of N processes, one per GPU: rank 0 leads (it listens on `--tp-addr`
//! for the others, hands out the NCCL ids, runs the engine on a `TpLeader` and serves
//! the router), ranks 1.. follow the leader's step plans. The group registers only once
//! every rank has joined (NCCL's init returns only then). With `--etcd` the NCCL ids go
//! through etcd under the leader's lease instead of `--tp-addr`. A rank that dies makes
//! the others fail within `--collective-timeout-s`.

use std::net::SocketAddr;

/// Tensor-parallel settings of a worker rank.
#[derive(Debug, Clone, clap::Args)]
pub struct TpArgs {
    /// This process's rank in its group (0 leads).
    #[arg(long, default_value_t = 0)]
    pub rank: usize,
    /// Processes (GPUs) in the group.
    #[arg(long, default_value_t = 1)]
    pub world_size: usize,
    /// The leader's rendezvous address (`host:port`): rank 0 listens there, the others
    /// connect to it to receive the NCCL ids.
    #[arg(long, default_value = "127.0.0.1:29500")]
    pub tp_addr: SocketAddr,
    /// Seconds a collective (and the rendezvous) may wait for the other ranks.
    #[arg(long, default_value_t = 20)]
    pub collective_timeout_s: u64,
    /// CUDA device of this rank (default: rank modulo the devices present).
    #[arg(long)]
    pub gpu: Option<usize>,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub worker: mlaserve_worker::WorkerArgs,
    #[command(flatten)]
    pub tp: TpArgs,
    /// Backend of a single-rank group (a multi-rank group runs the CPU backend with NCCL
    /// collectives for now).
    #[command(flatten)]
    pub backend: super::backend::BackendArgs,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    anyhow::ensure!(a.tp.world_size >= 1, "--world-size must be at least 1");
    anyhow::ensure!(
        a.tp.rank < a.tp.world_size,
        "--rank {} is out of range for --world-size {}",
        a.tp.rank,
        a.tp.world_size
    );
    if a.tp.world_size == 1 {
        return super::runtime()?.block_on(async move {
            let w = a.worker;
            let engine =
                super::backend::spawn_engine(&a.backend, w.model.clone(), w.kv_blocks, w.engine_config()).await?;
            serve_group(w, engine, 1).await
        });
    }
    tp::run(a)
}

/// Serves a group's engine to routers until SIGTERM or Ctrl-C, then deregisters.
async fn serve_group(
    w: mlaserve_worker::WorkerArgs,
    engine: mlaserve_engine::EngineHandle,
    world: usize,
) -> anyhow::Result<()> {
    let h = mlaserve_worker::start(w, engine).await?;
    println!("mlaserve worker group `{}` (TP {world}) listening on {}", h.group, h.addr);
    mlaserve_router::server::shutdown_signal().await;
    h.shutdown().await;
    Ok(())
}

#[cfg(not(feature = "nccl"))]
mod tp {
    pub fn run(_: super::Args) -> anyhow::Result<()> {
        anyhow::bail!("--world-size > 1 needs NCCL: rebuild with `cargo build --release -p mlaserve --features nccl`")
    }
}

#[cfg(feature = "nccl")]
mod tp {
    use super::*;
    use anyhow::Context;
    use mlaserve_core::{run_follower, TpLeader};
    use mlaserve_cpu::{CpuBackend, CpuOptions};
    use mlaserve_tp::nccl::{new_group_ids, NcclCollective};
    use mlaserve_tp::rendezvous;
    use std::time::Duration;

    fn ordinal(tp: &TpArgs) -> mlaserve_core::Result<usize> {
        if let Some(g) = tp.gpu {
            return Ok(g);
        }
        Ok(tp.rank % mlaserve_tp::nccl::device_count()?.max(1))
    }

    /// Both communicators of a rank: the backend's own, and the step-plan channel.
    fn comms(tp: &TpArgs, ids: &[u8]) -> mlaserve_core::Result<(NcclCollective, NcclCollective)> {
        let t = Duration::from_secs(tp.collective_timeout_s);
        mlaserve_tp::nccl::group_comms(ordinal(tp)?, tp.rank, tp.world_size, ids, t)
    }

    pub fn run(a: Args) -> anyhow::Result<()> {
        let group = a.worker.group.clone().unwrap_or_else(|| "default".into());
        let timeout = Duration::from_secs(a.tp.collective_timeout_s.max(30));
        let opts = CpuOptions { num_blocks: a.worker.kv_blocks, ..Default::default() };
        let via_etcd = !a.worker.etcd.is_empty();
        if a.tp.rank > 0 {
            let ids = if via_etcd {
                let (eps, cluster) = (a.worker.etcd.clone(), a.worker.cluster.clone());
                super::super::runtime()?.block_on(mlaserve_worker::nccl_id::fetch(&eps, &cluster, &group, timeout))?
            } else {
                rendezvous::join(a.tp.tp_addr, &group, a.tp.rank, a.tp.world_size, timeout)?
            };
            let (inner, plans) = comms(&a.tp, &ids)?;
            let mut backend = CpuBackend::load_with(&a.worker.model, opts, Box::new(inner))
                .with_context(|| format!("--model {}", a.worker.model.display()))?;
            eprintln!("mlaserve worker rank {} of {} following {}", a.tp.rank, a.tp.world_size, a.tp.tp_addr);
            run_follower(&mut backend, &plans).context("following the leader's step plans")?;
            return Ok(());
        }
        let ids = new_group_ids()?;
        let listener = if via_etcd {
            None
        } else {
            Some(std::net::TcpListener::bind(a.tp.tp_addr).with_context(|| format!("--tp-addr {}", a.tp.tp_addr))?)
        };
        let (tp, model, world) = (a.tp.clone(), a.worker.model.clone(), a.tp.world_size);
        let (eps, cluster, lease) = (a.worker.etcd.clone(), a.worker.cluster.clone(), a.worker.lease_ttl_s);
        let (group2, ids2) = (group.clone(), ids.clone());
        let make = move || -> mlaserve_core::Result<_> {
            if let Some(l) = &listener {
                rendezvous::serve(l, &group2, world, &ids2, timeout)?;
            }
            let (inner, plans) = comms(&tp, &ids2)?;
            let backend = CpuBackend::load_with(&model, opts, Box::new(inner))?;
            TpLeader::new(backend, plans)
        };
        let worker = a.worker;
        super::super::runtime()?.block_on(async move {
            // With etcd, the ids live under the leader's lease for as long as it runs.
            let _published = if via_etcd {
                let ttl = Duration::from_secs(lease.max(1));
                Some(mlaserve_worker::nccl_id::publish(&eps, &cluster, &group, &ids, ttl).await?)
            } else {
                None
            };
            let engine = mlaserve_engine::EngineHandle::spawn(make, worker.engine_config()).await?;
            serve_group(worker, engine, world).await
        })
    }
}
