"""Pre-aggregated histograms: a request's samples added at once land where one by one would."""

from __future__ import annotations

import random

from proxy.telemetry.histograms import DURATION_BUCKETS, OVERHEAD_BUCKETS, Histogram


def test_batched_samples_fill_the_same_buckets_min_max_and_sum_as_single_adds() -> None:
    rng = random.Random(7)
    for bounds in (DURATION_BUCKETS, OVERHEAD_BUCKETS):
        batched = Histogram("b", "s", "", bounds)
        single = Histogram("s", "s", "", bounds)
        expected = [0] * (len(bounds) + 1)
        for i in range(300):
            scale = rng.choice((1e-5, 1e-3, 0.05, 1.0, 100.0))
            values = [rng.random() * scale for _ in range(rng.randint(1, 70))]
            values += rng.sample(bounds, 2)  # a value on a bound goes into that bound's bucket
            batched.record(values, {}, ("k",), (i, i, i))
            for v in values:
                single.record1(v, {}, ("k",), None)
                expected[sum(1 for x in bounds if x < v)] += 1
        b, s = batched.points[("k",)], single.points[("k",)]
        assert b.counts == s.counts == expected  # (lower, upper] buckets, counted here
        assert (b.count, b.min, b.max) == (s.count, s.min, s.max)
        assert abs(b.total - s.total) < 1e-9 * max(1.0, s.total)
        # one exemplar per request, in the bucket of its largest value
        for i, (v, _) in b.exemplars.items():
            assert (
                (bounds[i - 1] if i else float("-inf"))
                < v
                <= (bounds[i] if i < len(bounds) else float("inf"))
            )


def test_requests_folded_in_batches_give_the_histograms_and_exemplars_of_single_adds() -> None:
    """Per-request samples wait in a batch (folded every few hundred and at every collection):
    counts, sums, min/max and the latest exemplar per bucket come out as one add per value."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    from proxy.config import TelemetryConfig
    from proxy.telemetry import TTFT_BUCKETS, Telemetry
    from tests.test_telemetry import facts, points, start

    rng = random.Random(3)
    reader, spans = InMemoryMetricReader(), InMemorySpanExporter()
    t = Telemetry(TelemetryConfig(), span_exporter=spans, metric_readers=[reader])
    t.tracer_provider.sampler = t.spans.sampler = TraceIdRatioBased(0.3)  # some requests sampled
    t.spans.decide = None  # ask the sampler itself
    ref = Histogram("ttft", "s", "", TTFT_BUCKETS)
    ref_errors = 0
    for round_ in range(3):
        for i in range(rng.randint(100, 400)):  # across fold boundaries and collections
            ttft = rng.choice((1e-4, 0.003, 0.2, 4.0, 30.0)) * rng.random()
            failed = i % 17 == 0
            rec = start(t, headers={})  # a root: its own trace id, sampled or not
            rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
            f = facts(ttft_s=ttft, error="upstream_stream_error" if failed else None)
            rec.finish(f, status=200)
            if failed:
                ref_errors += 1
            else:
                span = rec.span
                ex = (span.trace_id, span.span_id, 0) if span.flags & 1 else None
                ref.record1(ttft, {}, ("k",), ex)
        (ttft_point,) = points(reader)["gen_ai.server.time_to_first_token"]
        want = ref.points[("k",)]
        assert list(ttft_point.bucket_counts) == want.counts, round_
        assert (ttft_point.count, ttft_point.min, ttft_point.max) == (
            want.count,
            want.min,
            want.max,
        )
        assert abs(ttft_point.sum - want.total) < 1e-9 * want.total
        got = {(e.value, e.span_id, e.trace_id) for e in ttft_point.exemplars}
        assert got == {(v, ex[1], ex[0]) for v, ex in want.exemplars.values()}
        assert want.exemplars  # some requests were sampled
    durations = points(reader)["gen_ai.server.request.duration"]
    errors = [p for p in durations if p.attributes.get("error.type") == "upstream_stream_error"]
    assert sum(p.count for p in errors) == ref_errors
    t.shutdown()
