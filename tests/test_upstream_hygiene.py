"""What crosses between client, proxy and backend, and what must not: the per-backend
connection cap, trailers, proxies from the environment, hop-by-hop response headers, and the
request id on every admin answer. Real loopback servers throughout."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from proxy.bench.mock import MockBackend
from proxy.config import Config, TimeoutsConfig
from proxy.server.app import create_app
from proxy.upstream.pool import Upstream, UpstreamConnectTimeout
from tests.support import ServerThread
from tests.test_proxy_hostile import RawBackend

MODEL = "test-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = (
    b'{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}'
)


class HeldServer:
    """An HTTP/1.1 keep-alive server on loopback that holds every response until released,
    counting the connections it accepted and the requests it got."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: asyncio.Queue[asyncio.Event] = asyncio.Queue()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> HeldServer:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(ln.split(b":")[1])
                    for ln in head.split(b"\r\n")
                    if ln.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                release = asyncio.Event()
                self.requests.put_nowait(release)
                await release.wait()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def _request(client: Upstream, url: str) -> bytes:
    resp = await client.post(client.url(url, "/v1/x"), b"{}", {})
    try:
        return await resp.read()
    finally:
        resp.release()


# -- the per-backend connection cap -------------------------------------------------------------


async def test_past_the_per_backend_cap_a_request_waits_for_a_connection_and_then_gets_one() -> (
    None
):
    async with HeldServer() as server:
        client = Upstream(TimeoutsConfig(connect_s=30, first_byte_s=30), max_per_host=2)
        await client.start()
        try:
            tasks = [asyncio.create_task(_request(client, server.url)) for _ in range(3)]
            first, second = await server.requests.get(), await server.requests.get()
            assert server.connections == 2  # the third waits for one of them
            assert not any(t.done() for t in tasks)
            first.set()  # a response ends: its connection goes to the waiting request
            third = await server.requests.get()
            assert server.connections == 2  # the same connection, not a third
            second.set()
            third.set()
            assert await asyncio.gather(*tasks) == [b"ok", b"ok", b"ok"]
        finally:
            await client.close()


async def test_a_request_that_waits_past_the_connect_timeout_is_refused_and_frees_nothing() -> None:
    async with HeldServer() as server:
        client = Upstream(TimeoutsConfig(connect_s=0.05, first_byte_s=30), max_per_host=1)
        await client.start()
        try:
            held = asyncio.create_task(_request(client, server.url))
            release = await server.requests.get()
            with pytest.raises(UpstreamConnectTimeout, match="max_connections_per_backend"):
                await _request(client, server.url)
            waiting = asyncio.create_task(_request(client, server.url))
            await asyncio.sleep(0)  # it queues for the slot...
            waiting.cancel()  # ...and its client leaves
            with pytest.raises(asyncio.CancelledError):
                await waiting
            release.set()
            assert await held == b"ok"
            # The slot the refused and the cancelled request waited for is still one slot.
            after = asyncio.create_task(_request(client, server.url))
            (await server.requests.get()).set()
            assert await after == b"ok"
            assert server.connections == 1
        finally:
            await client.close()


# -- trailers -----------------------------------------------------------------------------------


async def test_trailers_never_become_headers_even_when_all_arrives_in_one_read() -> None:
    reply = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n"
        b"trailer: x-checksum\r\n\r\n5\r\nhello\r\n0\r\nx-checksum: abc\r\nx-other: 1\r\n\r\n"
    )
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(int(head.split(b"content-length: ")[1].split(b"\r")[0]))
                writer.write(reply)  # head, body and trailers in one segment
                await writer.drain()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = Upstream(TimeoutsConfig(connect_s=5, first_byte_s=5))
    await client.start()
    try:
        for _ in range(2):
            resp = await client.post(client.url(url, "/x"), b"{}", {})
            names = [k for k, _ in resp.headers]
            assert b"x-checksum" not in names and b"x-other" not in names
            assert b"content-type" in names
            assert await resp.read() == b"hello"
            resp.release()
        assert connections == 1  # the connection stayed good for the next request
    finally:
        await client.close()
        server.close()


