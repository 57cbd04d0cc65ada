"""The doctor's rules on hand-built windows: no servers, no simulator, every number known.

Each window is written to show one pathology the way the proxy would have measured it, so each
test can say which finding comes out and what its evidence must read. Times are seconds on the
window's own clock.
"""

from __future__ import annotations

import contextlib
import io
import os
import pty
import select
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.cli import main
from proxy.doctor import FINDING_IDS, SCHEMA, Thresholds, Window, diagnose
from proxy.doctor.hardware import declared
from proxy.doctor.model import (
    PREEMPTIONS,
    PREFILL_TIME_COUNT,
    PREFILL_TIME_SUM,
    QUEUE_TIME_COUNT,
    QUEUE_TIME_SUM,
    GaugeSample,
    RequestSample,
)
from proxy.doctor.render import render_text, use_color
from tests.support import serving

STEP = 0.02  # one decode step in the hand-built streams


def req(
    start: float,
    *,
    upstream: float = 0.05,
    gaps: Sequence[float] = (STEP,) * 10,
    input_tokens: int = 1000,
    cached: int | None = 900,
    predicted: float | None = None,
    seen: float | None = None,
    prefill_s: float | None = None,
    output: int | None = None,
) -> RequestSample:
    """One finished, streamed request; the proxy adds nothing to the upstream TTFT here."""
    return RequestSample(
        start=start,
        ttft_s=upstream,
        upstream_ttft_s=upstream,
        first_at=start + upstream,
        itl_s=list(gaps),
        input_tokens=input_tokens,
        cached_tokens=cached,
        output_tokens=len(gaps) + 1 if output is None else output,
        predicted_tokens=predicted,
        seen_tokens=seen,
        engine_prefill_s=prefill_s,
    )


def gauges(
    n: int = 5,
    *,
    waiting: float = 0.0,
    running: float = 4.0,
    kv_usage: float = 0.3,
    queue_s: float | None = None,
    prefill_s: float | None = None,
    per_scrape: int = 5,
    preemptions: float = 0.0,
) -> list[GaugeSample]:
    """`n` scrapes 1 s apart; with queue_s/prefill_s, vLLM's histograms grow by `per_scrape`
    requests of those mean times between scrapes."""
    out = []
    for i in range(n):
        counters: dict[str, float] = {PREEMPTIONS: preemptions * i}
        if queue_s is not None:
            counters |= {QUEUE_TIME_SUM: queue_s * per_scrape * i, QUEUE_TIME_COUNT: per_scrape * i}
        if prefill_s is not None:
            counters |= {
                PREFILL_TIME_SUM: prefill_s * per_scrape * i,
                PREFILL_TIME_COUNT: per_scrape * i,
            }
        out.append(
            GaugeSample(
                at=float(i), waiting=waiting, running=running, kv_usage=kv_usage, counters=counters
            )
        )
    return out


def window(requests: Sequence[RequestSample], **kw: Any) -> Window:
    kw.setdefault("engine", "vllm")
    return Window(backend="b1:8000", model="m", requests=list(requests), **kw)


def ids(*windows: Window) -> list[str]:
    return [f.id for f in diagnose(list(windows)).findings]


def only(w: Window) -> dict[str, Any]:
    """The one finding of `w` (as JSON), failing if there are none or several."""
    found = diagnose([w]).findings
    assert len(found) == 1, [f.id for f in found]
    return found[0].as_dict()


def healthy_requests(n: int = 30, upstream: float = 0.05) -> list[RequestSample]:
    # Prompts of 1,000 tokens, 900 of them cached as the index predicted: a warm cache.
    return [req(i * 0.5, upstream=upstream, predicted=900, seen=900) for i in range(n)]


# -- one rule each ------------------------------------------------------------------------------


