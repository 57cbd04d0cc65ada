"""Client connection limits (proxy/edge/limits.py) against a real `warmroute serve` subprocess.

Hostile clients on raw sockets (an oversized head, too many header fields, a slowloris head, a
trickled body, idle connections, more connections than allowed) each get their answer (431,
408, 503, or a close) instead of holding the proxy; a normal client is served while they try,
and the server's descriptors come back down once they are gone (read from /proc/<pid>/fd).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.bench.mock import MockBackend, prompt_directives
from tests.support import ServerThread, free_port

MODEL = "test-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
# Small enough to hit quickly, large enough that a loaded 2-core machine never trips them
# by accident while the normal client is served.
MAX_HEADER_BYTES, MAX_HEADERS, MAX_CONNECTIONS = 4096, 16, 24
LIMITS: dict[str, float] = {
    "max_header_bytes": MAX_HEADER_BYTES,
    "max_headers": MAX_HEADERS,
    "header_timeout_s": 1.5,
    "body_timeout_s": 1.5,
    "keepalive_timeout_s": 1.5,
    "max_connections": MAX_CONNECTIONS,
}
GUARD_S = 15.0  # a socket read that takes this long is a hang: the test fails


@dataclass
class Served:
    """The `warmroute serve` process under test."""

    pid: int
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def client_sockets(self) -> int:
        """Connections from clients that the server holds open (not its listening socket)."""
        inodes = set()
        for fd in os.listdir(f"/proc/{self.pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{self.pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        held = 0
        for table in ("tcp", "tcp6"):
            for line in Path(f"/proc/{self.pid}/net/{table}").read_text().splitlines()[1:]:
                cols = line.split()
                local_port, state, inode = int(cols[1].rsplit(":", 1)[1], 16), cols[3], cols[9]
                if local_port == self.port and state != "0A" and inode in inodes:  # 0A: LISTEN
                    held += 1
        return held

    def refused(self) -> dict[str, float]:
        """warmroute.connections.refused by reason, from the proxy's /metrics."""
        out: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("warmroute_connections_refused"):
                reason = line.split('warmroute_reason="', 1)[1].split('"', 1)[0]
                out[reason] = float(line.rsplit(" ", 1)[1])
        return out

    def admitted(self) -> float:
        """Requests holding an admission slot (warmroute.admission.inflight)."""
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("warmroute_admission_inflight"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("warmroute_admission_inflight is not in /metrics")


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve(LIMITS) as server:
        yield server


@contextlib.contextmanager
def serve(
    limits: dict[str, float], soft_nofile: int | None = None, app: MockBackend | None = None
) -> Iterator[Served]:
    """`warmroute serve` with these server.* settings, in front of a mock backend (`app`, or
    one of three chunks); started with that soft open-file limit, if given."""
    backend = ServerThread(app or MockBackend(chunks=3, models=(MODEL,))).start()
    port = free_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        **{f"WARMROUTE_SERVER__{k.upper()}": str(v) for k, v in limits.items()},
    }
    args = [sys.executable, "-m", "proxy", "serve", "--port", str(port), "--backend", backend.url]
    if soft_nofile is not None:  # the shell sets it and execs: the pid stays serve's
        args = ["sh", "-c", f'ulimit -Sn {soft_nofile} && exec "$@"', "sh", *args]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        server = Served(proc.pid, port)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.url + "/ready", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.05)  # another process: nothing to wait on but its answer
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        backend.stop()


@pytest.fixture
def baseline(served: Served) -> Iterator[Callable[[], None]]:
    """The server's descriptors before a test (after one request, so pools are warm); the
    returned check waits until no client connection is held and no more fds are open."""
    assert normal_request(served) == 200
    _until(lambda: served.client_sockets() == 0)
    before = served.fds()

    def back_to_baseline() -> None:
        _until(lambda: served.client_sockets() == 0 and served.fds() <= before)

    yield back_to_baseline


def normal_request(served: Served) -> int:
    """What a well-behaved client gets: one chat completion on its own connection."""
    with httpx.Client(base_url=served.url, timeout=GUARD_S) as http:
        r = http.post("/v1/chat/completions", json=CHAT)
        if r.status_code == 200:
            assert r.json()["choices"][0]["message"]["content"]
        return r.status_code


def _until(predicate: Callable[[], bool], within_s: float = GUARD_S) -> None:
    """Wait for another process's state (nothing announces it)."""
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.02)


