#!/usr/bin/env bash
# Quick start, step 2: set up and build, then run the whole test suite
# (unit and integration tests; GPU tests skip without a device).
# Extra arguments go to ctest (e.g. -L unit).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/launch/setup.sh"
build="${ELLM_BUILD_DIR:-$root/build}"
cd "$build"
ctest --output-on-failure --timeout 600 "$@"
