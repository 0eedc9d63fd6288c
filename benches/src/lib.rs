//! mlaserve-benches: the workspace's benchmarks, as `harness = false` mains in
//! `benches/benches/` (`cd benches && cargo bench`): the engine's host cost per step
//! (`engine`) and, with `--features cuda` on a GPU machine, kernel timings
//! (`gpu_kernels`) and the engine on the GPU backend (`gpu_engine`). Each GPU figure is
//! printed beside the ceiling measured in the same run. The roofline sweeps of the
//! decode and prefill attention and of a whole decode step are `mlaserve bench
//! mla-decode|mla-prefill|step` (mlaserve-cuda-lab).