def connect(served: Served) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=GUARD_S)
    sock.settimeout(GUARD_S)
    return sock


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    sock.close()
    return data


def answer(raw: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    """(status, headers, JSON body) of one raw HTTP/1.1 response; every answer, refusals
    included, carries a request id."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert headers.get("x-request-id"), head
    return int(lines[0].split()[1]), headers, json.loads(body)


def trickle(sock: socket.socket, data: bytes, every_s: float = 0.1) -> bytes:
    """Send `data` a byte at a time, as a slowloris client does, until the server answers or
    closes; then return what it sent."""
    for i in range(len(data)):
        try:
            sock.sendall(data[i : i + 1])
        except (BrokenPipeError, ConnectionResetError):
            break
        sock.settimeout(every_s)
        try:
            first = sock.recv(65536)
        except TimeoutError:
            continue
        finally:
            sock.settimeout(GUARD_S)
        return first + read_to_close(sock)
    return read_to_close(sock)


def in_threads(work: Callable[[], bytes], n: int) -> tuple[list[threading.Thread], list[bytes]]:
    out: list[bytes] = []
    threads = [threading.Thread(target=lambda: out.append(work()), daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, out


@pytest.mark.e2e
def test_an_oversized_request_head_gets_431_even_before_it_is_complete(
    served: Served, baseline: Callable[[], None]
) -> None:
    before = served.refused()
    big = b"x" * (MAX_HEADER_BYTES + 1000)
    whole = connect(served)
    whole.sendall(b"GET /health HTTP/1.1\r\nhost: proxy\r\nx-big: " + big + b"\r\n\r\n")
    growing = connect(served)  # never finishes its head: refused once it passes the bound
    growing.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\nx-big: " + big)
    assert normal_request(served) == 200
    for sock in (whole, growing):
        status, headers, body = answer(read_to_close(sock))
        assert status == 431 and headers["connection"] == "close"
        assert body["error"]["code"] == "header_too_large"
        assert "server.max_header_bytes" in body["error"]["message"]
    assert served.refused()["header_too_large"] == before.get("header_too_large", 0) + 2
    baseline()


@pytest.mark.e2e
def test_more_header_fields_than_the_limit_get_431(
    served: Served, baseline: Callable[[], None]
) -> None:
    def request(fields: int) -> bytes:
        sock = connect(served)
        extra = b"".join(b"x-f%d: v\r\n" % i for i in range(fields - 1))
        sock.sendall(
            b"GET /health HTTP/1.1\r\nhost: proxy\r\nconnection: close\r\n"
            b"x-request-id: refused-431\r\n" + extra
        )
        sock.sendall(b"\r\n")
        return read_to_close(sock)

    limit = MAX_HEADERS
    status, headers, body = answer(request(limit))  # host + connection + limit: two too many
    assert status == 431 and body["error"]["code"] == "too_many_headers"
    assert headers["x-request-id"] == "refused-431"  # the client's own, to match its logs
    assert f"at most {limit}" in body["error"]["message"]
    assert answer(request(limit - 2))[0] == 200  # exactly at the limit is fine
    assert normal_request(served) == 200
    baseline()


@pytest.mark.e2e
def test_slowloris_heads_get_408_while_a_normal_client_is_served(
    served: Served, baseline: Callable[[], None]
) -> None:
    before = served.refused()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\nx-slow: " + b"a" * 200

    def slowloris() -> bytes:
        return trickle(connect(served), head)

    threads, got = in_threads(slowloris, 10)
    assert normal_request(served) == 200  # served while ten heads trickle in
    for t in threads:
        t.join(GUARD_S)
    assert len(got) == 10
    for raw in got:
        status, _, body = answer(raw)
        assert status == 408 and body["error"]["code"] == "header_timeout"
    assert served.refused()["header_timeout"] == before.get("header_timeout", 0) + 10
    baseline()


@pytest.mark.e2e
def test_a_trickled_body_gets_408_while_a_normal_client_is_served(
    served: Served, baseline: Callable[[], None]
) -> None:
    body = json.dumps({**CHAT, "pad": "p" * 200}).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json"
        b"\r\ncontent-length: %d\r\n\r\n" % len(body)
    )

    def slow_body() -> bytes:
        sock = connect(served)
        sock.sendall(head)
        return trickle(sock, body)

    threads, got = in_threads(slow_body, 5)
    assert normal_request(served) == 200
    for t in threads:
        t.join(GUARD_S)
    assert len(got) == 5
    for raw in got:
        status, _, error = answer(raw)
        assert status == 408 and error["error"]["code"] == "body_timeout"
        assert "server.body_timeout_s" in error["error"]["message"]
    baseline()


@pytest.mark.e2e
def test_idle_connections_are_closed_fresh_or_kept_alive(
    served: Served, baseline: Callable[[], None]
) -> None:
    before = served.refused()
    silent = [connect(served) for _ in range(20)]  # never send a byte
    kept = connect(served)  # one request, then idle on keep-alive
    kept.sendall(b"GET /health HTTP/1.1\r\nhost: proxy\r\n\r\n")
    first = kept.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    assert normal_request(served) == 200
    assert all(read_to_close(s) == b"" for s in silent)  # closed, no answer to no request
    assert read_to_close(kept) == b""  # uvicorn's keep-alive timeout (keepalive_timeout_s)
    assert served.refused()["idle_timeout"] >= before.get("idle_timeout", 0) + 20
    baseline()


@pytest.mark.e2e
def test_past_max_connections_a_new_connection_gets_503_at_once(
    served: Served, baseline: Callable[[], None]
) -> None:
    cap = MAX_CONNECTIONS
    with httpx.Client(base_url=served.url, timeout=GUARD_S) as normal:
        assert normal.post("/v1/chat/completions", json=CHAT).status_code == 200  # it is open
        _until(lambda: served.client_sockets() == 1)
        hostile = [connect(served) for _ in range(cap + 6)]
        _until(lambda: served.client_sockets() >= cap)  # the server holds cap, refuses 6
        # The normal client's connection is one of those held: it is still served.
        assert normal.post("/v1/chat/completions", json=CHAT).status_code == 200
        answers = [read_to_close(s) for s in hostile]
    refused = [answer(a) for a in answers if a]
    assert len(refused) == 7  # one was held for the normal client
    for status, headers, body in refused:
        assert status == 503 and headers["connection"] == "close"
        assert body["error"]["code"] == "too_many_connections"
        assert body["error"]["type"] == "server_error"
    assert answers.count(b"") == cap - 1  # the held ones: closed idle, no answer
    baseline()
    assert normal_request(served) == 200


@pytest.mark.e2e
def test_the_default_connection_cap_is_taken_from_the_raised_open_file_limit() -> None:
    # Started with the common soft limit of 1024, serve raises it (to the hard limit, at
    # most 65536) before the app derives max_connections from it: the cap is half the raised
    # limit, not the 480 that 1024 gives.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard open-file limit ({hard}) leaves nothing to raise")
    held_count = 600  # past 480, well within the raised cap
    with serve({}, soft_nofile=1024) as served:
        limits = Path(f"/proc/{served.pid}/limits").read_text()
        soft = int(next(ln for ln in limits.splitlines() if "open files" in ln).split()[3])
        assert soft > 1024
        held = [connect(served) for _ in range(held_count)]
        try:
            assert normal_request(served) == 200  # the 601st connection: not refused
            assert served.refused()["too_many_connections"] == 0
        finally:
            for sock in held:
                sock.close()


@pytest.mark.e2e
def test_a_client_that_stops_reading_is_cut_off_and_its_upstream_closed() -> None:
    app = MockBackend(chunks=3, models=(MODEL,), script=prompt_directives, record=True)
    assert app.rec is not None
    with serve({"write_timeout_s": 1.0}, app=app) as served:
        body = json.dumps(
            {**CHAT, "stream": True, "messages": [{"role": "user", "content": "chunks:1000000"}]}
        ).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills in a moment
        sock.settimeout(GUARD_S)
        sock.connect(("127.0.0.1", served.port))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: "
            b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        try:
            assert sock.recv(16).startswith(b"HTTP/1.1 200")  # streaming; from here, unread
            assert normal_request(served) == 200  # other clients are served meanwhile
            # Cut off once its writes stalled for 1 s: the upstream is closed, so the engine
            # stops generating, and the admission slot and the connection come back.
            assert app.rec.disconnected.wait(GUARD_S)
            assert app.rec.completed == 1  # the normal request's; the stalled one was cut
            _until(lambda: served.client_sockets() == 0 and served.admitted() == 0)
            assert served.refused()["write_timeout"] == 1
            assert normal_request(served) == 200
        finally:
            sock.close()
