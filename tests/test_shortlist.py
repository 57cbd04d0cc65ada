"""The shortlist's reading of a placed prefix's homes (proxy.routing.shortlist): with weights
alike, the homes it reads loads for (its contenders) always hold the picker's first HEAD."""

from __future__ import annotations

import random

from proxy.routing.rendezvous import LoadBound, hrw_first, hrw_order
from proxy.routing.shortlist import _best_homes, _contenders, _within
from proxy.routing.types import BackendView, EngineLoad, RouteContext


def test_the_contenders_hold_the_best_homes_of_all() -> None:
    """Random hot prefixes (up to 300 homes, loads bunched or spread, some homes holding the
    request's own history, some over the bound): the HEAD best homes picked from the
    contenders are those picked from every home."""
    rng = random.Random(7)
    for trial in range(400):
        n = rng.randint(1, 300)
        top = rng.choice((1, 3, 12, 40))
        views = [
            BackendView(f"e{i}", "http://e", "vllm", "mixed", 1.0, True, rng.randint(-1, top),
                        EngineLoad(), None)
            for i in range(n)
        ]  # fmt: skip
        own = 20
        matched = {b.name: rng.choice((0, 8, 8, own, 40)) for b in views if rng.random() < 0.3}
        holding = [(i, matched[b.name]) for i, b in enumerate(views) if matched.get(b.name)]
        inflight = [b.inflight for b in views]
        bound = LoadBound(1.0, 8, 1.0, rng.choice((2.0, 5.0, 1e9)) + 1e-9)
        ctx = RouteContext(f"r{trial}", "m", "chat", {}, {}, 0.0)
        whole = _best_homes(ctx, views, _within(views, bound, True), matched, own, True)
        first = [views[i] for i in _contenders(list(range(n)), holding, own, inflight)]
        assert len(first) <= n
        some = _best_homes(ctx, first, _within(first, bound, True), matched, own, True)
        assert {b.name for b in some} == {b.name for b in whole}, trial


def test_the_first_of_a_rendezvous_order_are_those_of_the_whole() -> None:
    """hrw_first(key, views, r) is hrw_order(key, views)[:r] for views weighing the same."""
    rng = random.Random(3)
    for weight in (1.0, 2.5, 0.0):
        for _ in range(200):
            n = rng.randint(0, 60)
            views = [
                BackendView(f"b{rng.getrandbits(20)}", "http://b", "vllm", "mixed", weight, True,
                            0, EngineLoad(), None)
                for _ in range(n)
            ]  # fmt: skip
            key, r = rng.getrandbits(64), rng.randint(0, 12)
            assert hrw_first(key, views, r, weight) == hrw_order(key, views)[:r]
