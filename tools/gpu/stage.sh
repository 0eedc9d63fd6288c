#!/usr/bin/env bash
# Builds the GPU binaries on the CPU machine and stages them in .gpu/ (git-ignored),
# ready for a device call that carries [".gpu"] and runs tools/gpu/check.sh.
#
#   .gpu/bin/mlaserve-cuda-check   checks + benchmark (mlaserve-cuda-lab)
#   .gpu/tests/*                   cargo test binaries of mlaserve-cuda and mlaserve-cuda-lab
#                                  (unit + GPU)
#   .gpu/benches/*                 the GPU benchmarks of benches/ (gpu_kernels, gpu_engine)
#   .gpu/kernels/*.fatbin          the embedded kernel images (for cuobjdump there)
#   .gpu/bin/mlaserve              the CLI (--features cuda): bench step --tp, TP workers
#   .gpu/tests/tp_group            mlaserve-tp's group test (--features nccl): processes
#                                  over real NCCL
#
# Needs nvcc (CUDA_HOME, NVCC or PATH; tools/ci/install-nvcc.sh installs one).
#
# `--pack DIR`: also writes DIR/gpu.tar.xz (bin, tests, benches, kernels; ~3% of their size)
# for a device call whose working tree would be too large with .gpu/: carry DIR (add it
# to .git/info/exclude) and run `GPU_PACK=DIR/gpu.tar.xz tools/gpu/check.sh`.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
if [[ -z "${CUDA_HOME:-}${NVCC:-}" ]] && ! command -v nvcc >/dev/null; then
    py="$(ls -d .venv-nvcc/lib/python3*/site-packages/nvidia/cu13 2>/dev/null | head -1 || true)"
    [[ -n "$py" ]] && export CUDA_HOME="$repo/$py"
fi
target="${CARGO_TARGET_DIR:-$repo/target}"
cargo build --release -p mlaserve-cuda-lab --features cuda --bin mlaserve-cuda-check
cargo build --release -p mlaserve --features cuda
tp_test=$(cargo test --release -p mlaserve-tp --features nccl --test group --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    try: m=json.loads(l)
    except ValueError: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="group":
        print(m["executable"])')
# --message-format=json names the test executables; keep those of mlaserve-cuda(-lab).
tests=$(cargo test --release -p mlaserve-cuda -p mlaserve-cuda-lab --features mlaserve-cuda-lab/cuda --no-run \
    --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    try: m=json.loads(l)
    except ValueError: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and "mlaserve-cuda" in m["package_id"] and m["profile"]["test"] and m["target"]["kind"][0] in ("lib","test"):
        print(m["executable"])')
benches=$(cargo bench -p mlaserve-benches --features cuda --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    try: m=json.loads(l)
    except ValueError: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"][0]=="bench":
        print(m["executable"])')
rm -rf .gpu/bin .gpu/tests .gpu/kernels .gpu/benches
mkdir -p .gpu/bin .gpu/tests .gpu/kernels .gpu/benches
cp "$target/release/mlaserve-cuda-check" "$target/release/mlaserve" .gpu/bin/
cp "$tp_test" .gpu/tests/tp_group
for t in $tests; do
    name="$(basename "$t")"
    # module_graph reads the source tree, which the GPU machine does not have (CI runs it).
    [[ "${name%-*}" == module_graph ]] && continue
    cp "$t" ".gpu/tests/${name%-*}"   # drop cargo's hash suffix
done
for b in $benches; do
    name="$(basename "$b")"
    cp "$b" ".gpu/benches/${name%-*}"
done
out_dir="$(ls -td "$target"/release/build/mlaserve-cuda-[0-9a-f]*/out 2>/dev/null | head -1)"
cp "$out_dir"/*.fatbin "$out_dir"/*.ptxas.log .gpu/kernels/ 2>/dev/null || true
strip --strip-debug .gpu/bin/* .gpu/tests/* .gpu/benches/*  # line tables would triple the carry
du -sh .gpu/* ; ls -la .gpu/tests
if [[ "${1:-}" == "--pack" && -n "${2:-}" ]]; then
    mkdir -p "$2"
    # One xz stream with a 384 MiB window (about 4 GB to compress, 400 MB to unpack): the
    # binaries embed the same kernels, and the window spans them all (16.0 MB with xz -9
    # -T2, whose threads each see a block of their own; 12.6 MB so, in about 3 minutes).
    tar -C .gpu -cf - bin tests benches kernels | xz -T1 --lzma2=preset=9,dict=384MiB > "$2/gpu.tar.xz"
    ls -la "$2/gpu.tar.xz"
fi
