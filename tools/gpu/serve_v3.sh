#!/usr/bin/env bash
# DeepSeek-V3 served at its real widths: a tensor-parallel worker group on random fp8
# weights (`--load-format dummy`: the 688 GB checkpoint need not be on disk), a router,
# and `bench serve` at 64, 128, 256 and 512 concurrent streams (docs/PERFORMANCE-fp8.md).
#
# On an 8-GPU machine, from the repo root, over a staged pack (tools/gpu/stage.sh --pack):
#   GPU_PACK=.gpu-pack/gpu.tar.xz tools/gpu/serve_v3.sh            # TP 8, all 61 layers
#   GPU_PACK=.gpu-pack/gpu.tar.xz tools/gpu/serve_v3.sh 2 4        # TP 2, 4 layers (a check)
# Arguments: TP (GPUs, default 8), LAYERS (default 61), CONCURRENCY list (default
# "64 128 256 512"). Logs go to $OUT (default ./gpu-out): the ranks', the router's and
# the benchmark's. Exit status: non-zero if the group did not come up or a run failed.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
gpu_dir="${GPU_DIR:-$repo/.gpu}"
if [[ -n "${GPU_PACK:-}" ]]; then
    gpu_dir=/tmp/mlaserve-gpu
    mkdir -p "$gpu_dir" && tar -C "$gpu_dir" -xJf "$GPU_PACK" || exit 1
fi
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
tp="${1:-8}"
layers="${2:-61}"
conc="${3:-64 128 256 512}"
out="${OUT:-$repo/gpu-out}"
mkdir -p "$out"
bin="$gpu_dir/bin/mlaserve"
model="$(mktemp -d)"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$model"; }
trap cleanup EXIT

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
"$bin" gen-model --preset deepseek-v3 --fp8 --layers "$layers" --config-only --out "$model" || exit 1
for ((r = tp - 1; r >= 0; r--)); do
    listen=()
    ((r == 0)) && listen=(--listen 127.0.0.1:50261)
    "$bin" worker --model "$model" --backend cuda --load-format dummy --world-size "$tp" --rank "$r" \
        --tp-addr 127.0.0.1:29711 "${listen[@]}" >"$out/rank$r.log" 2>&1 &
    pids+=($!)
done
t0=$SECONDS
until grep -q "listening" "$out/rank0.log"; do
    if ((SECONDS - t0 > 900)) || ! kill -0 "${pids[-1]}" 2>/dev/null; then
        echo "the group did not come up; rank 0's log:"
        tail -20 "$out/rank0.log"
        exit 1
    fi
    sleep 1
done
echo "TP $tp group of $layers layers (random fp8 weights) serving after $((SECONDS - t0)) s"
grep -h "memory plan\|KV" "$out/rank0.log" | head -3
"$bin" router --model "$model" --worker http://127.0.0.1:50261 --listen 127.0.0.1:50251 >"$out/router.log" 2>&1 &
pids+=($!)
sleep 2
status=0
for c in $conc; do
    echo "=== bench serve: $c concurrent streams"
    "$bin" bench serve --addr http://127.0.0.1:50251 --concurrency "$c" --requests $((2 * c)) \
        --prompt-tokens 1024 --max-new-tokens 128 --connections 16 --time-limit-s 600 \
        2>&1 | tee -a "$out/bench-serve.log" || status=1
done
exit $status
