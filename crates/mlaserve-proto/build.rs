//! Compiles `proto/` with a vendored `protoc` (no system protoc needed). The public and
//! worker APIs also get a file descriptor set for gRPC reflection; the etcd subset is
//! client-only and stays out of it (the servers do not serve etcd).

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read at run time, not baked in with env!(): cargo may reuse one compiled build
    // script for checkouts at other paths, which must each compile their own protos.
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let ours = [root.join("mlaserve/v1/generation.proto"), root.join("mlaserve/worker/v1/worker.proto")];
    let etcd = root.join("etcd/etcd_v3_subset.proto");
    for p in ours.iter().chain([&etcd]) {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    // tonic-prost-build runs the `protoc` named by PROTOC; point it at the vendored one.
    // (A build script is single-threaded, so setting the variable here is sound.)
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("mlaserve_descriptor.bin"))
        .compile_protos(&ours, std::slice::from_ref(&root))?;
    tonic_prost_build::configure().build_server(false).compile_protos(&[etcd], &[root])?;
    Ok(())
}
