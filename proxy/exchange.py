"""One client request as it moves through the proxy, and the API paths it can arrive on.

A leaf of the request path: the intake builds an Exchange, the forwarder routes it and the
relay streams its response; none of them needs more than this module to share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from proxy.ports import UpstreamResponseLike
    from proxy.routing.types import Decision, RouteContext

API_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
}
STREAMABLE = frozenset({"chat", "completions", "responses"})


@dataclass
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
