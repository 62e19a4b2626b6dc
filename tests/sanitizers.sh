#!/usr/bin/env bash
# The sanitizer and fuzzing pass of the test suite (tests/run.sh runs it after
# the plain build's tests; ELLM_SKIP_SANITIZERS=1 skips it):
#   1. build-asan/: everything (no CUDA) under ASan + UBSan with clang, the
#      unit and integration tests once (ctest -j ELLM_JOBS; integration tests
#      run alone), and each libFuzzer harness of fuzz/ for ELLM_FUZZ_SECONDS
#      (default 45) from its checked-in seed corpus, ELLM_JOBS at a time;
#   2. build-tsan/: the ring, thread-pool and scheduler tests under TSan.
# Any sanitizer report, from a test or from any process an integration test
# starts (they write to build-*/sanitizer-reports/), fails the run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
jobs="${ELLM_JOBS:-2}"
fuzz_seconds="${ELLM_FUZZ_SECONDS:-45}"
clang_flags=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++
             -DELLM_CUDA=OFF)

check_reports() {
  local dir=$1
  if compgen -G "$dir/*" > /dev/null; then
    echo "[sanitizers] reports in $dir:"
    head -n 60 "$dir"/*
    exit 1
  fi
}

# --- 1. ASan + UBSan, fuzzers ---
asan="$root/build-asan"
echo "[sanitizers] configuring $asan (clang, address+undefined, fuzzers)"
cmake -S "$root" -B "$asan" "${clang_flags[@]}" -DELLM_SANITIZE=address,undefined -DELLM_FUZZ=ON > "$asan-configure.log" 2>&1 \
  || { cat "$asan-configure.log"; exit 1; }
echo "[sanitizers] building $asan"
cmake --build "$asan" -j "$jobs"
reports="$asan/sanitizer-reports"
rm -rf "$reports" && mkdir -p "$reports"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$reports/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan"
echo "[sanitizers] unit and integration tests under ASan + UBSan"
(cd "$asan" && ctest --output-on-failure -j "$jobs" -L "unit|integration" -E cmake_default_generator)
check_reports "$reports"

# One harness: its run, its execution count, its failure if any.
fuzz() {
  local h=$1
  local work="$asan/fuzz-corpus/$h"   # new inputs go here, not into the source tree
  local log="$asan/fuzz-$h.log"
  mkdir -p "$work"
  if ! "$asan/fuzz/fuzz_$h" "$work" "$root/fuzz/corpus/$h" -max_total_time="$fuzz_seconds" -print_final_stats=1 \
       -rss_limit_mb=4096 -timeout=20 -artifact_prefix="$asan/fuzz-crash-$h-" > "$log" 2>&1; then
    echo "[sanitizers] fuzz_$h found a failure:"
    tail -n 60 "$log"
    return 1
  fi
  local execs
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  echo "[sanitizers] fuzz_$h: $execs executions in ${fuzz_seconds} s, no failures"
}
# $jobs harnesses at a time (each is one process on one core).
harnesses=(gguf tokenizer chat_template frames request openai)
echo "[sanitizers] fuzzing ${harnesses[*]}, $jobs at a time, ${fuzz_seconds} s each"
failed=0
for ((i = 0; i < ${#harnesses[@]}; i += jobs)); do
  pids=()
  for h in "${harnesses[@]:i:jobs}"; do
    fuzz "$h" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do
    wait "$p" || failed=1
  done
done
[ "$failed" = 0 ] || exit 1
check_reports "$reports"
unset ASAN_OPTIONS UBSAN_OPTIONS

# --- 2. TSan: the ring, the thread pool (in test_kernels) and the scheduler ---
tsan="$root/build-tsan"
echo "[sanitizers] configuring $tsan (clang, thread)"
cmake -S "$root" -B "$tsan" "${clang_flags[@]}" -DELLM_SANITIZE=thread > "$tsan-configure.log" 2>&1 \
  || { cat "$tsan-configure.log"; exit 1; }
cmake --build "$tsan" -j "$jobs" --target test_ring test_kernels test_scheduler
reports="$tsan/sanitizer-reports"
rm -rf "$reports" && mkdir -p "$reports"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:log_path=$reports/tsan"
for t in test_ring test_kernels test_scheduler; do
  echo "[sanitizers] $t under TSan"
  "$tsan/tests/$t" --gtest_brief=1
done
check_reports "$reports"
echo "[sanitizers] done: no reports"
