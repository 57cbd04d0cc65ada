"""One window's measurements (pure): TTFT split into queueing and prefill, the cache as the
index predicted and the engine reported, the engine's gauges, and the decode timeline.

The split of the upstream TTFT (request sent -> first token received) uses the best source
the engine offers, in this order:

1. the engine's per-request figures (llama.cpp's `timings.prompt_ms` is its prefill; the
   rest of the upstream TTFT is waiting);
2. the engine's latency histograms over the window (vLLM's
   `vllm:request_queue_time_seconds` and `vllm:request_prefill_time_seconds`: the change of
   their sums over the change of their counts is the window's mean);
3. the engine's queue gauge and Little's law: requests waiting on average (L), divided by the
   rate they arrive at (λ, this window's requests over its span), is the mean wait (W = L/λ);
4. nothing: the split is unknown and the findings that need it stay silent (a note says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.doctor.model import (
    PREEMPTIONS,
    PREFILL_TIME_COUNT,
    PREFILL_TIME_SUM,
    PREFIX_HITS,
    PREFIX_QUERIES,
    QUEUE_TIME_COUNT,
    QUEUE_TIME_SUM,
    GaugeSample,
    RequestSample,
    Window,
)
from proxy.doctor.stats import mean, percentile
from proxy.doctor.timeline import Timeline, analyse

SPLIT_TIMINGS = "engine timings"
SPLIT_HISTOGRAMS = "engine histograms"
SPLIT_LITTLE = "waiting gauge (Little's law)"


@dataclass(slots=True)
class Split:
    upstream_ttft_s: float | None  # mean
    queue_s: float | None  # mean
    prefill_s: float | None  # mean (includes the first decode step: it makes the first token)
    source: str | None


@dataclass(slots=True)
class Gauges:
    scrapes: int
    waiting_mean: float | None
    running_mean: float | None
    kv_usage_mean: float | None
    kv_usage_max: float | None
    waiting_scrapes: int  # scrapes with a request waiting (and a KV reading)
    full_while_waiting: float | None  # share of those with no room for one more request
    kv_tokens: int | None
    preemptions: float | None  # during the window
    prefix_queries: float | None  # tokens looked up in the engine's prefix cache
    prefix_hits: float | None


@dataclass(slots=True)
class Cache:
    input_tokens: int  # over requests that reported usage
    reported_tokens: int  # cached, as the engine reported (requests that report it)
    reporting: int  # requests whose engine said cached_tokens
    predicted_tokens: float  # what the index expected on the serving backend
    predicting: int  # requests with a prediction of at least one token
    predicted_hit_tokens: float  # of the predicted, what the engine reported cached
    unpredicted_tokens: float  # reported cached beyond the prediction
    avoidable_tokens: float  # prefilled although the index had seen them (any backend)
    avoidable_here: float  # ... predicted on the serving backend
    avoidable_elsewhere: float  # ... seen only on another backend
    engine_caches_nothing: bool  # reported 0 cached tokens on every request, or hits = 0


@dataclass(slots=True)
class Measures:
    window: Window
    requests: int  # ok requests
    span_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    split: Split
    prefill_rate: float | None  # uncached tokens per second of prefill
    uncached_mean: float | None
    uncached_p90: float | None
    input_mean: float | None
    output_mean: float | None
    cache: Cache
    gauges: Gauges
    timeline: Timeline


def span(requests: Sequence[RequestSample]) -> float:
    if not requests:
        return 0.0
    start = min(r.start for r in requests)
    end = max(_end(r) for r in requests)
    return max(end - start, 0.0)


def _end(r: RequestSample) -> float:
    last = r.last_at
    if last is not None:
        return last
    return r.start + (r.ttft_s or 0.0)


def _delta(gauges: Sequence[GaugeSample], name: str) -> float | None:
    """The change of a cumulative counter over the window (None: absent, or it went back,
    as after an engine restart)."""
    seen = [g.counters[name] for g in gauges if name in g.counters]
    if len(seen) < 2 or seen[-1] < seen[0]:
        return None
    return seen[-1] - seen[0]


def split_ttft(requests: Sequence[RequestSample], gauges: Sequence[GaugeSample]) -> Split:
    streamed = [r for r in requests if r.upstream_ttft_s is not None]
    if not streamed:
        return Split(None, None, None, None)
    up_mean = sum(r.upstream_ttft_s or 0.0 for r in streamed) / len(streamed)
    told = [r for r in streamed if r.engine_queue_s is not None or r.engine_prefill_s is not None]
    if told and 2 * len(told) >= len(streamed):
        queue: list[float] = []
        prefill: list[float] = []
        for r in told:
            up = r.upstream_ttft_s or 0.0
            q = r.engine_queue_s
            p = r.engine_prefill_s
            if q is None:
                q = max(up - (p or 0.0), 0.0)
            if p is None:
                p = max(up - q, 0.0)
            queue.append(q)
            prefill.append(p)
        told_up = sum(r.upstream_ttft_s or 0.0 for r in told) / len(told)
        return Split(told_up, mean(queue), mean(prefill), SPLIT_TIMINGS)
    q_count = _delta(gauges, QUEUE_TIME_COUNT)
    q_sum = _delta(gauges, QUEUE_TIME_SUM)
    if q_count and q_sum is not None:
        q_mean = q_sum / q_count
        p_count = _delta(gauges, PREFILL_TIME_COUNT)
        p_sum = _delta(gauges, PREFILL_TIME_SUM)
        p_mean = p_sum / p_count if p_count and p_sum is not None else max(up_mean - q_mean, 0.0)
        return Split(up_mean, q_mean, p_mean, SPLIT_HISTOGRAMS)
    waits = [g.waiting for g in gauges if g.waiting is not None]
    duration = span(requests)
    if waits and duration > 0:
        arrival_rate = len(requests) / duration
        q_mean = min(sum(waits) / len(waits) / arrival_rate, up_mean)
        return Split(up_mean, q_mean, max(up_mean - q_mean, 0.0), SPLIT_LITTLE)
    return Split(up_mean, None, None, None)


def prefill_rate(requests: Sequence[RequestSample], split: Split) -> float | None:
    """Uncached prompt tokens per second of prefill, as this window measured it.

    From per-request prefill times where the engine gives them; else the mean uncached prompt
    over the mean prefill of the split; else (nothing splits TTFT) the upstream TTFT is taken
    as all prefill, which can only understate the rate."""
    told = [
        (u, r.engine_prefill_s)
        for r in requests
        if r.engine_prefill_s and (u := r.uncached_tokens) is not None
    ]
    if told:
        seconds = sum(p for _, p in told)
        return sum(u for u, _ in told) / seconds if seconds > 0 else None
    uncached = [u for r in requests if r.upstream_ttft_s is not None and (u := r.uncached_tokens)]
    if not uncached:
        return None
    prefill = split.prefill_s if split.prefill_s is not None else split.upstream_ttft_s
    if not prefill:
        return None
    return (sum(uncached) / len(uncached)) / prefill


def cache_view(requests: Sequence[RequestSample], gauges: Sequence[GaugeSample]) -> Cache:
    c = Cache(0, 0, 0, 0.0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, False)
    zero_reports = 0
    for r in requests:
        if r.input_tokens is None:
            continue
        n = r.input_tokens
        c.input_tokens += n
        cached = r.cached_tokens
        if cached is not None:
            c.reporting += 1
            c.reported_tokens += cached
            zero_reports += cached == 0
        pred = min(r.predicted_tokens or 0.0, n)
        if pred >= 1:
            c.predicting += 1
            c.predicted_tokens += pred
            if cached is not None:
                c.predicted_hit_tokens += min(cached, pred)
        if cached is not None:
            c.unpredicted_tokens += max(cached - pred, 0.0)
            here = max(pred - cached, 0.0)
            c.avoidable_here += here
            c.avoidable_elsewhere += r.avoidable_tokens - here
    c.avoidable_tokens = c.avoidable_here + c.avoidable_elsewhere
    queries, hits = _delta(gauges, PREFIX_QUERIES), _delta(gauges, PREFIX_HITS)
    counters_say_none = bool(queries) and hits == 0
    c.engine_caches_nothing = counters_say_none or (c.reporting > 0 and zero_reports == c.reporting)
    return c


def gauge_view(gauges: Sequence[GaugeSample], input_mean: float | None) -> Gauges:
    """Means of the scraped gauges, and how often a waiting request found the pool full.

    "Full" means no room for one more request: where the pool size is published, the free
    tokens ((1 - usage) x pool) are fewer than this window's mean prompt; otherwise the free
    share is less than what one running request holds on average (usage / running)."""
    waiting = [g.waiting for g in gauges if g.waiting is not None]
    running = [g.running for g in gauges if g.running is not None]
    usage = [g.kv_usage for g in gauges if g.kv_usage is not None]
    pools = [g.kv_tokens for g in gauges if g.kv_tokens]
    waited = full = 0
    for g in gauges:
        if not g.waiting or g.waiting < 1 or g.kv_usage is None:
            continue
        waited += 1
        free = 1.0 - g.kv_usage
        if g.kv_tokens and input_mean:
            full += free * g.kv_tokens < input_mean
        else:
            full += free < g.kv_usage / max(g.running or 1.0, 1.0)
    return Gauges(
        scrapes=len(gauges),
        waiting_mean=mean(waiting),
        running_mean=mean(running),
        kv_usage_mean=mean(usage),
        kv_usage_max=max(usage) if usage else None,
        waiting_scrapes=waited,
        full_while_waiting=full / waited if waited else None,
        kv_tokens=pools[-1] if pools else None,
        preemptions=_delta(gauges, PREEMPTIONS),
        prefix_queries=_delta(gauges, PREFIX_QUERIES),
        prefix_hits=_delta(gauges, PREFIX_HITS),
    )


def measure(window: Window) -> Measures:
    ok = [r for r in window.requests if r.ok]
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    split = split_ttft(ok, window.gauges)
    rate = prefill_rate(ok, split)
    uncached = sorted(u for r in ok if (u := r.uncached_tokens) is not None)
    inputs = [r.input_tokens for r in ok if r.input_tokens is not None]
    outputs = [r.output_tokens for r in ok if r.output_tokens is not None]
    input_mean = mean(inputs)
    return Measures(
        window=window,
        requests=len(ok),
        span_s=span(ok),
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_p90_s=percentile(ttfts, 0.9),
        split=split,
        prefill_rate=rate,
        uncached_mean=mean(uncached),
        uncached_p90=percentile(uncached, 0.9),
        input_mean=input_mean,
        output_mean=mean(outputs),
        cache=cache_view(ok, window.gauges),
        gauges=gauge_view(window.gauges, input_mean),
        timeline=analyse(ok, rate, window.hardware),
    )
