"""The router with prefix matching: hashing, one index lookup, record after the pick."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest

from proxy.config import Config, RoutingConfig
from proxy.routing.index import MemoryPrefixIndex, RedisPrefixIndex, open_redis
from proxy.routing.router import Router
from proxy.routing.setup import build_router, build_routing
from proxy.routing.types import BackendView, EngineLoad, RouteContext
from tests.routing_support import SHARED_URL, delete_prefix, unique_prefix

NAMES = ["e0", "e1", "e2", "e3"]


def view(name: str, inflight: int = 0, **kw: Any) -> BackendView:
    fields: dict[str, Any] = {
        "url": f"http://{name}",
        "engine": "vllm",
        "role": "mixed",
        "weight": 1.0,
        "healthy": True,
        "load": EngineLoad(),
        "models": frozenset({"m"}),
        **kw,
    }
    return BackendView(name=name, inflight=inflight, **fields)


def views(loads: Sequence[int] = (0, 0, 0, 0)) -> list[BackendView]:
    return [view(n, i) for n, i in zip(NAMES, loads, strict=True)]


def chat(system: str, user: str, i: int = 0, **extra: Any) -> RouteContext:
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        **extra,
    }
    return RouteContext(request_id=f"r{i}", model="m", api="chat", body=body, headers={}, now=0.0)


SYSTEM = "You are a meticulous assistant for the warmroute test suite. " * 40  # ~2.4k chars


def router(index: Any = None, policy: str = "prefix_aware", **plugins: Any) -> Router:
    return build_router(RoutingConfig(policy=policy, plugins=plugins), index=index)


async def test_a_follow_up_goes_where_its_prefix_was_recorded() -> None:
    r = router(MemoryPrefixIndex())
    first = await r.route(chat(SYSTEM, "question one", 1), views())
    second = await r.route(chat(SYSTEM, "question two", 2), views())
    assert first.winner == second.winner
    assert second.matched_blocks[second.winner] >= len(SYSTEM) // 64 - 1
    assert "placed prefix: its home" in second.reason
    assert second.predicted_cached_chars() == second.matched_blocks[second.winner] * 64


async def test_a_cold_prefix_lands_on_the_same_backend_on_every_replica() -> None:
    # No shared state at all: rendezvous hashing alone makes independent routers agree.
    winners = set()
    for _ in range(3):
        r = router(MemoryPrefixIndex())
        decision = await r.route(chat(SYSTEM, "hello", 1), views())
        assert decision.reason.startswith("placed prefix")
        assert decision.matched_blocks[decision.winner or ""] == 0  # a new home, cold
        winners.add(decision.winner)
    assert len(winners) == 1


async def test_new_system_prompts_spread_over_backends() -> None:
    r = router(MemoryPrefixIndex())
    homes = [
        (await r.route(chat(f"system prompt number {k} " * 30, "hi", k), views())).winner
        for k in range(40)
    ]
    assert set(homes) == set(NAMES)
    assert max(homes.count(n) for n in NAMES) <= 20


async def test_a_home_with_prefill_queued_spills_to_another_backend() -> None:
    r = router(MemoryPrefixIndex())
    home = (await r.route(chat(SYSTEM, "q", 1), views())).winner
    # The home is over the load bound and its engine has 30 prompts waiting: far more prefill
    # work than the cold prefill elsewhere.
    queued = [
        view(n, 12 if n == home else 2, load=EngineLoad(waiting=30.0 if n == home else 0.0))
        for n in NAMES
    ]
    decision = await r.route(chat(SYSTEM, "q2", 2), queued)
    assert decision.winner != home
    assert decision.ranking[1] == home  # still the first retry target
    assert "load over affinity" in decision.reason and "over the load bound" in decision.reason


async def test_a_home_busy_only_with_running_requests_keeps_its_prefix() -> None:
    # Over the in-flight bound but nothing queued: the request starts at once at home, while
    # a copy elsewhere would cost a cold prefill and evict another prompt (a close call the
    # load bound alone used to win).
    r = router(MemoryPrefixIndex())
    home = (await r.route(chat(SYSTEM, "q", 1), views())).winner
    loads = [12 if n == home else 2 for n in NAMES]
    decision = await r.route(chat(SYSTEM, "q2", 2), views(loads))
    assert decision.winner == home
    assert "over the load bound but still cheapest" in decision.reason


async def test_filters_run_before_the_lookup() -> None:
    index = MemoryPrefixIndex()
    r = router(index)
    backends = [*views(), view("other", models=frozenset({"x"}))]
    decision = await r.route(chat(SYSTEM, "q", 1), backends)
    assert "other" in decision.filtered_out
    assert "other" not in decision.matched_blocks
    assert decision.prefix_blocks == decision.prompt_chars // 64


async def test_record_can_be_deferred_to_the_backend_actually_used() -> None:
    index = MemoryPrefixIndex()
    r = router(index)
    r.record_on_route = False
    ctx = chat(SYSTEM, "q", 1)
    decision = await r.route(ctx, views())
    assert index.records == 0
    fallback = decision.ranking[1]  # say the winner refused before the first byte
    r.record(decision, fallback)
    assert index.lookup_now(ctx.prefix_blocks, [fallback])[fallback] == len(ctx.prefix_blocks)
    # The home that refused is marked down: the prefix is placed again, where it is cached.
    up = [b for b in views() if b.name != decision.winner]
    again = await r.route(chat(SYSTEM, "q2", 2), up)
    assert again.winner == fallback


async def test_a_dry_run_records_nothing() -> None:
    index = MemoryPrefixIndex()
    decision = await router(index).route(chat(SYSTEM, "q", 1), views(), record=False)
    assert decision.winner is not None and index.records == 0


async def test_non_prefix_policies_do_not_hash_or_look_up() -> None:
    index = MemoryPrefixIndex()
    r = router(index, policy="least_inflight")
    decision = await r.route(chat(SYSTEM, "q", 1), views((3, 1, 2, 2)))
    assert decision.winner == "e1"
    assert index.lookups == 0 and decision.prefix_blocks == 0


async def test_explain_lists_candidates_scores_matches_and_winner() -> None:
    r = router(MemoryPrefixIndex())
    await r.route(chat(SYSTEM, "q", 1), views())
    d = (await r.route(chat(SYSTEM, "q", 2), views())).as_dict()
    assert set(d["scores"]) == set(NAMES)
    assert set(d["scores"][d["winner"]]) == {
        "prefix",
        "predicted_ttft",
        "queue",
        "kv_usage",
        "inflight",
    }
    assert d["matched_blocks"][d["winner"]] > 0 and d["decision_ms"] > 0


async def test_weights_and_thresholds_come_from_plugin_blocks() -> None:
    r = router(
        MemoryPrefixIndex(),
        prefix_aware={"weights": {"prefix": 5, "kv_usage": 0}},
        prefix={"block_chars": 32, "half_tokens": 100},
        bounded_load={"epsilon": 0.5},
    )
    weights = {s.name: w for s, w in r.policy.scorers}
    assert weights["prefix"] == 5 and "kv_usage" not in weights
    assert r.hasher.block_chars == 32
    assert r.policy.picker.epsilon == 0.5  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown scorer"):
        router(prefix_aware={"weights": {"typo": 1}})


# -- replicas sharing Redis -----------------------------------------------------------------


@pytest.fixture
def prefix() -> Iterator[str]:
    kp = unique_prefix("router")
    yield kp
    delete_prefix(kp)


@pytest.fixture
async def replicas(prefix: str) -> AsyncIterator[list[Router]]:
    """Three routers, each with its own Redis client: three proxy replicas in one process."""
    indexes = [
        RedisPrefixIndex(open_redis(SHARED_URL), key_prefix=prefix, owns_client=True)
        for _ in range(3)
    ]
    for index in indexes:
        await index.start()
    yield [router(index) for index in indexes]
    for index in indexes:
        await index.close()


@pytest.mark.redis
async def test_replicas_sharing_redis_route_a_prefix_to_the_same_backend(
    replicas: list[Router],
) -> None:
    a, b, c = replicas
    home = (await a.route(chat(SYSTEM, "q", 1), views())).winner
    # A spills the prompt's next request to another backend because home has a queue...
    queued = [
        view(n, 20 if n == home else 0, load=EngineLoad(waiting=30.0 if n == home else 0.0))
        for n in NAMES
    ]
    spilled = (await a.route(chat(SYSTEM + "x" * 500, "longer", 2), queued)).winner
    assert spilled != home
    await a.index.flush()  # type: ignore[union-attr]
    # ...and B and C, which never saw either request, follow A's records, not their own hash.
    for other in (b, c):
        assert (await other.route(chat(SYSTEM, "q3", 3), views())).winner == home
        follow = await other.route(chat(SYSTEM + "x" * 500, "again", 4), views())
        assert follow.winner == spilled
        assert follow.matched_blocks[spilled] > follow.matched_blocks[home]


@pytest.mark.redis
async def test_build_routing_from_config_with_and_without_redis(prefix: str) -> None:
    memory = build_routing(Config())
    assert memory.index.mode == "memory" and memory.redis is None
    await memory.start()
    await memory.close()

    cfg = Config.model_validate(
        {
            "routing": {"policy": "prefix_aware"},
            "redis": {"url": SHARED_URL, "key_prefix": prefix},
        }
    )
    shared = build_routing(cfg, replica_id="r1")
    await shared.start()
    try:
        assert shared.index.mode == "redis"
        assert shared.info()["inflight"]["mode"] == "redis"
        d = await shared.router.route(chat(SYSTEM, "q", 1), views())
        assert d.policy == "prefix_aware" and d.winner in NAMES
    finally:
        await shared.close()


async def test_scorers_run_only_when_something_reads_the_scores() -> None:
    """A pick by prefix copies or load needs no scores: none are computed before the request
    is sent. Reading them afterwards (the span, explain) gives what the picker would have
    seen, computed once."""
    r = router(MemoryPrefixIndex())
    calls: list[str] = []
    for scorer, _ in r.policy.scorers:
        inner = scorer.score

        def counted(ctx: Any, cands: Any, inner: Any = inner, name: str = scorer.name) -> Any:
            calls.append(name)
            return inner(ctx, cands)

        scorer.score = counted  # type: ignore[method-assign]
    cold = await r.route(chat(SYSTEM, "q1", 1), views())
    assert "placed prefix" in cold.reason and calls == []
    twin = await router(MemoryPrefixIndex()).route(chat(SYSTEM, "q1", 1), views())
    assert cold.as_dict()["scores"] == twin.as_dict()["scores"]  # same values, when asked
    assert len(calls) == len(r.policy.scorers)
    assert cold.totals[cold.winner] == twin.totals[twin.winner]
    assert len(calls) == len(r.policy.scorers)  # computed once
