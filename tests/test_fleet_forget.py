"""A backend that leaves the fleet is forgotten everywhere the proxy kept something of it, and
a new (cold) engine at a known address starts cold: routing's learned state, the shared keys
in Redis (deleted once, however many replicas forget), /metrics, the doctor's windows, the
upstream pool and the KV-event view. Placement moves only what the change requires."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from proxy.config import RoutingConfig, TelemetryConfig, TimeoutsConfig, load_config
from proxy.doctor.collector import BackendInfo, Collector
from proxy.kvevents.subscriber import KvEventSubscriber
from proxy.routing.backlog import PrefillBacklog
from proxy.routing.capacity import CapacityLearner, Outcome
from proxy.routing.index import MemoryPrefixIndex, RedisPrefixIndex, open_redis
from proxy.routing.inflight import InflightBoard
from proxy.routing.learn import PrefillLearner
from proxy.routing.placement import Placement
from proxy.routing.popularity import PrefixPopularity
from proxy.routing.rendezvous import hrw_names
from proxy.routing.router import Router
from proxy.routing.setup import build_router, build_routing
from proxy.routing.shared_placement import SharedPlacement
from proxy.telemetry import Telemetry
from proxy.telemetry.batcher import EncodedBatcher
from proxy.upstream.pool import Upstream
from tests.routing_support import SHARED_URL, delete_prefix, unique_prefix
from tests.support import free_port
from tests.test_capacity import SYSTEMS, backend, chat
from tests.test_telemetry import facts, start
from tests.test_upstream_hygiene import HeldServer, _request

FOUR = [f"10.0.0.{i}:8000" for i in range(1, 5)]


# -- routing's own state (pure) -----------------------------------------------------------------


def test_the_memory_index_answers_nothing_for_a_forgotten_backend_and_keeps_the_rest() -> None:
    index = MemoryPrefixIndex(capacity_blocks=8)
    index.record("a", list(range(20)))  # over capacity: trimmed blocks become ghosts
    index.record("b", list(range(20)))
    index.set_capacity("a", 6)
    assert index.lookup_now(list(range(5)), ["a", "b"]) == {"a": 5, "b": 5}

    index.forget("a")
    assert index.lookup_now(list(range(5)), ["a", "b"]) == {"a": 0, "b": 5}
    assert index.occupancy("a") == 0 and index.capacity("a") == 8  # back to the default
    assert index.probe("a", list(range(20)), 0).ghost_blocks == 0  # no ghosts either
    assert index.backends() == ["b"] and "a" not in index.info()["capacity"]


def test_the_learners_and_the_backlog_forget_one_backend_only() -> None:
    capacity = CapacityLearner(default_blocks=1000)
    for name in ("a", "b"):
        outcome = Outcome(100, 120, 0.0, occupancy=160, recorded_age_s=10.0)
        assert capacity.observe(name, outcome) == "shrink"
    learner, backlog = PrefillLearner(), PrefillBacklog(clock=lambda: 0.0)
    for name in ("a", "b"):
        for n in range(8):
            learner.observe(name, 1000 + 100 * n, 0.1 + 0.01 * n)
        backlog.add(name, 500, 1000.0)

    for owner in (capacity, learner, backlog):
        owner.forget("a")
    assert set(capacity.estimates) == {"b"} and capacity.take_moved() == {"b": pytest.approx(148.8)}
    assert capacity.capacity("a") == 1000  # a new engine there starts at the default
    assert learner.rate("a") is None and learner.rate("b") is not None
    assert backlog.snapshot(lambda _: 1000.0) == {"b": 500}


def placed(seed: int, names: Sequence[str], keys: int = 120, steps: int = 3000) -> Any:
    """A placement attached to its popularity, fed `steps` requests over `keys` prefixes with
    Zipf-like traffic through the calls the router makes; returns (placement, popularity,
    feed) where feed(names, steps) goes on with the same traffic."""
    rng = random.Random(seed)
    pop = PrefixPopularity()
    placement = Placement()
    placement.attach(pop)
    prefixes = [rng.getrandbits(63) for _ in range(keys)]
    weights = [1 / (i + 1) for i in range(keys)]
    blocks = {k: list(range(k, k + 16)) for k in prefixes}

    def feed(names: Sequence[str], n: int) -> list[int]:
        """n requests; returns the rebalance count after each."""
        after = []
        w = dict.fromkeys(names, 1.0)
        for _ in range(n):
            key = rng.choices(prefixes, weights)[0]
            pop.observe(key)
            placement.note_load(16.0)
            placement.observe(key, blocks[key])
            if placement.due():
                placement.rebalance(names, w, lambda _: 1e5, pop.current, hrw_names)
            placement.homes(
                key, blocks[key], names, w, lambda _: 1e5, pop.current, {}, hrw_names, 4,
                lambda _: 0.0,
            )  # fmt: skip
            after.append(placement.rebalances)
        return after

    feed(names, steps)
    return placement, pop, feed


def homes_of(placement: Placement) -> dict[int, tuple[str, ...]]:
    return {k: p.homes for k, p in placement.placed.items()}


def test_on_a_leave_only_the_departed_backends_prefixes_move_to_their_next_rendezvous_choice() -> (
    None
):
    placement, _, feed = placed(1, FOUR)
    before = homes_of(placement)
    gone, rest = FOUR[2], [n for n in FOUR if n != FOUR[2]]
    on_it = [k for k, h in before.items() if gone in h]
    assert 10 < len(on_it) < len(before)

    assert placement.forget(gone, hrw_names, rest) == len(on_it)
    after = homes_of(placement)
    for key, homes in before.items():
        if gone not in homes:
            assert after[key] == homes  # every other prefix keeps its homes
        else:
            others = [h for h in homes if h != gone]
            nxt = next(b for b in hrw_names(key, rest) if b not in others)
            assert after[key] == tuple(nxt if h == gone else h for h in homes)
    tallies = placement.tallies
    assert gone not in tallies.hosted and gone not in tallies.sizes and gone not in placement.room
    assert sum(tallies.hosted.values()) == sum(len(h) for h in after.values())
    # The moves go out to the other replicas with the next exchange.
    assert set(on_it) <= set(placement.take_changes()[1])
    feed(rest, 500)  # and placing goes on without it
    assert all(gone not in h for h in homes_of(placement).values())


def test_when_a_fifth_backend_joins_four_a_fifth_of_the_prefixes_move_nearly_all_onto_it() -> None:
    """Measured with the router's calls and real rendezvous order, eight seeds: 6-30% of the
    placed prefixes (17.5% of all of them; 1/N is 20%) change homes, carrying 5-11% of the
    traffic; 163 of the 168 moves go onto the newcomer, the other five are cold prefixes
    (under 1% of the traffic each) reshuffled by the same rebalance; at most one of the ten
    hottest moves; and nothing moves before the first rebalance after the join (no herd onto
    the empty backend). The newcomer's share then grows as the rebalances' hysteresis allows."""
    five = [*FOUR, "10.0.0.5:8000"]
    moved_all = both_all = 0
    for seed in range(1, 9):
        placement, pop, feed = placed(seed, FOUR)
        before = homes_of(placement)
        rebalances = placement.rebalances
        first = feed(five, 3000)
        # Between the join and the next rebalance, placed prefixes stay where they are.
        quiet = next(i for i, n in enumerate(first) if n > rebalances)
        placement_then, _, feed_then = placed(seed, FOUR)
        feed_then(five, quiet)
        now = homes_of(placement_then)
        assert all(now[k] == h for k, h in before.items() if k in now)

        after = homes_of(placement)
        both = [k for k in before if k in after]
        moved = [k for k in both if after[k] != before[k]]
        share = sum(pop.current(k) for k in moved) / sum(pop.current(k) for k in both)
        assert len(moved) / len(both) <= 0.31 and share <= 0.2  # 1/N = 0.2
        elsewhere = [k for k in moved if five[-1] not in after[k]]
        assert len(elsewhere) <= 3 and all(pop.current(k) < 0.01 for k in elsewhere)
        hottest = sorted(both, key=lambda k: -pop.current(k))[:10]
        assert sum(after[k] != before[k] for k in hottest) <= 1
        assert moved  # the newcomer gets work
        moved_all += len(moved)
        both_all += len(both)
    assert moved_all / both_all <= 0.2


class FakeView:
    live = True

    def __init__(self, resettable: bool) -> None:
        self.resets = 0
        if resettable:
            self.reset = self._reset

    def match(self, blocks: Sequence[int]) -> int:
        return len(blocks)

    def match_tiers(self, blocks: Sequence[int]) -> tuple[int, ...]:
        return (len(blocks),) * 4

    def _reset(self) -> None:
        self.resets += 1


async def routed_router() -> Router:
    router = build_router(RoutingConfig(policy="prefix_aware"), index=MemoryPrefixIndex())
    views = [backend(f"e{i}") for i in range(4)]
    for i in range(64):
        decision = await router.route(chat(SYSTEMS[i % 8], i), views)
        assert decision.winner is not None
        router.observe(None, decision.winner, 2000, 0, 0.2)
    return router


async def test_the_router_forgets_a_backend_everywhere_and_moves_its_prefixes() -> None:
    router = await routed_router()
    placement, index = router.placement, router.index
    assert placement is not None and isinstance(index, MemoryPrefixIndex)
    gone = max(index.backends(), key=index.occupancy)
    router.exact = {gone: FakeView(True), "e3": FakeView(False)}  # type: ignore[dict-item]
    router.capacity.set_upper(gone, 500)
    homed = [k for k, p in placement.placed.items() if gone in p.homes]
    assert homed and router.learner.rate(gone) and router.backlog_tokens(gone) > 0

    rest = [f"e{i}" for i in range(4) if f"e{i}" != gone]
    assert router.forget(gone, rest) == len(homed)
    assert await index.lookup(
        router.hasher.key("m", "chat", chat(SYSTEMS[0], 0).body).blocks, [gone]
    ) == {gone: 0}
    assert gone not in index.backends() and gone not in router.capacity.estimates
    assert router.learner.rate(gone) is None and router.backlog_tokens(gone) == 0
    assert gone not in router.exact and "e3" in router.exact
    assert all(gone not in p.homes for p in placement.placed.values())
    assert gone not in router.cache_info()["backends"]


async def test_a_restarted_engine_starts_cold_but_keeps_its_homes_and_prefill_rate() -> None:
    router = await routed_router()
    placement, index = router.placement, router.index
    assert placement is not None and isinstance(index, MemoryPrefixIndex)
    name = max(index.backends(), key=index.occupancy)
    kept_view, dropped_view = FakeView(True), FakeView(False)
    router.exact = {name: kept_view, "other": dropped_view}  # type: ignore[dict-item]
    router.capacity.set_upper(name, 500)
    homes = {k: p.homes for k, p in placement.placed.items()}
    rate = router.learner.rate(name)

    router.reset_cache(name)
    router.reset_cache("other")
    assert index.occupancy(name) == 0 and name not in router.capacity.estimates
    assert kept_view.resets == 1 and router.exact == {name: kept_view}  # reset in place
    assert {k: p.homes for k, p in placement.placed.items()} == homes
    assert router.learner.rate(name) == rate


# -- the shared keys in Redis: deleted once ----------------------------------------------------


@pytest.fixture
def kp() -> Iterator[str]:
    prefix = unique_prefix("forget")
    yield prefix
    delete_prefix(prefix)


def keys_of(prefix: str) -> list[str]:
    client = redis.Redis.from_url(SHARED_URL)
    try:
        return sorted(k.decode() for k in client.scan_iter(match=f"{prefix}:*", count=1000))
    finally:
        client.close()


@pytest.mark.redis
async def test_two_replicas_forgetting_a_backend_delete_its_index_key_once(kp: str) -> None:
    replicas = [RedisPrefixIndex(open_redis(SHARED_URL), key_prefix=kp, owns_client=True)]
    replicas.append(RedisPrefixIndex(open_redis(SHARED_URL), key_prefix=kp, owns_client=True))
    blocks = list(range(100, 140))
    try:
        for r in replicas:  # not started: the test writes itself (no background writer)
            r.record("gone:8000", blocks)
            r.record("stays:8000", blocks)
            await r.flush()
        assert replicas[0].key("gone:8000") in keys_of(kp)

        for r in replicas:
            r.forget("gone:8000")
            await r.purge()
        assert [r.departures.info() for r in replicas] == [
            {"pending": 0, "deleted": 1, "skipped": 0},
            {"pending": 0, "deleted": 0, "skipped": 1},
        ]
        left = keys_of(kp)
        assert replicas[0].key("gone:8000") not in left
        assert replicas[0].key("stays:8000") in left
        for r in replicas:
            found = await r.lookup(blocks, ["gone:8000", "stays:8000"])
            assert found == {"gone:8000": 0, "stays:8000": 40}
            assert r.occupancy("gone:8000") == 0

        # The address comes back (a new engine): what is recorded now survives a late
        # replica's forget of the old departure, whose guard still stands.
        replicas[0].record("gone:8000", blocks[:8])
        await replicas[0].flush()
        replicas[1].forget("gone:8000")
        await replicas[1].purge()
        assert replicas[1].departures.info()["skipped"] == 2
        assert await replicas[0].lookup(blocks, ["gone:8000"]) == {"gone:8000": 8}
    finally:
        for r in replicas:
            await r.close()


@pytest.mark.redis
async def test_records_queued_before_the_forget_are_dropped_and_those_after_it_kept(
    kp: str,
) -> None:
    index = RedisPrefixIndex(open_redis(SHARED_URL), key_prefix=kp, owns_client=True)
    try:
        index.record("b:1", list(range(10)))  # not yet written
        index.forget("b:1", departure="pod-uid-1")
        index.record("b:1", list(range(50, 54)))  # the new engine's first prompt
        await index.flush()
        assert await index.lookup(list(range(10)), ["b:1"]) == {"b:1": 0}
        assert await index.lookup(list(range(50, 54)), ["b:1"]) == {"b:1": 4}
        assert index.info()["departures"]["deleted"] == 1
    finally:
        await index.close()


async def test_with_redis_down_forgetting_degrades_logs_once_and_deletes_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    index = RedisPrefixIndex(open_redis(url, timeout_s=0.05), key_prefix="x", timeout_s=0.05)
    board = InflightBoard(open_redis(url, timeout_s=0.05), key_prefix="x", timeout_s=0.05)
    with caplog.at_level(logging.WARNING, logger="warmroute.routing"):
        await index.start()
        index.record("b:1", [1, 2, 3])
        board.acquire("b:1")
        for _ in range(3):
            index.forget("b:1")
            board.forget("b:1")
            await index.purge()
            await board.purge()
        assert index.mode == "memory-fallback"
        assert await index.lookup([1, 2, 3], ["b:1"]) == {"b:1": 0}
        assert index.departures.info()["pending"] == 1  # deleted once Redis answers
        assert board.forgotten == {"b:1"} and board.get("b:1") == 0
        await index.close()
        await board.close()
    down = [r for r in caplog.records if "Redis unavailable" in r.getMessage()]
    assert len(down) == 1


@pytest.mark.redis
async def test_each_replica_deletes_its_own_in_flight_field_of_a_departed_backend(kp: str) -> None:
    boards = [
        InflightBoard(open_redis(SHARED_URL), key_prefix=kp, replica_id=f"r{i}") for i in (1, 2)
    ]
    client = redis.Redis.from_url(SHARED_URL)
    try:
        for b in boards:
            b.acquire("gone:1")
            b.acquire("stays:1")
            await b.sync()
        await boards[0].sync()
        assert boards[0].get("gone:1") == 2

        def fields() -> list[str]:
            return sorted(f.decode() for f in client.hkeys(boards[0].keys[0]))

        assert fields() == ["r1|gone:1", "r1|stays:1", "r2|gone:1", "r2|stays:1"]

        boards[0].forget("gone:1")
        assert boards[0].get("gone:1") == 0 and "gone:1" not in boards[0].snapshot()
        await boards[0].purge()
        assert fields() == ["r1|stays:1", "r2|gone:1", "r2|stays:1"]
        assert boards[0].forgotten == {"gone:1"}  # until a sync has deleted it too
        boards[1].forget("gone:1")
        await boards[1].step()  # the background sync deletes it as well
        assert fields() == ["r1|stays:1", "r2|stays:1"] and not boards[1].forgotten
        await boards[0].sync()
        assert "gone:1" not in boards[0].snapshot()
    finally:
        for b in boards:
            await b.close()
            await b.client.aclose()
        client.close()


@pytest.mark.redis
async def test_replicas_forgetting_a_backend_remove_its_shared_homes_and_capacity_once(
    kp: str,
) -> None:
    routers = [
        build_router(RoutingConfig(policy="prefix_aware"), index=MemoryPrefixIndex())
        for _ in range(2)
    ]
    shared = []
    for i, router in enumerate(routers):
        assert router.placement is not None
        shared.append(
            SharedPlacement(
                open_redis(SHARED_URL), router.placement, router.capacity, key_prefix=kp,
                replica_id=f"replica-{i}",
            )
        )  # fmt: skip
    views = [backend(f"e{i}") for i in range(4)]
    client = redis.Redis.from_url(SHARED_URL)

    def shared_homes() -> dict[int, list[str]]:
        import orjson

        raw = client.hgetall(shared[0].keys[0])
        return {int(k): orjson.loads(v.split(b"|", 1)[1])[0] for k, v in raw.items()}

    try:
        for rep in shared:
            await rep.step()
        for router in routers:
            for i in range(16):
                assert (await router.route(chat(SYSTEMS[i % 8], i), views)).winner
        outcome = Outcome(100, 120, 0.0, occupancy=160, recorded_age_s=10.0)
        for router in routers:
            for name in ("e0", "e1", "e2", "e3"):
                router.capacity.observe(name, outcome)
        for _ in range(2):
            for rep in shared:
                await rep.step()
        before = shared_homes()
        gone = max(("e0", "e1", "e2", "e3"), key=lambda n: sum(n in h for h in before.values()))
        assert any(gone in h for h in before.values())
        assert client.hexists(shared[0].keys[1], gone)

        rest = [n for n in ("e0", "e1", "e2", "e3") if n != gone]
        for router, rep in zip(routers, shared, strict=True):
            router.forget(gone, rest)
            rep.forget(gone)
        for _ in range(2):
            for rep in shared:
                assert await rep.step()
        assert [rep.info()["departures"] for rep in shared] == [
            {"pending": 0, "deleted": 1, "skipped": 0},
            {"pending": 0, "deleted": 0, "skipped": 1},
        ]
        after = shared_homes()
        assert not client.hexists(shared[0].keys[1], gone)
        assert all(gone not in h for h in after.values())
        for key, homes in before.items():  # what moved is where every replica moved it
            if gone in homes:
                nxt = next(b for b in hrw_names(key, rest) if b not in homes)
                assert after[key] == [nxt if h == gone else h for h in homes]
        local = [{k: p.homes for k, p in r.placement.placed.items()} for r in routers]  # type: ignore[union-attr]
        assert local[0] == local[1] and all(gone not in h for h in local[0].values())
        assert all(gone not in r.capacity.estimates for r in routers)
        # Back in the fleet: its entries are adopted again at once.
        shared[1].joined(gone)
        assert gone not in shared[1]._departed() and gone in shared[0]._departed()
    finally:
        for rep in shared:
            await rep.close()
            await rep.client.aclose()
        client.close()


@pytest.mark.redis
async def test_the_apps_routing_forgets_a_backend_here_and_in_redis(kp: str) -> None:
    env = {"WARMROUTE_REDIS__KEY_PREFIX": kp}
    flags = {"backends": ["http://127.0.0.1:9"], "redis": SHARED_URL}
    routing = build_routing(load_config(flags=flags, env=env))
    # Not started: the test writes, exchanges and syncs itself, so that no background round
    # under way at the same time (the index's writer, the board's sync) races its checks.
    views = [backend(f"e{i}") for i in range(4)]
    try:
        for i in range(16):
            ctx = chat(SYSTEMS[i % 8], i)
            decision = await routing.router.route(ctx, views)
            assert decision.winner is not None
            routing.router.record(decision, decision.winner)
            routing.board.acquire(decision.winner)
        assert isinstance(routing.index, RedisPrefixIndex)
        await routing.index.flush()
        await routing.board.sync()
        gone = max(routing.index.local.backends(), key=routing.index.occupancy)
        assert any(k.endswith(f":{gone}") for k in keys_of(kp))

        await routing.forget(gone, [v.name for v in views if v.name != gone])
        assert [k for k in keys_of(kp) if k.endswith(f":{gone}") and "!departed" not in k] == []
        client = redis.Redis.from_url(SHARED_URL)
        try:
            assert not any(
                f.endswith(b"|" + gone.encode()) for f in client.hkeys(routing.board.keys[0])
            )
        finally:
            client.close()
        assert gone not in routing.info()["inflight"]["inflight"]
        await routing.board.sync()
        assert not routing.board.forgotten  # the sync deleted it again, and forgot it
        assert gone not in routing.info()["index"]["capacity"]
    finally:
        await routing.close()


# -- telemetry -----------------------------------------------------------------------------------


@pytest.fixture
def tel() -> Iterator[Telemetry]:
    t = Telemetry(TelemetryConfig(), span_exporter=InMemorySpanExporter())
    yield t
    t.shutdown()


def serve(t: Telemetry, name: str, address: str, port: int, *, fail: bool = False) -> None:
    rec = start(t)
    if fail:
        rec.attempt(backend="other:1", address="10.9.9.9", port=1, attempt=1).fail("500", 500)
    rec.attempt(backend=name, address=address, port=port, attempt=2 if fail else 1)
    rec.finish(facts(), status=200)
    rec = start(t)
    rec.attempt(backend=name, address=address, port=port, attempt=1).fail("timeout")
    rec.finish(None, status=503, error_type="timeout", backend=name)


def series_of(t: Telemetry, needle: str) -> list[str]:
    text = t.prometheus_text()[0].decode()
    return [ln for ln in text.splitlines() if needle in ln and not ln.startswith("#")]


def test_a_forgotten_backend_leaves_no_series_in_metrics(tel: Telemetry) -> None:
    serve(tel, "10.0.0.1:8001", "10.0.0.1", 8001, fail=True)
    serve(tel, "10.0.0.2:8002", "10.0.0.2", 8002)
    board = InflightBoard()
    board.acquire("10.0.0.1:8001")
    board.acquire("10.0.0.2:8002")
    tel.read_inflight(board.snapshot)
    gone, stays = 'warmroute_backend="10.0.0.1:8001"', 'warmroute_backend="10.0.0.2:8002"'
    assert series_of(tel, gone) and series_of(tel, 'server_address="10.0.0.1"')
    assert any("warmroute_upstream_errors" in ln for ln in series_of(tel, gone))
    kept = series_of(tel, stays) + series_of(tel, 'server_address="10.0.0.2"')

    tel.forget_backend("10.0.0.1:8001")
    board.forget("10.0.0.1:8001")
    assert series_of(tel, gone) == [] and series_of(tel, 'server_address="10.0.0.1"') == []
    assert series_of(tel, stays) + series_of(tel, 'server_address="10.0.0.2"') == kept
    # It comes back: its series start again, from nothing.
    serve(tel, "10.0.0.1:8001", "10.0.0.1", 8001)
    assert series_of(tel, 'server_address="10.0.0.1"')


def test_a_rolling_restart_of_a_hundred_pods_leaves_as_many_series_as_one_pod(
    tel: Telemetry,
) -> None:
    def count() -> int:
        return len(series_of(tel, "warmroute_backend=")) + len(series_of(tel, "server_address="))

    serve(tel, "10.1.0.0:8000", "10.1.0.0", 8000)
    one = count()
    for i in range(1, 101):
        name = f"10.1.0.{i}:8000"
        serve(tel, name, f"10.1.0.{i}", 8000)
        tel.forget_backend(f"10.1.0.{i - 1}:8000")
        if i % 25 == 0:
            assert count() == one
    assert count() == one and len(tel.metrics._series) == 1


def test_fleet_changes_and_states_are_on_metrics_with_a_bounded_source_label(
    tel: Telemetry,
) -> None:
    tel.fleet_change("join", "config")
    tel.fleet_change("join", "dns:engines.internal")
    tel.fleet_change("leave", "kubernetes:llm/vllm")
    tel.fleet_change("leave", "kubernetes:llm/vllm")
    for i in range(200):
        tel.fleet_change("update", f"dns:host-{i}")
    states = {"serving": 3, "draining": 1}
    tel.read_fleet(lambda: states)
    text = tel.prometheus_text()[0].decode()
    changes = [ln for ln in text.splitlines() if ln.startswith("warmroute_fleet_changes_total")]
    assert any(
        'warmroute_fleet_change="leave"' in ln
        and 'warmroute_fleet_source="kubernetes:llm/vllm"' in ln
        and ln.endswith(" 2.0")
        for ln in changes
    )
    sources = {ln.split('warmroute_fleet_source="')[1].split('"')[0] for ln in changes}
    assert len(sources) == 65 and "other" in sources  # 64 kept, the rest "other"
    gauge = {
        ln.split('warmroute_fleet_state="')[1].split('"')[0]: float(ln.rsplit(" ", 1)[1])
        for ln in text.splitlines()
        if ln.startswith("warmroute_fleet_backends")
    }
    assert gauge == {"joining": 0.0, "serving": 3.0, "draining": 1.0, "drained": 0.0}


def test_the_server_span_says_which_fleet_epoch_it_was_routed_in() -> None:
    spans = InMemorySpanExporter()
    t = Telemetry(TelemetryConfig(), span_exporter=spans)
    rec = start(t)
    rec.set_fleet(7, True)
    rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    rec.finish(facts(), status=200)
    (server,) = [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert server.attributes is not None
    assert server.attributes["warmroute.fleet.epoch"] == 7
    assert server.attributes["warmroute.fleet.changing"] is True
    t.shutdown()


def test_the_fleet_attributes_reach_spans_encoded_straight_to_otlp() -> None:
    sent: list[bytes] = []

    class Exporter:
        def export_encoded(self, data: bytes) -> bool:
            sent.append(data)
            return True

        def shutdown(self) -> None:
            pass

    t = Telemetry(TelemetryConfig(), span_exporter=InMemorySpanExporter())
    sink = EncodedBatcher(Exporter(), t.resource, t.scope)  # type: ignore[arg-type]
    t.spans.sink = sink
    t.spans.processors = (sink,)
    rec = start(t)
    rec.set_fleet(12, False)
    rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    rec.finish(facts(), status=200)
    sink.shutdown()
    request = ExportTraceServiceRequest.FromString(b"".join(sent))
    spans = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    (server,) = [s for s in spans if s.kind == s.SPAN_KIND_SERVER]
    attrs = {a.key: a.value for a in server.attributes}
    assert attrs["warmroute.fleet.epoch"].int_value == 12
    assert attrs["warmroute.fleet.changing"].HasField("bool_value")
    assert attrs["warmroute.fleet.changing"].bool_value is False
    t.shutdown()


# -- the doctor, the upstream pool, the KV-event view --------------------------------------------


def test_the_doctors_windows_of_a_departed_backend_go() -> None:
    now = [100.0]
    collector = Collector([BackendInfo("a:1"), BackendInfo("b:1")], clock=lambda: now[0])
    for name in ("a:1", "b:1"):
        collector.finished("m1", name, facts(), None, None, 99.0)
        collector.finished("m2", name, facts(), None, None, 99.0)
        collector.finished("m1", name, None, "timeout", None, 99.0)
    collector.forget("a:1")
    assert {w.backend for w in collector.windows()} == {"b:1"}
    collector.add(BackendInfo("c:1"))  # a newcomer shows before it serves
    assert {w.backend for w in collector.windows()} == {"b:1", "c:1"}


async def test_the_upstream_pool_closes_a_departed_backends_idle_connections_only() -> None:
    async with HeldServer() as gone, HeldServer() as stays:
        client = Upstream(TimeoutsConfig(connect_s=5, first_byte_s=5))
        await client.start()
        try:
            for server in (gone, stays):
                task = asyncio.create_task(_request(client, server.url))
                (await server.requests.get()).set()
                assert await task == b"ok"
            held = asyncio.create_task(_request(client, gone.url))
            release = await gone.requests.get()  # a request in use when the backend leaves
            task = asyncio.create_task(_request(client, gone.url))
            second = await gone.requests.get()
            second.set()
            assert await task == b"ok"  # pooled again: one idle connection now

            name = gone.url.removeprefix("http://")  # its name: host:port
            assert client.forget_backend(name) == 1
            release.set()
            assert await held == b"ok"  # the one in use finishes normally...
            assert not client._idle.get(Target_key(gone.url))  # ...and is closed, not pooled
            assert Target_key(gone.url) not in client._busy
            assert not client._retired
            task = asyncio.create_task(_request(client, stays.url))
            (await stays.requests.get()).set()
            assert await task == b"ok" and stays.connections == 1  # the other kept its own
        finally:
            await client.close()


def Target_key(url: str) -> tuple[str, int, bool]:
    from proxy.upstream.pool import Target

    return Target(url).key


def test_a_kv_event_view_can_be_reset_for_an_engine_that_restarted() -> None:
    class Sink:
        cleared = 0

        def apply(self, events: Any) -> None:
            pass

        def clear(self) -> None:
            self.cleared += 1

    sink = Sink()
    sub = KvEventSubscriber("tcp://127.0.0.1:1", sink)
    sub.last_seq, sub.exact = 41, True
    sub.reset()
    assert sink.cleared == 1 and sub.last_seq is None and not sub.exact and not sub.live
    assert sub.counts["restarts"] == 0  # told, not detected
