"""A background check sent on a kept-alive connection the engine's server closed under it is
a race, not an outage: sent again at once on a new connection, it leaves the backend healthy
(proxy/upstream/backends.py BackendRegistry._get). One such lost check used to mark a busy engine
unhealthy, and placement moved its prompts away and back."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from proxy.config import load_config
from proxy.upstream.backends import CONTROL_LIMITS, BackendRegistry

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def closing_server() -> tuple[asyncio.AbstractServer, list[int]]:
    """Answers the first request of each connection and keeps it open, then closes it
    without a word when the next request arrives (a keep-alive that ran out as the request
    came). Returns the server and, per connection, the requests it read."""
    served: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(0)
        me = len(served) - 1
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                served[me] += 1
                if served[me] > 1:
                    break
                writer.write(OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, served


async def test_a_check_on_a_connection_closed_under_it_is_sent_again_and_passes() -> None:
    server, served = await closing_server()
    port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cfg = load_config(flags={"backends": [url]}, env={})
    async with server, httpx.AsyncClient(limits=CONTROL_LIMITS, trust_env=False) as control:
        registry = BackendRegistry(cfg, httpx.AsyncClient(), control=lambda: control)
        (b,) = list(registry)
        await registry._check(b, discover=False)
        assert b.healthy and served == [1]
        # The next check goes out on the kept-alive connection, which the server now closes.
        await registry._check(b, discover=False)
        assert b.healthy, b.last_error
        assert served == [2, 1]  # the first connection read it and hung up; a new one answered
        # Without the second try, the same race is a failed check.
        with pytest.raises(httpx.RemoteProtocolError):
            await control.get(url + "/health")
