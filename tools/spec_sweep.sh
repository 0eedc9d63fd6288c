#!/usr/bin/env bash
# Speculation at every load (docs/PERFORMANCE.md, "Adaptive k"): three `mlaserve
# serve` processes on the bundled model — fixed k = 0, fixed k = 3 and adaptive k (at most
# 3; on the GPU calibrated at start-up by default, `--speculation-calibration-rows`; on
# the GPU every server captures its CUDA graphs at start-up, `--warm-up-graphs`) — and
# `bench serve` at each concurrency against each, interleaved (each round in a
# rotated order, so drift of the machine's speed falls on all three alike); one table of
# the median generated tokens/s, with the k the adaptive server chose (its /metrics).
#
#   tools/spec_sweep.sh [MLASERVE_BINARY]      # default: target/release/mlaserve
#
# Environment: BACKEND (cpu or cuda; default cpu), CONC (default "1 4 16 64 256"), PROMPT
# (prompt tokens, default 64), PROMPTS (a JSONL of prompts for `bench serve --prompts`
# instead of random ids, e.g. the bundled model's eval_prompts.jsonl: acceptance on text
# like the model's own), NEW (new tokens, default 128), REQS (requests per stream and
# run, default 2; at least MIN_REQS a run, default 32), WARMUP (unrecorded runs per server
# and concurrency before its rounds: graph captures, first estimates; default 1; then up
# to WARMUP_MORE more, default 3, while the runs before captured CUDA graphs: a server
# keeps its graphs for life, so the rounds measure it past its captures), ROUNDS (runs per server and
# concurrency, default 3), LOGS (default a temporary directory), TP (default 1), PORT
# (the first of the servers' ports, default 21450; each takes ten from there). The three servers run side by
# side; with BACKEND=cuda they share the GPU, each with KV_BLOCKS blocks (default 2048) of
# cache. With TP > 1 each server is a worker group of TP processes (rank r on GPU r)
# behind a router, as in a deployment, and the servers run one after another (groups
# sharing GPUs would spin their NCCL kernels on the same SMs); SEQUENTIAL=1 runs them one
# after another at TP 1 too (each alone on the GPU, as deployed; no interleaving, so the
# rounds of a server are consecutive); RESTART=1 (with either; the default with
# BACKEND=cuda) gives every round fresh server processes, started in an order rotated per
# round, each warmed up again: a GPU process's speed at the same k can differ from
# another's by a few percent for its life (TP 2 at 64 streams: adaptive / better fixed k
# 0.911 with one group per server, 1.053 with fresh groups), which more rounds on the
# same processes do not average out. RESTART=0 keeps one set of servers for the sweep. SERVE_FLAGS: more flags
# for every server (e.g. --drafts-to-host). ALT_FLAGS: a fourth server, adaptive with
# these flags as well ("alt"), beside the others in the same rounds (an A/B of an
# option of the adaptive policy; FIXED=0 leaves the fixed-k servers out).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${1:-$repo/target/release/mlaserve}"
backend="${BACKEND:-cpu}"
conc="${CONC:-1 4 16 64 256}"
prompt="${PROMPT:-64}"
prompts_arg=()
[[ -n "${PROMPTS:-}" ]] && prompts_arg=(--prompts "$PROMPTS")
new="${NEW:-128}"
reqs="${REQS:-2}"
# At least this many requests a run: at one stream a run of 8 lasted half a second on a
# GPU, and its rounds spread by 10%.
min_reqs="${MIN_REQS:-32}"
rounds="${ROUNDS:-3}"
warmup="${WARMUP:-1}"
warmup_more="${WARMUP_MORE:-3}"
logs="${LOGS:-$(mktemp -d)}"
restart="${RESTART:-$([[ $backend == cuda ]] && echo 1 || echo 0)}"
mkdir -p "$logs"
[[ -x "$bin" ]] || { echo "no mlaserve binary at $bin (cargo build --release -p mlaserve)"; exit 1; }

