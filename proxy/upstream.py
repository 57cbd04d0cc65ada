"""Pooled keep-alive HTTP/1.1 connections to the backends: asyncio protocols + httptools.

The upstream client dominates the proxy's CPU (measurements in docs/architecture.md). aiohttp
was ~4x cheaper per chunk than httpx, but it still spent more CPU per streamed request than the
rest of the proxy did: every HTTP chunk of an SSE stream went through its parser callbacks,
chunk-split bookkeeping and flow-control calls one by one, and building each request took a
ClientRequest, a payload object and a writer. This client does only what the forwarding path
needs: one POST per request on a pooled connection, the body handed over as whatever is
buffered when the reader asks (whole reads, not one piece per HTTP chunk), and the timeouts,
keep-alive and error semantics the failure tests pin down. httpx remains the client for health
checks, discovery and scraping.

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

Proxies from the environment (HTTP_PROXY, HTTPS_PROXY) are not used: the backends are
addressed directly, by the forwarder and the health client alike (see `trust_env=False`
where the app builds its httpx client). Trailers of a chunked response are never merged
into its headers (llhttp reports them after the body; they are dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httptools

from proxy.config import TimeoutsConfig, UpstreamConfig

# Hop-by-hop headers (RFC 9110 7.6.1) and ones we set ourselves: never copied across.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
NOT_FORWARDED_UPSTREAM = HOP_BY_HOP | {
    "host",
    "content-length",
    "authorization",
    "accept-encoding",
    "cookie",
    "x-api-key",
}
NOT_FORWARDED_DOWNSTREAM = HOP_BY_HOP | {"content-length", "date", "server"}
# The same, as the lower-case bytes header names the response carries.
NOT_FORWARDED_DOWNSTREAM_B = frozenset(h.encode() for h in NOT_FORWARDED_DOWNSTREAM)

# Below the engines' own idle timeout (uvicorn, hence vLLM, and llama.cpp: 5 s), so the pool
# never hands out a connection the server is about to close.
KEEPALIVE_S = 4.0
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


class Target:
    """A parsed request target: where to connect and what to put in the request line."""

    __slots__ = ("host", "key", "port", "prefix", "ssl")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"unsupported backend URL scheme in {url!r}")
        self.host = parts.hostname or ""
        self.ssl = parts.scheme == "https"
        self.port = parts.port or (443 if self.ssl else 80)
        default = 443 if self.ssl else 80
        netloc = self.host if ":" not in self.host else f"[{self.host}]"
        if self.port != default:
            netloc += f":{self.port}"
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        # "POST <path> HTTP/1.1\r\nhost: <netloc>\r\n", built once per (backend, endpoint)
        self.prefix = f"POST {path} HTTP/1.1\r\nhost: {netloc}\r\n".encode("latin-1")
        self.key = (self.host, self.port, self.ssl)

    def __repr__(self) -> str:
        return f"Target({self.prefix!r})"


class _Conn(asyncio.Protocol):
    """One keep-alive connection; carries one response at a time."""

    __slots__ = (
        "_activity",
        "_buffer",
        "_buffered",
        "_eof",
        "_error",
        "_headers",
        "_headers_done",
        "_keep_alive",
        "_loop",
        "_paused",
        "_received",
        "_timer",
        "_until_eof",
        "_waiter",
        "closed",
        "idle_since",
        "key",
        "parser",
        "read_timeout",
        "reused",
        "transport",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, int, bool]) -> None:
        self._loop = loop
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
        self._reset()

    def _reset(self) -> None:
        """Ready for the next response on this connection."""
        self._headers: list[tuple[bytes, bytes]] = []
        self._headers_done = False
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._eof = False
        self._error: BaseException | None = None
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
        self._activity = self._loop.time()
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
        if self._eof or self._error is not None:
            return
        if self._headers_done and self._until_eof and exc is None:
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
        elif not self._headers_done:
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
        if not self._headers_done:
            self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # interim response: wait for the real one
            self._headers = []
            return
        self._headers_done = True
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
        if not self._headers_done:
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
        if self._error is None and not self._eof:
            self._error = exc
        self._cancel_timer()
        self._wake()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        """(Re)start the read timeout from now; one timer, re-armed lazily (see _on_timer)."""
        self._activity = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._activity + self.read_timeout, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._eof or self._error is not None or self.closed:
            return
        due = self._activity + self.read_timeout
        if self._loop.time() < due:  # bytes came since: wait the rest
            self._timer = self._loop.call_at(due, self._on_timer)
            return
        self._fail(TimeoutError(f"no data for {self.read_timeout:g}s"))

    def abort(self) -> None:
        self.closed = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()

    async def _wait(self) -> None:
        self._waiter = w = self._loop.create_future()
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

    def __init__(self, conn: _Conn, pool: Upstream) -> None:
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
            if c._error is not None:
                raise c._error
            if c._eof:
                return b""
            await c._wait()

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
        if not c._eof and c._error is None and not c.closed:
            c._cancel_timer()
            c._arm()

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
            and c._error is None
            and not c._buffer
            and not c.closed
            and not c._until_eof
            and c._keep_alive
        ):
            self._pool._put(c)
        else:
            self._pool._forget(c)
            c.abort()


class Upstream:
    """A pool of keep-alive connections per backend host for the whole app."""

    def __init__(
        self,
        timeouts: TimeoutsConfig,
        max_per_host: int = 1024,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.timeouts = timeouts
        self.max_per_host = max_per_host  # connections in use per (host, port, tls)
        self._targets: dict[tuple[str, str], Target] = {}
        self._idle: dict[tuple[str, int, bool], deque[_Conn]] = {}
        self._open: set[_Conn] = set()
        self._busy: dict[tuple[str, int, bool], int] = {}
        self._slot_waiters: dict[tuple[str, int, bool], deque[asyncio.Future[None]]] = {}
        self._ssl = ssl_context
        self._started = False

    async def start(self) -> None:
        self._started = True

    async def close(self) -> None:
        self._started = False
        for conns in self._idle.values():
            for c in conns:
                c.abort()
        self._idle.clear()
        for c in list(self._open):
            c.abort()
        self._open.clear()
        self._busy.clear()

    def url(self, base: str, path: str) -> Target:
        """The parsed target per (backend, endpoint), built once: parsing costs per request."""
        key = (base, path)
        target = self._targets.get(key)
        if target is None:
            target = self._targets[key] = Target(base + path)
        return target

    async def post(
        self,
        target: Target,
        body: bytes,
        headers: dict[str, str],
        on_sent: Callable[[], None] | None = None,
        *,
        fresh: bool = False,
    ) -> UpstreamResponse:
        """Send the request and wait for the response headers (not the body).

        `on_sent` runs right after the request is handed to the socket, before the wait for
        the response: bookkeeping that need not delay the request goes there (it overlaps the
        backend's own work instead of adding to the client's TTFT). `fresh` opens a new
        connection instead of taking a pooled one (the retry after a keep-alive race).
        """
        assert self._started, "Upstream.start() was not awaited"
        head = _head(target, headers, len(body))
        conn = await self._connect(target, fresh)
        conn._reset()
        conn.read_timeout = self.timeouts.first_byte_s
        try:
            assert conn.transport is not None
            conn.transport.write(head + body)
            conn._arm()
            if on_sent is not None:
                on_sent()
            while not conn._headers_done:
                if conn._error is not None:
                    raise conn._error
                await conn._wait()
        except BaseException:
            conn.abort()
            self._forget(conn)
            raise
        return UpstreamResponse(conn, self)

    async def _slot(self, key: tuple[str, int, bool]) -> None:
        """Wait (within the connect timeout) until fewer than max_per_host are in use."""
        if self._busy.get(key, 0) < self.max_per_host:
            self._busy[key] = self._busy.get(key, 0) + 1
            return
        waiter = asyncio.get_running_loop().create_future()
        waiters = self._slot_waiters.setdefault(key, deque())
        waiters.append(waiter)
        try:
            async with asyncio.timeout(self.timeouts.connect_s):
                await waiter  # _forget hands its slot straight to us
        except TimeoutError:
            with contextlib.suppress(ValueError):
                waiters.remove(waiter)
            if waiter.done() and not waiter.cancelled():
                self._free_slot(key)  # handed to us as the timeout fired: pass it on
            raise UpstreamConnectTimeout(
                f"no free connection to {key[0]}:{key[1]} within {self.timeouts.connect_s:g}s "
                f"({self.max_per_host} in use: upstream.max_connections_per_backend)"
            ) from None
        except BaseException:
            with contextlib.suppress(ValueError):
                waiters.remove(waiter)
            if waiter.done() and not waiter.cancelled():
                self._free_slot(key)
            raise

    def _free_slot(self, key: tuple[str, int, bool]) -> None:
        waiters = self._slot_waiters.get(key)
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(None)  # the slot moves to the waiter; the count stays
                return
        self._busy[key] = max(0, self._busy.get(key, 0) - 1)

    def _forget(self, conn: _Conn) -> None:
        """The connection is no longer in use by a request (pooled, closed or failed)."""
        if conn in self._open:
            self._open.discard(conn)
            self._free_slot(conn.key)

    async def _connect(self, target: Target, fresh: bool = False) -> _Conn:
        await self._slot(target.key)
        try:
            return await self._connect_in_slot(target, fresh)
        except BaseException:
            self._free_slot(target.key)
            raise

    async def _connect_in_slot(self, target: Target, fresh: bool) -> _Conn:
        idle = None if fresh else self._idle.get(target.key)
        if idle:
            now = asyncio.get_running_loop().time()
            while idle:
                c = idle.pop()  # the most recently used: warmest, least likely to be closed
                if c.closed or c.transport is None or c.transport.is_closing():
                    continue
                if now - c.idle_since > KEEPALIVE_S:
                    c.abort()
                    continue
                c.reused = True
                self._open.add(c)
                return c
        loop = asyncio.get_running_loop()
        conn = _Conn(loop, target.key)
        ssl_ctx = None
        if target.ssl:
            if self._ssl is None:
                self._ssl = client_ssl_context()
            ssl_ctx = self._ssl
        try:
            async with asyncio.timeout(self.timeouts.connect_s):
                await loop.create_connection(
                    lambda: conn,
                    target.host,
                    target.port,
                    ssl=ssl_ctx,
                    server_hostname=target.host if ssl_ctx else None,
                )
        except TimeoutError:
            conn.abort()
            raise UpstreamConnectTimeout(
                f"no connection to {target.host}:{target.port} within {self.timeouts.connect_s:g}s"
            ) from None
        except OSError as e:
            conn.abort()
            raise UpstreamConnectError(
                f"Cannot connect to host {target.host}:{target.port} ({e.strerror or e})"
            ) from None
        self._open.add(conn)
        return conn

    def _put(self, conn: _Conn) -> None:
        self._forget(conn)
        if not self._started:
            conn.abort()
            return
        conn.idle_since = conn._loop.time()
        self._idle.setdefault(conn.key, deque()).append(conn)

    @staticmethod
    def set_read_timeout(resp: UpstreamResponse, seconds: float) -> None:
        """Switch a live response from the first-byte budget to the idle budget."""
        resp.set_read_timeout(seconds)


def client_ssl_context(cfg: UpstreamConfig | None = None) -> ssl.SSLContext:
    """The TLS settings for https backends, shared by the forwarder and the health client."""
    cfg = cfg or UpstreamConfig()
    ctx = ssl.create_default_context(cafile=cfg.tls_ca_file)
    if not cfg.tls_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cfg.tls_cert_file:
        ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    return ctx


def _head(target: Target, headers: dict[str, Any], length: int) -> bytes:
    """Request line, host, the given headers and content-length, as bytes."""
    lines = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
    n = len(headers)
    if lines.count("\n") != n or lines.count("\r") != n:  # no header may smuggle a line in
        raise ValueError("newline in an upstream header")
    try:
        block = lines.encode("latin-1")
    except UnicodeEncodeError:
        block = lines.encode("utf-8")
    return b"%s%scontent-length: %d\r\n\r\n" % (target.prefix, block, length)
