"""The placement's tallies (proxy/routing/placement.py): placing a prefix reads per-backend
tallies of the prefixes placed so far, kept as homes change, instead of summing over all of
them, and decides exactly as the sums did."""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from math import ldexp

from proxy.config import RoutingConfig
from proxy.routing.index import MemoryPrefixIndex
from proxy.routing.placement import Placement, SharedHomes
from proxy.routing.popularity import PrefixPopularity
from proxy.routing.setup import build_router
from proxy.routing.types import BackendView, EngineLoad, RouteContext

NAMES = ["a", "b", "c", "d"]


def order(key: int, names: Sequence[str]) -> list[str]:
    return sorted(names, key=lambda n: zlib.crc32(f"{key}:{n}".encode()))


def test_tallied_loads_decide_as_the_sums_over_every_placed_prefix_did() -> None:
    """One placement reads its loads from tallies of the popularity it is attached to, the
    other sums the same shares over every placed prefix on every placement: through hot and
    one-off prompts, a full placement forgetting its coolest, rebalances, a backend going
    away, caches filling, another replica's homes and the weights' base moving, both place
    every prefix on the same homes and see the same backends full."""
    rng = random.Random(5)
    pop = PrefixPopularity(max_keys=40)  # it forgets placed prefixes too (their share: 0)
    pop.rebase_every = 701
    tallied = Placement(max_keys=24, rebalance_every=100)
    tallied.attach(pop)
    summed = Placement(max_keys=24, rebalance_every=100)
    caps = dict.fromkeys(NAMES, 400.0)
    weights = {"a": 2.0, "b": 1.0, "c": 1.0, "d": 0.5}
    hot = [rng.getrandbits(40) for _ in range(6)]
    blocks_of = {k: list(range(k, k + rng.randint(4, 60))) for k in hot}
    placed_differently = []
    recent: list[int] = []
    for step in range(3000):
        # One prompt a third of the traffic (it needs copies), five more, one-off prompts, and
        # one-off prompts seen again a little later (then forgotten as they cool).
        draw = rng.random()
        if draw < 0.35:
            key = hot[0]
        elif draw < 0.6:
            key = rng.choice(hot)
        elif draw < 0.75 and recent:
            key = rng.choice(recent[-8:])
        else:
            key = rng.getrandbits(40)
            recent.append(key)
        blocks = blocks_of.get(key) or list(range(key, key + rng.randint(4, 12)))
        if key in blocks_of and rng.random() < 0.3:  # a conversation that shares less of it
            blocks = blocks[: rng.randint(4, len(blocks))]
        names = [n for n in NAMES if n != "c"] if 1000 <= step < 1400 else NAMES
        if step == 2000:
            caps["b"] = 120.0  # its learned cache shrank
        inflight = {n: float(rng.randint(0, 6)) for n in names}
        warm = {n: rng.choice((0, 0, 8)) for n in names}
        theirs = {k: SharedHomes((rng.choice(NAMES),), 30.0) for k in hot[:3]}
        pop.observe(key)
        seen = []
        for p in (tallied, summed):
            p.note_load(sum(inflight.values()) + 1)
            p.observe(key, blocks)
            if p.due():
                p.rebalance(names, weights, caps.__getitem__, pop.current, order)
            homes = p.homes(
                key, blocks, names, weights, caps.__getitem__, pop.current, warm, order,
                4, inflight.__getitem__,
            )  # fmt: skip
            seen.append((homes, p.full_for(key, names, lambda n: n != "d"), sorted(p.placed)))
            if step % 700 == 699:
                p.take_changes()
                p.adopt(theirs, caps.__getitem__)
        if seen[0] != seen[1]:
            placed_differently.append(step)
    assert placed_differently == []
    assert tallied.moves == summed.moves > 0 and tallied.rebalances == summed.rebalances > 0
    assert pop.base > 0  # the weights were rebased on the way
    assert max(len(p.homes) for p in tallied.placed.values()) > 1  # copies were made
    # And the tallies are what counting the placed prefixes gives, once brought up to date
    # (as the next placement would: the sizes and weights that changed since are pending).
    tallied.tallies.current(tallied.placed)
    assert tallied.tallies.base == pop.base and not tallied.tallies.stale
    for name in NAMES:
        on = [(k, p) for k, p in tallied.placed.items() if name in p.homes]
        assert tallied.tallies.hosted.get(name, 0) == len(on)
        assert tallied.tallies.sizes.get(name, 0) == sum(int(ldexp(p.size, 128)) for _, p in on)
        assert tallied.tallies.weights.get(name, 0) == sum(
            int(ldexp(pop.weight(k), 128)) // len(p.homes) for k, p in on
        )
        assert (name in tallied.full_for(hot[1], NAMES, lambda _: False)) == bool(
            on and name not in tallied.placed[hot[1]].homes
        )  # home to a placed prefix, and no cache size measured: a copy would evict


