"""The retry policy (proxy/forwarding/retry.py) and the outlier breaker
(proxy/upstream/outlier.py): pure, in fake time."""

from __future__ import annotations

import pytest

from proxy.config import OutlierConfig, RetryConfig
from proxy.forwarding.retry import Retry, RetryBudget, RetryPolicy, classify
from proxy.upstream.outlier import Breaker
from proxy.upstream.pool import (
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamDisconnected,
    UpstreamPayloadError,
    UpstreamProtocolError,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _policy(**kw: float) -> RetryPolicy:
    return RetryPolicy(RetryConfig(**kw), rng=lambda: 1.0)  # the jitter at its top


def test_failures_are_classified_by_what_they_say_about_the_backend() -> None:
    assert classify(UpstreamConnectError("refused")).kind == "connect"
    assert classify(UpstreamConnectTimeout("slow")).kind == "connect_timeout"
    assert classify(UpstreamDisconnected("closed", reused=True)).kind == "reused"
    assert classify(UpstreamDisconnected("closed", reused=False)).kind == "protocol"
    assert classify(UpstreamProtocolError("bad head")).kind == "protocol"
    assert classify(TimeoutError()).kind == "timeout"
    assert classify(UpstreamPayloadError("cut")).kind == "protocol"
    with pytest.raises(TypeError):
        classify(ValueError("not ours"))


def test_a_keepalive_race_retries_the_same_backend_at_once_over_a_new_connection() -> None:
    p = _policy()
    failure = Retry("closed", "connection_reset", "reused")
    nxt, _ = p.next(failure, "a", ["a", "b"], ["a"], 0.0, 60.0)
    assert nxt is not None and (nxt.backend, nxt.fresh, nxt.delay_s) == ("a", True, 0.0)
    # Twice on the same backend is no race any more: move on.
    nxt, _ = p.next(failure, "a", ["a", "b"], ["a", "a"], 0.0, 60.0)
    assert nxt is not None and (nxt.backend, nxt.fresh) == ("b", False)


def test_other_failures_move_on_with_exponential_full_jitter_backoff() -> None:
    p = _policy(backoff_base_s=0.1, backoff_max_s=0.3, max_attempts=4)
    fail = Retry("HTTP 503", "http_503", "status", 503)
    delays = []
    tried = ["a"]
    for name in ("b", "c", "d"):
        nxt, _ = p.next(fail, tried[-1], ["a", "b", "c", "d"], tried, 0.0, 60.0)
        assert nxt is not None and nxt.backend == name
        delays.append(nxt.delay_s)
        tried.append(name)
    assert delays == pytest.approx([0.1, 0.2, 0.3])  # base * 2^(n-1), capped at max
    nxt, why = p.next(fail, "d", ["a", "b", "c", "d"], tried, 0.0, 60.0)
    assert nxt is None and "4 attempts" in why
    jittered = RetryPolicy(RetryConfig(backoff_base_s=0.1), rng=lambda: 0.25)
    assert jittered.backoff_s(2) == pytest.approx(0.05)


def test_no_attempt_starts_after_the_deadline_and_a_wait_never_passes_it() -> None:
    p = _policy(backoff_base_s=1.0, backoff_max_s=5.0)
    fail = Retry("timeout", "timeout", "timeout")
    nxt, why = p.next(fail, "a", ["a", "b"], ["a"], 10.0, 10.0)
    assert nxt is None and "deadline" in why
    nxt, _ = p.next(fail, "a", ["a", "b"], ["a"], 9.8, 10.0)
    assert nxt is not None and nxt.delay_s == pytest.approx(0.2)


def test_the_budget_caps_retries_at_a_fraction_of_recent_traffic() -> None:
    clock = Clock()
    budget = RetryBudget(ratio=0.2, min_per_s=0.0, window_s=10.0, clock=clock)
    for _ in range(50):
        budget.request()
    spent = sum(budget.try_spend() for _ in range(30))
    assert spent == 10  # 20% of 50
    clock.t += 11  # the window moved on: the old requests and retries no longer count
    assert not budget.try_spend()  # no recent requests and no floor
    for _ in range(10):
        budget.request()
    assert budget.try_spend() and budget.try_spend() and not budget.try_spend()


def test_a_spent_budget_answers_at_once_instead_of_storming_the_fleet() -> None:
    p = RetryPolicy(RetryConfig(budget_ratio=0.0, budget_min_per_s=0.0), rng=lambda: 0.0)
    nxt, why = p.next(Retry("x", "http_502", "status", 502), "a", ["a", "b"], ["a"], 0, 60)
    assert nxt is None and "budget" in why and p.exhausted == 1
    # ...but the keep-alive race is not a backend failure and costs no budget.
    nxt, _ = p.next(Retry("x", "connection_reset", "reused"), "a", ["a", "b"], ["a"], 0, 60)
    assert nxt is not None and nxt.backend == "a"


def _breaker(**kw: float) -> Breaker:
    return Breaker(OutlierConfig(**kw), first_ejection_s=5.0)


def test_consecutive_failures_eject_and_a_success_in_between_resets_the_count() -> None:
    b = _breaker(consecutive_failures=3, ejection_s=10.0)
    assert not b.failure("status", 0.0) and not b.failure("status", 0.0)
    b.success()
    assert not b.failure("status", 0.0) and not b.failure("timeout", 0.0)
    assert b.failure("status", 0.0)  # the third in a row
    assert not b.allows(5.0)
    assert b.allows(10.0)  # half-open: one probe
    b.on_attempt()
    assert not b.allows(10.0)  # ...and only one
    b.success()
    assert b.state == "closed" and b.allows(10.0)


def test_overload_and_keepalive_races_do_not_count_against_a_backend() -> None:
    b = _breaker(consecutive_failures=1)
    assert not b.failure("overloaded", 0.0) and not b.failure("reused", 0.0)
    assert b.allows(0.0)


def test_a_failed_probe_ejects_again_for_twice_as_long_up_to_the_cap() -> None:
    b = _breaker(consecutive_failures=1, ejection_s=10.0, max_ejection_s=25.0)
    b.failure("status", 0.0)
    assert b.open_until == 10.0
    assert b.allows(10.0)
    b.on_attempt()
    assert b.failure("status", 10.0)
    assert b.open_until == 30.0  # 20 s
    assert b.allows(30.0)
    b.failure("status", 30.0)
    assert b.open_until == 55.0  # 40 s, capped at 25


def test_a_refused_connection_ejects_at_once_and_a_health_check_can_end_it() -> None:
    b = _breaker(consecutive_failures=5, ejection_s=30.0)
    assert b.failure("connect", 0.0)
    assert b.open_until == 5.0  # the refused-connection cooldown, not the 5xx ejection
    assert not b.allows(1.0)
    b.health_ok(1.0)
    assert b.allows(1.0)  # half-open early: the engine is back
    s = _breaker(consecutive_failures=1)
    s.failure("status", 0.0)
    s.health_ok(1.0)  # answering /health says nothing about answering requests
    assert not s.allows(1.0)


def _probing(**kw: float) -> Breaker:
    """A breaker ejected once (10 s), now half-open with its probe out."""
    b = _breaker(consecutive_failures=1, ejection_s=10.0, **kw)
    b.failure("status", 0.0)
    assert b.allows(10.0)
    b.on_attempt()
    assert not b.allows(10.0)
    return b


@pytest.mark.parametrize("kind", ["overloaded", "reused", "cancelled"])
def test_a_probe_that_ends_without_a_verdict_lets_the_next_probe_go(kind: str) -> None:
    # A 429, the keep-alive race, the client leaving (or shutdown) before the answer: none
    # says whether the backend is well, so the breaker stays half-open and probes again.
    b = _probing()
    assert not b.failure(kind, 11.0)
    assert b.state == "half_open" and b.allows(11.0)
    assert b.info(11.0)["state"] == "half_open" and not b.info(11.0)["probe_out"]
    b.on_attempt()
    assert not b.allows(11.0)  # ...one probe at a time still
    b.success()
    assert b.state == "closed" and b.allows(11.0)


def test_a_probe_that_reports_nothing_is_presumed_lost_after_the_ejection_it_follows() -> None:
    b = _probing()  # its check at 10 s was the first request kept off: the clock starts
    assert not b.allows(19.9)
    assert b.allows(20.0)  # kept off for 10 s, the length of the ejection before it
    assert b.lost_probes == 1 and b.info(20.0)["lost_probes"] == 1
    b.on_attempt()
    assert not b.allows(20.0)  # the new probe is the only one out
    b.success()
    assert b.state == "closed"


def test_a_probe_that_fails_ejects_again_after_a_released_one() -> None:
    b = _probing()
    b.failure("overloaded", 11.0)
    assert b.allows(11.0)
    b.on_attempt()
    assert b.failure("timeout", 12.0)
    assert b.state == "open" and b.open_until == 32.0  # the second ejection: 20 s
