"""OTLP/HTTP span export: the SDK's exporter with the hand-written encoder, and a keep-alive
http.client transport under the SDK's own HTTP client (every SDK internal through sdk_bridge)."""

from __future__ import annotations

import http.client
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from proxy.telemetry import sdk_bridge
from proxy.telemetry.wire import encode_spans_fast

log = logging.getLogger("warmroute.telemetry")


def http_span_exporter(**kwargs: Any) -> SpanExporter:
    """The SDK's OTLP/HTTP span exporter with encode_spans_fast() in place of its encoder,
    and, for a plain-http endpoint, a keep-alive http.client connection under its client."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    class FastOTLPSpanExporter(OTLPSpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            client = sdk_bridge.exporter_client(self)
            if client is None or sdk_bridge.exporter_shut_down(self) or len(spans) > 10_000:
                return super().export(spans)
            try:
                data = encode_spans_fast(spans)
            except Exception:  # something the fast path does not know: the SDK's own encoder
                return super().export(spans)
            limit = sdk_bridge.request_size_limit(self)
            if limit and len(data) > limit:  # 0: no limit, as the SDK reads it
                return super().export(spans)  # it logs and drops
            result = client.export(data)
            ok = getattr(result, "success", False)
            return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

        def export_encoded(self, data: bytes) -> bool:
            """Send one serialized ExportTraceServiceRequest (see EncodedBatcher)."""
            client = sdk_bridge.exporter_client(self)
            if client is None or sdk_bridge.exporter_shut_down(self):
                return False
            limit = sdk_bridge.request_size_limit(self)
            if limit and len(data) > limit:
                log.error("span export of %d bytes exceeds the %d byte limit", len(data), limit)
                return False
            return bool(getattr(client.export(data), "success", False))

    exporter = FastOTLPSpanExporter(**kwargs)
    _use_plain_transport(exporter, kwargs)
    return exporter


_CREDENTIALS_ENV = "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER"


def _use_plain_transport(exporter: Any, kwargs: Mapping[str, Any]) -> None:
    """Swap the requests-based transport for HTTPClientTransport where nothing is lost.

    requests costs ~10 µs of export-thread CPU per proxied request here (it scans the
    environment for proxies on every POST). The SDK client above the transport keeps
    doing what it did: endpoint, OTEL_EXPORTER_OTLP_* headers, timeout, compression and
    retries. https endpoints (certificates), a session or a credential provider keep the
    SDK's transport, as do SDKs without this transport interface.
    """
    endpoint = sdk_bridge.exporter_endpoint(exporter)
    if endpoint is None or kwargs.get("session") is not None:
        return
    if urlsplit(endpoint).scheme != "http" or os.environ.get(_CREDENTIALS_ENV):
        return
    if any(os.environ.get(k) for k in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")):
        return  # requests would honour a proxy; http.client does not
    sdk_bridge.replace_transport(exporter, HTTPClientTransport)


def _result_type() -> Any:
    from dataclasses import dataclass

    base: Any = sdk_bridge.http_result_base()

    @dataclass(frozen=True, slots=True)
    class HTTPClientResult(base):
        body: bytes = b""
        header_map: Any = None

        def content(self) -> bytes:
            return self.body

        def headers(self) -> Mapping[str, str]:
            return self.header_map if self.header_map is not None else {}

    return HTTPClientResult


class HTTPClientTransport:
    """The SDK's BaseHTTPTransport interface over one keep-alive http.client connection."""

    def __init__(self) -> None:
        self._result = _result_type()  # ImportError: an SDK without the transport interface
        self._conn: http.client.HTTPConnection | None = None

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        data: bytes | None = None,
    ) -> Any:
        u = urlsplit(url)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        try:
            conn = self._conn
            if conn is None or (conn.host, conn.port) != (u.hostname, u.port or 80):
                self.close()
                conn = self._conn = http.client.HTTPConnection(u.hostname or "", u.port or 80)
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            conn.request(method, path, body=data, headers=headers or {})
            resp = conn.getresponse()
            body = resp.read()
            if resp.will_close:
                self.close()
        except Exception as e:
            self.close()
            return self._result(error=e)
        return self._result(
            status_code=resp.status, reason=resp.reason, body=body, header_map=resp.headers
        )

    def is_connection_error(self, exception: Exception | None) -> bool:
        # A kept-alive connection the collector closed shows up as one of these: the SDK's
        # client then resends once at once.
        return isinstance(exception, OSError | http.client.HTTPException) and not isinstance(
            exception, TimeoutError
        )

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
