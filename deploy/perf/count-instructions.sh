#!/usr/bin/env bash
# The proxy's user-space instructions per request, counted by valgrind's callgrind: the one CPU
# figure a shared, noisy machine does not move (with prefix_aware one build's counts still
# vary by up to ~1% run to run: count each build two or three times, interleaved).
#
#   deploy/perf/count-instructions.sh LABEL [VAR=value ...]
#
# Runs `python -m proxy serve` under callgrind with the given environment in front of the
# zero-latency mock (started here unless one answers on 127.0.0.1:9101), warms it with 200
# requests, counts the next REQUESTS (default 400) at CONCURRENCY (default 8), and prints
#   LABEL  <instructions per request>
# Settings: CHUNKS (mock's chunks per response, default 64), SYSTEM_CHARS (the system prompt's
# length, default 200; ~8000 is a 2k-token prompt), REQUESTS, WARMUP (requests before the
# count, default 200), CONCURRENCY, PORT (default 9100),
# ITL_MS (the mock's gap between content chunks, default 0: each stream arrives in a few reads;
# 5-20 is an engine's pace, and each chunk is then its own read, meter step and write: keep
# CONCURRENCY x the proxy's slowdown under callgrind (~50x) x its CPU per chunk below ITL_MS,
# e.g. CONCURRENCY=1, or chunks coalesce again), PROFILE (a file to keep callgrind's output in,
# for `callgrind_annotate PROFILE`: where the counted instructions went, by function),
# VALGRIND_ARGS (more of callgrind's options: --cache-sim=yes counts the simulated cache misses
# beside the instructions, in PROFILE), PROXY (warmroute; sglang-router or vllm-router counts
# that Rust router instead, found on PATH, with RUST_POLICY as its --policy, default
# round_robin: the same requests, counted the same way, every thread of its process;
# floor-bare or floor-asgi, the cheapest Python proxy on the same stack: floor_proxy.py).
# The mock is started here, with these settings, unless one already answers on 9101.
# An OTLP/HTTP receiver that reads and discards exports listens on 127.0.0.1:9250 while this
# runs, for OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:9250.
# API_KEY (in this script's environment): the load presents it as a bearer token; give the proxy
# its digest, e.g. API_KEY=k deploy/perf/count-instructions.sh keyed \
#   WARMROUTE_SERVER__API_KEYS=bench:$(printf %s k | sha256sum | cut -d' ' -f1)
# IDLE_S (seconds): after the counted requests, count as long with none, and print the proxy's
# own per-second work (polls, timers) and the requests' count net of it: at an engine's pace
# a long stream lasts seconds, and the slope between stream lengths would count that work
# as the chunks' (PROFILE then keeps the requests' window alone).
# Kernel time (the socket calls) is not counted. Example, telemetry off against the default:
#   deploy/perf/count-instructions.sh off WARMROUTE_TELEMETRY__ENABLED=false
#   deploy/perf/count-instructions.sh metrics
set -euo pipefail
label=${1:?usage: count-instructions.sh LABEL [VAR=value ...]}
shift
cd "$(dirname "$0")/../.."
for tool in valgrind callgrind_control curl; do
  command -v "$tool" >/dev/null || { echo "count-instructions: needs $tool" >&2; exit 2; }
done
PY=${PYTHON:-python}
PORT=${PORT:-9100}
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true  # gone before the next run looks for a mock on 9101
  rm -rf "$work"
}
trap cleanup EXIT

ready() { curl -s -o /dev/null "$1"; }
if ! ready http://127.0.0.1:9101/v1/models; then
  $PY -m proxy.bench.mock --port 9101 --instances 2 --chunks "${CHUNKS:-64}" \
    --chunk-interval-ms "${ITL_MS:-0}" >/dev/null 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do
    ready http://127.0.0.1:9101/v1/models && ready http://127.0.0.1:9102/v1/models && break
    sleep 0.1
  done
fi
$PY -c "$($PY -c 'from proxy.harness.telemetry_cost import SINK; print(SINK)')" 9250 \
  >/dev/null 2>&1 &
pids+=($!)

