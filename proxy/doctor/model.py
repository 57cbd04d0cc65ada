"""The doctor's vocabulary: what a window of measurements holds, and what a report says.

Plain values, no I/O: the collector (collector.py) fills windows in the running proxy, the
virtual fleet adapter (virtual.py) fills them in simulated time, and tests write them by hand.
Times are seconds on one monotonic clock per window (the proxy's perf_counter, or the virtual
fleet's clock); only differences between them mean anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SCHEMA = "warmroute.doctor/v1"

# Stable finding ids, in the order a report lists them for one backend (causes first).
FINDING_IDS = (
    "kv_pressure",
    "queueing",
    "prefill_bound_ttft",
    "cache_affinity_lost",
    "prefill_interference",
    "long_context_itl",
    "decode_below_ceiling",
    "decode_at_ceiling",
    "tenant_crowding",  # proxy-wide: the admission queue, not a backend (ADMISSION)
)
ADMISSION = "admission"  # the `backend` of a finding about the proxy's admission queue
SEVERITIES = ("warning", "critical")

# Counter names in GaugeSample.counters: cumulative engine counters, compared across a window.
QUEUE_TIME_SUM = "queue_time_sum"  # vllm:request_queue_time_seconds_sum
QUEUE_TIME_COUNT = "queue_time_count"
PREFILL_TIME_SUM = "prefill_time_sum"  # vllm:request_prefill_time_seconds_sum
PREFILL_TIME_COUNT = "prefill_time_count"
PREFIX_QUERIES = "prefix_queries"  # vllm:prefix_cache_queries_total (tokens)
PREFIX_HITS = "prefix_hits"  # vllm:prefix_cache_hits_total (tokens)
PREEMPTIONS = "preemptions"  # vllm:num_preemptions_total
COUNTERS = (
    QUEUE_TIME_SUM,
    QUEUE_TIME_COUNT,
    PREFILL_TIME_SUM,
    PREFILL_TIME_COUNT,
    PREFIX_QUERIES,
    PREFIX_HITS,
    PREEMPTIONS,
)


@dataclass(slots=True)
class RequestSample:
    """One finished request as the proxy measured it (None: not observed)."""

    start: float  # the proxy had the whole request (t0)
    ttft_s: float | None = None  # the client's time to first token
    upstream_ttft_s: float | None = None  # request written upstream -> first output received
    first_at: float | None = None  # first output chunk written to the client (absolute)
    itl_s: Sequence[float] = ()  # gaps between consecutive output chunks, in stream order
    input_tokens: int | None = None
    cached_tokens: int | None = None  # the engine's own report (usage or llama.cpp timings)
    output_tokens: int | None = None
    # Prompt tokens the prefix index expected cached on the backend that served the request,
    # and on the best backend it knew of (the prompt was seen before somewhere).
    predicted_tokens: float | None = None
    seen_tokens: float | None = None
    engine_prefill_s: float | None = None  # the engine's own prefill time (llama.cpp timings)
    engine_queue_s: float | None = None  # the engine's own queue time for this request
    ok: bool = True
    # When itl_s keeps only a long stream's first gaps: its last chunk, and how many it had.
    end_at: float | None = None
    gaps: int | None = None

    @property
    def uncached_tokens(self) -> int | None:
        if self.input_tokens is None:
            return None
        return max(self.input_tokens - (self.cached_tokens or 0), 0)

    @property
    def avoidable_tokens(self) -> float:
        """Prefilled prompt tokens the index had seen before on some backend: a working
        prefix cache and routing would not have prefilled them."""
        if self.input_tokens is None or self.cached_tokens is None:
            return 0.0
        seen = max(min(self.seen_tokens or 0.0, self.input_tokens), self.predicted_tokens or 0.0)
        return max(min(seen, self.input_tokens) - self.cached_tokens, 0.0)

    @property
    def last_at(self) -> float | None:
        if self.first_at is None:
            return None
        if self.end_at is not None:
            return self.end_at
        return self.first_at + sum(self.itl_s)

    @property
    def gap_count(self) -> int:
        """Gaps the stream had (itl_s may keep only the first of them)."""
        return len(self.itl_s) if self.gaps is None else self.gaps


@dataclass(slots=True)
class GaugeSample:
    """One scrape of an engine's own signals (None: the engine does not publish it)."""

    at: float
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None  # 0..1
    kv_tokens: int | None = None  # the KV pool's size, when published
    counters: Mapping[str, float] = field(default_factory=dict)  # cumulative, see COUNTERS


