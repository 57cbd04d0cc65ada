"""Pre-aggregated histograms: a request's samples added at once land where one by one would."""

from __future__ import annotations

import random

from proxy.telemetry import DURATION_BUCKETS, OVERHEAD_BUCKETS, _Histogram


def test_batched_samples_fill_the_same_buckets_min_max_and_sum_as_single_adds() -> None:
    rng = random.Random(7)
    for bounds in (DURATION_BUCKETS, OVERHEAD_BUCKETS):
        batched = _Histogram("b", "s", "", bounds)
        single = _Histogram("s", "s", "", bounds)
        for i in range(300):
            scale = rng.choice((1e-5, 1e-3, 0.05, 1.0, 100.0))
            values = [rng.random() * scale for _ in range(rng.randint(1, 70))]
            values += rng.sample(bounds, 2)  # a value on a bound goes into that bound's bucket
            batched.record(values, {}, ("k",), (i, i, i))
            for v in values:
                single.record1(v, {}, ("k",), None)
        b, s = batched.points[("k",)], single.points[("k",)]
        assert b.counts == s.counts
        assert (b.count, b.min, b.max) == (s.count, s.min, s.max)
        assert abs(b.total - s.total) < 1e-9 * max(1.0, s.total)
        # one exemplar per request, in the bucket of its largest value
        for i, (v, _) in b.exemplars.items():
            assert (
                (bounds[i - 1] if i else float("-inf"))
                < v
                <= (bounds[i] if i < len(bounds) else float("inf"))
            )
