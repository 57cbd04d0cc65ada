"""Hostile backends, issue 25 item 6: timeouts that measure progress, not silence.

A backend that trickles bytes must not hold a client past the timeouts: the first-byte clock
(request sent -> first body byte) is not stopped by a response head, nor by any number of
`100 Continue`s, and the idle clock is reset only by a complete SSE event (a stream) or not at
all (a whole body: due within idle_s of its first byte). Each backend here is a raw loopback
socket that sends a script, one piece per pacing interval, and records how far it got: the
client must get the proper error while the backend still had pieces left to send (and the
proxy closed the connection), not after the trickle ran out.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest

from proxy.config import TimeoutsConfig
from proxy.upstream.pool import Upstream
from tests.support import ServerThread, free_port
from tests.test_proxy_hostile import EVENT, HEAD, MODELS, _chunk
from tests.test_upstream_hygiene import COMPLETION

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"
PACE_S = 0.05  # between two pieces of a script: well inside every timeout below
TIMEOUT_S = 0.4  # first_byte_s and idle_s of the proxy under test
# Long enough that without the fix the trickle would have held the client for ~3 s.
PIECES = 60
JSON_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def _bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


class TrickleBackend:
    """Answers GET /v1/models at once and every POST with `script`, one piece per PACE_S
    (`pieces_sent` counts them). `cut` is set when the proxy closed the connection before
    the script's end, `finished` when the whole script went out."""

    def __init__(self, script: list[bytes]) -> None:
        self.script = script
        self.pieces_sent = 0
        self.cut = threading.Event()
        self.finished = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", free_port()))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            data = b""
            while b"\r\n\r\n" not in data:
                part = conn.recv(65536)
                if not part:
                    return
                data += part
            if data.startswith(b"GET"):
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d"
                    b"\r\nconnection: close\r\n\r\n%s" % (len(MODELS), MODELS)
                )
                return
            self._trickle(conn)

    def _trickle(self, conn: socket.socket) -> None:
        closed = threading.Event()
        threading.Thread(target=self._watch, args=(conn, closed), daemon=True).start()
        for i, piece in enumerate(self.script):
            if i and closed.wait(PACE_S):  # the pacing; the proxy closing ends it at once
                self.cut.set()
                return
            try:
                conn.sendall(piece)
            except OSError:
                self.cut.set()
                return
            self.pieces_sent += 1
        self.finished.set()
        closed.wait(10)  # hold the connection until the proxy is done with it

    @staticmethod
    def _watch(conn: socket.socket, closed: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while conn.recv(65536):
                pass
        closed.set()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def trickle() -> Iterator[Callable[[list[bytes]], TrickleBackend]]:
    made: list[TrickleBackend] = []

    def make(script: list[bytes]) -> TrickleBackend:
        made.append(TrickleBackend(script))
        return made[-1]

    yield make
    for b in made:
        b.close()


def _proxy(proxy_server: Callable[..., ServerThread], b: TrickleBackend) -> ServerThread:
    return proxy_server(
        [b.url],
        config={
            "timeouts": {"first_byte_s": TIMEOUT_S, "idle_s": TIMEOUT_S},
            "retries": {"max_attempts": 1},
        },
    )


def _cut_short(b: TrickleBackend) -> None:
    """The proxy gave up on the backend (closed its connection) with pieces still unsent."""
    assert b.cut.wait(5), "the proxy never closed the trickling connection"
    assert not b.finished.is_set() and b.pieces_sent < len(b.script), b.pieces_sent


def _post(proxy: ServerThread, stream: bool) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return httpx.post(proxy.url + CHAT, json=body, timeout=10)


def _first_byte_timeout(r: httpx.Response) -> None:
    """What a client gets when no backend sent a first body byte in time: a 503 naming it."""
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "backends_unavailable", error
    assert "no response headers within the first-byte timeout" in error["message"], error


def test_a_head_trickled_byte_by_byte_does_not_stop_the_first_byte_clock(
    trickle: Callable[[list[bytes]], TrickleBackend], proxy_server: Callable[..., ServerThread]
) -> None:
    head = HEAD.replace(b"\r\n\r\n", b"\r\nx-pad: " + b"p" * PIECES + b"\r\n\r\n")
    b = trickle([*_bytewise(head), _chunk(EVENT) + DONE])
    _first_byte_timeout(_post(_proxy(proxy_server, b), stream=True))
    _cut_short(b)


def test_repeated_100_continue_does_not_stop_the_first_byte_clock(
    trickle: Callable[[list[bytes]], TrickleBackend], proxy_server: Callable[..., ServerThread]
) -> None:
    b = trickle([CONTINUE] * PIECES + [JSON_HEAD % len(COMPLETION) + COMPLETION])
    _first_byte_timeout(_post(_proxy(proxy_server, b), stream=False))
    _cut_short(b)


def test_an_event_trickled_byte_by_byte_ends_the_stream_with_an_idle_timeout(
    trickle: Callable[[list[bytes]], TrickleBackend], proxy_server: Callable[..., ServerThread]
) -> None:
    # One whole event (the first byte: the client has its 200), then the next one a byte per
    # HTTP chunk: bytes keep coming, but no event ends.
    b = trickle([HEAD + _chunk(EVENT)] + [_chunk(c) for c in _bytewise(EVENT)] + [DONE])
    assert len(EVENT) > 2 * PIECES
    r = _post(_proxy(proxy_server, b), stream=True)
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[0] + "\n\n" == EVENT.decode() and events[-1] == "data: [DONE]"
    error = orjson.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "idle_timeout" and "no complete event" in error["message"], error
    assert len(events) == 3  # nothing of the trickled event reached the client
    _cut_short(b)


def test_complete_events_are_progress_however_long_the_stream(
    trickle: Callable[[list[bytes]], TrickleBackend], proxy_server: Callable[..., ServerThread]
) -> None:
    # 12 events PACE_S apart: the stream lasts past idle_s, each gap well inside it.
    b = trickle([HEAD] + [_chunk(EVENT)] * 12 + [DONE])
    r = _post(_proxy(proxy_server, b), stream=True)
    assert r.status_code == 200 and "error" not in r.text, r.text
    assert r.text.count(EVENT.decode()) == 12 and r.text.endswith("data: [DONE]\n\n")
    # The backend's thread marks its end after its last send, which the client may have read
    # before that thread runs again (a loaded machine): wait for it, bounded.
    assert b.finished.wait(5)


def test_a_whole_body_trickled_byte_by_byte_is_refused_within_idle_s_of_its_first_byte(
    trickle: Callable[[list[bytes]], TrickleBackend], proxy_server: Callable[..., ServerThread]
) -> None:
    body = COMPLETION + b" " * PIECES  # JSON may end in whitespace: a valid, slow answer
    b = trickle([JSON_HEAD % len(body), *_bytewise(body)])
    r = _post(_proxy(proxy_server, b), stream=False)
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "backends_unavailable", error
    assert "response body broke off: no progress within 0.4s" in error["message"], error
    _cut_short(b)


async def test_unread_bytes_are_the_readers_delay_not_the_backends() -> None:
    """A reader (the relay, behind a slow client) that takes a buffered event after the idle
    budget gets it and the rest of the stream: the deadline passing over bytes not yet read
    is not the backend's silence."""
    took_first, lagged = asyncio.Event(), asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(HEAD + _chunk(EVENT))
        await took_first.wait()
        writer.write(_chunk(b"data: 2\n\n"))
        for _ in range(10):  # 0.5 s, past the reader's 0.2 s budget: it does not read
            await asyncio.sleep(PACE_S)
        lagged.set()
        writer.write(DONE)
        await reader.read()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    client = Upstream(TimeoutsConfig(connect_s=1, first_byte_s=1, idle_s=1))
    await client.start()
    try:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        resp = await client.post(client.url(url, "/v1/chat/completions"), b"{}", {})
        assert await resp.readany() == EVENT
        resp.set_read_timeout(0.2)
        took_first.set()
        await lagged.wait()
        rest = b""
        while data := await resp.readany():
            rest += data
            if rest.endswith(b"\n\n"):  # a complete event: progress, as the relay counts it
                resp.set_read_timeout(0.2)
        assert rest == b"data: 2\n\ndata: [DONE]\n\n"
        resp.release()
    finally:
        await client.close()
        server.close()
