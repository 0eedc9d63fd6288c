//! mlaserve-cluster: what both servers of a cluster share, below both of them.
//!
//! [`etcd`] is a small etcd v3 client (prefix listing, leases, prefix watch);
//! [`keys`] is the key layout both sides read and write (a group's registration, its
//! NCCL ids); [`lease`] keeps one key alive under a lease for as long as its owner
//! lives ([`LeasedKey`]); [`metrics`] is the process's Prometheus recorder and its
//! `/metrics` endpoint; [`shutdown`] resolves on SIGTERM or Ctrl-C; [`tls`] serves and
//! connects over TLS with certificates from files; [`auth`] checks bearer keys;
//! [`probe`] serves gRPC health without TLS for probes that cannot speak it.

pub mod auth;
pub mod etcd;
pub mod keys;
pub mod lease;
pub mod metrics;
pub mod probe;
pub mod shutdown;
pub mod tls;

pub use etcd::{Etcd, EtcdError};
pub use keys::Registration;
pub use lease::LeasedKey;
pub use shutdown::shutdown_signal;
