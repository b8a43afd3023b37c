#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Runs weft's GPU test tiers and benchmarks on a GPU machine, writes one log per step into LOGDIR and
# prints a summary table last.
#
#   tools/gpu_run.sh LOGDIR [BINDIR] [--no-bench] [--bench-only]
#
# Each step is bounded by WEFT_GPU_RUN_STEP_TIMEOUT seconds (default 300), except the gpu test step: there
# each test case (its own process) and the listing of the cases are bounded by WEFT_GPU_RUN_TEST_TIMEOUT
# (default 180). With several GPUs the cases run on one stream per GPU, the GPUs being CUDA_VISIBLE_DEVICES's
# entries when it is set (WEFT_GPU_RUN_STREAMS overrides the count); WEFT_GPU_TEST_FILTER selects cases, and
# a filter that selects none fails the step. With weft-compile in BINDIR and WEFT_CACHE_DIR set, the cache is
# first warmed with weft's own kernels, WEFT_GPU_RUN_WARM_JOBS (default: the CPU count, at most 256) compiles
# at a time. The exit status is 1 when a step failed.
# BINDIR holds the built binaries (default build/release, searched recursively): weft_gpu_tests,
# weft_dist_tests, weftrun and the weft_bench_* benchmarks. Where the Python package and torch import, its GPU tests
# (python/tests/gpu) run too: run the script from the repository root. Binaries built on a CPU machine run here
# (static cudart); WEFT_CACHE_DIR may point at a JIT cache warmed ahead of time with weft-compile.
set -uo pipefail
logdir=${1:?usage: tools/gpu_run.sh LOGDIR [BINDIR] [--no-bench] [--bench-only]}
bindir=${2:-build/release}
run_tests=1
run_bench=1
for arg in "${@:3}"; do
    case "$arg" in
        --no-bench) run_bench=0 ;;
        --bench-only) run_tests=0 ;;
        *) echo "gpu_run: unknown option $arg" >&2; exit 2 ;;
    esac
done
mkdir -p "$logdir"
export CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-EAGER}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1