modes=(k0 k3 adaptive)
# FIXED=0: no fixed-k servers (an A/B of the adaptive server against ALT_FLAGS alone).
[[ ${FIXED:-1} == 0 ]] && modes=(adaptive)
# The servers whose k is chosen per step.
adaptive_modes=(adaptive)
[[ -n "${ALT_FLAGS:-}" ]] && modes+=(alt) && adaptive_modes+=(alt)
declare -A port flags
# Below Linux's ephemeral range (32768-60999), where a client socket of any process may
# hold a port for a while.
base="${PORT:-21450}"
port[k0]=$base port[k3]=$((base + 10)) port[adaptive]=$((base + 20)) port[alt]=$((base + 30))
extra="${SERVE_FLAGS:-}"
flags[k0]="--speculative-tokens 0 --speculation fixed $extra"
flags[k3]="--speculative-tokens 3 --speculation fixed $extra"
flags[adaptive]="--speculative-tokens 3 --speculation adaptive $extra"
flags[alt]="--speculative-tokens 3 --speculation adaptive $extra ${ALT_FLAGS:-}"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT

kv=()
[[ $backend == cuda ]] && kv=(--kv-blocks "${KV_BLOCKS:-2048}")
tp="${TP:-1}"
model="$repo/models/mla-tiny-code"

