#!/usr/bin/env bash
# The prefill/decode pool split on real engines: chat streams beside long documents through
# warmroute in front of two freshly started llama.cpp `llama-server` instances (CPU, the tiny
# model), with `disagg.mode: off` (both engines take both kinds) and `on` (one engine for the
# documents, one for the chat streams). llama.cpp moves no KV cache between instances, so this
# is the pool split only: a document's prefill no longer shares a batch with chat streams.
#
# Each mode gets its own cold engines and the same seeded chat-docs workload, scaled down for a
# CPU (documents of ~DOC_CHARS characters, short answers), so the only difference between the
# runs is where warmroute sent each request. The chat streams' ITL p99 is reported whichever
# way it comes out: with two engines the split also halves the capacity each kind gets.
#
#   deploy/llamacpp/bench_disagg.sh                          # seed 0, ~1-2 minutes on 2 cores
#   SEEDS="0 1 2" REQUESTS=200 deploy/llamacpp/bench_disagg.sh
#
# Knobs (environment): SEEDS (0), REQUESTS (120), CONCURRENCY (4), THREADS (per instance, 1),
# CTX (total context per instance, 8192), PARALLEL (slots per instance, 2), DOC_CHARS (8000),
# SYSTEM_CHARS (1000), MAX_TOKENS (64, chat answers), DOC_MAX_TOKENS (8), THRESHOLD_TOKENS
# (disagg.threshold_tokens, 1024), OUT (results directory, default a new temp dir), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/../.."

SEEDS="${SEEDS:-0}"
REQUESTS="${REQUESTS:-120}"
CONCURRENCY="${CONCURRENCY:-4}"
THREADS="${THREADS:-1}"
CTX="${CTX:-8192}"
PARALLEL="${PARALLEL:-2}"
DOC_CHARS="${DOC_CHARS:-8000}"
SYSTEM_CHARS="${SYSTEM_CHARS:-1000}"
MAX_TOKENS="${MAX_TOKENS:-64}"
DOC_MAX_TOKENS="${DOC_MAX_TOKENS:-8}"
THRESHOLD_TOKENS="${THRESHOLD_TOKENS:-1024}"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-$(mktemp -d -t warmroute-bench-disagg.XXXXXX)}"
mkdir -p "$OUT"

log() { printf '[bench-disagg] %s\n' "$*" >&2; }

# shellcheck source=deploy/llamacpp/common.sh
. deploy/llamacpp/common.sh

results=()
for seed in $SEEDS; do
  for mode in off on; do
    label="$mode-s$seed"
    log "$label: starting 2 fresh llama-server instances"
    urls=()
    for _ in 1 2; do
      port=$(free_port)
      "$BIN" -m "$MODEL" --host 127.0.0.1 --port "$port" -a tiny -c "$CTX" --parallel "$PARALLEL" \
        -t "$THREADS" --metrics --no-webui --cache-ram 0 >"$OUT/llama-$label-$port.log" 2>&1 &
      PIDS+=($!)
      wait_http "http://127.0.0.1:$port/health" $!
      urls+=("http://127.0.0.1:$port")
    done

    config="$OUT/warmroute-$label.yaml"
    {
      echo "backends:"
      for url in "${urls[@]}"; do printf '  - {url: %s, engine: llamacpp}\n' "$url"; done
      echo "disagg:"
      echo "  mode: $mode"
      echo "  threshold_tokens: $THRESHOLD_TOKENS"
    } >"$config"
    pport=$(free_port)
    aport=$(free_port)
    # exec: the pid kept is the proxy's own, so stop_all stops it (see bench_policies.sh).
    (exec "$PYTHON" -m proxy serve --config "$config" --port "$pport" --admin-port "$aport" \
      --log-level info) >"$OUT/warmroute-$label.log" 2>&1 &
    PIDS+=($!)
    wait_http "http://127.0.0.1:$pport/ready" $!

    log "$label: warmroute on :$pport -> ${urls[*]}; running chat-docs"
    warmroute bench --base-url "http://127.0.0.1:$pport" --label "$label" --workload chat-docs \
      --doc-chars "$DOC_CHARS" --system-chars "$SYSTEM_CHARS" --max-tokens "$MAX_TOKENS" \
      --doc-max-tokens "$DOC_MAX_TOKENS" --requests "$REQUESTS" --concurrency "$CONCURRENCY" \
      --seed "$seed" --extra-body '{"temperature": 0, "ignore_eos": true}' \
      --out "$OUT/$label.json" --no-progress >"$OUT/$label.txt" || rc=$?
    # 1 = some requests failed: they are counted in the table's "errors" row; keep going.
    [[ ${rc:-0} -le 1 ]] || { log "bench failed (exit $rc); see $OUT"; exit "$rc"; }
    unset rc
    curl -fsS "http://127.0.0.1:$aport/admin/disagg" >"$OUT/$label-disagg.json"
    stop_all
    results+=("$OUT/$label.json")
  done
done

echo "## chat-docs through warmroute on two llama-server instances (client view)"
echo
"$PYTHON" - "$OUT" "${results[@]}" <<'EOF'
import json, sys
from pathlib import Path
from proxy.stats import percentile

def p(values, q):
    return f"{percentile(sorted(values), q) * 1000:.1f}" if values else "-"

print("| run | ok/sent | chat ITL p50 (ms) | chat ITL p99 (ms) | chat TTFT p50 (ms) "
      "| doc TTFT p50 / p99 (ms) | output tok/s | where the proxy sent them |")
print("|---|---:|---:|---:|---:|---:|---:|---|")
for path in sys.argv[2:]:
    run = json.load(open(path))["runs"][0]
    state = json.load(open(Path(path).with_name(Path(path).stem + "-disagg.json")))
    ok = [r for r in run["requests"] if r["ok"]]
    chat = [r for r in ok if r["kind"] == "chat"]
    docs = [r for r in ok if r["kind"] == "doc"]
    itl = [g for r in chat for g in r["itl"]]
    out = sum(r["completion_tokens"] or r["output_chunks"] for r in ok) / run["duration"]
    sent = ", ".join(f"{k} {v}" for k, v in sorted(state.get("requests", {}).items())) or "-"
    pools = state.get("pools")
    if pools:
        sent += f" (prefill pool {pools['prefill']}, decode pool {pools['decode']})"
    print(f"| {run['label']} | {len(ok)}/{len(run['requests'])} | {p(itl, .5)} | {p(itl, .99)} "
          f"| {p([r['ttft'] for r in chat if r['ttft']], .5)} "
          f"| {p([r['ttft'] for r in docs if r['ttft']], .5)} / "
          f"{p([r['ttft'] for r in docs if r['ttft']], .99)} | {out:.1f} | {sent} |")
EOF
echo
warmroute bench report "${results[@]}" --out-md "$OUT/table.md" >/dev/null
echo "## The bench table (per-kind rows: chat, doc)"
cat "$OUT/table.md"
echo
log "results, configs and logs in $OUT"
