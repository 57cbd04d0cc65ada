#!/usr/bin/env bash
# Routing policies on real engines: `warmroute bench` through warmroute in front of freshly
# started llama.cpp `llama-server` instances (CPU, the tiny model), once per policy.
#
# Every policy gets its own cold engines and the same seeded workload (byte-identical
# prompts), so the only difference between the runs is where warmroute sent each request.
# Prints the bench table and, per policy, the engines' own prompt-cache counters (the
# referee for the hit ratio the clients saw in usage.prompt_tokens_details.cached_tokens).
#
#   deploy/llamacpp/bench_policies.sh                       # ~3-4 minutes on 2 cores
#   POLICIES="round_robin prefix_aware" REQUESTS=100 deploy/llamacpp/bench_policies.sh
#
# Knobs (environment): POLICIES, ENGINES (instances, default 2), THREADS (per instance, 1),
# CTX (total context per instance, 8192), PARALLEL (slots per instance, 2), REQUESTS (120),
# CONCURRENCY (2), PREFIXES (4), SYSTEM_CHARS (6000), MAX_TOKENS (8), SEED (0),
# OUT (results directory, default a new temp dir), PYTHON (interpreter with warmroute),
# PROXY_TREE (a checkout whose proxy to run, e.g. `git archive <commit>` built in place with
# `python setup.py build_ext --inplace`: two builds on the same engines and prompts).
set -euo pipefail
cd "$(dirname "$0")/../.."

POLICIES="${POLICIES:-round_robin least_inflight prefix_aware}"
ENGINES="${ENGINES:-2}"
THREADS="${THREADS:-1}"
CTX="${CTX:-8192}"
PARALLEL="${PARALLEL:-2}"
REQUESTS="${REQUESTS:-120}"
CONCURRENCY="${CONCURRENCY:-2}"
PREFIXES="${PREFIXES:-4}"
SYSTEM_CHARS="${SYSTEM_CHARS:-6000}"
MAX_TOKENS="${MAX_TOKENS:-8}"
SEED="${SEED:-0}"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-$(mktemp -d -t warmroute-bench-policies.XXXXXX)}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the proxy may start in PROXY_TREE

log() { printf '[bench-policies] %s\n' "$*" >&2; }

# shellcheck source=deploy/llamacpp/common.sh
. deploy/llamacpp/common.sh

engine_cache_line() {  # policy url...: the engines' own prompt-cache counters, summed
  local policy=$1; shift
  local cached=0 prefilled=0 url m
  for url in "$@"; do
    m=$(curl -fsS "$url/metrics")
    cached=$((cached + $(awk '/^llamacpp:prompt_tokens_cached_total /{printf "%d", $2}' <<<"$m")))
    prefilled=$((prefilled + $(awk '/^llamacpp:prompt_tokens_total /{printf "%d", $2}' <<<"$m")))
  done
  awk -v p="$policy" -v c="$cached" -v f="$prefilled" 'BEGIN {
    printf "| %s | %d | %d | %.1f%% |\n", p, c, f, (c + f) ? 100 * c / (c + f) : 0 }'
}

{
  echo "| policy | engine cached prompt tokens | engine prefilled prompt tokens | engine hit ratio |"
  echo "|---|---:|---:|---:|"
} >"$OUT/engines.md"

for policy in $POLICIES; do
  log "policy $policy: starting $ENGINES fresh llama-server instances"
  urls=()
  for _ in $(seq "$ENGINES"); do
    port=$(free_port)
    "$BIN" -m "$MODEL" --host 127.0.0.1 --port "$port" -a tiny -c "$CTX" --parallel "$PARALLEL" \
      -t "$THREADS" --metrics --no-webui --cache-ram 0 >"$OUT/llama-$policy-$port.log" 2>&1 &
    PIDS+=($!)
    wait_http "http://127.0.0.1:$port/health" $!
    urls+=("http://127.0.0.1:$port")
  done

  config="$OUT/warmroute-$policy.yaml"
  {
    echo "backends:"
    for url in "${urls[@]}"; do printf '  - {url: %s, engine: llamacpp}\n' "$url"; done
    printf 'routing: {policy: %s}\n' "$policy"
  } >"$config"
  pport=$(free_port)
  # exec: the pid kept is the proxy's own, so stop_all stops it (a backgrounded shell
  # function's pid is its subshell's, and the proxy outlived the script).
  (cd "${PROXY_TREE:-.}" && exec "$PYTHON" -m proxy serve --config "$config" --port "$pport" \
    --log-level warning) >"$OUT/warmroute-$policy.log" 2>&1 &
  PIDS+=($!)
  wait_http "http://127.0.0.1:$pport/health" $!

  log "policy $policy: warmroute on :$pport -> ${urls[*]}; running the workload"
  warmroute bench --base-url "http://127.0.0.1:$pport" --label "$policy" \
    --workload shared-prefix --prefixes "$PREFIXES" --system-chars "$SYSTEM_CHARS" \
    --requests "$REQUESTS" --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" \
    --seed "$SEED" --extra-body '{"temperature": 0, "ignore_eos": true}' \
    --out "$OUT/$policy.json" --no-progress >"$OUT/$policy.txt" || rc=$?
  # 1 = some requests failed: they are counted in the table's "errors" row; keep going.
  [[ ${rc:-0} -le 1 ]] || { log "bench failed (exit $rc); see $OUT"; exit "$rc"; }
  unset rc
  engine_cache_line "$policy" "${urls[@]}" >>"$OUT/engines.md"
  curl -fsS "http://127.0.0.1:$pport/metrics" >"$OUT/warmroute-$policy.prom" || true
  stop_all
done

results=()
for policy in $POLICIES; do results+=("$OUT/$policy.json"); done
warmroute bench report "${results[@]}" --out-md "$OUT/table.md" >/dev/null
echo
echo "## warmroute bench through warmroute (client view)"
cat "$OUT/table.md"
echo
echo "## The engines' own counters (llama.cpp /metrics, summed over instances)"
cat "$OUT/engines.md"
echo
log "results, configs and logs in $OUT"
