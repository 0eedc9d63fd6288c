//! `mlaserve router`: the public gRPC front over worker groups (static or etcd).

pub use mlaserve_router::RouterArgs as Args;

pub fn run(args: Args) -> anyhow::Result<()> {
    super::runtime()?.block_on(mlaserve_router::run(args))?;
    Ok(())
}
