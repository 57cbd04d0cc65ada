#!/usr/bin/env bash
# Prefill/decode disaggregation through real sockets: does `disagg.mode: auto` split a fleet
# of simulated engines when chat streams share it with long documents, and what does that do
# to the chat streams' inter-token latency and to throughput? And on 2 engines, or at light
# load, does it stay off and change nothing?
#
# Engines: `warmroute sim` (an 8B model on $DEVICE) run $TIME_SCALE times real time. Slower
# than real (0.25 by default) on purpose: on a small shared box the proxy, the load generator
# and six engines share the CPUs, and a 5 ms decode step is within the scheduling noise of a
# busy core; at 0.25 a step is ~20 ms and a 2,048-token prefill chunk ~270 ms, so what is
# measured is the engines' physics, not the host's. Each run starts on fresh engines (cold
# caches). The proxy runs with disagg off, then auto with a short window and dwell (a YAML
# config under $OUT), in front of the same engines; the load is `warmroute bench --workload
# chat-docs` (chat streams with 512-token answers, 15% ~8,000-token documents answered in 16).
#
#   deploy/perf/disagg.sh                          # seed 1: 6 engines, 2 engines, light load
#   SEEDS="1 2 3" deploy/perf/disagg.sh
#   REQUESTS=120 SEEDS=1 RUNS=six deploy/perf/disagg.sh   # a smoke run
#
# One line per run: chat ITL p50/p99 over the whole run, chat ITL p99 of the streams that
# began after the switch (the time read from GET /admin/disagg), the documents' TTFT p50,
# output tokens/s, and what the decider did and why. Results JSON and the proxies' decider
# state under $OUT. RUNS picks the setups: any of six, two, light (default all three); MODES
# the modes (default "off auto").
set -euo pipefail
cd "$(dirname "$0")/../.."

SEEDS="${SEEDS:-1}"
RUNS="${RUNS:-six two light}"
MODES="${MODES:-off auto}"
REQUESTS="${REQUESTS:-600}"         # per run on 6 engines; half on 2, a fifth at light load
CONCURRENCY="${CONCURRENCY:-48}"
LIGHT_CONCURRENCY="${LIGHT_CONCURRENCY:-3}"
DEVICE="${DEVICE:-h100}"
TIME_SCALE="${TIME_SCALE:-0.25}"
WINDOW_S="${WINDOW_S:-20}"          # the decider's window, evaluation period and dwell (real s)
EVALUATE_S="${EVALUATE_S:-2}"
DWELL_S="${DWELL_S:-30}"
MIN_REQUESTS="${MIN_REQUESTS:-60}"
OUT="${OUT:-/tmp/warmroute-disagg}"
SIM_PORT=9501
PROXY_PORT=9520
ADMIN_PORT=9521
mkdir -p "$OUT"

pids=()
cleanup() { for p in "${pids[@]:-}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_http() {
  for _ in $(seq 300); do curl -fs "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "disagg: $1 did not come up" >&2; return 1
}

start_sims() {  # engine count
  warmroute sim --port "$SIM_PORT" --instances "$1" --device "$DEVICE" \
    --time-scale "$TIME_SCALE" --seed "$seed" >"$OUT/sim.log" 2>&1 &
  pids+=($!)
  for ((i = 0; i < $1; i++)); do wait_http "http://127.0.0.1:$((SIM_PORT + i))/v1/models"; done
}

write_config() {  # engine count, mode -> config path
  local cfg="$OUT/config-$2-$1.yaml"
  {
    echo "backends:"
    for ((i = 0; i < $1; i++)); do echo "  - {url: http://127.0.0.1:$((SIM_PORT + i)), engine: vllm}"; done
    echo "disagg:"
    echo "  mode: $2"
    echo "  window_s: $WINDOW_S"
    echo "  evaluate_s: $EVALUATE_S"
    echo "  min_dwell_s: $DWELL_S"
    echo "  min_requests: $MIN_REQUESTS"
  } >"$cfg"
  echo "$cfg"
}

start_proxy() {  # config path
  warmroute serve --config "$1" --port "$PROXY_PORT" --admin-port "$ADMIN_PORT" \
    --log-level info >"$OUT/proxy-$label.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$PROXY_PORT/ready"
}

stop_all() { cleanup; pids=(); }

one_run() {  # engines, mode, requests, concurrency, setup name
  local engines=$1 mode=$2 requests=$3 concurrency=$4
  label="$5-$mode-s$seed"
  start_sims "$engines"
  start_proxy "$(write_config "$engines" "$mode")"
  warmroute bench --base-url "http://127.0.0.1:$PROXY_PORT" --workload chat-docs \
    --requests "$requests" --concurrency "$concurrency" --seed "$seed" \
    --no-progress --label "$label" --out "$OUT/$label.json" >/dev/null
  python - "http://127.0.0.1:$ADMIN_PORT/admin/disagg" "$OUT/$label-state.json" <<'EOF'
import json, sys, time, urllib.request
read_at = time.time()
state = json.load(urllib.request.urlopen(sys.argv[1], timeout=5))
state["read_at_unix"] = read_at  # with state["now"]: when each switch happened, wall clock
json.dump(state, open(sys.argv[2], "w"), indent=1)
EOF
  stop_all
  python - "$OUT/$label.json" "$OUT/$label-state.json" "$label" <<'EOF'
import json, sys
from datetime import datetime
from proxy.stats import percentile

run = json.load(open(sys.argv[1]))["runs"][0]
state = json.load(open(sys.argv[2]))
reqs = [r for r in run["requests"] if r["ok"]]
started = datetime.fromisoformat(run["started_at"]).timestamp()  # truncated to the second
on = next((s for s in state.get("switches", []) if s["active"]), None)
after = None
if on is not None:
    switch_unix = state["read_at_unix"] - (state["now"] - on["at"])
    after = switch_unix - started + 1.0  # + the second started_at may have lost

def p(values, q):
    return f"{percentile(sorted(values), q) * 1000:6.1f}" if values else "     -"

chat = [g for r in reqs if r["kind"] == "chat" for g in r["itl"]]
later = [g for r in reqs if r["kind"] == "chat" and after is not None and r["start"] >= after
         for g in r["itl"]]
docs = [r["ttft"] for r in reqs if r["kind"] == "doc" and r["ttft"] is not None]
out = sum(r["completion_tokens"] or r["output_chunks"] for r in reqs) / run["duration"]
decider = (f"on at {after - 1.0:.1f} s: {on['reason']}" if on is not None
           else f"off: {state.get('reason')}")
print(f"{sys.argv[3]:<22} ok {len(reqs)}/{len(run['requests'])}  chat ITL p50 {p(chat, .5)} ms"
      f"  p99 {p(chat, .99)} ms  p99 after switch {p(later, .99)} ms"
      f"  doc TTFT p50 {p(docs, .5)} ms  out {out:7.1f} tok/s  | {decider}")
EOF
}

for seed in $SEEDS; do
  for setup in $RUNS; do
    for mode in $MODES; do
      case $setup in
        six) one_run 6 "$mode" "$REQUESTS" "$CONCURRENCY" six ;;
        two) one_run 2 "$mode" $((REQUESTS / 2)) "$CONCURRENCY" two ;;
        light) one_run 6 "$mode" $((REQUESTS / 5)) "$LIGHT_CONCURRENCY" light ;;
        *) echo "disagg: unknown setup $setup (six, two, light)" >&2; exit 2 ;;
      esac
    done
  done
done
