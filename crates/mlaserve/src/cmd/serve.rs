//! `mlaserve serve`: router + one worker group in one process (CPU backend for now;
//! the GPU backend plugs in through `mlaserve_worker::serve::run_with_engine`).

pub use mlaserve_worker::ServeArgs as Args;

pub fn run(args: Args) -> anyhow::Result<()> {
    super::runtime()?.block_on(mlaserve_worker::serve::run_cpu(args))?;
    Ok(())
}
