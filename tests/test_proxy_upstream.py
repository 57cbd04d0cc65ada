"""The upstream HTTP/1.1 client on its own, against raw asyncio servers that misbehave on cue."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from proxy.config import TimeoutsConfig
from proxy.upstream import pool as up
from proxy.upstream.pool import (
    Upstream,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamFirstByteTimeout,
    UpstreamIdleTimeout,
    UpstreamPayloadError,
    UpstreamTimeout,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _with_server(handler: Handler, body: Callable[[str, Upstream], Awaitable[Any]]) -> Any:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = Upstream(TimeoutsConfig(connect_s=1, first_byte_s=0.5, idle_s=0.5))
    await client.start()
    try:
        return await body(f"http://127.0.0.1:{port}", client)
    finally:
        await client.close()
        server.close()


async def _closed_port_url() -> str:
    """A loopback URL nothing listens on (a port just released)."""
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    return f"http://127.0.0.1:{port}"


async def _body(resp: up.UpstreamResponse) -> bytes:
    parts = []
    while data := await resp.readany():
        parts.append(data)
    return b"".join(parts)


@pytest.mark.e2e
def test_streams_chunks_and_reuses_the_connection() -> None:
    connections: list[int] = []
    seen: list[tuple[bytes, bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        while not reader.at_eof():
            try:
                head, body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                break
            seen.append((head, body))
            writer.write(CHUNKED + _chunk(b"data: a\n\n") + _chunk(b"data: b\n\n") + b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    async def body(url: str, client: Upstream) -> list[bytes]:
        out = []
        for _ in range(3):
            resp = await client.post(
                client.url(url, "/v1/chat/completions"), b'{"x":1}', {"x-request-id": "r1"}
            )
            assert resp.status == 200
            assert (b"content-type", b"text/event-stream") in resp.headers
            out.append(await _body(resp))
            resp.release()
        return out

    assert asyncio.run(_with_server(handler, body)) == [b"data: a\n\ndata: b\n\n"] * 3
    assert len(connections) == 1  # keep-alive: one connection for all three requests
    head, sent = seen[0]
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:")
    assert b"x-request-id: r1\r\n" in head and b"content-length: 7\r\n" in head
    assert sent == b'{"x":1}'


@pytest.mark.e2e
def test_connection_close_and_unread_bodies_are_not_reused() -> None:
    connections: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                await _read_request(reader)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
                    if len(connections) == 1
                    else CHUNKED + _chunk(b"part")  # never finished
                )
                await writer.drain()
                if len(connections) == 1:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def body(url: str, client: Upstream) -> None:
        target = client.url(url, "/v1/completions")
        resp = await client.post(target, b"{}", {})
        assert await resp.read() == b"ok"
        resp.release()
        resp = await client.post(target, b"{}", {})  # a new connection: the first said close
        assert await resp.readany() == b"part"
        resp.release()  # body not finished: the connection must be dropped, not pooled
        resp = await client.post(target, b"{}", {})
        resp.close()
        resp.release()

    asyncio.run(_with_server(handler, body))
    assert len(connections) == 3


@pytest.mark.e2e
def test_body_until_eof_and_broken_chunked_body() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await _read_request(reader)
        if b"/eof" in head:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it")
        else:
            writer.write(CHUNKED + _chunk(b"data: a\n\n"))
        await writer.drain()
        writer.close()

    async def body(url: str, client: Upstream) -> None:
        resp = await client.post(client.url(url, "/eof"), b"{}", {})
        assert await resp.read() == b"all of it"
        resp.release()
        resp = await client.post(client.url(url, "/cut"), b"{}", {})
        assert await resp.readany() == b"data: a\n\n"
        with pytest.raises(UpstreamPayloadError):
            await resp.readany()
        resp.release()

    asyncio.run(_with_server(handler, body))


@pytest.mark.e2e
def test_timeouts_first_byte_then_idle() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await _read_request(reader)
        if b"/slow" not in head:
            writer.write(CHUNKED + _chunk(b"first"))
            await writer.drain()
        await asyncio.sleep(3)
        writer.close()

    async def body(url: str, client: Upstream) -> None:
        loop = asyncio.get_running_loop()
        t = loop.time()
        with pytest.raises(TimeoutError):
            await client.post(client.url(url, "/slow"), b"{}", {})
        assert loop.time() - t < 2
        resp = await client.post(client.url(url, "/stall"), b"{}", {})
        assert await resp.readany() == b"first"
        resp.set_read_timeout(0.2)
        t = loop.time()
        with pytest.raises(TimeoutError):
            await resp.readany()
        assert loop.time() - t < 1
        resp.release()

    asyncio.run(_with_server(handler, body))


@pytest.mark.e2e
def test_a_timeout_says_which_budget_ran_out() -> None:
    """The relay tells a backend that never started from one that stalled mid-stream by the
    error's class, not by where it caught it."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await _read_request(reader)
        if b"/slow" not in head:
            writer.write(CHUNKED + _chunk(b"first"))
            await writer.drain()
        await asyncio.sleep(3)
        writer.close()

    async def body(url: str, client: Upstream) -> None:
        with pytest.raises(UpstreamFirstByteTimeout):
            await client.post(client.url(url, "/slow"), b"{}", {})
        resp = await client.post(client.url(url, "/stall"), b"{}", {})
        assert await resp.readany() == b"first"
        resp.idle_budget(0.2)
        with pytest.raises(UpstreamIdleTimeout) as idle:
            await resp.readany()
        assert not isinstance(idle.value, UpstreamFirstByteTimeout)
        assert isinstance(idle.value, UpstreamTimeout) and isinstance(idle.value, TimeoutError)
        resp.release()
        # the next request's deadline is a first-byte one again
        with pytest.raises(UpstreamFirstByteTimeout):
            await client.post(client.url(url, "/slow"), b"{}", {})

    asyncio.run(_with_server(handler, body))


