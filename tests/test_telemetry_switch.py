"""telemetry.enabled (read with getattr, so it works before config.py has the field)."""

from __future__ import annotations

from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.config import TelemetryConfig
from proxy.telemetry import Telemetry
from tests.test_telemetry import DECISION, facts, start


def test_disabled_telemetry_records_nothing_and_propagates_nothing() -> None:
    cfg = TelemetryConfig()
    object.__setattr__(cfg, "enabled", False)
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
