#!/usr/bin/env bash
# Sets up and builds ellm on Debian 12: installs the missing Debian packages,
# configures CMake in build/ and builds everything. Safe to run again: it only
# installs what is missing and rebuilds what changed.
#   ELLM_BUILD_DIR   build folder (default: build)
#   ELLM_JOBS        parallel compile jobs (default: 2)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build="${ELLM_BUILD_DIR:-$root/build}"
jobs="${ELLM_JOBS:-2}"

packages=(build-essential cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libboost-dev libnuma-dev libabsl-dev numactl libgtest-dev libbenchmark-dev gnuplot-nox openssl
  clang libclang-rt-14-dev llvm nlohmann-json3-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] installing: ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ ! -f "$build/build.ninja" ] || ! grep -q "CMAKE_BUILD_TYPE:STRING=Release" "$build/CMakeCache.txt"; then
  echo "[setup] configuring $build"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
echo "[setup] building with $jobs jobs"
cmake --build "$build" -j "$jobs"
echo "[setup] done: binaries in $build"