def test_a_healthy_window_has_no_finding() -> None:
    hw = declared("h100", "8b")
    assert hw is not None
    reqs = healthy_requests()
    for r in reqs:  # decoding close to the roofline of the declared hardware
        r.itl_s = [1.1 * hw.step_s(1000)] * 10
    w = window(reqs, gauges=gauges(queue_s=0.005, prefill_s=0.04), hardware=hw)
    report = diagnose([w])
    assert report.findings == [] and report.as_dict()["healthy"] is True
    assert report.backends[0].findings == [] and report.backends[0].requests == 30


def test_queueing_when_most_of_ttft_is_waiting_and_the_pool_has_room() -> None:
    # 0.6 s queued + 0.2 s prefill per the engine's histograms, KV pool 30% used.
    reqs = [req(i * 0.5, upstream=0.8) for i in range(25)]
    f = only(window(reqs, gauges=gauges(waiting=3, queue_s=0.6, prefill_s=0.2)))
    assert f["id"] == "queueing" and f["severity"] == "warning"  # 75%: not yet 80%
    e = f["evidence"]
    assert e["queue_share_of_ttft"] == pytest.approx(0.75)
    assert e["queue_s_mean"] == pytest.approx(0.6) and e["upstream_ttft_s_mean"] == 0.8
    assert e["split_source"] == "engine histograms" and e["waiting_mean"] == 3
    assert e["full_while_waiting"] == 0.0
    assert "600 of 800 ms" in f["summary"] and "replicas" in f["change"]


def test_kv_pressure_when_requests_wait_while_the_pool_is_full() -> None:
    reqs = [req(i * 0.5, upstream=0.8) for i in range(25)]
    g = gauges(waiting=6, running=12, kv_usage=0.99, queue_s=0.7, prefill_s=0.1, preemptions=2)
    f = only(window(reqs, gauges=g))
    assert f["id"] == "kv_pressure" and f["severity"] == "critical"  # 87.5% of TTFT queued
    e = f["evidence"]
    assert e["queue_share_of_ttft"] == pytest.approx(0.875)
    assert e["full_while_waiting"] == 1.0 and e["kv_usage_max"] == 0.99
    assert e["preemptions"] == 8.0  # 2 per scrape, over 4 intervals
    assert e["prompt_tokens_mean"] == 1000
    assert "capacity, not the model" in f["change"]


def test_prefill_bound_ttft_when_prompts_cached_elsewhere_are_prefilled_again() -> None:
    # 4,000-token prompts the index had seen on another backend; this engine reports 100 cached
    # and says (llama.cpp timings) it prefilled 3,900 tokens in 0.39 s: 10,000 tokens/s.
    reqs = [
        req(
            i * 0.5,
            upstream=0.45,
            input_tokens=4000,
            cached=100,
            predicted=0,
            seen=4000,
            prefill_s=0.39,
        )
        for i in range(20)
    ]
    f = only(window(reqs, engine="llamacpp", policy="round_robin"))
    assert f["id"] == "prefill_bound_ttft" and f["severity"] == "critical"
    e = f["evidence"]
    assert e["prefill_tokens_per_s"] == pytest.approx(10000)
    assert e["avoidable_tokens_per_request"] == 3900
    assert e["avoidable_s_per_request"] == pytest.approx(0.39)
    assert e["avoidable_share_of_ttft"] == pytest.approx(0.39 / 0.45, abs=1e-3)
    assert e["avoidable_tokens_elsewhere"] == 3900 * 20 and e["avoidable_tokens_here"] == 0
    assert e["engine_caches_nothing"] is False
    assert "routing sent it elsewhere" in f["summary"] and "round_robin" in f["change"]


