"""Small statistics the doctor needs (pure): percentiles, means, a robust line fit."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.stats import percentile as project_percentile


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The project's percentile (proxy/stats.py: linear interpolation, numpy's default) of
    values sorted ascending; None when there are none."""
    return project_percentile(sorted_values, q) if sorted_values else None


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def binned_fit(
    xs: Sequence[float], ys: Sequence[float], bins: int = 10
) -> tuple[float, float, float] | None:
    """(intercept, slope, t of the slope) of a line through the medians of y in quantile bins
    of x.

    Medians per bin keep a few outliers (a stall, a step shared with a prefill) from tilting
    the line; the t statistic (slope over its standard error across the bins) says whether
    the slope is there at all. None with fewer than 5 bins of 3 samples, or when the bins'
    x spans less than 5% of its mean (nothing to tell a slope from).
    """
    n = len(xs)
    bins = min(bins, n // 3)
    if bins < 5:
        return None
    pairs = sorted(zip(xs, ys, strict=True))
    px: list[float] = []
    py: list[float] = []
    for b in range(bins):
        chunk = pairs[b * n // bins : (b + 1) * n // bins]
        cx = sorted(p[0] for p in chunk)
        cy = sorted(p[1] for p in chunk)
        px.append(cx[len(cx) // 2])
        py.append(cy[len(cy) // 2])
    k = len(px)
    bx, by = sum(px) / k, sum(py) / k
    sxx = sum((x - bx) ** 2 for x in px)
    if bx <= 0 or sxx <= 0 or (px[-1] - px[0]) < 0.05 * bx:
        return None
    slope = sum((x - bx) * (y - by) for x, y in zip(px, py, strict=True)) / sxx
    intercept = by - slope * bx
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(px, py, strict=True))
    se = (residual / (k - 2) / sxx) ** 0.5
    t = slope / se if se > 0 else (float("inf") if slope > 0 else 0.0)
    return intercept, slope, t
