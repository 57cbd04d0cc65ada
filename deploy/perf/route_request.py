#!/usr/bin/env python3
"""CPU time of one request's routing in the proxy's own terms, without the proxy around it.

    deploy/perf/route_request.py [--system-chars 600 200] [--requests 5000] [--backends 2]

Builds the app as `warmroute serve` does (default config, BACKENDS backends serving the model
`mock`, memory index), then for each request runs what the forwarder asks of routing:
`RequestRouting.route` (the view read and the decision), the in-flight count up, `sent` (the
prefix recorded, the backlog), one event-loop turn (the placement upkeep left for after the
decision), `prefilled`, the count down and `finished`. Prompts are a system prompt of
SYSTEM_CHARS characters and a random 50-character user turn: at 600 characters every request
shares a placed prompt head; at 200 each is a prompt placement has not seen. Prints the
process CPU time per request over the last REQUESTS - 500 (the first 500 warm up). Numbers
depend on the machine: compare builds in one session (PYTHONPATH=<checkout> picks one).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from proxy.config import load_config
from proxy.routing.types import RouteContext
from proxy.server.app import create_app

WARMUP = 500


def _app(backends: int) -> Any:
    urls = [f"http://127.0.0.1:{9101 + i}" for i in range(backends)]  # never contacted
    cfg = load_config(flags={"backends": urls}, env={})
    return create_app(
        cfg.model_validate(
            {**cfg.model_dump(), "backends": [{"url": u, "models": ["mock"]} for u in urls]}
        )
    )


async def run(system_chars: int, requests: int, backends: int, seed: int = 1) -> float:
    """CPU seconds per request (route, sent, prefilled, finished)."""
    steering = _app(backends).state.forwarding.steering
    rnd = random.Random(seed)
    system = ("You are a helpful assistant. " * (system_chars // 28 + 1))[:system_chars]

    def ctx(i: int) -> RouteContext:
        user = "".join(rnd.choice("abcdefgh ") for _ in range(50))
        body = {
            "model": "mock",
            "stream": True,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ],
        }
        return RouteContext(
            request_id=f"r{i}", model="mock", api="chat", body=body, headers={},
            now=time.monotonic(),
        )  # fmt: skip

    contexts = [ctx(i) for i in range(requests)]

    async def one(c: RouteContext) -> None:
        d = await steering.route(c)
        assert d.winner is not None
        steering.inflight(d.winner, 1)
        steering.sent(d, d.winner)
        await asyncio.sleep(0)  # the upkeep left for after the decision runs here
        steering.prefilled(d)
        steering.inflight(d.winner, -1)
        steering.finished(d)

    for c in contexts[:WARMUP]:
        await one(c)
    started = time.process_time()
    for c in contexts[WARMUP:]:
        await one(c)
    return (time.process_time() - started) / max(requests - WARMUP, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--system-chars", type=int, nargs="+", default=[600, 200])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--backends", type=int, default=2)
    args = ap.parse_args(argv)
    if args.requests <= WARMUP:
        ap.error(f"--requests must be above the {WARMUP} warm-up requests")
    for chars in args.system_chars:
        per = asyncio.run(run(chars, args.requests, args.backends))
        what = "us CPU per request (route, sent, prefilled, finished)"
        print(f"system prompt {chars:>6} chars  {args.backends} backends  {per * 1e6:7.1f} {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
