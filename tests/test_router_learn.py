"""Online prefill-rate learning and the predicted-TTFT scorer that uses it."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plugins.predicted_ttft_scorer import PredictedTtftScorer
from proxy.config import RoutingConfig
from proxy.routing.backlog import PrefillBacklog
from proxy.routing.index import MemoryPrefixIndex
from proxy.routing.learn import PrefillLearner, PrefillRate
from proxy.routing.router import Router
from proxy.routing.setup import build_router
from proxy.routing.types import EngineLoad, RouteContext
from tests.test_router import SYSTEM, chat, view, views


def test_rate_and_overhead_are_recovered_from_noisy_samples() -> None:
    rng = random.Random(1)
    est = PrefillRate()
    for _ in range(400):
        tokens = rng.uniform(100, 4000)
        est.observe(tokens, 0.03 + tokens / 8000 + rng.gauss(0, 0.005))
    assert est.rate is not None and abs(est.rate - 8000) / 8000 < 0.1
    assert abs(est.overhead_s - 0.03) < 0.01


def test_queueing_spikes_do_not_drag_the_rate_down() -> None:
    rng = random.Random(2)
    est = PrefillRate()
    for i in range(400):
        tokens = rng.uniform(100, 4000)
        spike = 5.0 if i % 10 == 0 else 0.0  # every tenth request waited in the engine queue
        est.observe(tokens, tokens / 8000 + spike)
    assert est.rate is not None and est.rate > 6000


def test_equal_sized_prompts_still_give_a_rate() -> None:
    est = PrefillRate()
    for _ in range(10):
        est.observe(2000, 0.1)  # faster than the prior: tokens over time
    assert est.rate is not None and abs(est.rate - 20000) < 1
    assert est.overhead_s == 0.0


def test_small_prompts_alike_do_not_make_the_rate_slower_than_the_prior() -> None:
    # A replica that only ever sent cached prompts (the user's turn uncached): their TTFT is
    # overhead. Through the origin it read 88 tokens in 0.1 s as 880 tokens/s.
    est = PrefillRate()
    for _ in range(50):
        est.observe(88, 0.1)
    assert est.rate == est.prior_rate
    prediction = est.predict(88)
    assert prediction is not None and abs(prediction - 0.1) < 1e-9  # the TTFT still predicted


def test_the_slope_identified_is_kept_while_prompt_sizes_stop_varying() -> None:
    rng = random.Random(4)
    est = PrefillRate()
    for _ in range(100):  # cold and cached prompts: the slope is identified
        tokens = rng.choice((60.0, 2700.0))
        est.observe(tokens, 0.02 + tokens / 20000 + rng.uniform(0, 0.004))
    assert est.rate is not None and abs(est.rate - 20000) / 20000 < 0.1
    for _ in range(2000):  # then only cached ones, their TTFT mostly queueing
        est.observe(rng.gauss(60, 6), 0.02 + rng.expovariate(1 / 0.04))
    # Through the origin these read ~1,000 tokens/s. (While the cold samples fade, the mean
    # TTFT rising with the queueing flattens the fit a little: within 1.5x.)
    assert est.rate is not None and 20000 / 1.5 < est.rate < 20000 * 1.5
    assert est.overhead_s > 0.04  # the queueing went to the overhead, not the rate


def test_the_estimate_follows_a_backend_that_slows_down() -> None:
    rng = random.Random(3)
    est = PrefillRate(half_life=32)
    for _ in range(200):
        t = rng.uniform(500, 3000)
        est.observe(t, t / 10000)
    for _ in range(300):
        t = rng.uniform(500, 3000)
        est.observe(t, t / 2000)
    assert est.rate is not None and abs(est.rate - 2000) / 2000 < 0.15


@given(st.lists(st.tuples(st.floats(0, 1e6), st.floats(0, 1e3)), max_size=50))
def test_the_rate_is_always_positive_and_bounded(samples: list[tuple[float, float]]) -> None:
    est = PrefillRate()
    for tokens, ttft in samples:
        est.observe(tokens, ttft)
    if est.rate is not None:
        assert est.min_rate <= est.rate <= est.max_rate


def test_unknown_backend_has_no_rate_until_enough_samples() -> None:
    learner = PrefillLearner(min_samples=3)
    assert learner.rate("a") is None
    for _ in range(3):
        learner.observe("a", 1000, 0.25)
    assert learner.rate("a") == 5000  # (the prior, the rest overhead: sizes never varied)
    assert learner.mean_prefill_s("a") == 0.25
    assert learner.snapshot()["a"]["identified"] is False
    assert learner.snapshot()["a"]["samples"] == 3


def ctx(prompt_chars: int, matched: dict[str, int]) -> RouteContext:
    return RouteContext(
        "r", "m", "chat", {}, {}, 0.0, prompt_chars=prompt_chars, matched_blocks=matched
    )


def test_predicted_ttft_prefers_the_cached_backend() -> None:
    scorer = PredictedTtftScorer()
    c = ctx(16_000, {"warm": 250})
    scores = scorer.score(c, [view("warm"), view("cold")])
    assert scores["warm"] == 1.0 and scores["cold"] < 0.2


def test_predicted_ttft_prefers_a_fast_cold_backend_over_a_queued_warm_one() -> None:
    scorer = PredictedTtftScorer()
    c = ctx(16_000, {"warm": 250})
    warm = view("warm", load=EngineLoad(waiting=20), prefill_tokens_per_s=8000, mean_prefill_s=0.3)
    cold = view("cold", prefill_tokens_per_s=8000)
    scores = scorer.score(c, [warm, cold])
    assert scores["cold"] == 1.0 and scores["warm"] < 0.2


def test_predicted_ttft_uses_each_backends_learned_rate() -> None:
    scorer = PredictedTtftScorer()
    c = ctx(8_000, {})
    fast, slow = view("fast", prefill_tokens_per_s=20_000), view("slow", prefill_tokens_per_s=2000)
    scores = scorer.score(c, [fast, slow])
    assert scores["fast"] == 1.0 and scores["slow"] < 0.2


def test_backlog_drains_at_the_prefill_rate() -> None:
    now = [0.0]
    backlog = PrefillBacklog(clock=lambda: now[0])
    backlog.add("a", 4000, tokens_per_s=8000)
    assert backlog.level("a", 8000) == 4000 and backlog.level("b", 8000) == 0
    now[0] = 0.25
    assert backlog.level("a", 8000) == 2000
    backlog.add("a", 1000, tokens_per_s=8000)  # on top of what is left, not of the total
    assert backlog.level("a", 8000) == 3000
    now[0] = 10.0
    assert backlog.level("a", 8000) == 0  # an idle backend's backlog never goes negative


def test_predicted_ttft_counts_the_backlog_this_proxy_sent() -> None:
    scorer = PredictedTtftScorer()
    c = ctx(16_000, {"warm": 250})
    # No engine queue scraped yet, but 24k tokens were just sent to the warm backend: ~3 s.
    warm = view("warm", prefill_tokens_per_s=8000, backlog_tokens=24_000)
    cold = view("cold", prefill_tokens_per_s=8000)
    scores = scorer.score(c, [warm, cold])
    assert scores["cold"] == 1.0 and scores["warm"] < 0.6


def router_with_a_still_backlog() -> Router:
    """prefix_aware on an in-memory index, its backlog on a clock that never moves (nothing
    drains: what is there is what was added and not taken off)."""
    r = build_router(RoutingConfig(policy="prefix_aware"), index=MemoryPrefixIndex())
    r.backlog = PrefillBacklog(clock=lambda: 0.0)
    return r


async def test_the_router_adds_each_decisions_uncached_tokens_to_the_backlog() -> None:
    r = router_with_a_still_backlog()
    first = await r.route(chat(SYSTEM * 4, "q1", 1), views())
    home = first.winner
    assert home is not None
    assert r.backlog_tokens(home) == first.prompt_chars / 4  # all of it was cold
    second = await r.route(chat(SYSTEM * 4, "q2", 2), views())
    assert second.winner == home
    added = r.backlog_tokens(home) - first.prompt_chars / 4
    assert 0 < added < 64  # only the part after the cached prefix


def test_the_backlog_never_exceeds_what_is_outstanding() -> None:
    """A drain rate learned far too slow (1 token/s here) must not let cached requests'
    few uncached tokens pile up: the level is at most what unfinished requests sent."""
    now = [0.0]
    backlog = PrefillBacklog(clock=lambda: now[0])
    for i in range(10):
        now[0] = i * 0.01
        backlog.add("home", 54, tokens_per_s=1.0)
    assert backlog.level("home", 1.0) == pytest.approx(540, abs=0.5)  # (drained 0.09)
    for _ in range(6):
        backlog.finished("home", 54)
    assert backlog.level("home", 1.0) == pytest.approx(216)
    assert backlog.levels({"home": 0}, [1.0], 5000.0) == [pytest.approx(216)]
    for _ in range(4):
        backlog.finished("home", 54)
    assert backlog.level("home", 1.0) == 0.0
    backlog.finished("home", 54)  # (one too many: nothing goes below zero)
    backlog.add("home", 100, tokens_per_s=1.0)
    assert backlog.level("home", 1.0) == pytest.approx(100)


async def test_a_request_that_ends_or_moves_takes_its_tokens_off_the_backlog() -> None:
    r = router_with_a_still_backlog()
    decision = await r.route(chat(SYSTEM * 4, "q1", 1), views())
    home = decision.winner
    assert home is not None and decision.backlogged is not None
    cold = decision.prompt_chars / 4
    assert r.backlog_tokens(home) == cold
    other = next(n for n in decision.ranking if n != home)
    r.record(decision, other)  # a retry elsewhere: the first attempt is over
    assert r.backlog_tokens(home) == 0 and r.backlog_tokens(other) > 0
    r.finished(decision)  # the request ended
    assert r.backlog_tokens(other) == 0 and decision.backlogged is None
    r.finished(decision)  # (twice is harmless)
