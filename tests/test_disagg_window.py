"""The decider's window: demand, steadiness, and which streams decoded beside a long prefill."""

from __future__ import annotations

import random

import pytest

from proxy.disagg.pools import BackendState
from proxy.disagg.window import RequestFacts, Window, itl_quantiles
from proxy.stats import percentile

LONG = 1024


def stream(
    rid: str,
    backend: str,
    arrival: float,
    first: float,
    end: float,
    p50: float = 0.01,
    p99: float = 0.012,
    uncached: int = 50,
    output: int = 200,
) -> RequestFacts:
    return RequestFacts(
        request_id=rid,
        backend=backend,
        arrival=arrival,
        prompt_tokens=uncached + 500,
        uncached_tokens=uncached,
        output_tokens=output,
        finished_at=end,
        first_token_at=first,
        itl_p50_s=p50,
        itl_p99_s=p99,
    )


def long_prefill(w: Window, rid: str, backend: str, start: float, first: float | None) -> None:
    w.started(rid, backend, start, 8_000)
    if first is not None:
        w.first_token(rid, first)


def test_a_stream_decoding_across_a_long_prefill_on_its_backend_is_overlapped() -> None:
    w = Window(60, LONG)
    long_prefill(w, "doc", "a", 10.0, 12.0)
    w.finished(stream("across", "a", 9.0, 11.0, 20.0, p99=0.08))  # decoding 11-20
    w.finished(stream("before", "a", 4.0, 5.0, 11.0, p99=0.08))  # decoding 5-11
    w.finished(stream("after", "a", 12.5, 13.0, 20.0))  # began after the prefill ended
    w.finished(stream("elsewhere", "b", 9.0, 11.0, 20.0))
    s = w.snapshot(20.0)
    assert (s.streams, s.overlapped) == (4, 2)
    assert s.itl_inflation == pytest.approx(8.0)
    assert s.itl_inflation_baseline == pytest.approx(1.2)
    assert s.interference == pytest.approx(8.0 / 1.2)


def test_a_long_prefill_still_running_counts_against_streams_ending_meanwhile() -> None:
    w = Window(60, LONG)
    long_prefill(w, "doc", "a", 10.0, None)
    w.finished(stream("s1", "a", 8.0, 9.0, 11.0))
    assert w.snapshot(11.0).overlapped == 1
    # The long request's own stream does not count against itself.
    w.first_token("doc", 13.0)
    w.finished(stream("doc", "a", 10.0, 13.0, 14.0, uncached=8_000, output=16))
    assert w.snapshot(14.0).overlapped == 1


def test_short_prompts_open_no_interval() -> None:
    w = Window(60, LONG)
    w.started("chat", "a", 10.0, LONG - 1)
    w.finished(stream("s1", "a", 9.0, 9.5, 12.0))
    assert w.snapshot(12.0).overlapped == 0


def test_an_unannounced_long_request_still_marks_later_streams() -> None:
    w = Window(60, LONG)
    w.finished(stream("doc", "a", 10.0, 12.0, 12.2, uncached=8_000, output=4))
    w.finished(stream("s1", "a", 9.0, 11.0, 20.0))
    s = w.snapshot(20.0)
    assert s.overlapped == 1 and s.long_prefills == 1
    assert s.prefill_rate_per_engine == pytest.approx(4_000.0)  # 8,000 tokens in 2 s


def test_demand_rates_and_mean_streams_over_the_span() -> None:
    w = Window(60, LONG)
    for i in range(10):
        w.started(f"r{i}", "a", float(i), 50)
        w.first_token(f"r{i}", i + 0.5)
        w.finished(stream(f"r{i}", "a", float(i), i + 0.5, i + 2.5, output=100))
    s = w.snapshot(20.0, [BackendState("a"), BackendState("b", healthy=False)])
    assert s.span_s == pytest.approx(20.0)  # the window has seen 20 s so far, not 60
    assert s.requests == 10 and s.rate_per_s == pytest.approx(0.5)
    assert s.decode_tokens_per_s == pytest.approx(50.0)
    assert s.prefill_tokens_per_s == pytest.approx(25.0)
    assert s.mean_streams == pytest.approx(1.0)  # ten 2-second streams in 20 s
    inputs = s.inputs()
    assert inputs["healthy_backends"] == 1
    assert inputs["backends_by_role"] == {"mixed": {"healthy": 1, "unhealthy": 1}}


