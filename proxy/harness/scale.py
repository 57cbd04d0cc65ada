"""Routing at fleet scale: N simulated engines behind M proxy replicas sharing one Redis.

    python -m proxy.harness.scale --engines 4 64 256 1024 --replicas 1 3 8 --requests 6 \\
        --seeds 1 2 --redis redis://127.0.0.1:6379/0 [--baseline] [--json FILE]

One run per (engines, replicas, seed), in virtual time (proxy/harness/virtual.py): ONE set of
N simulated engines (the simulator's scheduler core, one discrete-event clock) and M replicas,
each a Routing built by `build_routing` as the proxy builds it: its own Redis client, its own
RedisPrefixIndex on one shared key prefix, its in-flight board and, when the policy shares
placement, its SharedPlacement wired to the router. A balancer hands requests to the replicas
round robin; each request's response teaches the replica that routed it. Then the same
workload under STATIC_AFFINITY (system prompt i on engine i mod N, one in-memory router; the
documents, which have no system prompt, go by prefix_aware): the bound the hit ratio is
compared with. `--baseline` adds one proxy on the in-memory index (no Redis, no replicas).

The workload is `mixed` (Zipf(1.1) popularity over the system prompts, 20% unique ~2k-token
documents, short user turns): popular and rare prompts and cold documents together, as real
traffic has them. Caches are tight, as in the "tight-cache" benchmark (docs/benchmarks.md):
500 blocks (8,000 tokens) per engine, room for about three 2k-token system prompts beside the
requests running there, and 2 prompts per engine (8 at 4 engines, 2,048 at 1,024), so that the
fleet's caches hold ~1.5 copies of every prompt at every size: a router that scatters them
misses, and 1,024 engines are not all warm with a few prompts each. Requests and concurrency
scale with the fleet too (`--requests` and `--concurrency` are per engine).

Virtual time, and what is approximated:

- The replicas' background work runs on the virtual clock, driven here instead of by their
  wall-clock loops: each index writes its batch every `flush_interval_s` (5 ms) of virtual
  time, the SharedPlacement exchanges and in-flight board syncs run every 0.2 s of it (their
  `interval_s`/`sync_interval_s`), always in replica order. The real writer also flushes at 64
  records; at these rates a batch seldom reaches that.
- RedisPrefixIndex scores entries by wall time (replicas on several hosts must agree): here
  its clock (build_routing's `clock`) and the in-flight board's read the virtual clock on the
  wall clock's epoch, so refresh, TTL and recorded ages follow virtual time.
- SharedPlacement's leader lease and liveness are kept by Redis's own clock (TIME, PX) and stay
  wall clock: lease 2 s, exchanges every 0.2 virtual s. A replica that took more than 2 s of
  wall time for 0.2 s of virtual time (a huge fleet on a slow box) would lose its lease;
  `leaders` counts the distinct leaders seen at the exchanges (1 is the steady state).
- Replicas run one at a time in one process (the round robin in request order, no overlap of
  their Redis calls), so no lookup waits behind another replica's; decision time is one
  replica's own. Network latency to Redis is loopback. In-flight counts come from each
  replica's board (its own requests, the others' as of the last sync), as in the proxy.
- Redis's counters (commands, CPU) are server-wide: run on a Redis nothing else uses.

Each column: --help. Not a test: times depend on the machine. Hit ratios repeat exactly for a
seed, unless a Redis lookup times out (50 ms, a loaded box) and a replica answers it from its
local copy (`fb`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import BuiltinFunctionType, FunctionType, ModuleType
from typing import Any

from proxy.bench.metrics import cache_hit_ratio
from proxy.bench.results import RequestResult
from proxy.bench.workloads import Workload, make_workload
from proxy.config import Config, RedisConfig, RoutingConfig
from proxy.harness.virtual import STATIC_AFFINITY, VirtualFleet, _Open, _Replay, run_virtual
from proxy.routing.backlog import PrefillBacklog
from proxy.routing.index import RedisPrefixIndex, capacity_blocks_from_tokens, open_redis
from proxy.routing.setup import Routing, build_routing
from proxy.routing.types import BackendView, Decision, RouteContext
from proxy.sim.config import SimConfig
from proxy.stats import percentile

POLICY = "prefix_aware"
KV_BLOCKS = 500  # 8,000 tokens per engine: ~3 of the 2k-token system prompts (tight-cache)
SYSTEM_CHARS = 8000  # ~2k tokens
PROMPTS_PER_ENGINE = 2
# What the replicas send Redis: their scripts (and SCRIPT LOAD when one is missing).
ROUND_TRIPS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "script|load")
SYNC_S = 0.2  # SharedPlacement.interval_s and InflightBoard.sync_interval_s defaults
COLUMNS = """columns (one row per engines x replicas x seed):
  engines, replicas, seed, requests   the run: simulated engines, proxy replicas sharing
            Redis, the workload's seed, requests sent (--requests per engine)
  hit       prompt tokens served from the engines' prefix caches / prompt tokens sent
  bound     the same under static_affinity (system prompt i on engine i mod N)
  /bound    hit / bound (the issue's target: >= 0.95 for 3 and 8 replicas)
  mem hit   with --baseline: the hit ratio of one proxy on the in-memory index (no Redis,
            no replicas), the same workload; "-" without it
  dec p50, dec p99   Router.route() wall time per request, ms (hashing, Redis lookup,
            placement, claim, scoring, picking, recording; not building the views)
  cpu/req   this process's CPU in Router.route() per request, ms (time.process_time)
  bg/req    this process's CPU in the replicas' background work per request, ms (index
            writes, placement exchanges, in-flight board syncs)
  calls/req round trips to Redis per request (script calls: lookups, writes, claims,
            exchanges, board syncs; INFO commandstats)
  cmd/req   Redis commands per request (INFO total_commands_processed over the run: the
            commands a script runs count; a script call is one more)
  rcpu/req  Redis server CPU per request, ms (INFO used_cpu_user + used_cpu_sys)
  MB/rep    one replica's routing state after the run, MB (replica 0: its router, prefix index
            with its local copy, placement, learners, in-flight board; sizes of the Python
            objects reachable from them, not the interpreter, the Redis client or the engines)
  redis MB  MEMORY USAGE (SAMPLES 0) summed over the run's keys, after the run
  ttft p50, ttft p99  virtual time to first token, ms
  fb        lookups answered from a replica's local copy (Redis slow or down): 0 expected
  leaders   distinct leaders seen at the placement exchanges (1: the lease never moved)
  wall      wall-clock seconds for the run (without its static bound)"""


@dataclass
class _Replica:
    routing: Routing
    index: RedisPrefixIndex
    times: list[float] = field(default_factory=list)
    cpu: float = 0.0


class _VirtualWallClock:
    """The virtual clock on the wall clock's epoch: what RedisPrefixIndex and the in-flight
    board score by (replicas on several hosts must agree on wall time)."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self.epoch = time.time()

    def __call__(self) -> float:
        return self.epoch + self._now()


