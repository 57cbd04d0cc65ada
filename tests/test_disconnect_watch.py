"""How a request learns that its client left (proxy.asgi.disconnect_watch).

Under warmroute's HTTP protocol the connection's loss calls the request's callback at once
(the DISCONNECT_HOOK scope extension, no task per request); under any other server a task
awaits http.disconnect. Either way: once, only while the response is unfinished, and a stop
that comes late (a pipelined request's predecessor finishing) leaves a newer watch alone. A
loss is seen only while the connection is read: a watch set once the body is whole resumes
the reading that a long body's high-water mark paused, and one set after the loss is told.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
import uvicorn
from uvicorn.server import ServerState

from proxy.asgi import DISCONNECT_HOOK, disconnect_watch, read_body
from proxy.edge.limits import LimitedHttpToolsProtocol
from proxy.server.serve import NoDelayHttpToolsProtocol
from tests.support import serving, until


class _Transport:
    """A client connection's transport, as much of it as the protocol uses here."""

    def __init__(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8080)}.get(
            name, default
        )

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        pass


def _protocol(
    loop: asyncio.AbstractEventLoop, app: Any = None, transport: _Transport | None = None
) -> LimitedHttpToolsProtocol:
    """The protocol on a connection (a stand-in transport), serving `app`."""

    async def never(scope: Any, receive: Any, send: Any) -> None:  # never called here
        raise AssertionError

    config = uvicorn.Config(app or never, log_level="warning")
    config.load()  # (the app as uvicorn wraps it: what its protocol calls)
    protocol = LimitedHttpToolsProtocol(config, ServerState(), {}, _loop=loop)
    protocol.connection_made(transport or _Transport())  # type: ignore[arg-type]
    return protocol


def _cycle(complete: bool) -> Any:
    return SimpleNamespace(
        response_complete=complete, disconnected=False, message_event=asyncio.Event()
    )


def _lose(protocol: LimitedHttpToolsProtocol) -> None:
    protocol.connection_lost(ConnectionResetError())  # (an error: no transport to close)


async def test_the_loss_of_an_unfinished_response_calls_the_watch_once() -> None:
    protocol = _protocol(asyncio.get_running_loop())
    protocol.on_message_begin()
    hook = protocol.scope["extensions"][DISCONNECT_HOOK]  # type: ignore[typeddict-item]
    calls: list[str] = []
    hook["watch"](lambda: calls.append("left"))
    protocol.cycle = _cycle(complete=False)
    _lose(protocol)
    assert calls == ["left"]
    assert protocol.cycle.disconnected  # uvicorn's own bookkeeping ran first
    _lose(protocol)  # (a second loss, were one reported, calls nothing)
    assert calls == ["left"]


async def test_a_finished_response_or_a_stopped_watch_is_not_told() -> None:
    protocol = _protocol(asyncio.get_running_loop())
    protocol.on_message_begin()
    watch = protocol.scope["extensions"][DISCONNECT_HOOK]["watch"]  # type: ignore[typeddict-item]
    calls: list[str] = []
    watch(lambda: calls.append("answered"))
    protocol.cycle = _cycle(complete=True)  # the answer was sent whole: nothing to abort
    _lose(protocol)
    protocol = _protocol(asyncio.get_running_loop())
    protocol.on_message_begin()
    watch = protocol.scope["extensions"][DISCONNECT_HOOK]["watch"]  # type: ignore[typeddict-item]
    stop = watch(lambda: calls.append("stopped"))
    stop()
    protocol.cycle = _cycle(complete=False)
    _lose(protocol)
    assert calls == []


async def test_a_late_stop_leaves_the_next_requests_watch() -> None:
    protocol = _protocol(asyncio.get_running_loop())
    protocol.on_message_begin()
    watch = protocol.scope["extensions"][DISCONNECT_HOOK]["watch"]  # type: ignore[typeddict-item]
    calls: list[str] = []
    stop_first = watch(lambda: calls.append("first"))
    watch(lambda: calls.append("second"))  # the pipelined request after it, on its way
    stop_first()  # the first request's finally, running late
    protocol.cycle = _cycle(complete=False)
    _lose(protocol)
    assert calls == ["second"]


