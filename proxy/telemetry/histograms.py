"""Pre-aggregated histograms and counts, and the bucket bounds they use.

Histograms are pre-aggregated here rather than recorded through the SDK instrument API: the
SDK costs ~5-15 µs per record() (attribute cleaning and hashing on every call), which for the
~64 per-chunk samples of one request would cost more than forwarding the whole stream. The
points (with trace-linked exemplars) are handed to every reader's collection as ordinary OTel
histogram metrics (metrics.py), so Prometheus and OTLP see them like any other.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import Exemplar
from opentelemetry.sdk.metrics.export import AggregationTemporality, HistogramDataPoint, Metric
from opentelemetry.sdk.metrics.export import Histogram as HistogramData

# Explicit bucket boundaries from the OTel GenAI semantic conventions (seconds / tokens).
TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5)
TTFT_BUCKETS += (0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = tuple(0.01 * 2**i for i in range(14))  # 0.01 ... 81.92
TOKEN_BUCKETS = tuple(float(4**i) for i in range(14))  # 1 ... 67108864
# The proxy's own cost is sub-millisecond; the GenAI buckets would put it all in the first one.
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

# An exemplar as kept until collection: (trace_id, span_id, time_ns) of a sampled request.
TraceRef = tuple[int, int, int]


# ---------------------------------------------------------------------------------------------
# Pre-aggregated histograms.


@dataclass(slots=True)
class Point:
    attributes: dict[str, Any]
    bounds: tuple[float, ...]
    counts: list[int]
    total: float = 0.0
    count: int = 0
    min: float = float("inf")
    max: float = float("-inf")
    # one exemplar per bucket, the latest: what Prometheus/Grafana show per bucket. Kept as
    # (value, TraceRef) and made into SDK Exemplars only when collected.
    exemplars: dict[int, tuple[float, TraceRef]] = field(default_factory=dict)

    def add(self, v: float, exemplar: TraceRef | None) -> None:
        """Add one value (routing decisions, errored durations; the rest arrive in batches)."""
        self.add_sorted((v,), v, exemplar)

    def add_sorted(self, s: Sequence[float], total: float, exemplar: Any) -> None:
        """Add the values of sorted s (their sum: total), e.g. one request's per-chunk gaps."""
        bounds, counts = self.bounds, self.counts
        low, top = s[0], s[-1]
        # OTel buckets are (lower, upper]: bisect_left puts v == bound in that bound's bucket.
        first, last = bisect_left(bounds, low), bisect_left(bounds, top)
        if first == last:  # the usual case: one request's gaps all fall in one bucket
            counts[first] += len(s)
        else:  # cut at the bounds between the smallest and the largest value only
            prev = 0
            for i in range(first, last):
                k = bisect_right(s, bounds[i], prev)
                counts[i] += k - prev
                prev = k
            counts[last] += len(s) - prev
        self.total += total
        self.count += len(s)
        if low < self.min:
            self.min = low
        if top > self.max:
            self.max = top
        if exemplar is not None:
            # One exemplar per request (its largest value): the sample worth clicking through.
            self.exemplars[last] = (top, exemplar)


class Histogram:
    """A cumulative explicit-bucket histogram, keyed by an attribute tuple the caller builds."""

    __slots__ = ("bounds", "description", "name", "points", "unit")

    def __init__(self, name: str, unit: str, description: str, bounds: Sequence[float]) -> None:
        self.name = name
        self.unit = unit
        self.description = description
        self.bounds = tuple(bounds)
        self.points: dict[tuple[Any, ...], Point] = {}

    def point(self, attrs: dict[str, Any], key: tuple[Any, ...]) -> Point:
        p = self.points.get(key)
        if p is None:
            p = self.points[key] = Point(attrs, self.bounds, [0] * (len(self.bounds) + 1))
        return p

    def record1(
        self,
        v: float,
        attrs: dict[str, Any],
        key: tuple[Any, ...],
        exemplar: TraceRef | None,
    ) -> None:
        """Add one value."""
        self.point(attrs, key).add(v, exemplar)

    def record(
        self,
        values: Sequence[float],
        attrs: dict[str, Any],
        key: tuple[Any, ...],
        exemplar: TraceRef | None,
    ) -> None:
        """Add values; exemplar = (trace_id, span_id, time_ns) of the request, if sampled."""
        if values:
            self.point(attrs, key).add_sorted(sorted(values), sum(values), exemplar)

    def metric(self, start_ns: int, now_ns: int) -> Metric | None:
        if not self.points:
            return None
        points = [
            HistogramDataPoint(
                attributes=dict(p.attributes),
                start_time_unix_nano=start_ns,
                time_unix_nano=now_ns,
                count=p.count,
                sum=p.total,
                bucket_counts=list(p.counts),
                explicit_bounds=self.bounds,
                min=p.min,
                max=p.max,
                exemplars=[_exemplar(*p.exemplars[i]) for i in sorted(p.exemplars)],
            )
            for p in list(self.points.values())
        ]
        return Metric(
            name=self.name,
            description=self.description,
            unit=self.unit,
            data=HistogramData(
                data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE
            ),
        )


def _exemplar(value: float, ex: TraceRef) -> Exemplar:
    trace_id, span_id, t_ns = ex
    return Exemplar(None, value, t_ns, span_id=span_id, trace_id=trace_id)


class Counts:
    """Monotonic or up-down counts by attribute tuple, read by an observable instrument."""

    __slots__ = ("keys", "values")

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys
        self.values: dict[tuple[Any, ...], int] = {}

    def add(self, key: tuple[Any, ...], n: int = 1) -> None:
        self.values[key] = self.values.get(key, 0) + n

    def observe(self, _options: CallbackOptions) -> Iterable[Observation]:
        for key, v in list(self.values.items()):
            yield Observation(v, dict(zip(self.keys, key, strict=True)))
