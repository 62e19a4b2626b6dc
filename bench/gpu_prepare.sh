#!/usr/bin/env bash
# Runs HERE (no GPU needed): builds the GPU test, the GPU benchmark and the
# mlp-worker for sm_90, and packs them with the shared libraries the device
# machine lacks (gRPC, protobuf, abseil, gtest, numa, ...; not CUDA's own,
# which the device machine has) into .device-libs/ (ignored by git).
# Then run bench/gpu_check.sh on the device machine with the device tool:
#   command: "bash bench/gpu_check.sh"   carry: [".device-libs"]   timeout_s: 480
#
# Environment: ELLM_GPU_BUILD (build folder, default build), ELLM_GPU_BUILD_TYPE
# (default Release), ELLM_JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${ELLM_GPU_BUILD:-build}
type=${ELLM_GPU_BUILD_TYPE:-Release}
jobs=${ELLM_JOBS:-2}
out=.device-libs

cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="$type" >/dev/null
known=$(ninja -C "$build" -t targets all 2>/dev/null | cut -d: -f1)
targets="test_cuda_backend ellm-mlp-worker"
if grep -qx 'ellm-mlp-bench' <<<"$known"; then
  targets="$targets ellm-mlp-bench"
else
  echo "gpu_prepare: no ellm-mlp-bench target: add include(cuda.cmake) to bench/CMakeLists.txt" >&2
fi
if ! grep -qx 'test_cuda_backend' <<<"$known"; then
  echo "gpu_prepare: no test_cuda_backend target (is the CUDA toolkit found?)" >&2
  exit 1
fi
cmake --build "$build" -j"$jobs" --target $targets

rm -rf "$out"
mkdir -p "$out/bin"
for t in $targets; do
  bin=$(find "$build" -maxdepth 2 -type f -name "$t" | head -1)
  cp "$bin" "$out/bin/$t"
  strip --strip-debug "$out/bin/$t"
done
# Every library ldd resolves, except glibc's own and CUDA's (the device
# machine has the CUDA toolkit; its driver library must come from there).
for b in "$out"/bin/*; do
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r soname path; do
  case "$soname" in
    libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|libresolv.so*|ld-linux*|libutil.so*) ;;
    libcuda.so*|libcublas*|libcudart*|libnvidia*|libnvrtc*) ;;
    *) cp -L "$path" "$out/$soname" ;;
  esac
done
echo "gpu_prepare: $(du -sh "$out" | cut -f1) in $out:"
ls "$out" "$out/bin"
size_kb=$(du -sk "$out" | cut -f1)
if [ "$size_kb" -gt $((60 * 1024)) ]; then
  echo "gpu_prepare: $out is over 60 MiB; the device tool carries 64 MiB at most" >&2
  exit 1
fi
