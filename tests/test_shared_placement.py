"""Replicas sharing Redis agree on where hot prefixes live and on what each engine caches.

Routers of three replicas, each with its own placement and capacity learner, exchanging them
through a real Redis (proxy.routing.shared_placement): the one that leads recomputes, the
others adopt; a first placement loses to an earlier one; without Redis a replica places on
its own again, and with Redis back (empty) the replicas agree again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from proxy.config import RoutingConfig, load_config
from proxy.routing.capacity import Outcome
from proxy.routing.index import MemoryPrefixIndex, open_redis
from proxy.routing.router import Router
from proxy.routing.setup import build_router, build_routing
from proxy.routing.shared_placement import SharedPlacement
from tests.routing_support import (
    HAVE_REDIS_SERVER,
    SHARED_URL,
    RedisProcess,
    delete_prefix,
    unique_prefix,
    until,
)
from tests.test_capacity import SYSTEMS, backend, chat

pytestmark = pytest.mark.redis

VIEWS = [backend(f"e{i}") for i in range(4)]


@dataclass
class Replica:
    router: Router
    shared: SharedPlacement

    @property
    def homes(self) -> dict[int, tuple[str, ...]]:
        placement = self.router.placement
        assert placement is not None
        return {k: p.homes for k, p in placement.placed.items()}

    async def send(self, n: int, start: int = 0) -> None:
        """n requests cycling over the eight system prompts."""
        for i in range(start, start + n):
            decision = await self.router.route(chat(SYSTEMS[i % 8], i), VIEWS)
            assert decision.winner is not None
            await asyncio.sleep(0)  # the placement's upkeep, as between the proxy's requests


@contextlib.asynccontextmanager
async def replicas(url: str, prefix: str, n: int, now: list[float]) -> AsyncIterator[list[Replica]]:
    out = []
    for r in range(n):
        router = build_router(RoutingConfig(policy="prefix_aware"), index=MemoryPrefixIndex())
        assert router.placement is not None and router.index is not None
        shared = SharedPlacement(
            open_redis(url),
            router.placement,
            router.capacity,
            apply_capacity=router.index.set_capacity,
            key_prefix=prefix,
            replica_id=f"replica-{r}",
            clock=lambda: now[0],
        )
        router.claims = shared  # as build_routing wires it
        out.append(Replica(router, shared))
    try:
        yield out
    finally:
        for rep in out:
            await rep.shared.close()
            with contextlib.suppress(Exception):
                await rep.shared.client.aclose()


@pytest.fixture
def prefix() -> Iterator[str]:
    kp = unique_prefix("place")
    yield kp
    delete_prefix(kp)


@pytest.fixture
def private(tmp_path: Path) -> Iterator[RedisProcess]:
    if not HAVE_REDIS_SERVER:
        pytest.skip("redis-server binary not installed")
    server = RedisProcess(tmp_path).start()
    yield server
    server.stop()


async def exchange(reps: list[Replica], rounds: int = 2) -> None:
    # Two rounds: the replicas that exchanged first read what the later ones published.
    for _ in range(rounds):
        for rep in reps:
            assert await rep.shared.step()


async def test_replicas_adopt_the_homes_the_leader_recomputes_and_its_learned_capacity(
    prefix: str,
) -> None:
    async with replicas(SHARED_URL, prefix, 3, [0.0]) as reps:
        leader, *followers = reps
        await exchange(reps)
        assert leader.router.placement and leader.router.placement.leads
        assert all(f.router.placement and not f.router.placement.leads for f in followers)
        for i, rep in enumerate(reps):
            await rep.send(8, start=8 * i)  # every replica sees every prompt
        await exchange(reps)
        before = leader.homes
        assert len(before) == 8 and all(rep.homes == before for rep in reps)

        # The leader learns that one engine keeps a single prompt (its report contradicted
        # the index), so that engine's second prompt must move at the next recomputation.
        crowded = max(VIEWS, key=lambda b: sum(b.name in h for h in before.values())).name
        assert sum(crowded in h for h in before.values()) >= 2
        outcome = Outcome(100, 120, 0.0, occupancy=160, recorded_age_s=10.0)
        assert leader.router.capacity.observe(crowded, outcome) == "shrink"
        await leader.send(64)
        for f in followers:
            await f.send(64)
        assert leader.router.placement.rebalances >= 1
        assert all(f.router.placement and f.router.placement.rebalances == 0 for f in followers)
        after = leader.homes
        assert after != before and sum(crowded in h for h in after.values()) == 1
        assert all(f.homes == before for f in followers)  # not told yet

        await exchange(reps)
        assert all(rep.homes == after for rep in reps)
        learned = leader.router.capacity.capacity(crowded)
        for f in followers:
            assert f.router.capacity.capacity(crowded) == learned
            assert f.router.index and f.router.index.capacity(crowded) == learned  # type: ignore[attr-defined]
            assert f.shared.info()["adopted_homes"] >= 1


async def test_a_first_placement_yields_to_an_earlier_one_from_another_replica(
    prefix: str,
) -> None:
    async with replicas(SHARED_URL, prefix, 2, [0.0]) as (a, b):
        await exchange([a, b])
        ctx = chat(SYSTEMS[0], 1)
        await a.router.route(ctx, VIEWS)
        [first] = a.homes.values()
        # B's own index says another engine holds the prompt: on its own it would go there.
        elsewhere = next(v.name for v in VIEWS if v.name not in first)
        assert b.router.index is not None
        b.router.index.record(elsewhere, ctx.prefix_blocks)
        # A claimed its first placement in Redis: B takes it on its first sight.
        await b.router.route(chat(SYSTEMS[0], 2), VIEWS)
        assert b.homes == a.homes == {next(iter(a.homes)): first}
        assert b.shared.info()["claims_placed_elsewhere"] == 1
        # A prompt B places without a claim (Redis slow, say) goes where B's index says, and
        # yields at the next exchange to the placement A claimed.
        ctx = chat(SYSTEMS[1], 3)
        await a.router.route(ctx, VIEWS)
        key, ours = next((k, h) for k, h in a.homes.items() if k not in b.homes)
        elsewhere = next(v.name for v in VIEWS if v.name not in ours)
        b.router.index.record(elsewhere, ctx.prefix_blocks)
        b.router.claims = None
        await b.router.route(chat(SYSTEMS[1], 4), VIEWS)
        assert b.homes[key] == (elsewhere,)
        assert await a.shared.step()
        assert await b.shared.step()
        assert b.homes == a.homes and a.homes[key] == ours


async def _first_sightings(reps: list[Replica], orders: list[list[int]]) -> None:
    """Each replica sees the eight prompts for the first time, in its own order, with no
    exchange in between: the burst that reaches every replica before the next one."""
    for rep, order in zip(reps, orders, strict=True):
        for i, k in enumerate(order):
            decision = await rep.router.route(chat(SYSTEMS[k], 100 + i), VIEWS)
            assert decision.winner is not None


async def test_replicas_place_a_burst_of_new_prompts_alike_before_they_exchange(
    prefix: str,
) -> None:
    orders = [list(range(8)), list(range(8))[::-1]]
    async with replicas(SHARED_URL, prefix, 2, [0.0]) as reps:
        await exchange(reps)
        assert [rep.shared.info()["replicas"] for rep in reps] == [2, 2]
        await _first_sightings(reps, orders)
        a, b = reps
        assert len(a.homes) == 8 and a.homes == b.homes  # no prompt with a copy per replica
    # Placed by load instead (as a lone replica does), the two orders part ways: this is what
    # the agreement above is not an accident of.
    async with replicas(SHARED_URL, prefix + "-by-load", 2, [0.0]) as reps:
        await exchange(reps)
        for rep in reps:
            assert rep.router.placement is not None
            rep.router.placement.alike = False
        await _first_sightings(reps, orders)
        a, b = reps
        assert len(a.homes) == 8 and a.homes != b.homes
    delete_prefix(prefix + "-by-load")


async def test_a_lone_replica_places_by_load_and_counts_the_others_as_they_come_and_go(
    prefix: str,
) -> None:
    async with replicas(SHARED_URL, prefix, 2, [0.0]) as (a, b):
        assert a.router.placement is not None and b.router.placement is not None
        assert await a.shared.step()
        assert a.shared.info()["replicas"] == 1 and not a.router.placement.alike
        await exchange([a, b])
        assert a.router.placement.alike and b.router.placement.alike
        await b.shared.close()  # leaves the live replicas at once
        assert await a.shared.step()
        assert a.shared.info()["replicas"] == 1 and not a.router.placement.alike


@pytest.mark.e2e  # a private redis-server, stopped and started
async def test_without_redis_a_replica_places_on_its_own_and_agrees_again_once_it_is_back(
    private: RedisProcess,
) -> None:
    now = [0.0]
    async with replicas(private.url, "wr", 2, now) as (a, b):
        await exchange([a, b])
        await a.send(8)
        await b.send(8, start=8)
        await exchange([a, b])
        assert b.router.placement and not b.router.placement.leads

        private.stop()
        assert not await b.shared.step()
        assert not b.router.placement.leads  # within the lease the leader's homes stand
        now[0] += b.shared.lease_s + 0.1
        assert not await b.shared.step()
        assert b.router.placement.leads  # then this replica recomputes its own placement
        assert b.shared.info()["mode"] == "local-fallback"
        await b.send(64, start=16)  # every request routed
        assert b.router.placement.rebalances >= 1

        private.start()  # the same port, empty: a restart without persistence
        for rep in (b, a):
            # A pooled socket to the old server fails once; the next call reconnects.
            for _ in range(3):
                if await rep.shared.step():
                    break
            else:
                pytest.fail("no exchange after Redis came back")
        await exchange([b, a])
        assert b.shared.info()["mode"] == "redis"
        assert b.router.placement.leads != a.router.placement.leads  # one leader again
        assert a.homes == b.homes and len(a.homes) == 8


async def test_the_app_shares_placement_through_its_redis_unless_told_not_to(
    prefix: str,
) -> None:
    env = {"WARMROUTE_REDIS__KEY_PREFIX": prefix}
    flags = {"backends": ["http://127.0.0.1:9"], "redis": SHARED_URL}
    routing = build_routing(load_config(flags=flags, env=env))
    assert routing.shared is not None
    await routing.start()
    try:
        await until(lambda: routing.shared is not None and routing.shared.counters["syncs"] > 0)
        info = routing.info()["shared_placement"]
        assert info["leads"] and info["leader"] == info["replica"] == routing.board.replica_id
    finally:
        await routing.close()
    # Closing hands the lease over at once.
    client = redis.Redis.from_url(SHARED_URL)
    try:
        assert client.get(routing.shared.keys[3]) is None
    finally:
        client.close()

    off = {**env, "WARMROUTE_ROUTING__PLUGINS__BOUNDED_LOAD__PLACEMENT_OPTIONS__SHARED": "false"}
    assert build_routing(load_config(flags=flags, env=off)).shared is None


@pytest.mark.e2e
async def test_a_redis_restarted_empty_gets_the_placement_back_for_replicas_that_join_later(
    private: RedisProcess,
) -> None:
    now = [0.0]
    async with replicas(private.url, "wr", 2, now) as (a, b):
        await exchange([a, b])
        await a.send(8)
        await exchange([a, b])
        private.stop()
        private.start()  # between two exchanges: nothing pending on either replica
        for rep in (a, b):
            for _ in range(3):
                if await rep.shared.step():
                    break
        await exchange([a, b])
        async with replicas(private.url, "wr", 1, now) as [late]:
            await exchange([late])
            assert late.homes == a.homes == b.homes and len(a.homes) == 8


async def test_a_burst_of_new_prompts_spreads_over_the_engines_as_one_proxy_spreads_it(
    prefix: str,
) -> None:
    """Three replicas see eight new prompts interleaved, with no exchange in between: each
    first placement is claimed in Redis against every replica's, so they agree and the eight
    sit two per engine, as one proxy places them by load, whatever the prompts; placed alike
    without the claims (by rendezvous order alone) they agree too, but some sets crowd an
    engine."""
    layouts: dict[bool, list[list[int]]] = {True: [], False: []}
    for batch in range(4):
        systems = [f"batch {batch} prompt {k}: " + "rules of the house " * 330 for k in range(8)]
        for claims in (True, False):
            kp = f"{prefix}-{batch}-{claims}"
            async with replicas(SHARED_URL, kp, 3, [0.0]) as reps:
                await exchange(reps)
                for rep in reps:
                    if not claims:
                        rep.router.claims = None
                for i, system in enumerate(systems):
                    first, later = reps[i % 3], reps[(i + 1) % 3]
                    assert (await first.router.route(chat(system, 200 + i), VIEWS)).winner
                    assert (await later.router.route(chat(system, 300 + i), VIEWS)).winner
                await exchange(reps)
                homes = reps[0].homes
                assert len(homes) == 8 and all(rep.homes == homes for rep in reps)
                per = [sum(v.name in h for h in homes.values()) for v in VIEWS]
                layouts[claims].append(sorted(per, reverse=True))
                if claims:
                    assert sum(rep.shared.info()["claims"] for rep in reps) == 8
            delete_prefix(kp)
    assert all(layout == [2, 2, 2, 2] for layout in layouts[True])
    assert any(layout != [2, 2, 2, 2] for layout in layouts[False]), layouts


async def test_a_replica_starting_exchanges_once_before_it_routes(prefix: str) -> None:
    """A replica joining a running fleet (a restart, a scale-out) has the shared homes before
    its first request: start() makes one exchange before it returns."""
    async with replicas(SHARED_URL, prefix, 2, [0.0]) as (a, b):
        await exchange([a])
        await a.send(8)
        await exchange([a])
        await b.shared.start()
        assert b.shared.info()["syncs"] >= 1
        assert b.homes == a.homes and len(b.homes) == 8
        assert b.router.placement is not None and b.router.placement.alike
