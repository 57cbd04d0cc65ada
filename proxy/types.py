"""The request path's shared vocabulary: a leaf below every module of the path (it imports
nothing of the proxy), as Starlette's `types.py` is.

`FailureKind` is what an attempt's failure says about its backend. The retry policy retries
by it, the circuit breaker (proxy/outlier.py) counts or ignores it, and the admin views show
it; a StrEnum, so it compares, prints and serialises as the word it always was.
"""

from __future__ import annotations

from enum import StrEnum


class FailureKind(StrEnum):
    """How an attempt failed (Retry.kind, and the kind a backend's breaker is told)."""

    CONNECT = "connect"  # refused or unreachable: nothing was sent
    CONNECT_TIMEOUT = "connect_timeout"  # no connection (or no free slot) within connect_s
    REUSED = "reused"  # a pooled connection the backend had just closed: says nothing of it
    TIMEOUT = "timeout"  # no first byte in time, or no progress in time once streaming
    STATUS = "status"  # a retryable HTTP status (500, 502, 503, 504)
    OVERLOADED = "overloaded"  # a 429: busy, not broken
    PROTOCOL = "protocol"  # not valid HTTP, a body that broke off, not an answer at all
    TOO_LARGE = "too_large"  # an answer over the size limits: no verdict on the backend
    GONE = "gone"  # the backend left the fleet before it answered
    CANCELLED = "cancelled"  # the client left: nothing to judge the backend by
