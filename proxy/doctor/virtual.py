"""Windows from the virtual-time fleet (proxy/harness/virtual.py): the doctor on a simulated
run, with no sockets and no wall clock.

`VirtualRecorder.finished` is run_virtual's `on_finish` hook. It records each request as the
proxy's telemetry hook would (what the client saw, the engine's usage, the index's prediction)
and samples the engine gauges the fleet scraped, with the counters vLLM publishes: its queue
and prefill time histograms (as sums and counts), its prefix-cache counters and preemptions.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Protocol

from proxy.doctor.collector import predicted_tokens
from proxy.doctor.model import (
    PREEMPTIONS,
    PREFILL_TIME_COUNT,
    PREFILL_TIME_SUM,
    PREFIX_HITS,
    PREFIX_QUERIES,
    QUEUE_TIME_COUNT,
    QUEUE_TIME_SUM,
    GaugeSample,
    Hardware,
    RequestSample,
    Window,
)


class _Result(Protocol):
    start: float
    ttft: float | None
    itl: list[float]
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    ok: bool


class _Seq(Protocol):
    arrival: float
    scheduled_at: float | None
    first_token_at: float | None


class VirtualRecorder:
    """Collects doctor windows from one virtual run: pass `recorder.finished` as on_finish."""

    def __init__(self, hardware: Hardware | None = None, policy: str | None = None) -> None:
        self.hardware = hardware
        self.policy = policy
        self.requests: dict[str, list[RequestSample]] = defaultdict(list)
        self.gauges: dict[str, list[GaugeSample]] = defaultdict(list)
        self.model = ""
        self._sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._last_scrape: dict[str, float] = {}
        self._names: list[str] = []

    def finished(self, fleet: Any, engine: int, r: _Result, ctx: Any, seq: _Seq) -> None:
        name = fleet.names[engine]
        self._names = list(fleet.names)
        self.model = ctx.model
        here, best = predicted_tokens(_Prediction(ctx), name, r.prompt_tokens)
        first = r.start + r.ttft if r.ttft is not None else None
        self.requests[name].append(
            RequestSample(
                start=r.start,
                ttft_s=r.ttft,
                upstream_ttft_s=r.ttft,  # no network and no proxy in virtual time
                first_at=first,
                itl_s=list(r.itl),
                input_tokens=r.prompt_tokens,
                cached_tokens=r.cached_tokens,
                output_tokens=r.completion_tokens,
                predicted_tokens=here,
                seen_tokens=best,
            )
        )
        sums = self._sums[name]
        if seq.scheduled_at is not None and seq.first_token_at is not None:
            sums[QUEUE_TIME_SUM] += seq.scheduled_at - seq.arrival
            sums[QUEUE_TIME_COUNT] += 1
            sums[PREFILL_TIME_SUM] += seq.first_token_at - seq.scheduled_at
            sums[PREFILL_TIME_COUNT] += 1
        load = fleet.loads[engine]
        if load.scraped_at != self._last_scrape.get(name):
            self._last_scrape[name] = load.scraped_at
            sched = fleet.scheds[engine]
            counters = dict(sums)
            counters[PREFIX_QUERIES] = float(sched.prefix_queries)
            counters[PREFIX_HITS] = float(sched.prefix_hits)
            counters[PREEMPTIONS] = float(sched.preemptions)
            self.gauges[name].append(
                GaugeSample(
                    at=fleet.now,
                    waiting=load.waiting,
                    running=load.running,
                    kv_usage=load.kv_usage,
                    kv_tokens=load.kv_tokens,
                    counters=counters,
                )
            )

    def windows(self, since: float = 0.0) -> list[Window]:
        """One window per engine (vLLM's signals), requests started at or after `since`."""
        out = []
        for name in self._names or sorted(self.requests):
            reqs = [r for r in self.requests.get(name, []) if r.start >= since]
            gauges = [g for g in self.gauges.get(name, []) if g.at >= since]
            out.append(
                Window(
                    backend=name,
                    model=self.model,
                    engine="vllm",
                    requests=reqs,
                    gauges=gauges,
                    hardware=self.hardware,
                    policy=self.policy,
                )
            )
        return out


class _Prediction:
    """A RouteContext read as the routing decision the proxy's hook gets."""

    __slots__ = ("block_chars", "matched_blocks", "prompt_chars")

    def __init__(self, ctx: Any) -> None:
        self.matched_blocks = ctx.matched_blocks
        self.block_chars = ctx.block_chars
        self.prompt_chars = ctx.prompt_chars
