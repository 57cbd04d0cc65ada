"""telemetry.enabled, and trace context propagation as the SDK's own Tracer would do it."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy.config import TelemetryConfig
from proxy.telemetry import Telemetry
from tests.test_telemetry import DECISION, facts, start


def test_disabled_telemetry_records_nothing_and_propagates_nothing() -> None:
    cfg = TelemetryConfig(enabled=False)
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    t = Telemetry(cfg, span_exporter=spans, metric_readers=[reader])
    t.observe_routing("prefix", "r", 0.001)
    rec = start(t)
    rec.set_decision(DECISION)
    a = rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    headers: dict[str, str] = {}
    a.inject_headers(headers)
    a.fail("connect_error")
    t.read_inflight(lambda: {"b1": 1})
    rec.finish(facts(), status=200)
    t.shutdown()
    assert headers == {}
    assert spans.get_finished_spans() == ()
    data = reader.get_metrics_data()
    assert data is None or not any(
        m.data.data_points
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    )
    assert b"disabled" in t.prometheus_text()[0]


@pytest.mark.parametrize("tracing", [False, True])
@pytest.mark.parametrize(
    "incoming",
    [
        {},
        {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"},
        {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-00", "tracestate": "v=1,w=2"},
        {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-03", "tracestate": "v=1"},
    ],
)
def test_propagation_is_what_the_sdks_tracer_would_send(
    tracing: bool, incoming: dict[str, str]
) -> None:
    """Spans are built without the SDK's Tracer: flags, trace state and ids must match it."""
    spans = InMemorySpanExporter()
    t = Telemetry(TelemetryConfig(), span_exporter=spans if tracing else None)
    rec = start(t, headers=incoming)
    ours: dict[str, str] = {}
    rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1).inject_headers(ours)
    rec.finish(facts(), status=200)

    provider = TracerProvider(sampler=None if tracing else ALWAYS_OFF)
    tracer = provider.get_tracer("x")
    prop = TraceContextTextMapPropagator()
    server = tracer.start_span("s", context=prop.extract(incoming) if incoming else None)
    client = tracer.start_span("c", context=trace.set_span_in_context(server))
    sdk: dict[str, str] = {}
    prop.inject(sdk, context=trace.set_span_in_context(client))

    def parts(h: dict[str, str]) -> tuple[str, str, str, str | None]:
        version, trace_id, _span_id, flags = h["traceparent"].split("-")
        return version, trace_id if incoming else "", flags, h.get("tracestate")

    assert parts(ours) == parts(sdk)
    assert len(spans.get_finished_spans()) == (2 if tracing and parts(sdk)[2] != "00" else 0)


@pytest.mark.parametrize(
    "sampler",
    [
        "always_on",
        "always_off",
        "traceidratio",
        "parentbased_always_on",
        "parentbased_always_off",
        "parentbased_traceidratio",
    ],
)
def test_compiled_samplers_decide_as_the_sdk_samplers(
    sampler: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import random

    from opentelemetry.sdk.trace.sampling import Decision, _get_from_env_or_default
    from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
    from opentelemetry.trace.span import TraceState

    from proxy.telemetry.spans import compile_sampler

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.3")
    sdk = _get_from_env_or_default()
    decide = compile_sampler(sdk)
    assert decide is not None
    rng = random.Random(7)
    state = TraceState([("vendor", "x")])
    for _ in range(400):
        trace_id = rng.getrandbits(128) or 1
        parent = None
        if rng.random() < 0.7:
            parent = SpanContext(
                trace_id,
                rng.getrandbits(64) or 1,
                is_remote=rng.random() < 0.5,
                trace_flags=TraceFlags(rng.choice([0, 1])),
                trace_state=rng.choice([None, state]),
            )
        ctx = None if parent is None else trace.set_span_in_context(NonRecordingSpan(parent))
        want = sdk.should_sample(ctx, trace_id, "chat m", SpanKind.SERVER, None)
        sampled, trace_state = decide(parent, trace_id)
        assert sampled == (want.decision is Decision.RECORD_AND_SAMPLE)
        assert trace_state == want.trace_state
