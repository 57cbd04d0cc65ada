"""HTTP/1.1 correctness of the client-facing protocol (proxy/edge/limits.py) on raw loopback
sockets.

One answer per request, whatever the client does: an early answer (200, 404, 413) to a request
whose body is still unfinished is never followed by a 408 when the body times out (the
connection is just closed); pipelined requests arriving in one read are each bounded as their
own head and all answered in order; `Upgrade: h2c` (curl --http2 over cleartext) and
`Upgrade: websocket` are ignored and the request is answered over HTTP/1.1, its body read; and
the open-connections gauge comes back down after upgrade attempts.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from proxy.asgi import Receive, Scope, Send, read_body, respond, serve_lifespan
from proxy.edge.limits import APP_STATE_KEY, Connections, ConnLimits
from proxy.server.serve import NoDelayHttpToolsProtocol
from tests.support import ServerThread, serving, until

pytestmark = pytest.mark.e2e

GUARD_S = 10.0  # a socket read that takes this long is a hang: the test fails
TEXT = b"text/plain"


class App:
    """Publishes its connection limits like the proxy's edge, and answers:
    /health at once (200, the body unread); /too-large at once (413, the body unread);
    /echo with the body it read; /n/<x> with <x>; anything else 404. A WebSocket is closed
    at once (as Starlette does with no WebSocket route)."""

    def __init__(self, limits: ConnLimits) -> None:
        self.connections = Connections(limits)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            scope["state"][APP_STATE_KEY] = self.connections
            await serve_lifespan(receive, send)
            return
        if scope["type"] == "websocket":
            await receive()
            await send({"type": "websocket.close"})
            return
        path = scope["path"]
        if path == "/health":
            await respond(send, 200, b"ok", TEXT)
        elif path == "/too-large":
            await respond(send, 413, b"too large", TEXT)
        elif path == "/echo":
            await respond(send, 200, await read_body(receive), TEXT)
        elif path.startswith("/n/"):
            await respond(send, 200, path[3:].encode(), TEXT)
        else:
            await respond(send, 404, b"not found", TEXT)


@pytest.fixture
def server() -> Iterator[Callable[..., tuple[ServerThread, App]]]:
    """server(**limits): the production protocol in front of App, with these ConnLimits."""
    with_servers: list[Any] = []

    def start(**limits: Any) -> tuple[ServerThread, App]:
        app = App(ConnLimits(**{"header_timeout_s": 5.0, "body_timeout_s": 5.0, **limits}))
        context = serving(app, http=NoDelayHttpToolsProtocol)
        with_servers.append(context)
        return context.__enter__(), app

    yield start
    for context in with_servers:
        context.__exit__(None, None, None)


class Conn:
    """A raw client connection that reads whole responses (Content-Length bodies)."""

    def __init__(self, server: ServerThread) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=GUARD_S)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _more(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            assert self._more(), f"closed before a whole response head: {self.buf!r}"
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        size = int(headers["content-length"])
        while len(self.buf) < size:
            assert self._more(), "closed before the whole response body"
        body, self.buf = self.buf[:size], self.buf[size:]
        return int(lines[0].split()[1]), headers, body

    def rest(self) -> bytes:
        """Everything until the server closes the connection."""
        while self._more():
            pass
        return self.buf

    def close(self) -> None:
        self.sock.close()


# -- item 7: an early answer, then the body timeout -------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/health", 200), ("POST", "/too-large", 413), ("POST", "/nowhere", 404)],
)
def test_an_early_answer_is_not_followed_by_a_408_when_the_body_times_out(
    server: Callable[..., tuple[ServerThread, App]],
    caplog: pytest.LogCaptureFixture,
    method: str,
    path: str,
    status: int,
) -> None:
    srv, app = server(body_timeout_s=0.3)
    conn = Conn(srv)
    caplog.set_level(logging.INFO, logger="warmroute.limits")
    # 100 bytes declared, 10 sent: the app answers before the body is complete.
    conn.send(f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n".encode())
    conn.send(b"0123456789")
    assert conn.response()[0] == status
    assert conn.rest() == b""  # the body timed out: closed, and no second response
    conn.close()
    assert app.connections.refused["body_timeout"] == 1
    until(lambda: app.connections.open == 0, "the connection to be counted closed")
    assert any("already answered" in r.getMessage() for r in caplog.records), caplog.text


# -- item 8: pipelined requests in one read ---------------------------------------------------


def test_pipelined_requests_in_one_read_are_each_bounded_as_a_head_and_all_answered(
    server: Callable[..., tuple[ServerThread, App]],
) -> None:
    srv, app = server(max_header_bytes=1024)
    conn = Conn(srv)
    # 40 complete heads (~1.7 kB together, more than the bound) and the start of a 41st.
    heads = b"".join(b"GET /n/%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(40))
    conn.send(heads + b"GET /n/40 HTTP/1.1\r\nhost: x\r\nx-spl")
    for i in range(40):
        assert conn.response()[::2] == (200, b"%d" % i)
    conn.send(b"it: 1\r\n\r\n")
    assert conn.response()[2] == b"40"
    # A 100 kB body and the next heads together: body bytes are no part of a head.
    body = b"b" * 100_000
    post = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body)
    after = b"GET /n/after HTTP/1.1\r\nhost: x\r\n\r\nGET /n/split HTTP/1.1\r\nx-sp"
    conn.send(post + body + after)
    status, _, echoed = conn.response()
    assert status == 200 and echoed == body
    assert conn.response()[2] == b"after"
    conn.send(b"lit: 1\r\n\r\n")
    assert conn.response()[2] == b"split"
    # Each head is still bounded, and its 431 comes after the answer to the one before it.
    small = b"GET /n/small HTTP/1.1\r\nhost: x\r\n\r\n"
    for big in (b"x-big: " + b"y" * 1100 + b"\r\n\r\n", b"x-growing: " + b"y" * 1100):
        conn.send(small + b"GET /n/big HTTP/1.1\r\nhost: x\r\n" + big)
        assert conn.response()[::2] == (200, b"small")
        assert conn.response()[0] == 431
        assert conn.rest() == b""
        conn.close()
        conn = Conn(srv)
    conn.close()
    assert app.connections.refused["header_too_large"] == 2


# -- item 9: Upgrade: h2c ---------------------------------------------------------------------

H2C = (
    b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: Upgrade, HTTP2-Settings\r\n"
    b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\ncontent-length: 5\r\n\r\n"
)


def test_an_h2c_upgrade_is_ignored_and_the_request_answered_over_http1_with_its_body(
    server: Callable[..., tuple[ServerThread, App]],
) -> None:
    srv, app = server()
    conn = Conn(srv)
    conn.send(H2C + b"hello" + b"GET /n/next HTTP/1.1\r\nhost: x\r\n\r\n")  # one read
    assert conn.response()[::2] == (200, b"hello")
    assert conn.response()[::2] == (200, b"next")  # the connection is still HTTP/1.1
    conn.send(H2C)
    conn.send(b"world")  # the body in a later read
    assert conn.response()[::2] == (200, b"world")
    conn.close()
    assert not any(app.connections.refused.values())


def test_curl_http2_over_cleartext_gets_its_post_answered_over_http1(
    server: Callable[..., tuple[ServerThread, App]],
) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    srv, _ = server()
    out = subprocess.run(
        [
            curl,
            *("-sS", "--http2", "-d", "hello curl", "-w", " %{http_code} %{http_version}"),
            *("--max-time", str(GUARD_S), srv.url + "/echo"),
        ],
        capture_output=True,
        text=True,
        timeout=GUARD_S + 5,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hello curl 200 1.1"


# -- item 10: WebSocket upgrade attempts and the open-connections gauge -----------------------


def test_a_websocket_upgrade_gets_a_plain_http_answer_and_the_gauge_comes_back_down(
    server: Callable[..., tuple[ServerThread, App]],
) -> None:
    srv, app = server()
    for _ in range(3):
        conn = Conn(srv)
        conn.send(
            b"GET /ws HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: websocket\r\n"
            b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
        )
        status, _, body = conn.response()
        assert (status, body) == (404, b"not found")  # the app's answer, over HTTP/1.1
        conn.close()
    until(lambda: app.connections.open == 0, "the open-connections gauge to come back to 0")
