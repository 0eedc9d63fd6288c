#!/usr/bin/env bash
# One device call's worth of GPU checking, over binaries built on the CPU machine.
#
# Build and stage them here first (docs/cuda.md):   tools/gpu/stage.sh
# then, on the GPU machine, from the repo root:    tools/gpu/check.sh [--quick]
# (through the device tool: carry [".gpu"], command `tools/gpu/check.sh`).
#
# `--backend`: each test function in its own process (the CudaBackend, engine and kernel
# tests), memcheck on the backend tests, the measured numbers; no benchmark.
# MLASERVE_CHECK_BUDGET_S (default 270) caps the whole run; MLASERVE_CHECK_ONLY (a regex
# over step names) runs a subset.
#
# `--decode`: the decode-kernel loop: checks of each kernel in MLASERVE_KERNELS (default
# "wgmma-ss wgmma-t") against the f64 reference, each in its own process under a
# timeout (a barrier deadlock hangs rather than traps), memcheck on the new kernels' checks,
# then one `bench mla-decode --kernel` sweep comparing them (MLASERVE_BENCH_ARGS adds
# flags, e.g. "--heads 16,128").
#
# `--tp N`: tensor parallelism on N GPUs (N = 2, 4 or 8; run on a kind with N GPUs): the
# CUDA backend's TP tests (logits vs CPU, ranks bit-identical, engine k=3 == k=0 in bf16
# and fp8, prefix-cache hits, the sampling surface, graphs == eager on TP ranks, drafts
# kept on the ranks, a stalled rank, the one-shot collectives over peer memory between
# threads and between processes), mlaserve-tp's process group over real NCCL (TP = 1 .. N
# equal, a killed rank), the CLI's worker group on the CUDA backend (idle past its
# collective timeout, then a rank killed), `bench step` at TP 1 .. N, `bench all-reduce`, and
# `bench mla-decode`.
#
# Runs every GPU test binary in .gpu/tests/ (mlaserve-cuda's and mlaserve-cuda-lab's),
# compute-sanitizer memcheck on the kernel tests, a SASS summary of the embedded kernels,
# and the checks + decode benchmark of .gpu/bin/mlaserve-cuda-check (mlaserve-cuda-lab).
# `--backend` also runs the GPU benchmarks of .gpu/benches/ (benches/, feature cuda). Logs go to $OUT (default ./gpu-out): at most 8 files,
# since the device tool returns no more. Prints a short table last. Exit status: the
# number of failed steps (0 = all passed).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
gpu_dir="${GPU_DIR:-$repo/.gpu}"
if [[ -n "${GPU_PACK:-}" ]]; then   # tools/gpu/stage.sh --pack DIR
    gpu_dir=/tmp/mlaserve-gpu
    mkdir -p "$gpu_dir" && tar -C "$gpu_dir" -xJf "$GPU_PACK" || exit 1
fi
out="${OUT:-$repo/gpu-out}"
mkdir -p "$out"
quick=""
mode=full
case "${1:-}" in
    --quick) quick="--quick" ;;
    --backend) mode=backend ;;   # per-test processes + targeted memcheck, no benchmark
    --tp) mode=tp; tp_n="${2:?--tp needs the number of GPUs}" ;;
    --decode) mode=decode ;;
    --fp8) mode=fp8 ;;   # fp8 GEMM checks, memcheck, and the side-by-side benchmark
esac
# Every step's time limit is cut to what is left of this budget (a device call has one).
deadline=$((SECONDS + ${MLASERVE_CHECK_BUDGET_S:-270}))

export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0            # never NVLink multicast on the shared machines
export MLASERVE_REQUIRE_GPU=1        # GPU tests fail instead of skipping
export MLASERVE_REQUIRE_GROUPED=1    # the grouped fp8 experts too (these machines are Hopper)
export RUST_BACKTRACE=1

