"""In-flight counts shared across replicas through Redis; a crashed replica's counts age out."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from typing import Any

import pytest
from redis import exceptions as redis_errors

from proxy.routing.index import open_redis
from proxy.routing.inflight import InflightBoard
from tests.routing_support import SHARED_URL, delete_prefix, unique_prefix


@pytest.fixture
def prefix() -> Iterator[str]:
    kp = unique_prefix("load")
    yield kp
    delete_prefix(kp)


def test_without_redis_counts_are_local() -> None:
    board = InflightBoard()
    board.acquire("a")
    board.acquire("a")
    board.release("a")
    board.release("b")  # never below zero
    assert board.get("a") == 1 and board.get("b") == 0
    assert board.info()["mode"] == "local"


@pytest.mark.redis
async def test_replicas_see_each_others_requests(prefix: str) -> None:
    # A budget for a loaded machine: what is tested is the sharing, not the timeout.
    one = InflightBoard(open_redis(SHARED_URL), key_prefix=prefix, replica_id="one", timeout_s=5)
    two = InflightBoard(open_redis(SHARED_URL), key_prefix=prefix, replica_id="two", timeout_s=5)
    for _ in range(3):
        one.acquire("gpu-a")
    two.acquire("gpu-a")
    two.acquire("gpu-b")
    await one.sync()
    await two.sync()
    await one.sync()
    assert one.get("gpu-a") == 4 and one.get("gpu-b") == 1
    assert two.get("gpu-a") == 4
    one.release("gpu-a")
    await one.sync()
    await two.sync()
    assert two.get("gpu-a") == 3
    await one.close()  # a clean shutdown withdraws its counts at once
    await two.sync()
    assert two.get("gpu-a") == 1
    await two.close()
    await one.client.aclose()
    await two.client.aclose()


@pytest.mark.redis
async def test_a_crashed_replicas_counts_expire(prefix: str) -> None:
    now = [1_000_000.0]
    board = functools.partial(InflightBoard, key_prefix=prefix, ttl_s=5, timeout_s=5)
    crashed = board(open_redis(SHARED_URL), replica_id="x")
    alive = board(open_redis(SHARED_URL), replica_id="y")
    crashed.clock = alive.clock = lambda: now[0]
    crashed.acquire("gpu-a")
    await crashed.sync()
    await alive.sync()
    assert alive.get("gpu-a") == 1
    now[0] += 6  # "x" never syncs again (crashed), "y" keeps going
    await alive.sync()
    assert alive.get("gpu-a") == 0
    await crashed.client.aclose()
    await alive.client.aclose()


@pytest.mark.redis
async def test_redis_outage_keeps_local_counts(prefix: str) -> None:
    board = InflightBoard(open_redis("redis://127.0.0.1:1/0"), key_prefix=prefix)
    board.acquire("a")
    with pytest.raises(Exception):  # noqa: B017 - sync() itself reports; the loop swallows it
        await board.sync()
    assert board.get("a") == 1
    await board.client.aclose()


class ScriptedRedis:
    """Answers each sync as scripted: "ok", "slow" (past any timeout) or "refused"."""

    def __init__(self, outcomes: list[str]) -> None:
        self.outcomes = outcomes

    def register_script(self, lua: str) -> Any:
        async def script(keys: list[str], args: list[Any]) -> list[Any]:
            outcome = self.outcomes.pop(0)
            if outcome == "slow":
                await asyncio.sleep(10)
            if outcome == "refused":
                raise redis_errors.ConnectionError("Connection refused")
            return []

        return script


async def test_a_slow_sync_is_not_an_outage_but_three_in_a_row_are() -> None:
    # A loaded event loop makes a healthy Redis time out now and then; a refused connection
    # is down at once (the prefix index's TimeoutStreak, shared).
    outcomes = ["slow", "ok", "slow", "slow", "ok", "slow", "slow", "slow", "ok", "refused", "ok"]
    board = InflightBoard(ScriptedRedis(list(outcomes)), timeout_s=0.01)  # type: ignore[arg-type]
    modes = []
    for _ in outcomes:
        await board.step()
        modes.append(board.info()["mode"][0])  # r(edis) or l(ocal-fallback)
    assert "".join(modes) == "rrrrrrrlrlr"
    assert board.counters["sync_timeouts"] == 6 and board.counters["sync_errors"] == 7
