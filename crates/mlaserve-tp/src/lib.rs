//! mlaserve-tp: what turns N processes into one tensor-parallel worker group.
//!
//! [`rendezvous`] hands NCCL's 128-byte unique id from the leader (rank 0) to every
//! follower over TCP on the leader's address, as torchrun's store does, with deadlines
//! and errors that name the missing ranks. [`nccl`] (feature `nccl`) is the
//! [`mlaserve_core::Collective`] over a real NCCL communicator, with a bounded wait on
//! every operation so a dead or stalled peer fails the others instead of hanging them.

pub mod rendezvous;

#[cfg(feature = "nccl")]
pub mod nccl;
