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
    t.set_inflight("b1", 1)
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
