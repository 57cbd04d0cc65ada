"""Routing decision time: `python -m proxy.harness.routing_cost [--redis URL] [--backends 4 8]`.

Each decision is Router.route() as the proxy calls it, everything before the request is
sent: prompt rendering and hashing (4k-token prompts, 16k chars), the index lookup,
placement, scoring and picking. Prints p50/p99/max per index store, backend count and seed
(`--seeds 1 2 3`: each seed its own prompts and loads), in wall time and in the thread's CPU
time (on a shared machine the wall time's tail is mostly waits for a core; a Redis round
trip's wait is not CPU), and what follows the decision, timed apart ("after"): the winner's
prefix recorded in the index (the proxy records it once the request is on the wire;
`--record-in-decision` times it into the decision, as the figures before December 2026 did)
and the upkeep the router leaves for then (a rebalance's step, a prefix's new homes).
`--json FILE` also writes them, for deploy/perf/decision_plot.py. Not a test: numbers depend
on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import time
import uuid
from pathlib import Path
from typing import Any

from proxy.config import RoutingConfig
from proxy.routing.index import MemoryPrefixIndex, RedisPrefixIndex, open_redis
from proxy.routing.router import Router
from proxy.routing.setup import build_router
from proxy.routing.types import BackendView, EngineLoad, RouteContext
from proxy.routing.views import ViewKeeper
from proxy.stats import percentile


def _fleet(n: int) -> list[tuple[str, str]]:
    """Each backend's name and URL, made once: a registry's backends keep theirs."""
    return [(f"engine-{i}", f"http://10.0.{i // 256}.{i % 256}:8000") for i in range(n)]


MODELS = frozenset({"m"})  # the one copy of a model list the registry hands every view


def _backends(fleet: list[tuple[str, str]], rng: random.Random) -> list[BackendView]:
    """Fresh views, as RequestRouting.views() makes per request: every backend's load new."""
    return [
        BackendView(
            name=name,
            url=url,
            engine="vllm",
            role="mixed",
            weight=1.0,
            healthy=True,
            inflight=rng.randint(0, 8),
            load=EngineLoad(waiting=rng.randint(0, 3), running=8, kv_usage=rng.random()),
            models=MODELS,
            prefill_tokens_per_s=8000.0,
        )
        for name, url in fleet
    ]


def _requests(count: int, rng: random.Random, new: float = 0.0) -> list[dict[str, Any]]:
    """Zipf-popular 4k-token system prompts; with `new`, that share of the requests (the
    last ones) each bring a system prompt of their own (a first placement each)."""
    systems = [
        f"[system prompt {k}] " + "".join(rng.choices("abcdefgh ", k=15_000)) for k in range(32)
    ]
    weights = [1 / (k + 1) for k in range(32)]  # Zipf popularity
    fresh = count - int(count * new)
    return [
        {
            "model": "m",
            "messages": [
                {
                    "role": "system",
                    "content": (
                        rng.choices(systems, weights)[0] if i < fresh else f"[own {i}] {systems[0]}"
                    ),
                },
                {"role": "user", "content": f"question {i}: " + "x" * rng.randint(200, 1000)},
            ],
        }
        for i in range(count)
    ]


