"""The records a bench run produces: one `RequestResult` per request, one `RunResult` per target.

Times are seconds from `time.perf_counter()`; `start` is relative to the run's start so that a
results file is self-contained. These dataclasses round-trip through JSON (`to_dict` /
`from_dict`) so that `warmroute bench report` can re-summarize saved runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

SCHEMA = "warmroute.bench/v1"


@dataclass
class RequestResult:
    """What one request did, as the client saw it."""

    index: int
    target: str  # base URL this request went to
    kind: str  # "chat" | "doc"
    conversation: int | None = None
    turn: int = 0
    system_id: int | None = None
    start: float = 0.0  # seconds since the run started, when the request was sent
    ok: bool = False
    ttft: float | None = None  # first output-bearing chunk - start
    e2e: float | None = None  # last output-bearing chunk - start
    itl: list[float] = field(default_factory=list)  # gaps between output-bearing chunks
    output_chunks: int = 0
    output_chars: int = 0
    prompt_tokens: int | None = None  # from usage; None when the server did not report it
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None = None
    http_status: int | None = None
    error_kind: str | None = None  # connect | timeout | http_<status> | stream_error | ...
    error: str | None = None  # short message, never a traceback

    @property
    def output_tokens(self) -> int:
        """Tokens generated: usage when reported, else one per output chunk (a lower bound)."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return self.output_chunks

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1), as vllm bench serve; None for one-token answers."""
        if self.ttft is None or self.e2e is None or self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestResult:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class RunResult:
    """One workload against one target (or one set of round-robin targets)."""

    label: str
    targets: list[str]
    workload: dict[str, Any]  # Workload.params()
    model: str
    endpoint: str  # "chat" | "completions"
    concurrency: int | None
    rate: float | None
    requests_planned: int
    started_at: str  # ISO 8601 wall clock, for humans
    duration: float = 0.0  # first send → last completion, seconds
    requests: list[RequestResult] = field(default_factory=list)
    not_sent: int = 0  # planned but never sent (max-duration reached)
    client_cpu_s: float = 0.0  # CPU time of the client's event loop thread during the run
    server_cpu_s: float | None = None  # CPU of --server-pid processes during the run (the proxy)
    role: str = "target"  # "target" | "direct" | "compare"
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["requests"] = [r.to_dict() for r in self.requests]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunResult:
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs["requests"] = [RequestResult.from_dict(r) for r in d.get("requests", [])]
        return cls(**kwargs)
