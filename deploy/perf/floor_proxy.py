#!/usr/bin/env python3
"""The cheapest streaming proxy Python runs on warmroute's stack: the floor under any of them.

Not a proxy to deploy. It forwards a request's body to the next backend in turn over a
kept-alive connection and relays the answer's chunks as they come, and nothing else: no
validation, routing, telemetry, limits, timeouts, retries or error answers. What it spends per
request and per chunk is what CPython, uvloop and httptools cost for that much, and so the least
any Python proxy on them can spend; `paced_chunks.py` and `count-instructions.sh` run it beside
warmroute and the Rust routers (`PROXIES="floor-bare floor-asgi warmroute sglang-router"`).

  --server bare   an asyncio protocol over httptools' parsers: no HTTP server framework, no ASGI
                  (each chunk: one read, one parser callback, one write)
  --server asgi   an ASGI app under uvicorn with uvloop and httptools, as warmroute is served:
                  the same forwarding, plus uvicorn's request side and the ASGI cycle

  deploy/perf/floor_proxy.py --server bare --port 9300 \\
      --backend http://127.0.0.1:9101 --backend http://127.0.0.1:9102

GET /health answers 200 itself (the benchmarks' readiness check); every other request goes to
a backend. Client and backends must speak HTTP/1.1 with bodies of known length (the load
generator and the bench mock do); the answer is relayed with chunked framing, whatever the
backend used.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import signal
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

import httptools
import uvloop

HEALTH = b"/health"
_HEALTH_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
_END = b"0\r\n\r\n"
_REQUEST = b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"


class Sink(Protocol):
    """Where an upstream answer goes: a client connection (bare) or a request's queue (ASGI)."""

    def start(self, status: int, content_type: bytes) -> None: ...

    def part(self, data: bytes) -> None: ...

    def end(self) -> None: ...

    def lost(self) -> None: ...


class Upstream(asyncio.Protocol):
    """One kept-alive connection to a backend, carrying one exchange at a time."""

    def __init__(self, pool: Pool, backend: int) -> None:
        self.pool, self.backend = pool, backend
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.sink: Sink | None = None
        self.content_type = b"application/json"

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def send(self, head: bytes, body: bytes, sink: Sink) -> None:
        self.sink = sink
        assert self.transport is not None
        self.transport.write(head + body)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.content_type = value

    def on_headers_complete(self) -> None:
        if self.sink is not None:
            self.sink.start(self.parser.get_status_code(), self.content_type)

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            self.sink.part(body)

    def on_message_complete(self) -> None:
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.end()
        if self.parser.should_keep_alive():
            self.pool.idle[self.backend].append(self)
        elif self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        idle = self.pool.idle[self.backend]
        if self in idle:
            idle.remove(self)
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.lost()


class Pool:
    """Kept-alive connections to each backend, the backends taken in turn."""

    def __init__(self, backends: list[str]) -> None:
        self.addresses = []
        for url in backends:
            parts = urlsplit(url)
            self.addresses.append((parts.hostname or "127.0.0.1", parts.port or 80))
        self.idle: list[collections.deque[Upstream]] = [collections.deque() for _ in backends]
        self._turn = itertools.cycle(range(len(backends)))

    def forward(self, path: bytes, content_type: bytes, body: bytes, sink: Sink) -> None:
        """Send the request to the next backend; its answer goes to `sink`."""
        backend = next(self._turn)
        host, port = self.addresses[backend]
        head = _REQUEST % (path, host.encode(), port, content_type, len(body))
        idle = self.idle[backend]
        if idle:
            idle.pop().send(head, body, sink)
        else:
            asyncio.get_running_loop().create_task(self._connect(backend, head, body, sink))

    async def _connect(self, backend: int, head: bytes, body: bytes, sink: Sink) -> None:
        host, port = self.addresses[backend]
        try:
            _, conn = await asyncio.get_running_loop().create_connection(
                lambda: Upstream(self, backend), host, port
            )
        except OSError:
            sink.lost()
            return
        conn.send(head, body, sink)


class BareClient(asyncio.Protocol):
    """A client connection served straight from httptools' callbacks."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.content_type = b"application/json"
        self.body: list[bytes] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.body, self.content_type = b"", [], b"application/json"

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.content_type = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.url == HEALTH:
            assert self.transport is not None
            self.transport.write(_HEALTH_ANSWER)
            return
        self.pool.forward(self.url, self.content_type, b"".join(self.body), self)

    def start(self, status: int, content_type: bytes) -> None:
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n"
            % (status, content_type)
        )

    def part(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end(self) -> None:
        assert self.transport is not None
        self.transport.write(_END)
        if not self.parser.should_keep_alive():
            self.transport.close()

    def lost(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Exchange:
    """One ASGI request's answer: upstream events queued for the app's coroutine."""

    __slots__ = ("events", "waiter")

    def __init__(self) -> None:
        self.events: list[tuple[int, Any]] = []
        self.waiter: asyncio.Future[None] | None = None

    def _put(self, event: tuple[int, Any]) -> None:
        self.events.append(event)
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def start(self, status: int, content_type: bytes) -> None:
        self._put((0, (status, content_type)))

    def part(self, data: bytes) -> None:
        self._put((1, data))

    def end(self) -> None:
        self._put((2, None))

    def lost(self) -> None:
        self._put((3, None))


def asgi_app(pool: Pool) -> Callable[..., Any]:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        parts, more = [], True
        while more:
            message = await receive()
            parts.append(message.get("body", b""))
            more = message.get("more_body", False)
        content_type = b"application/json"
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value
        exchange = Exchange()
        pool.forward(scope["raw_path"], content_type, b"".join(parts), exchange)
        loop = asyncio.get_running_loop()
        while True:
            if not exchange.events:
                exchange.waiter = loop.create_future()
                await exchange.waiter
            events, exchange.events = exchange.events, []
            for kind, value in events:
                if kind == 0:
                    status, ctype = value
                    head = {"status": status, "headers": [(b"content-type", ctype)]}
                    await send({"type": "http.response.start", **head})
                elif kind == 1:
                    await send({"type": "http.response.body", "body": value, "more_body": True})
                elif kind == 2:
                    await send({"type": "http.response.body", "body": b""})
                    return
                else:
                    raise ConnectionError("the backend closed the connection")

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=("bare", "asgi"), default="bare")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9300)
    parser.add_argument("--backend", action="append", required=True, help="a backend's URL")
    args = parser.parse_args(argv)
    pool = Pool(args.backend)
    if args.server == "asgi":
        import uvicorn

        uvicorn.run(
            asgi_app(pool), host=args.host, port=args.port, loop="uvloop", http="httptools",
            lifespan="on", access_log=False, server_header=False, log_level="warning",
        )  # fmt: skip
        return

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: BareClient(pool), args.host, args.port)
        stopped = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopped.set)
        await stopped.wait()
        server.close()

    uvloop.run(serve())


if __name__ == "__main__":
    main()
