#!/usr/bin/env bash
# Scale-out: do N proxy replicas sharing Redis route as well as one proxy? One load generator
# spreads a workload round robin over N `warmroute serve` processes in front of the same
# engines; the prefix-cache hit ratio (the engines' own cached_tokens) is compared with one
# proxy on the same workload, and with N replicas that do not share Redis.
#
# The engines are the bench mock in engine mode (python -m proxy.bench.mock --cache-tokens):
# an LRU prefix cache of its own tokenization, serial prefill, nothing published about the cache,
# so every replica must learn it from responses. Every run starts on fresh engines (cold caches)
# and its own Redis key prefix.
#
#   deploy/perf/scale_out.sh                       # seed 1, 1 proxy vs 3 with/without Redis
#   SEEDS="1 2 3" REPLICAS=3 deploy/perf/scale_out.sh
#   REDIS_URL=redis://10.0.0.9:6379/0 deploy/perf/scale_out.sh
#   git archive HEAD~3 | tar -x -C /tmp/old && BASE=/tmp/old deploy/perf/scale_out.sh
#   SETUPS="1:redis 3:redis" RUNS=2 SEEDS="1 2 3" deploy/perf/scale_out.sh   # only these, twice
#   BALANCER=nginx deploy/perf/scale_out.sh        # nginx round robin in front (apt: nginx)
#   RESTART_AT=3 BALANCER=nginx deploy/perf/scale_out.sh   # replica 1 restarted 3 s into a run
#   RESTART_NICE=19 RESTART_AT=3 BALANCER=nginx ...        # ... its start at the lowest priority
#   # What N processes cost this machine with nothing shared (the control for the above):
#   # engines that prefill instantly, replicas that keep no state, the same N behind nginx
#   RATE_TPS=1000000000 WARMROUTE_ROUTING__POLICY=round_robin SETUPS="1:none 3:none 8:none" \
#     REQUESTS=12000 BALANCER=nginx deploy/perf/scale_out.sh
#
# Prints one line per run (hit ratio, of the first 50 requests too and, in runs of 2,000 or
# more, of the worst 1,000 in a row after the first 1,000; TTFT p50/p99, and the p99 of the
# steady seconds: after the first, outside RESTART_AT - 1 to + 3; the replicas' CPU per
# request, all replicas together, during the load, not counting a restarted replica's CPU
# before its stop; requests sent away from their homes (spills); with several replicas, on how many of the
# hot prompts their placements agree at the end, and the spread of their learned capacities;
# the share of prefix lookups the replicas answered from their own copy of the shared index)
# and writes results JSON under $OUT. BASE=DIR runs the proxies from another checkout of the
# source (say, `git archive` of an older commit unpacked in DIR), for a before/after.
set -euo pipefail
cd "$(dirname "$0")/../.."

SEEDS="${SEEDS:-1}"
REPLICAS="${REPLICAS:-3}"
CACHE="${CACHE:-8500}"             # mock tokens per engine: ~3 of the 8 prompts of ~2.7k each
REQUESTS="${REQUESTS:-400}"
CONCURRENCY="${CONCURRENCY:-32}"
RATE_TPS="${RATE_TPS:-20000}"      # prefill tokens/s of each engine
REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/0}"
OUT="${OUT:-/tmp/warmroute-scale-out}"
SETUPS="${SETUPS:-1:redis $REPLICAS:redis $REPLICAS:none 1:none}"  # proxies:redis|none
RUNS="${RUNS:-1}"                  # times each seed is run (alternating with the others)
BALANCER="${BALANCER:-client}"     # client: the load generator round-robins; nginx: nginx does
RESTART_AT="${RESTART_AT:-}"       # seconds into each multi-replica run: replica 1 is stopped
                                   # (SIGTERM, drained) and started again; empty: never
RESTART_NICE="${RESTART_NICE:-}"   # the restarted replica's niceness until /ready (say 19; back
                                   # to 0 then, which needs root): its start (~0.6 s of CPU) takes
                                   # no CPU the serving replicas need, as a pod starting on CPU of
                                   # its own would not; empty: started as the others were
