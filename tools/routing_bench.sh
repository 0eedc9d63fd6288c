#!/usr/bin/env bash
# Cache-aware routing (docs/PERFORMANCE.md, "Cache-aware routing"): two worker groups
# behind one router, `bench serve --workload shared-prefix` through it, once per routing
# policy (least-loaded, prefix-affinity), each on a fresh pair of groups. Prints each
# run's cached prompt tokens, TTFT and the router's routing decisions by reason, then the
# ratio of cached tokens (prefix affinity over least loaded).
#
#   tools/routing_bench.sh [MLASERVE_BINARY]      # default: target/release/mlaserve
#
# Environment: MODEL (default the bundled model), BACKEND (cpu or cuda; default cpu;
# both groups on GPU 0 with cuda), WORKER_ARGS (extra worker flags, e.g. `--load-format
# dummy`), KV_BLOCKS (per group, default 128), MAX_SEQS (per group, default 8), SYSTEMS
# (default 8), SYS (system prompt tokens, default 384..=640), TURNS (default 4), PROMPT
# (user tokens per turn, default 32), NEW (default 32), CONC (conversations at once,
# default 8), REQS (turns in all, default 192), VOCAB (default 4000), SLACK (the affinity
# bound's slack tokens, default 512), LOGS.
#
# DeepSeek-V3's widths on one GPU (4 layers on random fp8 weights, 1-2k-token system
# prompts):
#   bin/mlaserve gen-model --preset deepseek-v3 --fp8 --layers 4 --config-only --out /tmp/v3
#   BACKEND=cuda MODEL=/tmp/v3 WORKER_ARGS="--load-format dummy" SYS=1024..=2048 \
#       tools/routing_bench.sh bin/mlaserve
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${1:-$repo/target/release/mlaserve}"
backend="${BACKEND:-cpu}"
model="${MODEL:-$repo/models/mla-tiny-code}"
logs="${LOGS:-$(mktemp -d)}"
mkdir -p "$logs"
[[ -x "$bin" ]] || { echo "no mlaserve binary at $bin (cargo build --release -p mlaserve)"; exit 1; }

pids=()
stop() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; pids=(); }
trap stop EXIT
ready() { # ready PORT N: the router at PORT's metrics show N ready groups
    local t0=$SECONDS
    until curl -sf "http://127.0.0.1:$1/metrics" | grep -q "^mlaserve_ready_groups $2"; do
        if ((SECONDS - t0 > 600)); then echo "the groups did not come up:"; tail -5 "$logs"/*.log; return 1; fi
        sleep 1
    done
}

declare -A cached
for policy in least-loaded prefix-affinity; do
    for g in 0 1; do
        # shellcheck disable=SC2086
        "$bin" worker --model "$model" --backend "$backend" --listen "127.0.0.1:5088$g" \
            --kv-blocks "${KV_BLOCKS:-128}" --max-num-seqs "${MAX_SEQS:-8}" ${WORKER_ARGS:-} \
            >"$logs/worker-$policy-$g.log" 2>&1 &
        pids+=($!)
    done
    "$bin" router --model "$model" --worker 127.0.0.1:50880 --worker 127.0.0.1:50881 \
        --routing-policy "$policy" --affinity-slack-tokens "${SLACK:-512}" \
        --listen 127.0.0.1:50870 --metrics-listen 127.0.0.1:50871 >"$logs/router-$policy.log" 2>&1 &
    pids+=($!)
    ready 50871 2 || exit 1
    "$bin" bench serve --addr http://127.0.0.1:50870 --workload shared-prefix \
        --system-prompts "${SYSTEMS:-8}" --system-prompt-tokens "${SYS:-384..=640}" --turns "${TURNS:-4}" \
        --prompt-tokens "${PROMPT:-32}" --max-new-tokens "${NEW:-32}" --concurrency "${CONC:-8}" \
        --requests "${REQS:-192}" --vocab "${VOCAB:-4000}" >"$logs/bench-$policy.txt" 2>"$logs/bench-$policy.err"
    curl -sf http://127.0.0.1:50871/metrics >"$logs/metrics-$policy.txt"
    cached[$policy]=$(awk '/in the prefix cache/ { for (i = 1; i <= NF; i++) if ($i ~ /%$/) { sub("%", "", $i); print $i } }' "$logs/bench-$policy.txt")
    echo "$policy: $(grep -E '^throughput' "$logs/bench-$policy.txt"); $(grep -E 'TTFT' "$logs/bench-$policy.txt" | head -1)"
    echo "    $(grep -E 'in the prefix cache' "$logs/bench-$policy.txt")"
    echo "    routed: $(grep '^mlaserve_router_routed_total' "$logs/metrics-$policy.txt" | sed -E 's/mlaserve_router_routed_total//' | tr '\n' ' ')"
    stop
    sleep 2
done
awk -v a="${cached[prefix-affinity]:-0}" -v b="${cached[least-loaded]:-0}" \
    'BEGIN { printf "cached prompt tokens: prefix-affinity %s%%, least-loaded %s%%, ratio %.2f\n", a, b, (b > 0 ? a / b : 0) }'