def test_prefill_bound_ttft_when_the_engine_caches_nothing_though_prompts_repeat() -> None:
    # Caching off: every prompt fully prefilled (0.4 s of a 0.42 s TTFT); the index still knew
    # half of them (it forgets what the engine reports it did not keep: a lower bound).
    reqs = [
        req(
            i * 0.5,
            upstream=0.42,
            input_tokens=4000,
            cached=0,
            predicted=4000 if i % 2 else 0,
            seen=4000 if i % 2 else 0,
        )
        for i in range(24)
    ]
    f = only(window(reqs, gauges=gauges(queue_s=0.02, prefill_s=0.4)))
    assert f["id"] == "prefill_bound_ttft" and f["severity"] == "critical"
    e = f["evidence"]
    assert e["engine_caches_nothing"] is True and e["reported_hit_ratio"] == 0.0
    assert e["prefill_share_of_ttft"] == pytest.approx(0.4 / 0.42, abs=1e-3)
    assert e["repeated_share_of_prefill"] == pytest.approx(0.5)
    assert e["prefill_tokens_per_s"] == pytest.approx(10000)
    assert "enable prefix caching" in f["change"]


def test_cache_affinity_lost_when_the_engine_misses_what_the_index_predicted() -> None:
    # Predicted 3,000 cached, reported 500; prefill is fast enough that TTFT does not suffer.
    reqs = [
        req(
            i * 0.5,
            upstream=0.04,
            input_tokens=4000,
            cached=500,
            predicted=3000,
            seen=3000,
            prefill_s=0.035,
        )
        for i in range(20)
    ]
    f = only(window(reqs, engine="llamacpp"))
    assert f["id"] == "cache_affinity_lost" and f["severity"] == "critical"
    e = f["evidence"]
    assert e["predicted_tokens"] == 60000 and e["predicted_hit_tokens"] == 10000
    assert e["missing_share"] == pytest.approx(1 - 500 / 3000, abs=1e-6)
    assert e["unpredicted_share"] == 0.0 and e["requests_with_prediction"] == 20
    assert "eviction" in f["change"]


def test_cache_affinity_lost_the_other_way_when_the_index_forgets_what_the_engine_keeps() -> None:
    reqs = [
        req(
            i * 0.5,
            upstream=0.04,
            input_tokens=4000,
            cached=3000,
            predicted=500,
            seen=500,
            prefill_s=0.01,
        )
        for i in range(20)
    ]
    f = only(window(reqs, engine="llamacpp"))
    assert f["id"] == "cache_affinity_lost" and f["severity"] == "critical"
    assert f["evidence"]["unpredicted_share"] == pytest.approx(2500 / 3000, abs=1e-6)
    assert f["evidence"]["missing_share"] == 0.0
    assert "capacity_blocks" in f["change"]


def interference(
    stall: float = 0.2, doc_tokens: int = 8000, doc_prefill_s: float = 0.8, streams: int = 4
) -> list[RequestSample]:
    """`streams` chat streams decoding at STEP for 6 s beside three long documents whose
    prefills (engine timings) overlap them; a gap that shares a step with one lasts `stall`."""
    docs_first = [1.5, 3.0, 4.5]
    intervals = [(f - doc_prefill_s, f) for f in docs_first]
    rate = doc_tokens / doc_prefill_s
    out = []
    for s in range(streams):
        start, upstream = 0.001 * s, 50 / rate
        t, gaps = start + upstream, []
        while t < 6.0:
            g = stall if any(t < e and t + STEP > b for b, e in intervals) else STEP
            gaps.append(g)
            t += g
        out.append(
            req(start, upstream=upstream, gaps=gaps, input_tokens=50, cached=0, prefill_s=upstream)
        )
    for f in docs_first:
        out.append(
            req(
                f - doc_prefill_s,
                upstream=doc_prefill_s,
                gaps=(STEP,) * 3,
                input_tokens=doc_tokens,
                cached=0,
                prefill_s=doc_prefill_s,
            )
        )
    return out