class ReplicatedFleet(VirtualFleet):
    """VirtualFleet's engines and clock behind several routers: each request goes to the next
    replica's router (round robin); VirtualFleet.route does the rest with that router."""

    def __init__(self, sim: SimConfig, engines: int, scrape_s: float = 2.0) -> None:
        super().__init__(sim, engines, POLICY, scrape_s=scrape_s)
        self.replicas: list[_Replica] = []
        self.owner: dict[str, _Replica] = {}
        self.bg_cpu = 0.0
        self.leaders: set[str] = set()
        self._turn = 0
        self._views_s = self._views_cpu = 0.0
        self._next_flush = self._next_sync = 0.0

    def attach(self, routing: Routing, clock: _VirtualWallClock) -> None:
        """A replica as build_routing made it, on this fleet's clock and engines."""
        router = routing.router
        assert isinstance(routing.index, RedisPrefixIndex)
        # The proxy records once the request is on the wire (forward.py); in virtual time that
        # is the instant it is routed.
        router.record_on_route = True
        router.backlog = PrefillBacklog(clock=lambda: self.now)
        hasher = router.hasher
        for name, cfg in zip(self.names, self.cfgs, strict=True):
            blocks = capacity_blocks_from_tokens(
                cfg.kv_pool_tokens, hasher.block_chars, hasher.chars_per_token
            )
            router.set_published_capacity(name, blocks)
        routing.board.clock = clock
        if routing.shared is not None:
            routing.shared.clock = lambda: self.now
        self.replicas.append(_Replica(routing, routing.index))

    def views(self) -> list[BackendView]:
        """The routing replica's views: in-flight counts from its board (its own requests and
        the others' as of the last sync), as the proxy's RequestRouting reads them."""
        started, cpu = time.perf_counter(), time.process_time()
        board = self.replicas[(self._turn - 1) % len(self.replicas)].routing.board
        true_inflight, self.inflight = self.inflight, board.counts(self.names)
        try:
            return super().views()
        finally:
            self.inflight = true_inflight
            self._views_s += time.perf_counter() - started
            self._views_cpu += time.process_time() - cpu

    async def route(
        self,
        request_id: str,
        body: dict[str, Any],
        system_id: int | None = None,
        prompt: list[int] | None = None,
    ) -> tuple[int, RouteContext, Decision]:
        rep = self.replicas[self._turn % len(self.replicas)]
        self._turn += 1
        self.router, self.learner = rep.routing.router, rep.routing.router.learner
        self.owner[request_id] = rep
        self._views_s = self._views_cpu = 0.0
        started, cpu = time.perf_counter(), time.process_time()
        i, ctx, decision = await super().route(request_id, body, system_id, prompt)
        rep.times.append(time.perf_counter() - started - self._views_s)
        rep.cpu += time.process_time() - cpu - self._views_cpu
        return i, ctx, decision

    async def tick(self) -> None:
        """The replicas' background work due at this virtual instant (see the module's doc)."""
        now = self.now
        if now < self._next_flush:
            return
        cpu = time.process_time()
        wrote = []
        for rep in self.replicas:
            writes = rep.index.counters["writes"]
            await rep.index.flush()
            wrote.append(rep.index.counters["writes"] != writes)
        # Each reads the others' writes, as its feed reader does: woken by a new entry, then
        # gathering for FEED_GATHER_S (here: until this tick).
        for k, rep in enumerate(self.replicas):
            if any(w for j, w in enumerate(wrote) if j != k):
                await rep.index.pull_feed()
        self._next_flush = now + self.replicas[0].index.flush_interval_s
        if now >= self._next_sync:
            self._next_sync = now + SYNC_S
            for rep in self.replicas:
                shared = rep.routing.shared
                if shared is not None:
                    await shared.step()
                    if shared.leader:
                        self.leaders.add(shared.leader)
                await rep.routing.board.step()
        self.bg_cpu += time.process_time() - cpu


