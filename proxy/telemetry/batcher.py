"""The BatchSpanProcessor's job for spans that arrive already encoded (spans.SpanData)."""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from proxy.telemetry import sdk_bridge
from proxy.telemetry.export_health import ExportHealth
from proxy.telemetry.wire import envelope, ld, span_bytes, varint

log = logging.getLogger("warmroute.telemetry")


def _env_int(name: str, default: int) -> int:
    try:
        value = int(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value > 0 else default


class EncodedBatcher(SpanProcessor):
    """The BatchSpanProcessor's job for spans that arrive already encoded (spans.SpanData).

    The same OTEL_BSP_* settings and defaults (export every 5 s or at 512 spans, at most 2048
    waiting, older ones kept when full), one daemon thread, and the export itself through the
    SDK exporter's own HTTP client (its endpoint, headers, compression, timeout and retries).
    """

    def __init__(
        self,
        exporter: SpanExporter,
        resource: Resource,
        scope: InstrumentationScope,
        health: ExportHealth | None = None,
    ) -> None:
        self._exporter: Any = exporter
        self._health = health  # while export fails, drops are counted there, not logged
        self._delay_s = _env_int("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self._max_queue = _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self._max_batch = min(_env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512), self._max_queue)
        self._res, self._res_tail, self._sc, self._sc_tail = envelope(resource, scope)
        self._queue: deque[bytes] = deque()
        self._dropped = 0
        self._wake = threading.Condition()
        self._export_lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="warmroute-span-export", daemon=True)
        self._thread.start()

    @staticmethod
    def can_use(exporter: SpanExporter) -> bool:
        return (
            hasattr(exporter, "export_encoded") and sdk_bridge.exporter_client(exporter) is not None
        )

    def add(self, span: bytes) -> None:
        """One encoded Span (its bytes as a ScopeSpans.spans field); never blocks."""
        queue = self._queue
        if len(queue) >= self._max_queue or self._stopped:
            self._dropped += 1
            return
        queue.append(span)
        if len(queue) == self._max_batch:
            with self._wake:
                self._wake.notify()

    def on_end(self, span: ReadableSpan) -> None:  # spans the SDK made, should any arrive
        if span.context.trace_flags.sampled:
            self.add(ld(b"\x12", span_bytes(span)))

    def _run(self) -> None:
        while not self._stopped:
            with self._wake:
                if len(self._queue) < self._max_batch and not self._stopped:
                    self._wake.wait(self._delay_s)
            self._drain()

    def _drain(self) -> bool:
        ok = True
        with self._export_lock:
            queue = self._queue
            while queue:
                n = min(len(queue), self._max_batch)
                batch = [queue.popleft() for _ in range(n)]
                ok = self._export(batch) and ok
            if self._dropped:
                health = self._health
                if health is None or health.spans_dropped(self._dropped):
                    log.warning("dropped %d spans: the export queue was full", self._dropped)
                self._dropped = 0
        return ok

    def _export(self, batch: list[bytes]) -> bool:
        # ExportTraceServiceRequest{resource_spans: {resource, scope_spans: {scope, spans...}}},
        # written in one join: the batch (~0.5 MB at 512 spans) is copied once, not per level.
        scope_len = len(self._sc) + sum(map(len, batch)) + len(self._sc_tail)
        scope_head = b"\x12" + varint(scope_len)
        rs_len = len(self._res) + len(scope_head) + scope_len + len(self._res_tail)
        data = b"".join(
            [
                b"\x0a",
                varint(rs_len),
                self._res,
                scope_head,
                self._sc,
                *batch,
                self._sc_tail,
                self._res_tail,
            ]
        )
        try:
            return bool(self._exporter.export_encoded(data))
        except Exception:
            log.exception("span export failed")
            return False

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._drain()

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        with self._wake:
            self._wake.notify()
        self._thread.join()
        self._drain()
        self._exporter.shutdown()
