#!/usr/bin/env bash
# The router's relay latency at many concurrent streams (docs/PERFORMANCE.md, "The HTTP
# API beside gRPC"): a worker, a router and the `bench serve` clients as three processes,
# each pinned to its own cores when the machine has enough of them, and `bench serve`
# over gRPC, the OpenAI HTTP API and gRPC again. For each run it reads the router's
# `mlaserve_router_relay_seconds` histogram before and after and prints the quantiles
# the buckets bound (from the group's event reaching the router to the message leaving
# it), beside the client's report line.
#
#   tools/relay_bench.sh [MLASERVE_BINARY]      # default: target/release/mlaserve
#
# Environment: MODEL (default: tiny-v3 written by gen-model), BACKEND (cpu or cuda;
# default cpu), STREAMS (default 1000), NEW (new tokens per request, default 16), PROMPT
# (default 16), VOCAB (default 500), CONNECTIONS (gRPC HTTP/2 connections, default 8),
# WORKER_CPUS / ROUTER_CPUS / CLIENT_CPUS (taskset lists; default on 16 or more cores
# 0-7 / 8-11 / 12-15, else unpinned), WORKER_ARGS (extra worker flags), GOAL_MS (default
# 1), LOGS. Exits with the number of runs whose p99 bound is above GOAL_MS.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${1:-$repo/target/release/mlaserve}"
backend="${BACKEND:-cpu}"
streams="${STREAMS:-1000}"
new="${NEW:-16}"
prompt="${PROMPT:-16}"
vocab="${VOCAB:-500}"
conns="${CONNECTIONS:-8}"
goal_s=$(awk -v g="${GOAL_MS:-1}" 'BEGIN { print g / 1000 }')
logs="${LOGS:-$(mktemp -d)}"
mkdir -p "$logs"
[[ -x "$bin" ]] || { echo "no mlaserve binary at $bin (cargo build --release -p mlaserve)"; exit 1; }

if [[ -z "${MODEL:-}" ]]; then
    MODEL="$logs/tiny-v3"
    "$bin" gen-model --preset tiny-v3 --out "$MODEL" >"$logs/gen-model.log" 2>&1 || { cat "$logs/gen-model.log"; exit 1; }
fi
pin() { # pin CPUS CMD...: exec CMD, on CPUS when a list is given (run it in a subshell)
    local cpus="$1"
    shift
    if [[ -n "$cpus" ]]; then exec taskset -c "$cpus" "$@"; else exec "$@"; fi
}
if (($(nproc) >= 16)); then
    wc="${WORKER_CPUS-0-7}" rc="${ROUTER_CPUS-8-11}" cc="${CLIENT_CPUS-12-15}"
else
    wc="${WORKER_CPUS-}" rc="${ROUTER_CPUS-}" cc="${CLIENT_CPUS-}"
fi

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
# shellcheck disable=SC2086
pin "$wc" "$bin" worker --model "$MODEL" --backend "$backend" --listen 127.0.0.1:50761 --kv-blocks 2048 \
    --max-queued 4096 ${WORKER_ARGS:-} >"$logs/worker.log" 2>&1 &
pids+=($!)
pin "$rc" "$bin" router --model "$MODEL" --worker 127.0.0.1:50761 --listen 127.0.0.1:50751 \
    --http-listen 127.0.0.1:50752 --metrics-listen 127.0.0.1:50753 --queue-size $((streams * 2)) \
    >"$logs/router.log" 2>&1 &
pids+=($!)
router_pid=$!
# The router's CPU time so far, in seconds (user + system).
router_cpu() { awk -v hz="$(getconf CLK_TCK)" '{ print ($14 + $15) / hz }' "/proc/$router_pid/stat"; }
t0=$SECONDS
until curl -sf http://127.0.0.1:50752/ready >/dev/null; do
    if ((SECONDS - t0 > 600)); then echo "the group did not come up:"; tail -20 "$logs/worker.log" "$logs/router.log"; exit 1; fi
    sleep 1
done

# quantiles BEFORE AFTER API: the bucket bounds of p50, p90 and p99 of the messages
# between the two scrapes, and the share within 1 ms (a series absent before counts 0).
quantiles() {
    awk -v api="$3" '
        index($0, "mlaserve_router_relay_seconds_bucket{api=\"" api "\"") == 1 {
            match($0, /le="[^"]+"/); le = substr($0, RSTART + 4, RLENGTH - 5)
            if (FNR == NR) before[le] = $NF; else { after[le] = $NF; order[++m] = le }
        }
        END {
            for (j = 1; j <= m; j++) { c[j] = after[order[j]] - before[order[j]] }
            n = c[m]
            if (n == 0) { print "no samples"; exit }
            split("0.5 0.9 0.99", q, " ")
            for (i = 1; i <= 3; i++) for (j = 1; j <= m; j++) if (c[j] >= q[i] * n) { v[i] = order[j]; break }
            for (j = 1; j <= m; j++) if (order[j] == "0.001") w = c[j]
            printf "relay p50 <= %s s, p90 <= %s s, p99 <= %s s, %.1f%% within 1 ms, %d messages\n", v[1], v[2], v[3], 100 * w / n, n
            exit (v[3] + 0 > goal + 0)
        }' goal="$goal_s" "$1" "$2"
}

i=0
over=0
for api in grpc openai grpc; do
    i=$((i + 1))
    curl -sf http://127.0.0.1:50753/metrics >"$logs/m$i-before.txt"
    cpu0=$(router_cpu)
    if [[ $api == grpc ]]; then addr=http://127.0.0.1:50751; else addr=http://127.0.0.1:50752; fi
    (pin "$cc" "$bin" bench serve --addr "$addr" --api "$api" --concurrency "$streams" --requests "$streams" \
        --prompt-tokens "$prompt" --max-new-tokens "$new" --vocab "$vocab" --connections "$conns" \
        >"$logs/bench$i.txt" 2>"$logs/bench$i.err")
    curl -sf http://127.0.0.1:50753/metrics >"$logs/m$i-after.txt"
    cpu1=$(router_cpu)
    label=grpc
    [[ $api == openai ]] && label=http
    echo "run $i ($api): $(grep -E '^throughput' "$logs/bench$i.txt" | head -1)"
    q=$(quantiles "$logs/m$i-before.txt" "$logs/m$i-after.txt" "$label") || over=$((over + 1))
    echo "    $q"
    echo "    router CPU $(awk -v a="$cpu0" -v b="$cpu1" 'BEGIN { printf "%.2f", b - a }') s"
done
echo "$over of $i runs above the goal (relay p99 <= ${GOAL_MS:-1} ms)"
exit "$over"