class _Balanced(_Replay):
    """The replay, with each response taught to the replica that routed the request, and the
    replicas' background work run between the engines' steps."""

    fleet: ReplicatedFleet

    async def output(self, i: int, o: _Open, out: Any) -> None:
        if o.result.output_chunks == 0:  # the first token: the router observes it
            self.fleet.router = self.fleet.owner[o.ctx.request_id].routing.router
        await super().output(i, o, out)

    async def fill(self) -> None:
        await self.fleet.tick()
        await super().fill()


def _acquire(fleet: VirtualFleet, i: int, r: RequestResult, ctx: RouteContext) -> None:
    assert isinstance(fleet, ReplicatedFleet)
    fleet.owner[ctx.request_id].routing.board.acquire(fleet.names[i])


def _release(fleet: VirtualFleet, i: int, r: RequestResult, ctx: RouteContext, _: Any) -> None:
    assert isinstance(fleet, ReplicatedFleet)
    fleet.owner.pop(ctx.request_id).routing.board.release(fleet.names[i])


@dataclass(frozen=True)
class Setup:
    engines: int
    replicas: int
    seed: int
    requests: int
    concurrency: int
    redis_url: str
    key_prefix: str | None = None  # None: a fresh one per run; its keys are deleted after


def sim_config(seed: int) -> SimConfig:
    return SimConfig.from_preset("l40s", kv_blocks=KV_BLOCKS, seed=seed)


def workload_for(engines: int, seed: int) -> Workload:
    return make_workload(
        "mixed", seed=seed, num_prefixes=PROMPTS_PER_ENGINE * engines, system_chars=SYSTEM_CHARS
    )


