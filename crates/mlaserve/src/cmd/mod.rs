//! One module per subcommand.

pub mod backend;
pub mod bench;
pub mod bench_load;
pub mod bench_serve;
pub mod gen_model;
pub mod generate;
pub mod router;
pub mod serve;
pub mod worker;

/// The multi-threaded tokio runtime the serving subcommands run on.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build()
}
