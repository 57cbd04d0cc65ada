"""The registry's background GETs over the proxy's own connections (proxy/upstream/control.py):
answered as httpx answers, a stale pooled connection retried once on a new one, and every
failure an httpx error the checks already handle."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator

import httpx
import pytest

from proxy.config import TimeoutsConfig
from proxy.upstream.control import ControlClient
from tests.support import ROOT, free_port

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"


@contextlib.asynccontextmanager
async def _server(answer: object) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A raw HTTP/1.1 server on loopback: `answer(n, request)` gives the bytes for the n-th
    request on a connection (None: close it without answering); the requests seen go in the
    list it yields beside the base URL."""
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                seen.append(head)
                n += 1
                out = answer(n, head)  # type: ignore[operator]
                if out is None:
                    break
                writer.write(out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    port = free_port()
    server = await asyncio.start_server(serve, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def _client() -> AsyncIterator[ControlClient]:
    client = ControlClient(TimeoutsConfig())
    await client.start()
    try:
        yield client
    finally:
        await client.close()


async def test_a_get_answers_as_httpx_does_on_one_kept_connection() -> None:
    body = b'{"data": [{"id": "m"}]}'
    async with _server(lambda n, head: OK % (len(body), body)) as (url, seen), _client() as c:
        for _ in range(3):
            r = await c.get(url + "/v1/models", {"authorization": "Bearer k"}, 5.0)
            r.raise_for_status()
            assert r.status_code == 200 and r.json() == {"data": [{"id": "m"}]}
    assert len(seen) == 3
    assert seen[0].startswith(b"GET /v1/models HTTP/1.1\r\n")
    assert b"authorization: Bearer k\r\n" in seen[0]


async def test_a_pooled_connection_the_server_closed_is_retried_once_on_a_new_one() -> None:
    body = b"ok"

    def answer(n: int, head: bytes) -> bytes | None:
        return OK % (len(body), body) if n == 1 else None  # the second on a connection: closed

    async with _server(answer) as (url, seen), _client() as c:
        assert (await c.get(url + "/health")).text == "ok"
        assert (await c.get(url + "/health")).text == "ok"  # its connection's second: retried
    assert len(seen) == 3


async def test_failures_are_the_httpx_errors_the_checks_handle() -> None:
    async with _client() as c:
        with pytest.raises(httpx.ConnectError):
            await c.get(f"http://127.0.0.1:{free_port()}/health", None, 5.0)  # nothing listens
        async with _server(lambda n, head: b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nab") as (
            url,
            _,
        ):
            with pytest.raises(httpx.TimeoutException):
                await c.get(url + "/health", None, 0.2)  # the body never comes whole
        status = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"
        async with _server(lambda n, head: status) as (url, _):
            r = await c.get(url + "/health")
            with pytest.raises(httpx.HTTPStatusError):
                r.raise_for_status()
        async with _server(lambda n, head: None) as (url, _):  # closed on a new connection
            with pytest.raises(httpx.RemoteProtocolError):
                await c.get(url + "/health")


def test_the_cost_script_runs_both_clients_both_ways() -> None:
    out = subprocess.run(
        [sys.executable, "deploy/perf/control_get.py", "--requests", "20"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    rows = [line.rsplit(" us CPU per GET", 1)[0] for line in out.strip().splitlines()]
    assert [r[:28].strip() for r in rows] == [
        "httpx, kept alive",
        "httpx, a new connection",
        "own pool, kept alive",
        "own pool, a new connection",
    ]
    assert all(float(r[28:]) > 0 for r in rows)


async def test_a_backend_forgotten_drops_its_own_urls_only() -> None:
    body = b"ok"
    async with _server(lambda n, head: OK % (len(body), body)) as (url, _), _client() as c:
        other = url + "0"  # the same host, a port whose digits begin with this one's
        c._targets[other + "/health"] = None  # type: ignore[assignment]  # (never sent)
        await c.get(url + "/health")
        c.forget(url)
        assert list(c._targets) == [other + "/health"]
        assert (await c.get(url + "/health")).text == "ok"  # parsed again when next asked
