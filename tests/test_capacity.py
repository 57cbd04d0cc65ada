"""The capacity learner and the placement: what each backend's cache really holds, and where
each hot prefix lives."""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from proxy.config import RoutingConfig
from proxy.routing.capacity import CapacityLearner, Outcome
from proxy.routing.index import MemoryPrefixIndex
from proxy.routing.placement import Placement, SharedHomes
from proxy.routing.router import Router
from proxy.routing.setup import build_router
from proxy.routing.types import BackendView, EngineLoad, RouteContext


class LruEngine:
    """An engine's prefix cache: an LRU of `capacity` blocks that reports the cached prefix."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()

    def serve(self, blocks: Sequence[int]) -> int:
        hit = 0
        for h in blocks:
            if h not in self.lru:
                break
            hit += 1
        for h in reversed(blocks):  # the head ends up most recent, as engines free tails first
            self.lru.pop(h, None)
            self.lru[h] = None
        while len(self.lru) > self.capacity:
            self.lru.popitem(last=False)
        return hit


def backend(name: str = "e0") -> BackendView:
    return BackendView(
        name=name,
        url=f"http://{name}",
        engine="openai",
        role="mixed",
        weight=1.0,
        healthy=True,
        inflight=0,
        load=EngineLoad(),
        models=frozenset({"m"}),
    )


def chat(system: str, i: int) -> RouteContext:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}],
    }
    return RouteContext(request_id=f"r{i}", model="m", api="chat", body=body, headers={}, now=0.0)


SYSTEMS = [f"system prompt {k}: " + "rules of the house " * 330 for k in range(8)]  # ~100 blocks


async def drive(router: Router, engine: LruEngine, clock: list[float], n: int, start: int = 0):
    """n requests cycling over the 8 prompts on one backend; returns the engine's hit ratio."""
    hits = total = 0
    for i in range(start, start + n):
        clock[0] += 1.0
        ctx = chat(SYSTEMS[i % len(SYSTEMS)], i)
        decision = await router.route(ctx, [backend()])
        cached = engine.serve(ctx.prefix_blocks)
        hits, total = hits + cached, total + len(ctx.prefix_blocks)
        # Usage in the engine's own tokens: 4 of them per block here, the fraction is the same.
        prompt_tokens = 4 * len(ctx.prefix_blocks)
        router.observe(decision, "e0", prompt_tokens, 4 * cached, 0.05)
    return hits / total


def learning_router() -> tuple[Router, list[float]]:
    clock = [0.0]
    index = MemoryPrefixIndex(clock=lambda: clock[0])
    return build_router(RoutingConfig(policy="prefix_aware"), index=index), clock


async def test_the_learner_shrinks_the_index_to_what_an_evicting_engine_keeps() -> None:
    router, clock = learning_router()
    engine = LruEngine(capacity=400)  # holds 4 of the 8 prompts; cycling over 8, it keeps none
    await drive(router, engine, clock, 64)
    est = router.capacity.estimate("e0")
    assert est.false_hits > 0 and est.capacity < 800  # the 32,768-block default is gone
    # Converged: the index predicts what the engine reports (misses, here), and stays there.
    false_hits = est.false_hits
    await drive(router, engine, clock, 64, start=64)
    assert est.false_hits - false_hits <= 2
    assert est.agreement > 0.9
    assert router.index.capacity("e0") == router.capacity.capacity("e0")  # type: ignore[union-attr]


async def test_the_learner_grows_back_when_the_engine_keeps_more_again() -> None:
    router, clock = learning_router()
    engine = LruEngine(capacity=400)
    await drive(router, engine, clock, 64)
    small = router.capacity.capacity("e0")
    engine.capacity = 1200  # load fell: the engine's cache holds every prompt again
    hit = await drive(router, engine, clock, 96, start=64)
    est = router.capacity.estimate("e0")
    assert est.ghost_hits > 0 and router.capacity.capacity("e0") > small
    assert router.capacity.capacity("e0") >= 800  # all 8 prompts fit the index again
    assert hit > 0.6
    # And the index predicts the engine's hits again.
    ctx = chat(SYSTEMS[0], 999)
    decision = await router.route(ctx, [backend()], record=False)
    assert decision.matched_blocks["e0"] >= len(ctx.prefix_blocks) - 2


async def test_responses_without_cached_tokens_teach_nothing() -> None:
    router, clock = learning_router()
    for i in range(32):
        clock[0] += 1.0
        ctx = chat(SYSTEMS[i % 8], i)
        decision = await router.route(ctx, [backend()])
        router.observe(decision, "e0", 400, None, 0.05)
    est = router.capacity.estimate("e0")
    assert est.ignored == 32 and est.samples == 0
    assert router.capacity.capacity("e0") == est.upper


