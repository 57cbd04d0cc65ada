"""A tenant's max_concurrent over every replica (proxy/tenants/leases.py): leases in a real
Redis, given back at each request's end, renewed while it runs, expired when a replica dies,
and each replica's share of the cap while Redis is away."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from proxy.routing.index import open_redis
from proxy.tenants.budgets import Budgets, Grant, Refusal
from tests.routing_support import RedisProcess
from tests.test_tenants import MODEL, budgets_for, private, redis, tenants

__all__ = ["private", "redis"]  # the fixtures, used by name


async def admit_many(replicas: list[Budgets], n: int) -> list[Grant | Refusal]:
    return list(
        await asyncio.gather(
            *(replicas[i % len(replicas)].admit("default", MODEL, b"{}") for i in range(n))
        )
    )


async def held(redis: Any, b: Budgets) -> int:
    assert b.leases is not None
    return int(await redis.zcard(b.leases.key("default")))


async def test_three_replicas_admit_the_cap_between_them_and_a_settled_one_frees_a_slot(
    redis: Any,
) -> None:
    config = tenants(max_concurrent=4)
    replicas = [budgets_for(redis, f"r{i}", config, timeout_s=1.0) for i in range(3)]
    results = await admit_many(replicas, 12)
    grants = [r for r in results if isinstance(r, Grant)]
    refused = [r for r in results if isinstance(r, Refusal)]
    assert len(grants) == 4 and len(refused) == 8
    assert all(r.kind == "concurrency" and r.retry_after_s == 1.0 for r in refused)
    assert "4 in flight across the replicas" in refused[0].message
    assert await held(redis, replicas[0]) == 4
    assert sum(b.view()["leases_held_here"] for b in replicas) == 4  # each counts its own
    owner = next(b for b in replicas if b.stats["default"].inflight)
    await owner.settle(grants[0] if owner is replicas[0] else _own(owner, grants), None, 0)
    assert await held(redis, replicas[0]) == 3
    # the freed slot goes to whichever replica asks next, not only to the one that freed it
    other = next(b for b in replicas if b is not owner)
    assert isinstance(await other.admit("default", MODEL, b"{}"), Grant)
    assert isinstance(await owner.admit("default", MODEL, b"{}"), Refusal)
    assert replicas[0].view()["concurrency"] == "redis"


def _own(b: Budgets, grants: list[Grant]) -> Grant:
    """One of the grants `b` made (its leases are named after its replica)."""
    assert b.leases is not None
    return next(g for g in grants if g.lease and g.lease[1].startswith(b.leases.replica + ":"))


async def test_a_refusal_by_a_rate_limit_gives_the_slot_back(redis: Any) -> None:
    b = budgets_for(redis, "r1", tenants(max_concurrent=1, requests_per_minute=1), timeout_s=1.0)
    first = await b.admit("default", MODEL, b"{}")
    assert isinstance(first, Grant) and await held(redis, b) == 1
    await b.settle(first, None, 0)
    second = await b.admit("default", MODEL, b"{}")  # the minute's one request is spent
    assert isinstance(second, Refusal) and second.kind == "requests"
    assert await held(redis, b) == 0 and not b.held


async def test_a_running_requests_lease_is_renewed_and_a_dead_replicas_expires(
    redis: Any,
) -> None:
    config = tenants(max_concurrent=1)
    dying, other = (budgets_for(redis, f"r{i}", config, timeout_s=1.0) for i in range(2))
    dying.lease_s = 0.5
    grant = await dying.admit("default", MODEL, b"{}")
    assert isinstance(grant, Grant) and grant.lease is not None
    key, member = grant.lease
    before = await redis.zscore(key, member)
    t0 = await redis.time()
    while await redis.time() == t0:  # Redis's clock moves on (microseconds)
        pass
    await dying.renew_leases()
    assert await redis.zscore(key, member) > before  # renewed, on Redis's clock
    assert isinstance(await other.admit("default", MODEL, b"{}"), Refusal)
    # `dying` stops here: no renewal, no settle. Its lease runs out and the slot is free.
    for _ in range(200):
        got = await other.admit("default", MODEL, b"{}")
        if isinstance(got, Grant):
            break
        await asyncio.sleep(0.05)
    assert isinstance(got, Grant)
    assert await held(redis, other) == 1  # the expired lease is gone, the new one counted


async def test_a_replica_that_shuts_down_gives_its_slots_back_at_once(redis: Any) -> None:
    config = tenants(max_concurrent=2)
    leaving, staying = (budgets_for(redis, f"r{i}", config, timeout_s=1.0) for i in range(2))
    for _ in range(2):
        assert isinstance(await leaving.admit("default", MODEL, b"{}"), Grant)
    assert isinstance(await staying.admit("default", MODEL, b"{}"), Refusal)
    await leaving.release_all()
    assert await held(redis, staying) == 0 and not leaving.held
    assert isinstance(await staying.admit("default", MODEL, b"{}"), Grant)


@pytest.mark.e2e
@pytest.mark.redis
async def test_with_redis_away_each_replica_holds_its_share_of_the_cap(
    private: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    config = tenants(max_concurrent=6)  # no rate limit: the cap's own calls count replicas
    clients = [open_redis(private.url, timeout_s=0.2) for _ in range(3)]
    replicas = [
        Budgets(config, redis=c, key_prefix="wr", replica=f"r{i}", timeout_s=0.2)
        for i, c in enumerate(clients)
    ]
    for _ in range(2):  # every replica has reached Redis; the second round sees three live
        grants = [await b.admit("default", MODEL, b"{}") for b in replicas]
        assert all(isinstance(g, Grant) for g in grants)
    for b, g in zip(replicas, grants, strict=True):
        await b.settle(g, None, 0)  # (each still holds the first round's)
    assert [b.live_replicas for b in replicas] == [3, 3, 3]
    private.stop()
    results = [await replicas[i % 3].admit("default", MODEL, b"{}") for i in range(12)]
    # 6 / 3 = 2 each while Redis is away; each already holds 1 (taken while it answered)
    assert sum(isinstance(r, Grant) for r in results) == 3
    refused = [r for r in results if isinstance(r, Refusal)]
    assert all(r.kind == "concurrency" for r in refused)
    assert "share while Redis is away: 2" in refused[0].message
    assert "enforces its share" in caplog.text
    assert replicas[0].view()["concurrency"] == "local"
    for c in clients:
        with contextlib.suppress(Exception):
            await c.aclose()


async def test_an_admission_cancelled_after_its_lease_stops_renewing_it(redis: Any) -> None:
    """The client leaves while the rate limits are being charged: no grant, so no settle; the
    lease must not stay in the renewal set (it would hold the slot for ever)."""
    b = budgets_for(redis, "r1", tenants(max_concurrent=1, requests_per_minute=10), timeout_s=1.0)
    charging = asyncio.Event()

    async def never_answers(*args: Any) -> None:
        charging.set()
        await asyncio.Event().wait()

    b._charge_admission = never_answers  # type: ignore[method-assign]
    admitting = asyncio.create_task(b.admit("default", MODEL, b"{}"))
    await charging.wait()
    assert b.held  # the lease was taken
    admitting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await admitting
    assert not b.held  # not renewed: it expires within lease_s
