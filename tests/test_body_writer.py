"""proxy.asgi.body_writer: a streamed body's parts written past uvicorn's `send`, as it would.

The relay writes every part of a stream after the first with it (proxy/forwarding/relay.py);
what the client reads must be what `send` would have written, and where `send` would wait
(writing paused) or drop the part (the client gone), the writer writes nothing and says so.
"""

from __future__ import annotations

import socket
from typing import Any

from proxy.asgi import body_writer
from proxy.server.serve import NoDelayHttpToolsProtocol
from tests.support import StandInCycle, serving

PARTS = [b"data: one\n\n", b"data: " + b"x" * 3000 + b"\n\n", b"data: [DONE]\n\n"]


def _app(seen: list[Any]) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": PARTS[0], "more_body": True})
        write = body_writer(send)
        seen.append(write)
        assert write is not None
        for part in PARTS[1:]:
            assert write(part) is True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def _get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_parts_written_directly_read_as_the_chunked_body_send_would_write() -> None:
    seen: list[Any] = []
    with serving(_app(seen), http=NoDelayHttpToolsProtocol, loop="uvloop") as server:
        raw = _get(server.port)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    expected = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in PARTS) + b"0\r\n\r\n"
    assert body == expected
    assert seen and seen[0] is not None


def _started() -> StandInCycle:
    """A cycle whose chunked response has its head out."""
    cycle = StandInCycle()
    cycle.response_started, cycle.chunked_encoding = True, True
    return cycle


def test_the_writer_writes_nothing_while_send_would_wait_or_drop_the_part() -> None:
    cycle = _started()
    write = body_writer(cycle.send)
    assert write is not None
    assert write(b"abc") is True and cycle.writes == [b"3\r\nabc\r\n"]
    cycle.flow.write_paused = True  # a slow client: `send` drains first
    assert write(b"def") is False
    cycle.flow.write_paused = False
    cycle.disconnected = True  # `send` drops it
    assert write(b"ghi") is False
    assert cycle.writes == [b"3\r\nabc\r\n"]


def test_no_writer_where_send_frames_the_body_otherwise() -> None:
    cycle = _started()
    cycle.chunked_encoding = False  # a Content-Length body
    assert body_writer(cycle.send) is None
    cycle.chunked_encoding, cycle.response_started = True, False  # no head out yet
    assert body_writer(cycle.send) is None

    async def other_server_send(message: Any) -> None:  # pragma: no cover
        pass

    assert body_writer(other_server_send) is None
