#!/usr/bin/env python3
"""What the proxy spends per streamed chunk at an engine's pace, in CPU (user + system).

The zero-latency mock sends a whole stream in a few writes, so the proxy reads it in a few
reads and its cost per chunk hides in its cost per request. An engine sends each token tens
of milliseconds after the last: every chunk is then its own read, meter step and write, and
what sizes a proxy tier is the CPU per such chunk. Here the bench mock paces its content chunks
(`--chunk-interval-ms`) and nothing else; for each pace and stream length the proxy's CPU
(utime + stime from /proc, kernel time included) is read over REQUESTS streamed chat
completions, and the CPU per chunk is the slope between the shortest and the longest streams
(what a request costs apart from its chunks cancels out).

  deploy/perf/paced_chunks.py                     # ITL 5 and 20 ms, 16/64/256 chunks, c=16
  ITLS="20" CHUNKS="16 64" REQUESTS=100 deploy/perf/paced_chunks.py
  PIN=1 deploy/perf/paced_chunks.py               # proxy on core 1; mock and load on core 0

Environment: ITLS ("5 20", ms), CHUNKS ("16 64 256"), REQUESTS (200), CONCURRENCY (16), WARMUP
(50 requests before each measurement), PIN, OUT (/tmp/warmroute-paced). Prints one line per
run and a per-chunk line per pace, and writes OUT/paced_chunks.json. Instructions instead of
CPU (a figure a noisy machine does not move): deploy/perf/count-instructions.sh with ITL_MS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "perf"))
sys.path.insert(0, str(ROOT))

from idle_cpu import cpu_s, stop, wait_ready  # noqa: E402

from proxy.demo.stack import free_ports  # noqa: E402


def _bench(port: int, requests: int, concurrency: int, pin: list[str]) -> None:
    subprocess.run(
        [
            *pin, sys.executable, "-m", "proxy", "bench", "--base-url", f"http://127.0.0.1:{port}",
            "--workload", "hot-prompt", "--system-chars", "200", "--user-chars", "50",
            "--model", "mock", "--requests", str(requests), "--concurrency", str(concurrency),
            "--no-progress",
        ],
        check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
    )  # fmt: skip


def run(
    itl_ms: float, chunks: int, requests: int, concurrency: int, warmup: int, pin: bool
) -> dict[str, float]:
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
    try:
        wait_ready(f"http://127.0.0.1:{mock_port + 1}/health", 60)
        proxy = subprocess.Popen(
            [
                *proxy_cpu, sys.executable, "-m", "proxy", "serve", "--port", str(proxy_port),
                "--backend", f"http://127.0.0.1:{mock_port}",
                "--backend", f"http://127.0.0.1:{mock_port + 1}", "--log-level", "warning",
            ],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_ready(f"http://127.0.0.1:{proxy_port}/ready", 120)
        _bench(proxy_port, warmup, concurrency, load_cpu)
        before, t0 = cpu_s(proxy.pid), time.monotonic()
        _bench(proxy_port, requests, concurrency, load_cpu)
        used, wall = cpu_s(proxy.pid) - before, time.monotonic() - t0
        return {
            "itl_ms": itl_ms,
            "chunks": chunks,
            "requests": requests,
            "concurrency": concurrency,
            "wall_s": round(wall, 2),
            "proxy_cpu_s": round(used, 3),
            "proxy_cpu_ms_per_request": round(1000 * used / requests, 3),
        }
    finally:
        stop(proxy, mock)


def main() -> None:
    env = os.environ
    itls = [float(x) for x in env.get("ITLS", "5 20").split()]
    lengths = [int(x) for x in env.get("CHUNKS", "16 64 256").split()]
    requests, concurrency = int(env.get("REQUESTS", "200")), int(env.get("CONCURRENCY", "16"))
    warmup, pin = int(env.get("WARMUP", "50")), bool(env.get("PIN"))
    out = Path(env.get("OUT", "/tmp/warmroute-paced"))
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, object]] = []
    for itl in itls:
        rows = []
        for n in lengths:
            row = run(itl, n, requests, concurrency, warmup, pin)
            rows.append(row)
            per = row["proxy_cpu_ms_per_request"]
            print(
                f"itl {itl:g} ms  chunks {n:4d}  cpu/request {per:.3f} ms"
                f"  ({requests} requests, c={concurrency}, {row['wall_s']:.1f} s)",
                flush=True,
            )
        short, long = rows[0], rows[-1]
        slope = (long["proxy_cpu_ms_per_request"] - short["proxy_cpu_ms_per_request"]) / (
            long["chunks"] - short["chunks"]
        )
        print(f"itl {itl:g} ms  cpu per paced chunk {1000 * slope:.1f} us", flush=True)
        results.append({"itl_ms": itl, "rows": rows, "cpu_us_per_chunk": round(1000 * slope, 2)})
    (out / "paced_chunks.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
