"""A decision's work follows the prompt and its holders, not the fleet (issue 31), and decides
as the per-candidate path did: the index's holder walk against a binary search per backend,
the router (holder lookups, lazy placement reads, the picker's shortlist) against a reference
router that looks every candidate up, places over whole-fleet dicts and hands the picker every
candidate; and deterministic counts of what one decision touches at 48 and at 1,024 backends.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Collection, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import pytest

import plugins.bounded_load_picker as picker_module
from proxy.config import RoutingConfig
from proxy.routing.fleet import Fleet, Names
from proxy.routing.index import MemoryPrefixIndex, RedisPrefixIndex, open_redis
from proxy.routing.placement import Placement
from proxy.routing.rendezvous import hrw_names, hrw_order
from proxy.routing.router import Router
from proxy.routing.setup import build_policy
from proxy.routing.shortlist import HEAD
from proxy.routing.tallies import Placed, unfixed
from proxy.routing.types import BackendView, EngineLoad, RouteContext
from proxy.routing.views import ViewKeeper
from tests.routing_support import SHARED_URL, delete_prefix, unique_prefix


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ReferenceIndex(MemoryPrefixIndex):
    """Every backend's own binary search, as lookups were made before the holder masks."""

    def holders_now(self, blocks: Sequence[int], backends: Collection[str]) -> dict[str, int]:
        self.lookups += 1
        oldest = self.clock() - self.ttl_s if self.ttl_s else float("-inf")
        found = {b: self._match(self._lru.get(b), blocks, oldest) for b in backends}
        return {b: n for b, n in found.items() if n}


def _w(weights: Mapping[str, float], b: str) -> float:
    w = weights.get(b, 1.0)
    return w if w > 1e-9 else 1e-9


