"""Hostile backends, round two (issue 25): what a backend URL's path and query make of the
request target, coded request bodies, a fleet that answers 429, idle pooled connections under
light traffic, and the size of an explain body. Real loopback sockets, the official openai
client where the client's view matters."""

from __future__ import annotations

import asyncio
import gzip
import socket
from collections.abc import Callable, Iterator

import httpx
import openai
import orjson
import pytest

from proxy.config import TimeoutsConfig
from proxy.engines import backend_url
from proxy.upstream.pool import Upstream
from tests.support import ServerThread
from tests.test_proxy_hostile import RawBackend
from tests.test_upstream_hygiene import COMPLETION, HeldServer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _answer(status: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s" % (
        status,
        extra,
        len(body),
        body,
    )


OK = _answer(b"200 OK", COMPLETION)


class _Tap:
    """A backend's accepted socket that keeps the request head it reads (before any reply)."""

    def __init__(self, conn: socket.socket, heads: list[bytes]) -> None:
        self.conn, self.heads = conn, heads
        self.seen: bytes | None = b""

    def recv(self, n: int) -> bytes:
        data = self.conn.recv(n)
        if self.seen is not None:
            self.seen += data
            if b"\r\n\r\n" in self.seen:
                self.heads.append(self.seen.partition(b"\r\n\r\n")[0])
                self.seen = None
        return data

    def sendall(self, data: bytes) -> None:
        self.conn.sendall(data)

    def __enter__(self) -> _Tap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.close()


class RecordingBackend(RawBackend):
    """RawBackend (GET: its model list; POST: `reply`) that keeps every request head."""

    def __init__(self, reply: bytes) -> None:
        self.heads: list[bytes] = []
        super().__init__("ok")
        self.reply = reply

    def _one(self, conn: socket.socket) -> None:
        super()._one(_Tap(conn, self.heads))  # type: ignore[arg-type]

    def posts_heads(self) -> list[bytes]:
        return [h for h in list(self.heads) if h.startswith(b"POST ")]

    def lines(self, method: bytes) -> list[bytes]:
        return [h.split(b"\r\n")[0] for h in list(self.heads) if h.startswith(method + b" ")]


@pytest.fixture
def backend() -> Iterator[Callable[[bytes], RecordingBackend]]:
    made: list[RecordingBackend] = []

    def make(reply: bytes = OK) -> RecordingBackend:
        made.append(RecordingBackend(reply))
        return made[-1]

    yield make
    for b in made:
        b.close()


def _client(proxy: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0, timeout=10)


def _chat(proxy: ServerThread) -> str | None:
    reply = _client(proxy).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]
    )
    return reply.choices[0].message.content


# -- 11: a backend URL's path prefix and query ------------------------------------------------


def test_a_backend_urls_path_prefix_and_query_go_around_the_api_path() -> None:
    assert backend_url("http://h:8000", "/v1/models") == "http://h:8000/v1/models"
    assert backend_url("http://h:8000/gw", "/v1/models") == "http://h:8000/gw/v1/models"
    assert backend_url("http://h:8000/?t=X", "/v1/models") == "http://h:8000/v1/models?t=X"
    assert backend_url("https://u:p@h/gw/v1?t=X&a=1", "/v1/x?b=2") == (
        "https://u:p@h/gw/v1/x?b=2&t=X&a=1"
    )


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("suffix", "prefix"), [("/?token=s3cret", b""), ("/gw/v1?token=s3cret", b"/gw")]
)
def test_a_backend_url_with_a_query_gets_it_after_the_api_path_and_it_is_masked(
    backend: Callable[[bytes], RecordingBackend],
    proxy_server: Callable[..., ServerThread],
    suffix: str,
    prefix: bytes,
) -> None:
    b = backend(OK)
    proxy = proxy_server([b.url + suffix])
    assert _chat(proxy) == "hi"
    assert b.lines(b"POST") == [b"POST %s/v1/chat/completions?token=s3cret HTTP/1.1" % prefix]
    # the health client's too: the model list at startup, and whatever it polls since
    gets = [line.split(b" ")[1] for line in b.lines(b"GET")]
    assert prefix + b"/v1/models?token=s3cret" in gets
    assert all(g.startswith(prefix + b"/") and g.endswith(b"?token=s3cret") for g in gets), gets
    shown = httpx.get(proxy.url + "/admin/backends", timeout=5).text
    assert "s3cret" not in shown and "***" in shown


# -- 12: a coded request body ---------------------------------------------------------------


@pytest.mark.e2e
def test_a_gzip_request_body_gets_a_415_naming_the_encoding_and_reaches_no_backend(
    backend: Callable[[bytes], RecordingBackend], proxy_server: Callable[..., ServerThread]
) -> None:
    b = backend(OK)
    proxy = proxy_server([b.url])
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        content=gzip.compress(orjson.dumps(CHAT)),
        headers={"content-type": "application/json", "content-encoding": "gzip"},
        timeout=5,
    )
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported_content_encoding" and "gzip" in error["message"]
    assert r.headers["accept-encoding"] == "identity"
    with pytest.raises(openai.APIStatusError) as err:  # what the openai client sees
        _client(proxy).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"Content-Encoding": "br"},
        )
    assert err.value.status_code == 415 and "br" in err.value.message
    assert b.posts_heads() == []


