"""The running proxy's doctor windows (proxy/doctor/collector.py): what a finished request
leaves in them is what the report reads back, whatever form the window keeps it in."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from proxy.doctor.collector import (
    GAP_BUDGET_BYTES,
    MAX_GAPS_PER_STREAM,
    MAX_REQUESTS,
    MIN_GAPS_PER_STREAM,
    BackendInfo,
    Collector,
)
from proxy.routing.types import EngineLoad
from proxy.types import StreamFacts
from tests.support import load_script


def facts(gaps: list[float], **over: Any) -> StreamFacts:
    base: dict[str, Any] = {
        "ttft_s": 0.02,
        "upstream_ttft_s": 0.015,
        "itl_s": gaps,
        "tpot_s": 0.001,
        "e2e_s": 0.5,
        "chunks": len(gaps) + 1,
        "events": len(gaps) + 3,
        "output_tokens": len(gaps) + 1,
        "input_tokens": 400,
        "cached_tokens": 256,
        "finish_reasons": ["stop"],
        "response_id": "r",
        "response_model": "m",
        "error": None,
        "cancelled": False,
        "first_output_at": 10.0,
        "last_output_at": 10.0 + sum(gaps),
        "engine_prefill_s": 0.004,
    }
    return StreamFacts(**{**base, **over})


@dataclass
class Decision:
    matched_blocks: dict[str, int] = field(default_factory=lambda: {"a": 2, "b": 5})
    block_chars: int = 64
    prompt_chars: int = 1280


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def collector(loads: dict[str, EngineLoad] | None = None) -> tuple[Collector, Clock]:
    clock = Clock()
    return Collector(
        [BackendInfo("a", "vllm"), BackendInfo("b", "vllm")],
        loads=(loads or {}).get,
        window_s=300.0,
        clock=clock,
    ), clock


def test_a_finished_request_comes_back_with_every_measurement_and_its_gaps_in_order() -> None:
    c, _ = collector()
    gaps = [0.003, 0.001, 0.0125, 1e-9, 0.25]
    c.finished("m", "a", facts(gaps), None, Decision(), 42.0)
    (window,) = [w for w in c.windows() if w.backend == "a"]
    (r,) = window.requests
    assert (window.model, window.engine, window.errors) == ("m", "vllm", 0)
    assert list(r.itl_s) == gaps  # bit for bit, in stream order
    assert (r.start, r.ttft_s, r.upstream_ttft_s, r.first_at) == (42.0, 0.02, 0.015, 10.0)
    assert (r.input_tokens, r.cached_tokens, r.output_tokens) == (400, 256, 6)
    assert r.engine_prefill_s == 0.004
    # 2 and 5 blocks of 64 of the prompt's 1,280 characters, in its 400 tokens
    assert (r.predicted_tokens, r.seen_tokens) == (40.0, 100.0)
    assert r.last_at == 10.0 + sum(gaps)


def test_a_stream_without_gaps_and_one_past_the_cap_are_kept_as_the_report_expects() -> None:
    c, _ = collector()
    long = [i * 1e-4 for i in range(MAX_GAPS_PER_STREAM + 50)]
    c.finished("m", "a", facts([]), None, None, 1.0)
    c.finished("m", "a", facts(long), None, None, 2.0)
    short, capped = next(w for w in c.windows() if w.backend == "a").requests
    assert len(short.itl_s) == 0 and short.predicted_tokens is None
    assert list(capped.itl_s) == long[:MAX_GAPS_PER_STREAM]  # the first ones


def test_more_windows_keep_fewer_gaps_per_stream_within_the_budget_and_the_true_end() -> None:
    # 10 requests per window, a budget for 256 gaps per stream in one window
    c = Collector([BackendInfo(b) for b in "abcd"], max_requests=10, gap_budget_bytes=8 * 10 * 256)
    long = [1e-3 * (1 + i % 7) for i in range(300)]
    c.finished("m", "a", facts(long), None, None, 1.0)
    c.finished("m", "b", facts(long), None, None, 2.0)  # a second window: 128 each from now
    c.finished("m", "a", facts(long), None, None, 3.0)
    c.finished("m", "a", facts(long[:100]), None, None, 4.0)  # under the cap: whole
    w = {x.backend: x for x in c.windows(window_s=1e9)}
    a1, a2, a3 = w["a"].requests
    (b1,) = w["b"].requests
    assert list(a1.itl_s) == long[:256]
    assert list(b1.itl_s) == long[:128] and list(a2.itl_s) == long[:128]
    for r in (a1, b1, a2):  # the whole stream's count and end
        assert r.gap_count == 300 and r.last_at == 10.0 + sum(long)
    assert (list(a3.itl_s), a3.gap_count, a3.end_at) == (long[:100], 100, None)
    for b in "cd":  # four windows and more: the floor
        c.finished("m", b, facts(long), None, None, 5.0)
    assert c.gaps_per_stream == MIN_GAPS_PER_STREAM
    # once the windows' requests have been replaced, the gaps they keep fit the budget
    c2 = Collector([BackendInfo(b) for b in "ab"], max_requests=10, gap_budget_bytes=8 * 10 * 256)
    kept = []
    for i in range(20):
        for b in "ab":
            c2.finished("m", b, facts(long), None, None, float(i))
        kept.append(sum(len(r.itl_s) for x in c2.windows(window_s=1e9) for r in x.requests))
    assert kept[9] == 256 + 19 * 128  # a's first stream came while it was the only window
    assert kept[-1] * 8 == 8 * 10 * 256


def test_one_window_of_the_default_size_keeps_every_stream_up_to_the_cap() -> None:
    assert GAP_BUDGET_BYTES // (8 * MAX_REQUESTS) >= MAX_GAPS_PER_STREAM
    assert Collector([BackendInfo("a")]).gaps_per_stream == MAX_GAPS_PER_STREAM


def test_errors_count_apart_and_old_requests_leave_the_window() -> None:
    c, _ = collector()
    c.finished("m", "b", None, "timeout", None, 50.0)
    c.finished("m", "b", facts([0.01]), None, None, 90.0)
    c.finished("m", "b", facts([0.01]), None, None, 99.0)
    window = next(w for w in c.windows(window_s=5.0) if w.backend == "b")
    assert [r.start for r in window.requests] == [99.0] and window.errors == 0
    window = next(w for w in c.windows() if w.backend == "b")
    assert [r.start for r in window.requests] == [90.0, 99.0] and window.errors == 1
    idle = next(w for w in c.windows() if w.backend == "a")
    assert idle.requests == [] and idle.model == ""


def test_each_new_scrape_is_sampled_once_by_the_next_request_that_finishes() -> None:
    loads = {"a": EngineLoad(waiting=1, running=3, kv_usage=0.5, scraped_at=7.0)}
    c, clock = collector(loads)
    c.finished("m", "a", facts([0.01]), None, None, 99.0)
    c.finished("m", "a", facts([0.01]), None, None, 99.5)
    loads["a"] = EngineLoad(waiting=4, running=3, kv_usage=0.9, scraped_at=9.0)
    clock.now = 101.0
    c.finished("m", "a", facts([0.01]), None, None, 100.5)
    gauges = next(w for w in c.windows() if w.backend == "a").gauges
    assert [(g.at, g.waiting, g.kv_usage) for g in gauges] == [(100.0, 1, 0.5), (101.0, 4, 0.9)]


def test_a_report_read_from_another_thread_while_requests_finish_loses_none_and_keeps_order() -> (
    None
):
    c = Collector([BackendInfo("a")], max_requests=100_000)
    n = 20_000
    gaps = [0.01, 0.02]

    read = threading.Event()

    def finish_all() -> None:
        for i in range(n):
            if i % 1_000 == 0:  # hand over to the reader now and then, so it reads mid-stream
                read.clear()  # on a busy machine the GIL may otherwise let it in only once
                read.wait(timeout=5)
            c.finished("m", "a", facts(gaps), None, None, float(i))

    seen = []
    writer = threading.Thread(target=finish_all)
    writer.start()
    while writer.is_alive():  # the findings gauge's thread reads while the loop appends
        seen.append(sum(len(w.requests) for w in c.windows(window_s=1e9)))
        read.set()
    writer.join()
    (window,) = c.windows(window_s=1e9)
    assert [r.start for r in window.requests] == [float(i) for i in range(n)]
    assert seen == sorted(seen) and len(seen) >= n // 1_000 and any(0 < s < n for s in seen)


def test_a_stream_kept_in_part_still_grows_its_context_to_its_last_chunk() -> None:
    """The decode context sweep reads a long stream's true end and chunk count, not the part of
    its gaps the window kept."""
    from proxy.doctor.model import RequestSample
    from proxy.doctor.timeline import _context_at

    whole = RequestSample(start=0.0, first_at=10.0, itl_s=[0.01] * 400, input_tokens=1000)
    kept = RequestSample(
        start=0.0, first_at=10.0, itl_s=[0.01] * 64, input_tokens=1000, end_at=14.0, gaps=400
    )
    times = [10.0, 12.0, 13.999]
    assert (
        [round(ctx) for ctx, _ in _context_at([kept], times)]
        == [round(ctx) for ctx, _ in _context_at([whole], times)]
        == [1000, 1200, 1400]
    )


def test_the_windows_of_a_fleet_of_long_answers_stay_near_the_gap_budget_in_memory() -> None:
    """deploy/perf/memory_bounds.py's measurement (tracemalloc, deterministic): four windows
    full of 4,096-token streams held 4 x 66 MB before the budget."""
    bounds = load_script("deploy/perf/memory_bounds.py", "warmroute_memory_bounds")
    one, _ = bounds.heap_mb(lambda: bounds.full_windows(1, 4096))
    four, c = bounds.heap_mb(lambda: bounds.full_windows(4, 4096))
    assert c.gaps_per_stream < MAX_GAPS_PER_STREAM
    budget_mb = GAP_BUDGET_BYTES / 1e6
    assert 0.9 * budget_mb < one < four < 1.15 * budget_mb


def test_a_keyed_request_is_kept_with_its_tenant_wait_and_tokens_for_the_queue_rule() -> None:
    from proxy.admission.slots import TICKET, Ticket
    from proxy.doctor.http import Doctor
    from proxy.types import CLIENT

    c, clock = collector()
    doctor = Doctor(c)
    ticket = Ticket("team-a")
    ticket.waited_s = 0.25
    ticket.backend_wait_s = 0.5  # then for a backend at its bound
    held = (CLIENT.set("team-a"), TICKET.set(ticket))
    try:
        doctor.finished("m", "a", facts([0.01]), None, Decision(), 99.0)
    finally:
        CLIENT.reset(held[0])
        TICKET.reset(held[1])
    doctor.finished("m", "a", facts([0.01]), None, Decision(), 99.5)  # no key: not a tenant's
    [row] = c.tenant_requests()
    assert (row.tenant, row.waited_s, row.tokens) == ("team-a", 0.75, 402)  # 400 in, 2 out
    clock.now += 400  # past the window
    assert c.tenant_requests() == []
