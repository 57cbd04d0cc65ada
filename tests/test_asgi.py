"""proxy.asgi: body limits, disconnects and responses as byte-level ASGI messages."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.asgi import (
    SSE_DONE,
    BodyTooLarge,
    ClientDisconnected,
    header,
    headers_of,
    read_body,
    respond,
    send_json,
    serve_lifespan,
    sse,
    watch_disconnect,
)


def messages(*parts: dict[str, Any]) -> Any:
    queue = list(parts)

    async def receive() -> dict[str, Any]:
        return queue.pop(0)

    return receive


def body(data: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.request", "body": data, "more_body": more}


class Sent(list[dict[str, Any]]):
    async def __call__(self, message: dict[str, Any]) -> None:
        self.append(message)


async def test_the_body_is_joined_from_its_parts() -> None:
    assert await read_body(messages(body(b"ab", True), body(b""), body(b"c"))) == b"ab"
    got = await read_body(messages(body(b"ab", True), body(b"cd")), limit=4)
    assert got == b"abcd"


async def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    async def never() -> dict[str, Any]:
        raise AssertionError("read a body the Content-Length already refused")

    with pytest.raises(BodyTooLarge) as e:
        await read_body(never, limit=10, declared="11")
    assert (e.value.size, e.value.limit) == (11, 10)


async def test_a_body_that_grows_past_the_limit_is_refused_as_it_arrives() -> None:
    with pytest.raises(BodyTooLarge) as e:
        await read_body(messages(body(b"abc", True), body(b"def", True)), limit=5, declared="x")
    assert (e.value.size, e.value.limit) == (6, 5)


async def test_a_client_leaving_mid_body_is_a_typed_error() -> None:
    with pytest.raises(ClientDisconnected):
        await read_body(messages(body(b"ab", True), {"type": "http.disconnect"}))


async def test_the_disconnect_watcher_calls_back_once_on_disconnect() -> None:
    calls: list[str] = []
    receive = messages(body(b""), {"type": "http.disconnect"})
    await asyncio.wait_for(watch_disconnect(receive, lambda: calls.append("gone")), 5)
    assert calls == ["gone"]


async def test_responses_carry_their_length_and_events_their_framing() -> None:
    sent = Sent()
    await respond(sent, 503, b"down", b"text/plain", [(b"x-a", b"1")])
    assert sent[0]["status"] == 503
    assert sent[0]["headers"] == [
        (b"content-type", b"text/plain"),
        (b"content-length", b"4"),
        (b"x-a", b"1"),
    ]
    assert sent[1] == {"type": "http.response.body", "body": b"down"}
    await send_json(sent, 200, {"a": 1})
    assert sent[3]["body"] == b'{"a":1}'
    assert sse({"a": 1}) == b'data: {"a":1}\n\n' and sse(b"[DONE]") == SSE_DONE


def test_headers_are_read_by_lower_case_name() -> None:
    scope = {"headers": [(b"x-request-id", b"r1"), (b"Content-Type", b"a/b")]}
    assert headers_of(scope) == {"x-request-id": "r1", "content-type": "a/b"}
    assert header(scope, b"x-request-id") == "r1" and header(scope, b"nope") is None


async def test_the_lifespan_runs_startup_and_shutdown() -> None:
    ran: list[str] = []

    async def up() -> None:
        ran.append("up")

    async def down() -> None:
        ran.append("down")

    sent = Sent()
    receive = messages({"type": "lifespan.startup"}, {"type": "lifespan.shutdown"})
    await serve_lifespan(receive, sent, up, down)
    assert ran == ["up", "down"]
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
