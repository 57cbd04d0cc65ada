"""The decider's sliding window: what warmroute measured about its own traffic, summarised.

Sans-I/O like the stream meter: the forwarder tells it three things per request, with the time
passed in, and `snapshot(now, backends)` returns the numbers the decider reads.

    window.started(request_id, backend, at, uncached_tokens)   # request sent to a backend
    window.first_token(request_id, at)                         # its first output token
    window.finished(RequestFacts(...))                         # done (or failed)

`uncached_tokens` is what *that* engine has to prefill: a retry or a fallback calls `started`
again for the same request (one arrival, the interval moves to the new backend), and the decode
leg of a KV-transfer flow is started with 0, since its KV comes over the link. The prefill leg
of such a flow is no request of its own: `prefill_started(key, ...)` / `prefill_ended(key, at)`
open and close its long-prefill interval on the prefill engine without counting an arrival.

Interference is measured, not assumed. A prompt of at least `long_prefill_tokens` uncached
tokens holds its backend's compute from `started` to `first_token` (its prefill), and every
stream decoding on that backend meanwhile waits for those prefill steps (docs/physics.md). So
the window keeps, per backend, the intervals of long prefills, and marks a finished stream as
*overlapped* when its decode interval (first token -> end) crossed one. Checking at `finished`
is exact: any long prefill that overlapped the stream had `started` before the stream ended,
so it is known then (still open, or closed). Comparing the ITL p99/p50 of overlapped streams
with the others' gives the interference a prefill/decode split would remove.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from proxy.disagg.pools import BackendState
from proxy.stats import percentile

MIN_ITL_P50_S = 1e-3  # a p50 below 1 ms is bunched delivery, not a decode step
INTERVAL_CAP = 4096  # long-prefill intervals kept per backend
OPEN_TTL_FACTOR = 10  # a request still open after 10 windows was never closed: forget it


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """One finished request as the proxy measured it (times in one monotonic clock, seconds)."""

    request_id: str
    backend: str
    arrival: float  # the proxy received it
    prompt_tokens: int
    uncached_tokens: int  # prompt tokens the engine had to prefill (prompt - cached)
    output_tokens: int
    finished_at: float
    first_token_at: float | None = None  # None: it failed before its first token
    itl_p50_s: float | None = None  # of this stream's inter-token gaps (itl_quantiles)
    itl_p99_s: float | None = None
    ok: bool = True


@dataclass(frozen=True, slots=True)
class WindowStats:
    """The window's summary at `now`: every input the decider judges from."""

    now: float
    span_s: float  # seconds the window covers (less than window_s right after start)
    requests: int
    rate_per_s: float
    rate_cv: float | None  # coefficient of variation of arrivals per bucket; None: too few
    prefill_tokens_per_s: float  # uncached prompt tokens sent per second (prefill demand)
    decode_tokens_per_s: float  # output tokens per second (decode demand)
    long_prefills: int  # requests with at least long_prefill_tokens uncached
    long_share: float  # of all requests
    uncached_p50: float
    uncached_p90: float
    streams: int  # finished streams with an ITL (two or more output tokens)
    overlapped: int  # of which decoded alongside a long prefill on their backend
    itl_inflation: float | None  # median p99/p50 of overlapped streams
    itl_inflation_baseline: float | None  # the same for streams that saw no long prefill
    prefill_rate_per_engine: float | None  # p90 of uncached tokens / TTFT of long prefills
    mean_streams: float  # decoding streams in flight, averaged over the span
    backends: tuple[BackendState, ...] = ()

    @property
    def overlap_share(self) -> float:
        return self.overlapped / self.streams if self.streams else 0.0

    @property
    def interference(self) -> float | None:
        """How much worse overlapped streams' tails are than the others' (>= 1 means worse)."""
        if self.itl_inflation is None:
            return None
        return self.itl_inflation / max(1.0, self.itl_inflation_baseline or 1.0)

    def inputs(self) -> dict[str, object]:
        """The window's inputs as plain numbers, for /admin/disagg and gauges."""
        r = _round
        return {
            "span_s": r(self.span_s),
            "requests": self.requests,
            "rate_per_s": r(self.rate_per_s),
            "rate_cv": r(self.rate_cv),
            "prefill_tokens_per_s": r(self.prefill_tokens_per_s),
            "decode_tokens_per_s": r(self.decode_tokens_per_s),
            "long_prefills": self.long_prefills,
            "long_share": r(self.long_share),
            "uncached_p50": r(self.uncached_p50),
            "uncached_p90": r(self.uncached_p90),
            "streams": self.streams,
            "overlapped": self.overlapped,
            "overlap_share": r(self.overlap_share),
            "itl_inflation": r(self.itl_inflation),
            "itl_inflation_baseline": r(self.itl_inflation_baseline),
            "interference": r(self.interference),
            "prefill_rate_per_engine": r(self.prefill_rate_per_engine),
            "mean_streams": r(self.mean_streams),
            "healthy_backends": sum(b.healthy for b in self.backends),
            "backends_by_role": _by_role(self.backends),
        }


