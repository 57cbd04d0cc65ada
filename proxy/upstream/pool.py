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

Here: the pool (idle connections per host, the per-host cap, connecting, TLS), the request
target and head, and which headers cross. One connection's protocol state, the response it
carries are in proxy/upstream/conn.py, the typed errors in proxy/upstream/errors.py (both
re-exported here).

Proxies from the environment (HTTP_PROXY, HTTPS_PROXY) are not used: the backends are
addressed directly, by the forwarder and the health client alike (see `trust_env=False`
where the app builds its httpx client).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from proxy.config import TimeoutsConfig, UpstreamConfig
from proxy.engines import backend_url
from proxy.upstream.conn import (
    HIGH_WATER,
    MAX_BUFFERED_BYTES,
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    MAX_RESPONSE_BYTES,
    BodyBudget,
    Connection,
    UpstreamResponse,
)
from proxy.upstream.errors import (
    CONNECT_ERRORS,
    READ_ERRORS,
    REFUSED_ERRORS,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamFirstByteTimeout,
    UpstreamHeadTooLarge,
    UpstreamIdleTimeout,
    UpstreamOverBudget,
    UpstreamPayloadError,
    UpstreamProtocolError,
    UpstreamResponseTooLarge,
    UpstreamTimeout,
)

__all__ = [
    "CONNECT_ERRORS",
    "HIGH_WATER",
    "HOP_BY_HOP",
    "KEEPALIVE_S",
    "MAX_BUFFERED_BYTES",
    "MAX_HEADERS",
    "MAX_HEAD_BYTES",
    "MAX_RESPONSE_BYTES",
    "NOT_FORWARDED_DOWNSTREAM",
    "NOT_FORWARDED_DOWNSTREAM_B",
    "NOT_FORWARDED_UPSTREAM",
    "READ_ERRORS",
    "REFUSED_ERRORS",
    "Connection",
    "Target",
    "Upstream",
    "UpstreamConnectError",
    "UpstreamConnectTimeout",
    "UpstreamDisconnected",
    "UpstreamError",
    "UpstreamFirstByteTimeout",
    "UpstreamHeadTooLarge",
    "UpstreamIdleTimeout",
    "UpstreamOverBudget",
    "UpstreamPayloadError",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "UpstreamResponseTooLarge",
    "UpstreamTimeout",
    "client_ssl_context",
]

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
# Content-Encoding: the proxy sends the JSON body it parsed, never the client's coded bytes
# (a coded request body is refused with 415 before it is read: proxy/forwarding/forward.py).
NOT_FORWARDED_UPSTREAM = HOP_BY_HOP | {
    "host",
    "content-length",
    "content-encoding",
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


class Target:
    """A parsed request target: where to connect and what to put in the request line."""

    __slots__ = ("host", "key", "port", "prefix", "ssl")

    def __init__(self, url: str, method: str = "POST") -> None:
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
        self.prefix = f"{method} {path} HTTP/1.1\r\nhost: {netloc}\r\n".encode("latin-1")
        self.key = (self.host, self.port, self.ssl)

    def __repr__(self) -> str:
        return f"Target({self.prefix!r})"


class Upstream:
    """A pool of keep-alive connections per backend host for the whole app."""

    def __init__(
        self,
        timeouts: TimeoutsConfig,
        max_per_host: int = 1024,
        ssl_context: ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        max_buffered_bytes: int = MAX_BUFFERED_BYTES,
    ) -> None:
        self.timeouts = timeouts
        # The most of a whole (non-streamed) body a response's read() takes
        self.max_response_bytes = max_response_bytes
        # What all whole bodies hold at once beyond their first FREE_BYTES each
        self.body_budget = BodyBudget(max_buffered_bytes)
        self._clock = clock  # ages idle connections (KEEPALIVE_S): injectable for tests
        self.max_per_host = max_per_host  # connections in use per (host, port, tls)
        self._targets: dict[tuple[str, str], Target] = {}
        self._idle: dict[tuple[str, int, bool], deque[Connection]] = {}
        self._open: set[Connection] = set()
        self._busy: dict[tuple[str, int, bool], int] = {}
        self._slot_waiters: dict[tuple[str, int, bool], deque[asyncio.Future[None]]] = {}
        # Hosts whose backend left while connections to it were in use: those are closed when
        # their request ends instead of pooled (see forget_backend).
        self._retired: set[tuple[str, int, bool]] = set()
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
        """The parsed target per (backend, endpoint), built once: parsing costs per request.
        The backend URL's own path prefix and query go around `path` (engines.backend_url)."""
        key = (base, path)
        target = self._targets.get(key)
        if target is None:
            target = self._targets[key] = Target(backend_url(base, path))
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
        conn.reset()
        conn.read_timeout = self.timeouts.first_byte_s
        try:
            assert conn.transport is not None
            conn.transport.write(head + body)
            conn.arm()  # the head, 1xx heads and the first body byte: all within first_byte_s
            if on_sent is not None:
                on_sent()
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait()
        except BaseException:
            conn.abort()
            self.forget(conn)
            raise
        return UpstreamResponse(
            conn, self, self.max_response_bytes, self.timeouts.idle_s, self.body_budget
        )

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
                await waiter  # forget hands its slot straight to us
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
        n = self._busy.get(key, 0) - 1
        if n > 0:
            self._busy[key] = n
        else:  # none in use: no entry, so hosts that come and go leave nothing behind
            self._busy.pop(key, None)
            if waiters is not None:
                del self._slot_waiters[key]
            if self._retired:
                self._retired.discard(key)

    def forget_backend(self, backend: str) -> int:
        """The backend left the fleet: its idle pooled connections are closed now and its
        parsed targets and slot state dropped; connections in use finish their requests
        normally and are closed, not pooled, when they end. Returns how many idle connections
        were closed. `backend` is its base URL (as the forwarder passes it to `url()`) or its
        name when that is its host:port (BackendConfig.key without a configured name).

        Connections are pooled per host, port and TLS, so this applies to every backend at that
        address (one engine per address: BackendConfig.key)."""
        if "://" in backend:
            keys = {Target(backend).key}
        else:
            host, _, port = backend.rpartition(":")
            host = host.removeprefix("[").removesuffix("]")
            keys = {(host, int(port), tls) for tls in (False, True)} if port.isdigit() else set()
        for target_key in [k for k, t in self._targets.items() if t.key in keys]:
            del self._targets[target_key]
        closed = 0
        for key in keys:
            idle = self._idle.pop(key, ())
            for c in idle:
                c.abort()
            closed += len(idle)
            if self._busy.get(key, 0) > 0:
                self._retired.add(key)
        return closed

    def forget(self, conn: Connection) -> None:
        """The connection is no longer in use by a request (pooled, closed or failed)."""
        if conn in self._open:
            self._open.discard(conn)
            self._free_slot(conn.key)

    async def _connect(self, target: Target, fresh: bool = False) -> Connection:
        await self._slot(target.key)
        try:
            return await self._connect_in_slot(target, fresh)
        except BaseException:
            self._free_slot(target.key)
            raise

    async def _connect_in_slot(self, target: Target, fresh: bool) -> Connection:
        idle = None if fresh else self._idle.get(target.key)
        if idle:
            _expire(idle, self._clock())
            while idle:
                c = idle.pop()  # the most recently used: warmest, least likely to be closed
                if c.closed or c.transport is None or c.transport.is_closing():
                    continue
                c.reused = True
                self._open.add(c)
                return c
        if self._retired:  # the address serves again: its connections may be pooled again
            self._retired.discard(target.key)
        loop = asyncio.get_running_loop()
        conn = Connection(loop, target.key)
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

    def keep(self, conn: Connection) -> None:
        # Read before forget(): the last connection in use of a retired host un-retires it.
        retired = bool(self._retired) and conn.key in self._retired
        self.forget(conn)
        if retired:
            conn.abort()
            return
        if not self._started:
            conn.abort()
            return
        conn.idle_since = now = self._clock()
        idle = self._idle.setdefault(conn.key, deque())
        _expire(idle, now)
        idle.append(conn)

    @staticmethod
    def set_read_timeout(resp: UpstreamResponse, seconds: float) -> None:
        """Switch a live response from the first-byte budget to the idle budget."""
        resp.idle_budget(seconds)


def _expire(idle: deque[Connection], now: float) -> None:
    """Close the connections idle past KEEPALIVE_S, oldest first. Checkout takes the newest
    (LIFO), so under steady light traffic the older ones would otherwise never be looked at
    again: they are closed here, on every checkout and return, at one comparison when none is
    due."""
    while idle and now - idle[0].idle_since > KEEPALIVE_S:
        idle.popleft().abort()


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
