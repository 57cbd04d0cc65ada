"""proxy.asgi.stream_head and body_part: a streamed response's head, first part and end
written as uvicorn's `send` would write them, or not at all.

The relay starts and ends every stream with them (proxy/forwarding/relay.py): the client must
read the same bytes as when the messages go through `send`, the connection must be left in the
state `send` leaves it in (the next request on it served, or the connection closed), and where
`send` would do anything else (wait, drop, refuse, frame otherwise, log) they write nothing.
"""

from __future__ import annotations

import re
import socket
from typing import Any

import pytest

from proxy.asgi import body_part, stream_head
from proxy.server.serve import NoDelayHttpToolsProtocol
from tests.support import StandInCycle, serving

HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"X-Request-Id", b"req-1"),  # upper case: uvicorn writes names lower-cased
    (b"x-warmroute-backend", b"e0 \t(tab) \xe9"),  # a tab and obs-text are allowed in values
]
PARTS = [b"data: one\n\n", b"data: two\n\n"]


def _app(started: list[bool]) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        status = int(scope["path"].rsplit("/", 1)[1])
        fast = scope["path"].startswith("/fast/")
        if fast:
            started.append(stream_head(send, status, list(HEADERS)))
            assert started[-1] and body_part(send, PARTS[0], True)
            assert body_part(send, b"", True)  # (send writes nothing of an empty part either)
            assert body_part(send, PARTS[1], False)
            return
        await send({"type": "http.response.start", "status": status, "headers": HEADERS})
        await send({"type": "http.response.body", "body": PARTS[0], "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": True})
        await send({"type": "http.response.body", "body": PARTS[1], "more_body": False})

    return app


def _exchange(port: int, paths: list[str], close_last: bool) -> list[bytes]:
    """The raw responses to GETs of `paths`, one after another on one connection."""
    out = []
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(30)  # a connection the server stopped serving fails, not hangs, the test
        for i, path in enumerate(paths):
            last = i == len(paths) - 1
            conn = b"connection: close\r\n" if close_last and last else b""
            s.sendall(b"GET %b HTTP/1.1\r\nhost: x\r\n%b\r\n" % (path.encode(), conn))
            raw = b""
            while not raw.endswith(b"0\r\n\r\n"):
                chunk = s.recv(65536)
                assert chunk, raw
                raw += chunk
            out.append(raw)
        if close_last:
            assert s.recv(1) == b""  # the server closed after the response, as it said
    return out


def _dateless(raw: bytes) -> bytes:
    return re.sub(rb"\r\ndate: [^\r]*\r\n", b"\r\ndate: -\r\n", raw)


@pytest.mark.parametrize("close_last", [False, True])
def test_the_head_and_parts_are_those_send_writes_and_the_connection_goes_on_as_after_send(
    close_last: bool,
) -> None:
    started: list[bool] = []
    with serving(
        _app(started), http=NoDelayHttpToolsProtocol, loop="uvloop", access_log=False
    ) as server:
        fast = _exchange(server.port, ["/fast/200", "/fast/201", "/fast/200"], close_last)
        slow = _exchange(server.port, ["/send/200", "/send/201", "/send/200"], close_last)
    assert started == [True, True, True]
    assert [_dateless(r) for r in fast] == [_dateless(r) for r in slow]
    head, _, body = fast[1].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 201 Created\r\n")
    assert b"\r\nx-request-id: req-1\r\n" in head
    assert (b"\r\nconnection: close" in fast[-1]) is close_last
    assert body == b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in PARTS) + b"0\r\n\r\n"


def _state(cycle: StandInCycle) -> tuple[Any, ...]:
    return (cycle.response_started, cycle.waiting_for_100_continue, cycle.chunked_encoding)


