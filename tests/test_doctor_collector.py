"""The running proxy's doctor windows (proxy/doctor/collector.py): what a finished request
leaves in them is what the report reads back, whatever form the window keeps it in."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from proxy.doctor.collector import MAX_GAPS_PER_STREAM, BackendInfo, Collector
from proxy.meter import StreamFacts
from proxy.routing.types import EngineLoad


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
