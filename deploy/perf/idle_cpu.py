#!/usr/bin/env python3
"""What an idle proxy costs in CPU as the fleet grows: the background work (health checks,
model lists, load scrapes, telemetry) in front of N engines that nobody sends requests to.

One bench mock process serves every engine (`--instances N`, consecutive ports); one
`warmroute serve` lists them all. After the fleet is up and WARM_S has passed, the proxy's own
CPU (utime + stime from /proc) is read over MEASURE_S; the mock's is reported beside it (what the
proxy asked of the engines).

  deploy/perf/idle_cpu.py                          # 4, 64 and 256 engines, as vLLM (scraped)
  FLEETS="4 256" ENGINE=openai deploy/perf/idle_cpu.py   # engines with no load metrics
  REPEATS=3 MEASURE_S=30 deploy/perf/idle_cpu.py
  REQUESTS=300 FLEETS="4 256" deploy/perf/idle_cpu.py   # and CPU per request after the idle part

Environment: FLEETS ("4 64 256"), ENGINE (vllm: the proxy scrapes /metrics as it would a vLLM;
openai: nothing to scrape), WARM_S (10), MEASURE_S (20), REPEATS (1), REQUESTS (0: none; else
that many chat completions through the proxy after the idle part, c=8, and its CPU per
request, background work included), OUT
(/tmp/warmroute-idle-cpu). Prints one line per run and writes OUT/idle_cpu.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from proxy.demo.stack import free_ports  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of a process and its reaped children, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICK


def wait_ready(url: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready within {within_s:g}s")


def stop(*processes: subprocess.Popen[bytes] | None) -> None:
    """Terminate each started process, killing any that is still there 10 s later."""
    for p in processes:
        if p is not None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def per_request(pid: int, port: int, requests: int, out: Path) -> dict[str, float]:
    """The proxy's CPU per request while `requests` chat completions (8 shared 2k-token system
    prompts, c=8, streamed) go through it, background work included."""
    before = cpu_s(pid)
    subprocess.run(
        [
            sys.executable, "-m", "proxy", "bench", "--workload", "shared-prefix",
            "--prefixes", "8", "--system-chars", "8000", "--requests", str(requests),
            "--concurrency", "8", "--max-tokens", "16", "--no-progress", "--out", str(out),
            "--direct", f"http://127.0.0.1:{port}",
        ],
        check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    used = cpu_s(pid) - before
    return {"requests": requests, "proxy_cpu_ms_per_request": round(1000 * used / requests, 3)}


def run(
    n: int, engine: str, warm_s: float, measure_s: float, out: Path, requests: int = 0
) -> dict[str, float]:
    first = free_ports(n)[0]
    (port,) = free_ports(1)
    mock_log = (out / f"mock-{n}.log").open("wb")
    proxy_log = (out / f"proxy-{n}.log").open("wb")
    mock = subprocess.Popen(
        [sys.executable, "-m", "proxy.bench.mock", "--port", str(first), "--instances", str(n)],
        stdout=mock_log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write("backends:\n")
        for i in range(n):
            f.write(f"  - {{url: 'http://127.0.0.1:{first + i}', engine: {engine}}}\n")
        config = f.name
    proxy = None
    try:
        wait_ready(f"http://127.0.0.1:{first + n - 1}/health", 60)
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "proxy",
                "serve",
                "--config",
                config,
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            stdout=proxy_log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        wait_ready(f"http://127.0.0.1:{port}/ready", 120)
        time.sleep(warm_s)
        p0, m0, t0 = cpu_s(proxy.pid), cpu_s(mock.pid), time.monotonic()
        time.sleep(measure_s)
        p1, m1, t1 = cpu_s(proxy.pid), cpu_s(mock.pid), time.monotonic()
        wall = t1 - t0
        result = {
            "engines": n,
            "wall_s": round(wall, 2),
            "proxy_cpu_s": round(p1 - p0, 3),
            "proxy_core_share": round((p1 - p0) / wall, 4),
            "mock_cpu_s": round(m1 - m0, 3),
        }
        if requests:
            result |= per_request(proxy.pid, port, requests, out / f"bench-{n}.json")
        return result
    finally:
        stop(proxy, mock)
        os.unlink(config)
        mock_log.close()
        proxy_log.close()


def main() -> int:
    env = os.environ.get
    fleets = [int(x) for x in env("FLEETS", "4 64 256").split()]
    engine = env("ENGINE", "vllm")
    warm_s, measure_s = float(env("WARM_S", "10")), float(env("MEASURE_S", "20"))
    repeats = int(env("REPEATS", "1"))
    requests = int(env("REQUESTS", "0"))
    out = Path(env("OUT", "/tmp/warmroute-idle-cpu"))
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for r in range(repeats):
        for n in fleets:
            res = run(n, engine, warm_s, measure_s, out, requests)
            res |= {"repeat": r + 1, "engine": engine}
            results.append(res)
            busy = ""
            if requests:
                busy = f"  {res['proxy_cpu_ms_per_request']:.2f} ms CPU per request ({requests})"
            print(
                f"{n:5d} engines ({engine})  proxy {res['proxy_cpu_s']:.2f} s CPU in "
                f"{res['wall_s']:.0f} s ({100 * res['proxy_core_share']:.1f}% of a core)  "
                f"mock {res['mock_cpu_s']:.2f} s{busy}",
                flush=True,
            )
    (out / "idle_cpu.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