def test_the_head_sets_the_state_send_would_set() -> None:
    cycle = StandInCycle()
    assert stream_head(cycle.send, 200, [(b"a", b"b")]) is True
    assert _state(cycle) == (True, False, True)
    assert cycle.writes == [
        b"HTTP/1.1 200 OK\r\ndate: Sun, 06 Dec 2026 07:00:00 GMT\r\nserver: u\r\na: b\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    ]


def _refuses(change: Any, status: int = 200, headers: Any = ((b"a", b"b"),)) -> None:
    cycle = StandInCycle()
    change(cycle)
    before = _state(cycle)
    assert stream_head(cycle.send, status, list(headers)) is False
    assert cycle.writes == [] and _state(cycle) == before


@pytest.mark.parametrize(
    "value",
    [b"a\r\nset-cookie: x", b"a\nb", b"a\rb", b"a\x00b", b"a\x01b", b"a\x1fb", b"a\x7fb"],
)
def test_a_header_send_would_refuse_is_left_to_send(value: bytes) -> None:
    _refuses(lambda c: None, headers=[(b"a", b"b"), (b"x-bad", value)])
    _refuses(lambda c: None, headers=[(b"x-bad" + value, b"v")])


@pytest.mark.parametrize("name", [b"content-length", b"Transfer-Encoding", b"connection"])
def test_a_head_with_framing_fields_of_its_own_is_left_to_send(name: bytes) -> None:
    _refuses(lambda c: None, headers=[(name, b"5")])


@pytest.mark.parametrize("status", [101, 204, 304, 600])
def test_statuses_without_a_streamed_body_are_left_to_send(status: int) -> None:
    _refuses(lambda c: None, status=status)


@pytest.mark.parametrize(
    "change",
    [
        lambda c: setattr(c, "response_started", True),  # a second start: send raises
        lambda c: setattr(c, "disconnected", True),  # send drops it
        lambda c: setattr(c.flow, "write_paused", True),  # send waits first
        lambda c: setattr(c, "access_log", True),  # send logs it
        lambda c: setattr(c, "chunked_encoding", False),
        lambda c: c.scope.update(method="HEAD"),  # no body
    ],
)
def test_whatever_send_would_do_otherwise_is_left_to_it(change: Any) -> None:
    _refuses(change)


def test_no_head_for_another_servers_send() -> None:
    async def other_server_send(message: Any) -> None:  # pragma: no cover
        pass

    assert stream_head(other_server_send, 200, []) is False


def _started() -> StandInCycle:
    cycle = StandInCycle()
    assert stream_head(cycle.send, 200, [])
    cycle.writes.clear()
    return cycle


def test_a_part_and_the_end_as_send_writes_them_and_the_response_complete() -> None:
    cycle = _started()
    assert body_part(cycle.send, b"abc", True) and body_part(cycle.send, b"x" * 3000, True)
    assert cycle.writes == [b"3\r\nabc\r\n", b"bb8\r\n" + b"x" * 3000 + b"\r\n"]
    assert (cycle.response_complete, cycle.message_event.is_set, cycle.told) == (False, False, 0)
    assert body_part(cycle.send, b"end", False)
    assert cycle.writes[-1] == b"3\r\nend\r\n0\r\n\r\n"
    assert (cycle.response_complete, cycle.message_event.is_set, cycle.told) == (True, True, 1)
    assert not cycle.closed  # kept alive
    assert body_part(cycle.send, b"more", True) is False  # complete: send raises
    closing = _started()
    closing.keep_alive = False
    assert body_part(closing.send, b"", False)
    assert closing.writes == [b"0\r\n\r\n"] and closing.closed and closing.told == 1


@pytest.mark.parametrize(
    "change",
    [
        lambda c: setattr(c, "response_started", False),  # no head yet: send raises
        lambda c: setattr(c, "chunked_encoding", False),  # a Content-Length body
        lambda c: setattr(c, "disconnected", True),  # send drops it
        lambda c: setattr(c.flow, "write_paused", True),  # send waits first
        lambda c: c.scope.update(method="HEAD"),  # send writes no body
    ],
)
@pytest.mark.parametrize("more", [True, False])
def test_a_part_send_would_treat_otherwise_is_left_to_it(change: Any, more: bool) -> None:
    cycle = _started()
    change(cycle)
    assert body_part(cycle.send, b"abc", more) is False
    assert cycle.writes == [] and not cycle.response_complete and cycle.told == 0
