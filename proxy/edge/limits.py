"""Limits on client connections, enforced in the HTTP protocol before the app sees a request.

Without them one client could hold the proxy: a 128 MB header was parsed for ~25 s on the
event loop (health checks timed out, other clients got 503), and 300 idle or slow-header
connections were all still open after 75 s. Here, per connection:

- the request head (request line and headers) is bounded in bytes and header count: past
  either, 431 and the connection closes; bytes are counted as they arrive, so a head that is
  still growing is refused as soon as it passes the bound;
- the head must be complete within `header_timeout_s` of the connection opening (or of its
  first byte after a keep-alive wait), and the body within `body_timeout_s` of the head: else
  408 (a connection that never sent a byte is just closed);
- past `max_connections` open connections a new one gets 503 and is closed at once;
- a client that stops reading its response is cut off once its writes have been stalled for
  `write_timeout_s`: else it would hold its admission slot and the upstream connection (the
  engine's KV cache) for as long as it liked. The timer is armed when the transport's buffer
  passes its high-water mark (pause_writing) and cancelled when it drains (resume_writing),
  so a chunk written costs nothing; the connection's loss is told to the request at once
  (the DISCONNECT_HOOK extension below, no task per request), and the forwarder closes the
  upstream.

Never two answers to one request, and every request answered in order: a body that times out
after the app has answered (a 404, a 413, /health) just closes the connection; a refusal of a
pipelined head waits for the answers owed before it; the head bound counts each head's own
bytes, not the requests and bodies before it in the same read. A request asking to switch
protocols (Upgrade: h2c from `curl --http2`, a WebSocket handshake) is answered over HTTP/1.1
as if it had not asked (RFC 9110 section 7.8): this proxy speaks neither; CONNECT gets 400.

Deadlines are checked by one timer per server every tick (a quarter of the shortest timeout,
at most 1 s), not one timer per request: a request costs two clock reads. The app publishes
the limits (and reads the counters) through the ASGI lifespan state, so any server running the
app with this protocol enforces the app's configured limits.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from proxy.asgi import DISCONNECT_HOOK
from proxy.errors import error_body
from proxy.redact import sane_request_id

APP_STATE_KEY = "warmroute.connections"
log = logging.getLogger("warmroute.limits")

_IDLE, _HEAD, _BODY = 0, 1, 2
REASONS = (
    "too_many_connections",
    "header_too_large",
    "too_many_headers",
    "header_timeout",
    "body_timeout",
    "idle_timeout",
    "bad_request",
    "write_timeout",
)


@dataclass(frozen=True)
class ConnLimits:
    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 1024
    write_timeout_s: float = 60.0

    @property
    def tick_s(self) -> float:
        return min(1.0, max(0.02, min(self.header_timeout_s, self.body_timeout_s) / 4))


@dataclass
class Connections:
    """The limits a server enforces and what enforcing them did (read by /metrics)."""

    limits: ConnLimits
    open: int = 0
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))


def request_id_of(headers: Iterable[tuple[bytes, bytes]] | None) -> str:
    """The client's x-request-id when it is a sane one, else a new one: the rule of the API
    paths (proxy.redact.sane_request_id), for a refusal made before the app sees the head."""
    for name, value in headers or ():
        if name == b"x-request-id":
            return sane_request_id(value.decode("latin-1"))
    return sane_request_id(None)


def default_max_connections() -> int:
    """Half the open-file limit (each client connection may hold an upstream one too), less
    a reserve for listeners, Redis, logs and the health checks."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 32768
    return max(16, (soft - 64) // 2)


def raise_open_file_limit(want: int = 65536) -> tuple[int, int]:
    """Raise this process's soft open-file limit towards its hard limit: (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request that is refused."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above (when the app publishes them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._conns: Connections | None = self.app_state.get(APP_STATE_KEY)
        self._phase = _IDLE
        self._since = 0.0  # loop time the current phase began
        self._head_bytes = 0  # bytes of the current head seen in earlier reads
        self._chunk = 0  # bytes of the read being parsed
        self._refusal: tuple[int, str, str] | None = None
        self._counted = False
        self._clean = True  # all the read parsed so far is the current head's
        self._upgrade_asked = False  # the head asks to switch protocols: answered over HTTP/1.1
        self._deferred: bytes | None = None  # a refusal sent once earlier answers are
        self._stalled: asyncio.TimerHandle | None = None  # armed while writes are paused
        # The running request's callback for its client leaving (proxy.asgi.disconnect_watch),
        # offered to the app in each request's scope: one dict per connection.
        self._left: Callable[[], object] | None = None
        self._lost = False  # the connection is gone (a watch set after that is told at once)
        self._extensions: dict[str, dict[object, object]] = {
            DISCONNECT_HOOK: {"watch": self._watch_left}
        }

    # -- connection ------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        conns = self._conns
        if conns is None:
            return
        conns.open += 1
        self._counted = True
        self._phase, self._since = _HEAD, self.loop.time()
        if len(self.connections) > conns.limits.max_connections:
            self._refuse(
                503,
                f"This proxy has {conns.limits.max_connections} connections open "
                "(server.max_connections); retry shortly.",
                "too_many_connections",
            )
            return
        _arm_sweep(self.loop, self.server_state, conns)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted and self._conns is not None:
            self._counted = False
            self._conns.open -= 1
        self._phase = _IDLE
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None
        self._lost = True
        left, self._left = self._left, None
        cycle = self.cycle
        answered = cycle is None or cycle.response_complete
        super().connection_lost(exc)
        if left is not None and not answered:
            try:
                left()
            except Exception:
                log.exception("the handler of a client's leaving failed")

    # -- the app's disconnect watch (proxy.asgi.DISCONNECT_HOOK) ---------------------------
    def _watch_left(self, callback: Callable[[], object]) -> Callable[[], object]:
        """Call `callback()` if the connection is lost before the running response ends
        (what http.disconnect would say, without a task awaiting it); returns the stop.

        A loss is seen only while the connection is read: uvicorn pauses reading when a
        read takes a request's buffered body past its high-water mark (64 KiB), and resumes
        it only in `receive()`, which nothing calls once the body is whole. A client that
        sent a long prompt and left while it prefilled went unseen until the stream's next
        write, the engine working on for no one. So a watch set once the body is whole
        resumes reading (the next head read is a pipelined request's, which pauses it again
        as uvicorn does); and a connection lost before the watch was set tells it at once."""
        if self._lost:
            return self.loop.call_soon(callback).cancel
        self._left = callback
        cycle = self.cycle
        if (
            self.flow.read_paused
            and cycle is not None
            and not cycle.more_body
            and not self.pipeline
            and self._deferred is None  # (a refusal waiting its turn: nothing more is read)
        ):
            self.flow.resume_reading()
        return functools.partial(self._unwatch_left, callback)

    def _unwatch_left(self, callback: Callable[[], object]) -> None:
        if self._left is callback:  # (a pipelined request after it may have its own)
            self._left = None

    # -- flow control: called at the transport's water marks, never per write -----------------
    def pause_writing(self) -> None:
        HttpToolsProtocol.pause_writing(self)
        conns = self._conns
        if conns is not None and self._stalled is None:
            self._stalled = self.loop.call_later(
                conns.limits.write_timeout_s, self._write_timed_out
            )

    def resume_writing(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None
        HttpToolsProtocol.resume_writing(self)

    def _write_timed_out(self) -> None:
        self._stalled = None
        conns = self._conns
        transport = self.transport
        if conns is None or transport is None:
            return
        conns.refused["write_timeout"] += 1
        log.warning(
            "connection from %s closed: it read nothing of its response for %g s "
            "(server.write_timeout_s)",
            _address(self.client),
            conns.limits.write_timeout_s,
        )
        # abort, not close: close() would wait to flush the buffer the client is not reading.
        transport.abort()

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        self._chunk = len(data)
        self._clean = self._phase != _BODY  # what this read starts with is a head's
        if not self._feed(data):
            return
        conns = self._conns
        if conns is not None and self._phase == _HEAD:  # the read ended within a head
            if self._clean:  # all of it is this head's
                self._head_bytes += len(data)
            else:  # the head began after a request (or a body) in the same read
                self._head_bytes = _partial_head_size(self.url, self.headers, data)
            limit = conns.limits.max_header_bytes
            if self._head_bytes > limit and not self.transport.is_closing():
                self._refuse(*_head_too_large(limit))

    def _feed(self, data: bytes) -> bool:
        """Parse `data`: False when the connection was refused. A head asking to upgrade
        stops the parser (the bytes after it are not parsed): the head is parsed again without
        its upgrade, then the bytes after it, without copying them (a memoryview)."""
        pending: list[Any] = [data]
        while pending:
            buffer = pending.pop()
            try:
                self.parser.feed_data(buffer)
            except httptools.HttpParserUpgrade as stop:
                rest = memoryview(buffer)[stop.args[0] if stop.args else len(buffer) :]
                if rest:
                    pending.append(rest)
                pending.append(self._without_upgrade())
            except httptools.HttpParserError:
                refusal = self._refusal or (400, "Invalid HTTP request received.", "bad_request")
                self._refuse(*refusal)
                return False
        return True

    # -- parser callbacks (once per request: the base class's named, not a super() object) --
    def on_message_begin(self) -> None:
        HttpToolsProtocol.on_message_begin(self)
        self.scope["extensions"] = self._extensions
        if self._phase != _HEAD:
            self._phase, self._since = _HEAD, self.loop.time()
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._clean = False  # what follows in this read is no part of the next head
        conns = self._conns
        if conns is not None:
            limits = conns.limits
            if len(self.headers) > limits.max_headers:
                self._refusal = (
                    431,
                    f"The request has {len(self.headers)} header fields; this proxy takes at "
                    f"most {limits.max_headers} (server.max_headers).",
                    "too_many_headers",
                )
                raise _Refused
            if self._head_bytes + self._chunk > limits.max_header_bytes:  # else it fits
                if _head_size(self.url, self.headers) > limits.max_header_bytes:
                    self._refusal = _head_too_large(limits.max_header_bytes)
                    raise _Refused
        if self.parser.should_upgrade():  # Upgrade with Connection: upgrade, or CONNECT
            if self.parser.get_method() == b"CONNECT":
                self._refusal = (400, "This proxy opens no tunnels (CONNECT).", "bad_request")
                raise _Refused
            # No request is started for this head: the parser stops after it, and it is
            # parsed again without its upgrade (_feed, _without_upgrade).
            self._upgrade_asked = True
            return
        if conns is not None:
            self._phase, self._since = _BODY, self.loop.time()
        HttpToolsProtocol.on_headers_complete(self)

    def on_message_complete(self) -> None:
        self._phase = _IDLE
        if self._upgrade_asked:
            return
        HttpToolsProtocol.on_message_complete(self)

    def _should_upgrade(self) -> bool:
        return False  # never handed to a WebSocket protocol (see _without_upgrade)

    def _without_upgrade(self) -> bytes:
        """The head of a request that asks to switch protocols (`Upgrade: h2c` from `curl
        --http2`, a WebSocket handshake), without its upgrade: this proxy speaks neither, and
        a server may ignore Upgrade (RFC 9110 section 7.8), so the request is answered over
        HTTP/1.1 as if it had not asked (its body read, the connection kept). The Upgrade and
        HTTP2-Settings fields go, and the `upgrade` token of Connection."""
        self._upgrade_asked = False
        parser = self.parser
        head = [parser.get_method(), b" ", self.url, b" HTTP/"]
        head += [parser.get_http_version().encode(), b"\r\n"]
        for name, value in self.headers:
            if name == b"connection":
                kept = [t for t in value.split(b",") if t.strip().lower() not in _UPGRADE_TOKENS]
                value = b",".join(kept).strip()
                if value:
                    head += [name, b": ", value, b"\r\n"]
            elif name not in _UPGRADE_TOKENS:
                head += [name, b": ", value, b"\r\n"]
        head.append(b"\r\n")
        log.debug("request from %s asked to upgrade; answered over HTTP/1.1", _address(self.client))
        return b"".join(head)

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, msg, "bad_request")

    # -- refusing --------------------------------------------------------------------------
    def expire(self, now: float) -> None:
        """Called by the sweep: close the connection if its head or body is overdue."""
        conns = self._conns
        if conns is None or self.transport is None or self.transport.is_closing():
            return
        limits = conns.limits
        if self._phase == _HEAD and now - self._since > limits.header_timeout_s:
            if self._head_bytes == 0:  # not a byte of a request: an idle connection
                conns.refused["idle_timeout"] += 1
                self._phase = _IDLE
                self.transport.close()
                return
            self._refuse(
                408,
                f"The request head was not complete within {limits.header_timeout_s:g} s "
                "(server.header_timeout_s).",
                "header_timeout",
            )
        elif self._phase == _BODY and now - self._since > limits.body_timeout_s:
            self._refuse(
                408,
                f"The request body was not complete within {limits.body_timeout_s:g} s "
                "(server.body_timeout_s).",
                "body_timeout",
            )

    def _refuse(self, status: int, message: str, reason: str) -> None:
        """Answer `status` and close the connection: at once, or after the answers still
        owed to earlier requests; never a second answer to a request."""
        current = self._phase == _BODY  # self.cycle is this request's (not the one before)
        self._phase = _IDLE
        self._refusal = None
        if self._conns is not None:
            self._conns.refused[reason] = self._conns.refused.get(reason, 0) + 1
        # Every answer carries a request id, the refusals made before the app saw a request
        # too: the client's, when its head got that far, or a new one to quote in a report.
        request_id = request_id_of(self.headers)
        log.debug(
            "request %s from %s refused: %s (%d)",
            request_id,
            _address(self.client),
            reason,
            status,
        )
        transport = self.transport
        if transport.is_closing():
            return
        cycle = self.cycle
        if not current and cycle is not None and not cycle.response_complete:
            # A request before this head (pipelined) is still being answered: the refusal is
            # the next answer, sent once that one is complete (on_response_complete), and
            # nothing more is read or parsed meanwhile.
            self._deferred = _refusal_response(status, message, reason, request_id)
            self.parser = cast(Any, _DISCARD)
            self.flow.pause_reading()
            return
        if cycle is not None and not cycle.response_complete:
            # The app is working on this request: it now sees a disconnect, and what it
            # still sends is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        if current and cycle is not None and (cycle.response_started or self.pipeline):
            # Answered (or being answered) early: a 404, a 413, /health; or waiting behind the
            # answer to an earlier request. An answer now would be a second one to this
            # request, or be taken for the earlier one's: its unfinished body just ends the
            # connection.
            log.info(
                "request %s from %s %s and its body did not complete; connection closed (%s)",
                request_id,
                _address(self.client),
                "was already answered" if cycle.response_started else "waited its turn",
                reason,
            )
            transport.close()
            return
        transport.write(_refusal_response(status, message, reason, request_id))
        transport.close()

    def on_response_complete(self) -> None:
        HttpToolsProtocol.on_response_complete(self)
        deferred = self._deferred
        if deferred is not None and self.cycle.response_complete:  # every earlier one sent
            self._deferred = None
            self._unset_keepalive_if_required()
            if not self.transport.is_closing():
                self.transport.write(deferred)
                self.transport.close()


class _Discard:
    """The parser of a connection whose refusal waits for the answers before it: what the
    connection still reads is not parsed."""

    @staticmethod
    def feed_data(data: Any) -> None:
        return None


_DISCARD = _Discard()


def _refusal_response(status: int, message: str, reason: str, request_id: str) -> bytes:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = error_body(message, kind, None, reason)
    return (
        STATUS_LINE[status]
        + b"content-type: application/json\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\nx-request-id: "
        + request_id.encode()
        + b"\r\nconnection: close\r\n\r\n"
        + body
    )


def _address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown address"


_UPGRADE_TOKENS = frozenset((b"upgrade", b"http2-settings"))


def _head_size(url: bytes, headers: list[tuple[bytes, bytes]]) -> int:
    """The bytes of a parsed head (request target and fields), as the limit counts them."""
    return max(1, len(url) + sum(len(n) + len(v) + 4 for n, v in headers))


def _partial_head_size(url: bytes, headers: list[tuple[bytes, bytes]], data: bytes) -> int:
    """The bytes of a head that began in `data` after other requests (or a body) and is not
    complete at its end: the target and fields parsed so far, and the line still arriving
    (what follows the last line break, once one of this head's lines has ended there), which
    the parser reports only once it is complete. What came before the head is not counted."""
    size = _head_size(url, headers) + 16  # the method and version around the target
    end = data.rfind(b"\r\n")
    if end >= 0 and (headers or data.startswith(b" HTTP/", end - 9)):  # a line of this head
        size += len(data) - end - 2
    return size


def _head_too_large(limit: int) -> tuple[int, str, str]:
    return (
        431,
        f"The request head (request line and headers) exceeds this proxy's limit of {limit} "
        "bytes (server.max_header_bytes).",
        "header_too_large",
    )


def _arm_sweep(loop: asyncio.AbstractEventLoop, server_state: Any, conns: Connections) -> None:
    """One deadline check per server every tick while it has connections."""
    if getattr(server_state, "_warmroute_sweep", None) is None:
        handle = loop.call_later(conns.limits.tick_s, _sweep, loop, server_state, conns)
        server_state._warmroute_sweep = handle


def _sweep(loop: asyncio.AbstractEventLoop, server_state: Any, conns: Connections) -> None:
    now = loop.time()
    for protocol in list(server_state.connections):
        expire = getattr(protocol, "expire", None)
        if expire is not None and protocol._phase != _IDLE:
            expire(now)
    server_state._warmroute_sweep = None
    if server_state.connections:
        _arm_sweep(loop, server_state, conns)
