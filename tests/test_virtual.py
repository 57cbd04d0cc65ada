"""The virtual-time fleet: the real router over the simulator's scheduler, no sockets.

Virtual time is exact, so these compare policies by outcome (hit ratio, load balance) without
any wall-clock assertion.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

from proxy.bench.metrics import cache_hit_ratio
from proxy.bench.results import RequestResult
from proxy.bench.workloads import make_workload
from proxy.demo.run import format_engine_balance, oracle_hit_ratio
from proxy.harness.virtual import engine_stats, run_virtual
from proxy.sim.config import SimConfig

SIM = SimConfig.from_preset("l40s", kv_blocks=600)  # 9.6k tokens: ~2 of the 8 prompts fit


def tight_workload(name: str = "shared-prefix", **kw: object) -> object:
    sizes = {"num_prefixes": 8, "system_chars": 12000, "max_tokens": 16, "user_chars": 200}
    return make_workload(name, seed=3, **{**sizes, **kw})


async def test_every_request_completes_with_consistent_facts() -> None:
    wl = tight_workload()
    run, fleet = await run_virtual(
        wl, policy="prefix_aware", sim=SIM, engines=3, requests=60, concurrency=6
    )
    assert len(run.requests) == 60 and all(r.ok for r in run.requests)
    for r in run.requests:
        assert r.ttft is not None and r.e2e is not None and 0 < r.ttft <= r.e2e
        assert r.prompt_tokens and 0 <= (r.cached_tokens or 0) <= r.prompt_tokens
        assert r.output_chunks == r.completion_tokens == 16 and len(r.itl) == 15
    assert sum(s["requests"] for s in engine_stats(fleet)) == 60
    assert run.duration > 0 and fleet.inflight == [0, 0, 0]


async def test_runs_are_reproducible() -> None:
    wl = tight_workload()
    a, _ = await run_virtual(wl, policy="prefix_aware", sim=SIM, engines=3, requests=40)
    b, _ = await run_virtual(wl, policy="prefix_aware", sim=SIM, engines=3, requests=40)
    assert [(r.target, r.ttft, r.cached_tokens) for r in a.requests] == [
        (r.target, r.ttft, r.cached_tokens) for r in b.requests
    ]


async def test_later_turns_wait_for_and_carry_the_earlier_reply() -> None:
    wl = tight_workload("multi-turn", turns=3, active_conversations=4)
    run, _ = await run_virtual(
        wl, policy="round_robin", sim=SIM, engines=2, requests=24, concurrency=4
    )
    turns: dict[int, list[RequestResult]] = defaultdict(list)
    for r in run.requests:
        assert r.conversation is not None
        turns[r.conversation].append(r)
    for conv in turns.values():
        conv.sort(key=lambda r: r.turn)
        for before, after in itertools.pairwise(conv):
            assert after.start >= before.start + (before.e2e or 0)
            assert (after.prompt_tokens or 0) > (before.prompt_tokens or 0)


async def test_prefix_aware_beats_round_robin_when_the_pools_are_tight() -> None:
    wl = tight_workload()
    hits = {}
    for policy in ("round_robin", "prefix_aware"):
        run, _ = await run_virtual(
            wl, policy=policy, sim=SIM, engines=4, requests=300, concurrency=8
        )
        hits[policy] = cache_hit_ratio(run.requests) or 0.0
    oracle = oracle_hit_ratio(wl, run.requests)
    assert oracle is not None
    assert hits["prefix_aware"] > hits["round_robin"] + 0.1
    assert hits["prefix_aware"] >= 0.9 * oracle


async def test_a_hot_prompt_spreads_evenly() -> None:
    wl = tight_workload("hot-prompt")
    _run, fleet = await run_virtual(
        wl, policy="prefix_aware", sim=SIM, engines=4, requests=400, concurrency=16
    )
    loads = [s["mean_inflight"] for s in engine_stats(fleet)]
    assert max(loads) / min(loads) <= 1.5, format_engine_balance(engine_stats(fleet))


def test_oracle_counts_repeated_systems_and_earlier_turns() -> None:
    wl = make_workload("multi-turn", seed=1, num_prefixes=1, system_chars=400, turns=2)
    plan = wl.plan(4)  # two conversations of two turns, one system prompt
    system = len(wl.system_prompts[0])
    users = [len(wl.user_text(s)) for s in plan]
    results = [
        RequestResult(
            index=s.index,
            target="x",
            kind="chat",
            conversation=s.conversation,
            turn=s.turn,
            start=float(s.index),
            ok=True,
            output_chars=100,
        )
        for s in plan
    ]
    by_index = {s.index: s for s in plan}
    total = cached = 0
    prompt_so_far: dict[int, int] = {}
    seen = False
    for r in results:
        spec = by_index[r.index]
        conv = spec.conversation
        assert conv is not None
        if spec.turn == 0:
            total += system + users[r.index]
            cached += system if seen else 0
            seen = True
            prompt_so_far[conv] = system + users[r.index]
        else:
            total += prompt_so_far[conv] + 100 + users[r.index]
            cached += prompt_so_far[conv]  # the reply itself is not cached by the simulator
    assert oracle_hit_ratio(wl, results) == cached / total
    with_replies = oracle_hit_ratio(wl, results, replies_cached=True)
    assert with_replies is not None and with_replies > cached / total


async def test_prompts_longer_than_the_kv_pool_fail_like_a_400_and_nothing_hangs() -> None:
    wl = tight_workload("multi-turn", turns=2, active_conversations=3)
    tiny = SimConfig.from_preset("l40s", kv_blocks=40)  # 640 tokens: the prompts do not fit
    run, fleet = await run_virtual(
        wl, policy="prefix_aware", sim=tiny, engines=2, requests=12, concurrency=3
    )
    assert len(run.requests) == 12 and not any(r.ok for r in run.requests)
    first = [r for r in run.requests if r.turn == 0]
    assert all(r.http_status == 400 and "KV blocks" in (r.error or "") for r in first)
    assert all(r.error_kind == "dependency" for r in run.requests if r.turn == 1)
    assert fleet.inflight == [0, 0]
