//! A tensor-parallel group of CUDA backends on threads, for the GPU engine tests (kept
//! out of `common`, which mlaserve-cuda-lab's tests share without mlaserve-tp).

/// Runs `f` on the leader of a tensor-parallel group of `world` ranks on GPUs
/// `0..world` (threads: rank r loads on GPU r and follows the leader's plans over an
/// in-process channel; the backends all-reduce over their own NCCL communicator).
#[cfg(feature = "cuda")]
pub fn with_tp_group<R>(
    dir: &std::path::Path,
    opts: mlaserve_cuda::CudaOptions,
    world: usize,
    f: impl FnOnce(&mut mlaserve_tp::TpLeader<mlaserve_cuda::CudaBackend, mlaserve_tp::LocalGroup>) -> R,
) -> R {
    use mlaserve_cuda::{CudaBackend, CudaOptions, TpInit};
    use std::time::Duration;
    let id = TpInit::new_id().expect("NCCL id");
    let init = |rank| TpInit { rank, world, id: id.clone(), timeout: Duration::from_secs(60) };
    std::thread::scope(|s| {
        let mut plans = mlaserve_tp::LocalGroup::new(world, Duration::from_secs(120));
        let followers: Vec<_> = plans
            .drain(1..)
            .enumerate()
            .map(|(i, p)| {
                let init = init(i + 1);
                s.spawn(move || {
                    let o = CudaOptions { ordinal: init.rank, ..opts };
                    let mut be = CudaBackend::load_tp(dir, o, Some(&init)).expect("load follower");
                    mlaserve_tp::run_follower(&mut be, &p)
                })
            })
            .collect();
        let be = CudaBackend::load_tp(dir, opts, Some(&init(0))).expect("load leader");
        let mut leader = mlaserve_tp::TpLeader::new(be, plans.pop().expect("rank 0")).expect("leader");
        let out = f(&mut leader);
        leader.shutdown().expect("shutdown");
        for f in followers {
            f.join().expect("follower thread").expect("follower");
        }
        out
    })
}
