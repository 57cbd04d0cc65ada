"""The raw-ASGI pieces every streaming endpoint in warmroute needs, written once.

The proxy's forwarder and edge, the simulated engine (proxy/sim/server.py), the mock backend
(proxy/bench/mock/) and the tests' servers are raw ASGI callables (docs/architecture.md says
why): they read a request body within a limit, answer JSON or stream server-sent events, and
watch for the client leaving. The ASGI types are starlette's. A leaf module: of the proxy it
imports only the SSE framing (proxy/sse.py), so the simulator and the bench may use it and
stay on their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from http import HTTPStatus
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.sse import SSE_DONE, sse

__all__ = [
    "DISCONNECT_HOOK",
    "JSON",
    "SSE",
    "SSE_DONE",
    "ASGIApp",
    "BodyTooLarge",
    "ClientDisconnected",
    "Headers",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "Watch",
    "body_part",
    "body_writer",
    "disconnect_watch",
    "end_stream",
    "header",
    "headers_of",
    "read_body",
    "respond",
    "send_json",
    "serve_lifespan",
    "sse",
    "start_stream",
    "stream_chunk",
    "stream_head",
    "watch_disconnect",
]

Headers = Iterable[tuple[bytes, bytes]]
# `watch(callback)`: call `callback()` once if the client leaves before its response ends;
# returns the function that stops watching (disconnect_watch)
Watch = Callable[[Callable[[], object]], Callable[[], object]]
# The scope extension a server offers it under ({"watch": Watch}): warmroute's HTTP protocol
# (proxy/edge/limits.py)
DISCONNECT_HOOK = "warmroute.disconnect"

JSON = b"application/json"
SSE = ((b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"))


class BodyTooLarge(Exception):
    """The request body is over the limit: by its Content-Length, or by what arrived."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"request body of {size} bytes is over the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class ClientDisconnected(Exception):
    """The client left (http.disconnect) while its request was being read."""


# -- request ----------------------------------------------------------------------------------
def headers_of(scope: Scope) -> dict[str, str]:
    """The request headers by lower-case name (a repeated header: the last one)."""
    # A loop, not a comprehension: one Python frame fewer per request on the proxy's path.
    out: dict[str, str] = {}
    for k, v in scope["headers"]:
        out[k.decode("latin-1").lower()] = v.decode("latin-1")
    return out


def header(scope: Scope, name: bytes) -> str | None:
    """One request header by its lower-case name, without building the whole dict."""
    for k, v in scope.get("headers", ()):
        if k == name:
            return str(v.decode("latin-1"))
    return None


