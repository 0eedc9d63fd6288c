//! Generated gRPC code: the public `mlaserve.v1` API (clients ↔ router) and the internal
//! `mlaserve.worker.v1` API (router ↔ group leader), plus the subset of etcd's v3 API
//! that discovery speaks. The `.proto` sources live in the
//! workspace's `proto/` folder; nothing here is written by hand except this file.

#![allow(missing_debug_implementations, clippy::all)]

/// `mlaserve.v1`: Generate / Tokenize / GetModelInfo.
pub mod v1 {
    tonic::include_proto!("mlaserve.v1");
}

/// `mlaserve.worker.v1`: the router ↔ leader session.
pub mod worker {
    tonic::include_proto!("mlaserve.worker.v1");
}

/// `etcdserverpb`: the subset of etcd's v3 API that discovery uses (client side).
pub mod etcd {
    tonic::include_proto!("etcdserverpb");
}

/// The encoded `FileDescriptorSet` of both packages, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("mlaserve_descriptor");
