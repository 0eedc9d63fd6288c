//! mlaserve-e2e: a home for the workspace-level serving tests (`tests/`), which start
//! real servers on loopback and speak real gRPC to them. The library itself is empty.
