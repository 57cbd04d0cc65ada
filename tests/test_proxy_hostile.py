"""Hostile backends on real loopback sockets, the official openai client in front.

Each backend is a raw TCP server that misbehaves in one exact way at the byte level: a
stream cut inside an SSE event, cut inside an HTTP chunk, a garbled or partial response
head. The client must always get either a complete answer or an openai.APIError — never a
JSONDecodeError, a silent truncation or a 500 with a traceback.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENT = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'  # noqa: E501


CLOSE_DELIMITED_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
)
RESPONSES_DELTA = (
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"item_id":"i1","output_index":0,"content_index":0,"delta":"hi","sequence_number":1}\n\n'
)
RESPONSES_COMPLETED = (
    b'event: response.completed\ndata: {"type":"response.completed","sequence_number":2,'
    b'"response":{"id":"r1","object":"response","status":"completed","model":"m","output":[]}}'
    b"\n\n"
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _answer(status: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        len(body),
        body,
    )


MODELS = b'{"object":"list","data":[{"id":"m","object":"model"}]}'

BEHAVIOURS: dict[str, bytes] = {
    # one complete event, then half of the next, then the connection closes
    "cut_inside_event": HEAD + _chunk(EVENT) + _chunk(EVENT[:40]),
    # one complete event, then an HTTP chunk that announces more than it delivers
    "cut_inside_chunk": HEAD + _chunk(EVENT) + b"400\r\n" + EVENT[:50],
    # a status line and half a header
    "partial_head": b"HTTP/1.1 200 OK\r\ncontent-ty",
    # not HTTP at all
    "garbage_head": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    # a healthy stream
    "ok": HEAD + _chunk(EVENT) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n",
    # a body delimited by the connection's end (no length, no chunking), closed mid-event
    "close_delimited_cut": CLOSE_DELIMITED_HEAD + EVENT + EVENT[:40],
    # a chunked stream properly terminated, but before its end (no finish reason, no [DONE])
    "chunked_without_end": HEAD + _chunk(EVENT) + b"0\r\n\r\n",
    # a Responses API stream: it ends after response.completed, with no [DONE]
    "responses_ok": HEAD + _chunk(RESPONSES_DELTA) + _chunk(RESPONSES_COMPLETED) + b"0\r\n\r\n",
    "responses_cut": HEAD + _chunk(RESPONSES_DELTA) + b"0\r\n\r\n",
    # an engine that fails every request, or is too busy to take it
    "status_500": _answer(b"500 Internal Server Error", b'{"error":{"message":"boom"}}'),
    "status_429": _answer(b"429 Too Many Requests", b'{"error":{"message":"busy"}}'),
    # a wedged engine: the streaming head (vLLM sends it before the first token), then nothing
    "head_then_hang": HEAD,
    # an event that never ends: no blank line for more than the proxy holds of one event
    "oversized_event": HEAD + _chunk(EVENT) + _chunk(b'data: {"x":"' + b"a" * (5 << 20)),
}
# keep the connection open until the proxy closes it
HOLD = frozenset({"head_then_hang", "oversized_event"})


class RawBackend:
    """Answers GET /v1/models properly and every POST with its scripted bytes, then closes."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour  # may be changed while it serves
        self.reply: bytes | None = None  # bytes of its own, instead of the behaviour's
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.posts = 0
        self.released = threading.Event()  # the proxy closed a held connection
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                part = conn.recv(65536)
                if not part:
                    return
                data += part
            head, _, body = data.partition(b"\r\n\r\n")
            if head.startswith(b"GET"):
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d"
                    b"\r\nconnection: close\r\n\r\n%s" % (len(MODELS), MODELS)
                )
                return
            length = int(
                next(
                    (
                        ln.split(b":")[1]
                        for ln in head.split(b"\r\n")
                        if ln.lower().startswith(b"content-length")
                    ),
                    b"0",
                )
            )
            while len(body) < length:
                body += conn.recv(65536)
            self.posts += 1
            behaviour = self.behaviour
            conn.sendall(BEHAVIOURS[behaviour] if self.reply is None else self.reply)
            if behaviour in HOLD:
                with contextlib.suppress(OSError):  # a reset, when the proxy left bytes unread
                    while conn.recv(65536):
                        pass
                self.released.set()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw_backend() -> Iterator[Callable[[str], RawBackend]]:
    made: list[RawBackend] = []

    def make(behaviour: str) -> RawBackend:
        b = RawBackend(behaviour)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def _client(proxy: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0, timeout=20)  # type: ignore[attr-defined]


