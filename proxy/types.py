"""The request path's shared vocabulary: a leaf below every module of the path (it imports
nothing of the proxy), as Starlette's `types.py` is.

`FailureKind` is what an attempt's failure says about its backend. The retry policy retries
by it, the circuit breaker (proxy/upstream/outlier.py) counts or ignores it, and the admin views
show it; a StrEnum, so it compares, prints and serialises as the word it always was.

`CLIENT` and `TENANT` say who the current request is: the edge (proxy/edge/gate.py) sets
them for the request's task; telemetry, the prefix hash and the tenants' budgets read them.

`StreamFacts` is what one request looked like to its client: the stream meter
(proxy/forwarding/meter.py) makes it, telemetry, the routing learners and the doctor read it.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from enum import StrEnum

# The name of the API key the current request presented (None: keys are off). Set by the
# edge for the request's task; telemetry records it.
CLIENT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "warmroute_client", default=None
)
# The tenant salt of the current request's prefix hash (None: not isolated). Set by the edge
# when server.isolate_tenants is on and a key was presented; proxy.routing.prefix reads it.
TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "warmroute_tenant", default=None
)


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


@dataclass(slots=True)
class StreamFacts:
    """What one request looked like to its client (times in seconds; None = not observed)."""

    ttft_s: float | None  # first output-bearing event written to the client - t0
    upstream_ttft_s: float | None  # first output-bearing event received - request sent upstream
    itl_s: list[float]  # one gap per output-bearing event after the first (client send times)
    tpot_s: float | None  # (t_last - t_first) / (output_tokens - 1)
    e2e_s: float | None  # last output-bearing event written (or the JSON response) - t0
    chunks: int  # output-bearing events
    events: int  # events with a data field (incl. [DONE])
    output_tokens: int | None
    input_tokens: int | None
    cached_tokens: int | None
    finish_reasons: list[str]
    response_id: str | None
    response_model: str | None
    error: str | None  # error.type-style; set when the stream carried an error or broke
    cancelled: bool
    first_output_at: float | None  # absolute perf_counter times, for span events
    last_output_at: float | None
    # Time from receiving output bytes to writing them to the client, one per write that
    # carried output (the proxy's own per-chunk forwarding cost).
    forward_s: list[float] = field(default_factory=list)
    engine_prefill_s: float | None = None  # the engine's own prefill time (llama.cpp timings)
