"""Bounded metric label values for what a peer chooses: a backend's error type.

A backend names its own errors (`{"error": {"type": ...}}` in an answer or a stream's event,
read by proxy/forwarding/meter.py) and a hostile or broken one can name a new one per request: as
`error.type` on the duration histogram and `warmroute.upstream.errors`, 600 made-up types grew
/metrics from 4 kB to 3.4 MB. Spans carry the backend's value (cut to 128 characters by
proxy/telemetry/record.py); metrics get `ErrorLabels(value)`, which is, in order:

- the proxy's own error types (`OWN`: its error codes and failure kinds) and the error types
  of the OpenAI API and the engines (`STANDARD`): kept as they are;
- an HTTP error status, `http_<status>` or `<status>`, 400 to 599: kept;
- any other value, the first `first` (32) distinct ones this process sees that look like an
  identifier (at most 64 of `[A-Za-z0-9_.:-]`): kept, so that an engine's own vocabulary
  still shows;
- everything else: `_OTHER` (OpenTelemetry's fallback for error.type).

So a proxy process has at most len(OWN) + len(STANDARD) + 400 + 32 + 1 error.type values,
whatever its backends send. The first-seen slots are per process, not shared by replicas.
"""

from __future__ import annotations

import re

OTHER_ERROR = "_OTHER"
OWN = frozenset(
    {
        OTHER_ERROR,
        "cancelled",
        "shutdown",
        "timeout",
        "idle_timeout",
        "connect_error",
        "connect_timeout",
        "connection_reset",
        "protocol_error",
        "body_error",
        "stream_error",
        "upstream_error",
        "upstream_stream_error",
        "incomplete_stream",
        "invalid_response",
        "prefill_error",
        "kv_transfer",
        "pd_no_kv_params",
        "backend_gone",
        "backend_drained",
        "gone",
        "no_backend",
        "backends_at_capacity",
        "backends_unavailable",
        "backends_rate_limited",
        "event_too_large",
        "upstream_response_too_large",
        "upstream_invalid_response",
    }
)
STANDARD = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "rate_limit_error",
        "server_error",
        "api_error",
        "overloaded_error",
        "insufficient_quota",
        "context_length_exceeded",
        "BadRequestError",
        "NotFoundError",
        "InternalServerError",
        "ServiceUnavailableError",
    }
)
_HTTP_ERROR = re.compile(r"(?:http_)?[45][0-9][0-9]")
_IDENTIFIER = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


class ErrorLabels:
    """error.type as a metric label: the value itself or `_OTHER` (the module's rule).

    Called with RequestMetrics.lock held (one thread at a time), on failed requests only.
    """

    __slots__ = ("first", "seen")

    def __init__(self, first: int = 32) -> None:
        self.first = first
        self.seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in OWN or value in STANDARD or value in self.seen:
            return value
        if _HTTP_ERROR.fullmatch(value):
            return value
        if len(self.seen) < self.first and _IDENTIFIER.fullmatch(value):
            self.seen.add(value)
            return value
        return OTHER_ERROR
