"""Fakes of the forwarder's upstream port and a request through a raw ASGI app: what the
tests of the request path share (tests/test_forward_fake_upstream.py, which patches them into
a built app, and tests/test_forwarding_alone.py, which builds the forwarder from them)."""

from __future__ import annotations

import asyncio
import inspect
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import orjson

from proxy.upstream.pool import Target

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


class FakeResponse:
    def __init__(self, status: int, chunks: list[bytes], error: BaseException | None = None):
        self.status = status
        self.headers = [(b"content-type", b"text/event-stream")]
        self.reused = False
        self._chunks = list(chunks)
        self._error = error
        self.closed = False

    async def readany(self) -> bytes:
        await asyncio.sleep(0)
        if self._chunks:
            return self._chunks.pop(0)
        if self._error is not None:
            raise self._error
        return b""

    def at_end(self) -> bool:
        return not self._chunks and self._error is None

    async def read(self, limit: int = -1) -> bytes:
        out = b""
        while data := await self.readany():
            out += data
        return out

    def idle_budget(self, seconds: float) -> None:
        pass

    def set_read_timeout(self, seconds: float) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def release(self) -> None:
        pass


Step = Callable[[], FakeResponse]


class FakeUpstream:
    """Answers each backend's requests from its script, in order (the last step repeats)."""

    def __init__(self, scripts: dict[str, list[Step | BaseException]]) -> None:
        self.scripts = scripts
        self.calls: list[tuple[str, bool, dict[str, str]]] = []
        self.bodies: list[bytes] = []
        self.count: dict[str, int] = defaultdict(int)

    def url(self, base: str, path: str) -> Target:
        return Target(base + path)

    async def post(
        self,
        target: Target,
        body: bytes,
        headers: dict[str, str],
        on_sent: Callable[[], None] | None = None,
        *,
        fresh: bool = False,
    ) -> FakeResponse:
        name = f"{target.host}:{target.port}"
        self.calls.append((name, fresh, headers))
        self.bodies.append(body)
        script = self.scripts[name]
        step = script[min(self.count[name], len(script) - 1)]
        self.count[name] += 1
        if isinstance(step, BaseException):
            raise step
        if on_sent is not None:
            on_sent()
        response = step()
        if inspect.isawaitable(response):  # a step that takes its time (or never answers)
            response = await response
        return response


async def asgi_request(
    app: Any,
    body: dict[str, Any],
    path: str = "/v1/chat/completions",
    headers: tuple[tuple[bytes, bytes], ...] = ((b"content-type", b"application/json"),),
    client: tuple[str, int] = ("127.0.0.1", 50000),
    leave: asyncio.Event | None = None,
) -> list[dict[str, Any]]:
    """One request through the app's ASGI interface; the messages it sent. The client stays
    connected, or hangs up once `leave` is set."""
    raw = orjson.dumps(body)
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await (leave or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope: dict[str, Any] = {"type": "http", "method": "POST", "path": path, "client": client}
    scope["headers"] = list(headers)
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


async def request(
    app: Any,
    body: dict[str, Any],
    headers: tuple[tuple[bytes, bytes], ...] = (),
    path: str = "/v1/chat/completions",
) -> tuple[int, bytes, dict[bytes, bytes]]:
    """Status, body and headers of one request (the client stays connected)."""
    sent = await asgi_request(app, body, path, ((b"content-type", b"application/json"), *headers))
    status = sent[0]["status"]
    return status, b"".join(m.get("body", b"") for m in sent[1:]), dict(sent[0]["headers"])


def chat(stream: bool = True) -> dict[str, Any]:
    return {
        "model": "m",
        "stream": stream,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hello"}],
    }


def ok() -> FakeResponse:
    return FakeResponse(200, [CHUNK, DONE])