find_bin() { find "$bindir" -type f -name "$1" -perm -u+x 2>/dev/null | head -n 1; }
summary=()
any_failed=0
list_cases() {  # list_cases BINARY FILTER: prints Suite.case, one a line; fails when the binary fails or hangs
    timeout --kill-after=10 "${WEFT_GPU_RUN_TEST_TIMEOUT:-180}" "$1" --gtest_list_tests --gtest_filter="$2" |
        awk '/^[^ ]/{s=$1} /^  /{print s $1}'
}
run_each() {  # run_each BINARY FILTER: every test case in its own process; prints a gtest-like summary
    # With several GPUs visible the cases are dealt round-robin to one stream per GPU (CUDA_VISIBLE_DEVICES=it):
    # a case's ranks share that GPU, and two processes never time-share one GPU (spurious timeouts).
    local bin=$1 filter=$2 passed=0 failed=0 t rc g
    local failed_names=()
    # The GPUs to deal the streams onto: the entries of the user's CUDA_VISIBLE_DEVICES when it is set, else
    # every physical GPU (nvidia-smi -L ignores CUDA_VISIBLE_DEVICES and lists MIG instances on lines of their own).
    local gpus=()
    if [ -n "${CUDA_VISIBLE_DEVICES+set}" ] && [ -z "${CUDA_VISIBLE_DEVICES// /}" ]; then
        echo "== no tests run: CUDA_VISIBLE_DEVICES is set but empty (no GPU is visible)"
        return 1
    fi
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
        IFS=, read -ra gpus <<<"${CUDA_VISIBLE_DEVICES// /}"
    else
        mapfile -t gpus < <(nvidia-smi -L 2>/dev/null | awk '/^GPU /{print n++}')
    fi
    local streams=${WEFT_GPU_RUN_STREAMS:-${#gpus[@]}}
    [ "$streams" -ge 1 ] 2>/dev/null || streams=1
    [ ${#gpus[@]} -ge 1 ] || mapfile -t gpus < <(seq 0 $((streams - 1)))
    # The per-stream logs live in LOGDIR until the step ends, so a run cut short still leaves them.
    local work
    work=$(mktemp -d "$logdir/run_each.XXXXXX")
    # An empty list is a failure, not a pass: the binary did not start, or the filter selects nothing.
    list_cases "$bin" "$filter" >"$work/cases"
    rc=$?
    if [ "$rc" != 0 ]; then
        echo "== no tests run: '$bin --gtest_list_tests' failed with exit status $rc"
        rm -rf "$work"
        return 1
    fi
    # DISABLED_ cases (known failures kept visible in the source) are listed apart, never counted as passed.
    mapfile -t cases < <(grep -v 'DISABLED_' "$work/cases")
    local disabled
    disabled=$(grep -c 'DISABLED_' "$work/cases")
    if [ ${#cases[@]} = 0 ]; then
        echo "== no tests run: the filter '$filter' selects no enabled test case ($disabled disabled)"
        rm -rf "$work"
        return 1
    fi
    for ((g = 0; g < streams; ++g)); do
        (
            gpu=${gpus[g % ${#gpus[@]}]}
            for ((i = g; i < ${#cases[@]}; i += streams)); do
                t=${cases[i]}
                if [ "$streams" -gt 1 ]; then
                    CUDA_VISIBLE_DEVICES=$gpu timeout --kill-after=10 "${WEFT_GPU_RUN_TEST_TIMEOUT:-180}" "$bin" \
                        --gtest_color=no --gtest_filter="$t" >>"$work/$g.log" 2>&1
                else
                    timeout --kill-after=10 "${WEFT_GPU_RUN_TEST_TIMEOUT:-180}" "$bin" --gtest_color=no \
                        --gtest_filter="$t" >>"$work/$g.log" 2>&1
                fi
                echo "$t $?" >>"$work/$g.rc"
            done
        ) &
    done
    wait
    cat "$work"/*.log 2>/dev/null
    while read -r t rc; do
        if [ "$rc" = 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); failed_names+=("$t"); fi
    done < <(cat "$work"/*.rc 2>/dev/null)
    rm -rf "$work"
    echo "== $passed tests passed, $failed failed, $disabled disabled (not run) ($streams stream(s))"
    for t in "${failed_names[@]}"; do echo "FAILED TEST: $t"; done
    [ $failed = 0 ]
}
step() {  # step NAME LOGFILE COMMAND...
    local name=$1 log=$2
    shift 2
    local start=$(date +%s.%N)
    if declare -F "$1" >/dev/null; then
        "$@" >"$logdir/$log" 2>&1  # a function (run_each) bounds each command it runs itself
    else
        timeout --kill-after=10 "${WEFT_GPU_RUN_STEP_TIMEOUT:-300}" "$@" >"$logdir/$log" 2>&1
    fi
    local rc=$?
    [ $rc = 0 ] || any_failed=1
    local secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN{printf "%.1f", e-s}')
    local detail
    detail=$(grep -E '^== [0-9]+ tests passed|^== no tests run|^FAILED TEST|^\[  PASSED  \]|^[0-9]+ (passed|failed)' \
        "$logdir/$log" |
        head -n 4 | tr '\n' ' ')
    summary+=("$(printf '%-28s %-6s %7ss  %s' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL:$rc)" "$secs" "$detail")")
}

nvidia-smi >"$logdir/nvidia-smi.txt" 2>&1
nvidia-smi topo -m >>"$logdir/nvidia-smi.txt" 2>&1

# Warm the JIT cache with weft's own kernels first, many compiles at a time (the tests would otherwise
# compile them one by one on first use).
weft_compile=$(find_bin weft-compile)
if [ -n "$weft_compile" ] && [ -n "${WEFT_CACHE_DIR:-}" ]; then
    warm_jobs=$(nproc)
    [ "$warm_jobs" -le 256 ] || warm_jobs=256  # weft-compile refuses more
    step "warm JIT cache" warm_cache.log "$weft_compile" --builtin --jobs "${WEFT_GPU_RUN_WARM_JOBS:-$warm_jobs}"
fi

if [ $run_tests = 1 ]; then
    # One process per test: a kernel that traps poisons its CUDA context and must not take the tests
    # after it down with it. (ctest would do the same, but needs the configuring machine's CMake.)
    gpu_tests=$(find_bin weft_gpu_tests)
    if [ -z "$gpu_tests" ]; then
        summary+=("$(printf '%-28s %-6s' "gpu tests" "FAIL: no weft_gpu_tests under $bindir")")
        any_failed=1
    fi
    [ -n "$gpu_tests" ] && step "gpu tests" gpu_tests.log run_each "$gpu_tests" "${WEFT_GPU_TEST_FILTER:-*}"
    dist_tests=$(find_bin weft_dist_tests)
    weftrun=$(find_bin weftrun)
    if [ -n "$dist_tests" ] && [ -n "$weftrun" ]; then
        for n in 2 3 4; do
            step "dist tests (weftrun -n $n)" dist_tests_n$n.log "$weftrun" -n $n --timeout 240 -- "$dist_tests" --gtest_color=no
        done
        # The fault tests leave their World with a recorded failure: each suite runs alone, with WEFT_TEST_FAULTS=1.
        for suite in DistAgAttentionFaults DistAgGemmFaults; do
            step "dist $suite (-n 2)" "dist_$suite.log" env WEFT_TEST_FAULTS=1 WEFT_TIMEOUT_MS=5000 "$weftrun" -n 2 \
                --timeout 240 -- "$dist_tests" --gtest_color=no --gtest_filter="$suite.*"
        done
    fi
    while IFS= read -r example; do
        step "$(basename "$example")" "$(basename "$example").log" "$example"
    done < <(find "$bindir" -type f -name 'weft_example_*' -perm -u+x 2>/dev/null | sort)
    # The Python package's GPU tests, where weft and torch import (pip install . first; run from the repository
    # root): one rank per GPU under torchrun (NCCL references), then two ranks sharing GPU 0 (gloo references).
    if python3 -c "import weft, torch" >/dev/null 2>&1; then
        ngpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
        [ "$ngpus" -ge 1 ] || ngpus=1
        step "python tests (${ngpus} rank(s))" python_tests.log python3 -m torch.distributed.run --standalone \
            --nproc_per_node="$ngpus" -m pytest -q -p no:cacheprovider python/tests/gpu
        step "python tests (2 ranks, 1 GPU)" python_tests_shared.log env WEFT_TEST_TORCH_BACKEND=gloo \
            CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" python3 -m torch.distributed.run --standalone \
            --nproc_per_node=2 -m pytest -q -p no:cacheprovider python/tests/gpu
    fi
fi
if [ $run_bench = 1 ]; then
    while IFS= read -r bench; do
        name=$(basename "$bench")
        step "$name" "$name.log" "$bench" --json "$logdir/$name.json"
    done < <(find "$bindir" -type f -name 'weft_bench_*' -perm -u+x 2>/dev/null | sort)
fi

echo
echo "== weft GPU run: $(date -u +%Y-%m-%dT%H:%MZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1) x$(nvidia-smi -L | grep -c '^GPU ')"
printf '%-28s %-6s %8s  %s\n' step result time detail
for line in "${summary[@]}"; do echo "$line"; done
[ "$any_failed" = 0 ]  # the exit status: 1 when a step failed ('exit' here makes shellcheck 0.9 report SC2317)