# -- proxies from the environment ----------------------------------------------------------------


class CountingListener:
    """A TCP listener that counts who connects (standing in for an HTTP proxy)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def env_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[CountingListener]:
    listener = CountingListener()
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, listener.url)
        monkeypatch.setenv(name.lower(), listener.url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    yield listener
    listener.close()


@pytest.mark.e2e
def test_proxies_from_the_environment_are_used_by_neither_client(
    env_proxy: CountingListener,
) -> None:
    backend = MockBackend(chunks=3, models=(MODEL,), record=True)
    with ServerThread(backend) as server:
        # Listed models would skip discovery: leave them to GET /v1/models, a health client call.
        config = Config.model_validate({"backends": [{"url": server.url}]})
        with (
            ServerThread(create_app(config)) as proxy,
            httpx.Client(base_url=proxy.url, timeout=10, trust_env=False) as http,  # this test's
        ):
            ready = http.get("/ready")  # the health client reached the backend
            assert ready.status_code == 200, ready.text
            r = http.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200  # and so did the forwarder
    assert backend.rec is not None and len(backend.rec.requests) == 1
    assert env_proxy.accepted == 0


# -- headers on the way back, and the request id on admin answers -------------------------------


@pytest.fixture
def raw_backend() -> Iterator[Callable[[bytes], RawBackend]]:
    made: list[RawBackend] = []

    def make(reply: bytes) -> RawBackend:
        backend = RawBackend("ok")
        backend.reply = reply
        made.append(backend)
        return backend

    yield make
    for b in made:
        b.close()


@pytest.mark.e2e
def test_headers_named_in_the_backends_connection_header_do_not_reach_the_client(
    raw_backend: Callable[[bytes], RawBackend], proxy_server: Callable[..., ServerThread]
) -> None:
    backend = raw_backend(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        b"connection: X-Hop-Secret, close\r\nx-hop-secret: s3cret\r\nkeep-alive: timeout=5\r\n"
        b"x-kept: yes\r\ncontent-length: %d\r\n\r\n%s" % (len(COMPLETION), COMPLETION)
    )
    proxy = proxy_server([backend.url])
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={**CHAT, "model": "m"},
        timeout=10,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi"
    assert "x-hop-secret" not in r.headers and "keep-alive" not in r.headers
    assert r.headers["x-kept"] == "yes"  # an end-to-end header goes through
    assert "s3cret" not in str(r.headers)


ADMIN_CALLS = (
    ("GET", "/admin/backends"),
    ("GET", "/admin/routing"),
    ("GET", "/admin/disagg"),
    ("GET", "/admin/doctor"),
    ("POST", "/admin/route/explain"),
)


@pytest.mark.e2e
def test_every_admin_answer_carries_a_request_id_refusals_too(
    fake_backends: Any, proxy_server: Callable[..., ServerThread]
) -> None:
    [(_, backend)] = fake_backends(1)
    served = proxy_server([backend.url])  # /admin on the serving port
    off = proxy_server([backend.url], admin_port=None)  # /admin not served: 404
    token = hashlib.sha256(b"admin-token").hexdigest()
    guarded = proxy_server([backend.url], {"server": {"admin_token_sha256": token}})
    for proxy, status in ((served, 200), (off, 404), (guarded, 401)):
        for method, path in ADMIN_CALLS:
            r = httpx.request(method, proxy.url + path, json=CHAT, timeout=10)
            assert r.status_code == status, (path, r.text)
            assert len(r.headers["x-request-id"]) == 32, path
            mine = httpx.request(
                method, proxy.url + path, json=CHAT, headers={"x-request-id": "op-42"}, timeout=10
            )
            assert mine.headers["x-request-id"] == "op-42", path
