//! `mlaserve worker`: one rank of a worker group.
//!
//! With `--world-size 1` (the default) the process is the whole group. With N > 1 it is
//! rank `--rank` of N processes, one per GPU: rank 0 leads (it listens on `--tp-addr`
//! for the others, hands out the NCCL ids, runs the engine on a `TpLeader` and serves
//! the router), ranks 1.. follow the leader's step plans. The group registers only once
//! every rank has joined (NCCL's init returns only then). With `--etcd` the NCCL ids go
//! through etcd under the leader's lease instead of `--tp-addr`. A rank that dies makes
//! the others fail within `--collective-timeout-s`. `--backend` picks what every rank
//! computes on: the CUDA backend (NCCL on its own stream) or the CPU reference (its
//! collectives staged through the GPU's NCCL).

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
    /// Send step plans to the other ranks through a ring in shared memory (`/dev/shm`)
    /// when every rank can map it; otherwise, or with `false`, over NCCL.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1,
          default_missing_value = "true", value_name = "BOOL")]
    pub shared_memory_plans: bool,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub worker: mlaserve_worker::WorkerArgs,
    #[command(flatten)]
    pub tp: TpArgs,
    /// Backend of the group's ranks (every rank of a group must be given the same one).
    #[command(flatten)]
    pub backend: super::backend::BackendArgs,
}

