"""The retry policy for a request back after a failed prefill/decode leg
(proxy/forwarding/retry.py): pure, in fake time."""

from __future__ import annotations

import pytest

from proxy.config import RetryConfig
from proxy.forwarding.retry import Resume, RetryPolicy


def _policy(**kw: float) -> RetryPolicy:
    return RetryPolicy(RetryConfig(**kw), rng=lambda: 1.0)  # the jitter at its top


def test_the_deadline_runs_from_the_requests_arrival() -> None:
    assert _policy(deadline_s=30).deadline(1000.0) == 1030.0


def test_a_prefill_fallback_goes_to_its_decode_engine_at_once_and_free_not_past_the_deadline() -> (
    None
):
    # No retries left by count or budget: the fallback is the plan's, not a retry elsewhere.
    p = _policy(max_attempts=1, budget_ratio=0, budget_min_per_s=0, backoff_base_s=1.0)
    fallback = Resume("prefill leg on p failed (HTTP 500)", fallback=True)
    nxt, why = p.resume(fallback, "d1", ["d1", "d2"], ["p"], now=5.0, deadline=10.0)
    assert nxt is not None and (nxt.backend, nxt.delay_s, nxt.fresh) == ("d1", 0.0, False)
    assert why == "" and p.budget.info()["retries"] == 0 and p.exhausted == 0
    nxt, why = p.resume(fallback, "d1", ["d1", "d2"], ["p"], now=10.0, deadline=10.0)
    assert nxt is None and why == "the retry deadline of 60s passed"


def test_a_failed_decode_leg_is_retried_elsewhere_like_any_attempt() -> None:
    p = _policy(backoff_base_s=0.1, backoff_max_s=1.0, max_attempts=3)
    again = Resume("decode leg on d1 failed before its first byte")
    tried = ["p", "d1"]
    nxt, _ = p.resume(again, "d1", ["d1", "d2"], tried, now=5.0, deadline=10.0)
    # The next decode engine, after the backoff of a second retry, from the budget.
    assert nxt is not None and (nxt.backend, nxt.fresh) == ("d2", False)
    assert nxt.delay_s == 0.2 and p.budget.info()["retries"] == 1
    late, _ = p.resume(again, "d1", ["d1", "d2"], tried, now=9.95, deadline=10.0)
    assert late is not None and late.delay_s == pytest.approx(0.05)  # never past the deadline
    checks = [
        (p.resume(again, "d1", ["d1"], tried, 5.0, 10.0), "no other backend to try"),
        (p.resume(again, "d1", ["d1", "d2"], tried, 10.0, 10.0), "the retry deadline of 60s"),
        (_policy(max_attempts=2).resume(again, "d1", ["d1", "d2"], tried, 5.0, 10.0), "2 attempts"),
        (
            _policy(budget_ratio=0, budget_min_per_s=0).resume(
                again, "d1", ["d1", "d2"], tried, 5.0, 10.0
            ),
            "the retry budget is spent",
        ),
    ]
    for (nxt, why), expected in checks:
        assert nxt is None and why.startswith(expected), why
