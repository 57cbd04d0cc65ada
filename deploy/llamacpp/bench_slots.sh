#!/usr/bin/env bash
# Slot engines (issue 28): warmroute's prefix_aware against the static-affinity bound on
# llama.cpp engines whose cache is their slots (2 engines of 2 slots, 4 system prompts).
#
# The bound sends system prompt i straight to engine i mod 2 (`warmroute bench --direct ...
# --direct-affinity system`); prefix_aware goes through warmroute. Every run starts on fresh
# engines with the same seeded workload. The client opens a connection per request
# (--close-connections): llama-server closes its connection after a streamed response, and a
# client that reuses it fails the next request (a third of the bound's requests did). One line per run: the engines' own prefix-cached
# share (llamacpp:prompt_tokens_cached_total over all prompt tokens, summed over both
# engines) and the clients' mean TTFT; then, per (host cache, concurrency, seed), warmroute
# over the bound.
#
#   deploy/llamacpp/bench_slots.sh                      # ~25 min on 2 cores
#   SEEDS="1" CONCURRENCIES="2" HOST_CACHES="off" deploy/llamacpp/bench_slots.sh
#
# Knobs (environment): SEEDS (1 2 3), CONCURRENCIES (2 4), HOST_CACHES ("off on": --cache-ram
# 0, or CACHE_RAM MiB, default 256), POLICIES (static_affinity prefix_aware), REQUESTS (120),
# PREFIXES (4), ZIPF_S (popularity exponent; the bench's default, 1.1), SYSTEM_CHARS (6000), CTX (8192), PARALLEL (2), MAX_TOKENS (8), THREADS (1),
# OUT (results directory), PYTHON (interpreter with warmroute), PROXY_TREE (serve the proxy
# from another source tree, e.g. `git archive <commit> | tar -x -C /tmp/old`, to compare builds).
set -euo pipefail
cd "$(dirname "$0")/../.."