def test_prefill_interference_when_streams_stall_beside_long_prefills() -> None:
    f = only(window(interference(), engine="llamacpp"))
    assert f["id"] == "prefill_interference" and f["severity"] == "critical"  # p99 = 10 x p50
    e = f["evidence"]
    assert e["itl_p50_s"] == STEP and e["itl_p99_s"] == 0.2
    assert e["itl_p99_over_p50"] == pytest.approx(10.0)
    assert e["clean_itl_p99_s"] == STEP and e["alongside_itl_p99_s"] == 0.2
    assert e["prefill_tokens_per_s"] == pytest.approx(10000)
    # the device prefills 10,000 x 0.02 = 200 tokens in one decode step; advised: 256
    assert e["step_tokens"] == pytest.approx(200) and e["advised_chunk_tokens"] == 256
    assert e["long_prefills"] == 3 and e["long_prefill_tokens_mean"] == 8000
    assert e["disagg"] is None
    assert "--max-num-batched-tokens" in f["change"] and "256 tokens" in f["change"]


def test_prefill_interference_carries_the_disaggregation_deciders_view() -> None:
    view = {"mode": "auto", "active": False, "reason": "too little traffic", "extra": 1}
    f = only(window(interference(), engine="llamacpp", disagg=view))
    assert f["evidence"]["disagg"] == {
        "mode": "auto",
        "active": False,
        "reason": "too little traffic",
    }
    assert "keeps the pools joined: too little traffic" in f["change"]


def test_no_prefill_interference_when_a_smaller_chunk_could_not_halve_the_stall() -> None:
    # A slow prefill (100 tokens/s): a 64-token chunk alone costs 0.64 s, more than the stall.
    slow = interference(stall=0.1, doc_tokens=80, doc_prefill_s=0.8)
    assert ids(window(slow, engine="llamacpp")) == []


def test_no_prefill_interference_when_itl_stalls_without_long_prefills_too() -> None:
    reqs = interference()
    for r in reqs[:4]:  # every 50th gap of the streams stalls anyway (preemption, a hiccup)
        r.itl_s = [0.2 if i % 50 == 49 else g for i, g in enumerate(r.itl_s)]
    assert "prefill_interference" not in ids(window(reqs, engine="llamacpp"))


def sequential(gap_of: Any, inputs: Sequence[int], n_gaps: int = 30) -> list[RequestSample]:
    """One stream at a time (no overlap): request k has prompt inputs[k], constant gaps."""
    out, t = [], 0.0
    for n in inputs:
        g = gap_of(n + n_gaps / 2)  # the mean context over the stream's life
        out.append(req(t, upstream=0.01, gaps=(g,) * n_gaps, input_tokens=n, cached=0))
        t += 0.01 + g * n_gaps + 0.01
    return out


def test_long_context_itl_when_the_step_grows_with_the_kv_read() -> None:
    # ITL = 5 ms + 0.1 ms per 1,000 tokens of context: at ~100k tokens, 2/3 of a step is KV.
    reqs = sequential(lambda ctx: 0.005 + 1e-7 * ctx, range(10_000, 100_001, 10_000))
    f = only(window(reqs))
    assert f["id"] == "long_context_itl" and f["severity"] == "warning"
    e = f["evidence"]
    assert e["source"] == "measured"
    assert e["itl_at_no_context_s"] == pytest.approx(0.005, rel=0.02)
    assert e["itl_per_1k_context_tokens_s"] == pytest.approx(1e-4, rel=0.02)
    ctx = e["context_tokens_p90"]
    assert 90_000 < ctx <= 100_030
    assert e["kv_share_of_step"] == pytest.approx(1e-7 * ctx / (0.005 + 1e-7 * ctx), abs=0.01)
    assert e["slope_t"] > 3


def test_decode_below_ceiling_when_steps_take_three_times_the_roofline() -> None:
    hw = declared("h100", "8b")
    assert hw is not None
    reqs = sequential(lambda ctx: 3 * hw.step_s(ctx), [100, 110, 120, 130, 140], n_gaps=40)
    f = only(window(reqs, hardware=hw))
    assert f["id"] == "decode_below_ceiling" and f["severity"] == "warning"  # 33%: not < 25%
    e = f["evidence"]
    assert e["efficiency"] == pytest.approx(1 / 3, rel=0.01)
    assert e["single_stream_ceiling_tok_s"] == pytest.approx(3350e9 / 16e9)  # 209.4
    assert e["decode_tok_s"] == pytest.approx(e["ceiling_tok_s"] / 3, rel=0.01)
    assert e["single_stream_tok_s"] == pytest.approx(e["decode_tok_s"], rel=1e-6)
    assert e["hardware"] == "h100/8b/bf16" and e["streams_mean"] == pytest.approx(1, abs=0.01)
    assert "serving-stack problem" in f["change"]


