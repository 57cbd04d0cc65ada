#!/usr/bin/env python3
"""CPU per background GET (a health check, a model list, a scrape): httpx against the proxy's
own pooled connections (proxy/upstream/control.py), on kept-alive and on new connections.

    deploy/perf/control_get.py [--requests 300]

Starts the bench mock on a loopback port and GETs its /v1/models (what a health check of an
OpenAI-compatible server asks) REQUESTS times each way, in this process, under uvloop: with
httpx as the registry's per-backend clients are made, kept alive and with a new connection each
time (a busy engine's check every 5 s finds its last connection closed by the server's 5 s
keep-alive), then with ControlClient the same two ways. Prints the process CPU time per GET.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from proxy.config import TimeoutsConfig  # noqa: E402
from proxy.demo.stack import free_ports  # noqa: E402
from proxy.upstream.backends import CONTROL_LIMITS  # noqa: E402
from proxy.upstream.control import ControlClient  # noqa: E402

CLOSE = {"connection": "close"}  # the server closes after answering: a new connection each


async def _per_get(get: Callable[[], Awaitable[object]], n: int) -> float:
    for _ in range(20):
        await get()
    t0 = time.process_time()
    for _ in range(n):
        await get()
    return (time.process_time() - t0) / n


async def run(url: str, n: int) -> list[tuple[str, float]]:
    out = []
    async with httpx.AsyncClient(limits=CONTROL_LIMITS, trust_env=False) as c:
        out.append(("httpx, kept alive", await _per_get(lambda: c.get(url), n)))
        out.append(
            ("httpx, a new connection", await _per_get(lambda: c.get(url, headers=CLOSE), n))
        )
    client = ControlClient(TimeoutsConfig())
    await client.start()
    try:
        out.append(("own pool, kept alive", await _per_get(lambda: client.get(url), n)))
        out.append(
            ("own pool, a new connection", await _per_get(lambda: client.get(url, CLOSE), n))
        )
    finally:
        await client.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300)
    a = p.parse_args()
    (port,) = free_ports(1)
    mock = subprocess.Popen(
        [sys.executable, "-m", "proxy.bench.mock", "--port", str(port), "--instances", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}/v1/models"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise SystemExit("control_get: the mock did not come up") from None
                time.sleep(0.1)  # another process: nothing to wait on but its answer
        import uvloop

        for label, s in uvloop.run(run(url, a.requests)):
            print(f"{label:<28} {s * 1e6:7.0f} us CPU per GET")
    finally:
        mock.terminate()
        mock.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
