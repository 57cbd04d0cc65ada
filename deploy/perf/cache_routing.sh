#!/usr/bin/env bash
# Warm-cache routing on engines that publish no cache size: warmroute's prefix_aware against
# the static-affinity bound (system prompt i on engine i mod 4, sent directly) and round robin.
#
# The engines are the bench mock in engine mode (python -m proxy.bench.mock --cache-tokens):
# serial prefill, an LRU prefix cache of its own tokenization and block size, cached_tokens in
# usage, nothing published about the cache. Every run starts on fresh engines (cold caches).
#
#   deploy/perf/cache_routing.sh                    # seeds 1-5, caches of ~3 and ~5 of 8 prompts
#   SEEDS="1 2" CACHES="8500" deploy/perf/cache_routing.sh
#   PIN=1 deploy/perf/cache_routing.sh    # the proxy on core 0, the engines and the load on core 1
#   SYSTEM_CHARS=250 CACHES="400 1000" POLICIES=prefix_aware deploy/perf/cache_routing.sh
#     # short prompts: under the eight blocks that key a placement with their user turn
#
# Prints one line per run (hit ratio, TTFT p50/p99) and writes results JSON under $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."

SEEDS="${SEEDS:-1 2 3 4 5}"
CACHES="${CACHES:-8500 14000}"     # mock tokens per engine: a 2k-token prompt is ~2.7k of them
REQUESTS="${REQUESTS:-400}"
CONCURRENCY="${CONCURRENCY:-32}"
RATE_TPS="${RATE_TPS:-20000}"      # prefill tokens/s of each engine
SYSTEM_CHARS="${SYSTEM_CHARS:-8000}"  # each of the 8 system prompts (8000 chars: ~2k tokens)
POLICIES="${POLICIES:-prefix_aware round_robin}"
OUT="${OUT:-/tmp/warmroute-cache-routing}"
PROXY_CPU=(); OTHERS_CPU=()
if [[ "${PIN:-0}" == 1 ]]; then PROXY_CPU=(taskset -c 0); OTHERS_CPU=(taskset -c 1); fi
MOCK_PORT=9301
PROXY_PORT=9300
mkdir -p "$OUT"

pids=()
cleanup() { for p in "${pids[@]:-}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_http() {
  for _ in $(seq 100); do curl -fs "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "cache_routing: $1 did not come up" >&2; return 1
}

start_mock() {
  "${OTHERS_CPU[@]}" python -m proxy.bench.mock --port "$MOCK_PORT" --instances 4 --chunks 16 \
    --cache-tokens "$1" --prefill-tokens-per-s "$RATE_TPS" >"$OUT/mock.log" 2>&1 &
  pids+=($!)
  for i in 0 1 2 3; do wait_http "http://127.0.0.1:$((MOCK_PORT + i))/v1/models"; done
}

start_proxy() {
  local backends=()
  for i in 0 1 2 3; do backends+=(--backend "http://127.0.0.1:$((MOCK_PORT + i))"); done
  "${PROXY_CPU[@]}" python -m proxy serve --port "$PROXY_PORT" --policy "$1" "${backends[@]}" \
    >"$OUT/proxy.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$PROXY_PORT/ready"
}

stop_all() { cleanup; pids=(); }

bench() {  # label, extra args...
  local label=$1; shift
  "${OTHERS_CPU[@]}" warmroute bench --workload shared-prefix --prefixes 8 --system-chars "$SYSTEM_CHARS" --zipf 0 \
    --requests "$REQUESTS" --concurrency "$CONCURRENCY" --max-tokens 16 --seed "$seed" \
    --no-progress --label "$label" --out "$OUT/$label-c$cache-s$seed.json" "$@" >/dev/null
  python - "$OUT/$label-c$cache-s$seed.json" "$label" "$cache" "$seed" <<'EOF'
import json, sys
run = json.load(open(sys.argv[1]))
runs = run.get("runs", [run])
r = runs[0]
ok = [q for q in r["requests"] if q.get("ok")]
p = sum(q.get("prompt_tokens") or 0 for q in ok)
c = sum(q.get("cached_tokens") or 0 for q in ok)
t = sorted(q["ttft"] for q in ok if q.get("ttft") is not None)
pct = lambda f: t[min(len(t) - 1, int(f * len(t)))] * 1000
print(f"cache {sys.argv[3]:>5}  seed {sys.argv[4]}  {sys.argv[2]:<15} ok {len(ok)}/{len(r['requests'])}"
      f"  hit {c / max(p, 1):6.1%}  TTFT p50 {pct(0.5):6.0f} ms  p99 {pct(0.99):6.0f} ms")
EOF
}

direct=()
for i in 0 1 2 3; do direct+=(--direct "http://127.0.0.1:$((MOCK_PORT + i))"); done
for cache in $CACHES; do
  for seed in $SEEDS; do
    start_mock "$cache"; bench static_affinity "${direct[@]}" --direct-affinity system; stop_all
    for policy in $POLICIES; do
      start_mock "$cache"; start_proxy "$policy"
      bench "$policy" --base-url "http://127.0.0.1:$PROXY_PORT"
      stop_all
    done
  done
done