def test_decode_at_ceiling_when_the_hardware_itself_is_too_slow_for_a_reader() -> None:
    hw = declared("cpu-ddr5", "8b")
    assert hw is not None
    reqs = sequential(lambda ctx: 1.1 * hw.step_s(ctx), [100, 110, 120, 130, 140], n_gaps=40)
    f = only(window(reqs, hardware=hw))
    assert f["id"] == "decode_at_ceiling" and f["severity"] == "warning"  # 5.1 tok/s: not < 5
    e = f["evidence"]
    assert e["single_stream_ceiling_tok_s"] == pytest.approx(90e9 / 16e9)  # 5.625
    assert e["efficiency"] == pytest.approx(1 / 1.1, rel=0.01)
    assert e["decode_tok_s"] == pytest.approx(5.625 / 1.1, rel=0.01)
    assert e["target_tok_s"] == 10.0
    assert "quantize" in f["change"]


def test_every_rule_has_a_test_above() -> None:
    tested = {
        "kv_pressure",
        "queueing",
        "prefill_bound_ttft",
        "cache_affinity_lost",
        "prefill_interference",
        "long_context_itl",
        "decode_below_ceiling",
        "decode_at_ceiling",
        "tenant_crowding",  # the admission queue's, at the end of this file
    }
    assert tested == set(FINDING_IDS)


# -- what cannot be judged --------------------------------------------------------------------


def test_no_windows_is_a_healthy_empty_report() -> None:
    d = diagnose([], window_s=60.0, generated_at="2025-01-01T00:00:00+00:00").as_dict()
    assert d == {
        "schema": SCHEMA,
        "generated_at": "2025-01-01T00:00:00+00:00",
        "window_s": 60.0,
        "healthy": True,
        "backends": [],
        "findings": [],
    }


def test_a_backend_without_traffic_is_listed_with_a_note_and_no_finding() -> None:
    report = diagnose([window([], gauges=gauges(waiting=9, kv_usage=1.0))])
    (b,) = report.backends
    assert report.findings == [] and b.requests == 0 and b.span_s == 0
    assert b.notes == ["no requests in the window: nothing to judge"]
    assert b.measurements["ttft_p50_s"] is None and b.measurements["scrapes"] == 5


def test_one_request_is_too_few_to_judge_however_slow_it_was() -> None:
    slow = req(0.0, upstream=30.0, input_tokens=4000, cached=0, predicted=4000, seen=4000)
    report = diagnose([window([slow], gauges=gauges(waiting=5, kv_usage=1.0, queue_s=29))])
    assert report.findings == []
    notes = report.backends[0].notes
    assert any("1 request(s): too few to judge TTFT" in n for n in notes)
    assert any("10 inter-token gaps: too few" in n for n in notes)


def test_a_backend_without_gauges_is_judged_on_what_the_proxy_measured() -> None:
    # No scrape: no split, so neither queueing nor KV pressure, but the cache still judges.
    reqs = [
        req(
            i * 0.5,
            upstream=0.45,
            input_tokens=4000,
            cached=100,
            predicted=0,
            seen=4000,
            prefill_s=None,
        )
        for i in range(20)
    ]
    report = diagnose([window(reqs, policy="round_robin")])
    assert [f.id for f in report.findings] == ["prefill_bound_ttft"]
    notes = report.backends[0].notes
    assert any("no scrape of the vllm engine's /metrics" in n for n in notes)
    assert any("no engine gauges in the window: KV pressure cannot be judged" in n for n in notes)
    assert report.backends[0].measurements["split_source"] is None