SEEDS="${SEEDS:-1 2 3}"
CONCURRENCIES="${CONCURRENCIES:-2 4}"
HOST_CACHES="${HOST_CACHES:-off on}"
POLICIES="${POLICIES:-static_affinity prefix_aware}"
CACHE_RAM="${CACHE_RAM:-256}"
REQUESTS="${REQUESTS:-120}"
PREFIXES="${PREFIXES:-4}"
ZIPF=()
[[ -n "${ZIPF_S:-}" ]] && ZIPF=(--zipf "$ZIPF_S")
SYSTEM_CHARS="${SYSTEM_CHARS:-6000}"
CTX="${CTX:-8192}"
PARALLEL="${PARALLEL:-2}"
MAX_TOKENS="${MAX_TOKENS:-8}"
THREADS="${THREADS:-1}"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-$(mktemp -d -t warmroute-bench-slots.XXXXXX)}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# Absolute (not resolved: a venv's python is a link that must stay inside the venv), as the
# proxy may be served from another directory.
[[ $PYTHON == */* ]] && PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")"

log() { printf '[bench-slots] %s\n' "$*" >&2; }

# shellcheck source=deploy/llamacpp/common.sh
. deploy/llamacpp/common.sh

start_engines() {  # host cache (off|on); sets urls
  local ram=0 port
  [[ $1 == on ]] && ram=$CACHE_RAM
  urls=()
  for _ in 1 2; do
    port=$(free_port)
    "$BIN" -m "$MODEL" --host 127.0.0.1 --port "$port" -a tiny -c "$CTX" --parallel "$PARALLEL" \
      -t "$THREADS" --metrics --no-webui --cache-ram "$ram" >"$OUT/llama-$port.log" 2>&1 &
    PIDS+=($!)
    wait_http "http://127.0.0.1:$port/health" $!
    urls+=("http://127.0.0.1:$port")
  done
}

start_proxy() {  # sets proxy
  local config="$OUT/warmroute.yaml" url pport
  pport=$(free_port)
  {
    echo "backends:"
    for url in "${urls[@]}"; do printf '  - {url: %s, engine: llamacpp}\n' "$url"; done
    echo "routing: {policy: prefix_aware}"
    echo "server: {port: $pport, admin_port: $pport}"  # /admin/routing on loopback
  } >"$config"
  (cd "${PROXY_TREE:-.}" && exec "$PYTHON" -m proxy serve --config "$config" --log-level warning) \
    >>"$OUT/warmroute.log" 2>&1 &
  PIDS+=($!)
  wait_http "http://127.0.0.1:$pport/ready" $!
  proxy="http://127.0.0.1:$pport"
}

engine_share() {  # the engines' cached share of all prompt tokens, summed
  local cached=0 prefilled=0 url m
  for url in "${urls[@]}"; do
    m=$(curl -fsS "$url/metrics")
    cached=$((cached + $(awk '/^llamacpp:prompt_tokens_cached_total /{printf "%d", $2}' <<<"$m")))
    prefilled=$((prefilled + $(awk '/^llamacpp:prompt_tokens_total /{printf "%d", $2}' <<<"$m")))
  done
  awk -v c="$cached" -v f="$prefilled" 'BEGIN { printf "%.4f", (c + f) ? c / (c + f) : 0 }'
}

mean_ttft() {  # bench JSON -> mean TTFT (s) of the requests that succeeded
  "$PYTHON" - "$1" <<'EOF'
import json, sys
run = json.load(open(sys.argv[1]))
r = run.get("runs", [run])[0]
t = [q["ttft"] for q in r["requests"] if q.get("ok") and q.get("ttft") is not None]
print(f"{sum(t) / max(len(t), 1):.4f}")
EOF
}

results="$OUT/results.tsv"
printf 'host_cache\tconcurrency\tseed\tpolicy\tcached_share\tmean_ttft_s\n' >"$results"
for host in $HOST_CACHES; do
  for conc in $CONCURRENCIES; do
    for seed in $SEEDS; do
      for policy in $POLICIES; do
        start_engines "$host"
        target=()
        if [[ $policy == static_affinity ]]; then
          target=(--direct "${urls[0]}" --direct "${urls[1]}" --direct-affinity system)
        else
          start_proxy
          target=(--base-url "$proxy")
        fi
        run="$OUT/$policy-$host-c$conc-s$seed"
        warmroute bench "${target[@]}" --label "$policy" --workload shared-prefix \
          --prefixes "$PREFIXES" --system-chars "$SYSTEM_CHARS" "${ZIPF[@]}" --requests "$REQUESTS" \
          --concurrency "$conc" --max-tokens "$MAX_TOKENS" --seed "$seed" \
          --extra-body '{"temperature": 0, "ignore_eos": true}' --close-connections \
          --out "$run.json" --no-progress >"$run.txt" || rc=$?
        [[ ${rc:-0} -le 1 ]] || { log "bench failed (exit $rc); see $OUT"; exit "$rc"; }
        unset rc
        share=$(engine_share)
        ttft=$(mean_ttft "$run.json")
        [[ $policy == static_affinity ]] || curl -fsS "$proxy/admin/routing" >"$run.routing.json" 2>/dev/null || true
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$host" "$conc" "$seed" "$policy" "$share" "$ttft" \
          | tee -a "$results"
        stop_all
      done
    done
  done
done

echo
echo "| host cache | clients | seed | static: cached, mean TTFT | prefix_aware: cached, mean TTFT | cached / static | TTFT / static |"
echo "|---|---:|---:|---|---|---:|---:|"
awk -F'\t' 'NR > 1 { k = $1 "\t" $2 "\t" $3; s[k, $4] = $5; t[k, $4] = $6; if (!(k in seen)) { seen[k] = 1; keys[++n] = k } }
  END { for (i = 1; i <= n; i++) { k = keys[i]; split(k, f, "\t")
    sa = s[k, "static_affinity"]; ta = t[k, "static_affinity"]; sp = s[k, "prefix_aware"]; tp = t[k, "prefix_aware"]
    rs = "-"; if (sa > 0) rs = sprintf("%.3f", sp / sa)
    rt = "-"; if (ta > 0) rt = sprintf("%.3f", tp / ta)
    printf "| %s | %s | %s | %.1f%%, %.0f ms | %.1f%%, %.0f ms | %s | %s |\n", f[1], f[2], f[3],
      100 * sa, 1000 * ta, 100 * sp, 1000 * tp, rs, rt } }' "$results"
log "results, configs and logs in $OUT"
