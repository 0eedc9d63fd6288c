//! The `mlaserve` binary's library half: what composes the crates below it and what the
//! end-to-end tests drive as a user would. [`serve`] runs a router and one worker group
//! in one process; [`client`] is the command-line client of the public API (`generate`)
//! and its load generator (`bench serve`).

pub mod client;
pub mod http_bench;
pub mod serve;
pub mod workload;