def test_an_openai_engine_that_publishes_nothing_gets_notes_not_guesses() -> None:
    # No gauges, no cached_tokens, no index prediction: TTFT of 3 s says nothing about why.
    reqs = [req(i * 0.5, upstream=3.0, cached=None) for i in range(30)]
    report = diagnose([window(reqs, engine="openai")])
    assert report.findings == []
    notes = " | ".join(report.backends[0].notes)
    assert "engine 'openai' publishes no queue gauge or latency split" in notes
    assert "reports no cached_tokens in usage" in notes
    assert "did not match prompts against the prefix index" in notes
    assert "no declared hardware" in notes
    m = report.backends[0].measurements
    assert m["ttft_p50_s"] == 3.0 and m["queue_s_mean"] is None and m["reported_hit_ratio"] is None


def test_a_wait_too_short_to_notice_is_not_queueing() -> None:
    # 80% of a 50 ms TTFT waiting is a request joining the batch at a step boundary.
    reqs = [req(i * 0.5, upstream=0.05) for i in range(25)]
    assert ids(window(reqs, gauges=gauges(waiting=1, queue_s=0.04, prefill_s=0.01))) == []
    assert Thresholds().min_cost_s == 0.1


# -- when two findings would describe one cause ------------------------------------------------


def test_a_full_pool_explains_the_queue_kv_pressure_not_queueing() -> None:
    reqs = [req(i * 0.5, upstream=0.8) for i in range(25)]
    roomy = window(reqs, gauges=gauges(waiting=6, kv_usage=0.3, queue_s=0.7, prefill_s=0.1))
    full = window(reqs, gauges=gauges(waiting=6, kv_usage=0.99, queue_s=0.7, prefill_s=0.1))
    assert ids(roomy) == ["queueing"] and ids(full) == ["kv_pressure"]


def test_caching_off_is_prefill_bound_ttft_and_not_also_cache_affinity_lost() -> None:
    reqs = [
        req(i * 0.5, upstream=0.42, input_tokens=4000, cached=0, predicted=4000, seen=4000)
        for i in range(24)
    ]
    w = window(reqs, gauges=gauges(queue_s=0.02, prefill_s=0.4))
    assert ids(w) == ["prefill_bound_ttft"]
    # with short prompts (no TTFT to win) the disagreement is what is left to say
    quick = [
        req(i * 0.5, upstream=0.04, input_tokens=4000, cached=0, predicted=4000, seen=4000)
        for i in range(24)
    ]
    f = only(window(quick, gauges=gauges(queue_s=0.001, prefill_s=0.039)))
    assert f["id"] == "cache_affinity_lost" and f["change"].startswith("the engine caches nothing")


def test_preemption_recomputes_under_kv_pressure_are_not_prefill_interference() -> None:
    # The streams beside long prefills, then 30 requests that waited 0.85 s for a full pool.
    reqs = interference() + [req(7 + i * 0.2, upstream=0.9, prefill_s=0.05) for i in range(30)]
    g = gauges(waiting=6, kv_usage=0.99)
    assert ids(window(reqs, engine="llamacpp", gauges=g)) == ["kv_pressure", "prefill_interference"]
    g = gauges(waiting=6, kv_usage=0.99, preemptions=3)
    assert ids(window(reqs, engine="llamacpp", gauges=g)) == ["kv_pressure"]


# -- the report as text and as the CLI prints it -----------------------------------------------


def pathological() -> dict[str, Any]:
    reqs = [req(i * 0.5, upstream=0.8) for i in range(25)]
    sick = window(reqs, gauges=gauges(waiting=3, queue_s=0.6, prefill_s=0.2))
    well = Window(backend="b2:8000", model="m", engine="vllm", requests=healthy_requests())
    return diagnose([sick, well], window_s=300.0).as_dict()


