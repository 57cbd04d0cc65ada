"""How a request learns that its client left (proxy.asgi.disconnect_watch).

Under warmroute's HTTP protocol the connection's loss calls the request's callback at once
(the DISCONNECT_HOOK scope extension, no task per request); under any other server a task
awaits http.disconnect. Either way: once, only while the response is unfinished, and a stop
that comes late (a pipelined request's predecessor finishing) leaves a newer watch alone.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from types import SimpleNamespace
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from proxy.asgi import DISCONNECT_HOOK, disconnect_watch
from proxy.edge.limits import LimitedHttpToolsProtocol
from proxy.server.serve import NoDelayHttpToolsProtocol
from tests.support import serving


def _protocol(loop: asyncio.AbstractEventLoop) -> LimitedHttpToolsProtocol:
    async def app(scope: Any, receive: Any, send: Any) -> None:  # never called here
        raise AssertionError

    config = uvicorn.Config(app, log_level="warning")
    return LimitedHttpToolsProtocol(config, ServerState(), {}, _loop=loop)


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
