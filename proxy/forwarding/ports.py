"""The request path's ports: the small protocols its collaborators satisfy.

A leaf module (it imports nothing of the proxy at run time), so the forwarder, the relay,
the app and tests' fakes can all name these types without importing one another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from proxy.telemetry import RequestRecord
    from proxy.types import FailureKind
    from proxy.upstream.backends import Backend
    from proxy.upstream.pool import Target


class UpstreamResponseLike(Protocol):
    """What the relay reads of a backend's response."""

    status: int
    headers: list[tuple[bytes, bytes]]
    reused: bool

    async def readany(self) -> bytes: ...
    def at_end(self) -> bool: ...
    async def read(self, limit: int = -1) -> bytes: ...
    def idle_budget(self, seconds: float) -> None: ...
    def set_read_timeout(self, seconds: float) -> None: ...
    def push_to(self, sink: Callable[[bytes], bool] | None) -> None: ...
    def close(self) -> None: ...
    def release(self) -> None: ...


class UpstreamClient(Protocol):
    """Sends one request upstream and waits for the response head."""

    def url(self, base: str, path: str) -> Target: ...

    async def post(
        self,
        target: Target,
        body: bytes,
        headers: dict[str, str],
        on_sent: Callable[[], None] | None = None,
        *,
        fresh: bool = False,
    ) -> UpstreamResponseLike: ...


class Fleet(Protocol):
    """The backends as the request path sees them."""

    def __getitem__(self, name: str) -> Backend: ...
    def get(self, name: str) -> Backend | None: ...
    def may_serve(self, model: str) -> bool: ...
    def mark_attempt(self, backend: Backend) -> None: ...
    def mark_failure(self, backend: Backend, reason: str, *, kind: FailureKind) -> None: ...
    def mark_success(self, backend: Backend) -> None: ...


class Recorder(Protocol):
    """Opens a request's telemetry record and counts routing decisions."""

    def start_request(
        self,
        *,
        request_id: str,
        api: str,
        model: Any,
        stream: bool,
        params: dict[str, Any],
        headers: dict[str, str],
        t0: float,
    ) -> RequestRecord: ...

    def observe_routing(self, policy: str, reason: str, decision_s: float) -> None: ...

    def refused(self, status: int, code: str) -> None:
        """Count a request refused before any backend (`code`: a fixed error code)."""
        ...