@dataclass(frozen=True, slots=True)
class Hardware:
    """Declared hardware and model of one backend: enough for the decode ceiling.

    One decode step reads every weight once plus the KV cache of every sequence in the batch,
    so a step cannot take less than (weight bytes + KV bytes) / memory bandwidth.
    """

    label: str  # as declared, e.g. "h100/8b/bf16"
    bandwidth_bytes_s: float
    weight_bytes: float
    kv_bytes_per_token: float | None  # None: the model's layout is unknown

    @property
    def ceiling_tok_s(self) -> float:
        """The single-stream ceiling at no context: bandwidth / weight bytes."""
        return self.bandwidth_bytes_s / self.weight_bytes

    def step_s(self, context_tokens: float) -> float:
        """The shortest possible decode step with `context_tokens` of KV read in it."""
        kv = (self.kv_bytes_per_token or 0.0) * max(context_tokens, 0.0)
        return (self.weight_bytes + kv) / self.bandwidth_bytes_s


@dataclass(slots=True)
class Window:
    """Everything the doctor knows about one (backend, model) over a span of time."""

    backend: str
    model: str
    engine: str = "openai"  # vllm | sglang | llamacpp | openai: which signals it publishes
    requests: Sequence[RequestSample] = ()
    gauges: Sequence[GaugeSample] = ()
    errors: int = 0  # requests that failed (not in `requests`)
    hardware: Hardware | None = None
    # The capacity learner's view of this backend (CacheEstimate.as_dict()), if any.
    cache: Mapping[str, Any] | None = None
    policy: str | None = None  # the routing policy, for the change texts
    # The disaggregation decider's current view (GET /admin/disagg: mode, active, reason);
    # None when disagg.mode is off.
    disagg: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class TenantRequest:
    """One request that presented an API key: whose, how long it waited for an admission
    slot, and its tokens (prompt + output, as the engine counted them; 0 when unknown)."""

    t0: float
    tenant: str
    waited_s: float
    tokens: int


@dataclass(slots=True)
class Finding:
    """One diagnosis: what is wrong, the numbers that show it, and what to change."""

    id: str
    severity: str
    backend: str
    model: str
    summary: str
    evidence: dict[str, Any]
    change: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "severity": self.severity,
            "backend": self.backend,
            "model": self.model,
            "summary": self.summary,
            "evidence": self.evidence,
            "change": self.change,
        }


@dataclass(slots=True)
class BackendReport:
    """One window's measurements (as computed), its findings' ids, and notes on what is
    missing (no traffic, no gauges, no declared hardware...)."""

    backend: str
    model: str
    engine: str
    requests: int
    errors: int
    span_s: float
    measurements: dict[str, Any]
    findings: list[str]
    notes: list[str]
    hardware: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "model": self.model,
            "engine": self.engine,
            "hardware": self.hardware,
            "requests": self.requests,
            "errors": self.errors,
            "span_s": self.span_s,
            "measurements": self.measurements,
            "findings": self.findings,
            "notes": self.notes,
        }


@dataclass(slots=True)
class Report:
    """The whole diagnosis: one BackendReport per window, and every finding."""

    window_s: float | None
    backends: list[BackendReport]
    findings: list[Finding]
    generated_at: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "generated_at": self.generated_at,
            "window_s": self.window_s,
            "healthy": not self.findings,
            "backends": [b.as_dict() for b in self.backends],
            "findings": [f.as_dict() for f in self.findings],
        }