use mlaserve_model::progress::LoadProgress;
use std::sync::Arc;

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
            let mut w = a.worker;
            // /metrics from the start: a large checkpoint's load is watched there.
            if let Some(m) = w.metrics_listen.take() {
                let at = mlaserve_cluster::metrics::serve(m)
                    .await
                    .map_err(|e| anyhow::anyhow!("--metrics-listen {m}: {e}"))?;
                println!("metrics on http://{at}/metrics");
            }
            let progress = Arc::new(LoadProgress::new(format!("loading {}", w.model.display()), 0));
            let follow = mlaserve_worker::load::follow(progress.clone());
            let engine = super::backend::spawn_engine(&a.backend, w.model.clone(), &w.engine, progress.clone()).await?;
            mlaserve_worker::load::finish(follow, &progress);
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
    let h = mlaserve_worker::start(w, engine, world).await?;
    println!("mlaserve worker group `{}` (TP {world}) listening on {}", h.group, h.addr);
    mlaserve_cluster::shutdown_signal().await;
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
    use mlaserve_core::Backend;
    use mlaserve_cpu::{CpuBackend, CpuOptions};
    use mlaserve_tp::nccl::{new_group_ids, NcclCollective, GROUP_ID_BYTES, ID_BYTES};
    use mlaserve_tp::rendezvous;
    use mlaserve_tp::{run_follower, Plans, TpLeader};
    use std::path::Path;
    use std::time::Duration;

    fn ordinal(tp: &TpArgs) -> mlaserve_core::Result<usize> {
        if let Some(g) = tp.gpu {
            return Ok(g);
        }
        Ok(tp.rank % mlaserve_tp::nccl::device_count()?.max(1))
    }

    /// Whether the ranks compute on the CUDA backend.
    fn on_gpu(b: &super::super::backend::BackendArgs, tp: &TpArgs) -> anyhow::Result<bool> {
        use super::super::backend::BackendKind;
        #[cfg(feature = "cuda")]
        if b.backend != BackendKind::Cpu {
            let present = ordinal(tp).map(|o| mlaserve_cuda::Gpu::new(o).is_ok()).unwrap_or(false);
            anyhow::ensure!(
                present || b.backend == BackendKind::Auto,
                "--backend cuda: no usable GPU for rank {}",
                tp.rank
            );
            return Ok(present);
        }
        #[cfg(not(feature = "cuda"))]
        anyhow::ensure!(
            b.backend != BackendKind::Cuda,
            "--backend cuda: this build has no CUDA; rebuild with `cargo build --release -p mlaserve --features cuda`"
        );
        let _ = tp;
        Ok(false)
    }

    /// The step-plan channel: the shared-memory ring, set up over a host-staged NCCL
    /// communicator that stays the channel when a rank cannot map the ring (or with
    /// `--shared-memory-plans false`). The backend has its own communicator: the CPU
    /// backend a second `NcclCollective`, the CUDA backend NCCL on its own stream.
    fn plans(tp: &TpArgs, ids: &[u8]) -> mlaserve_core::Result<Plans<NcclCollective>> {
        let t = Duration::from_secs(tp.collective_timeout_s);
        let c = NcclCollective::new(ordinal(tp)?, tp.rank, tp.world_size, &ids[ID_BYTES..], t)?;
        let (plans, how) = Plans::connect(c, tp.shared_memory_plans)?;
        eprintln!("rank {} of {}: step plans over {how}", tp.rank, tp.world_size);
        Ok(plans)
    }

    fn cpu_backend(tp: &TpArgs, ids: &[u8], model: &Path, opts: CpuOptions) -> mlaserve_core::Result<CpuBackend> {
        let t = Duration::from_secs(tp.collective_timeout_s);
        let inner = NcclCollective::new(ordinal(tp)?, tp.rank, tp.world_size, &ids[..ID_BYTES], t)?;
        CpuBackend::load_with(model, opts, Box::new(inner))
    }

    #[cfg(feature = "cuda")]
    fn cuda_backend(
        b: &super::super::backend::BackendArgs,
        tp: &TpArgs,
        ids: &[u8],
        model: &Path,
        engine: &mlaserve_worker::EngineArgs,
    ) -> mlaserve_core::Result<mlaserve_cuda::CudaBackend> {
        let init = mlaserve_cuda::TpInit {
            rank: tp.rank,
            world: tp.world_size,
            id: ids[..ID_BYTES].to_vec(),
            timeout: Duration::from_secs(tp.collective_timeout_s),
        };
        let opts = b.cuda_options(engine, ordinal(tp)?);
        super::super::backend::load_cuda(model, opts, Some(&init), b.load_format, None)
    }

    #[cfg(not(feature = "cuda"))]
    fn cuda_backend(
        _: &super::super::backend::BackendArgs,
        _: &TpArgs,
        _: &[u8],
        _: &Path,
        _: &mlaserve_worker::EngineArgs,
    ) -> mlaserve_core::Result<CpuBackend> {
        Err(mlaserve_core::Error::Backend("this build has no CUDA".into()))
    }

    fn follow<B: Backend>(a: &Args, backend: mlaserve_core::Result<B>, ids: &[u8]) -> anyhow::Result<()> {
        let mut backend = backend.with_context(|| format!("--model {}", a.worker.model.display()))?;
        let plans = plans(&a.tp, ids)?;
        eprintln!("mlaserve worker rank {} of {} following {}", a.tp.rank, a.tp.world_size, a.tp.tp_addr);
        run_follower(&mut backend, &plans).context("following the leader's step plans")
    }

    pub fn run(a: Args) -> anyhow::Result<()> {
        let group = a.worker.group.clone().unwrap_or_else(|| "default".into());
        let timeout = Duration::from_secs(a.tp.collective_timeout_s.max(30));
        let via_etcd = !a.worker.etcd.is_empty();
        let gpu = on_gpu(&a.backend, &a.tp)?;
        anyhow::ensure!(
            gpu || a.backend.load_format == super::super::backend::LoadFormat::Auto,
            "--load-format dummy: random weights are made on the GPU; this group runs on the CPU backend"
        );
        let (model, engine_args) = (a.worker.model.clone(), a.worker.engine.clone());
        let cpu_opts = a.backend.cpu_options(engine_args.kv_blocks_or_default());
        if a.tp.rank > 0 {
            let ids = if via_etcd {
                let (eps, cluster) = (a.worker.etcd.clone(), a.worker.cluster.clone());
                super::super::runtime()?.block_on(mlaserve_worker::nccl_id::fetch(&eps, &cluster, &group, timeout))?
            } else {
                rendezvous::join(a.tp.tp_addr, &group, a.tp.rank, a.tp.world_size, timeout)?
            };
            anyhow::ensure!(
                ids.len() == GROUP_ID_BYTES,
                "group `{group}`: the leader handed out {} bytes of NCCL ids, expected {GROUP_ID_BYTES}",
                ids.len()
            );
            // The backend first: its communicator's init waits for every rank's, in the
            // same order on every rank (backend, then plans).
            return if gpu {
                follow(&a, cuda_backend(&a.backend, &a.tp, &ids, &model, &engine_args), &ids)
            } else {
                follow(&a, cpu_backend(&a.tp, &ids, &model, cpu_opts), &ids)
            };
        }
        let ids = new_group_ids()?;
        let listener = if via_etcd {
            None
        } else {
            Some(std::net::TcpListener::bind(a.tp.tp_addr).with_context(|| format!("--tp-addr {}", a.tp.tp_addr))?)
        };
        let (tp, world, backend) = (a.tp.clone(), a.tp.world_size, a.backend.clone());
        let (eps, cluster, lease) = (a.worker.etcd.clone(), a.worker.cluster.clone(), a.worker.lease_ttl_s);
        let (group2, ids2) = (group.clone(), ids.clone());
        let join = move || -> mlaserve_core::Result<()> {
            match &listener {
                Some(l) => rendezvous::serve(l, &group2, world, &ids2, timeout),
                None => Ok(()),
            }
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
            let engine = if gpu {
                let cfg = worker.engine.gpu_engine_config();
                let make = move || {
                    join()?;
                    let b = cuda_backend(&backend, &tp, &ids, &model, &engine_args)?;
                    TpLeader::new(b, plans(&tp, &ids)?)
                };
                mlaserve_engine::EngineHandle::spawn(make, cfg).await?
            } else {
                let cfg = worker.engine.engine_config();
                let make = move || {
                    join()?;
                    let b = cpu_backend(&tp, &ids, &model, cpu_opts)?;
                    TpLeader::new(b, plans(&tp, &ids)?)
                };
                mlaserve_engine::EngineHandle::spawn(make, cfg).await?
            };
            serve_group(worker, engine, world).await
        })
    }
}
