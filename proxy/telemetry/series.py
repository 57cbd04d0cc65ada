"""A metric series of finished requests, and the batch of samples that waits to be added to it.

A series is one (operation, model, backend) attribute set; its histogram points are made on
first use, so a series shows only what it recorded. A finished request's one-value samples are
a row (a plain tuple whose fields RowFields names, each mapped to its point by POINT_OF),
folded into the histograms in batches (RequestMetrics.fold).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, NamedTuple, Protocol

from proxy.telemetry.histograms import Histogram, Point, TraceRef

PROVIDER = "openai"  # the wire format every backend speaks (semconv: the telemetry flavour)


class Instruments(Protocol):
    """The request histograms a series records into (RequestMetrics has them)."""

    h_duration: Histogram
    h_ttfc: Histogram
    h_tpoc: Histogram
    h_overhead: Histogram
    h_ttft: Histogram
    h_forward: Histogram
    h_tpot: Histogram
    h_tokens: Histogram
    h_cached: Histogram
    h_hit: Histogram


# The histogram points a series records into, by index in Series.points.
(DURATION, TTFC, TPOC, OVERHEAD, TTFT, FORWARD, TPOT) = range(7)
(TOK_IN, TOK_OUT, CACHED, HIT_ACTUAL, HIT_PREDICTED) = range(7, 12)
POINTS = 12


class Series:
    """Metric attribute sets (and their points) of one (operation, model, backend) series.

    Built once per series and cached, so recording a request's metrics allocates no dicts and
    looks up no keys: each histogram's point of the series is kept here once it exists.
    """

    __slots__ = ("attrs", "errors", "key", "points", "specs")

    def __init__(
        self, m: Instruments, op: str, model: str, address: str, port: int, backend: str
    ) -> None:
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": op,
            "gen_ai.provider.name": PROVIDER,
        }
        if model:
            attrs["gen_ai.request.model"] = model
        if address:
            attrs["server.address"] = address
            attrs["server.port"] = port
        key = (op, model, address, port)
        self.attrs, self.key = attrs, key
        b_attrs = {"warmroute.backend": backend, "gen_ai.request.model": model}
        b_key = (backend, model)
        series = (attrs, key)
        # (histogram, attributes, point key) per point; points made on first use, so that a
        # series shows only what it recorded
        specs: dict[int, tuple[Histogram, dict[str, Any], tuple[Any, ...]]] = {
            DURATION: (m.h_duration, *series),
            TTFC: (m.h_ttfc, *series),
            TPOC: (m.h_tpoc, *series),
            OVERHEAD: (m.h_overhead, *series),
            TTFT: (m.h_ttft, *series),
            FORWARD: (m.h_forward, *series),
            TPOT: (m.h_tpot, *series),
            TOK_IN: (m.h_tokens, {**attrs, "gen_ai.token.type": "input"}, (*key, "input")),
            TOK_OUT: (m.h_tokens, {**attrs, "gen_ai.token.type": "output"}, (*key, "output")),
            CACHED: (m.h_cached, b_attrs, b_key),
            HIT_ACTUAL: (
                m.h_hit,
                {**b_attrs, "warmroute.prefix.source": "actual"},
                (backend, model, "actual"),
            ),
            HIT_PREDICTED: (
                m.h_hit,
                {**b_attrs, "warmroute.prefix.source": "predicted"},
                (backend, model, "predicted"),
            ),
        }
        self.specs = tuple(specs[i] for i in range(POINTS))  # a KeyError: a point left out
        self.points: list[Point | None] = [None] * len(self.specs)
        self.errors: dict[str, Point] = {}

    def point(self, i: int) -> Point:
        p = self.points[i]
        if p is None:
            h, attrs, key = self.specs[i]
            p = self.points[i] = h.point(attrs, key)
        return p

    def duration_with_error(self, err: str) -> Point:
        p = self.errors.get(err)
        if p is None:
            h = self.specs[DURATION][0]
            p = h.point({**self.attrs, "error.type": err}, (*self.key, err))
            self.errors[err] = p  # bounded: RequestMetrics.error_label folds the rest
        return p


class RowFields(NamedTuple):
    """What a finished request's row of one-value samples holds, in order, waiting to be
    folded into the histograms: its series and exemplar, then a value (or None) for each point
    named in POINT_OF. A row itself is a plain tuple in this order (see Row)."""

    series: Series
    exemplar: TraceRef | None
    duration: float | None
    ttfc: float | None  # the client's time to first chunk, even for a failed stream
    overhead: float | None  # client TTFT - upstream TTFT: the proxy's own share
    ttft: float | None  # successful requests only
    tpot: float | None
    tokens_in: int | None
    tokens_out: int | None
    cached: int | None
    hit_actual: float | None  # cached / input tokens, as the engine reported them
    hit_predicted: float | None  # what the router's index matched, on the same backend


# The histogram point each of a row's samples goes to.
POINT_OF = {
    "duration": DURATION,
    "ttfc": TTFC,
    "overhead": OVERHEAD,
    "ttft": TTFT,
    "tpot": TPOT,
    "tokens_in": TOK_IN,
    "tokens_out": TOK_OUT,
    "cached": CACHED,
    "hit_actual": HIT_ACTUAL,
    "hit_predicted": HIT_PREDICTED,
}
if set(POINT_OF) != set(RowFields._fields[2:]):
    raise AssertionError("every sample of a row needs its histogram point in POINT_OF")
Row = tuple[Any, ...]  # a RowFields' values in a plain tuple
ROW_COLUMNS = tuple((RowFields._fields.index(name), point) for name, point in POINT_OF.items())
NO_FACTS = (None,) * (len(RowFields._fields) - 3)  # all but the duration


def fold_rows(rows: list[Row]) -> None:
    """Add the rows' samples to their series' points: one batch per point, then the
    exemplars (per bucket, the latest sampled request's value, as single adds keep them)."""
    # Any: the samples are read by column (r[col]), a float or int, or None, in each
    groups: dict[Series, list[Any]] = {}
    for r in rows:
        g = groups.get(r[0])  # its series
        if g is None:
            groups[r[0]] = [r]
        else:
            g.append(r)
    for series, g in groups.items():
        for col, i in ROW_COLUMNS:
            values = [v for r in g if (v := r[col]) is not None]
            if values:
                values.sort()
                series.point(i).add_sorted(values, sum(values), None)
        for r in g:
            exemplar = r[1]
            if exemplar is None:
                continue
            for col, i in ROW_COLUMNS:
                v = r[col]
                if v is not None:
                    p = series.point(i)
                    p.exemplars[bisect_left(p.bounds, v)] = (v, exemplar)
