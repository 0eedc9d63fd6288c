//! `mlaserve worker`: one worker group's leader (CPU backend for now).

pub use mlaserve_worker::WorkerArgs as Args;

pub fn run(args: Args) -> anyhow::Result<()> {
    super::runtime()?.block_on(mlaserve_worker::run_cpu(args))?;
    Ok(())
}
