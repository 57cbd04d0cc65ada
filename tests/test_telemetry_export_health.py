"""A collector that is down costs one log line when export starts failing, one when it
recovers, and a counter in between: against a real loopback port with nothing listening."""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from proxy.config import TelemetryConfig
from proxy.telemetry import Telemetry
from proxy.telemetry.export_health import ExportHealths
from proxy.telemetry.transport import http_span_exporter
from tests.support import SHUTDOWN_POLL_S, free_port

REQUEST = b"\x0a\x00"  # an ExportTraceServiceRequest with one empty ResourceSpans


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("OTEL_"):
            monkeypatch.delenv(var)


class _Ok(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def collector_port() -> Iterator[tuple[int, Any]]:
    """A loopback port with nothing listening, and a function that starts a collector there."""
    port = free_port()
    servers: list[ThreadingHTTPServer] = []

    def start() -> None:
        server = ThreadingHTTPServer(("127.0.0.1", port), _Ok)
        threading.Thread(target=server.serve_forever, args=(SHUTDOWN_POLL_S,), daemon=True).start()
        servers.append(server)

    yield port, start
    for server in servers:
        server.shutdown()
        server.server_close()


def _fast_retries(exporter: Any) -> Any:
    """The SDK retries six times with 1 s, 2 s, 4 s... between: here at once, so that one
    export makes all of its retry lines without the wait."""
    exporter._client._compute_backoff = lambda retry: 0.0
    return exporter


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_unwatched_the_sdk_logs_several_lines_per_failed_export(
    collector_port: tuple[int, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """What the watch replaces (the budget below means something)."""
    port, _ = collector_port
    exporter = _fast_retries(http_span_exporter(endpoint=f"http://127.0.0.1:{port}/v1/traces"))
    with caplog.at_level(logging.WARNING):
        assert not exporter.export_encoded(REQUEST)
    assert len(_lines(caplog)) >= 4
    exporter.shutdown()


def test_collector_down_costs_one_line_failing_one_recovered_and_a_count_between(
    collector_port: tuple[int, Any], caplog: pytest.LogCaptureFixture
) -> None:
    port, start_collector = collector_port
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    exporter = _fast_retries(http_span_exporter(endpoint=endpoint))
    healths = ExportHealths()
    health = healths.watch(exporter, "traces", endpoint)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert not exporter.export_encoded(REQUEST)
        [failing] = _lines(caplog)
        assert "traces export to " + endpoint + " is failing" in failing
        assert "refused" in failing.lower()  # the SDK's reason, once
        assert "retrying in" not in failing  # nothing retries once this line is out
        assert health.failures == 3 and health.failing
        start_collector()
        assert exporter.export_encoded(REQUEST)
        assert exporter.export_encoded(REQUEST)
    lines = _lines(caplog)
    assert len(lines) == 2, lines
    assert "works again (3 failed exports" in lines[1]
    assert health.failures == 3 and not health.failing
    exporter.shutdown()


def test_spans_dropped_while_failing_are_reported_on_recovery_not_per_batch() -> None:
    health = ExportHealths().watch(object(), "traces", "http://127.0.0.1:1/v1/traces")
    assert health.spans_dropped(5)  # working: the batcher logs them itself
    health.record(False)
    assert not health.spans_dropped(7) and not health.spans_dropped(3)
    assert health.dropped == 10
    health.record(True)
    assert health.dropped == 0


def test_failures_are_a_metric_per_signal(
    collector_port: tuple[int, Any],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port, _ = collector_port
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "200")  # ms: one attempt, no backoff
    cfg = TelemetryConfig(
        traces_exporter="otlp",
        metrics_exporter="otlp",
        otlp_endpoint=f"http://127.0.0.1:{port}",
    )
    t = Telemetry(cfg)
    try:
        with caplog.at_level(logging.WARNING):
            batcher: Any = t.spans.sink
            batcher.add(b"\x12\x00")
            assert not batcher.force_flush()
            t.meter_provider.force_flush()
        text = t.prometheus_text()[0].decode()
        for signal in ("traces", "metrics"):
            labels = rf'\{{[^}}]*warmroute_telemetry_signal="{signal}"[^}}]*\}}'
            assert re.search(rf"warmroute_telemetry_export_failures_total{labels} 1\.0", text)
            assert re.search(rf"warmroute_telemetry_export_failing{labels} 1\.0", text)
        assert len([line for line in _lines(caplog) if "is failing" in line]) == 2
        assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]
    finally:
        t.shutdown(deadline_s=0.5)
