#!/usr/bin/env bash
# One replica's user-space instructions per request while others share its Redis index: what
# the shared index (its batched writes, the feed's reads, decoding and applying them) costs a
# replica, counted by valgrind's callgrind, which a shared, noisy machine does not move
# (a build's counts still vary by a few percent run to run: count each build two or three
# times, interleaved).
#
#   deploy/perf/replica-instructions.sh LABEL [VAR=value ...]
#
# Starts the engines' mock as deploy/perf/scale_out.sh does (four engines, prefix caches), then
# REPLICAS (default 3) `python -m proxy serve` processes sharing Redis (REDIS_URL, default
# redis://127.0.0.1:6379/0) under a key prefix of their own (deleted at the end), replica 0
# under callgrind with the given environment. One load generator spreads the shared-prefix
# workload (8 prompts of ~2k tokens) round robin over all of them at CONCURRENCY (default
# 32): WARMUP requests (default 600, which also lets replica 0's copy of the index agree with
# Redis and answer lookups), then REQUESTS (default 1,200) counted. Prints
#   LABEL  <replica 0's instructions per request it served (REQUESTS / REPLICAS)>
# Callgrind slows replica 0 ~50x and the round robin paces the others to it: each of them
# flushes about once per request and replica 0's reads carry fewer entries each than at full
# speed, so per-read costs weigh more here than in scale_out.sh's runs. REPLICAS=1: one proxy
# with the same Redis index and no other writer, for the difference.
# SRC=DIR runs everything from another checkout (a `git worktree add DIR COMMIT`), for a
# before/after (PYTHON: an absolute path then). An unbuilt checkout has no compiled hot path:
# give both WARMROUTE_PURE_PYTHON=1, or copy the build's proxy/**/*.so and
# proxy/_compiled.sha256 into it (used where its hot-path sources are the ones compiled);
# stderr says which runs. PROFILE=FILE keeps callgrind's output, for `callgrind_annotate FILE`.
# Ports: the mock 9601-9604, the replicas from PORT (default 9610), their admin ports from
# PORT + 20.
set -euo pipefail
label=${1:?usage: replica-instructions.sh LABEL [VAR=value ...]}
shift
cd "${SRC:-$(dirname "$0")/../..}"  # (`python -m` imports the package from here)
for tool in valgrind callgrind_control curl; do
  command -v "$tool" >/dev/null || { echo "replica-instructions: needs $tool" >&2; exit 2; }
done
PY=${PYTHON:-python}
PORT=${PORT:-9610}
REPLICAS=${REPLICAS:-3}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
if [[ -n "${SRC:-}" ]]; then export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"; fi
$PY -c 'import proxy, sys; print("replica-instructions: runs", proxy.__file__, proxy.hot_path(),
  file=sys.stderr)'
prefix="replica-instr-$$"
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  $PY - "$REDIS_URL" "$prefix" <<'EOF' || true
import sys, redis
r = redis.Redis.from_url(sys.argv[1])
for k in r.scan_iter(f"{sys.argv[2]}:*", count=1000):
    r.delete(k)
EOF
  rm -rf "$work"
}
trap cleanup EXIT

ready() { curl -fs -o /dev/null "$1"; }
$PY -m proxy.bench.mock --port 9601 --instances 4 --chunks 16 --cache-tokens 8500 \
  --prefill-tokens-per-s 20000 >/dev/null 2>&1 &
pids+=($!)
for i in 1 2 3 4; do
  for _ in $(seq 100); do ready "http://127.0.0.1:960$i/v1/models" && break; sleep 0.1; done
done
backends=()
for i in 1 2 3 4; do backends+=(--backend "http://127.0.0.1:960$i"); done
for ((r = 0; r < REPLICAS; r++)); do
  cmd=($PY -m proxy serve "${backends[@]}" --redis "$REDIS_URL" --port $((PORT + r))
    --admin-port $((PORT + 20 + r)) --log-level warning)
  if ((r == 0)); then
    env WARMROUTE_REDIS__KEY_PREFIX="$prefix" "$@" valgrind --tool=callgrind \
      --instr-atstart=no --callgrind-out-file="$work/out" --log-file="$work/log" "${cmd[@]}" \
      >/dev/null 2>&1 &
    counted=$!
  else
    env WARMROUTE_REDIS__KEY_PREFIX="$prefix" "$@" "${cmd[@]}" >/dev/null 2>&1 &
  fi
  pids+=($!)
done
targets=()
for ((r = 0; r < REPLICAS; r++)); do
  for _ in $(seq 240); do ready "http://127.0.0.1:$((PORT + r))/ready" && break; sleep 0.5; done
  targets+=(--direct "http://127.0.0.1:$((PORT + r))")
done
bench=($PY -m proxy bench --workload shared-prefix --prefixes 8 --system-chars 8000 --zipf 0
  --concurrency "${CONCURRENCY:-32}" --max-tokens 16 --no-progress "${targets[@]}"
  --direct-affinity round-robin)
"${bench[@]}" --seed 1 --requests "${WARMUP:-600}" >/dev/null
callgrind_control -i on "$counted" >/dev/null 2>&1
"${bench[@]}" --seed 1 --requests "${REQUESTS:-1200}" >/dev/null
callgrind_control -i off "$counted" >/dev/null 2>&1
feed=$(curl -fs "http://127.0.0.1:$((PORT + 20))/admin/routing" | $PY -c '
import json, sys
i = json.load(sys.stdin)["index"]
f = i["feed"]
print("copy", i["copy_lookups"], "redis", i["lookups"], "writes", i["writes"],
      "entries", f["entries"], "own", f["own_entries"], "malformed", f["malformed"])
' || echo "no /admin/routing")
kill -INT "$counted"
wait "$counted" || true
total=$(grep -o "Collected : [0-9]*" "$work/log" | awk '{print $3}')
if [ -n "${PROFILE:-}" ]; then cp "$work/out" "$PROFILE"; fi
awk -v l="$label" -v t="$total" -v n="${REQUESTS:-1200}" -v r="$REPLICAS" -v f="$feed" \
  'BEGIN { printf "%-12s %.4f M instructions per request  (replica 0: %s)\n", l, t / (n / r) / 1e6, f }'