summary=()
failures=0
step() {  # step NAME LOG CMD...: runs CMD appending to LOG, records rc and seconds
    local name="$1" log="$2"; shift 2
    local t0=$SECONDS left=$((deadline - SECONDS))
    # MLASERVE_CHECK_ONLY (an extended regex) runs only the steps whose name matches.
    if [[ -n "${MLASERVE_CHECK_ONLY:-}" ]] && ! [[ "$name" =~ $MLASERVE_CHECK_ONLY ]]; then
        summary+=("$(printf '%-34s %-6s' "$name" "not selected")")
        return 0
    fi
    if ((left < 5)); then
        summary+=("$(printf '%-34s %-6s' "$name" "SKIP (budget)")")
        failures=$((failures + 1))
        return 0
    fi
    # `timeout N` as the first word is capped at the budget left.
    if [[ "$1" == timeout ]] && (($2 > left)); then set -- timeout "$left" "${@:3}"; fi
    echo "=== $name: $*" >>"$log"
    "$@" >>"$log" 2>&1
    local rc=$?
    summary+=("$(printf '%-34s %-6s %4ss  %s' "$name" "$([[ $rc == 0 ]] && echo ok || echo FAIL:$rc)" $((SECONDS - t0)) "$(basename "$log")")")
    [[ $rc == 0 ]] || failures=$((failures + 1))
    return 0
}

