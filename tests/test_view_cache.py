"""The views routing decides from (proxy.forwarding.state.ViewCache): read per request in C-level
passes and made again only for a backend whose health, in-flight count, load, models, learned
prefill, backlog or configuration changed; against every view made afresh (Backend.view with
each value read one backend at a time, as RequestRouting.views() did), field by field, through
random changes to a fleet: breakers opening and probing back, loads scraped, models moving,
prefill rates learned, backlogs draining, backends leaving and joining."""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from typing import Any

import pytest

from proxy.config import BackendConfig, OutlierConfig
from proxy.forwarding.state import ViewCache
from proxy.routing.backlog import PrefillBacklog
from proxy.routing.inflight import InflightBoard
from proxy.routing.learn import DEFAULT_PREFILL_TOKENS_PER_S, PrefillLearner
from proxy.routing.types import BackendView, Changes, EngineLoad, Views
from proxy.upstream.backends import Backend
from proxy.upstream.outlier import Breaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class RouterLike:
    """What ViewCache reads of the router (its backlog) and the per-backend path's reads."""

    def __init__(self, learner: PrefillLearner, clock: Clock) -> None:
        self.learner = learner
        self.backlog = PrefillBacklog(clock=clock)

    def backlog_tokens(self, backend: str) -> float:
        rate = self.learner.rate(backend) or DEFAULT_PREFILL_TOKENS_PER_S
        return self.backlog.level(backend, rate)  # (Router.backlog_tokens)


def backend(i: int) -> Backend:
    cfg = BackendConfig(url=f"http://127.0.0.1:{9000 + i}", engine="vllm", max_inflight=8)
    b = Backend(cfg, breaker=Breaker(OutlierConfig(consecutive_failures=2), name=cfg.key))
    b.models = frozenset({"m"})
    return b


def fields(v: BackendView) -> tuple[Any, ...]:
    return tuple(getattr(v, f.name) for f in dataclasses.fields(v))


def afresh(
    fleet: list[Backend], now: float, board: InflightBoard, learner: PrefillLearner, r: RouterLike
) -> list[BackendView]:
    return [
        b.view(
            now,
            board.get(b.name),
            learner.rate(b.name),
            learner.mean_prefill_s(b.name),
            r.backlog_tokens(b.name),
        )
        for b in fleet
    ]


def tracked(backends: list[Backend]) -> Changes:
    """The registry's wiring: each backend, and its breaker's ejections, mark one record."""
    changes = Changes()
    for b in backends:
        b.changes = changes
        assert b.breaker is not None
        b.breaker.watch = functools.partial(changes.mark, b.name)
    return changes


@pytest.mark.parametrize("mode", ["whole", "marked", "verified", "one"])
@pytest.mark.parametrize("seed", range(8))
def test_views_read_in_passes_are_those_made_one_backend_at_a_time(seed: int, mode: str) -> None:
    """`whole`: no record of changes, every backend read at each request; `marked`: only the
    backends their sources marked (and those a backlog or a breaker moves with time);
    `verified`: every read whole and compared with the marks, none of which may miss; `one`:
    as `marked`, one change between reads (most reads then read one backend: the usual
    request's, whose in-flight count moved, read without the passes)."""
    rng = random.Random(seed)
    clock = Clock()
    board, learner = InflightBoard(None), PrefillLearner(min_samples=2)
    router = RouterLike(learner, clock)
    spare = [backend(i) for i in range(rng.choice((4, 40, 300)))]
    fleet = spare[: len(spare) * 3 // 4]
    changes = tracked(spare) if mode != "whole" else None
    cache = ViewCache()
    cache.verify_s = 0.0 if mode == "verified" else math.inf
    made = read = 0
    for _ in range(120):
        clock.now += rng.random() * 3
        for _ in range(rng.randint(0, 6) if mode != "one" else 1):
            b = rng.choice(fleet)
            what = rng.random()
            if what < 0.3:
                board.acquire(b.name) if rng.random() < 0.6 else board.release(b.name)
            elif what < 0.4:
                b.healthy = not b.healthy
            elif what < 0.5:
                assert b.breaker is not None
                if rng.random() < 0.7:
                    b.breaker.failure("status", clock.now)
                else:
                    b.breaker.success()
            elif what < 0.6:
                b.load = EngineLoad(waiting=rng.randint(0, 4), kv_usage=rng.random())
            elif what < 0.65:
                b.models = frozenset({"m", "n"}) if rng.random() < 0.5 else frozenset({"m"})
            elif what < 0.8:
                learner.observe(b.name, rng.uniform(100, 4000), rng.uniform(0.05, 0.8))
            elif what < 0.95:
                rate = learner.rate(b.name) or DEFAULT_PREFILL_TOKENS_PER_S
                router.backlog.add(b.name, rng.uniform(0, 20000), rate)
            elif len(fleet) > 2:
                fleet.remove(b)  # it left; another joins now and then
                if rng.random() < 0.5:
                    fleet.append(rng.choice([s for s in spare if s not in fleet]))
                if changes is not None:
                    changes.mark_all()  # (the registry's add and remove)
        before = cache.made
        got = cache.read(list(fleet), clock.now, board, learner, router, changes)  # type: ignore[arg-type]
        want = afresh(fleet, clock.now, board, learner, router)
        assert list(map(fields, got)) == list(map(fields, want))
        # Its fleet-wide facts, kept current for the views remade only, are the fleet's.
        assert isinstance(got, Views)
        assert got.inflight == [b.inflight for b in want]
        assert got.inflight_total == sum(got.inflight)
        assert got.inflight_least == min(got.inflight)
        assert got.waiting_most == max(float(b.load.waiting or 0) for b in want)
        made += cache.made - before
        read += len(fleet)
    if len(spare) >= 40:
        assert made < read / 4  # most views were handed out again
    assert cache.missed == 0


def test_an_unchanged_fleet_gets_the_same_views_and_a_change_remakes_one() -> None:
    clock = Clock()
    board, learner = InflightBoard(None), PrefillLearner()
    router = RouterLike(learner, clock)
    fleet = [backend(i) for i in range(6)]
    cache = ViewCache()
    first = cache.read(fleet, clock.now, board, learner, router)  # type: ignore[arg-type]
    again = cache.read(fleet, clock.now, board, learner, router)  # type: ignore[arg-type]
    assert all(a is b for a, b in zip(first, again, strict=True)) and again is not first
    board.acquire(fleet[2].name)
    third = cache.read(fleet, clock.now, board, learner, router)  # type: ignore[arg-type]
    assert [a is b for a, b in zip(first, third, strict=True)] == [1, 1, 0, 1, 1, 1]
    assert third[2].inflight == 1


def test_a_backend_without_a_breaker_is_up_while_healthy() -> None:
    clock = Clock()
    board, learner = InflightBoard(None), PrefillLearner()
    router = RouterLike(learner, clock)
    bare = Backend(BackendConfig(url="http://127.0.0.1:9999"))
    ejected = backend(1)
    assert ejected.breaker is not None and ejected.breaker.failure("connect", clock.now)
    views = ViewCache().read([bare, ejected], clock.now, board, learner, router)  # type: ignore[arg-type]
    assert [v.healthy for v in views] == [True, False]