MOCK_PORT=9401
NGINX_PORT=9460
PROXY_PORT=9410
ADMIN_PORT=9430
if [[ -n "${BASE:-}" ]]; then export PYTHONPATH="$BASE${PYTHONPATH:+:$PYTHONPATH}"; fi
# Bytecode cached as an installed package has it (pip compiles it at install; the image runs
# from that): a shell with PYTHONDONTWRITEBYTECODE set would have each replica, the restarted
# one included, compile the source again at every start (~0.15 s of CPU on this machine).
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-$OUT/pycache}"
mkdir -p "$OUT"

pids=()
cleanup() {
  if [[ -f "$OUT/restarted.pid" ]]; then pids+=("$(cat "$OUT/restarted.pid")"); rm -f "$OUT/restarted.pid"; fi
  for p in "${pids[@]:-}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

wait_http() {
  for _ in $(seq 150); do curl -fs "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "scale_out: $1 did not come up" >&2; return 1
}

start_mock() {
  python -m proxy.bench.mock --port "$MOCK_PORT" --instances 4 --chunks 16 \
    --cache-tokens "$CACHE" --prefill-tokens-per-s "$RATE_TPS" >"$OUT/mock.log" 2>&1 &
  pids+=($!)
  for i in 0 1 2 3; do wait_http "http://127.0.0.1:$((MOCK_PORT + i))/v1/models"; done
}

replica_pids=()
start_replica() {  # index, redis url or "", niceness or ""
  local r=$1 redis=$2 niceness=${3:-} backends=() extra=() lower=()
  for i in 0 1 2 3; do backends+=(--backend "http://127.0.0.1:$((MOCK_PORT + i))"); done
  if [[ -n "$redis" ]]; then extra=(--redis "$redis"); fi
  if [[ -n "$niceness" ]]; then lower=(nice -n "$niceness"); fi
  WARMROUTE_REDIS__KEY_PREFIX="scale-out-$$-$run" "${lower[@]}" warmroute serve \
    --port $((PROXY_PORT + r)) --admin-port $((ADMIN_PORT + r)) --log-level warning \
    "${backends[@]}" "${extra[@]}" >>"$OUT/proxy-$r.log" 2>&1 &
  pids+=($!)
  replica_pids[r]=$!
}

start_proxies() {  # count, redis url or "" (each replica its own in-memory index)
  local count=$1 redis=$2
  for ((r = 0; r < count; r++)); do start_replica "$r" "$redis"; done
  for ((r = 0; r < count; r++)); do wait_http "http://127.0.0.1:$((PROXY_PORT + r))/ready"; done
}

restart_replica() {  # seconds to wait, redis url or "": replica 1 stopped and started again
  # (in the background: the new pid goes through a file, picked up by bench)
  local old=${replica_pids[1]}
  sleep "$1"
  kill -TERM "$old" 2>/dev/null || true
  while kill -0 "$old" 2>/dev/null; do sleep 0.05; done
  start_replica 1 "$2" "$RESTART_NICE"
  echo "${replica_pids[1]}" >"$OUT/restarted.pid"
  wait_http "http://127.0.0.1:$((PROXY_PORT + 1))/ready"
  if [[ -n "$RESTART_NICE" ]]; then  # serving, it runs at the others' priority again
    renice -n 0 -p "${replica_pids[1]}" >/dev/null ||
      echo "scale_out: could not renice replica 1 (needs root); it serves at $RESTART_NICE" >&2
  fi
  echo "run $run: replica 1 restarted ${1}s in" >>"$OUT/restarts.log"
}

start_nginx() {  # count: one upstream of every replica, round robin, kept-alive connections
  local count=$1 servers=""
  for ((r = 0; r < count; r++)); do servers+="    server 127.0.0.1:$((PROXY_PORT + r));"$'\n'; done
  mkdir -p "$OUT/nginx"
  cat >"$OUT/nginx/nginx.conf" <<CONF
daemon off;
worker_processes 1;
pid $OUT/nginx/nginx.pid;
error_log $OUT/nginx/error.log warn;
events { worker_connections 1024; }
http {
  access_log off;
  upstream replicas {
$servers    keepalive 64;
  }
  server {
    listen 127.0.0.1:$NGINX_PORT;
    location / {
      proxy_pass http://replicas;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      # A replica stopping (RESTART_AT) closes its idle kept-alive connections; a request nginx
      # sent on one at that moment is reset unread: try it on another replica.
      proxy_next_upstream error timeout non_idempotent;
      proxy_read_timeout 300s;
    }
  }
}
CONF
  nginx -c "$OUT/nginx/nginx.conf" -p "$OUT/nginx" >"$OUT/nginx/stdout.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$NGINX_PORT/ready"
}

stop_all() { cleanup; pids=(); }

proxy_cpu() {  # count: CPU ticks the replicas have used so far (utime + stime)
  local total=0 r stat
  for ((r = 0; r < $1; r++)); do
    stat=$(cat "/proc/${replica_pids[r]}/stat" 2>/dev/null) || continue
    stat=${stat##*) }  # the fields after the command name
    read -r -a f <<<"$stat"
    total=$((total + f[11] + f[12]))
  done
  echo "$total"
}

bench() {  # label, proxy count
  local label=$1 count=$2 targets=()
  if [[ $BALANCER == nginx ]]; then
    targets=(--direct "http://127.0.0.1:$NGINX_PORT")
  else
    for ((r = 0; r < count; r++)); do targets+=(--direct "http://127.0.0.1:$((PROXY_PORT + r))"); done
  fi
  # --direct repeated, round-robin: one load generator in front of every replica.
  local restarter=""
  if [[ -n "$RESTART_AT" && $count -gt 1 ]]; then
    restart_replica "$RESTART_AT" "$redis_now" &
    restarter=$!
  fi
  local cpu0; cpu0=$(proxy_cpu "$count")
  warmroute bench --workload shared-prefix --prefixes 8 --system-chars 8000 --zipf 0 \
    --requests "$REQUESTS" --concurrency "$CONCURRENCY" --max-tokens 16 --seed "$seed" \
    --no-progress --label "$label" --out "$OUT/$label-s$seed-r$pass.json" "${targets[@]}" \
    --direct-affinity round-robin >/dev/null
  if [[ -n "$restarter" ]]; then
    wait "$restarter" || true
    replica_pids[1]=$(cat "$OUT/restarted.pid")
    pids+=("${replica_pids[1]}")
    rm -f "$OUT/restarted.pid"
  fi
  local cpu_s; cpu_s=$(( $(proxy_cpu "$count") - cpu0 ))
  python - "$OUT/$label-s$seed-r$pass.json" "$label" "$seed" "$pass" "$cpu_s" "$(getconf CLK_TCK)" \
    "${RESTART_AT:-}" <<'EOF'
import json, sys
run = json.load(open(sys.argv[1]))
r = run.get("runs", [run])[0]
ok = [q for q in r["requests"] if q.get("ok")]
p = sum(q.get("prompt_tokens") or 0 for q in ok)
c = sum(q.get("cached_tokens") or 0 for q in ok)
early = ok[:50]  # the cold start: the first burst reaches every replica before an exchange
p50 = sum(q.get("prompt_tokens") or 0 for q in early)
c50 = sum(q.get("cached_tokens") or 0 for q in early)
t = sorted(q["ttft"] for q in ok if q.get("ttft") is not None)
pct = lambda f: t[min(len(t) - 1, int(f * len(t)))] * 1000
# The worst 1,000 requests in a row after the first 1,000 (a restarted replica's dip shows here).
hits = [((q.get("cached_tokens") or 0), (q.get("prompt_tokens") or 0)) for q in ok[1000:]]
worst = min((sum(h[0] for h in hits[i:i + 1000]) / max(sum(h[1] for h in hits[i:i + 1000]), 1)
             for i in range(0, max(len(hits) - 999, 1), 100)), default=0.0)
cpu_ms = int(sys.argv[5]) / int(sys.argv[6]) * 1000 / max(len(r["requests"]), 1)
# Steady: requests sent after the first second (cold caches, a first placement) and outside
# the seconds around a restart (RESTART_AT - 1 to + 3), the same seconds left out of every run.
at = float(sys.argv[7]) if sys.argv[7] else None
steady = sorted(q["ttft"] for q in ok if q.get("ttft") is not None and q["start"] >= 1
                and (at is None or not at - 1 <= q["start"] < at + 3))
sp99 = steady[min(len(steady) - 1, int(0.99 * len(steady)))] * 1000 if steady else float("nan")
print(f"seed {sys.argv[3]} run {sys.argv[4]}  {sys.argv[2]:<18} ok {len(ok)}/{len(r['requests'])}"
      f"  hit {c / max(p, 1):6.1%} (first 50 {c50 / max(p50, 1):5.1%}"
      f"{f', worst 1k {worst:5.1%}' if len(ok) >= 2000 else ''})"
      f"  TTFT p50 {pct(0.5):6.0f} ms  p99 {pct(0.99):6.0f} ms (steady {sp99:.0f})"
      f"  proxy CPU {cpu_ms:.2f} ms/req", end="")
EOF
  agreement "$count" "$OUT/$label-s$seed-r$pass-admin.json"
}

agreement() {  # proxy count, file: where the hot prompts live; do the replicas' views agree?
  # (every replica's /admin/routing at the end of the run goes to the file, for a post-mortem)
  local count=$1 save=$2 urls=()
  for ((r = 0; r < count; r++)); do urls+=("http://127.0.0.1:$((ADMIN_PORT + r))/admin/routing"); done
  python - "$save" "${urls[@]}" <<'EOF'
import json, sys, urllib.request
save, urls = sys.argv[1], sys.argv[2:]
infos = [json.load(urllib.request.urlopen(u, timeout=5)) for u in urls]
json.dump(infos, open(save, "w"), indent=1)
# Requests sent away from their prompt's homes because every home was over the load bound
# (each a cold prefill, and an eviction where that engine's cache is full): the decisions
# counted by reason on each replica's /metrics.
spills = 0
for u in urls:
    text = urllib.request.urlopen(u.replace("/admin/routing", "/metrics"), timeout=5).read()
    for line in text.decode().splitlines():
        if line.startswith("warmroute_route_decisions") and "load over affinity" in line:
            spills += int(float(line.rsplit(" ", 1)[1]))
# (a policy that places nothing, round_robin say, has no placement: no homes to compare)
views = [{h["prefix"]: tuple(sorted(h["homes"]))
          for h in i.get("cache", {}).get("placement", {}).get("hottest", [])[:8]}
         for i in infos]
per = {}
for homes in views[0].values():
    for b in homes:
        per[b] = per.get(b, 0) + 1
layout = "/".join(map(str, sorted(per.values(), reverse=True)))
idx = [i.get("index", {}) for i in infos]
copy = sum(x.get("copy_lookups", 0) for x in idx)
asked = copy + sum(x.get("lookups", 0) + x.get("fallback_lookups", 0) for x in idx)
answered = f"  from the copy {copy / asked:4.0%}" if "copy_lookups" in idx[0] and asked else ""
if len(infos) < 2:
    print(f"  prompts per engine {layout}  spills {spills}{answered}")
    sys.exit()
hot = set(views[0])
same = sum(1 for k in hot if all(v.get(k) == views[0][k] for v in views[1:]))
caps = {}
for i in infos:
    for b, est in i.get("cache", {}).get("backends", {}).items():
        caps.setdefault(b, []).append(est["capacity_blocks"])
spread = max(max(v) / max(min(v), 1) for v in caps.values()) if caps else 1.0
print(f"  prompts per engine {layout}  spills {spills}  homes agree {same}/{len(hot)}"
      f"  capacity spread x{spread:.1f}"
      f"{answered}")
EOF
}

drop_keys() {  # redis url, key prefix: a run's keys, so that Redis does not grow run by run
  # (each run has its own prefix: its index, feed and placement would stay for their TTLs,
  # half an hour; a session of runs left Redis holding 200 MB)
  python - "$1" "$2" <<'EOF'
import sys
import redis
client = redis.Redis.from_url(sys.argv[1])
keys = list(client.scan_iter(match=sys.argv[2] + ":*", count=1000))
for i in range(0, len(keys), 500):
    client.delete(*keys[i : i + 500])
EOF
}

run=0
for ((pass = 1; pass <= RUNS; pass++)); do
  for seed in $SEEDS; do
    for setup in $SETUPS; do
      count=${setup%%:*} store=${setup#*:}
      run=$((run + 1))
      start_mock
      redis_now="$([[ $store == redis ]] && echo "$REDIS_URL" || true)"
      start_proxies "$count" "$redis_now"
      if [[ $BALANCER == nginx ]]; then start_nginx "$count"; fi
      bench "${count}-proxy-${store}" "$count"
      stop_all
      if [[ -n "$redis_now" ]]; then drop_keys "$redis_now" "scale-out-$$-$run"; fi
    done
  done
done
