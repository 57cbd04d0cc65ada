"""One keep-alive HTTP/1.1 connection to a backend and the response it carries.

The connection is an asyncio protocol fed to httptools (llhttp): it buffers body bytes as they
arrive and hands the reader whatever is buffered at once (whole reads, not one piece per HTTP
chunk), keeps the read timeout (one timer, re-armed lazily), pauses reading past HIGH_WATER
unread bytes, and turns every way a response can fail into a typed error (below). The pool
that opens, reuses and caps these connections is proxy/upstream.py.

Errors, typed so the retry policy (proxy/retry.py) can tell them apart:
- UpstreamConnectError: the backend did not take the connection (refused, unreachable, DNS);
  the request was never sent. UpstreamConnectTimeout (a subclass): no connection within
  connect_s.
- UpstreamDisconnected: a connection closed before any response byte; `reused` says whether
  it was a pooled connection (the keep-alive race: the server had just closed it, which says
  nothing about the backend) or a new one.
- UpstreamProtocolError: the response was not valid HTTP/1.1 (a garbled or partial head).
- UpstreamPayloadError: the response broke off after it started.
- TimeoutError: no bytes for the read timeout (the first-byte budget until the forwarder
  switches the response to the idle budget).

Trailers of a chunked response are never merged into its headers (llhttp reports them after
the body; they are dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Protocol

import httptools

# Pause reading a response once this much is buffered and unread (a slow client).
HIGH_WATER = 1 << 20


class UpstreamError(Exception):
    """Any failure of the upstream exchange other than a timeout."""


class UpstreamConnectError(UpstreamError):
    """The backend refused or could not be reached; nothing was sent."""


class UpstreamConnectTimeout(UpstreamConnectError):
    """No connection within the connect timeout (or no free slot under the host's cap)."""


class UpstreamDisconnected(UpstreamError):
    """The connection closed before any byte of a response arrived."""

    def __init__(self, message: str, reused: bool = False) -> None:
        super().__init__(message)
        self.reused = reused


class UpstreamPayloadError(UpstreamError):
    """The response broke off after it started."""


class UpstreamProtocolError(UpstreamPayloadError):
    """The response was not valid HTTP/1.1."""


# Errors that mean "this backend did not take the request": safe to retry elsewhere.
# Refused/unreachable marks the backend down for a while; a pooled connection the server had
# just closed (keep-alive race) says nothing about the backend's health.
REFUSED_ERRORS: tuple[type[BaseException], ...] = (UpstreamConnectError,)
CONNECT_ERRORS: tuple[type[BaseException], ...] = (UpstreamConnectError, UpstreamDisconnected)
# Errors while reading a response that has started.
READ_ERRORS: tuple[type[BaseException], ...] = (UpstreamError, TimeoutError)


class Pool(Protocol):
    """Where a finished response's connection goes: back to the idle set, or forgotten."""

    def keep(self, conn: Connection) -> None: ...

    def forget(self, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One keep-alive connection; carries one response at a time."""

    __slots__ = (
        "_activity",
        "_buffer",
        "_buffered",
        "_eof",
        "_headers",
        "_keep_alive",
        "_paused",
        "_received",
        "_timer",
        "_until_eof",
        "_waiter",
        "closed",
        "error",
        "headers_done",
        "idle_since",
        "key",
        "loop",
        "parser",
        "read_timeout",
        "reused",
        "transport",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, int, bool]) -> None:
        self.loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self.read_timeout = 0.0
        self._timer: asyncio.TimerHandle | None = None
        # One parser for the connection's life: llhttp starts over after each complete
        # keep-alive response (a connection with a parse error is never reused).
        self.parser = httptools.HttpResponseParser(self)
        self.reset()

    def reset(self) -> None:
        """Ready for the next response on this connection."""
        self._headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._eof = False
        self.error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._received = False
        self._until_eof = False
        self._keep_alive = False
        self._paused = False
        self._activity = 0.0

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self._activity = self.loop.time()
        self._received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamProtocolError(f"invalid HTTP response: {e}"))
            self.abort()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        if self._eof or self.error is not None:
            return
        if self.headers_done and self._until_eof and exc is None:
            self._eof = True  # a body delimited by the connection's end
            self._wake()
            return
        if not self._received:
            why = f": {exc}" if exc else ""
            self._fail(
                UpstreamDisconnected(
                    f"Server disconnected before responding{why}"
                    + (" (a pooled keep-alive connection)" if self.reused else ""),
                    self.reused,
                )
            )
        elif not self.headers_done:
            why = f" ({exc})" if exc else ""
            self._fail(UpstreamProtocolError(f"the response head broke off{why}"))
        else:
            why = f" ({exc})" if exc else ""
            self._fail(UpstreamPayloadError(f"Response payload is not completed{why}"))

    def pause_writing(self) -> None:  # request bodies are small; the kernel buffer takes them
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks -----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        # llhttp reports trailers here too, after the body; when the whole response came in
        # one read they would land in the headers before the response object copies them.
        if not self.headers_done:
            self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # interim response: wait for the real one
            self._headers = []
            return
        self.headers_done = True
        chunked = length = False
        for k, v in self._headers:
            lk = k.lower()
            if lk == b"content-length":
                length = True
            elif lk == b"transfer-encoding" and b"chunked" in v.lower():
                chunked = True
        self._until_eof = not (length or chunked) and status not in (204, 304)
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._buffer.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        if self._waiter is not None:
            self._wake()

    def on_message_complete(self) -> None:
        if not self.headers_done:
            return  # the end of an interim (1xx) response
        self._eof = True
        # read here: llhttp forgets it once the message is over
        self._keep_alive = self.parser.should_keep_alive()
        self._cancel_timer()
        self._wake()

    # -- state -------------------------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None and not self._eof:
            self.error = exc
        self._cancel_timer()
        self._wake()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def arm(self) -> None:
        """(Re)start the read timeout from now; one timer, re-armed lazily (see _on_timer)."""
        self._activity = self.loop.time()
        if self._timer is None:
            self._timer = self.loop.call_at(self._activity + self.read_timeout, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._eof or self.error is not None or self.closed:
            return
        due = self._activity + self.read_timeout
        if self.loop.time() < due:  # bytes came since: wait the rest
            self._timer = self.loop.call_at(due, self._on_timer)
            return
        self._fail(TimeoutError(f"no data for {self.read_timeout:g}s"))

    def abort(self) -> None:
        self.closed = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()

    async def wait(self) -> None:
        self._waiter = w = self.loop.create_future()
        try:
            await w
        finally:
            self._waiter = None

    # -- reading -----------------------------------------------------------------------------
    def _take(self) -> bytes:
        buf = self._buffer
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        self._buffer = []
        self._buffered = 0
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return data


class UpstreamResponse:
    """The response to one upstream request; read it with readany() / read()."""

    __slots__ = ("_conn", "_pool", "_released", "headers", "reused", "status")

    def __init__(self, conn: Connection, pool: Pool) -> None:
        self._conn = conn
        self._pool = pool
        self._released = False
        self.reused = conn.reused  # a pooled connection (not opened for this request)
        self.status: int = conn.parser.get_status_code()
        # (lower-case name, value) as bytes, in the order the backend sent them
        self.headers: list[tuple[bytes, bytes]] = [(k.lower(), v) for k, v in conn._headers]

    async def readany(self) -> bytes:
        """Whatever body bytes are buffered (waiting for some); b"" at the end of the body."""
        c = self._conn
        while True:
            if c._buffer:
                return c._take()
            if c.error is not None:
                raise c.error
            if c._eof:
                return b""
            await c.wait()

    async def read(self, limit: int = -1) -> bytes:
        """The whole body (or its first `limit` bytes, waiting no longer than needed)."""
        c = self._conn
        parts: list[bytes] = []
        size = 0
        while limit < 0 or size < limit:
            data = await self.readany()
            if not data:
                break
            parts.append(data)
            size += len(data)
        body = b"".join(parts)
        if 0 <= limit < len(body):
            c._buffer.insert(0, body[limit:])
            body = body[:limit]
        return body

    def set_read_timeout(self, seconds: float) -> None:
        """Switch from the first-byte budget to the idle budget (from now)."""
        c = self._conn
        c.read_timeout = seconds
        if not c._eof and c.error is None and not c.closed:
            c._cancel_timer()
            c.arm()

    def close(self) -> None:
        """Drop the connection now (the client left): a pending read fails at once."""
        c = self._conn
        c._fail(UpstreamPayloadError("closed by the proxy"))
        c.abort()

    def release(self) -> None:
        """Done with the response: the connection goes back to the pool if it can be reused."""
        if self._released:
            return
        self._released = True
        c = self._conn
        if (
            c._eof
            and c.error is None
            and not c._buffer
            and not c.closed
            and not c._until_eof
            and c._keep_alive
        ):
            self._pool.keep(c)
        else:
            self._pool.forget(c)
            c.abort()