async def measure(
    router: Router,
    n_backends: int,
    count: int,
    seed: int = 1,
    reuse_views: bool = False,
    upkeep: list[float] | None = None,
    new: float = 0.0,
    markers: bool = False,
    record_in_decision: bool = False,
    cpu: list[float] | None = None,
) -> list[float]:
    """`reuse_views`: keep the views from one decision to the next, remaking only those
    whose in-flight count moved (the winner's, and one random request's end), and read them
    as the proxy's ViewCache does (a ViewKeeper told which changed); otherwise every view is
    new, with fresh random loads, handed over as a plain list.

    After each decision the loop is let run once, as the proxy's is while a request waits for
    its engine: the placement's upkeep the router left for then (a rebalance's step) runs
    there, timed into `upkeep` (one entry per decision), not into the decision.

    The winner's prefix is recorded in the index after the decision, timed into `upkeep`
    with it, as the proxy records it once the request is on the wire to its backend
    (`record_on_route` off); `record_in_decision` times it into the decision instead, as
    Router.route() records it by default.

    `markers`: a getppid() system call before and after each decision and after its upkeep,
    where valgrind's `--dump-before=getppid` cuts its counts (deploy/perf/decision-tail.sh).
    `cpu`: each decision's thread CPU time, appended (what the wall time is, less the time
    the process waited for a core: on a shared machine the wall time's tail is mostly that)."""
    router.record_on_route = record_in_decision
    rng = random.Random(seed)
    bodies = _requests(count, rng, new)
    mark = os.getppid if markers else _nothing
    times: list[float] = []
    spent: list[float] = []
    between: list[float] = []
    fleet = _fleet(n_backends)
    backends = _backends(fleet, rng)
    position = {b.name: i for i, b in enumerate(backends)}
    keeper = ViewKeeper()
    changed: list[int] | None = None
    for i, body in enumerate(bodies):
        views: list[BackendView]
        if reuse_views:
            views = keeper.read(backends, changed)
        else:
            views = backends = _backends(fleet, rng)
        ctx = RouteContext(f"r{i}", "m", "chat", body, {}, time.monotonic())
        mark()
        start, used = time.perf_counter(), time.thread_time()
        decision = await router.route(ctx, views)
        times.append(time.perf_counter() - start)
        spent.append(time.thread_time() - used)
        mark()
        if reuse_views and decision.winner is not None:
            w = position[decision.winner]
            backends[w] = dataclasses.replace(backends[w], inflight=backends[w].inflight + 1)
            changed = [w]
            k = rng.randrange(n_backends)
            if backends[k].inflight > 0:
                backends[k] = dataclasses.replace(backends[k], inflight=backends[k].inflight - 1)
                changed.append(k)
        start = time.perf_counter()
        if not record_in_decision and decision.winner is not None:
            router.record(decision, decision.winner)  # (the proxy: once the request is sent)
        await asyncio.sleep(0)  # the deferred upkeep, and the batched Redis writes, run here
        between.append(time.perf_counter() - start)
        mark()
    if upkeep is not None:
        upkeep += between[count // 10 :]
    if cpu is not None:
        cpu += spent[count // 10 :]
    return times[count // 10 :]  # drop warm-up (script load, first connections, cold caches)


def _nothing() -> int:
    return 0


def _row(label: str, times: list[float]) -> str:
    times = sorted(times)

    def q(p: float) -> float:
        return percentile(times, p) * 1000

    stats = f"p50={q(0.5):.3f} ms  p99={q(0.99):.3f} ms  max={times[-1] * 1000:.3f} ms"
    return f"{label:<24} n={len(times):<5} {stats}"


async def main(
    redis_url: str | None,
    backend_counts: list[int],
    count: int,
    seeds: list[int] | None = None,
    reuse_views: bool = False,
    new: float = 0.0,
    markers: bool = False,
    record_in_decision: bool = False,
) -> list[dict[str, Any]]:
    cfg = RoutingConfig(policy="prefix_aware")
    rows: list[dict[str, Any]] = []

    def note(
        store: str,
        n: int,
        seed: int,
        times: list[float],
        upkeep: list[float],
        cpu: list[float],
        extra: str = "",
    ) -> None:
        label = f"{store}, {n} backends" + (f", seed {seed}" if len(seeds or [1]) > 1 else "")
        kept, used = sorted(upkeep), sorted(cpu)
        after = (
            f"  cpu p50={percentile(used, 0.5) * 1000:.3f} ms p99="
            f"{percentile(used, 0.99) * 1000:.3f} ms"
            f"  after (record, upkeep): mean={sum(kept) / len(kept) * 1000:.3f} ms"
            f" p99={percentile(kept, 0.99) * 1000:.3f} ms"
        )
        print(_row(label, times) + after + extra, flush=True)
        ordered = sorted(times)
        rows.append(
            {
                "store": store,
                "backends": n,
                "seed": seed,
                "p50_ms": percentile(ordered, 0.5) * 1000,
                "p99_ms": percentile(ordered, 0.99) * 1000,
                "max_ms": ordered[-1] * 1000,
                "cpu_p50_ms": percentile(used, 0.5) * 1000,
                "cpu_p99_ms": percentile(used, 0.99) * 1000,
                "upkeep_mean_ms": sum(kept) / len(kept) * 1000,
                "upkeep_p99_ms": percentile(kept, 0.99) * 1000,
            }
        )

    for seed in seeds or [1]:
        for n in backend_counts:
            router = build_router(cfg, index=MemoryPrefixIndex())
            upkeep: list[float] = []
            cpu: list[float] = []
            times = await measure(
                router, n, count, seed, reuse_views, upkeep, new, markers, record_in_decision, cpu
            )
            note("memory", n, seed, times, upkeep, cpu)
            if redis_url:
                prefix = f"wrbench-{uuid.uuid4().hex[:8]}"
                client = open_redis(redis_url)
                index = RedisPrefixIndex(client, key_prefix=prefix, owns_client=True)
                await index.start()
                try:
                    router = build_router(cfg, index=index)
                    upkeep, cpu = [], []
                    times = await measure(
                        router, n, count, seed, reuse_views, upkeep, new,
                        record_in_decision=record_in_decision, cpu=cpu,
                    )  # fmt: skip
                    c = index.counters
                    asked = c["lookups"] + c["copy_lookups"] + c["fallback_lookups"]
                    note(
                        "redis", n, seed, times, upkeep, cpu,
                        f"  mode={index.mode}  from the copy {c['copy_lookups']}/{asked}",
                    )  # fmt: skip
                finally:
                    keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
                    if keys:
                        await client.delete(*keys)
                    await index.close()
    return rows


def write(rows: list[dict[str, Any]], path: str) -> None:
    Path(path).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis", default=None, help="e.g. redis://127.0.0.1:6379/0")
    parser.add_argument("--backends", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument(
        "--reuse-views",
        action="store_true",
        help="keep the views between decisions, remaking those whose in-flight count moved, "
        "as the proxy does (default: every view new each decision, with random loads)",
    )
    parser.add_argument(
        "--new-prompts",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="this share of the requests (the last ones) each bring a system prompt of their "
        "own: a first placement each (default 0)",
    )
    parser.add_argument(
        "--markers",
        action="store_true",
        help="a getppid() system call around each decision and after its upkeep, for "
        "valgrind --dump-before=getppid (deploy/perf/decision-tail.sh); memory index only",
    )
    parser.add_argument(
        "--record-in-decision",
        action="store_true",
        help="time the winner's prefix record into the decision (Router.route()'s default) "
        "instead of after it, where the proxy makes it: once the request is on the wire",
    )
    args = parser.parse_args()
    rows = asyncio.run(
        main(
            args.redis,
            args.backends,
            args.requests,
            args.seeds,
            args.reuse_views,
            args.new_prompts,
            args.markers,
            args.record_in_decision,
        )
    )
    if args.json:
        write(rows, args.json)
