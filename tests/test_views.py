"""A ViewKeeper's Views carry the fleet-wide facts a pass over the views would give, updated
for the views that changed only; the filters and the load bound read them and answer as they
do over a plain list (issue 31: a decision's cost follows what changed, not the fleet)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from plugins.health_filter import HealthFilter
from plugins.model_filter import ModelFilter
from plugins.role_filter import RoleFilter
from proxy.routing.rendezvous import load_bound
from proxy.routing.types import BackendView, EngineLoad, RouteContext, Views
from proxy.routing.views import ViewKeeper

MODELS = frozenset({"m"})


def view(i: int, rng: random.Random) -> BackendView:
    return BackendView(
        name=f"e{i}",
        url=f"http://e{i}",
        engine="vllm",
        role="mixed",
        weight=1.0,
        healthy=True,
        inflight=rng.randint(0, 9),
        load=EngineLoad(waiting=rng.choice((None, 0, 1, 3))),
        models=MODELS,
    )


def changed_view(b: BackendView, rng: random.Random) -> BackendView:
    """`b` made again with one thing it shows changed: mostly its load, now and then what
    starts a new epoch (health, role, models, weight, an in-flight bound)."""
    roll = rng.random()
    if roll < 0.6:
        return dataclasses.replace(b, inflight=max(b.inflight + rng.choice((-1, 1, 2)), 0))
    if roll < 0.8:
        return dataclasses.replace(b, load=EngineLoad(waiting=rng.choice((None, 0, 2, 12))))
    if roll < 0.85:
        return dataclasses.replace(b)  # a new object showing the same
    stable: dict[str, Any] = rng.choice(
        (
            {"healthy": not b.healthy},
            {"role": "prefill" if b.role == "mixed" else "mixed"},
            {"models": frozenset({"other"}) if b.models == MODELS else MODELS},
            {"weight": 2.0 if b.weight == 1.0 else 1.0},
            {"max_inflight": None if b.max_inflight else 4},
        )
    )
    return dataclasses.replace(b, **stable)


def facts(views: list[BackendView]) -> dict[str, Any]:
    """What a Views should say, by passes over the views."""
    inflight = [b.inflight for b in views]
    counts: dict[int, int] = {}
    for i in inflight:
        counts[i] = counts.get(i, 0) + 1
    return {
        "inflight": inflight,
        "inflight_total": sum(inflight),
        "inflight_least": min(inflight),
        "inflight_counts": counts,
        "waiting_most": max(float(b.load.waiting or 0.0) for b in views),
    }


def stable(views: list[BackendView]) -> list[tuple[Any, ...]]:
    return [(b.name, b.weight, b.role, b.models, b.healthy, b.max_inflight) for b in views]


@pytest.mark.parametrize("seed", range(4))
def test_views_say_what_passes_over_the_views_would(seed: int) -> None:
    rng = random.Random(seed)
    current = [view(i, rng) for i in range(rng.choice((3, 40, 300)))]
    keeper = ViewKeeper()
    read = keeper.read(current)
    earlier: list[tuple[Views, dict[str, Any]]] = []
    for _ in range(400):
        changed = rng.sample(range(len(current)), rng.randint(0, min(5, len(current))))
        before = stable(current)
        for i in changed:
            current[i] = changed_view(current[i], rng)
        last = read
        read = keeper.read(current, changed)
        assert list(read) == current
        got = {k: getattr(read, k) for k in facts(current)}
        assert got == facts(current)
        # A new epoch exactly when a stable fact changed.
        assert (read.epoch is last.epoch) == (stable(current) == before)
        earlier.append((read, got))
    # Each read is a snapshot: later reads did not change what an earlier one says.
    for old, said in earlier[::37]:
        assert {k: getattr(old, k) for k in said} == said


def test_a_read_whole_keeps_the_epoch_while_the_stable_facts_hold() -> None:
    """The proxy reads the fleet whole when its membership changes, and a harness that makes
    every view afresh does each time: the epoch (and what was derived in it) holds as long as
    no stable fact changed, and a fleet of other names starts a new one."""
    rng = random.Random(1)
    keeper = ViewKeeper()
    first = keeper.read([view(i, rng) for i in range(8)])
    first.fleetwide("probe", len)
    again = keeper.read([view(i, rng) for i in range(8)])  # every object new, loads new
    assert again.epoch is first.epoch and again.fleetwide("probe", lambda v: -1) == 8
    bigger = keeper.read([view(i, rng) for i in range(9)])
    assert bigger.epoch is not first.epoch and bigger.fleetwide("probe", len) == 9


@pytest.mark.parametrize("seed", range(6))
def test_filters_drop_from_views_what_they_drop_from_a_list(seed: int) -> None:
    rng = random.Random(seed)
    current = [view(i, rng) for i in range(50)]
    keeper = ViewKeeper()
    filters = [HealthFilter(), ModelFilter(), RoleFilter(("mixed",))]
    read = keeper.read(current)
    for turn in range(300):
        changed = rng.sample(range(len(current)), rng.randint(0, 3))
        for i in changed:
            current[i] = changed_view(current[i], rng)
        read = keeper.read(current, changed)
        ctx = RouteContext(f"r{turn}", "m", "chat", {}, {}, 0.0)
        for f in filters:
            dropped_views: dict[str, str] = {}
            dropped_list: dict[str, str] = {}
            got = f.filter(ctx, read, dropped_views)
            want = f.filter(ctx, list(current), dropped_list)
            assert got == want and dropped_views == dropped_list, (turn, f.name)


@pytest.mark.parametrize("seed", range(6))
def test_the_load_bound_of_views_is_the_one_passes_give(seed: int) -> None:
    """The same LoadBound to the float, counted or not, whatever the loads."""
    rng = random.Random(seed)
    current = [view(i, rng) for i in range(rng.choice((2, 33, 500)))]
    keeper = ViewKeeper()
    read = keeper.read(current)
    for _ in range(300):
        changed = rng.sample(range(len(current)), rng.randint(0, min(4, len(current))))
        for i in changed:
            b = current[i]
            current[i] = dataclasses.replace(b, inflight=rng.choice((0, 1, 5, 30, b.inflight + 1)))
        read = keeper.read(current, changed)
        epsilon, slack = rng.choice((0.25, 1.0, 3.0)), rng.choice((0, 1, 8))
        count = rng.random() < 0.5
        got = load_bound(read, epsilon, slack, count, read.inflight, unit=True)
        want = load_bound(list(current), epsilon, slack, count, unit=True)
        assert got == want


def test_a_backend_at_its_bound_is_dropped_from_views_of_a_healthy_fleet() -> None:
    rng = random.Random(3)
    current = [dataclasses.replace(view(i, rng), inflight=1) for i in range(6)]
    keeper = ViewKeeper()
    ctx = RouteContext("r", "m", "chat", {}, {}, 0.0)
    assert HealthFilter().filter(ctx, keeper.read(current), {}) == current
    current[2] = dataclasses.replace(current[2], max_inflight=1)
    dropped: dict[str, str] = {}
    kept = HealthFilter().filter(ctx, keeper.read(current, [2]), dropped)
    assert [b.name for b in kept] == ["e0", "e1", "e3", "e4", "e5"] and list(dropped) == ["e2"]
    current[2] = dataclasses.replace(current[2], inflight=0)  # room again: load alone changed
    assert HealthFilter().filter(ctx, keeper.read(current, [2]), {}) == current