# 1. The machine as found (clocks, driver) — never changed.
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv
    nvidia-smi -q | grep -iE "persistence|compute mode|mig mode" | head
    ls -la "$gpu_dir" "$gpu_dir"/* 2>&1
} >"$out/machine.txt" 2>&1

# Decode-kernel mode (see the header).
# fp8 mode: the fp8 GEMM tests against the f64 reference, memcheck on the small ones, then
# this project's kernels and torch's block-scaled / per-tensor fp8 and bf16 at V3's
# shapes in the same call (`mlaserve-cuda-check --fp8`, tools/gpu/fp8_gemm_baseline.py).
if [[ "$mode" == fp8 ]]; then
    sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
    step "gpu_fp8" "$out/tests.log" timeout 200 "$gpu_dir/tests/gpu_fp8" --test-threads=1 --nocapture
    for name in act_quant_is_bit_exact padded_inputs_quantise_as_the_unpadded_row fp8_gemm_odd_shapes \
        fp8_stream_cluster_split_equals_global \
        fp8_rejects_bad_shapes fp8_grouped_small \
        fp8_grouped_rejects_bad_shapes; do
        step "memcheck gpu_fp8::$name" "$out/memcheck.log" timeout 90 "$sanitizer" --tool memcheck \
            --error-exitcode 1 --leak-check no "$gpu_dir/tests/gpu_fp8" --exact "$name" --test-threads=1
    done
    step "bench fp8" "$out/bench-fp8.log" timeout 200 "$gpu_dir/bin/mlaserve-cuda-check" --fp8 --no-check $quick
    step "torch fp8 baseline" "$out/bench-fp8.log" timeout 200 python3 "$repo/tools/gpu/fp8_gemm_baseline.py" $quick
    { echo "==== summary"; printf '%s\n' "${summary[@]}"; } | tee "$out/summary.txt"
    exit "$failures"
fi

if [[ "$mode" == decode ]]; then
    kernels="${MLASERVE_KERNELS:-wgmma-ss wgmma-t}"
    sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
    for k in $kernels; do
        step "check $k" "$out/check.log" timeout 120 "$gpu_dir/bin/mlaserve-cuda-check" --kernel "$k" --no-bench
    done
    for k in $kernels; do
        [[ "$k" == mma.sync ]] && continue
        step "memcheck check $k" "$out/memcheck.log" timeout 180 "$sanitizer" --tool memcheck --error-exitcode 1 \
            --leak-check no "$gpu_dir/bin/mlaserve-cuda-check" --kernel "$k" --no-bench
    done
    step "bench mla-decode" "$out/bench-mla.log" timeout 300 "$gpu_dir/bin/mlaserve" bench mla-decode \
        --kernel "$(tr ' ' ',' <<<"$kernels")" ${MLASERVE_BENCH_ARGS:-}
    {
        echo
        echo "==== summary ($(date -u +%H:%M:%S), logs in $out)"
        printf '%s\n' "${summary[@]}"
        grep -E "checks:|FAIL|rel_err|Error|error" "$out/check.log" | head -40
        grep -E "ERROR SUMMARY" "$out/memcheck.log" 2>/dev/null | head
        grep -vE "^===" "$out/bench-mla.log" | head -160
    } | tee "$out/summary.txt"
    exit "$failures"
fi

# TP mode (see the header).
if [[ "$mode" == tp ]]; then
    export MLASERVE_REQUIRE_GPUS="$tp_n"
    worlds="2"; ((tp_n >= 4)) && worlds="2,4"; ((tp_n >= 8)) && worlds="2,4,8"
    for spec in gpu_backend:tiny_v3_tp2_tp4_tp8_match_cpu gpu_prefill:tiny_v3_expanded_prefill_tp2_matches_cpu \
        gpu_sample:tiny_v3_backend_samples_match_core_rule \
        gpu_engine:tp_groups_greedy_k3_equals_k0_cuda_core_batch_invariant \
        gpu_engine:a_stalled_rank_fails_the_step_within_the_timeout \
        gpu_engine:fp8_greedy_k3_equals_k0_batch_invariant_tp1_tp2 gpu_prefix:cache_hits_keep_every_output_tp2 \
        gpu_sampling_surface:engine_k3_equals_k0_with_the_whole_surface_one_gpu_and_tp2 \
        gpu_graphs:tp2_decode_steps_through_graphs_equal_eager \
        gpu_engine:tp2_kept_drafts_equal_drafts_read_back_per_stage \
        gpu_comm:peer_all_reduce_equals_the_rank_order_sum_threads \
        gpu_comm:peer_all_reduce_equals_the_rank_order_sum_processes \
        gpu_comm:a_stalled_peer_fails_the_flag_kernel_within_the_timeout \
        gpu_comm:a_stalled_peer_fails_the_lines_kernel_within_the_timeout; do
        step "${spec/:/::}" "$out/tests.log" timeout 240 "$gpu_dir/tests/${spec%%:*}" --exact "${spec#*:}" \
            --nocapture --test-threads=1
    done
    # Processes over real NCCL (CPU compute: exact equality with TP = 1), tiny-v3 and the
    # bundled model, then a killed rank.
    step "tp_group processes (TP $worlds)" "$out/tp-group.log" env MLASERVE_TP_WORLDS="$worlds" timeout 300 \
        "$gpu_dir/tests/tp_group" nccl:: --test-threads=1 --nocapture
    # The CLI: a worker group of N ranks on the CUDA backend, a router, a generation, then
    # the last rank killed; the leader must turn the group failed within 30 s.
    alive() { [[ -e /proc/$1 ]] && ! grep -qE '^[0-9]+ \(.*\) Z' "/proc/$1/stat" 2>/dev/null; }
    cli_group() {
        # Rank logs go to a scratch folder and into cli.log at the end ($OUT returns at most
        # 8 files).
        local m="$repo/models/mla-tiny-code" port=29611 pids=() r logs
        logs="$(mktemp -d)"
        for ((r = tp_n - 1; r >= 1; r--)); do
            "$gpu_dir/bin/mlaserve" worker --model "$m" --backend cuda --world-size "$tp_n" --rank "$r" \
                --tp-addr 127.0.0.1:$port --collective-timeout-s 10 >"$logs/rank$r.log" 2>&1 &
            pids[r]=$!
        done
        "$gpu_dir/bin/mlaserve" worker --model "$m" --backend cuda --world-size "$tp_n" --rank 0 \
            --tp-addr 127.0.0.1:$port --collective-timeout-s 10 --listen 127.0.0.1:50161 >"$logs/rank0.log" 2>&1 &
        pids[0]=$!
        for _ in $(seq 120); do grep -q "listening" "$logs/rank0.log" && break; sleep 0.5; done
        "$gpu_dir/bin/mlaserve" router --model "$m" --worker http://127.0.0.1:50161 --listen 127.0.0.1:50151 \
            >"$logs/router.log" 2>&1 &
        local router=$!
        # A failed step must not leave ranks holding the GPUs for the steps after it.
        stop_group() {
            kill "$router" "${pids[@]}" 2>/dev/null
            wait 2>/dev/null
            tail -n 15 "$logs"/*.log
        }
        sleep 2
        timeout 60 "$gpu_dir/bin/mlaserve" generate --addr http://127.0.0.1:50151 --prompt "def fibonacci(n):" \
            --max-new-tokens 48 || { stop_group; return 1; }
        # Idle past the collective timeout: the leader's keep-alive plans hold the group.
        sleep 12
        timeout 60 "$gpu_dir/bin/mlaserve" generate --addr http://127.0.0.1:50151 --prompt "def fibonacci(n):" \
            --max-new-tokens 48 || { echo "TP=$tp_n CLI: the group did not outlive 12 s idle"; stop_group; return 1; }
        echo "TP=$tp_n CLI: served again after 12 s idle (collective timeout 10 s)"
        # A long generation streams; the last rank is killed under it: the client's stream
        # must end with UNAVAILABLE (the group failed), not INTERNAL.
        local victim=$((tp_n - 1)) t0 gen="$logs/generate-killed.log"
        timeout 90 "$gpu_dir/bin/mlaserve" generate --addr http://127.0.0.1:50151 --prompt "def main():" \
            --max-new-tokens 1000 --ignore-eos >"$gen" 2>&1 &
        local gen_pid=$!
        for _ in $(seq 100); do [[ $(wc -c <"$gen") -gt 40 ]] && break; sleep 0.1; done
        kill -9 "${pids[victim]}"
        t0=$(date +%s.%N)
        wait "$gen_pid"
        echo "TP=$tp_n CLI: the stream cut by the kill ended with: $(tail -n 2 "$gen" | tr '\n' ' ')"
        local unavailable=0
        grep -q "Unavailable" "$gen" && unavailable=1
        for _ in $(seq 600); do grep -q "group failed" "$logs/rank0.log" && break; sleep 0.1; done
        echo "TP=$tp_n CLI: leader reported the group failed $(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $t0 }") s after rank $victim was killed"
        grep -h "group failed\|aborted" "$logs/rank0.log" | head -3
        # The surviving followers must exit with an error within 30 s of the kill.
        local ok=1
        for ((r = 1; r < tp_n; r++)); do
            ((r == victim)) && continue
            while alive "${pids[r]}" && [[ $(awk "BEGIN { print ($(date +%s.%N) - $t0 < 30) }") == 1 ]]; do
                sleep 0.2
            done
            if alive "${pids[r]}"; then
                echo "TP=$tp_n CLI: rank $r still running 30 s after the kill"
                ok=0
            else
                echo "TP=$tp_n CLI: rank $r exited by $(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $t0 }") s: $(grep -h -m1 "collective:" "$logs/rank$r.log" | sed 's/^ *//')"
            fi
        done
        # The leader of the failed group still serves (NOT_SERVING) until it is told to
        # stop; a SIGTERM must end it cleanly, not with a signal (a crash while its
        # backend and the aborted communicator are torn down).
        local leader_rc
        kill -TERM "${pids[0]}"
        for _ in $(seq 300); do alive "${pids[0]}" || break; sleep 0.1; done
        alive "${pids[0]}" && { echo "TP=$tp_n CLI: the leader still runs 30 s after SIGTERM"; kill -9 "${pids[0]}"; }
        wait "${pids[0]}"
        leader_rc=$?
        echo "TP=$tp_n CLI: the failed group's leader exited with status $leader_rc after SIGTERM"
        ((leader_rc < 128)) || ok=0
        stop_group
        grep -q "group failed" "$logs/rank0.log" && ((ok)) && ((unavailable))
    }
    step "CLI worker group TP $tp_n (cuda) + kill" "$out/cli.log" cli_group
    for ((n = 1; n <= tp_n; n *= 2)); do
        step "bench step --tp $n" "$out/bench-step.log" timeout 240 "$gpu_dir/bin/mlaserve" bench step --tp "$n"
    done
    step "bench step --tp $tp_n --eager" "$out/bench-step.log" timeout 240 "$gpu_dir/bin/mlaserve" bench step \
        --tp "$tp_n" --eager
    step "bench step --tp $tp_n --threads" "$out/bench-step.log" timeout 240 "$gpu_dir/bin/mlaserve" bench step \
        --tp "$tp_n" --threads
    step "bench all-reduce --tp $tp_n" "$out/bench-step.log" timeout 120 "$gpu_dir/bin/mlaserve" bench all-reduce \
        --tp "$tp_n"
    step "bench mla-decode" "$out/bench-mla.log" timeout 150 "$gpu_dir/bin/mlaserve" bench mla-decode
    {
        echo
        echo "==== summary ($(date -u +%H:%M:%S), logs in $out)"
        printf '%s\n' "${summary[@]}"
        echo "---- measured"
        grep -hE " rel |differ|tokens in|failed .* after|exited by|still running|panicked|idle" "$out/tests.log" "$out/tp-group.log" "$out/cli.log" | head -60
        grep -hE "^bench step|^ceiling|^ +[0-9]+ +[0-9] |^\(" "$out/bench-step.log"
        grep -hA12 "^all-reduce in" "$out/bench-step.log"
        grep -hE "ceiling|heads" "$out/bench-mla.log" | head -40
    } | tee "$out/summary.txt"
    exit "$failures"