class ReferencePlacement(Placement):
    """Placing over dicts of every backend, sorting every spare, in hrw_names order (the
    placement before its lazy reads)."""

    def _accounting(
        self,
        backends: Sequence[str],
        weights: Mapping[str, float],
        capacity: Callable[[str], float],
        share_of: Callable[[int], float],
        skip: int,
    ) -> tuple[Mapping[str, float], MutableMapping[str, float]]:
        sizes, tally = self.tallies.sizes, self.tallies.weights
        room = {b: self.fill * capacity(b) - unfixed(sizes.get(b, 0)) for b in backends}
        assert self.tallies.shares is not None
        scale = self.tallies.shares.scale()
        return {b: unfixed(tally.get(b, 0)) * scale / _w(weights, b) for b in backends}, room

    def _choose(
        self,
        key: int,
        p: Placed,
        backends: Sequence[str],
        weights: Mapping[str, float],
        loads: Mapping[str, float],
        room: Mapping[str, float],
        holders: Sequence[str],
        order: Callable[[int, Sequence[str]], list[str]],
        previous: Sequence[str],
        total: float,
        busy: Callable[[str], float] | None = None,
        most: int = 0,
        whole: bool = False,
    ) -> tuple[tuple[str, ...], bool]:
        share = max(p.share, 0.0)
        need = self._needed(share, len(backends), 0 if whole else len(previous))
        total_weight = sum(_w(weights, b) for b in backends)
        per_copy = share / need
        need = min(need, most) if most else need
        hrw = hrw_names(key, list(backends))
        rank = {b: i for i, b in enumerate(hrw)}

        def within(b: str, slack: float = 1.0) -> bool:
            bound = (1.0 + self.imbalance * slack) * total / total_weight if total > 0 else math.inf
            return loads[b] + per_copy / _w(weights, b) <= bound + 1e-12

        def fits(b: str) -> bool:
            return room[b] >= p.size

        def keeps(b: str) -> bool:  # within twice the imbalance, or under a fair load without it
            fair = total / total_weight if total > 0 else math.inf
            return within(b, 2.0) or loads[b] < fair - 1e-12

        chosen: list[str] = []
        for b in previous:
            if len(chosen) < need and b in loads and b not in chosen and keeps(b) and fits(b):
                chosen.append(b)
        for b in sorted(holders, key=lambda b: (loads[b], rank[b])):
            if len(chosen) < need and b not in chosen and within(b) and fits(b):
                chosen.append(b)
        if len(chosen) < need:
            spare = sorted(
                (b for b in hrw if b not in chosen and fits(b)),
                key=lambda b: (not within(b), rank[b]),
            )
            now = busy or (lambda b: 0.0)
            pair = spare[: self.choices]
            if len(pair) == 2 and within(pair[1]):
                if (loads[pair[1]], now(pair[1])) < (loads[pair[0]], now(pair[0])):
                    spare[0], spare[1] = pair[1], pair[0]
            hosted = {b: self.tallies.hosted.get(b, 0) for b in backends}
            fair = sum(hosted.values()) / max(len(backends), 1)
            if spare and hosted[spare[0]] > fair:
                spare.sort(key=lambda b: (not within(b), hosted[b] > fair, hosted[b], rank[b]))
            chosen += spare[: need - len(chosen)]
        if len(chosen) < need:
            rest = sorted(
                (b for b in hrw if b not in chosen), key=lambda b: (not within(b), rank[b])
            )
            return tuple(chosen + rest[: need - len(chosen)]), True
        return tuple(chosen), False

    def _rebalance_steps(
        self,
        backends: Sequence[str],
        weights: Mapping[str, float],
        capacity: Callable[[str], float],
        share_of: Callable[[int], float],
        order: Callable[[int, Sequence[str]], list[str]],
        model: str | None = None,
    ) -> Iterator[int]:
        self.rebalances = max(self.rebalances + 1, self.requests // max(self.rebalance_every, 1))
        for key, p in self.placed.items():
            p.share = share_of(key)
        ranked = sorted(self.placed.items(), key=lambda kv: (-kv[1].share, kv[0]))
        keep = ranked[: self.max_keys]
        self.placed = dict(keep)
        tallies = self.tallies
        for key, gone in ranked[self.max_keys :]:
            self.dirty.pop(key, None)
            tallies.uncount(gone)
        for _, p in keep:
            p.seq = tallies.next_seq()
        tallies.reheap(self.placed)
        loads = dict.fromkeys(backends, 0.0)
        room = {b: self.fill * capacity(b) for b in backends}
        mine = [(k, p) for k, p in keep if model is None or p.model in (None, model)]
        total = sum(p.share for _, p in mine)
        for _, p in keep:  # another model's prefixes stay, counted on the engines they share
            if model is not None and p.model not in (None, model) and p.homes:
                here = [h for h in p.homes if h in loads]
                for h in here:
                    loads[h] += p.share / len(p.homes) / _w(weights, h)
                    room[h] -= p.size
                total += p.share * len(here) / len(p.homes)
        yield len(keep)
        for key, p in mine:
            if self.placed.get(key) is not p:
                continue
            previous = p.homes
            tallies.uncount(p)
            p.homes, p.overflow = self._choose(
                key, p, backends, weights, loads, room, [], order, previous, total
            )
            tallies.count(p)
            if previous and p.homes != previous:
                p.moves += 1
                self.moves += 1
            for h in p.homes:
                loads[h] += p.share / len(p.homes) / _w(weights, h)
                room[h] -= p.size
            yield 1 + len(previous) + len(p.homes)
        self.room = room
        self.reassigned = True
        self._fresh = {}


def routers(placement: bool, clock: Clock, capacity: int) -> tuple[Router, Router]:
    cfg = RoutingConfig(policy="prefix_aware", plugins={"bounded_load": {"placement": placement}})
    new = Router(build_policy(cfg), index=MemoryPrefixIndex(capacity, 60.0, clock=clock))
    policy = build_policy(cfg)
    options = policy.hints.placement or {}
    old = Router(
        policy,
        index=ReferenceIndex(capacity, 60.0, clock=clock),
        placement=ReferencePlacement(**options) if placement else None,
    )
    old.shortlists = False  # the picker sees every candidate
    return new, old


def fleet(
    rng: random.Random, names: list[str], weights: list[float], hot: set[str], sick: float = 0.02
) -> list[Any]:
    views = []
    for name, weight in zip(names, weights, strict=True):
        busy = name in hot
        waiting = rng.choice((0, 0, 0, 1, 2)) if rng.random() > 0.01 else 12
        views.append(
            BackendView(
                name=name,
                url=f"http://{name}",
                engine="vllm",
                role="mixed",
                weight=weight,
                healthy=rng.random() > sick,
                inflight=rng.randint(14, 30) if busy else rng.randint(0, 6),
                load=EngineLoad(waiting=waiting, kv_usage=rng.random()),
                models=frozenset({"m"}),
                backlog_tokens=rng.random() * 2000,
            )
        )
    return views


def body(
    rng: random.Random, systems: list[str], turn: int, earlier: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    if rng.random() < 0.08:  # short: ranked by score over every candidate
        return {"model": "m", "messages": [{"role": "user", "content": f"hi {turn}"}]}
    if earlier and rng.random() < 0.25:
        # A conversation's next turn: the home its earlier turn went to holds more of it
        # than the prefix its requests share (the picker puts such a home first).
        last = rng.choice(earlier)
        answer = {"role": "assistant", "content": "z" * rng.randint(300, 900)}
        more = {"role": "user", "content": f"and then {turn}? " + "w" * rng.randint(10, 200)}
        req = {"model": "m", "messages": [*last["messages"], answer, more]}
    else:
        system = rng.choices(systems, [1 / (k + 1) for k in range(len(systems))])[0]
        req = chat(system, f"question {turn}: " + "y" * rng.randint(10, 300))
    if earlier is not None:
        earlier.append(req)
    return req


def chat(system: str, question: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "m", "messages": messages}


@pytest.mark.parametrize("kept", [False, True], ids=["fresh", "kept"])
@pytest.mark.parametrize("seed", range(6))
async def test_decisions_are_those_of_the_per_candidate_path(seed: int, kept: bool) -> None:
    """Random fleets of 40-400 backends (uniform and mixed weights, loaded homes, an engine
    with a long queue now and then, unhealthy ones), Zipf-popular system prompts and short
    prompts, learned capacities moving: the router decides as the reference router does,
    winner, reason and the ranking as far as a retry reaches, and places alike.

    `kept`: as the proxy reads them, a few views change from one decision to the next (now
    and then all of them) and the router is handed a ViewKeeper's Views: its fleet-wide facts
    (the filters' epoch, in-flight total and least, longest queue) stand in for the passes
    the reference router makes over the same views."""
    rng = random.Random(seed)
    keeper = ViewKeeper()
    current: list[Any] = []
    clock = Clock()
    n = rng.choice((40, 90, 400)) if seed < 4 else rng.choice((70, 120))
    names = [f"e{i}" for i in range(n)]
    weights = [1.0] * n if seed % 2 == 0 else [rng.choice((0.5, 1.0, 2.0)) for _ in names]
    new, old = routers(placement=seed != 5, clock=clock, capacity=rng.choice((400, 4000)))
    systems = [
        f"[system {k}] " + "".join(rng.choices("abcdefgh ", k=rng.randint(300, 2500)))
        for k in range(12)
    ]
    shortlisted = whole = 0
    earlier: list[dict[str, Any]] = []
    for turn in range(160):
        clock.now += rng.random() * 2
        hot = set(rng.sample(names, rng.randint(0, n // 2))) if rng.random() < 0.3 else set()
        views = fleet(rng, names, weights, hot, 0.001 if kept else 0.02)
        handed: list[Any] = views
        if kept:
            changed: list[int] | None = None
            if current and rng.random() < 0.9:
                changed = rng.sample(range(n), rng.randint(0, 6))
                for i in changed:
                    current[i] = views[i]
            else:
                current = list(views)
            handed, views = keeper.read(current, changed), list(current)
        req = body(rng, systems, turn, earlier)
        decisions = []
        for router, seen in ((new, handed), (old, views)):
            ctx = RouteContext(f"r{seed}-{turn}", "m", "chat", req, {}, clock.now)
            decisions.append((await router.route(ctx, seen), ctx))
        await asyncio.sleep(0)  # their placements' upkeep, left for after the decision
        (got, ctx_new), (want, ctx_old) = decisions
        assert got.winner == want.winner, (turn, got.reason, want.reason)
        assert got.reason == want.reason
        assert got.ranking[:HEAD] == want.ranking[:HEAD]
        assert got.matched_blocks == want.matched_blocks
        assert ctx_new.homes == ctx_old.homes
        shortlisted += len(got.ranking) < len(want.ranking)
        whole += new.fleets.epoch is not None  # decided on the Views' facts, no filter dropped
        if got.winner is not None and rng.random() < 0.3:  # the engine reports its cache
            tokens = max(ctx_new.prompt_chars // 4, 1)
            cached = int(tokens * rng.random())
            for router, decided in ((new, got), (old, want)):
                router.observe(decided, got.winner, tokens, cached, 0.2)
    if new.placement is not None:
        assert old.placement is not None
        assert {k: p.homes for k, p in new.placement.placed.items()} == {
            k: p.homes for k, p in old.placement.placed.items()
        }
    assert shortlisted > 0  # the shortlist was used (and not only the whole-fleet path)
    assert (whole > 20) if kept else whole == 0


def test_a_fleets_kept_orders_are_those_computed_afresh() -> None:
    """Rendezvous keeps, per prompt head, the placement's order (hrw_names) and the pickers'
    (hrw_order), each from the same hashes of the names: asked in any order, for new heads
    and kept ones, they are what the plain functions give."""
    rng = random.Random(5)
    names = [f"e{i}" for i in range(300)]
    for weights in ([rng.choice((0.5, 1.0, 2.0)) for _ in names], [1.0] * 300, [2.0] * 300):
        orders_agree(rng, names, weights)  # (alike weights: scored as read, orders.py)


def orders_agree(rng: random.Random, names: list[str], weights: list[float]) -> None:
    fleet = Fleet(Names(names), weights)
    views = [
        BackendView(
            name=n, url=f"http://{n}", engine="vllm", role="mixed", weight=w, healthy=True,
            inflight=0, load=EngineLoad(), models=None,
        )
        for n, w in zip(names, weights, strict=True)
    ]  # fmt: skip
    keys = [rng.getrandbits(64) for _ in range(6)]
    for key in [*keys, *reversed(keys), *keys]:
        if rng.random() < 0.5:
            plain, weighted = fleet.rendezvous(key, fleet.names), fleet.rendezvous.weighted(key)
        else:
            weighted, plain = fleet.rendezvous.weighted(key), fleet.rendezvous(key, fleet.names)
        assert list(plain) == hrw_names(key, names)
        assert [views[i] for i in weighted] == hrw_order(key, views)


def test_holder_lookups_answer_as_a_binary_search_per_backend_did() -> None:
    """Through records, trims, TTL expiry, records dated out of order and departures, the
    holder walk gives every backend the answer its own binary search gives."""
    rng = random.Random(3)
    clock = Clock()
    index = MemoryPrefixIndex(capacity_blocks=60, ttl_s=20.0, clock=clock)
    reference = ReferenceIndex(capacity_blocks=60, ttl_s=20.0, clock=clock)
    names = [f"b{i}" for i in range(80)]
    heads = [[rng.getrandbits(63) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    for step in range(1500):
        clock.now += rng.random() * 2 if rng.random() < 0.95 else -1.0
        head = rng.choice(heads)
        blocks = head[: rng.randint(1, len(head))] + [rng.getrandbits(63) for _ in range(3)]
        draw, backend = rng.random(), rng.choice(names)
        for idx in (index, reference):
            if draw < 0.6:
                idx.record_now(backend, blocks, clock.now - 5.0 if draw < 0.03 else None)
            elif draw < 0.62:
                idx.forget(backend)
            elif draw < 0.64:
                idx.set_capacity(backend, 1 + step % 50)
        asked = tuple(rng.sample(names, rng.randint(1, len(names))))
        assert index.holders_now(blocks, asked) == reference.holders_now(blocks, asked), step


def test_a_lookup_probes_the_same_whatever_the_fleet() -> None:
    """Six backends hold a prompt (three of them all of it): a lookup over 16 or 1,024
    backends makes the same mask probes and reads the same backends."""
    probes = []
    for n in (16, 1024):
        index = MemoryPrefixIndex()
        names = tuple(f"b{i}" for i in range(n))
        prompt = list(range(1, 201))
        for i, name in enumerate(names):
            index.record_now(name, [10_000 + i, *range(i * 7, i * 7 + 40)])  # others
        for i, name in enumerate(names[:6]):
            index.record_now(name, prompt[: 60 + 70 * (i % 3)])
        before = index.probes
        found = index.holders_now(prompt, names)
        assert found == {names[i]: 60 + 70 * (i % 3) for i in range(6)}
        probes.append(index.probes - before)
    assert probes[0] == probes[1] <= 6 + 3 * 8


async def test_a_decision_touches_the_same_few_backends_at_48_or_1024() -> None:
    """A placed prompt at low concurrency (one home): the picker is handed the same few
    backends, the rendezvous orders are kept, the placement reads nothing per backend and
    the index probes alike, whether the fleet has 48 engines or 1,024."""
    counts = []
    for n in (48, 1024):
        cfg = RoutingConfig(policy="prefix_aware")
        router = Router(build_policy(cfg), index=MemoryPrefixIndex(clock=Clock()))
        views = [
            BackendView(f"e{i}", f"http://e{i}", "vllm", "mixed", 1.0, True, 0, EngineLoad(), None)
            for i in range(n)
        ]
        system = "You are a careful assistant. " * 40
        handed: list[int] = []
        capacity_reads = [0]
        learner_capacity = router.capacity.capacity

        def counted(b: str, reads: list[int] = capacity_reads, read: Any = learner_capacity) -> int:
            reads[0] += 1
            return int(read(b))

        router.capacity.capacity = counted  # type: ignore[method-assign]
        pick = router.policy.picker.pick

        def picking(
            ctx: RouteContext,
            candidates: list[BackendView],
            totals: Any,
            handed: list[int] = handed,
            pick: Any = pick,
        ) -> Any:
            handed.append(len(candidates))
            return pick(ctx, candidates, totals)

        router.policy.picker.pick = picking  # type: ignore[method-assign]
        index = router.index
        assert isinstance(index, MemoryPrefixIndex)
        for turn in range(40):  # warm: placed, recorded, orders computed
            req = chat(system, f"q{turn}")
            await router.route(RouteContext(f"r{turn}", "m", "chat", req, {}, 0.0), views)
        fleet_orders = router.fleets.fleet.rendezvous.computed if router.fleets.fleet else 0
        probes, reads = index.probes, capacity_reads[0]
        handed.clear()
        req = chat(system, "last")
        decision = await router.route(RouteContext("last", "m", "chat", req, {}, 0.0), views)
        assert decision.reason.startswith("placed prefix")
        assert router.fleets.fleet is not None
        counts.append(
            (
                handed,
                index.probes - probes,
                capacity_reads[0] - reads,
                router.fleets.fleet.rendezvous.computed - fleet_orders,
                router.fleets.builds,
            )
        )
    small, large = counts
    assert large == small
    assert large[0][0] <= 2 * HEAD + 2  # the shortlist (48 > SHORTLIST_ABOVE: used at both)


@pytest.mark.redis
async def test_a_shared_lookup_sends_one_key_and_reads_the_holders_only() -> None:
    """Redis: the lookup script gets the prompt's head set, not a key per backend, and
    answers for the backends that recorded the prompt."""
    kp = unique_prefix("scale")
    index = RedisPrefixIndex(open_redis(SHARED_URL), key_prefix=kp, owns_client=True)
    await index.start()
    try:
        names = tuple(f"b{i}" for i in range(1024))
        index.record("b7", list(range(1, 40)))
        index.record("b900", list(range(1, 20)))
        index.record("b3", [99, 1, 2])
        await index.flush()
        sent: list[list[str]] = []
        script = index._script

        async def counting(keys: list[str], args: list[Any]) -> Any:
            sent.append(keys)
            return await script(keys=keys, args=args)

        index._script = counting  # type: ignore[assignment]
        assert await index.holders(list(range(1, 40)), names) == {"b7": 39, "b900": 19}
        assert [len(k) for k in sent] == [1]
        assert await index.lookup([99, 1, 2, 3], ["b3", "b7"]) == {"b3": 3, "b7": 0}
    finally:
        await index.close()
        delete_prefix(kp)


def test_the_picker_module_is_the_one_the_shortlist_mirrors() -> None:
    """The shortlist is drawn for bounded_load's rules (proxy/routing/shortlist.py): the
    picker still splits by the load bound and orders by rendezvous from the vocabulary that
    honours a shortlist's fleet-wide bound."""
    from proxy.routing import rendezvous

    assert picker_module.split_by_load is rendezvous.split_by_load
    assert picker_module.hrw_order is rendezvous.hrw_order


@pytest.mark.redis
async def test_a_lookup_trying_the_last_common_depth_first_answers_as_a_search_does() -> None:
    """Redis: the depth most holders of a head held last time is tried first; whatever it is
    (deeper or shallower than a holder's, past the prompt's end, for another prompt of the
    same head), each holder's depth is the binary search's, as the local copy finds it."""
    kp = unique_prefix("depth")
    index = RedisPrefixIndex(open_redis(SHARED_URL), key_prefix=kp, owns_client=True)
    await index.start()
    rng = random.Random(7)
    try:
        names = [f"b{i}" for i in range(60)]
        chain = list(range(1, 121))
        for name in names:
            depth = rng.choice((120, 80, 80, 80, 30, 2, 1))
            index.record(name, chain[:depth])
        await index.flush()
        prompts = [chain, chain[:80], chain[:81], chain[:5], chain[:1], [*chain[:100], 999, 998]]
        for _ in range(3):
            for blocks in prompts:
                got = await index.holders(blocks, names)
                assert got == index.local.holders_now(blocks, names), blocks[-1]
                assert index._depths[blocks[0]] in set(got.values())
    finally:
        await index.close()
        delete_prefix(kp)


@pytest.mark.redis
async def test_a_replica_judges_a_shared_backend_by_every_replicas_records() -> None:
    """Redis: the capacity learner's evidence reads the shared index, not this replica's
    share of it: occupancy is what the backend's ZSET holds after the last write (behind a
    round robin of three, the local copy holds about a third), and a match another replica
    recorded counts as just recorded (its age unknown: a miss on it proves no eviction).
    Without the feed (local_lookups false) the copy holds only this replica's records."""
    kp = unique_prefix("occupancy")
    a = RedisPrefixIndex(
        open_redis(SHARED_URL), key_prefix=kp, owns_client=True, local_lookups=False
    )
    b = RedisPrefixIndex(
        open_redis(SHARED_URL), key_prefix=kp, owns_client=True, local_lookups=False
    )
    await a.start()
    await b.start()
    try:
        theirs, ours = list(range(1, 51)), list(range(1000, 1005))
        a.record("x", theirs)
        await a.flush()
        b.record("x", ours)
        await b.flush()
        assert b.local.occupancy("x") == 5
        assert b.occupancy("x") == 55
        matched = (await b.holders(theirs, ["x"]))["x"]
        assert matched == 50
        seen = b.probe("x", theirs, matched).last_seen
        assert seen is not None and abs(seen - time.time()) < 5
        assert b.probe("x", ours, 5).last_seen == b.local.probe("x", ours, 5).last_seen
    finally:
        await a.close()
        await b.close()
        delete_prefix(kp)
