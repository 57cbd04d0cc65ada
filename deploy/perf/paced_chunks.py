#!/usr/bin/env python3
"""What the proxy spends per streamed chunk at an engine's pace, in CPU (user + system).

The zero-latency mock sends a whole stream in a few writes, so the proxy reads it in a few
reads and its cost per chunk hides in its cost per request. An engine sends each token tens
of milliseconds after the last: every chunk is then its own read, meter step and write, and
what sizes a proxy tier is the CPU per such chunk. Here the bench mock paces its content chunks
(`--chunk-interval-ms`) and nothing else; for each pace and stream length the proxy's CPU
(utime + stime from /proc, kernel time included; each also apart) is read over REQUESTS
streamed chat completions, and the CPU per chunk is the slope between the shortest and the
longest streams (what a request costs apart from its chunks cancels out).

  deploy/perf/paced_chunks.py                     # ITL 5 and 20 ms, 16/64/256 chunks, c=16
  ITLS="20" CHUNKS="16 64" REQUESTS=100 deploy/perf/paced_chunks.py
  PIN=1 deploy/perf/paced_chunks.py               # proxy on core 1; mock and load on core 0
  PROXIES="warmroute nginx sglang-router vllm-router" deploy/perf/paced_chunks.py
  PROXIES="floor-bare floor-asgi warmroute sglang-router" deploy/perf/paced_chunks.py  # floors
  PROXIES="warmroute@/tmp/before warmroute sglang-router" deploy/perf/paced_chunks.py  # 2 builds
  PROXIES="warmroute@/tmp/other warmroute" deploy/perf/paced_chunks.py  # its .venv's Python
  ITLS=0 CHUNKS=64 CONCURRENCY=64 REQUESTS=3000 \
    PROXIES="direct warmroute sglang-router" deploy/perf/paced_chunks.py   # vs direct, zero cost

PROXIES puts each in front of the same mock in turn, one pace and stream length at a time, so
that their figures come from one run (`direct`: no proxy, the load sent to one mock
instance, the baseline each proxy's requests/s is divided by, "vs direct"): `nginx` (a plain
reverse proxy: streaming, no buffering, kept-alive upstream connections; `apt-get install
nginx`), and the Rust routers of
SGLang (`pip install sglang-router`: `sglang-router launch`, round robin) and vLLM (`pip
install vllm-router`, round robin), found on PATH or at $NGINX, $SGLANG_ROUTER,
$VLLM_ROUTER; `floor-bare` and `floor-asgi`, the cheapest streaming proxy Python runs on
warmroute's stack (floor_proxy.py: no framework, or an ASGI app under uvicorn): what no Python
proxy can spend less than. A proxy's CPU is that of every process of its session (nginx's
workers too).

Environment: ITLS ("5 20", ms), CHUNKS ("16 64 256"), REQUESTS (200), CONCURRENCY (16), WARMUP
(50 requests before each measurement), SYSTEM_CHARS (the shared system prompt, 200 characters;
~8000 is a 2k-token prompt), PIN, PROXIES ("warmroute"), RUST_POLICY (the Rust
routers' --policy: round_robin, or cache_aware for routing against routing), OUT
(/tmp/warmroute-paced). Prints one line per run and a per-chunk line per pace and proxy, and
writes OUT/paced_chunks.json. Instructions instead of CPU (a figure a noisy machine does not
move): deploy/perf/count-instructions.sh with ITL_MS.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "perf"))
sys.path.insert(0, str(ROOT))

from idle_cpu import TICK, stop, wait_ready  # noqa: E402

from proxy.demo.stack import free_ports  # noqa: E402

# The shared system prompt's length in characters (SYSTEM_CHARS; ~8000 is a 2k-token prompt,
# whose 125 blocks routing hashes and looks up on every request).
SYSTEM_CHARS = int(os.environ.get("SYSTEM_CHARS", "200"))


def _bench(port: int, requests: int, concurrency: int, pin: list[str], seed: int = 0) -> None:
    """The load. The warm-up sends another seed's prompts than the measured run: the same
    prompts twice would be heads seen again, which warmroute places (the Rust routers keep no
    such state), a cost the measured requests would pay and real traffic does not."""
    subprocess.run(
        [
            *pin, sys.executable, "-m", "proxy", "bench", "--base-url", f"http://127.0.0.1:{port}",
            "--workload", "hot-prompt", "--system-chars", str(SYSTEM_CHARS), "--user-chars", "50",
            "--model", "mock", "--requests", str(requests), "--concurrency", str(concurrency),
            "--no-progress", "--seed", str(seed),
        ],
        check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
    )  # fmt: skip


# An nginx of its own in a scratch directory (pid, logs, temp paths there): the head of every
# configuration these benchmarks write, up to the http block's own directives.
NGINX_PRELUDE = """
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
"""

NGINX_CONF = (
    NGINX_PRELUDE
    + """  upstream engines {{ {servers} keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://engines;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"""
)


# The Rust routers' policy (RUST_POLICY): round_robin, or cache_aware to compare routing with
# routing (warmroute's own policy is its config's: WARMROUTE_ROUTING__POLICY=round_robin).
RUST_POLICY = os.environ.get("RUST_POLICY", "round_robin")


def _command(kind: str, port: int, backends: list[str], work: Path) -> tuple[list[str], str]:
    """The command line that runs proxy `kind` on `port` in front of `backends`, and the URL
    that answers once it is ready."""
    ready = f"http://127.0.0.1:{port}/health"
    if kind == "warmroute" or kind.startswith("warmroute@"):
        cmd = [_python(kind), "-m", "proxy", "serve", "--port", str(port)]
        cmd += ["--log-level", "warning"]
        for b in backends:
            cmd += ["--backend", b]
        return cmd, f"http://127.0.0.1:{port}/ready"
    if kind in ("floor-bare", "floor-asgi"):  # the cheapest Python proxy (floor_proxy.py)
        cmd = [sys.executable, str(ROOT / "deploy" / "perf" / "floor_proxy.py")]
        cmd += ["--server", kind.removeprefix("floor-"), "--port", str(port)]
        for b in backends:
            cmd += ["--backend", b]
        return cmd, ready
    if kind == "nginx":
        servers = " ".join(f"server {b.removeprefix('http://')};" for b in backends)
        (work / "nginx.conf").write_text(NGINX_CONF.format(dir=work, servers=servers, port=port))
        nginx = os.environ.get("NGINX") or shutil.which("nginx") or "/usr/sbin/nginx"
        return [nginx, "-c", str(work / "nginx.conf"), "-g", "daemon off;"], ready
    if kind == "sglang-router":
        exe = os.environ.get("SGLANG_ROUTER") or shutil.which("sglang-router") or "sglang-router"
        cmd = [exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", RUST_POLICY]
        return [*cmd, "--log-level", "warn", "--worker-urls", *backends], ready
    if kind == "vllm-router":
        exe = os.environ.get("VLLM_ROUTER") or shutil.which("vllm-router") or "vllm-router"
        cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", RUST_POLICY]
        return [*cmd, "--log-level", "warning", "--worker-urls", *backends], ready
    known = "direct, warmroute, warmroute@DIR, floor-bare, floor-asgi, nginx, sglang-router"
    known += ", vllm-router"
    raise SystemExit(f"paced_chunks: unknown proxy {kind!r} ({known})")


def _tree(kind: str) -> Path:
    """Where proxy `kind` runs from: `warmroute@DIR` runs the checkout at DIR (its own `proxy`
    package, compiled parts built in place: `python setup.py build_ext --inplace`), so that
    two builds are measured in one run; every other kind, this checkout."""
    if kind.startswith("warmroute@"):
        tree = Path(kind.split("@", 1)[1]).resolve()
        if not (tree / "proxy" / "__main__.py").is_file():
            raise SystemExit(f"paced_chunks: {kind!r}: no warmroute checkout at {tree}")
        return tree
    return ROOT


def _python(kind: str) -> str:
    """The interpreter proxy `kind` runs on: a `warmroute@DIR` checkout with a virtual
    environment of its own (DIR/.venv) runs on that environment's Python, so that two
    interpreters (a distribution's optimised build against a plain source build, say) are
    measured in one run; every other, this script's."""
    own = _tree(kind) / ".venv" / "bin" / "python"
    return str(own) if kind.startswith("warmroute@") and own.is_file() else sys.executable


def session_cpu_split_s(sid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of every live process of session `sid` (and the children
    they reaped): the proxy's own code against the kernel's work for it (its system calls)."""
    user = system = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[3]) == sid:  # the session id (after state, ppid, pgrp)
            user += int(fields[11]) + int(fields[13])  # utime, cutime
            system += int(fields[12]) + int(fields[14])  # stime, cstime
    return user / TICK, system / TICK


def session_cpu_s(sid: int) -> float:
    """utime + stime of every live process of session `sid` (and the children they reaped)."""
    return sum(session_cpu_split_s(sid))


def run(
    itl_ms: float,
    chunks: int,
    requests: int,
    concurrency: int,
    warmup: int,
    pin: bool,
    kind: str = "warmroute",
) -> dict[str, float | str]:
    mock_port, proxy_port = free_ports(2)[0], free_ports(1)[0]
    load_cpu = ["taskset", "-c", "0"] if pin else []
    proxy_cpu = ["taskset", "-c", "1"] if pin else []
    mock = subprocess.Popen(
        [
            *load_cpu, sys.executable, "-m", "proxy.bench.mock", "--port", str(mock_port),
            "--instances", "2", "--chunks", str(chunks), "--chunk-interval-ms", str(itl_ms),
        ],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    proxy = None
    backends = [f"http://127.0.0.1:{mock_port}", f"http://127.0.0.1:{mock_port + 1}"]
    with tempfile.TemporaryDirectory(prefix="paced-") as tmp:
        try:
            wait_ready(f"http://127.0.0.1:{mock_port + 1}/health", 60)
            if kind == "direct":  # the baseline: the load generator straight at the mock
                _bench(mock_port, warmup, concurrency, load_cpu, seed=1)
                t0 = time.monotonic()
                _bench(mock_port, requests, concurrency, load_cpu)
                wall = time.monotonic() - t0
                return {
                    "proxy": kind, "itl_ms": itl_ms, "chunks": chunks, "requests": requests,
                    "concurrency": concurrency, "wall_s": round(wall, 2), "proxy_cpu_s": 0.0,
                    "proxy_cpu_ms_per_request": 0.0, "proxy_user_ms_per_request": 0.0,
                    "proxy_sys_ms_per_request": 0.0,
                }  # fmt: skip
            cmd, ready = _command(kind, proxy_port, backends, Path(tmp))
            proxy = subprocess.Popen(
                [*proxy_cpu, *cmd], cwd=_tree(kind), stdout=subprocess.DEVNULL,
                stderr=open(Path(tmp) / "stderr", "wb"), start_new_session=True,
            )  # fmt: skip
            try:
                wait_ready(ready, 120)
            except RuntimeError:
                print((Path(tmp) / "stderr").read_text()[-2000:], file=sys.stderr)
                raise
            _bench(proxy_port, warmup, concurrency, load_cpu, seed=1)
            (user0, sys0), t0 = session_cpu_split_s(proxy.pid), time.monotonic()
            _bench(proxy_port, requests, concurrency, load_cpu)
            (user1, sys1), wall = session_cpu_split_s(proxy.pid), time.monotonic() - t0
            used = (user1 - user0) + (sys1 - sys0)
            return {
                "proxy": kind,
                "itl_ms": itl_ms,
                "chunks": chunks,
                "requests": requests,
                "concurrency": concurrency,
                "wall_s": round(wall, 2),
                "proxy_cpu_s": round(used, 3),
                "proxy_cpu_ms_per_request": round(1000 * used / requests, 3),
                "proxy_user_ms_per_request": round(1000 * (user1 - user0) / requests, 3),
                "proxy_sys_ms_per_request": round(1000 * (sys1 - sys0) / requests, 3),
            }
        finally:
            stop(proxy, mock)


def main() -> None:
    env = os.environ
    itls = [float(x) for x in env.get("ITLS", "5 20").split()]
    lengths = [int(x) for x in env.get("CHUNKS", "16 64 256").split()]
    requests, concurrency = int(env.get("REQUESTS", "200")), int(env.get("CONCURRENCY", "16"))
    warmup, pin = int(env.get("WARMUP", "50")), bool(env.get("PIN"))
    kinds = env.get("PROXIES", "warmroute").split()
    out = Path(env.get("OUT", "/tmp/warmroute-paced"))
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, object]] = []
    for itl in itls:
        rows: dict[str, list[dict[str, float | str]]] = {k: [] for k in kinds}
        for n in lengths:
            for kind in kinds:  # each length through every proxy in turn: one run's figures
                row = run(itl, n, requests, concurrency, warmup, pin, kind)
                rows[kind].append(row)
                rate = requests / float(row["wall_s"])
                direct = rows.get("direct")
                versus = ""
                if direct and kind != "direct" and len(direct) == len(rows[kind]):
                    row["vs_direct"] = round(float(direct[-1]["wall_s"]) / float(row["wall_s"]), 3)
                    versus = f"  {row['vs_direct']:.2f}x direct's"
                print(
                    f"{kind:13s} itl {itl:g} ms  chunks {n:4d}"
                    f"  cpu/request {row['proxy_cpu_ms_per_request']:.3f} ms"
                    f" (user {row['proxy_user_ms_per_request']:.3f}"
                    f" + sys {row['proxy_sys_ms_per_request']:.3f})"
                    f"  {rate:.0f} req/s{versus}"
                    f"  ({requests} requests, c={concurrency}, {row['wall_s']:.1f} s)",
                    flush=True,
                )
        for kind in kinds:
            short, long = rows[kind][0], rows[kind][-1]
            if kind == "direct" or short is long:
                results.append({"proxy": kind, "itl_ms": itl, "rows": rows[kind]})
                continue
            rise = float(long["proxy_cpu_ms_per_request"]) - float(
                short["proxy_cpu_ms_per_request"]
            )
            slope = rise / (int(long["chunks"]) - int(short["chunks"]))
            per = f"cpu per paced chunk {1000 * slope:.1f} us"
            print(f"{kind:13s} itl {itl:g} ms  {per}", flush=True)
            results.append(
                {
                    "proxy": kind,
                    "itl_ms": itl,
                    "rows": rows[kind],
                    "cpu_us_per_chunk": round(1000 * slope, 2),
                }
            )
    (out / "paced_chunks.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