@pytest.mark.e2e
def test_refused_and_dropped_connections() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.close()  # the keep-alive race, as the proxy sees it: closed without a byte

    async def body(url: str, client: Upstream) -> None:
        with pytest.raises(UpstreamDisconnected):
            await client.post(client.url(url, "/x"), b"{}", {})

    asyncio.run(_with_server(handler, body))

    async def refused() -> None:
        client = Upstream(TimeoutsConfig())
        await client.start()
        with pytest.raises(UpstreamConnectError):
            await client.post(client.url(await _closed_port_url(), "/x"), b"{}", {})
        await client.close()

    asyncio.run(refused())


@pytest.mark.e2e
def test_on_sent_runs_once_the_request_is_written_and_never_for_a_refused_one() -> None:
    """The forwarder's deferred bookkeeping (prefix recording) must see a sent request only."""
    log: list[str] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(0.05)
        log.append("response")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    async def body(url: str, client: Upstream) -> None:
        resp = await client.post(client.url(url, "/x"), b"{}", {}, lambda: log.append("sent"))
        assert await resp.read() == b"ok"
        resp.release()

    asyncio.run(_with_server(handler, body))
    assert log == ["sent", "response"]

    async def refused() -> None:
        client = Upstream(TimeoutsConfig())
        await client.start()
        with pytest.raises(UpstreamConnectError):
            await client.post(
                client.url(await _closed_port_url(), "/x"), b"{}", {}, lambda: log.append("no")
            )
        await client.close()

    asyncio.run(refused())
    assert "no" not in log


@pytest.mark.e2e
def test_stale_pooled_connections_are_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up, "KEEPALIVE_S", 0.05)
    connections: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                await _read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def body(url: str, client: Upstream) -> None:
        for _ in range(2):
            resp = await client.post(client.url(url, "/x"), b"{}", {})
            assert await resp.read() == b"ok"
            resp.release()
            await asyncio.sleep(0.1)  # idle longer than the pool keeps connections

    asyncio.run(_with_server(handler, body))
    assert len(connections) == 2


def test_header_values_cannot_inject_lines() -> None:
    target = up.Target("http://127.0.0.1:1/v1/x")
    with pytest.raises(ValueError):
        up._head(target, {"x-a": "1\r\nx-b: 2"}, 0)
    assert up._head(target, {"x-a": "1"}, 3) == (
        b"POST /v1/x HTTP/1.1\r\nhost: 127.0.0.1:1\r\nx-a: 1\r\ncontent-length: 3\r\n\r\n"
    )
