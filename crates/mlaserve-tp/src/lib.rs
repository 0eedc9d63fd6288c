//! mlaserve-tp: everything that turns N ranks into one tensor-parallel worker group.
//!
//! [`leader`] is the execution model: the leader runs the engine on a [`TpLeader`]
//! (itself a `Backend`) that sends each step plan before running its own shard;
//! followers sit in [`run_follower`] and replay the plans on theirs. [`plans`] is how
//! plans cross: [`shm`]'s ring in shared memory when the ranks share a host, else
//! frames broadcast over a collective. [`local_group`] is
//! the in-process [`LocalGroup`] collective (CPU tests of TP 2/4/8, one thread a rank).
//! [`rendezvous`] hands NCCL's 128-byte unique id from the leader to every follower over
//! TCP on the leader's address, as torchrun's store does, with deadlines and errors that
//! name the missing ranks. [`nccl`] (feature `nccl`) is the one NCCL wrapper: the
//! communicator with a bounded wait on every operation, so a dead or stalled peer fails
//! the others instead of hanging them.

pub mod leader;
pub mod local_group;
pub mod plans;
pub mod rendezvous;
pub mod shm;
mod wait;

#[cfg(feature = "nccl")]
pub mod nccl;

pub use leader::{run_follower, TpHidden, TpLeader};
pub use local_group::LocalGroup;
pub use plans::{PlanChannel, Plans};
