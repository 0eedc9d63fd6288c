//! `mlaserve bench serve`: concurrent streaming clients against a router; prints TTFT,
//! inter-token and end-to-end latency percentiles and throughput.

pub use mlaserve::client::BenchArgs as Args;

pub fn run(args: Args) -> anyhow::Result<()> {
    let report = super::runtime()?.block_on(mlaserve::client::bench(&args))?;
    print!("{report}");
    Ok(())
}
