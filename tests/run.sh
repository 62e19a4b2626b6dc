#!/usr/bin/env bash
# Quick start, step 2: set up and build, then run the whole test suite: the
# unit and integration tests (GPU tests skip without a device), then the same
# tests under ASan + UBSan, the fuzzers and the TSan tests
# (tests/sanitizers.sh; ELLM_SKIP_SANITIZERS=1 skips that part).
# Extra arguments go to the first ctest (e.g. -L unit).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/launch/setup.sh"
build="${ELLM_BUILD_DIR:-$root/build}"
# Unit tests ELLM_JOBS (default 2) at a time; integration tests run alone
# (RUN_SERIAL, tests/CMakeLists.txt).
(cd "$build" && ctest --output-on-failure --timeout 900 -j "${ELLM_JOBS:-2}" "$@")
if [ "${ELLM_SKIP_SANITIZERS:-0}" != "1" ]; then
  "$root/tests/sanitizers.sh"
fi
