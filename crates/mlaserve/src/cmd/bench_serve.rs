//! `mlaserve bench serve`: concurrent streaming clients against a router; prints TTFT,
//! inter-token and end-to-end latency percentiles and throughput.

pub use mlaserve_router::client::BenchArgs as Args;

pub fn run(args: Args) -> anyhow::Result<()> {
    let report = super::runtime()?.block_on(mlaserve_router::client::bench(&args))?;
    print!("{report}");
    Ok(())
}