def _chat_until_api_error(client: openai.OpenAI) -> tuple[list[str], openai.APIError]:
    """Stream one chat that must end in APIError: the content that came first, and the error."""
    got: list[str] = []
    with pytest.raises(openai.APIError) as err:
        for chunk in client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        ):
            got.extend(c.delta.content or "" for c in chunk.choices)
    return got, err.value


@pytest.mark.parametrize("behaviour", ["cut_inside_event", "cut_inside_chunk"])
def test_a_stream_cut_mid_event_raises_api_error_in_the_openai_client(
    behaviour: str, raw_backend: Callable[[str], RawBackend], proxy_server: Callable[..., object]
) -> None:
    backend = raw_backend(behaviour)
    proxy = proxy_server([backend.url])
    client = _client(proxy)
    for _ in range(5):
        got, err = _chat_until_api_error(client)
        assert got == ["hi"]  # the complete event arrived; the cut one did not
        assert "broke off" in str(err)


@pytest.mark.parametrize("behaviour", ["close_delimited_cut", "chunked_without_end"])
def test_a_stream_the_backend_ends_cleanly_before_its_end_raises_api_error(
    behaviour: str, raw_backend: Callable[[str], RawBackend], proxy_server: Callable[..., object]
) -> None:
    backend = raw_backend(behaviour)
    proxy = proxy_server([backend.url])
    got, err = _chat_until_api_error(_client(proxy))
    assert got == ["hi"]  # the complete event arrived; a cut one did not
    assert "before it was complete" in str(err)
    assert err.code == "incomplete_stream"


def test_an_event_that_never_ends_is_cut_off_with_an_api_error_and_its_upstream_closed(
    raw_backend: Callable[[str], RawBackend], proxy_server: Callable[..., object]
) -> None:
    backend = raw_backend("oversized_event")
    proxy = proxy_server([backend.url])
    got, err = _chat_until_api_error(_client(proxy))
    assert got == ["hi"]
    assert err.code == "event_too_large"
    assert backend.released.wait(10)  # the proxy let go of the backend's connection


def test_a_responses_stream_ends_at_response_completed_and_raises_when_cut_before_it(
    raw_backend: Callable[[str], RawBackend], proxy_server: Callable[..., object]
) -> None:
    backend = raw_backend("responses_ok")
    proxy = proxy_server([backend.url])
    client = _client(proxy)
    events = list(client.responses.create(model="m", input="hi", stream=True))
    assert [e.type for e in events] == ["response.output_text.delta", "response.completed"]
    backend.behaviour = "responses_cut"
    got: list[str] = []
    with pytest.raises(openai.APIError) as err:
        for event in client.responses.create(model="m", input="hi", stream=True):
            got.append(event.type)
    assert got == ["response.output_text.delta"]
    assert err.value.code == "incomplete_stream"  # type: ignore[attr-defined]


@pytest.mark.parametrize("behaviour", ["partial_head", "garbage_head"])
def test_an_invalid_response_head_is_retried_on_another_backend(
    behaviour: str, raw_backend: Callable[[str], RawBackend], proxy_server: Callable[..., object]
) -> None:
    bad, good = raw_backend(behaviour), raw_backend("ok")
    proxy = proxy_server([bad.url, good.url], policy="round_robin")
    client = _client(proxy)
    for _ in range(10):
        chunks = list(
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True
            )
        )
        assert [c.choices[0].delta.content for c in chunks if c.choices] == ["hi"]
    assert good.posts == 10