@pytest.mark.e2e
def test_content_encoding_is_never_forwarded_upstream(
    backend: Callable[[bytes], RecordingBackend], proxy_server: Callable[..., ServerThread]
) -> None:
    b = backend(OK)
    proxy = proxy_server([b.url])
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        json=CHAT,
        headers={"content-encoding": "identity"},
        timeout=5,
    )
    assert r.status_code == 200, r.text
    [head] = b.posts_heads()
    assert b"content-encoding" not in head.lower()


# -- 15: every backend answering 429 --------------------------------------------------------


def _limited(retry_after: bytes | None) -> bytes:
    extra = b"retry-after: %s\r\n" % retry_after if retry_after is not None else b""
    return _answer(b"429 Too Many Requests", b'{"error":{"message":"busy"}}', extra)


@pytest.mark.e2e
def test_every_backend_answering_429_gives_the_client_429_with_the_soonest_retry_after(
    backend: Callable[[bytes], RecordingBackend], proxy_server: Callable[..., ServerThread]
) -> None:
    slow, soon = backend(_limited(b"7")), backend(_limited(b"3"))
    proxy = proxy_server([slow.url, soon.url])
    with pytest.raises(openai.RateLimitError) as err:
        _chat(proxy)
    assert err.value.response.headers["retry-after"] == "3"
    assert err.value.code == "backends_rate_limited"
    assert len(slow.posts_heads()) == len(soon.posts_heads()) == 1  # both were tried


@pytest.mark.e2e
def test_429s_without_retry_after_give_a_one_second_default_and_a_mix_stays_503(
    backend: Callable[[bytes], RecordingBackend], proxy_server: Callable[..., ServerThread]
) -> None:
    bare = proxy_server([backend(_limited(None)).url, backend(_limited(b"soon")).url])
    with pytest.raises(openai.RateLimitError) as limited:
        _chat(bare)
    assert limited.value.response.headers["retry-after"] == "1"
    failing = _answer(b"500 Internal Server Error", b'{"error":{"message":"boom"}}')
    mixed = proxy_server([backend(_limited(b"3")).url, backend(failing).url])
    with pytest.raises(openai.InternalServerError) as down:
        _chat(mixed)
    assert down.value.status_code == 503 and down.value.code == "backends_unavailable"


# -- 16: idle pooled connections under steady light traffic --------------------------------


class ClosingHeldServer(HeldServer):
    """HeldServer that counts the connections the client closed."""

    def __init__(self) -> None:
        super().__init__()
        self.closed: asyncio.Queue[None] = asyncio.Queue()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await super()._handle(reader, writer)
        self.closed.put_nowait(None)


async def test_light_traffic_closes_the_idle_connections_it_no_longer_uses() -> None:
    now = [0.0]
    client = Upstream(TimeoutsConfig(connect_s=5, first_byte_s=5), clock=lambda: now[0])
    await client.start()
    async with ClosingHeldServer() as server:
        target = client.url(server.url, "/v1/x")

        async def request() -> bytes:
            resp = await client.post(target, b"{}", {})
            try:
                return await resp.read()
            finally:
                resp.release()

        try:
            burst = [asyncio.create_task(request()) for _ in range(2)]  # two connections
            for _ in burst:
                (await server.requests.get()).set()
            assert await asyncio.gather(*burst) == [b"ok", b"ok"]
            now[0] = 3.0  # one request at a time from here: the newest connection serves it
            light = asyncio.create_task(request())
            release = await server.requests.get()
            now[0] = 4.5  # the other one has been idle past KEEPALIVE_S when this one returns
            release.set()
            assert await light == b"ok"
            await asyncio.wait_for(server.closed.get(), 5)  # closed by the return, not reused
            assert server.closed.empty()  # the warm one stays pooled...
            again = asyncio.create_task(request())
            (await server.requests.get()).set()
            assert await again == b"ok"
            assert server.connections == 2  # ...and serves the next request
        finally:
            await client.close()


# -- 17: the size of an explain body -------------------------------------------------------


@pytest.mark.e2e
def test_explain_refuses_a_body_over_max_body_bytes_with_413_declared_or_streamed(
    backend: Callable[[bytes], RecordingBackend], proxy_server: Callable[..., ServerThread]
) -> None:
    proxy = proxy_server([backend(OK).url], {"server": {"max_body_bytes": 2048}})
    url = proxy.url + "/admin/route/explain"
    assert httpx.post(url, json=CHAT, timeout=5).status_code == 200
    big = orjson.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 4096}]})
    declared = httpx.post(url, content=big, timeout=5)

    def chunks() -> Iterator[bytes]:  # no Content-Length: refused as it arrives
        yield from (big[i : i + 512] for i in range(0, len(big), 512))

    streamed = httpx.post(url, content=chunks(), timeout=5)
    for r in (declared, streamed):
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"