def itl_quantiles(gaps: Sequence[float]) -> tuple[float, float] | None:
    """(p50, p99) of one stream's inter-token gaps (proxy.stats.percentile); None for none."""
    if not gaps:
        return None
    ordered = sorted(gaps)
    return percentile(ordered, 0.50), percentile(ordered, 0.99)


@dataclass(slots=True)
class _Sample:
    arrival: float
    finished_at: float
    uncached: int
    output: int
    decode_start: float | None
    inflation: float | None  # this stream's p99/p50
    overlapped: bool
    prefill_rate: float | None  # uncached / TTFT, for long prefills


@dataclass(slots=True)
class _Open:
    backend: str
    at: float
    long: bool
    leg: bool = False  # a prefill leg: an interval, not a request


@dataclass(slots=True)
class _Intervals:
    """One backend's long prefills: [start, end) with end None while still prefilling."""

    closed: deque[tuple[float, float]] = field(default_factory=deque)
    open: dict[str, float] = field(default_factory=dict)  # request id -> start


class Window:
    """Accumulates finished requests over the last `window_s` seconds (time passed in)."""

    def __init__(
        self, window_s: float = 60.0, long_prefill_tokens: int = 1024, rate_buckets: int = 12
    ) -> None:
        if window_s <= 0 or long_prefill_tokens < 1 or rate_buckets < 2:
            raise ValueError("need window_s > 0, long_prefill_tokens >= 1, rate_buckets >= 2")
        self.window_s = window_s
        self.long_prefill_tokens = long_prefill_tokens
        self.rate_buckets = rate_buckets
        self._samples: deque[_Sample] = deque()
        self._arrivals: deque[float] = deque()
        self._open: dict[str, _Open] = {}
        self._intervals: dict[str, _Intervals] = {}
        self._since: float | None = None  # first thing the window saw

    # --- feeding --------------------------------------------------------------------------
    def started(self, request_id: str, backend: str, at: float, uncached_tokens: int) -> None:
        """A request (or its next attempt, or its decode leg) was sent to `backend`, which
        has `uncached_tokens` of it to prefill (as predicted by the prefix index)."""
        self._seen(at)
        before = self._open.get(request_id)
        if before is None:
            self._arrivals.append(at)
        elif before.long:
            self._close(before.backend, request_id, at)  # that attempt is over
        long = uncached_tokens >= self.long_prefill_tokens
        self._open[request_id] = _Open(backend, at, long)
        if long:
            self._intervals_of(backend).open[request_id] = at

    def prefill_started(self, key: str, backend: str, at: float, uncached_tokens: int) -> None:
        """A prefill leg (KV-transfer flow) was sent to `backend`: an interval, no arrival."""
        self._seen(at)
        long = uncached_tokens >= self.long_prefill_tokens
        self._open[key] = _Open(backend, at, long, leg=True)
        if long:
            self._intervals_of(backend).open[key] = at

    def prefill_ended(self, key: str, at: float) -> None:
        """The prefill leg answered (or failed, or was cancelled): its compute is released."""
        opened = self._open.pop(key, None)
        if opened is not None and opened.long:
            self._close(opened.backend, key, at)

    def first_token(self, request_id: str, at: float) -> None:
        """The request's first output token arrived: its prefill is over."""
        opened = self._open.get(request_id)
        if opened is not None and opened.long:
            self._close(opened.backend, request_id, at)

    def finished(self, facts: RequestFacts) -> None:
        """A request ended (successfully or not); `facts` hold what the proxy measured."""
        self._seen(facts.arrival)
        opened = self._open.pop(facts.request_id, None)
        if opened is None:
            self._arrivals.append(facts.arrival)  # never announced: count its arrival now
        elif opened.long:
            self._close(opened.backend, facts.request_id, facts.first_token_at or facts.finished_at)
        long = facts.uncached_tokens >= self.long_prefill_tokens
        if long and opened is None and facts.first_token_at is not None:
            # Not announced either, but its prefill interval is known now: later streams see it.
            self._add_closed(facts.backend, facts.arrival, facts.first_token_at)
        inflation = None
        overlapped = False
        if facts.ok and facts.first_token_at is not None and facts.itl_p99_s is not None:
            p50 = max(facts.itl_p50_s or 0.0, MIN_ITL_P50_S)
            inflation = facts.itl_p99_s / p50
            overlapped = self._overlaps(
                facts.backend, facts.request_id, facts.first_token_at, facts.finished_at
            )
        rate = None
        if long and facts.ok and facts.first_token_at is not None:
            ttft = facts.first_token_at - facts.arrival
            if ttft > 0:
                rate = facts.uncached_tokens / ttft
        self._samples.append(
            _Sample(
                arrival=facts.arrival,
                finished_at=facts.finished_at,
                uncached=max(0, facts.uncached_tokens),
                output=max(0, facts.output_tokens),
                decode_start=facts.first_token_at,
                inflation=inflation,
                overlapped=overlapped,
                prefill_rate=rate,
            )
        )

    # --- reading ----------------------------------------------------------------------------
    def snapshot(self, now: float, backends: Iterable[BackendState] = ()) -> WindowStats:
        """The window's summary at `now` (drops what fell out of it first)."""
        self.prune(now)
        since = self._since if self._since is not None else now
        span = max(min(self.window_s, now - since), 1e-9)
        start = now - span
        samples = list(self._samples)
        n = len(samples)
        uncached = sorted(s.uncached for s in samples)
        streams = [s for s in samples if s.inflation is not None]
        over = [s.inflation for s in streams if s.overlapped and s.inflation is not None]
        clean = [s.inflation for s in streams if not s.overlapped and s.inflation is not None]
        long_rates = sorted(s.prefill_rate for s in samples if s.prefill_rate is not None)
        decoding = sum(
            max(0.0, s.finished_at - max(s.decode_start, start))
            for s in samples
            if s.decode_start is not None
        )
        arrivals = [a for a in self._arrivals if a >= start]
        return WindowStats(
            now=now,
            span_s=span,
            requests=n,
            rate_per_s=len(arrivals) / span,
            rate_cv=self._rate_cv(arrivals, start, span),
            prefill_tokens_per_s=sum(uncached) / span,
            decode_tokens_per_s=sum(s.output for s in samples) / span,
            long_prefills=sum(1 for u in uncached if u >= self.long_prefill_tokens),
            long_share=(sum(1 for u in uncached if u >= self.long_prefill_tokens) / n)
            if n
            else 0.0,
            uncached_p50=percentile(uncached, 0.50) if uncached else 0.0,
            uncached_p90=percentile(uncached, 0.90) if uncached else 0.0,
            streams=len(streams),
            overlapped=len(over),
            itl_inflation=statistics.median(over) if over else None,
            itl_inflation_baseline=statistics.median(clean) if clean else None,
            prefill_rate_per_engine=percentile(long_rates, 0.90) if long_rates else None,
            mean_streams=decoding / span,
            backends=tuple(backends),
        )

    def prune(self, now: float) -> None:
        """Forget requests that finished before the window and stale long-prefill intervals."""
        edge = now - self.window_s
        while self._samples and self._samples[0].finished_at < edge:
            self._samples.popleft()
        while self._arrivals and self._arrivals[0] < edge:
            self._arrivals.popleft()
        # A stream that finishes now may have decoded for longer than the window: intervals
        # are kept for two windows so its overlap is still seen.
        keep_from = now - 2 * self.window_s
        empty = []
        for backend, iv in self._intervals.items():
            while iv.closed and iv.closed[0][1] < keep_from:
                iv.closed.popleft()
            if not iv.closed and not iv.open:
                empty.append(backend)
        for backend in empty:  # a backend that left (or went quiet) leaves no entry behind
            del self._intervals[backend]
        stale = now - OPEN_TTL_FACTOR * self.window_s
        for rid in [r for r, o in self._open.items() if o.at < stale]:
            gone = self._open.pop(rid)
            if gone.long:
                self._intervals_of(gone.backend).open.pop(rid, None)

    @property
    def in_flight(self) -> int:
        return sum(not o.leg for o in self._open.values())

    # --- internals --------------------------------------------------------------------------
    def _seen(self, at: float) -> None:
        if self._since is None or at < self._since:
            self._since = at

    def _intervals_of(self, backend: str) -> _Intervals:
        iv = self._intervals.get(backend)
        if iv is None:
            iv = self._intervals[backend] = _Intervals()
        return iv

    def _close(self, backend: str, request_id: str, end: float) -> None:
        iv = self._intervals_of(backend)
        start = iv.open.pop(request_id, None)
        if start is not None:
            self._add_closed(backend, start, end)

    def _add_closed(self, backend: str, start: float, end: float) -> None:
        closed = self._intervals_of(backend).closed
        if closed and closed[-1][1] > end:
            # Rare (a late report): keep the deque ordered by end time for pruning.
            items = list(closed)
            bisect.insort(items, (start, end), key=lambda x: x[1])
            closed.clear()
            closed.extend(items)
        else:
            closed.append((start, end))
        while len(closed) > INTERVAL_CAP:
            closed.popleft()

    def _overlaps(self, backend: str, request_id: str, begin: float, end: float) -> bool:
        """Whether a long prefill on `backend` (not this request's own) ran in (begin, end)."""
        iv = self._intervals.get(backend)
        if iv is None:
            return False
        if any(s < end for rid, s in iv.open.items() if rid != request_id):
            return True  # still prefilling now, and it began before this stream ended
        for s, e in reversed(iv.closed):
            if e <= begin:
                break  # ordered by end: every earlier one ended before this stream decoded
            if s < end:
                return True
        return False

    def _rate_cv(self, arrivals: list[float], start: float, span: float) -> float | None:
        """CV of arrivals per bucket; steady Poisson traffic at rate r gives ~1/sqrt(r*bucket)."""
        if len(arrivals) < self.rate_buckets:
            return None
        width = span / self.rate_buckets
        counts = [0] * self.rate_buckets
        for a in arrivals:
            counts[min(self.rate_buckets - 1, int((a - start) / width))] += 1
        mean = len(arrivals) / self.rate_buckets
        return statistics.pstdev(counts) / mean


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _by_role(backends: Iterable[BackendState]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for b in backends:
        row = out.setdefault(b.role, {"healthy": 0, "unhealthy": 0})
        row["healthy" if b.healthy else "unhealthy"] += 1
    return out
