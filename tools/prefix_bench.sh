#!/usr/bin/env bash
# Prefix caching on vs off (docs/PERFORMANCE.md, "Prefix caching"): two `mlaserve serve`
# processes on the bundled model, one with --enable-prefix-caching and one with
# --no-enable-prefix-caching, and `bench serve` against each, in alternating order, for two
# workloads: shared-prefix conversations (8 system prompts, several turns) and random
# prompts (nothing shared). Prints each run's report line and a table of the medians.
#
#   tools/prefix_bench.sh [MLASERVE_BINARY]      # default: target/release/mlaserve
#
# Environment: BACKEND (cpu or cuda; default cpu), MODEL (default the bundled model),
# SERVE_ARGS (extra `serve` flags, e.g. `--load-format dummy`), ROUNDS (default 2), CONC
# (default 8), REQS (default 96), SYS ("MIN..=MAX" system prompt tokens, default
# 384..=640), TURNS (default 4), PROMPT (user tokens per turn, default 32), NEW (default
# 32), VOCAB (ids drawn below it, default 4000), KV_BLOCKS (cuda only, default 2048),
# LOGS (default a temporary directory).
#
# DeepSeek-V3's widths on one GPU, 4 layers (3 dense, 1 MoE) and the MTP layer on random
# fp8 weights, system prompts of 1-2k tokens:
#   bin/mlaserve gen-model --preset deepseek-v3 --fp8 --layers 4 --config-only --out /tmp/v3
#   BACKEND=cuda MODEL=/tmp/v3 SERVE_ARGS="--load-format dummy" SYS=1024..=2048 \
#       tools/prefix_bench.sh bin/mlaserve
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${1:-$repo/target/release/mlaserve}"
backend="${BACKEND:-cpu}"
rounds="${ROUNDS:-2}"
conc="${CONC:-8}"
reqs="${REQS:-96}"
sys="${SYS:-384..=640}"
turns="${TURNS:-4}"
prompt="${PROMPT:-32}"
new="${NEW:-32}"
vocab="${VOCAB:-4000}"
model="${MODEL:-$repo/models/mla-tiny-code}"
logs="${LOGS:-$(mktemp -d)}"
mkdir -p "$logs"
[[ -x "$bin" ]] || { echo "no mlaserve binary at $bin (cargo build --release -p mlaserve)"; exit 1; }

declare -A port flag
port[on]=50558 port[off]=50568
flag[on]=--enable-prefix-caching flag[off]=--no-enable-prefix-caching
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
kv=()
[[ $backend == cuda ]] && kv=(--kv-blocks "${KV_BLOCKS:-2048}")
for m in on off; do
    # shellcheck disable=SC2086
    "$bin" serve --model "$model" --backend "$backend" --listen "127.0.0.1:${port[$m]}" --http-listen off \
        --metrics-listen "127.0.0.1:$((port[$m] + 1))" "${flag[$m]}" "${kv[@]}" ${SERVE_ARGS:-} >"$logs/serve-$m.log" 2>&1 &
    pids+=($!)
done
for m in on off; do
    t0=$SECONDS
    until curl -sf "http://127.0.0.1:$((port[$m] + 1))/metrics" | grep -q '^mlaserve_ready_groups 1'; do
        if ((SECONDS - t0 > 300)); then echo "serve ($m) did not come up:"; tail -20 "$logs/serve-$m.log"; exit 1; fi
        sleep 1
    done
done

declare -A args
args[shared]="--workload shared-prefix --system-prompts 8 --system-prompt-tokens $sys --turns $turns"
args[random]="--workload random"
for r in $(seq 1 "$rounds"); do
    # Odd rounds run the cached server first, even rounds second: drift and warm-up fall
    # on both alike.
    order="on off"
    ((r % 2 == 0)) && order="off on"
    for w in shared random; do
        for m in $order; do
            f="$logs/$w-$m-$r.txt"
            # shellcheck disable=SC2086
            "$bin" bench serve --addr "http://127.0.0.1:${port[$m]}" --concurrency "$conc" --requests "$reqs" \
                --prompt-tokens "$prompt" --max-new-tokens "$new" --vocab "$vocab" ${args[$w]} >"$f" 2>/dev/null
            echo "$w caching $m round $r: $(grep -E 'throughput' "$f" | head -1); $(grep -E 'TTFT' "$f")"
        done
    done
done

median() { sort -g | awk '{a[NR]=$1} END {if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
printf '\n%-8s %-8s %12s %12s %12s %10s\n' workload caching "tokens/s" "TTFT p50 ms" "TTFT p99 ms" cached
for w in shared random; do
    for m in on off; do
        tps=$(cat "$logs/$w-$m-"*.txt | awk '/^throughput/ {print $2}' | median)
        p50=$(cat "$logs/$w-$m-"*.txt | awk '/TTFT/ {print $4}' | median)
        p99=$(cat "$logs/$w-$m-"*.txt | awk '/TTFT/ {print $8}' | median)
        cached=$(cat "$logs/$w-$m-"*.txt | awk '/prefix cache/ {print $4 + 0}' | median)
        printf '%-8s %-8s %12s %12s %12s %9s%%\n' "$w" "$m" "$tps" "$p50" "$p99" "$cached"
    done
done