async def read_body(
    receive: Receive, limit: int | None = None, declared: str | None = None
) -> bytes:
    """The whole request body.

    `declared` is the Content-Length header, if any: a body it says is over `limit` is refused
    before a byte of it is read. Raises BodyTooLarge over `limit` (None: no limit) and
    ClientDisconnected when the client leaves before the body's end.
    """
    if limit is not None and declared is not None and declared.isdigit():
        size = int(declared)
        if size > limit:
            raise BodyTooLarge(size, limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise BodyTooLarge(size, limit)
        parts.append(chunk)
        if not message.get("more_body", False):
            break
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def watch_disconnect(receive: Receive, on_disconnect: Callable[[], object]) -> None:
    """Await the client's http.disconnect, then call `on_disconnect()` once and return.

    Run as a task beside the response once the body is read: `send()` does not report a
    departed client on uvicorn's servers, so without it an upstream or an engine would go on
    working for no one. Cancel the task when the response is done.
    """
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


def disconnect_watch(scope: Scope, receive: Receive) -> Watch:
    """How this request learns that its client left (a `Watch`): the server's own hook where
    it offers one (the DISCONNECT_HOOK extension: warmroute's protocol calls back from the
    connection's loss, no task per request), else a task running `watch_disconnect`."""
    extensions = scope.get("extensions")
    if extensions:
        hook = extensions.get(DISCONNECT_HOOK)
        if hook is not None:
            watch: Watch = hook["watch"]
            return watch

    def by_task(callback: Callable[[], object]) -> Callable[[], object]:
        task = asyncio.get_running_loop().create_task(watch_disconnect(receive, callback))
        return task.cancel

    return by_task


# -- response ---------------------------------------------------------------------------------
async def respond(
    send: Send, status: int, body: bytes, content_type: bytes = JSON, headers: Headers = ()
) -> None:
    """A whole response with its Content-Length."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, obj: Any, headers: Headers = ()) -> None:
    await respond(send, status, orjson.dumps(obj), JSON, headers)


async def start_stream(send: Send, status: int = 200, headers: Headers = SSE) -> None:
    """The head of a streamed response (server-sent events unless `headers` say otherwise)."""
    await send({"type": "http.response.start", "status": status, "headers": list(headers)})


async def stream_chunk(send: Send, data: bytes) -> None:
    """Part of a streamed body; more follows."""
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def end_stream(send: Send, data: bytes = b"") -> None:
    """The last part of a streamed body."""
    await send({"type": "http.response.body", "body": data, "more_body": False})


# The chunk-size lines of HTTP/1.1 chunked framing, made once for the sizes a streamed read has.
_CHUNK_SIZE = [b"%x\r\n" % n for n in range(2048)]
_UVICORN_HTTPTOOLS = "uvicorn.protocols.http.httptools_impl"


def _status_line(code: int) -> bytes:
    try:
        phrase = HTTPStatus(code).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %b\r\n" % (code, phrase)


# Status lines 200-599, as uvicorn writes them
_STATUS_LINES = [_status_line(code) for code in range(200, 600)]
# The header fields whose values uvicorn's `send` reads: stream_head leaves a head with one to it
_FRAMING = (b"content-length", b"transfer-encoding", b"connection")
# The control bytes: uvicorn refuses each of them in a header but the tab
_CONTROL = bytes([*range(0x09), *range(0x0A, 0x20), 0x7F])


def stream_head(send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> bool:
    """Write the head of a streamed (chunked) response at once, for `send` of a response
    not started; False where it cannot, having written and changed nothing: the caller sends
    http.response.start through `send` then.

    uvicorn's `send` of the start message is a coroutine that checks each header with two
    regular expressions and builds the head in the interpreter (several thousand
    instructions a request: docs/hot-path.md, round 12). This writes the same bytes (its date
    and server headers, the fields, its transfer-encoding and, where the connection closes
    after this response, connection: close) and leaves the connection's state as `send`
    would. It checks the whole head once: a line end or control byte where uvicorn's checks
    would refuse one leaves the start to `send` (which raises, as it always did). Heads with
    framing fields of their own, HEAD requests, statuses without a body, an access log to
    write, writing paused or the client gone are all `send`'s. Only uvicorn's httptools
    protocol is known (as body_writer).
    """
    cycle: Any = getattr(send, "__self__", None)
    if (
        type(cycle).__module__ != _UVICORN_HTTPTOOLS
        or status < 200
        or status >= 600
        or status == 204
        or status == 304
        or cycle.response_started
        or cycle.disconnected
        or cycle.flow.write_paused
        or cycle.access_log
        or cycle.chunked_encoding is not None
        or cycle.scope.get("method") == "HEAD"
    ):
        return False
    parts = [_STATUS_LINES[status - 200]]
    lines = 3  # the status line, transfer-encoding and the blank line
    for fields in (cycle.default_headers, headers):
        for name, value in fields:
            name = name.lower()
            if name in _FRAMING:
                return False
            parts.extend((name, b": ", value, b"\r\n"))
            lines += 1
    if not cycle.keep_alive:
        parts.append(b"connection: close\r\n")
        lines += 1
    parts.append(b"transfer-encoding: chunked\r\n\r\n")
    head = b"".join(parts)
    # Each line's CR LF are the only control bytes a head send would write may hold (one C
    # pass; a regular expression's search costs ten times as much)
    if len(head) - len(head.translate(None, _CONTROL)) != 2 * lines:
        return False
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    cycle.chunked_encoding = True
    cycle.transport.write(head)
    return True


def _chunked_body(send: Send) -> Any:
    """The uvicorn httptools cycle behind `send` while its response's chunked body is open
    (the head out, the end not); None otherwise, for a HEAD request (no body) and for any
    other server's `send`."""
    cycle: Any = getattr(send, "__self__", None)
    if (
        type(cycle).__module__ != _UVICORN_HTTPTOOLS
        or not cycle.response_started
        or cycle.response_complete
        or cycle.chunked_encoding is not True
        or cycle.scope.get("method") == "HEAD"
    ):
        return None
    return cycle


def body_part(send: Send, body: bytes, more: bool) -> bool:
    """Write a streamed (chunked) body's part, and with `more` False its end, as `send` of
    http.response.body would, for a response whose head has gone out; False where it cannot,
    having written and changed nothing: the caller sends the part through `send` then.

    Per part, `send` is a coroutine that checks the response's state and frames the part in
    the interpreter; a stream's first part and its end go through here (the parts between
    through body_writer). The end is `send`'s: the chunked body's last chunk, the response
    complete, its event set, the connection closed where it does not stay open, the protocol
    told. Writing paused (the client reads slowly) and the client gone are `send`'s too: it
    waits for the one and drops the part for the other.
    """
    cycle = _chunked_body(send)
    if cycle is None or cycle.disconnected or cycle.flow.write_paused:
        return False
    n = len(body)
    size = (_CHUNK_SIZE[n] if n < 2048 else b"%x\r\n" % n) if n else b""
    if more:
        cycle.transport.write(b"".join((size, body, b"\r\n")) if n else b"")
        return True
    cycle.transport.write(b"".join((size, body, b"\r\n0\r\n\r\n")) if n else b"0\r\n\r\n")
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()
    return True


def body_writer(send: Send) -> Callable[[bytes], bool] | None:
    """A synchronous writer of a streamed body's next part, straight to the client's
    connection, for `send` of a response whose head has gone out; None where there is none.

    Per part, uvicorn's `send` is a coroutine that checks the response's state, formats the
    chunk-size line and writes (~4,000 interpreter instructions); what it checks cannot change
    between two parts of a chunked body, so the writer keeps only the checks that can: writing
    paused (the client reads slowly) and the client gone. It returns False then, having written
    nothing, and the caller sends the part through `send`, which waits or drops it as it
    always does. A stream's first part and its end are body_part's (or `send`'s). Only
    uvicorn's httptools protocol is known here: any other server's `send` gets None, and every
    part goes through it.
    """
    cycle = _chunked_body(send)
    if cycle is None:
        return None
    transport = cycle.transport
    # A wrapper that holds the head until its first body bytes (proxy/server/serve.py) says
    # when they have gone out; then the connection's own transport writes the rest.
    write = getattr(transport, "direct_write", None) or transport.write
    flow = cycle.flow
    sizes, join, crlf = _CHUNK_SIZE, b"".join, b"\r\n"

    def write_part(body: bytes) -> bool:
        if flow.write_paused or cycle.disconnected:
            return False
        n = len(body)
        if n:
            write(join((sizes[n] if n < 2048 else b"%x\r\n" % n, body, crlf)))
        return True

    return write_part


# -- lifespan ---------------------------------------------------------------------------------
async def serve_lifespan(
    receive: Receive,
    send: Send,
    startup: Callable[[], Awaitable[None]] | None = None,
    shutdown: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Answer an ASGI lifespan scope, running `startup` and `shutdown` if given."""
    while True:
        message: Message = await receive()
        if message["type"] == "lifespan.startup":
            if startup is not None:
                await startup()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if shutdown is not None:
                await shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return