def test_a_miss_on_a_prefix_recorded_moments_ago_is_not_an_eviction() -> None:
    learner = CapacityLearner(default_blocks=10_000)
    fresh = Outcome(100, 120, 0.0, occupancy=5000, recorded_age_s=0.2, ttft_s=0.8)
    assert learner.observe("e0", fresh) is None  # the first request may still be prefilling
    old = Outcome(100, 120, 0.0, occupancy=5000, recorded_age_s=30.0, ttft_s=0.8)
    assert learner.observe("e0", old) == "shrink"
    assert learner.capacity("e0") == round(5000 * 0.93)


def test_a_published_pool_bounds_the_estimate_but_is_not_taken_as_the_truth() -> None:
    learner = CapacityLearner(default_blocks=32768)
    learner.set_upper("e0", 2000)
    assert learner.capacity("e0") == 2000  # the best guess before any evidence
    learner.observe("e0", Outcome(100, 120, 0.0, occupancy=1500, recorded_age_s=10.0))
    assert learner.capacity("e0") < 1500  # running sequences took part of the pool
    for _ in range(20):  # the engine keeps far more than the index: grows, up to the pool
        learner.observe("e0", Outcome(0, 120, 0.95, occupancy=1000, ghost_blocks=120))
    assert learner.capacity("e0") == 2000


def test_hits_the_engine_had_but_the_index_never_trimmed_do_not_grow_it() -> None:
    # A prompt the index never saw there (another replica sent it, or a shared prefix):
    # evidence about that engine's content, not about the index's size.
    learner = CapacityLearner(default_blocks=32768)
    learner.observe("e0", Outcome(100, 120, 0.0, occupancy=900, recorded_age_s=10.0))
    before = learner.capacity("e0")
    assert learner.observe("e0", Outcome(0, 120, 0.9, occupancy=900, ghost_blocks=0)) is None
    assert learner.capacity("e0") == before


# -- placement ---------------------------------------------------------------------------------


def place_all(p: Placement, shares: dict[int, float], caps: dict[str, float]) -> dict[int, tuple]:
    names = sorted(caps)
    weights = dict.fromkeys(names, 1.0)

    def order(key: int, ns: Sequence[str]) -> list[str]:
        return sorted(ns, key=lambda n: hash((key, n)) & 0xFFFF)

    out = {}
    for key in shares:
        out[key] = p.homes(
            key, list(range(100)), names, weights, caps.__getitem__, shares.__getitem__, {}, order
        )
    p.rebalance(names, weights, caps.__getitem__, shares.__getitem__, order)
    return {k: v.homes for k, v in p.placed.items()}


def test_equal_prompts_are_partitioned_two_per_backend() -> None:
    shares = {k: 1 / 8 for k in range(8)}
    homes = place_all(Placement(), shares, dict.fromkeys(["a", "b", "c", "d"], 300.0))
    assert all(len(h) == 1 for h in homes.values())
    per_backend = [sum(1 for h in homes.values() if n in h) for n in "abcd"]
    assert per_backend == [2, 2, 2, 2]


def test_a_prompt_carrying_half_the_traffic_gets_several_homes_under_load() -> None:
    shares = {0: 0.5, **{k: 0.5 / 7 for k in range(1, 8)}}
    busy = Placement()
    busy.note_load(32.0)
    homes = place_all(busy, shares, dict.fromkeys(["a", "b", "c", "d"], 2000.0))
    assert len(homes[0]) == 3  # 0.5 x 4 backends / 0.8 of a fair backend load
    assert all(len(homes[k]) == 1 for k in range(1, 8))
    # Two requests in flight: a copy would spread no load, only cost a prefill and an eviction.
    quiet = Placement()
    quiet.note_load(2.0)
    homes = place_all(quiet, shares, dict.fromkeys(["a", "b", "c", "d"], 2000.0))
    assert all(len(h) == 1 for h in homes.values())


def test_prompts_no_cache_has_room_for_are_marked_overflow_but_still_spread() -> None:
    p = Placement()
    shares = {k: 1 / 8 for k in range(8)}
    homes = place_all(p, shares, dict.fromkeys(["a", "b", "c", "d"], 150.0))  # room for 1 each
    assert sum(1 for v in p.placed.values() if v.overflow) == 4
    assert sorted(sum(1 for h in homes.values() if n in h) for n in "abcd") == [2, 2, 2, 2]


def test_homes_stay_put_when_shares_wobble() -> None:
    p = Placement()
    caps = dict.fromkeys(["a", "b", "c", "d"], 300.0)
    first = place_all(p, {k: 1 / 8 for k in range(8)}, caps)
    wobbly = {k: 1 / 8 * (1.25 if k % 2 else 0.8) for k in range(8)}
    again = place_all(p, wobbly, caps)
    assert again == first and p.moves == 0


# -- what replicas exchange (the pure part; tests/test_shared_placement.py runs it over Redis) ---

FOUR = dict.fromkeys(["a", "b", "c", "d"], 300.0)


