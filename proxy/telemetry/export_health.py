"""A collector that is down costs two log lines, not four per export batch.

The SDK's OTLP exporters log every retry of every batch (three warnings and an error a batch
against a collector that is down). Each OTLP exporter is watched here instead: its first
failed export logs one line (the signal, the endpoint and the SDK's reason), its first export
that succeeds again logs one line (how many failed in between), and every failed export in
between counts in warmroute.telemetry.export.failures. The SDK's own retry and failure lines
are dropped only while a watched export runs on that thread; anything else it logs passes.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation

log = logging.getLogger("warmroute.telemetry")

# The loggers the SDK's OTLP exporters log their retries and failures on.
SDK_EXPORT_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.common.http",
)
# The SDK's per-attempt lines that an ExportHealth replaces.
_RETRY_LINES = ("Transient error", "Failed to export", "Shutdown in progress")
_TRANSIENT = re.compile(r"Transient error (?P<cause>.*?) encountered while exporting", re.S)
SIGNAL_ATTR = "warmroute.telemetry.signal"
_current = threading.local()  # the ExportHealth whose export runs on this thread, if any


class ExportHealth:
    """One signal's OTLP export: working or failing, and the failures counted while failing."""

    def __init__(self, signal: str, endpoint: str) -> None:
        self.signal = signal  # traces | metrics
        self.endpoint = endpoint
        self.failures = 0  # failed exports, ever (the counter)
        self.failing = False
        self.dropped = 0  # spans dropped from a full queue while failing
        self._failed_in_row = 0
        self._reason: str | None = None
        self._lock = threading.Lock()
        self.stopped = False  # after shutdown: exports fail by design, nothing to say

    def note(self, sdk_message: str) -> None:
        """The SDK's own words for the export now failing (its first line is kept: the
        cause, where the last says only that it gave up)."""
        if self._reason is None:
            self._reason = sdk_message

    def record(self, ok: bool) -> None:
        """One export's outcome: a line when the state changes, a count while it fails."""
        if self.stopped:
            return
        with self._lock:
            changed = ok == self.failing
            if ok:
                failed, dropped = self._failed_in_row, self.dropped
                self.failing, self._failed_in_row, self.dropped = False, 0, 0
            else:
                self.failures += 1
                self._failed_in_row += 1
                self.failing = True
            reason, self._reason = self._reason, None
        if changed and ok:
            self._log_recovered(failed, dropped)
        elif changed:
            self._log_failing(reason)

    def spans_dropped(self, n: int) -> bool:
        """Count `n` spans dropped from a full queue; False while failing (the recovery line
        reports them), True when the caller should log them itself."""
        with self._lock:
            if self.failing:
                self.dropped += n
                return False
        return True

    def _log_failing(self, reason: str | None) -> None:
        log.warning(
            "telemetry: %s export to %s is failing (%s); %s are dropped until it answers, "
            "counted in warmroute.telemetry.export.failures (one line when it recovers)",
            self.signal,
            self.endpoint,
            reason or "the exporter gave no reason",
            self.signal,
        )

    def _log_recovered(self, failed: int, dropped: int) -> None:
        spans = f", {dropped} spans dropped from the full queue" if dropped else ""
        log.warning(
            "telemetry: %s export to %s works again (%d failed exports while it was down%s)",
            self.signal,
            self.endpoint,
            failed,
            spans,
        )


class ExportHealths:
    """Every watched exporter of one Telemetry, and the metrics that report them."""

    def __init__(self) -> None:
        self.by_signal: dict[str, ExportHealth] = {}

    def watch(self, exporter: Any, signal: str, endpoint: str) -> ExportHealth:
        """Watch `exporter`'s exports (export, and export_encoded where it has one)."""
        _quiet_sdk_retry_lines()
        health = self.by_signal[signal] = ExportHealth(signal, endpoint)
        for name in ("export", "export_encoded"):
            inner = getattr(exporter, name, None)
            if inner is not None:
                setattr(exporter, name, _watched(inner, health))
        return health

    def stop(self) -> None:
        """Exporters are being stopped: their failures from now on are expected."""
        for health in self.by_signal.values():
            health.stopped = True

    def observe_failures(self, _options: CallbackOptions) -> Iterable[Observation]:
        for signal, health in self.by_signal.items():
            yield Observation(health.failures, {SIGNAL_ATTR: signal})

    def observe_failing(self, _options: CallbackOptions) -> Iterable[Observation]:
        for signal, health in self.by_signal.items():
            yield Observation(int(health.failing), {SIGNAL_ATTR: signal})


def _succeeded(result: Any) -> bool:
    """An export's result: a bool (export_encoded) or the SDK's SUCCESS/FAILURE enum."""
    if isinstance(result, bool):
        return result
    return getattr(result, "name", None) == "SUCCESS"


def _watched(inner: Callable[..., Any], health: ExportHealth) -> Callable[..., Any]:
    @functools.wraps(inner)
    def export(*args: Any, **kwargs: Any) -> Any:
        _current.health = health
        try:
            result = inner(*args, **kwargs)
        except Exception:
            health.record(False)
            raise
        finally:
            _current.health = None
        health.record(_succeeded(result))
        return result

    return export


class _QuietRetryLines(logging.Filter):
    """Drops the SDK's per-attempt retry and failure lines of a watched export, handing their
    text to its ExportHealth as the reason; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        health: ExportHealth | None = getattr(_current, "health", None)
        if health is None or not str(record.msg).startswith(_RETRY_LINES):
            return True
        health.note(_cause(record.getMessage()))
        return False


def _cause(sdk_message: str) -> str:
    """The cause in the SDK's retry line, without its "retrying in 1.17s" (nothing retries
    once the ExportHealth line is out)."""
    m = _TRANSIENT.match(sdk_message)
    return m["cause"] if m else sdk_message


_QUIET = _QuietRetryLines()


def _quiet_sdk_retry_lines() -> None:
    for name in SDK_EXPORT_LOGGERS:
        logger = logging.getLogger(name)
        if _QUIET not in logger.filters:
            logger.addFilter(_QUIET)
