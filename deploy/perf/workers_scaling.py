#!/usr/bin/env python3
"""Does `warmroute serve --workers N` scale CPU-bound throughput on this box?

The proxy is made the bottleneck: its backend is nginx answering every chat completion from
memory with a fixed 16-chunk SSE stream (`return 200`: a few microseconds of C a request), and
the load is wrk (C, one thread) at CONCURRENCY kept-alive connections posting one small
streamed chat request. Neither leaves the proxy's core to anything but the proxy, as the
Python bench mock and load generator would (each about a core of its own at these rates).
For each N in WORKERS, a fresh `warmroute serve --workers N` (defaults: prefix_aware, metrics
on) is warmed for WARM_S seconds and then measured for MEASURE_S: requests per second (wrk's
count of complete responses), the proxy's CPU (utime + stime of every process of its session:
the supervisor and its workers) and that CPU per request. Direct to nginx once, for scale.

  deploy/perf/workers_scaling.py                 # WORKERS="1 2", 64 connections, 10 s each
  WORKERS="1 2 4" ROUNDS=2 deploy/perf/workers_scaling.py
  PROXIES="warmroute nginx sglang-router vllm-router" deploy/perf/workers_scaling.py

PROXIES adds other proxies in front of the same backend, each once a round after warmroute's
runs (deploy/perf/paced_chunks.py starts them: nginx as a plain streaming reverse proxy, the
SGLang and vLLM routers from their pip wheels, round robin; each uses the threads it starts,
both cores for the Rust routers), for their requests per second and CPU per request beside
warmroute's in one run.

Needs nginx and wrk (`apt-get install nginx wrk`). Environment: WORKERS ("1 2"), ROUNDS (1:
each round runs every N in turn), CONCURRENCY (64), WARM_S (3), MEASURE_S (10), NGINX, WRK
(paths, default on PATH), OUT (/tmp/warmroute-workers: results JSON). On a 2-core machine N=2
can at most double: nginx and wrk take a share of the same cores, so read the ratio, not the
absolute rate.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "perf"))
sys.path.insert(0, str(ROOT))

from idle_cpu import stop, wait_ready  # noqa: E402
from paced_chunks import NGINX_PRELUDE, _command, session_cpu_s  # noqa: E402

from proxy.demo.stack import free_ports  # noqa: E402

CHUNK = '{"id":"c","object":"chat.completion.chunk","created":0,"model":"mock","choices":[{"index":0,"delta":{"content":"tok "},"finish_reason":null}]}'  # noqa: E501
USAGE = '{"id":"c","object":"chat.completion.chunk","created":0,"model":"mock","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":16,"total_tokens":56}}'  # noqa: E501
BODY = "".join(f"data: {CHUNK}\\n\\n" for _ in range(16)) + f"data: {USAGE}\\n\\ndata: [DONE]\\n\\n"

NGINX_CONF = (
    NGINX_PRELUDE
    + """  keepalive_requests 1000000;
  server {{
    listen 127.0.0.1:{port};
    location = /health {{ return 200 "ok"; }}
    location = /v1/models {{
      default_type application/json;
      return 200 '{{"object":"list","data":[{{"id":"mock","object":"model"}}]}}';
    }}
    location = /v1/chat/completions {{
      client_body_buffer_size 64k;
      default_type text/event-stream;
      return 200 '{body}';
    }}
  }}
}}
"""
)

WRK_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"mock","stream":true,"messages":[{"role":"system","content":"You are a helpful assistant. Answer briefly."},{"role":"user","content":"What is a KV cache?"}]}'
"""  # noqa: E501


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def wrk(url: str, seconds: float, connections: int, script: Path) -> dict[str, float]:
    """Run wrk against `url`; requests/s and latency p50 from its report."""
    out = subprocess.run(
        [_env("WRK", "wrk"), "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency",
         "-s", str(script), url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)", out)
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}
    return {
        "req_per_s": float(rate.group(1)) if rate else 0.0,
        "non_2xx": float(errors.group(1)) if errors else 0.0,
        "latency_p50_ms": float(p50.group(1)) * scale[p50.group(2)] if p50 else float("nan"),
    }