async def run_replicated(setup: Setup) -> tuple[list[RequestResult], dict[str, Any]]:
    """One run: the requests' results and what it cost (see COLUMNS)."""
    sim = sim_config(setup.seed)
    fleet = ReplicatedFleet(sim, setup.engines)
    prefix = setup.key_prefix or f"wrscale-{uuid.uuid4().hex[:10]}"
    probe = open_redis(setup.redis_url)
    config = Config(
        routing=RoutingConfig(policy=POLICY),
        redis=RedisConfig(url=setup.redis_url, key_prefix=prefix),
    )
    try:
        clock = _VirtualWallClock(lambda: fleet.now)
        for k in range(setup.replicas):
            fleet.attach(build_routing(config, f"replica-{k}", clock), clock)
        before = await _redis_counters(probe)
        started = time.perf_counter()
        for rep in fleet.replicas:  # as Routing.start does: one exchange before serving
            if rep.routing.shared is not None:
                await rep.routing.shared.step()
        replay = _Balanced(
            fleet, workload_for(setup.engines, setup.seed), sim, setup.requests,
            setup.concurrency, (),
        )  # fmt: skip
        replay.on_start, replay.on_finish = _acquire, _release
        await replay.run(fleet.scrape_s)
        for rep in fleet.replicas:
            await rep.index.flush()
        wall = time.perf_counter() - started
        after = await _redis_counters(probe)
        cost = _cost(fleet, before, after)
        cost["wall_s"] = wall
        cost["mb_per_replica"] = retained_bytes(fleet.replicas[0].routing, fleet) / 1e6
        cost["redis_mb"] = await redis_bytes(probe, prefix) / 1e6
    finally:
        for rep in fleet.replicas:
            await rep.routing.close()
        await _delete_prefix(probe, prefix)
        await probe.aclose()
    return replay.results, cost


def _cost(
    fleet: ReplicatedFleet, before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    times = sorted(t for rep in fleet.replicas for t in rep.times)
    n = max(len(times), 1)
    # CONFIG RESETSTAT during the run (someone else's measurement) leaves no usable delta.
    reset = after["commands"] < before["commands"] or after["calls"] < before["calls"]
    return {
        "decision_p50_ms": percentile(times, 0.5) * 1000 if times else None,
        "decision_p99_ms": percentile(times, 0.99) * 1000 if times else None,
        "cpu_ms_per_req": sum(rep.cpu for rep in fleet.replicas) / n * 1000,
        "bg_cpu_ms_per_req": fleet.bg_cpu / n * 1000,
        # `before` read commandstats after the total: one INFO more.
        "redis_cmds_per_req": None if reset else (after["commands"] - before["commands"] - 1) / n,
        "redis_calls_per_req": None if reset else (after["calls"] - before["calls"]) / n,
        "redis_cpu_ms_per_req": (after["cpu"] - before["cpu"]) / n * 1000,
        "fallback_lookups": sum(rep.index.counters["fallback_lookups"] for rep in fleet.replicas),
        "leaders": len(fleet.leaders),
        "routed": len(times),
    }


async def _redis_counters(client: Any) -> dict[str, float]:
    info = await client.info()
    cpu = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    stats = await client.info("commandstats")
    calls = sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ROUND_TRIPS)
    return {"commands": float(info["total_commands_processed"]), "cpu": cpu, "calls": calls}


async def redis_bytes(client: Any, prefix: str) -> int:
    total = 0
    async for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        total += int(await client.memory_usage(key, samples=0) or 0)
    return total


async def _delete_prefix(client: Any, prefix: str) -> None:
    keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
    for i in range(0, len(keys), 1000):
        await client.delete(*keys[i : i + 1000])


_OPAQUE = (ModuleType, type, FunctionType, BuiltinFunctionType, asyncio.AbstractEventLoop)


def retained_bytes(root: Any, *outside: Any) -> int:
    """Bytes of the Python objects reachable from `root` (sys.getsizeof each, once), not
    following modules, classes, functions, the event loop, a Redis client or `outside`."""
    skip = {id(o) for o in outside}
    skip.update(id(o) for o in _clients(root))
    seen: set[int] = set()
    stack = [root]
    total = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or id(obj) in skip or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def _clients(routing: Any) -> list[Any]:
    index, shared = getattr(routing, "index", None), getattr(routing, "shared", None)
    found = [getattr(routing, "redis", None), getattr(index, "client", None)]
    return [c for c in [*found, getattr(shared, "client", None)] if c is not None]


def _summary(results: Sequence[RequestResult]) -> dict[str, Any]:
    ttfts = sorted(r.ttft for r in results if r.ok and r.ttft is not None)
    return {
        "requests": len(results),
        "ok": sum(1 for r in results if r.ok),
        "hit": cache_hit_ratio(results),
        "ttft_p50_ms": percentile(ttfts, 0.5) * 1000 if ttfts else None,
        "ttft_p99_ms": percentile(ttfts, 0.99) * 1000 if ttfts else None,
    }