# Starts server m (its processes' pids in spids[m]).
declare -A spids
start() {
    local m=$1 p=${port[$1]} r lead
    spids[$m]=""
    if ((tp > 1)); then
        # The engine's metrics (the k chosen) are rank 0's, on p + 1 as `serve`'s are.
        for ((r = tp - 1; r >= 0; r--)); do
            lead=()
            ((r == 0)) && lead=(--listen "127.0.0.1:$((p + 2))" --metrics-listen "127.0.0.1:$((p + 1))")
            # shellcheck disable=SC2086
            "$bin" worker --model "$model" --backend "$backend" --world-size "$tp" --rank "$r" \
                --tp-addr "127.0.0.1:$((p + 5))" "${lead[@]}" ${flags[$m]} "${kv[@]}" >"$logs/worker-$m-$r.log" 2>&1 &
            spids[$m]+="$! "
        done
        "$bin" router --model "$model" --worker "http://127.0.0.1:$((p + 2))" --listen "127.0.0.1:$p" \
            --http-listen "127.0.0.1:$((p + 4))" --metrics-listen "127.0.0.1:$((p + 3))" >"$logs/router-$m.log" 2>&1 &
    else
        # shellcheck disable=SC2086
        "$bin" serve --model "$model" --backend "$backend" --listen "127.0.0.1:$p" --http-listen off \
            --metrics-listen "127.0.0.1:$((p + 1))" ${flags[$m]} "${kv[@]}" >"$logs/serve-$m.log" 2>&1 &
    fi
    spids[$m]+="$! "
    pids+=(${spids[$m]})
}
ready() {
    local m=$1 t0=$SECONDS at=$((port[$1] + 1))
    ((tp > 1)) && at=$((port[$1] + 3))
    until curl -sf "http://127.0.0.1:$((port[$m] + 1))/metrics" >/dev/null &&
        curl -s "http://127.0.0.1:$at/metrics" | grep -q "^mlaserve_ready_groups 1"; do
        local gone=0
        for q in ${spids[$m]}; do kill -0 "$q" 2>/dev/null || gone=1; done
        if ((gone || SECONDS - t0 > 300)); then echo "server $m did not come up:"; tail -n 20 "$logs"/*-"$m"*.log; exit 1; fi
        sleep 0.5
    done
}
stop() {
    # shellcheck disable=SC2086
    kill ${spids[$1]} 2>/dev/null
    # shellcheck disable=SC2086
    wait ${spids[$1]} 2>/dev/null
}

# Server MODE's cumulative decisions per k, "k0 k1 k2 k3".
steps_per_k() {
    local v t
    t=$(curl -s "http://127.0.0.1:$((port[$1] + 1))/metrics")
    for k in 0 1 2 3; do
        v=$(grep "^mlaserve_speculation_steps_total{k=\"$k\"}" <<<"$t" | awk '{print $2}')
        printf '%s ' "${v:-0}"
    done
}

# Server MODE's engine counters, "steps schedule forward verify draft" (seconds): its
# rank 0's in a group (the worker's /metrics are served on p + 1 as `serve`'s are).
counters() {
    curl -s "http://127.0.0.1:$((port[$1] + 1))/metrics" | awk '
        /^mlaserve_engine_steps_total / {s = $2}
        /^mlaserve_engine_step_seconds_total/ {
            for (p = 1; p <= 4; p++) if (index($0, "\"" ph[p] "\"")) v[p] = $2 }
        BEGIN {split("schedule forward verify draft", ph, " ")}
        END {printf "%s %s %s %s %s", s + 0, v[1] + 0, v[2] + 0, v[3] + 0, v[4] + 0}'
}
median() { sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }

declare -A tps choice runs before weighed phases wall at graphs caught caught_before
# Server MODE's CUDA graphs captured so far (its rank 0's; 0 without graphs).
graphs_now() {
    curl -s "http://127.0.0.1:$((port[$1] + 1))/metrics" | awk '/^mlaserve_graph_captures_total/ {g = $2} END {print g + 0}'
}
# warm MODE STREAMS: the unrecorded runs; then the captures before the rounds into `caught`.
warm() {
    local m=$1 c=$2 r g now
    # (The metrics are published once a second.)
    g=$(graphs_now "$m")
    for ((r = 0; r < warmup; r++)); do bench "$m" "$c" warm; done
    for ((r = 0; ; r++)); do
        sleep 1.2
        now=$(graphs_now "$m")
        ((now == g || r == warmup_more)) && break
        g=$now
        bench "$m" "$c" warm
    done
    caught[$m,$c]=$now
}
# caught_since MODE STREAMS: the captures during the rounds.
caught_since() {
    caught[$1,$2]=$(($(graphs_now "$1") - caught[$1,$2] + ${caught_before[$1,$2]:-0}))
    caught_before[$1,$2]=${caught[$1,$2]}
}
bench() {  # bench MODE STREAMS ROUND: one `bench serve` run, its tokens/s into runs
    local m=$1 c=$2 r=$3 n=$(($2 * reqs)) log="$logs/bench-$1-$2-$3.log"
    ((n < min_reqs)) && n=$min_reqs
    "$bin" bench serve --addr "http://127.0.0.1:${port[$m]}" --concurrency "$c" --requests "$n" \
        --prompt-tokens "$prompt" "${prompts_arg[@]}" --max-new-tokens "$new" >"$log" 2>&1 ||
        { echo "bench serve ($m, $c streams) failed:"; tail -5 "$log"; exit 1; }
    [[ $r == warm ]] && return
    runs[$m,$c]+="$(awk '/^throughput/ {print $2}' "$log") "
    wall[$m,$c]=$(awk -v w="${wall[$m,$c]:-0}" '/^requests/ {print w + $(NF - 1)}' "$log")
}
# The engine's counters are published once a second: a snapshot waits for that first.
snapshot() {  # snapshot MODE: its counters into `at[MODE]`
    sleep 1.2
    at[$1]=$(counters "$1")
}
phases_of() {  # phases_of MODE STREAMS: steps, run seconds, phase seconds since `at[MODE]`
    local a
    a=${at[$1]}
    snapshot "$1"
    # Added to the earlier processes' (RESTART); the run seconds are cumulative already.
    phases[$1,$2]=$(awk -v a="$a" -v b="${at[$1]}" -v w="${wall[$1,$2]}" -v p="${phases[$1,$2]:-0 0 0 0 0 0}" '
        BEGIN { split(a, x, " "); split(b, y, " "); split(p, q, " ");
        printf "%s %s", q[1] + y[1] - x[1], w; for (i = 2; i <= 5; i++) printf " %s", q[i + 1] + y[i] - x[i] }')
}
decided() {  # decided MODE STREAMS: server MODE's decisions since `before[MODE,STREAMS]`
    local a b c
    read -r -a a <<<"${before[$1,$2]}"
    read -r -a b <<<"$(steps_per_k "$1")"
    # Added to the earlier processes' (RESTART).
    IFS=/ read -r -a c <<<"${choice[$1,$2]:-0/0/0/0}"
    choice[$1,$2]="$((c[0] + b[0] - a[0]))/$((c[1] + b[1] - a[1]))/$((c[2] + b[2] - a[2]))/$((c[3] + b[3] - a[3]))"
    # What the adaptive server's choices weighed by then: cycle µs per decode row per
    # (rows, k), the rates; and where its choices fell (decisions per (rows, k), over the
    # process's life).
    [[ $1 == adaptive ]] && weighed[$2]=$(curl -s "http://127.0.0.1:$((port[adaptive] + 1))/metrics" |
        grep -E '^mlaserve_speculation_(cycle_us_per_row|acceptance_rate|steps_by_rows_total)' |
        sed 's/^mlaserve_speculation_/  /' | sort -V)
}
# One server process's share of the sweep: every concurrency, ROUNDS rounds (or the
# single round R with RESTART).
serve_rounds() {
    local m=$1 first=$2 last=$3 c r
    start "$m"
    ready "$m"
    for c in $conc; do
        warm "$m" "$c"
        [[ $m == adaptive || $m == alt ]] && before[$m,$c]=$(steps_per_k "$m")
        snapshot "$m"
        for ((r = first; r < last; r++)); do bench "$m" "$c" "$r"; done
        phases_of "$m" "$c"
        caught_since "$m" "$c"
        [[ $m == adaptive || $m == alt ]] && decided "$m" "$c"
    done
    graphs[$m]=$(($(graphs_now "$m") + ${graphs[$m]:-0}))
    stop "$m"
}
if [[ $restart == 1 ]]; then
    # Fresh processes every round, one server at a time, in an order rotated per round.
    nm=${#modes[@]}
    for ((r = 0; r < rounds; r++)); do
        for ((i = 0; i < nm; i++)); do serve_rounds "${modes[$(((i + r) % nm))]}" "$r" $((r + 1)); done
    done
elif ((tp > 1)) || [[ ${SEQUENTIAL:-0} == 1 ]]; then
    # Groups of several GPUs cannot share them side by side (their NCCL kernels spin on
    # the same SMs): one server at a time, every concurrency and round on it.
    for m in "${modes[@]}"; do serve_rounds "$m" 0 "$rounds"; done
else
    for m in "${modes[@]}"; do start "$m"; done
    for m in "${modes[@]}"; do ready "$m"; done
    for c in $conc; do
        for m in "${modes[@]}"; do warm "$m" "$c"; done
        for m in "${adaptive_modes[@]}"; do before[$m,$c]=$(steps_per_k "$m"); done
        for m in "${modes[@]}"; do at[$m]=$(counters "$m"); done
        nm=${#modes[@]}
        for ((r = 0; r < rounds; r++)); do
            for ((i = 0; i < nm; i++)); do bench "${modes[$(((i + r) % nm))]}" "$c" "$r"; done
        done
        sleep 1.2
        for m in "${modes[@]}"; do
            phases_of "$m" "$c"
            caught_since "$m" "$c"
        done
        for m in "${adaptive_modes[@]}"; do decided "$m" "$c"; done
    done
    for m in "${modes[@]}"; do graphs[$m]=$(graphs_now "$m"); done
fi
for c in $conc; do
    for m in "${modes[@]}"; do
        tps[$m,$c]=$(tr ' ' '\n' <<<"${runs[$m,$c]}" | grep . | median)
        # The rounds' spread: the fastest over the slowest (a ratio between servers
        # says little where it is far above 1).
        spread=$(tr ' ' '\n' <<<"${runs[$m,$c]}" | grep . | sort -g | awk 'NR == 1 {lo = $1} {hi = $1} END {printf "%.2f", hi / lo}')
        echo "$m, $c streams: ${runs[$m,$c]}-> ${tps[$m,$c]} tokens/s (fastest / slowest round: $spread;" \
            "CUDA graphs captured in the rounds: ${caught[$m,$c]:-?})"
    done
done

echo
prompts="$prompt-token prompts"
[[ -n "${PROMPTS:-}" ]] && prompts="prompts of $PROMPTS"
how="interleaved runs"
((tp > 1)) || [[ ${SEQUENTIAL:-0} == 1 ]] && how="runs, one server at a time"
[[ $restart == 1 ]] && how="runs, one server at a time, each round on fresh processes"
echo "backend $backend, TP $tp, $prompts, $new new tokens, median of $rounds $how;"
echo "generated tokens/s (logs: $logs)"
echo "| streams | k = 0 | k = 3 | adaptive | adaptive / better fixed | adaptive / k = 0 | decisions at k = 0/1/2/3 |"
echo "| ---: | ---: | ---: | ---: | ---: | ---: | :--- |"
for c in $conc; do
    awk -v c="$c" -v z="${tps[k0,$c]:-0}" -v t="${tps[k3,$c]:-0}" -v a="${tps[adaptive,$c]}" -v ch="${choice[adaptive,$c]}" \
        'function r(x, y) { return (y > 0) ? sprintf("%.3f", x / y) : "-" }
        BEGIN { b = (z > t) ? z : t; printf "| %d | %.1f | %.1f | %.1f | %s | %s | %s |\n", c, z, t, a, r(a, b), r(a, z), ch }'
done
if [[ -n "${ALT_FLAGS:-}" ]]; then
    echo
    echo "alt: adaptive with $ALT_FLAGS, the same rounds"
    echo "| streams | alt | alt / better fixed | alt / adaptive | decisions at k = 0/1/2/3 |"
    echo "| ---: | ---: | ---: | ---: | :--- |"
    for c in $conc; do
        awk -v c="$c" -v z="${tps[k0,$c]:-0}" -v t="${tps[k3,$c]:-0}" -v a="${tps[adaptive,$c]}" -v x="${tps[alt,$c]}" \
            -v ch="${choice[alt,$c]}" 'function r(x, y) { return (y > 0) ? sprintf("%.3f", x / y) : "-" }
            BEGIN { b = (z > t) ? z : t; printf "| %d | %.1f | %s | %s | %s |\n", c, x, r(x, b), r(x, a), ch }'
    done
fi
echo
echo "engine steps per run second, and ms per step: the step's phases (schedule, forward,"
echo "verify, draft) and the rest of the run's wall time (the server outside steps, idle)"
echo "| streams | server | steps/s | schedule | forward | verify | draft | outside |"
echo "| ---: | :--- | ---: | ---: | ---: | ---: | ---: | ---: |"
for c in $conc; do
    for m in "${modes[@]}"; do
        awk -v c="$c" -v m="$m" -v p="${phases[$m,$c]}" 'BEGIN { split(p, v, " "); n = (v[1] > 0) ? v[1] : 1;
            printf "| %d | %s | %.0f | %.3f | %.3f | %.3f | %.3f | %.3f |\n", c, m, v[1] / v[2], 1e3 * v[3] / n,
                1e3 * v[4] / n, 1e3 * v[5] / n, 1e3 * v[6] / n, 1e3 * (v[2] - v[3] - v[4] - v[5] - v[6]) / n }'
    done
done
echo
printf 'CUDA graphs captured by the end:'
for m in "${modes[@]}"; do printf ' %s %s' "$m" "${graphs[$m]:-?}"; done
echo
for c in $conc; do
    echo "the adaptive server's estimates after $c streams (per (rows bucket, k): cycle us per decode row; decisions per (rows bucket, k)):"
    echo "${weighed[$c]}"
done
