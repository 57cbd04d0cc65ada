"""One keep-alive HTTP/1.1 connection to a backend and the response it carries.

The connection is an asyncio protocol fed to httptools (llhttp): it buffers body bytes as they
arrive and hands the reader whatever is buffered at once (whole reads, not one piece per HTTP
chunk), keeps the read deadline (below), pauses reading past HIGH_WATER unread bytes, and turns
every way a response can fail into a typed error (below; the classes are in
proxy/upstream/errors.py). The pool that opens, reuses and caps these connections is
proxy/upstream/pool.py. Compiled with mypyc where the install could (proxy.HOT_PATH).

Size: the connection and the response reading it share their private state (buffer, parser,
deadline, budget share), which one module keeps private; the pool is proxy/upstream/pool.py.

Timeouts measure progress, not silence: the read deadline is a point in time that only
progress moves, never a byte as such (a backend trickling a byte every second, or a 100
Continue, must not hold a client for ever). One monotonic deadline, checked by one timer that
is re-armed lazily (_on_timer), so moving it costs a clock read and a store, off the per-byte
path altogether:
- First byte: the request is sent -> its first body byte within timeouts.first_byte_s. The
  response head, and any number of interim 1xx heads before it, do not move the deadline:
  they must all arrive within it too.
- Streamed body (the relay): from its first byte, the next complete SSE event (a read that
  completes one, `\n\n`-terminated) within timeouts.idle_s, then the next, and so on; bytes
  of an event that has not ended yet do not count (`set_read_timeout` is the relay's
  "progress").
- Whole body (read(), non-streamed): the rest of the body within timeouts.idle_s of its first
  byte, however it arrives (a deadline for the whole body, not per read). An answer that is
  not a stream is of no use until it is whole, and at the limit (max_response_bytes, 64 MiB)
  idle_s's default of 60 s asks ~1 MiB/s of a backend. So a response the backend starts is
  over within first_byte_s + idle_s, whatever it sends.
- The deadline passing while unread body bytes wait in the buffer is the reader's delay (a
  slow client blocks the relay's writes), not the backend's: judged again one read timeout
  later.

Errors, typed so the retry policy (proxy/forwarding/retry.py) can tell them apart:
- UpstreamConnectError: the backend did not take the connection (refused, unreachable, DNS);
  the request was never sent. UpstreamConnectTimeout (a subclass): no connection within
  connect_s.
- UpstreamDisconnected: a connection closed before any response byte; `reused` says whether
  it was a pooled connection (the keep-alive race: the server had just closed it, which says
  nothing about the backend) or a new one.
- UpstreamProtocolError: the response was not valid HTTP/1.1 (a garbled or partial head).
  UpstreamHeadTooLarge (a subclass): a head past MAX_HEAD_BYTES or MAX_HEADERS.
- UpstreamPayloadError: the response broke off after it started.
- UpstreamResponseTooLarge: a whole body (read()) past the response's limit
  (upstream.max_response_bytes), or a Content-Length that says it will be; the connection is
  closed at once, the rest never read. UpstreamOverBudget (a subclass): a whole body that
  would take the bytes all whole bodies hold at once past the proxy's budget (BodyBudget).
- UpstreamTimeout (a TimeoutError): the read deadline passed (above).
  UpstreamFirstByteTimeout: no response head and first body byte within the first-byte
  budget; UpstreamIdleTimeout: no progress within the idle budget, once the reader switched
  to it at the first body byte (`idle_budget`).

Trailers of a chunked response are never merged into its headers (llhttp reports them after
the body; they are dropped).

A backend chooses the size of what it sends, so what the proxy holds of it is bounded: the
response head (MAX_HEAD_BYTES in at most MAX_HEADERS fields, 1xx heads before it included,
measured when it is complete; and the bytes received while it is incomplete, which llhttp
would otherwise keep joining, checked per read; trailers count towards it), unread body bytes
(HIGH_WATER, then reading pauses), and a whole body read with read() (the response's
`max_body`). A stream read with readany() is bounded per event by the relay's meter.

One limit per answer still lets a few large answers at once take the process past its
container's memory limit (each costs about twice its size while it is joined), so the whole
bodies being read or relayed at once share a BodyBudget (upstream.max_buffered_bytes): each
body's first FREE_BYTES are outside it (ordinary answers never wait on large ones), the rest
is taken from it as it arrives (a Content-Length's worth at once when the head announces it)
and given back when the response is released, once its bytes were handed to the client's
connection. A body
that cannot take what it needs fails at once (UpstreamOverBudget; no waiting, so two large
bodies can never hold each other's share), and the relay answers 503 with a Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Protocol

import httptools

from proxy.upstream.errors import (
    UpstreamDisconnected,
    UpstreamFirstByteTimeout,
    UpstreamHeadTooLarge,
    UpstreamIdleTimeout,
    UpstreamOverBudget,
    UpstreamPayloadError,
    UpstreamProtocolError,
    UpstreamResponseTooLarge,
    UpstreamTimeout,
)

# Pause reading a response once this much is buffered and unread (a slow client).
HIGH_WATER = 1 << 20
# The most of a response head the proxy takes: its bytes (status line, fields, blank line;
# interim 1xx heads before it included) and its fields. Envoy's defaults are 60 KiB and 100
# headers; engines send under 1 KiB. Not settings: no legitimate backend comes near them.
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100
# The default most bytes of a whole (non-streamed) body (UpstreamConfig.max_response_bytes).
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
# The default most bytes all whole bodies hold at once beyond their first FREE_BYTES each
# (UpstreamConfig.max_buffered_bytes): four answers at the limit.
MAX_BUFFERED_BYTES = 256 * 1024 * 1024
FREE_BYTES = 1 << 20


RETRY_AFTER_MAX_S = 60.0  # a Retry-After past this is read as this (a backend, the API server)


def retry_after_s(value: str | None) -> float:
    """A Retry-After header's delay in seconds (delta-seconds; an HTTP date or junk: 0)."""
    try:
        return min(RETRY_AFTER_MAX_S, max(0.0, float(value))) if value else 0.0
    except ValueError:
        return 0.0


