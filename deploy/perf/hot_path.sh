#!/usr/bin/env bash
# What the proxy adds on the wall clock, this tree against another build, in one session:
# throughput vs direct and proxy CPU per request at concurrency 64, and the added TTFT at
# concurrency 1 (each request sent through the proxy and straight to the mock in turn).
#
#   deploy/perf/hot_path.sh                       # this tree only
#   BEFORE=/tmp/wr-before deploy/perf/hot_path.sh # and a checkout of another commit, alternating
#   PIN=1 ...                                     # proxy on core 1; mock and load generator on 0
#   SYSTEM_CHARS="200 8000" ROUNDS=3 ...          # prompt sizes (8000 chars is ~2k tokens)
#
# Backends: the zero-latency mock (64-chunk streams, no model time), so what is measured is the
# proxy. Each round starts each build's proxy fresh, warms it with 300 requests, then runs
# REQUESTS (default 3000) at c=64 against it and straight at the mock, then PAIRS (default
# 1000) interleaved pairs at c=1. Builds alternate which goes first in each round. One line per
# build, round and prompt size:
#   <build> <system chars> r<round>  thr-vs-direct <ratio>  cpu/req <ms>  added-ttft-p50 <ms> p99 <ms>
# BEFORE's tree runs with this tree's interpreter and its own sources first on PYTHONPATH (its
# dependencies must be what this venv has). Results JSON under $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=$(pwd)
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/warmroute-hot-path}
ROUNDS=${ROUNDS:-3}
REQUESTS=${REQUESTS:-3000}
PAIRS=${PAIRS:-1000}
SYSTEM_CHARS=${SYSTEM_CHARS:-"200 8000"}
MOCK_PORT=${MOCK_PORT:-9701}
PROXY_PORT=${PROXY_PORT:-9700}
mkdir -p "$OUT"
PROXY_CPU=() LOAD_CPU=()
if [[ -n "${PIN:-}" ]]; then PROXY_CPU=(taskset -c 1) LOAD_CPU=(taskset -c 0); fi

pids=()
cleanup() { for p in "${pids[@]:-}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
wait_http() {
  for _ in $(seq 200); do curl -fs -o /dev/null "$1" && return 0; sleep 0.1; done
  echo "hot_path: $1 did not come up" >&2; return 1
}

"${LOAD_CPU[@]}" $PY -m proxy.bench.mock --port $MOCK_PORT --instances 2 --chunks 64 >"$OUT/mock.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$MOCK_PORT/v1/models"
wait_http "http://127.0.0.1:$((MOCK_PORT + 1))/v1/models"

bench() {  # label system-chars requests concurrency [extra args]
  local label=$1 chars=$2 n=$3 c=$4
  shift 4
  "${LOAD_CPU[@]}" $PY -m proxy bench --base-url "http://127.0.0.1:$PROXY_PORT" \
    --direct "http://127.0.0.1:$MOCK_PORT" --direct "http://127.0.0.1:$((MOCK_PORT + 1))" \
    --workload hot-prompt --system-chars "$chars" --user-chars 50 --model mock \
    --requests "$n" --concurrency "$c" --no-progress --label "$label" \
    --out "$OUT/$label.json" "$@" >/dev/null
}

one() {  # build-name tree system-chars round
  local name=$1 tree=$2 chars=$3 round=$4 label="$1-$3-r$4"
  (cd "$tree" && PYTHONPATH="$tree" exec "${PROXY_CPU[@]}" $PY -m proxy serve \
    --backend "http://127.0.0.1:$MOCK_PORT" --backend "http://127.0.0.1:$((MOCK_PORT + 1))" \
    --port $PROXY_PORT --log-level warning) >"$OUT/proxy-$label.log" 2>&1 &
  local pid=$!
  wait_http "http://127.0.0.1:$PROXY_PORT/ready"
  "${LOAD_CPU[@]}" $PY -m proxy bench --base-url "http://127.0.0.1:$PROXY_PORT" --workload hot-prompt \
    --system-chars "$chars" --user-chars 50 --model mock --requests 300 --concurrency 16 \
    --no-progress --seed 1 >/dev/null
  bench "$label-c64" "$chars" "$REQUESTS" 64 --server-pid "$pid"
  # (each run its own seed: prompts sent again would be heads seen again, and placed)
  bench "$label-c1" "$chars" "$PAIRS" 1 --interleave --seed 2
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  $PY - "$OUT/$label-c64.json" "$OUT/$label-c1.json" "$label" <<'EOF'
import json, sys
c64, c1 = (json.load(open(p)) for p in sys.argv[1:3])
proxy, direct = (r["summary"] for r in c64["runs"])
ratio = proxy["request_throughput"] / direct["request_throughput"]
cpu = proxy["server_cpu_ms_per_request"]
added = c1["comparisons"][0]["ttft_s"]
failed = proxy["failed"] + direct["failed"]
print(f"{sys.argv[3]:<24} thr-vs-direct {ratio:5.2f}  cpu/req {cpu:5.2f} ms  "
      f"added-ttft-p50 {added['p50'] * 1000:+5.2f} ms p99 {added['p99'] * 1000:+5.2f} ms"
      f"  failed {failed}")
EOF
}

for chars in $SYSTEM_CHARS; do
  for round in $(seq "$ROUNDS"); do
    if [[ -z "${BEFORE:-}" ]]; then
      one now "$HERE" "$chars" "$round"
    elif ((round % 2)); then
      one before "$BEFORE" "$chars" "$round"; one now "$HERE" "$chars" "$round"
    else
      one now "$HERE" "$chars" "$round"; one before "$BEFORE" "$chars" "$round"
    fi
  done
done
