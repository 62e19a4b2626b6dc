#!/usr/bin/env bash
# Runs ON THE DEVICE MACHINE (after bench/gpu_prepare.sh here, carrying
# .device-libs): the GPU tests and the GPU benchmark of the CUDA MLP backend.
# Writes under $OUT: env.txt (GPU, driver, library check, probe),
# test_cuda_backend.log and .xml, bench.txt; prints a summary last.
# Extra arguments go to ellm-mlp-bench (e.g. --models=llama3-8b --iters=10).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ellm-gpu-out}
mkdir -p "$OUT"
libs=$PWD/.device-libs
if [ ! -x "$libs/bin/test_cuda_backend" ]; then
  echo "gpu_check: $libs/bin/test_cuda_backend missing: run bench/gpu_prepare.sh and carry .device-libs" >&2
  exit 2
fi

# CUDA's libraries (cuBLAS) from the machine's toolkit, wherever it keeps them.
cuda_path=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/lib \
         /usr/lib/x86_64-linux-gnu; do
  if [ -e "$d/libcublas.so.13" ]; then cuda_path="$d"; break; fi
done
if [ -z "$cuda_path" ]; then
  found=$(find / -xdev -name 'libcublas.so.13*' 2>/dev/null | head -1)
  [ -n "$found" ] && cuda_path=$(dirname "$found")
fi
export LD_LIBRARY_PATH="$libs${cuda_path:+:$cuda_path}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem \
    --format=csv 2>&1
  echo "cuBLAS from: ${cuda_path:-not found}"
  for b in "$libs"/bin/*; do
    missing=$(ldd "$b" | grep 'not found')
    echo "$(basename "$b"): ${missing:-all libraries found}"
  done
  "$libs/bin/ellm-mlp-worker" --probe-cuda 2>&1
  echo "probe exit: $?"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if ! grep -q '^cuda: yes' "$OUT/env.txt"; then
  echo "gpu_check: no usable CUDA device (see the probe line above); the GPU tests would only skip" >&2
  exit 3
fi

echo "== test_cuda_backend"
timeout 300 "$libs/bin/test_cuda_backend" --gtest_output="xml:$OUT/test_cuda_backend.xml" \
  > "$OUT/test_cuda_backend.log" 2>&1
test_rc=$?
grep -E '^\[ +(OK|FAILED|SKIPPED) +\]|Failure|error|Expected|Which is|actual' \
  "$OUT/test_cuda_backend.log" | head -80

bench_rc=-1
if [ -x "$libs/bin/ellm-mlp-bench" ]; then
  echo "== ellm-mlp-bench $*"
  timeout 300 "$libs/bin/ellm-mlp-bench" "$@" > "$OUT/bench.txt" 2>&1
  bench_rc=$?
fi

echo "== summary"
echo "test_cuda_backend exit=$test_rc ($(grep -c '^\[       OK \]' "$OUT/test_cuda_backend.log") ok, $(grep -c '^\[  FAILED  \]' "$OUT/test_cuda_backend.log") failed lines, $(grep -c '^\[  SKIPPED \]' "$OUT/test_cuda_backend.log") skipped lines)"
if [ -f "$OUT/bench.txt" ]; then
  echo "ellm-mlp-bench exit=$bench_rc"
  cat "$OUT/bench.txt"
else
  echo "ellm-mlp-bench: not carried"
fi
[ "$test_rc" -eq 0 ] && { [ "$bench_rc" -eq 0 ] || [ "$bench_rc" -eq -1 ]; }
