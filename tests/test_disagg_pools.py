"""Pool planning and request classification: pure functions of roles, health and demand."""

from __future__ import annotations

from proxy.config import DisaggConfig
from proxy.disagg.controller import DisaggController
from proxy.disagg.pools import (
    BackendState,
    Demand,
    OutputHistory,
    PoolSplit,
    classify,
    plan_pools,
    plan_request,
    requested_output,
    split_carries_demand,
    uncached_tokens,
)
from proxy.disagg.window import RequestFacts


def fleet(n: int, **kw: object) -> list[BackendState]:
    return [BackendState(f"b{i}", **kw) for i in range(n)]  # type: ignore[arg-type]


def test_prefill_pool_is_sized_by_measured_prefill_demand() -> None:
    # 50k uncached tokens/s, one engine prefills 25k/s: 2.5 engines at 80% -> 3 engines.
    split = plan_pools(fleet(8), Demand(50_000, 25_000, mean_streams=40))
    assert len(split.prefill) == 3 and len(split.decode) == 5
    assert split.prefill_engines_needed == 2.5
    assert split_carries_demand(split)
    assert "3 of 8 healthy backends for prefill-heavy requests" in split.reason


def test_dedicated_roles_stay_in_their_pool_and_unhealthy_backends_in_none() -> None:
    backends = [
        BackendState("p0", "prefill"),
        BackendState("d0", "decode"),
        BackendState("m0"),
        BackendState("m1"),
        BackendState("m2", healthy=False),
    ]
    split = plan_pools(backends, Demand(1_000, 25_000, 4))
    assert split.prefill == ("p0",)
    assert split.decode == ("d0", "m0", "m1")
    assert split.pool_of("m2") is None


def test_a_split_needs_two_healthy_backends_and_keeps_one_for_decoding() -> None:
    one = plan_pools(fleet(1) + fleet(2, healthy=False)[1:], Demand(1_000, 1_000, 1))
    assert not one.feasible and "1 healthy backend" in one.reason
    greedy = plan_pools(fleet(3), Demand(1_000_000, 1_000, 1))  # prefill wants every engine
    assert len(greedy.decode) == 1 and len(greedy.prefill) == 2
    assert not split_carries_demand(greedy) and "can be spared" in greedy.reason


def test_decode_pool_too_small_for_the_streams_is_reported() -> None:
    split = plan_pools(
        fleet(4), Demand(40_000, 25_000, mean_streams=900), max_streams_per_engine=256
    )
    assert len(split.decode) == 2 and not split_carries_demand(split)
    assert "decoding streams need 3.5 engines" in split.reason


def test_without_a_measured_rate_a_quarter_of_the_mixed_backends_prefill() -> None:
    assert len(plan_pools(fleet(8), Demand(10_000, None, 10)).prefill) == 2
    assert len(plan_pools(fleet(2), Demand(10_000, None, 10)).prefill) == 1


def test_pools_are_stable_under_small_demand_changes() -> None:
    first = plan_pools(fleet(8), Demand(50_000, 25_000, 40))  # needs 2.5 -> 3
    assert len(first.prefill) == 3
    # Busy engines: a fresh plan would pick others, the previous split keeps its members.
    busy = [BackendState(f"b{i}", inflight=0 if i >= 5 else 9) for i in range(8)]
    again = plan_pools(busy, Demand(52_000, 25_000, 40), previous=first)
    assert again.prefill == first.prefill
    # Demand falls to 1.9 engines: still within the slack, keep three.
    assert len(plan_pools(fleet(8), Demand(38_000, 25_000, 40), previous=first).prefill) == 3
    # ... to 1.5 engines: give one back.
    assert len(plan_pools(fleet(8), Demand(30_000, 25_000, 40), previous=first).prefill) == 2


def test_classify_long_uncached_short_output_as_prefill_heavy() -> None:
    assert classify(8_000, 16, 1024) == "prefill"
    assert classify(8_000, None, 1024) == "prefill"  # unknown output: the prompt decides
    assert classify(500, 16, 1024) == "decode"  # short uncached prompt (cached prefix)
    assert classify(2_000, 1_500, 1024) == "decode"  # a long answer: a stream to protect
    assert classify(2_000, 500, 1024, output_ratio=0.25) == "prefill"


def test_uncached_tokens_from_the_index_match() -> None:
    assert uncached_tokens(prompt_chars=32_000, matched_blocks=0, block_chars=64) == 8_000
    assert uncached_tokens(prompt_chars=32_000, matched_blocks=400, block_chars=64) == 1_600
    assert uncached_tokens(prompt_chars=1_000, matched_blocks=100, block_chars=64) == 0


def test_expected_output_from_history_capped_by_the_request() -> None:
    assert requested_output({"max_tokens": 64}) == 64
    assert requested_output({"max_completion_tokens": 10, "max_tokens": 64}) == 10
    assert requested_output({"max_tokens": True}) is None
    h = OutputHistory()
    assert h.expected(8_000) is None and h.expected(8_000, cap=32) == 32.0
    for _ in range(50):
        h.observe(8_000, 20)
        h.observe(300, 400)
    assert h.expected(7_000) == 20.0  # same power-of-two bucket
    assert h.expected(300, cap=100) == 100.0
    assert 399 < (h.expected(300) or 0) <= 400