async def test_a_long_body_read_whole_leaves_the_connection_read_for_its_clients_leaving() -> None:
    """uvicorn pauses reading when a read takes the buffered body past 64 KiB and resumes it
    only in receive(): the last read of a long prompt, arriving while the app waited for it,
    left reading paused, and the client's leaving unseen while the engine prefilled."""
    transport = _Transport()
    second_receive, watching, left = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls = 0

        async def counted() -> Any:
            nonlocal calls
            calls += 1
            if calls == 2:
                second_receive.set()
            return await receive()

        assert len(await read_body(counted)) == 10 + 100_000
        disconnect_watch(scope, receive)(left.set)
        watching.set()
        await left.wait()

    protocol = _protocol(asyncio.get_running_loop(), app, transport)
    protocol.data_received(
        b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100010\r\n\r\n" + b"x" * 10
    )
    await asyncio.wait_for(second_receive.wait(), 10)  # the app waits for the rest
    protocol.data_received(b"y" * 100_000)  # the rest in one read: past the high-water mark
    assert not transport.reading  # (uvicorn's pause, which its receive() would undo)
    await asyncio.wait_for(watching.wait(), 10)
    assert transport.reading  # the watch needs the connection read: resumed
    _lose(protocol)
    await asyncio.wait_for(left.wait(), 10)


async def test_a_watch_set_after_the_connection_was_lost_is_told_at_once() -> None:
    protocol = _protocol(asyncio.get_running_loop())
    protocol.on_message_begin()
    protocol.cycle = _cycle(complete=False)
    _lose(protocol)  # the client left while the request was routed, before any watch
    watch = protocol.scope["extensions"][DISCONNECT_HOOK]["watch"]  # type: ignore[typeddict-item]
    told, stopped = asyncio.Event(), asyncio.Event()
    watch(told.set)
    watch(stopped.set)()  # (stopped before the loop ran it: not told)
    await asyncio.wait_for(told.wait(), 10)
    await asyncio.sleep(0)
    assert not stopped.is_set()


async def test_without_the_servers_hook_a_task_awaits_the_disconnect() -> None:
    messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    left = asyncio.Event()
    watch = disconnect_watch({"type": "http"}, messages.get)
    watch(left.set)
    await messages.put({"type": "http.request", "body": b"", "more_body": False})
    await messages.put({"type": "http.disconnect"})
    await asyncio.wait_for(left.wait(), 10)
    stopped = asyncio.Event()
    stop = disconnect_watch({"type": "http", "extensions": {}}, messages.get)(stopped.set)
    stop()
    await messages.put({"type": "http.disconnect"})
    await asyncio.sleep(0)  # (the cancelled task does not run again)
    assert not stopped.is_set()


def test_a_client_leaving_mid_stream_is_told_through_the_protocols_hook() -> None:
    seen: dict[str, Any] = {}
    told = threading.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        left = asyncio.Event()
        watch = disconnect_watch(scope, receive)
        seen["hook"] = getattr(watch, "__self__", None)
        stop = watch(left.set)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: one\n\n", "more_body": True})
        try:
            await asyncio.wait_for(left.wait(), 10)
            told.set()
        finally:
            stop()

    with serving(app, http=NoDelayHttpToolsProtocol, loop="uvloop") as server:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
            got = b""
            while b"data: one" not in got:
                part = s.recv(65536)
                assert part, got
                got += part
        assert told.wait(10)
    assert isinstance(seen["hook"], LimitedHttpToolsProtocol)  # not the task fallback


@pytest.mark.e2e
def test_a_client_that_sent_a_long_prompt_and_left_while_it_prefilled_frees_its_engine(
    fake_backends: Any, proxy_server: Callable[..., Any]
) -> None:
    """The last part of a ~120 KB prompt read while the proxy waits for it (past uvicorn's
    64 KiB high-water mark): its client's leaving before the first token reached the engine
    only at that token (here 30 s), the engine prefilling for no one meanwhile."""
    [(app, backend)] = fake_backends(1)
    proxy = proxy_server([backend.url])
    prompt = "delay:30 " + "x" * 120_000  # the mock's first token 30 s after the request
    body = orjson.dumps(
        {"model": "test-model", "stream": True, "messages": [{"role": "user", "content": prompt}]}
    )
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n"
    with socket.create_connection(("127.0.0.1", proxy.port)) as client:
        client.sendall(head % len(body) + body[:1000])
        # The rest a moment later, so that it is read on its own while the proxy waits for it
        # (this shapes the reads; a shorter pause could only make the case not arise)
        time.sleep(0.2)
        client.sendall(body[1000:])
        until(lambda: app.rec.requests, "the request on the engine")
    assert app.rec.disconnected.wait(10), "the engine was left prefilling for a client gone"
