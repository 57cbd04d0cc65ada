"""The OTLP/HTTP span export's transport: the SDK's settings, over one kept-alive connection."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from proxy.telemetry.transport import HTTPClientTransport, http_span_exporter
from tests.support import SHUTDOWN_POLL_S


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            seen.append(
                {
                    "path": self.path,
                    "headers": {k.lower(): v for k, v in self.headers.items()},
                    "body": body,
                    "peer": self.client_address,
                }
            )
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(SHUTDOWN_POLL_S,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


@pytest.mark.e2e
def test_plain_http_export_keeps_the_sdk_settings_over_one_connection(
    receiver: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, seen = receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-api-key=abc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
    exporter: Any = http_span_exporter(endpoint=f"{url}/v1/traces")
    assert isinstance(exporter._client._transport, HTTPClientTransport)
    assert exporter.export_encoded(b"\x0a\x00")
    assert exporter.export_encoded(b"\x0a\x02\x0a\x00")
    exporter.shutdown()
    assert [r["path"] for r in seen] == ["/v1/traces", "/v1/traces"]
    assert seen[0]["peer"] == seen[1]["peer"]  # kept alive
    for r, body in zip(seen, (b"\x0a\x00", b"\x0a\x02\x0a\x00"), strict=True):
        assert r["headers"]["x-api-key"] == "abc"
        assert r["headers"]["content-type"] == "application/x-protobuf"
        assert r["headers"]["content-encoding"] == "gzip"
        assert gzip.decompress(r["body"]) == body


@pytest.mark.e2e
def test_a_closed_connection_is_reopened_and_the_export_sent(
    receiver: tuple[str, list[dict[str, Any]]],
) -> None:
    url, seen = receiver
    exporter: Any = http_span_exporter(endpoint=f"{url}/v1/traces")
    assert exporter.export_encoded(b"\x0a\x00")
    transport = exporter._client._transport
    assert transport._conn is not None
    transport._conn.sock.close()  # as if the collector had dropped the idle connection
    assert exporter.export_encoded(b"\x0a\x00")
    assert len(seen) == 2


def test_unreachable_collector_fails_the_export_without_raising() -> None:
    exporter: Any = http_span_exporter(endpoint="http://127.0.0.1:9/v1/traces", timeout=0.5)
    assert not exporter.export_encoded(b"\x0a\x00")


def test_https_and_proxied_endpoints_keep_the_sdk_transport(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter: Any = http_span_exporter(endpoint="https://collector.example:4318/v1/traces")
    assert not isinstance(exporter._client._transport, HTTPClientTransport)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    exporter = http_span_exporter(endpoint="http://collector.example:4318/v1/traces")
    assert not isinstance(exporter._client._transport, HTTPClientTransport)