fi

# Backend mode: every test function of every binary in its own process (a fault or a
# hang in one cannot hide the others), then memcheck on the tests that touch every
# backend kernel, then the summary with the measured numbers.
if [[ "$mode" == backend ]]; then
    for bin in gpu_backend gpu_engine gpu_graphs gpu_ops gpu_kv_fp8 gpu_router gpu_kernels gpu_prefill gpu_sample gpu_fp8 \
        routing_margins mlaserve_cuda mlaserve_cuda_lab; do
        t="$gpu_dir/tests/$bin"
        [[ -x "$t" ]] || continue
        for name in $("$t" --list --format terse 2>/dev/null | sed -n 's/: test$//p'); do
            step "$bin::$name" "$out/tests.log" timeout 150 "$t" --exact "$name" --nocapture --test-threads=1
        done
    done
    sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
    for spec in gpu_backend:tiny_v3_matches_cpu_default_options gpu_backend:tiny_v3_matches_cpu_cuda_core_batch_invariant \
        gpu_ops:small_backend_ops_match_reference gpu_prefill:kernel_matches_reference_small_dims \
        gpu_prefill:expanded_path_from_paged_cache_matches_reference gpu_ops:grouped_experts_tensor_core_match_reference \
        gpu_sample:sample_kernel_matches_core_rule gpu_graphs:decode_steps_through_graphs_equal_eager \
        gpu_router:router_logits_small_shapes_match_reference \
        gpu_ops:gemm_matches_reference_and_invariant_mode_is_batch_invariant \
        gpu_fp8:act_quant_is_bit_exact gpu_fp8:fp8_gemm_odd_shapes \
        gpu_backend:fp8_weights_widen_on_the_device_bit_for_bit gpu_kv_fp8:kv_write_fp8_matches_cpu_rounding \
        gpu_kernels:mla_decode_fp8_cache_matches_reference gpu_kernels:copy_ids_moves_ids_by_pairs; do
        t="$gpu_dir/tests/${spec%%:*}"
        step "memcheck ${spec/:/::}" "$out/memcheck.log" timeout 90 "$sanitizer" --tool memcheck \
            --error-exitcode 1 --leak-check no "$t" --exact "${spec#*:}" --test-threads=1
    done
    # One decode step at DeepSeek-V3's dimensions (random weights, 2 MoE layers + MTP),
    # decode steps as CUDA graphs (the default), launched eagerly, and with the
    # batch-invariant options (CudaOptions::batch_invariant).
    step "bench-step" "$out/bench-step.log" timeout 200 "$gpu_dir/bin/mlaserve-cuda-check" --bench-step
    step "bench step --eager" "$out/bench-step.log" timeout 200 "$gpu_dir/bin/mlaserve" bench step --eager
    step "bench step --batch-invariant" "$out/bench-step.log" timeout 200 "$gpu_dir/bin/mlaserve" bench step \
        --batch-invariant
    # The engine on the GPU (k = 3 vs k = 0 with the default options, the bundled model's
    # decode speed) and the router's timing (benches/, run from the repository root).
    step "bench gpu_engine" "$out/bench-step.log" timeout 150 "$gpu_dir/benches/gpu_engine"
    step "bench gpu_kernels router" "$out/bench-step.log" timeout 60 "$gpu_dir/benches/gpu_kernels" router
    {
        echo
        echo "==== summary ($(date -u +%H:%M:%S), logs in $out)"
        printf '%s\n' "${summary[@]}"
        echo "---- bench step (from bench-step.log: graphs, eager, batch-invariant)"
        grep -vE "^===" "$out/bench-step.log" | grep -E "^ +[0-9]+ +[0-9]+ |graph|eager|^bench|ceiling|^prefill" | head -48
        echo "---- measured (from tests.log)"
        grep -E " rel |differ|tokens in|tokens/s|speed-up|alone ==|ids (exact|DIFFER)|panicked" "$out/tests.log" | head -90
        echo "---- benches (from bench-step.log)"
        grep -E "differ in|tokens/s|speed-up|^router (timing|m=.*warp kernel)" "$out/bench-step.log" | head -12
        grep -E "ERROR SUMMARY" "$out/memcheck.log" 2>/dev/null | head -10
    } | tee "$out/summary.txt"
    exit "$failures"