async def static_bound(
    engines: int, seed: int, requests: int, concurrency: int, policy: str = STATIC_AFFINITY
) -> float | None:
    """The hit ratio of the same workload under STATIC_AFFINITY: the bound (or under `policy`
    on one router with the in-memory index: one proxy, no Redis)."""
    sim = sim_config(seed)
    run, _ = await run_virtual(
        workload_for(engines, seed),
        policy=policy,
        sim=sim,
        engines=engines,
        requests=requests,
        concurrency=concurrency,
    )
    return cache_hit_ratio(run.requests)


async def run_row(setup: Setup, bound: float | None) -> dict[str, Any]:
    results, cost = await run_replicated(setup)
    row: dict[str, Any] = {
        "engines": setup.engines,
        "replicas": setup.replicas,
        "seed": setup.seed,
        "concurrency": setup.concurrency,
        **_summary(results),
        "bound": bound,
        **cost,
    }
    hit = row["hit"]
    row["hit_over_bound"] = hit / bound if hit is not None and bound else None
    return row


async def main(
    engines: Sequence[int],
    replicas: Sequence[int],
    seeds: Sequence[int],
    per_engine: int,
    concurrency_per_engine: int,
    redis_url: str,
    max_requests: int | None = None,
    baseline: bool = False,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for seed in seeds:
        for n in engines:
            requests = per_engine * n
            if max_requests is not None:
                requests = min(requests, max_requests)
            concurrency = max(1, min(concurrency_per_engine * n, requests))
            started = time.perf_counter()
            bound = await static_bound(n, seed, requests, concurrency)
            log(
                f"[scale] {n} engines, seed {seed}: {requests} requests at concurrency "
                f"{concurrency}; static bound {_fmt(bound, 3)} "
                f"({time.perf_counter() - started:.1f} s)"
            )
            alone = None
            if baseline:
                alone = await static_bound(n, seed, requests, concurrency, POLICY)
                log(f"[scale]   one proxy, memory index: hit {_fmt(alone, 3)}")
            for m in replicas:
                setup = Setup(n, m, seed, requests, concurrency, redis_url)
                row = await run_row(setup, bound)
                row["memory_hit"] = alone
                rows.append(row)
                log(f"[scale]   {m} replicas: hit {_fmt(row['hit'], 3)}, {row['wall_s']:.1f} s")
    return rows


def _fmt(v: Any, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


TABLE = [
    ("engines", "engines", 0),
    ("replicas", "replicas", 0),
    ("seed", "seed", 0),
    ("requests", "requests", 0),
    ("hit", "hit", 3),
    ("bound", "bound", 3),
    ("/bound", "hit_over_bound", 3),
    ("mem hit", "memory_hit", 3),
    ("dec p50", "decision_p50_ms", 3),
    ("dec p99", "decision_p99_ms", 3),
    ("cpu/req", "cpu_ms_per_req", 3),
    ("bg/req", "bg_cpu_ms_per_req", 3),
    ("calls/req", "redis_calls_per_req", 2),
    ("cmd/req", "redis_cmds_per_req", 1),
    ("rcpu/req", "redis_cpu_ms_per_req", 3),
    ("MB/rep", "mb_per_replica", 1),
    ("redis MB", "redis_mb", 1),
    ("ttft p50", "ttft_p50_ms", 0),
    ("ttft p99", "ttft_p99_ms", 0),
    ("fb", "fallback_lookups", 0),
    ("leaders", "leaders", 0),
    ("wall", "wall_s", 1),
]


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table (times in ms, memory in MB)."""
    head = "| " + " | ".join(h for h, _, _ in TABLE) + " |"
    rule = "|" + "|".join("---" for _ in TABLE) + "|"
    lines = [head, rule]
    for row in rows:
        cells = [_cell(row.get(key), digits) for _, key, digits in TABLE]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(v: Any, digits: int) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m proxy.harness.scale",
        description=__doc__,
        epilog=COLUMNS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engines", type=int, nargs="+", default=[4, 64])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 3])
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--requests", type=int, default=25, help="requests per engine (default 25)")
    p.add_argument("--max-requests", type=int, default=None, help="at most this many per run")
    p.add_argument(
        "--concurrency", type=int, default=8, help="clients per engine (default 8: 32 at 4)"
    )
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="the shared Redis")
    p.add_argument(
        "--baseline", action="store_true", help="also run one proxy on the in-memory index"
    )
    p.add_argument("--json", default=None, help="also write the rows to this file")
    return p


def cli(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rows = asyncio.run(
        main(
            args.engines,
            args.replicas,
            args.seeds,
            args.requests,
            args.concurrency,
            args.redis,
            args.max_requests,
            args.baseline,
        )
    )
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