def test_with_only_a_garbled_backend_the_client_gets_a_clear_503(
    raw_backend: Callable[[str], RawBackend], proxy_server: Callable[..., object]
) -> None:
    bad = raw_backend("garbage_head")
    proxy = proxy_server([bad.url])
    with pytest.raises(openai.APIStatusError) as err:
        _client(proxy).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
    assert err.value.status_code == 503
    assert "invalid" in err.value.message.lower()


def _chat(proxy: object) -> list[str]:
    chunks = _client(proxy).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    return [c.choices[0].delta.content or "" for c in chunks if c.choices]


def _circuit(proxy: object, name: str) -> tuple[bool, str, dict[str, object]]:
    """What /ready says of the backend (up, its circuit) and /admin/backends' detail (read
    just after: near the end of an ejection the two may differ)."""
    url = proxy.url  # type: ignore[attr-defined]
    ready = {b["name"]: b for b in httpx.get(url + "/ready").json()["backends"]}[name]
    admin = {b["name"]: b for b in httpx.get(url + "/admin/backends").json()["backends"]}[name]
    return ready["up"], ready["circuit"], {**admin["circuit"], "up": admin["up"]}


def test_ready_shows_the_breaker_go_open_half_open_and_closed_past_a_probe_without_verdict(
    raw_backend: Callable[[str], RawBackend], proxy_server: Callable[..., object]
) -> None:
    backend = raw_backend("status_500")
    name = backend.url.removeprefix("http://")
    proxy = proxy_server(
        [backend.url], config={"outlier": {"consecutive_failures": 1, "ejection_s": 2.0}}
    )
    with pytest.raises(openai.APIStatusError):
        _chat(proxy)
    up, circuit, detail = _circuit(proxy, name)
    assert (up, circuit, detail["ejections"]) == (False, "open", 1)
    assert (detail["up"], detail["state"]) == (False, "open")
    assert httpx.get(proxy.url + "/ready").status_code == 503  # type: ignore[attr-defined]
    backend.behaviour = "status_429"
    deadline = time.monotonic() + 10
    while _circuit(proxy, name)[:2] != (True, "half_open"):  # the 2 s ejection ends
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(openai.APIStatusError):  # the probe: busy, which is no verdict
        _chat(proxy)
    assert backend.posts == 2
    up, circuit, detail = _circuit(proxy, name)
    assert (up, circuit, detail["probe_out"]) == (True, "half_open", False)  # not stuck
    assert (detail["up"], detail["state"]) == (True, "half_open")
    backend.behaviour = "ok"
    assert _chat(proxy) == ["hi"]  # the next probe answers: back in rotation
    up, circuit, detail = _circuit(proxy, name)
    assert (up, circuit, detail["ejections"]) == (True, "closed", 0)
    assert (detail["up"], detail["state"]) == (True, "closed")
    assert httpx.get(proxy.url + "/ready").status_code == 200  # type: ignore[attr-defined]


def test_a_backend_that_sends_heads_but_no_first_byte_is_ejected(
    raw_backend: Callable[[str], RawBackend], proxy_server: Callable[..., object]
) -> None:
    wedged, good = raw_backend("head_then_hang"), raw_backend("ok")
    proxy = proxy_server(
        [wedged.url, good.url],
        policy="round_robin",
        config={
            "timeouts": {"first_byte_s": 0.3},
            "outlier": {"consecutive_failures": 3, "ejection_s": 60.0},
        },
    )
    for _ in range(8):
        assert _chat(proxy) == ["hi"]  # each first-byte timeout retried on the good one
    up, circuit, detail = _circuit(proxy, wedged.url.removeprefix("http://"))
    assert (up, circuit, detail["last_failure_kind"]) == (False, "open", "timeout")
    assert wedged.posts == 3  # ejected after the third, not tried since