fi

# 2. Test binaries (unit + GPU kernel tests). Every step has a time limit: a kernel that
# hangs must not take the rest of the device call with it.
for t in "$gpu_dir"/tests/*; do
    [[ -x "$t" ]] || continue
    step "test $(basename "$t")" "$out/tests.log" timeout 120 "$t" --test-threads=1 --nocapture
done

# 3. memcheck on the kernel tests.
sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
for t in "$gpu_dir"/tests/gpu_kernels*; do
    [[ -x "$t" ]] || continue
    step "memcheck $(basename "$t")" "$out/memcheck.log" \
        timeout 180 "$sanitizer" --tool memcheck --error-exitcode 1 --leak-check no "$t" --test-threads=1
done

# 4. What the compiler made of the kernels (registers, spills, tensor-core instructions).
if [[ -d "$gpu_dir/kernels" ]] && command -v cuobjdump >/dev/null; then
    {
        for f in "$gpu_dir"/kernels/*.fatbin; do
            echo "== $f"
            cuobjdump --list-elf "$f"
            cuobjdump --dump-resource-usage "$f" 2>&1 | grep -E "Function|REG|STACK|LOCAL" | head -40
            sass="$(cuobjdump --dump-sass --gpu-architecture sm_90a "$f" 2>/dev/null)"
            for ins in HMMA HGMMA LDSM LDGSTS LDL STL BAR; do
                printf '  sm_90a %-7s %6d\n' "$ins" "$(grep -c "$ins" <<<"$sass")"
            done
        done
    } >"$out/sass.txt" 2>&1
fi

# 5. Checks and the decode benchmark beside the measured ceilings, one process per
# tensor-core kernel (a trapped kernel poisons its CUDA context, not the others' runs).
for k in ${MLASERVE_KERNELS:-mma.sync wgmma-ss wgmma-t auto}; do
    step "check+bench $k $quick" "$out/check-bench.log" timeout 150 "$gpu_dir/bin/mlaserve-cuda-check" --kernel "$k" $quick
done

{
    echo
    echo "==== summary ($(date -u +%H:%M:%S), logs in $out)"
    printf '%s\n' "${summary[@]}"
    echo "---- bench (from check-bench.log)"
    grep -m1 "ceilings" "$out/check-bench.log"
    grep -m1 -E "^ +kernel +batch" "$out/check-bench.log"
    # The production selection only (each kernel's full table is in check-bench.log).
    grep -E "^ *auto +[0-9]" "$out/check-bench.log" | head -60
    grep -E "ceilings|checks:|FAIL|Error|error" "$out/check-bench.log" | head -20
    grep -E "ERROR SUMMARY|test result" "$out/memcheck.log" "$out/tests.log" 2>/dev/null | head -20
} | tee "$out/summary.txt"
exit "$failures"
