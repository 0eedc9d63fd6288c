//! `mlaserve generate`: stream one completion to the terminal, then a usage line.

pub use mlaserve_router::client::GenerateArgs as Args;

pub fn run(args: Args) -> anyhow::Result<()> {
    super::runtime()?.block_on(mlaserve_router::client::generate(args))?;
    Ok(())
}