def test_request_plan_uses_kv_transfer_only_between_matching_pd_engines() -> None:
    backends = [
        BackendState("p0", "prefill", flow="vllm"),
        BackendState("d0", "decode", flow="vllm"),
        BackendState("m0"),
    ]
    split = plan_pools(backends, Demand(1_000, 25_000, 2))
    assert split.prefill == ("p0",) and split.decode == ("d0", "m0")
    long = plan_request(split, backends, "prefill")
    assert long.legs == "two" and long.flow == "vllm"
    assert long.prefill_candidates == ("p0",) and long.candidates == ("d0",)
    chat = plan_request(split, backends, "decode")
    assert chat.legs == "one" and chat.candidates == ("d0", "m0")
    mixed = [BackendState(f"m{i}") for i in range(4)]
    pool = plan_pools(mixed, Demand(10_000, 25_000, 2))
    only = plan_request(pool, mixed, "prefill")
    assert only.legs == "one" and only.candidates == pool.prefill and only.flow is None
    off = plan_request(None, mixed, "prefill")
    assert off.legs == "one" and off.candidates == ()
    assert plan_request(PoolSplit(), mixed, "decode").candidates == ()


PD = [
    BackendState("p0", "prefill", flow="vllm"),
    BackendState("d0", "decode", flow="vllm"),
    BackendState("m0"),
]


def test_a_long_prompt_takes_two_legs_whatever_its_output_the_pool_split_keeps_the_ratio() -> None:
    split = plan_pools(PD, Demand(1_000, 25_000, 2))
    # 3,000 uncached tokens and 1,000 to write: decode-heavy by the output ratio, but moved
    # over the link its prefill stalls no decode engine, so it takes two legs.
    cls = classify(3_000, 1_000, 1024)
    assert cls == "decode"
    two = plan_request(split, PD, cls, long_prompt=True)
    assert two.legs == "two" and two.flow == "vllm" and two.candidates == ("d0",)
    short = plan_request(split, PD, "decode", long_prompt=False)
    assert short.legs == "one" and short.candidates == ("d0", "m0")
    # Without a KV-transfer pair (mixed engines only) the ratio decides: the decode pool, whole.
    mixed = [BackendState(f"m{i}") for i in range(4)]
    pool = plan_pools(mixed, Demand(10_000, 25_000, 2))
    whole = plan_request(pool, mixed, cls, long_prompt=True)
    assert whole.legs == "one" and whole.candidates == pool.decode


def test_an_api_without_a_kv_transfer_flow_gets_the_pool_split_only() -> None:
    split = plan_pools(PD, Demand(1_000, 25_000, 2))
    long = plan_request(split, PD, "prefill", long_prompt=True, kv_transfer=False)
    assert long.legs == "one" and long.candidates == split.prefill and long.flow is None
    chat = plan_request(split, PD, "decode", long_prompt=True, kv_transfer=False)
    assert chat.legs == "one" and chat.candidates == split.decode


def _pd_controller() -> DisaggController:
    ctl = DisaggController(DisaggConfig(mode="on", threshold_tokens=1024))
    ctl.evaluate(0.0, PD)
    assert ctl.split is not None and ctl.split.prefill == ("p0",)
    return ctl


def test_two_legs_only_for_chat_and_completions_and_by_the_threshold_alone() -> None:
    ctl = _pd_controller()
    long_answer = {"max_tokens": 1_000}
    for api in ("chat", "completions"):
        plan = ctl.plan(long_answer, 3_000, 3_000, PD, api)
        assert (plan.legs, plan.flow) == ("two", "vllm"), api
        assert ctl.plan(long_answer, 3_000, 500, PD, api).legs == "one"  # short: decode pool
    # /v1/responses: the pool split by class (its cap is max_output_tokens); no prefill leg.
    assert ctl.plan({"max_output_tokens": 16}, 3_000, 3_000, PD, "responses").candidates == ("p0",)
    responses = ctl.plan({"max_output_tokens": 1_000}, 3_000, 3_000, PD, "responses")
    assert responses.legs == "one" and responses.candidates == ("d0", "m0")
    # /v1/embeddings: all prefill, no output: a long one to the prefill-heavy pool, whole.
    embed = ctl.plan({}, 3_000, 3_000, PD, "embeddings")
    assert (embed.legs, embed.candidates, embed.request_class) == ("one", ("p0",), "prefill")
    assert ctl.plan({}, 300, 300, PD, "embeddings").candidates == ("d0", "m0")


def test_an_embedding_is_prefill_heavy_whatever_generations_of_its_size_wrote() -> None:
    ctl = _pd_controller()
    for i in range(20):  # long prompts answered at length: the history expects long outputs
        ctl.finished(RequestFacts(f"c{i}", "m0", 0.0, 3_000, 3_000, 2_000, 1.0, 0.5))
    assert ctl.plan({}, 3_000, 3_000, PD, "responses").request_class == "decode"
    embed = ctl.plan({}, 3_000, 3_000, PD, "embeddings")
    assert embed.request_class == "prefill" and embed.candidates == ("p0",)
    # ...and an embedding's zero output does not teach the history about generations.
    before = dict(ctl.history.means)
    ctl.finished(RequestFacts("e", "p0", 0.0, 3_000, 3_000, 0, 1.0), generates=False)
    assert ctl.history.means == before
