#!/usr/bin/env bash
# Loading speed of a DeepSeek-V3-width fp8 checkpoint in the HF layout, beside the disk's
# and the page cache's read rates of the same files, all in one run (docs/PERFORMANCE-fp8.md).
#
# On the GPU machine, from the repo root, over a staged pack (tools/gpu/stage.sh --pack):
#   GPU_PACK=.gpu-pack/gpu.tar.xz tools/gpu/load_speed.sh [LAYERS]
# LAYERS (default 3: V3's three dense layers and its MTP layer, an MoE one; ~21 GB) is
# what the disk allows: each further layer is an MoE layer of ~11.6 GB. The checkpoint
# goes to $MLASERVE_LOAD_DIR (default /tmp/mlaserve-v3-fp8) and is deleted afterwards.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
gpu_dir="${GPU_DIR:-$repo/.gpu}"
if [[ -n "${GPU_PACK:-}" ]]; then
    gpu_dir=/tmp/mlaserve-gpu
    mkdir -p "$gpu_dir" && tar -C "$gpu_dir" -xJf "$GPU_PACK"
fi
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
layers="${1:-3}"
dir="${MLASERVE_LOAD_DIR:-/tmp/mlaserve-v3-fp8}"
trap 'rm -rf "$dir"' EXIT
rm -rf "$dir"
df -h "$(dirname "$dir")" | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
"$gpu_dir/bin/mlaserve" gen-model --preset deepseek-v3 --fp8 --layers "$layers" --out "$dir" >/dev/null
echo "gen-model --preset deepseek-v3 --fp8 --layers $layers: $(du -sh "$dir" | cut -f1) in $((SECONDS - t0)) s"
"$gpu_dir/bin/mlaserve" bench load --model "$dir" --cold