def test_old_requests_leave_the_window() -> None:
    w = Window(10, LONG)
    w.started("old", "a", 0.0, 50)
    w.finished(stream("old", "a", 0.0, 0.5, 1.0))
    w.finished(stream("new", "a", 15.0, 15.5, 16.0))
    s = w.snapshot(20.0)
    assert s.requests == 1 and s.span_s == 10.0 and w.in_flight == 0


def test_steady_arrivals_have_a_low_cv_and_bursts_a_high_one() -> None:
    rng = random.Random(3)
    steady = Window(60, LONG, rate_buckets=12)
    t = 0.0
    while t < 60:
        t += rng.expovariate(5.0)  # Poisson, 5 req/s: 25 per 5 s bucket, CV ~0.2
        steady.started(f"s{t}", "a", t, 50)
    cv = steady.snapshot(60.0).rate_cv
    assert cv is not None and cv < 0.35
    bursty = Window(60, LONG, rate_buckets=12)
    for burst in (2.0, 32.0):  # all 300 requests in two 1-second bursts
        for i in range(150):
            bursty.started(f"b{burst}-{i}", "a", burst + i / 150, 50)
    cv = bursty.snapshot(60.0).rate_cv
    assert cv is not None and cv > 2.0
    assert Window(60, LONG).snapshot(1.0).rate_cv is None  # too few arrivals to tell


def test_itl_quantiles_are_the_projects_one_percentile() -> None:
    gaps = [0.01] * 98 + [0.07, 0.08]
    assert itl_quantiles(gaps) == (0.01, percentile(sorted(gaps), 0.99))
    assert itl_quantiles(gaps) == (0.01, pytest.approx(0.0701))  # linear between ranks
    assert itl_quantiles([]) is None
    assert itl_quantiles([0.02]) == (0.02, 0.02)


def test_window_rejects_nonsense_sizes() -> None:
    with pytest.raises(ValueError):
        Window(0, LONG)


def test_a_retry_is_one_arrival_and_its_long_prefill_moves_to_the_new_backend() -> None:
    w = Window(60, LONG)
    w.started("doc", "a", 10.0, 8_000)
    w.started("doc", "b", 11.0, 8_000)  # the attempt on a failed before its first byte
    w.first_token("doc", 13.0)
    w.finished(stream("on-a", "a", 11.5, 12.0, 20.0))  # decoding on a after a was given up
    w.finished(stream("on-b", "b", 11.5, 12.0, 20.0))
    w.finished(stream("doc", "b", 10.0, 13.0, 13.5, uncached=8_000, output=4))
    s = w.snapshot(20.0)
    assert s.requests == 3 and s.rate_per_s * s.span_s == pytest.approx(3)  # not 4 arrivals
    assert s.overlapped == 1  # on-b only


def test_a_decode_leg_started_with_no_prefill_opens_no_interval_on_its_engine() -> None:
    w = Window(60, LONG)
    w.prefill_started("doc/prefill", "p", 10.0, 8_000)
    w.prefill_ended("doc/prefill", 12.0)
    w.started("doc", "d", 12.0, 0)  # KV-transfer decode leg: the KV comes over the link
    w.first_token("doc", 12.1)
    w.finished(stream("beside-decode", "d", 9.0, 9.5, 20.0))
    w.finished(stream("beside-prefill", "p", 9.0, 9.5, 20.0))
    w.finished(stream("doc", "d", 10.0, 12.1, 12.5, uncached=8_000, output=16))
    s = w.snapshot(20.0)
    assert (s.streams, s.overlapped) == (3, 1)  # only the stream on the prefill engine
    assert s.requests == 3 and s.long_prefills == 1 and w.in_flight == 0
    assert s.rate_per_s * s.span_s == pytest.approx(3)  # the prefill leg is no arrival
