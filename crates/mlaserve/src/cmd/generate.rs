//! `mlaserve generate`: stream one completion to the terminal, then a usage line.

pub use mlaserve::client::GenerateArgs as Args;

pub fn run(args: Args) -> anyhow::Result<()> {
    super::runtime()?.block_on(mlaserve::client::generate(args))?;
    Ok(())
}
