"""Decode as a timeline (pure): which gaps ran alongside long prefills, how much KV each step
read, and how close the steps came to the bandwidth ceiling.

Every output chunk after the first leaves a gap (ITL); the proxy knows when each stream's
first chunk went out and each gap in order, so every gap has an absolute time. Against the
same clock every request's prefill is an interval ending at its first token. From those:

- a gap **alongside a long prefill** is one that overlapped another request's prefill of
  more tokens than the device prefills in one decode step (`step_tokens`): such a prefill
  cannot fit inside a step, so the step it shares grows, and every stream decoding on that
  backend sees a longer gap (docs/doctor.md). Tokens the prefix index had seen before do not
  count: a working cache would have skipped them, and that is prefill_bound_ttft's finding;
- the **context in flight** at a gap is the sum, over the streams decoding on that backend
  then, of their prompt plus what they had generated so far: the KV a decode step reads.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.doctor.model import Hardware, RequestSample
from proxy.doctor.stats import binned_fit, percentile

MAX_GAPS = 50_000  # per window; beyond it every k-th stream is read (the timeline stays whole)
MIN_SLOPE_T = 3.0  # a slope three standard errors from zero is growth, not noise


@dataclass(slots=True)
class Gap:
    end: float  # when the chunk that closed the gap was written
    length: float
    alongside: bool = False  # overlapped another request's long prefill
    context: float = 0.0  # KV tokens of every stream decoding on the backend then
    streams: int = 0  # streams decoding on the backend then


@dataclass(slots=True)
class Timeline:
    """What the gaps of one window say (None: not enough to tell)."""

    gaps: int
    itl_p50_s: float | None
    itl_p99_s: float | None
    clean_p50_s: float | None  # gaps not alongside a long prefill
    clean_p99_s: float | None
    alongside_gaps: int
    alongside_p50_s: float | None
    alongside_p99_s: float | None
    inflated_share: float  # gaps alongside long prefills that were >= 2 decode steps, of all
    long_prefills: int
    long_prefill_tokens_mean: float | None
    step_tokens: float | None  # tokens the device prefills in one decode step
    context_p90_tokens: float | None
    mean_streams: float | None
    # decode vs context: ITL ~ intercept + slope * context (medians of quantile bins), with
    # the slope's t statistic
    context_fit: tuple[float, float, float] | None
    kv_share_p90: float | None  # share of a p90-context step spent reading KV (measured)
    # against declared hardware (None without it)
    decode_tok_s: float | None  # per stream, clean gaps
    ceiling_tok_s: float | None  # per stream at the same contexts and batches
    efficiency: float | None  # ceiling step time / measured step time, clean gaps
    single_stream_tok_s: float | None  # gaps while the stream decoded alone
    expected_kv_share_p90: float | None


def prefill_interval(r: RequestSample, rate: float | None) -> tuple[float, float] | None:
    """When `r`'s prefill ran: up to its first token, for as long as the engine said, or for
    its uncached tokens at the measured prefill rate (never longer than its upstream TTFT)."""
    if r.first_at is None:
        return None
    if r.engine_prefill_s is not None:
        return r.first_at - r.engine_prefill_s, r.first_at
    up = r.upstream_ttft_s if r.upstream_ttft_s is not None else r.ttft_s
    if up is None:
        return None
    uncached = r.uncached_tokens
    p = up if rate is None or uncached is None else min(up, uncached / rate)
    return r.first_at - p, r.first_at


def _gaps(requests: Sequence[RequestSample]) -> list[tuple[int, float, float]]:
    """(request index, end, length) of every gap, reading every k-th stream past MAX_GAPS."""
    total = sum(len(r.itl_s) for r in requests if r.first_at is not None)
    stride = max(1, -(-total // MAX_GAPS))
    out: list[tuple[int, float, float]] = []
    for i, r in enumerate(requests):
        if r.first_at is None or i % stride:
            continue
        t = r.first_at
        for g in r.itl_s:
            t += g
            out.append((i, t, g))
    return out


def _merged(intervals: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    intervals.sort()
    starts: list[float] = []
    ends: list[float] = []
    for s, e in intervals:
        if starts and s <= ends[-1]:
            ends[-1] = max(ends[-1], e)
        else:
            starts.append(s)
            ends.append(e)
    return starts, ends


def _overlaps(starts: list[float], ends: list[float], s: float, e: float) -> bool:
    """Whether [s, e] overlaps the inside of a merged interval (touching does not count)."""
    i = bisect.bisect_left(starts, e) - 1  # the last interval starting before e
    return i >= 0 and ends[i] > s


def _context_at(requests: Sequence[RequestSample], times: list[float]) -> list[tuple[float, int]]:
    """(KV tokens, streams) decoding at each time: a sweep over the streams' decode spans.

    A stream's context grows from its prompt by one token per chunk; between its first and last
    chunk it is taken to grow linearly: prompt + chunks * (t - first) / (last - first).
    """
    events: list[tuple[float, int, float, float]] = []  # (time, order, a, b): ctx = a + b * t
    for r in requests:
        first, last = r.first_at, r.last_at
        if first is None or last is None:
            continue
        n = r.gap_count
        b = n / (last - first) if last > first else 0.0
        a = float(r.input_tokens or 0) - b * first
        events.append((first, 0, a, b))  # starts before the queries at the same time
        events.append((last, 2, -a, -b))  # ends after them
    events.sort()
    order = sorted(range(len(times)), key=times.__getitem__)
    out: list[tuple[float, int]] = [(0.0, 0)] * len(times)
    sum_a = sum_b = 0.0
    streams = 0
    k = 0
    for q in order:
        t = times[q]
        while k < len(events) and (events[k][0] < t or (events[k][0] == t and events[k][1] == 0)):
            _, kind, a, b = events[k]
            sum_a += a
            sum_b += b
            streams += 1 if kind == 0 else -1
            k += 1
        out[q] = (max(sum_a + sum_b * t, 0.0), streams)
    return out


def analyse(
    requests: Sequence[RequestSample], prefill_rate: float | None, hardware: Hardware | None
) -> Timeline:
    """The gaps of one window's streams, classified and measured (see the module doc)."""
    raw = _gaps(requests)
    lengths = sorted(g for _, _, g in raw)
    positive = [g for g in lengths if g > 0]
    step = percentile(positive, 0.5)  # one decode step, as streams saw it
    step_tokens = prefill_rate * step if prefill_rate and step else None
    long_iv: list[tuple[float, float]] = []
    long_tokens: list[float] = []
    for r in requests:
        # A prefill a working prefix cache would have skipped is the cache's finding, not
        # this one: only what would stay uncached counts towards a long prefill.
        u = r.uncached_tokens
        if step_tokens is None or u is None or u - r.avoidable_tokens < step_tokens:
            continue
        iv = prefill_interval(r, prefill_rate)
        if iv is not None and iv[1] > iv[0]:
            long_iv.append(iv)
            long_tokens.append(u)
    starts, ends = _merged(long_iv)
    ctx = _context_at(requests, [end for _, end, _ in raw])
    gaps = [
        Gap(end, g, _overlaps(starts, ends, end - g, end), c, n)
        for (_, end, g), (c, n) in zip(raw, ctx, strict=True)
    ]
    clean = sorted(g.length for g in gaps if not g.alongside)
    along = sorted(g.length for g in gaps if g.alongside)
    inflated = 0
    if step:
        inflated = sum(1 for g in gaps if g.alongside and g.length >= 2 * step)
    clean_gaps = [g for g in gaps if not g.alongside]
    contexts = sorted(g.context for g in clean_gaps)
    ctx_p90 = percentile(contexts, 0.9)
    fit_gaps = [g for g in clean_gaps if g.length > 0]
    fit = binned_fit([g.context for g in fit_gaps], [g.length for g in fit_gaps])
    kv_share = None  # unknown: the contexts did not vary enough to show a slope
    if fit is not None and ctx_p90 is not None:
        intercept, slope, t_slope = fit
        if t_slope < MIN_SLOPE_T or slope <= 0:
            kv_share = 0.0  # they varied, and ITL did not follow
        elif intercept > 0:
            kv_share = slope * ctx_p90 / (intercept + slope * ctx_p90)
    t = Timeline(
        gaps=len(gaps),
        itl_p50_s=percentile(lengths, 0.5),
        itl_p99_s=percentile(lengths, 0.99),
        clean_p50_s=percentile(clean, 0.5),
        clean_p99_s=percentile(clean, 0.99),
        alongside_gaps=len(along),
        alongside_p50_s=percentile(along, 0.5),
        alongside_p99_s=percentile(along, 0.99),
        inflated_share=inflated / len(gaps) if gaps else 0.0,
        long_prefills=len(long_iv),
        long_prefill_tokens_mean=sum(long_tokens) / len(long_tokens) if long_tokens else None,
        step_tokens=step_tokens,
        context_p90_tokens=ctx_p90,
        mean_streams=sum(g.streams for g in clean_gaps) / len(clean_gaps) if clean_gaps else None,
        context_fit=fit,
        kv_share_p90=kv_share,
        decode_tok_s=None,
        ceiling_tok_s=None,
        efficiency=None,
        single_stream_tok_s=None,
        expected_kv_share_p90=None,
    )
    if hardware is not None and clean_gaps:
        _against(t, clean_gaps, hardware)
    return t


def _against(t: Timeline, clean: list[Gap], hw: Hardware) -> None:
    """Measured decode against the roofline of declared hardware, on the same gaps."""
    measured = sum(g.length for g in clean)
    ideal = sum(hw.step_s(g.context) for g in clean)
    if measured > 0:
        t.decode_tok_s = len(clean) / measured
        t.efficiency = ideal / measured
    t.ceiling_tok_s = len(clean) / ideal if ideal > 0 else None
    alone = [g.length for g in clean if g.streams == 1]
    if alone and sum(alone) > 0:
        t.single_stream_tok_s = len(alone) / sum(alone)
    if t.context_p90_tokens is not None and hw.kv_bytes_per_token is not None:
        kv = hw.kv_bytes_per_token * t.context_p90_tokens
        t.expected_kv_share_p90 = kv / (hw.weight_bytes + kv)
