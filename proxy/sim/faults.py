"""Fault injection at the connection: a refusing engine aborts new connections at accept,
and a stream cut on purpose leaves no traceback in uvicorn's log.

The per-request faults (an error status, a slow start, a stall or a cut mid-stream) are
decided where the request is answered (server.py, completion.py); the settings are
`SimConfig.faults`, changed at run time through POST /sim/faults.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from proxy.sim.errors import StreamCut


class Refuser(Protocol):
    """What the protocol asks of the engine: whether to refuse, and where to count."""

    counts: dict[str, int]
    protocols: set[Any]

    def should_refuse(self) -> bool: ...


class QuietStreamCut(logging.Filter):
    """Drops uvicorn's log record of a StreamCut: the cut was the point."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, StreamCut)


def protocol_for(app: Refuser) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, but one that aborts a connection when `app` refuses it."""
    base: Any = AutoHTTPProtocol

    class SimHTTPProtocol(base):
        """uvicorn's HTTP protocol, but a refusing engine aborts the connection at accept."""

        _refused = False

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            if app.should_refuse():
                self._refused = True
                app.counts["refused"] += 1
                transport.abort()  # type: ignore[attr-defined]
                return
            super().connection_made(transport)
            app.protocols.add(self)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            app.protocols.discard(self)
            super().connection_lost(exc)

    return SimHTTPProtocol


def close_idle(protocols: set[Any]) -> None:
    """Close the keep-alive connections with no response in flight (they would bypass the
    accept-time refusal)."""
    for proto in list(protocols):
        cycle = getattr(proto, "cycle", None)
        if cycle is None or cycle.response_complete:
            proto.transport.close()