def test_new_prefixes_leave_their_two_choices_once_those_host_more_than_a_fair_count() -> None:
    """Eight prompts whose rendezvous orders all start with a and b: the counts of placed
    prefixes per backend (a tally) send the third and fourth to c and d, not back to a, b."""
    p = Placement()
    caps = dict.fromkeys(NAMES, 10_000.0)
    homes = [
        p.homes(
            k, list(range(20)), NAMES, dict.fromkeys(NAMES, 1.0), caps.__getitem__,
            lambda _: 0.02, {}, lambda _key, names: sorted(names),
        )
        for k in range(8)
    ]  # fmt: skip
    assert homes == [(n,) for n in "abcdabcd"]
    assert p.tallies.hosted == dict.fromkeys(NAMES, 2)


def view(name: str) -> BackendView:
    return BackendView(
        name=name,
        url=f"http://127.0.0.1:{8000 + NAMES.index(name)}",
        engine="vllm",
        role="mixed",
        weight=1.0,
        healthy=True,
        inflight=0,
        load=EngineLoad(),
        models=frozenset({"m"}),
    )


async def test_a_first_sighting_asks_for_one_share_not_one_per_placed_prefix() -> None:
    """Prompts whose first eight blocks are their own (a document, a case file ahead of the
    question) each have a head of their own, so every request is placed at first sight into a
    full placement. Between rebalances each one reads a share or two, however many prefixes
    are placed."""
    r = build_router(RoutingConfig(policy="prefix_aware"), index=MemoryPrefixIndex())
    assert r.placement is not None
    asked = []
    current = r.popularity.current
    r.popularity.current = lambda key: asked.append(key) or current(key)  # type: ignore[method-assign]
    views = [view(n) for n in NAMES]
    text = "You are a terse assistant. " * 24  # ~650 characters: ten 64-character blocks
    per_request = []
    for i in range(400):
        body = {
            "model": "m",
            "messages": [
                {"role": "system", "content": f"Case {i}. {text}"},
                {"role": "user", "content": f"Request {i}: what is {i} squared?"},
            ],
        }
        ctx = RouteContext(f"r{i}", "m", "chat", body, {}, 0.0)
        rebalances = r.placement.rebalances
        asked.clear()
        decision = await r.route(ctx, views)
        assert decision.reason.startswith("placed prefix")
        if r.placement.rebalances == rebalances:
            per_request.append(len(asked))
    assert len(r.placement.placed) == r.placement.max_keys  # full of one-off prompts
    assert max(per_request[-100:]) <= 2


async def test_a_short_prompt_is_placed_when_its_head_comes_again_not_at_first_sight() -> None:
    """A prompt under eight blocks is keyed by its whole text, the user's turn included: most
    such heads never come again, and placing each one (with the rebalances that re-place it)
    was over half a short request's routing. So it is routed by the rules for prompts not
    placed at first sight, and placed when the same head comes again; a long prompt is placed
    at first sight, as before."""
    r = build_router(RoutingConfig(policy="prefix_aware"), index=MemoryPrefixIndex())
    assert r.placement is not None
    views = [view(n) for n in NAMES]

    def ctx(rid: str, system: str, user: str) -> RouteContext:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return RouteContext(rid, "m", "chat", {"model": "m", "messages": messages}, {}, 0.0)

    short = "You are a terse assistant. " * 8  # ~200 characters: three 64-character blocks
    for i in range(20):
        decision = await r.route(ctx(f"s{i}", short, f"Request {i}: what is {i} squared?"), views)
        assert not decision.reason.startswith("placed prefix")
    assert not r.placement.placed
    again = await r.route(ctx("again", short, "Request 7: what is 7 squared?"), views)
    assert again.reason.startswith("placed prefix")
    assert len(r.placement.placed) == 1
    long = "You are a terse assistant. " * 24  # ten blocks: the head is the system prompt's
    first = await r.route(ctx("long", long, "What is 3 squared?"), views)
    assert first.reason.startswith("placed prefix")
    assert len(r.placement.placed) == 2


