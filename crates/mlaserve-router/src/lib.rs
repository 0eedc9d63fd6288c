//! mlaserve-router: the public gRPC front of mlaserve.
//!
//! A request flows: [`admission`] (bounded, RESOURCE_EXHAUSTED when full) →
//! [`validate`] (INVALID_ARGUMENT naming the field; the prompt is tokenized here) →
//! [`pool`] picks a ready group by the [`balance`] policy (prefix affinity within a load
//! bound, or the least outstanding tokens) → [`group`] hands it
//! to the group's leader over one batched session → token events come back and are
//! turned into text by [`detok`] and cut by [`stop`] → streamed to the client by
//! [`service`]. Dropping the client stream aborts the request in the group. Groups come
//! from [`discovery`] (static list or etcd leases); [`health`] and [`metrics`] report.
//! [`error`] maps every failure to its status code in one place.

pub mod admission;
pub mod args;
pub mod balance;
pub mod deadline;
pub mod detok;
pub mod discovery;
pub mod error;
pub mod group;
pub mod health;
pub mod http;
mod limit;
pub mod metrics;
pub mod pool;
pub mod server;
pub mod service;
pub mod stop;
pub mod validate;

pub use args::RouterArgs;
pub use error::RouterError;
pub use server::{run, start, RouterHandle, StartError};
