"""One client request as it moves through the proxy, and the API paths it can arrive on.

A leaf of the request path: the intake builds an Exchange, the forwarder routes it and the
relay streams its response; none of them needs more than this module to share it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from proxy.forwarding.ports import UpstreamResponseLike
    from proxy.routing.types import Decision, RouteContext
    from proxy.types import StreamFacts

API_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
}
STREAMABLE = frozenset({"chat", "completions", "responses"})


@dataclass(eq=False)  # by identity: a backend keeps the set of those on it (drains wait)
class Exchange:
    """Everything about one client request as it moves through the proxy."""

    api: str
    request_id: str
    t0: float
    headers: dict[str, str]
    body: dict[str, Any]
    raw: bytes  # what we send upstream (the client's bytes unless we had to change them)
    stream: bool
    strip_usage: bool = False
    client_raw: bytes = b""  # the client's own bytes, for backends we must not inject into
    decision: Decision | None = None
    attempts: list[str] = field(default_factory=list)
    client_gone: bool = False
    upstream: UpstreamResponseLike | None = None  # the live upstream response, if any
    ctx: RouteContext | None = None
    started_response: bool = False
    client: tuple[str, int] | None = None  # the client's address, for X-Forwarded-For
    task: asyncio.Task[Any] | None = None  # the task serving it (cut() cancels it)
    cut_reason: tuple[str, str] | None = None  # (code, reason) when cut by the proxy
    facts: StreamFacts | None = None  # what the client was sent, once the answer ended
    output_events: Callable[[], int] | None = None  # a streaming answer's output events so far
    response_headers: tuple[tuple[bytes, bytes], ...] = ()  # added to the answer (x-ratelimit-*)

    def cut(self, code: str, reason: str) -> None:
        """End this request with a clean error: its backend left the fleet (a stream gets an
        error event; one still waiting for its response head is retried elsewhere)."""
        if self.cut_reason is None and self.task is not None and not self.client_gone:
            self.cut_reason = (code, reason)
            self.task.cancel()