def place_one(p: Placement, key: int, caps: dict[str, float] = FOUR) -> tuple[str, ...]:
    names = sorted(caps)

    def order(k: int, ns: Sequence[str]) -> list[str]:
        return sorted(ns, key=lambda n: zlib.crc32(f"{k}:{n}".encode()))

    return p.homes(
        key, list(range(100)), names, dict.fromkeys(names, 1.0), caps.__getitem__,
        lambda _: 1 / 8, {}, order,
    )  # fmt: skip


def test_a_replica_that_does_not_lead_leaves_the_recomputation_to_the_one_that_does() -> None:
    p = Placement(rebalance_every=4, leads=False)
    for _ in range(10):
        p.observe(1, [1, 2, 3])
    assert not p.due()
    p.leads = True  # the leader went away: this replica recomputes again
    assert p.due()


def test_first_placements_and_recomputations_are_handed_over_once() -> None:
    p = Placement()
    for key in range(3):
        place_one(p, key)
    assert p.take_changes() == (False, {0: True, 1: True, 2: True})
    assert p.take_changes() == (False, {})
    names = sorted(FOUR)
    p.rebalance(names, dict.fromkeys(names, 1.0), FOUR.__getitem__, lambda _: 1 / 8, sorted_order)
    full, _ = p.take_changes()
    assert full  # the whole assignment goes out, replacing the previous one


def sorted_order(key: int, names: Sequence[str]) -> list[str]:
    return sorted(names)


def test_changes_that_could_not_be_delivered_go_out_next_time() -> None:
    p = Placement()
    place_one(p, 7)
    taken = p.take_changes()
    p.requeue(*taken)  # the exchange failed
    assert p.take_changes() == taken


def test_another_replicas_homes_replace_these_but_not_ones_decided_here_since() -> None:
    p = Placement()
    for key in range(8):
        place_one(p, key)
    p.take_changes()  # the last exchange
    place_one(p, 8)  # placed here after it: newer than anything another replica says
    mine = p.placed[8].homes
    crowded = next(n for n in sorted(FOUR) if n not in mine)
    theirs = {k: SharedHomes((crowded,), 100.0) for k in range(9)}
    differ = sum(1 for k in range(8) if p.placed[k].homes != (crowded,))
    assert differ >= 6  # two per backend, as placed here
    assert p.adopt(theirs, FOUR.__getitem__) == differ
    assert all(p.placed[k].homes == (crowded,) for k in range(8))
    assert p.placed[8].homes == mine
    assert p.adopted == differ and p.moves == 0  # adopted, not decided here
    # The room the placed prefixes leave is redone: that backend is full of them now.
    assert crowded in p.full_for(8, sorted(FOUR))


def test_nothing_is_adopted_while_a_recomputation_waits_to_go_out() -> None:
    p = Placement()
    for key in range(4):
        place_one(p, key)
    names = sorted(FOUR)
    p.rebalance(names, dict.fromkeys(names, 1.0), FOUR.__getitem__, lambda _: 1 / 8, sorted_order)
    before = {k: v.homes for k, v in p.placed.items()}
    assert p.adopt({0: SharedHomes(("zz",), 1.0)}, FOUR.__getitem__) == 0
    assert {k: v.homes for k, v in p.placed.items()} == before


def test_a_prefix_first_seen_through_another_replica_keeps_its_size_until_seen_here() -> None:
    p = Placement()
    p.adopt({5: SharedHomes(("a",), 80.0)}, FOUR.__getitem__)
    blocks = list(range(100))
    placed = p.observe(5, blocks)
    assert placed is not None and placed.size == 80.0  # nothing of this replica's to compare
    p.observe(5, blocks)
    assert placed.size > 80.0  # its requests here share 100 blocks


def test_the_changes_stay_bounded_where_nobody_takes_them() -> None:
    p = Placement(max_keys=4)
    for key in range(40):
        place_one(p, key)
    assert set(p.dirty) <= set(p.placed) and len(p.placed) <= 4


def test_an_adopted_capacity_counts_as_measured_and_a_newer_one_learned_here_stays() -> None:
    learner = CapacityLearner(default_blocks=32768)
    assert not learner.measured("e0")
    assert learner.adopt("e0", 2000)
    assert learner.capacity("e0") == 2000 and learner.measured("e0")
    assert learner.take_moved() == {}  # adopted, not learned here: nothing to hand over
    learner.observe("e0", Outcome(100, 120, 0.0, occupancy=1500, recorded_age_s=10.0))
    learned = learner.capacity("e0")
    assert learned < 1500
    assert not learner.adopt("e0", 3000)  # this replica's evidence is newer
    assert learner.capacity("e0") == learned
    assert learner.take_moved() == {"e0": learner.estimate("e0").capacity}
    assert learner.adopt("e0", 3000)  # handed over: the next word from another replica counts
    learner.set_upper("e1", 5000)
    learner.adopt("e1", 10**9)
    assert learner.capacity("e1") == 5000  # never above the engine's published pool