def test_forgetting_a_backend_keeps_the_tallies_what_counting_the_placed_prefixes_gives() -> None:
    """A backend leaves mid-run (Placement.forget): the tallied and the summed placement move
    the same prefixes to the same homes, go on deciding alike without it, and the tallies are
    what counting the placed prefixes gives, with nothing left for the departed backend."""
    rng = random.Random(11)
    pop = PrefixPopularity(max_keys=40)
    tallied = Placement(max_keys=24, rebalance_every=50)
    tallied.attach(pop)
    summed = Placement(max_keys=24, rebalance_every=50)
    caps = dict.fromkeys(NAMES, 400.0)
    weights = dict.fromkeys(NAMES, 1.0)
    hot = [rng.getrandbits(40) for _ in range(10)]
    names = list(NAMES)
    for step in range(1500):
        key = hot[0] if rng.random() < 0.3 else rng.choice(hot)
        blocks = list(range(key, key + 20))
        if step == 700:
            names = [n for n in NAMES if n != "b"]
            moved = [p.forget("b", order, names) for p in (tallied, summed)]
            assert moved[0] == moved[1] > 0
            assert {k: p.homes for k, p in tallied.placed.items()} == {
                k: p.homes for k, p in summed.placed.items()
            }
            assert "b" not in tallied.tallies.hosted and "b" not in tallied.room
        pop.observe(key)
        seen = []
        for p in (tallied, summed):
            p.note_load(8.0)
            p.observe(key, blocks)
            if p.due():
                p.rebalance(names, weights, caps.__getitem__, pop.current, order)
            homes = p.homes(
                key, blocks, names, weights, caps.__getitem__, pop.current, {}, order, 4,
            )  # fmt: skip
            seen.append(homes)
        assert seen[0] == seen[1]
        assert step < 700 or "b" not in seen[0]
    tallied.tallies.current(tallied.placed)
    assert "b" not in tallied.tallies.hosted
    for name in NAMES:
        on = [(k, p) for k, p in tallied.placed.items() if name in p.homes]
        assert tallied.tallies.hosted.get(name, 0) == len(on)
        assert tallied.tallies.sizes.get(name, 0) == sum(int(ldexp(p.size, 128)) for _, p in on)
        assert tallied.tallies.weights.get(name, 0) == sum(
            int(ldexp(pop.weight(k), 128)) // len(p.homes) for k, p in on
        )


def test_tallies_made_current_equal_a_fresh_count() -> None:
    """Prefixes whose share or size moved are counted again when next read (Tallies.current,
    one pass of differences per prefix): the tallies then equal counting every placed prefix
    afresh, for prefixes with hundreds of homes and with a few."""
    from proxy.routing.tallies import Placed, Tallies

    rng = random.Random(7)
    pop = PrefixPopularity(half_life=32)
    names = [f"e{i}" for i in range(300)]
    placed: dict[int, Placed] = {}
    for key in range(20):
        homes = tuple(rng.sample(names, rng.choice((1, 3, 12, 150))))
        placed[key] = Placed(homes, float(rng.randint(10, 400)), ())
    for _ in range(40):
        pop.observe(rng.randrange(20))
    tallies = Tallies(shares=pop)
    pop.listener = lambda k: tallies.stale.add(k)  # (recount replaces the set)
    tallies.recount(placed)
    for _ in range(500):
        key = rng.randrange(20)
        pop.observe(key)  # its weight moves (the listener marks it stale)
        if rng.random() < 0.3:
            placed[key].size = float(rng.randint(10, 400))
            tallies.stale.add(key)
        if rng.random() < 0.2:
            tallies.current(placed)
            fresh = Tallies(shares=pop)
            fresh.recount(placed)
            assert (tallies.hosted, tallies.sizes, tallies.weights) == (
                fresh.hosted, fresh.sizes, fresh.weights,
            )  # fmt: skip
