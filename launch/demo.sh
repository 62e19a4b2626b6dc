#!/usr/bin/env bash
# Quick start, step 1: set up and build, launch ellm on the default model,
# generate a story, and stop. Extra arguments go to ellm-launch.
#   ELLM_PROMPT      the prompt (default: "Once upon a time")
#   ELLM_MODEL       model file (default: ../shared/models/stories260K.gguf)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/launch/setup.sh"
build="${ELLM_BUILD_DIR:-$root/build}"
port="${ELLM_DEMO_PORT:-50051}"
log=$(mktemp /tmp/ellm-demo-XXXXXX.log)
out=$(mktemp /tmp/ellm-demo-out-XXXXXX)

cd "$root"
"$build/ellm-launch" --bin-dir "$build" --port "$port" "$@" >"$out" 2>"$log" &
launcher=$!
stop() { kill -TERM "$launcher" 2>/dev/null || true; wait "$launcher" 2>/dev/null || true; }
trap stop EXIT
echo "[demo] starting ellm (log: $log)"
for _ in $(seq 1 600); do
  grep -q "ellm listening" "$out" && break
  if ! kill -0 "$launcher" 2>/dev/null; then
    echo "[demo] ellm-launch failed:"; cat "$log"; exit 1
  fi
  sleep 0.1
done
grep -q "ellm listening" "$out" || { echo "[demo] ellm did not start in time:"; cat "$log"; exit 1; }
grep -E "launch I" "$log" | sed 's/^/[demo] /'
prompt="${ELLM_PROMPT:-Once upon a time}"
echo "[demo] ellm generate \"$prompt\""
echo
printf '%s' "$prompt"
"$build/ellm" generate "$prompt" --server "127.0.0.1:$port" --max-tokens 256 --temperature 0.8 --top-p 0.95 --seed 42 --stats
echo
stop
trap - EXIT
echo "[demo] stopped ellm"