def test_render_text_is_a_table_per_backend_with_colour_only_when_asked() -> None:
    report = pathological()
    plain = render_text(report, color=False, source="http://127.0.0.1:1")
    coloured = render_text(report, color=True)
    assert "\x1b[" not in plain and "\x1b[33mWARNING queueing" in coloured
    assert plain.startswith("warmroute doctor: http://127.0.0.1:1, last 300 s; 2 backend(s), 1")
    lines = plain.splitlines()
    b1 = lines.index(next(ln for ln in lines if ln.startswith("b1:8000")))
    assert lines[b1 + 1].split()[0] == "TTFT" and "queue 600 ms + prefill 200 ms" in lines[b1 + 1]
    assert "WARNING queueing: time to first token is mostly waiting" in plain
    assert "    change: more replicas" in plain
    assert "b2:8000  model m  engine vllm  30 requests" in plain and "no finding" in plain
    healthy = render_text(diagnose([]).as_dict())
    assert "healthy: no finding on any backend" in healthy


class Stream(io.StringIO):
    """Standard output as the CLI sees it: a terminal or not."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(
    ("tty", "no_color", "choice", "coloured"),
    [
        (True, None, "auto", True),  # a terminal
        (False, None, "auto", False),  # a pipe or a file
        (True, "1", "auto", False),  # NO_COLOR set: never on its own
        (True, "", "auto", True),  # ... but set and empty counts as unset (no-color.org)
        (False, "1", "always", True),  # asked for: always wins, over NO_COLOR too
        (True, None, "never", False),
        (False, None, "never", False),
    ],
)
def test_colour_follows_the_terminal_and_no_color_unless_forced(
    monkeypatch: pytest.MonkeyPatch, tty: bool, no_color: str | None, choice: str, coloured: bool
) -> None:
    if no_color is None:
        monkeypatch.delenv("NO_COLOR", raising=False)
    else:
        monkeypatch.setenv("NO_COLOR", no_color)
    assert use_color(Stream(tty), choice) is coloured


def test_a_pseudo_terminal_counts_as_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    leader, follower = pty.openpty()
    try:
        with open(follower, "w") as terminal, open(os.devnull, "w") as devnull:
            assert use_color(terminal) and not use_color(devnull)
            monkeypatch.setenv("NO_COLOR", "1")
            assert not use_color(terminal)
    finally:
        os.close(leader)


@contextlib.contextmanager
def doctor_endpoint(report: dict[str, Any], token: str | None = None) -> Iterator[str]:
    """A loopback server answering GET /admin/doctor as the proxy does (404 elsewhere)."""
    seen: list[dict[str, str]] = []

    async def endpoint(request: Request) -> Response:
        seen.append(dict(request.query_params))
        if token is not None and request.headers.get("authorization") != f"Bearer {token}":
            return JSONResponse({"error": {"message": "needs the admin token"}}, 401)
        return Response(orjson.dumps(report), media_type="application/json")

    app = Starlette(routes=[Route("/admin/doctor", endpoint)])
    with serving(app) as server:
        yield server.url


def run_cli(args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    code = main(args)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.e2e
def test_cli_json_prints_the_report_as_served(monkeypatch: pytest.MonkeyPatch) -> None:
    report = pathological()
    with doctor_endpoint(report) as url:
        code, out, _ = run_cli(["doctor", "--url", url, "--json", "--window-s", "60"], monkeypatch)
        assert code == 0 and orjson.loads(out) == report
        code, out, _ = run_cli(["doctor", "--url", url, "--color", "never"], monkeypatch)
        assert code == 0 and "WARNING queueing" in out and "\x1b[" not in out


@pytest.mark.e2e
def test_cli_sends_the_admin_token_and_says_what_to_do_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with doctor_endpoint(pathological(), token="s3cret") as url:
        code, _, err = run_cli(["doctor", "--url", url], monkeypatch)
        assert code == 1 and "needs the admin token" in err and "--token" in err
        code, _, err = run_cli(["doctor", "--url", url, "--token", "wrong"], monkeypatch)
        assert code == 1 and "was refused" in err
        monkeypatch.setenv("WARMROUTE_ADMIN_TOKEN", "s3cret")  # read when the parser is built
        code, out, _ = run_cli(["doctor", "--url", url, "--json"], monkeypatch)
        assert code == 0 and orjson.loads(out)["schema"] == SCHEMA
        # and 404: a port with no /admin says how to turn admin access on
        code, _, err = run_cli(["doctor", "--url", url + "/elsewhere"], monkeypatch)
        assert code == 1 and "admin port" in err and "admin_token_sha256" in err


def on_a_terminal(args: list[str], env: dict[str, str]) -> str:
    """What `warmroute ARGS` writes when its standard output is a terminal (a pty)."""
    leader, follower = pty.openpty()
    child = subprocess.Popen(
        [sys.executable, "-m", "proxy", *args], stdout=follower, stderr=subprocess.PIPE, env=env
    )
    os.close(follower)
    out = bytearray()
    try:
        while select.select([leader], [], [], 60)[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child exited and the terminal closed
                break
            if not chunk:
                break
            out += chunk
        assert child.wait(timeout=60) == 0, child.stderr.read() if child.stderr else ""
    finally:
        if child.poll() is None:
            child.kill()
        os.close(leader)
    return out.decode()


@pytest.mark.e2e
def test_cli_colours_a_terminal_by_itself_and_not_with_no_color(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    with doctor_endpoint(pathological()) as url:
        out = on_a_terminal(["doctor", "--url", url], env)
        assert "\x1b[33mWARNING queueing" in out
        out = on_a_terminal(["doctor", "--url", url], {**env, "NO_COLOR": "1"})
        assert "WARNING queueing" in out and "\x1b[" not in out
        out = on_a_terminal(["doctor", "--url", url, "--color", "never"], env)
        assert "WARNING queueing" in out and "\x1b[" not in out
        # and a pipe gets colours only when asked
        monkeypatch.delenv("NO_COLOR", raising=False)
        code, out, _ = run_cli(["doctor", "--url", url], monkeypatch)
        assert code == 0 and "WARNING queueing" in out and "\x1b[" not in out
        code, out, _ = run_cli(["doctor", "--url", url, "--color", "always"], monkeypatch)
        assert code == 0 and "\x1b[33mWARNING queueing" in out


# -- the admission queue, proxy-wide ------------------------------------------------------------


def test_tenant_crowding_when_one_tenant_has_most_tokens_and_the_others_wait() -> None:
    from proxy.doctor.model import TenantRequest

    flood = [TenantRequest(i * 0.1, "flood", 0.9, 4000) for i in range(30)]
    quiet = [TenantRequest(i * 0.5, "quiet", 0.3, 500) for i in range(10)]
    report = diagnose([], tenants=flood + quiet)
    [f] = [x.as_dict() for x in report.findings]
    assert f["id"] == "tenant_crowding" and f["backend"] == "admission"
    assert f["severity"] == "critical"  # 96% of the tokens
    e = f["evidence"]
    assert e["tenant"] == "flood" and e["token_share"] == pytest.approx(120000 / 125000)
    assert e["others_wait_s_mean"] == pytest.approx(0.3) and e["others_requests"] == 10
    assert "tenants.keys.flood" in f["change"]
    text = render_text(report.as_dict(), color=False)
    assert "admission (the proxy's admission queue)" in text
    assert "CRITICAL tenant_crowding: tenant `flood` had 96%" in text
    # The others hardly waited: not the flood's doing, whatever its share.
    calm = [TenantRequest(r.t0, r.tenant, 0.01, r.tokens) for r in quiet]
    assert diagnose([], tenants=flood + calm).findings == []
    # One tenant alone, or too few requests: nothing to judge.
    assert diagnose([], tenants=flood).findings == []
    assert diagnose([], tenants=flood[:5] + quiet[:5]).findings == []