case "${PROXY:-warmroute}" in
  warmroute | sglang-router | vllm-router | floor-bare | floor-asgi) ;;
  *)
    echo "count-instructions: PROXY=$PROXY: warmroute, sglang-router, vllm-router, floor-bare or floor-asgi" >&2
    exit 2
    ;;
esac
# The command line paced_chunks.py runs each proxy with (one place says how each is started).
mapfile -t serve < <(cd deploy/perf && $PY -c '
import sys
from pathlib import Path
from paced_chunks import _command
print("\n".join(_command(sys.argv[1], int(sys.argv[2]), sys.argv[3:], Path("."))[0]))
' "${PROXY:-warmroute}" "$PORT" http://127.0.0.1:9101 http://127.0.0.1:9102)
if ! command -v "${serve[0]:-}" >/dev/null; then
  echo "count-instructions: ${PROXY:-warmroute}: not found (${serve[0]:-no command}); pip install ${PROXY:-warmroute}" >&2
  exit 2
fi
# shellcheck disable=SC2086  # VALGRIND_ARGS: more of callgrind's options, e.g. --cache-sim=yes
env "$@" valgrind --tool=callgrind --instr-atstart=no ${VALGRIND_ARGS:-} --callgrind-out-file="$work/out" \
  --log-file="$work/log" "${serve[@]}" >/dev/null 2>&1 &
proxy=$!
pids+=("$proxy")
for _ in $(seq 120); do
  ready "http://127.0.0.1:$PORT/health" && break
  sleep 1
done
bench=($PY -m proxy bench --base-url "http://127.0.0.1:$PORT" --workload hot-prompt
  --system-chars "${SYSTEM_CHARS:-200}" --user-chars 50 --model mock
  --concurrency "${CONCURRENCY:-8}" --no-progress)
if [ -n "${API_KEY:-}" ]; then  # the client presents it (give the proxy its SHA-256)
  export API_KEY
  bench+=(--api-key-env API_KEY)
fi
counted() {  # instructions counted since the last zero or dump, every thread
  callgrind_control -e Ir "$proxy" 2>/dev/null | awk '/^ *Th /{gsub(",", "", $3); s += $3} END {print s + 0}'
}
# The warm-up sends another seed's prompts: the same seed would send the counted run's first
# prompts again, and a prompt head seen again is placed (a cost those requests would pay).
"${bench[@]}" --requests "${WARMUP:-200}" --seed 1 >/dev/null
callgrind_control -i on "$proxy" >/dev/null 2>&1
t0=$(date +%s.%N)
"${bench[@]}" --requests "${REQUESTS:-400}" >/dev/null
t1=$(date +%s.%N)
out="$work/out"
if [ -n "${IDLE_S:-}" ]; then
  # The window's count, dumped (and zeroed), then IDLE_S seconds with no request: the proxy's
  # own per-second work (health and load polls, timers), which the window also holds.
  window=$(counted)
  callgrind_control --dump=window "$proxy" >/dev/null 2>&1
  sleep "$IDLE_S"
  idle=$(counted)
  out=$(ls "$work"/out.* 2>/dev/null | head -1); out=${out:-$work/out}
fi
callgrind_control -i off "$proxy" >/dev/null 2>&1
kill -INT "$proxy"
wait "$proxy" || true
total=${window:-$(grep -o "Collected : [0-9]*" "$work/log" | awk '{print $3}')}
if [ -n "${PROFILE:-}" ]; then cp "$out" "$PROFILE"; fi
awk -v l="$label" -v t="$total" -v n="${REQUESTS:-400}" \
  'BEGIN { printf "%-12s %.4f M instructions per request\n", l, t / n / 1e6 }'
if [ -n "${IDLE_S:-}" ]; then
  awk -v l="$label" -v t="$total" -v n="${REQUESTS:-400}" -v i="$idle" -v s="$IDLE_S" \
    -v w="$(echo "$t1 - $t0" | bc)" 'BEGIN {
      bg = i / s * w  # the per-second work over the window
      printf "%-12s idle %.0f k instructions/s; the window'"'"'s %.1f s of it %.4f M per request;" \
        " %.4f M per request net of it\n", l, i / s / 1e3, w, bg / n / 1e6, (t - bg) / n / 1e6 }'
fi