class BodyBudget:
    """The bytes whole bodies may hold at once beyond their first FREE_BYTES each (pure)."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int = MAX_BUFFERED_BYTES) -> None:
        self.limit = limit
        self.held = 0  # taken and not given back

    def take(self, n: int) -> bool:
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n


class Pool(Protocol):
    """Where a finished response's connection goes: back to the idle set, or forgotten."""

    def keep(self, conn: Connection) -> None: ...

    def forget(self, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One keep-alive connection; carries one response at a time."""

    __slots__ = (
        "_buffer",
        "_buffered",
        "_deadline",
        "_due",
        "_eof",
        "_head_bytes",
        "_head_seen",
        "_headers",
        "_keep_alive",
        "_length",
        "_paused",
        "_received",
        "_sink",
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
        "timeout_error",
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
        self._due = 0.0  # when the timer fires (it may fire before the deadline, never after)
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
        # What the read deadline means: the first-byte budget until the reader switches.
        self.timeout_error: type[UpstreamTimeout] = UpstreamFirstByteTimeout
        self._waiter: asyncio.Future[None] | None = None
        # The reader's synchronous step for a read while it waits (UpstreamResponse.push_to)
        self._sink: Callable[[bytes], bool] | None = None
        self._received = False
        self._until_eof = False
        self._keep_alive = False
        self._paused = False
        self._deadline = 0.0  # the read deadline (loop time): moved only by progress
        self._length = -1  # the response's Content-Length; -1: none
        self._head_seen = 0  # bytes received while its head was incomplete (1xx heads too)
        self._head_bytes = 0  # its 1xx heads', its reason phrase's and its trailers' sizes

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self._received = True  # no clock here: a byte is not progress (the module's docstring)
        if not self.headers_done:
            self._head_received(data)
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamProtocolError(f"invalid HTTP response: {e}"))
            self.abort()
            return
        if self._sink is not None and self._buffer:
            self._push(self._sink)

    def _push(self, sink: Callable[[bytes], bool]) -> None:
        """Body bytes arrived while a sink is set: handed to it here, in this callback, while
        the reader waits for them and nothing else has happened to the response (its waiter
        neither woken nor cancelled: no end, no error, no cut). What it declines is buffered
        and the reader woken, as without a sink."""
        w = self._waiter
        if w is None or w.done():
            return  # the reader is busy, or already woken: it reads them, in order
        buf = self._buffer
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        self._buffer = []
        self._buffered = 0
        try:
            taken = sink(data)
        except Exception as e:  # the reader's own error, raised where it reads
            self._sink = None
            self._fail(e)
            return
        if not taken:
            self._buffer = [data]
            self._buffered = len(data)
            self._wake()
        elif self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def _head_received(self, data: bytes) -> None:
        """A read while the head is incomplete (off the per-chunk path): bounded here, since
        llhttp keeps joining a header's pieces until the field ends."""
        self._head_seen += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            # A head over its bounds fails in on_headers_complete: that error is kept.
            self._fail(UpstreamProtocolError(f"invalid HTTP response: {e}"))
            self.abort()
            return
        if not self.headers_done and self._head_seen > MAX_HEAD_BYTES and not self.closed:
            self._fail(
                UpstreamHeadTooLarge(
                    f"the response head was still incomplete after {self._head_seen} bytes "
                    f"(the most this proxy reads of one is {MAX_HEAD_BYTES})"
                )
            )
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
    def on_status(self, reason: bytes) -> None:
        self._head_bytes += len(reason)  # the reason phrase (maybe in pieces): the head's size

    def on_header(self, name: bytes, value: bytes) -> None:
        # llhttp reports trailers here too, after the body; when the whole response came in
        # one read they would land in the headers before the response object takes them.
        # Names are lowered here, once: the head's own loop and every reader compare them so.
        if not self.headers_done:
            self._headers.append((name.lower(), value))
        else:  # a trailer: dropped, and counted towards the head's bound
            self._head_bytes += len(name) + len(value) + 4
            if self._head_bytes > MAX_HEAD_BYTES:
                raise self._head_too_large(f"{self._head_bytes} bytes with its trailers")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        headers = self._headers
        # The bytes received so far bound the head's: only past the limit is it measured.
        if self._head_seen > MAX_HEAD_BYTES or len(headers) > MAX_HEADERS:
            self._check_head(headers)
        if 100 <= status < 200:  # interim response: wait for the real one
            self._head_bytes += _head_size(headers)  # counted towards the final head
            self._headers = []
            return
        self.headers_done = True
        chunked = length = False
        for k, v in headers:
            if k == b"content-length":
                length = True
                try:
                    self._length = int(v)
                except ValueError:  # llhttp has checked its digits
                    pass
            elif k == b"transfer-encoding" and v.lower().find(b"chunked") >= 0:
                chunked = True
        self._until_eof = not (length or chunked) and status not in (204, 304)
        self._wake()

    def _check_head(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Raise (in llhttp's callback, which stops the parse) for a head past its bounds."""
        if len(headers) > MAX_HEADERS:
            raise self._head_too_large(f"{len(headers)} header fields")
        size = self._head_bytes + _head_size(headers)
        if size > MAX_HEAD_BYTES:
            raise self._head_too_large(f"{size} bytes")

    def on_body(self, body: bytes) -> None:
        self._buffer.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        w = self._waiter  # _wake(), written out: this runs once per body piece
        if w is not None and self._sink is None:  # with a sink: data_received hands it over
            self._waiter = None
            if not w.done():
                w.set_result(None)

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

    def _head_too_large(self, what: str) -> UpstreamHeadTooLarge:
        """The error for a head past its bounds, kept as the connection's error; the caller
        raises it in llhttp's callback, which stops the parse (data_received then aborts)."""
        exc = UpstreamHeadTooLarge(
            f"the response head has {what} (the most this proxy takes is {MAX_HEAD_BYTES} "
            f"bytes in at most {MAX_HEADERS} fields)"
        )
        self._fail(exc)
        return exc

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
        """Set the read deadline read_timeout from now (progress, or the request just sent)."""
        self._deadline = deadline = self.loop.time() + self.read_timeout
        if self._timer is None or self._due > deadline:
            self._schedule(deadline)

    def _schedule(self, when: float) -> None:
        """The timer at `when` (one timer: a later deadline is left to _on_timer)."""
        if self._eof or self.error is not None or self.closed:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._due = when
        self._timer = self.loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._eof or self.error is not None or self.closed:
            return
        now = self.loop.time()
        if now < self._deadline:  # progress moved it since: wait the rest
            self._schedule(self._deadline)
            return
        if self._buffer:  # unread body bytes: the reader is behind, not the backend
            self._schedule(now + self.read_timeout)
            return
        self._fail(self.timeout_error(f"no progress within {self.read_timeout:g}s"))

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


def _head_size(headers: list[tuple[bytes, bytes]]) -> int:
    """A head's bytes but for its reason phrase: "HTTP/1.1 200 " and CRLF, each field
    "name: value" and CRLF, the blank line."""
    return 17 + sum([len(k) + len(v) + 4 for k, v in headers])


class UpstreamResponse:
    """The response to one upstream request; read it with readany() / read()."""

    __slots__ = (
        "_budget",
        "_conn",
        "_held",
        "_pool",
        "_released",
        "body_s",
        "headers",
        "max_body",
        "reused",
        "status",
    )

    def __init__(
        self,
        conn: Connection,
        pool: Pool,
        max_body: int = MAX_RESPONSE_BYTES,
        body_s: float = 0.0,
        budget: BodyBudget | None = None,
    ) -> None:
        self._conn = conn
        self._pool = pool
        self._released = False
        self._budget = budget  # shared by every whole body read at once (None: no budget)
        self._held = 0  # what this body took of it
        self.max_body = max_body  # the most read() takes of a whole body
        # read(): the rest of a body is due this long after its first byte (timeouts.idle_s);
        # 0: the deadline it has (the first-byte one) holds for the whole body
        self.body_s = body_s
        self.reused = conn.reused  # a pooled connection (not opened for this request)
        self.status: int = conn.parser.get_status_code()
        # (lower-case name, value) as bytes, in the order the backend sent them; the
        # connection's own list (its next response starts a new one: reset())
        self.headers: list[tuple[bytes, bytes]] = conn._headers

    async def readany(self) -> bytes:
        """Whatever body bytes are buffered (waiting for some); b"" at the end of the body.

        The relay's per-read call: the wait (Connection.wait) and the common take are
        written out here, one coroutine frame and two calls fewer per read."""
        c = self._conn
        while True:
            buf = c._buffer
            if buf:
                if len(buf) != 1 or c._paused:
                    return c._take()
                c._buffer = []
                c._buffered = 0
                return buf[0]
            if c.error is not None:
                raise c.error
            if c._eof:
                return b""
            c._waiter = w = c.loop.create_future()
            try:
                await w
            finally:
                c._waiter = None

    def at_end(self) -> bool:
        """The body has ended and every byte of it was read: the next readany() returns b"".
        (The relay sends a stream's last bytes and its end in one write when they came in
        one read.)"""
        c = self._conn
        return c._eof and not c._buffer and c.error is None

    async def read(self, limit: int = -1) -> bytes:
        """The whole body (or its first `limit` bytes, waiting no longer than needed).

        The rest of the body is due within `body_s` of its first byte (the module's docstring).
        A whole body is at most `max_body` bytes: past it, or when its Content-Length says it
        will be (before reading any of it), UpstreamResponseTooLarge, and the connection is
        closed (the rest is never read; the pool does not get it back)."""
        c = self._conn
        cap = self.max_body
        if limit < 0 and c._length > cap:
            raise self._too_large(f"announces {c._length} bytes (content-length), more than")
        whole = limit < 0 and self._budget is not None
        if whole and c._length > FREE_BYTES:  # announced: its share at once, before any byte
            self._reserve(c._length)
        parts: list[bytes] = []
        size = 0
        try:
            while limit < 0 or size < limit:
                data = await self.readany()
                if not data:
                    break
                if not parts and self.body_s:  # its first byte: the whole body's deadline
                    self.idle_budget(self.body_s)
                parts.append(data)
                size += len(data)
                if limit < 0 and size > cap:
                    raise self._too_large("is longer than")
                if whole and size - FREE_BYTES > self._held:
                    self._reserve(size)
        except BaseException:
            # The error is kept on the connection (c.error) and its traceback holds this frame:
            # a cycle (error -> frame -> self -> connection -> error) that only the cyclic GC
            # frees, often generations later. What was read must not wait for it with them:
            # up to max_response_bytes per failed answer (measured: 8 answers past the limit
            # at once left 690 MB in the process).
            parts.clear()
            raise
        body = b"".join(parts)
        if 0 <= limit < len(body):
            c._buffer.insert(0, body[limit:])
            body = body[:limit]
        return body

    def _reserve(self, size: int) -> None:
        """Take from the budget what a body of `size` bytes holds beyond its free share; when
        the budget has not got it, fail the response (UpstreamOverBudget)."""
        budget = self._budget
        assert budget is not None
        need = size - FREE_BYTES - self._held
        if budget.take(need):
            self._held += need
            return
        exc = UpstreamOverBudget(
            f"the whole answers being read at once hold {budget.held} of the "
            f"{budget.limit} bytes this proxy buffers (upstream.max_buffered_bytes), and this "
            f"one needed {need} more",
            budget.limit,
        )
        c = self._conn
        c._fail(exc)
        c.abort()
        raise exc

    def _give_back(self) -> None:
        if self._held:
            assert self._budget is not None
            self._budget.give(self._held)
            self._held = 0

    def _too_large(self, what: str) -> UpstreamResponseTooLarge:
        exc = UpstreamResponseTooLarge(
            f"the response body {what} the most this proxy reads of one, {self.max_body} bytes "
            "(upstream.max_response_bytes)",
            self.max_body,
        )
        c = self._conn
        c._fail(exc)
        c.abort()
        return exc

    def idle_budget(self, seconds: float) -> None:
        """The first body byte arrived: from now the read deadline is the idle budget,
        `seconds` from each progress (set_read_timeout), and a timeout is an idle one."""
        self._conn.timeout_error = UpstreamIdleTimeout
        self.set_read_timeout(seconds)

    def set_read_timeout(self, seconds: float) -> None:
        """Progress: the read deadline moves to `seconds` from now. The relay switches from
        the first-byte budget to the idle budget with it at the first body byte, then calls it
        per read that completes an event. On the per-read path: a clock read and two stores;
        a new timer only when the deadline comes earlier than the timer (at the switch)."""
        c = self._conn
        c.read_timeout = seconds
        c._deadline = deadline = c.loop.time() + seconds
        if c._timer is None or c._due > deadline:
            c._schedule(deadline)

    def push_to(self, sink: Callable[[bytes], bool] | None) -> None:
        """While readany() waits, hand each read to `sink(data)` in the connection's own
        callback instead of waking the reader: True, it took the bytes (the reader goes on
        waiting); False, it took nothing, and readany() returns them. The end of the body, an
        error, a timeout and a cancelled read reach the reader as without a sink. None: no
        sink. The relay's per-read step for paced streams (proxy/forwarding/push.py): no
        future, wake-up and task step per read."""
        self._conn._sink = sink

    def close(self) -> None:
        """Drop the connection now (the client left): a pending read fails at once."""
        c = self._conn
        c._fail(UpstreamPayloadError("closed by the proxy"))
        c.abort()
        self._give_back()

    def release(self) -> None:
        """Done with the response: the connection goes back to the pool if it can be reused,
        and what its body took of the budget goes back to it."""
        self._give_back()
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