def run_proxy(
    kind: str, workers: int, backend: str, port: int, tmp: Path, script: Path, conc: int
) -> dict[str, Any]:
    """One proxy in front of `backend`, warmed and measured under wrk."""
    work = tmp / f"{kind}-{workers}"
    work.mkdir(exist_ok=True)
    cmd, ready = _command(kind, port, [backend], work)
    if kind == "warmroute":
        cmd += ["--workers", str(workers)]
    log = open(work / "log", "wb")
    proxy = subprocess.Popen(
        cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        wait_ready(ready, 60)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        wrk(url, float(_env("WARM_S", "3")), conc, script)
        measure_s = float(_env("MEASURE_S", "10"))
        before = session_cpu_s(proxy.pid)
        got = wrk(url, measure_s, conc, script)
        cpu = session_cpu_s(proxy.pid) - before
    finally:
        os.killpg(proxy.pid, 15)
        stop(proxy)
    requests = got["req_per_s"] * measure_s
    return {
        **got,
        "proxy": kind,
        "workers": workers,
        "cpu_s": cpu,
        "cores": cpu / measure_s,
        "cpu_ms_per_request": cpu / requests * 1000 if requests else float("nan"),
    }


def main() -> int:
    nginx = _env("NGINX", shutil.which("nginx") or "/usr/sbin/nginx")
    if not Path(nginx).exists() or not shutil.which(_env("WRK", "wrk")):
        print("workers_scaling: needs nginx and wrk (apt-get install nginx wrk)", file=sys.stderr)
        return 2
    workers = [int(w) for w in _env("WORKERS", "1 2").split()]
    proxies = _env("PROXIES", "warmroute").split()
    rounds = int(_env("ROUNDS", "1"))
    conc = int(_env("CONCURRENCY", "64"))
    out = Path(_env("OUT", "/tmp/warmroute-workers"))
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        backend_port, proxy_port = free_ports(2)
        (tmp / "nginx.conf").write_text(NGINX_CONF.format(dir=tmp, port=backend_port, body=BODY))
        script = tmp / "post.lua"
        script.write_text(WRK_LUA)
        server = subprocess.Popen(
            [nginx, "-c", str(tmp / "nginx.conf"), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            backend = f"http://127.0.0.1:{backend_port}"
            wait_ready(f"{backend}/health", 20)
            direct = wrk(f"{backend}/v1/chat/completions", 5.0, conc, script)
            print(f"direct to nginx: {direct['req_per_s']:9.0f} req/s", flush=True)
            runs = [("warmroute", n) for n in workers]
            runs += [(kind, 1) for kind in proxies if kind != "warmroute"]
            for r in range(1, rounds + 1):
                for kind, n in runs:
                    got = run_proxy(kind, n, backend, proxy_port, tmp, script, conc)
                    row = {"round": r, **got}
                    results.append(row)
                    name = f"warmroute --workers {n}" if kind == "warmroute" else kind
                    print(
                        f"round {r}  {name:<22} {row['req_per_s']:7.0f} req/s  "
                        f"p50 {row['latency_p50_ms']:6.2f} ms  proxy CPU {row['cores']:.2f} "
                        f"cores, {row['cpu_ms_per_request']:.3f} ms/request  "
                        f"non-2xx {row['non_2xx']:.0f}",
                        flush=True,
                    )
        finally:
            stop(server)
    first = [r for r in results if r["proxy"] == "warmroute" and r["workers"] == workers[0]]
    base = {r["round"]: r["req_per_s"] for r in first}
    for row in results:
        if base.get(row["round"]):
            row["vs_first"] = row["req_per_s"] / base[row["round"]]
    mine = [r for r in results if r["proxy"] == "warmroute"]
    for n in workers[1:]:
        ratios = [r["vs_first"] for r in mine if r["workers"] == n and "vs_first" in r]
        shown = ", ".join(f"{x:.2f}" for x in ratios)
        print(f"--workers {n} against --workers {workers[0]}: {shown}x the requests/s")
    (out / "workers_scaling.json").write_text(json.dumps({"direct": direct, "runs": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
