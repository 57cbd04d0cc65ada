"""What a hostile backend can make the proxy hold, and what the client gets from a bad answer.

Raw loopback backends (tests.test_proxy_hostile.RawBackend) answer with exact bytes: a whole
answer past upstream.max_response_bytes (announced, chunked, close-delimited), a response head
past its bounds, a 200 that is not JSON or not an event stream, an event that is not UTF-8.
The official openai client is in front wherever what the client sees is the point. Where the
point is that the proxy stops reading, the backend writes far more than the kernel's socket
buffers hold and the test waits for its write to fail: the proxy closed the connection.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from proxy.config import TimeoutsConfig
from proxy.upstream.conn import FREE_BYTES
from proxy.upstream.pool import (
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    Upstream,
    UpstreamHeadTooLarge,
    UpstreamResponseTooLarge,
)
from tests.support import until
from tests.test_proxy_hostile import EVENT, HEAD, RawBackend, _chunk

pytestmark = pytest.mark.e2e

LIMIT = 64 * 1024  # upstream.max_response_bytes in these tests
# More than a loopback connection's socket buffers take (tcp_wmem and tcp_rmem together, a
# few MiB here) while the proxy does not read: a write of it can only finish if it does.
FLOOD = 48 << 20
COMPLETION = (
    b'{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}'
)
DONE = b"data: [DONE]\n\n"
MESSAGES = [{"role": "user", "content": "hi"}]


class FloodBackend(RawBackend):
    """A RawBackend whose POST reply is too large to sit in the socket buffers: `cut` is set
    when its write failed (the proxy closed the connection before reading all of it),
    `finished` when it all went out."""

    def __init__(self, reply: bytes) -> None:
        self.cut = threading.Event()
        self.finished = threading.Event()
        super().__init__("ok")
        self.reply = reply

    def _one(self, conn: object) -> None:
        posts = self.posts
        try:
            super()._one(conn)  # type: ignore[arg-type]
        except OSError:  # reset or broken pipe: the proxy let go mid-write
            self.cut.set()
            return
        if self.posts > posts:
            self.finished.set()


@pytest.fixture
def backends() -> Iterator[list[RawBackend]]:
    made: list[RawBackend] = []
    yield made
    for b in made:
        b.close()


def _raw(made: list[RawBackend], reply: bytes, behaviour: str = "ok") -> RawBackend:
    b = RawBackend(behaviour)
    b.reply = reply
    made.append(b)
    return b


def _flood(made: list[RawBackend], reply: bytes) -> FloodBackend:
    b = FloodBackend(reply)
    made.append(b)
    return b


def _client(proxy: object) -> openai.OpenAI:
    url = f"{proxy.url}/v1"  # type: ignore[attr-defined]
    return openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=10)


def _limited(proxy_server: Callable[..., object], urls: list[str], **flags: object) -> object:
    return proxy_server(urls, config={"upstream": {"max_response_bytes": LIMIT}}, **flags)


def _status_error(call: Callable[[], object]) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as err:
        call()
    return err.value


def _answer(content_type: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        content_type,
        len(body),
        body,
    )


# -- 1. a whole answer is read up to upstream.max_response_bytes --------------------------------


def test_an_answer_announced_over_the_limit_is_refused_before_its_body_is_read(
    backends: list[RawBackend], proxy_server: Callable[..., object]
) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n{"
    backend = _raw(backends, head % (10 << 30), behaviour="head_then_hang")
    proxy = _limited(proxy_server, [backend.url])
    client = _client(proxy)
    err = _status_error(lambda: client.chat.completions.create(model="m", messages=MESSAGES))
    assert err.status_code == 502
    assert err.code == "upstream_response_too_large"
    assert str(LIMIT) in err.message and "upstream.max_response_bytes" in err.message
    assert backend.released.wait(5)  # the proxy closed the connection, the body unread
    assert backend.posts == 1  # not retried


@pytest.mark.parametrize("framing", ["chunked", "close_delimited"])
def test_an_answer_past_the_limit_stops_being_read_and_the_client_gets_a_502(
    framing: str, backends: list[RawBackend], proxy_server: Callable[..., object]
) -> None:
    if framing == "chunked":
        piece = _chunk(b" " * 65536)
        reply = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: "
        reply += b"chunked\r\n\r\n" + _chunk(b"{") + piece * (FLOOD // len(piece))
    else:
        reply = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
        reply += b"{" + b" " * FLOOD
    backend = _flood(backends, reply)
    proxy = _limited(proxy_server, [backend.url])
    client = _client(proxy)
    err = _status_error(lambda: client.embeddings.create(model="m", input="hi"))
    assert (err.status_code, err.code) == (502, "upstream_response_too_large")
    assert str(LIMIT) in err.message
    assert backend.cut.wait(5)  # the proxy stopped reading and closed the connection
    assert not backend.finished.is_set()
    assert backend.posts == 1


def test_an_answer_within_the_limit_is_passed_on(
    backends: list[RawBackend], proxy_server: Callable[..., object]
) -> None:
    body = COMPLETION[:-1] + b',"pad":"' + b"x" * (LIMIT - len(COMPLETION) - 10) + b'"}'
    assert len(body) <= LIMIT
    backend = _raw(backends, _answer(b"application/json", body))
    proxy = _limited(proxy_server, [backend.url])
    answer = _client(proxy).chat.completions.create(model="m", messages=MESSAGES)
    assert answer.choices[0].message.content == "hi"


def _padded(size: int) -> bytes:
    """A chat completion of exactly `size` bytes."""
    return COMPLETION[:-1] + b',"pad":"' + b"x" * (size - len(COMPLETION) - 9) + b'"}'


def test_answers_held_at_once_share_one_budget_and_ordinary_answers_are_outside_it(
    backends: list[RawBackend], proxy_server: Callable[..., object]
) -> None:
    """upstream.max_buffered_bytes: a large answer half read holds its share; the next large
    one that would pass the budget is a 503 with Retry-After (not retried, no verdict on the
    backend); an ordinary answer passes meanwhile; the share comes back with the response."""
    budget_bytes = 128 << 10
    big = len(_padded(FREE_BYTES + (100 << 10)))
    hold = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    # a FloodBackend: the refused answer's write fails when the proxy closes (not an error)
    backend = _flood(backends, hold % big + _padded(big)[:FREE_BYTES])
    backend.behaviour = "head_then_hang"
    proxy = proxy_server(
        [backend.url],
        config={
            "upstream": {"max_buffered_bytes": budget_bytes},
            "timeouts": {"idle_s": 1.0},  # the held answer ends (a 502) once it is taken
        },
    )
    budget = proxy.config.app.state.upstream.body_budget  # type: ignore[attr-defined]
    client = _client(proxy)
    held: list[BaseException] = []

    def first() -> None:
        try:
            client.chat.completions.create(model="m", messages=MESSAGES)
        except openai.APIError as e:
            held.append(e)

    t = threading.Thread(target=first)
    t.start()
    until(lambda: budget.held == big - FREE_BYTES, "the first answer's share taken")
    backend.behaviour = "ok"
    backend.reply = _answer(b"application/json", _padded(FREE_BYTES + (64 << 10)))
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="m", messages=MESSAGES)
    e = err.value
    assert e.status_code == 503 and e.code == "upstream_responses_over_budget"
    assert e.response.headers["retry-after"] == "1"
    assert "upstream.max_buffered_bytes" in e.message and str(budget_bytes) in e.message
    assert backend.posts == 2  # not retried
    # an ordinary answer is outside the budget, however full it is
    backend.reply = _answer(b"application/json", _padded(FREE_BYTES))
    assert client.chat.completions.create(model="m", messages=MESSAGES).choices
    t.join(10)
    assert held and not t.is_alive()  # the held answer ended (its body timed out) ...
    until(lambda: budget.held == 0, "every share given back")  # ... and gave its share back
    backend.reply = _answer(b"application/json", _padded(FREE_BYTES + (64 << 10)))
    answer = client.chat.completions.create(model="m", messages=MESSAGES)
    assert answer.choices[0].message.content == "hi"
    until(lambda: budget.held == 0, "the last share given back")


async def test_a_refused_answer_leaves_none_of_its_bytes_to_the_garbage_collector(
    backends: list[RawBackend],
) -> None:
    """The refusal is kept on the connection and its traceback holds the reading frame: a
    cycle only the cyclic GC frees, late. What was read of the answer is not in it."""
    reply = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
    backend = _flood(backends, reply + b"{" + b" " * (4 * LIMIT))
    client = Upstream(TimeoutsConfig(connect_s=5, first_byte_s=5), max_response_bytes=LIMIT)
    await client.start()
    try:
        resp = await client.post(client.url(backend.url, "/x"), b"{}", {})
        with pytest.raises(UpstreamResponseTooLarge) as err:
            await resp.read()
        kept, tb = 0, err.value.__traceback__
        while tb is not None:
            for v in tb.tb_frame.f_locals.values():
                if isinstance(v, list):
                    kept += sum(len(x) for x in v if isinstance(x, bytes))
            tb = tb.tb_next
        assert kept == 0
        resp.release()
    finally:
        await client.close()


# -- 2. the response head is bounded ------------------------------------------------------------


def _many_headers(n: int, size: int = 0) -> bytes:
    """A head of `n` small fields (or fields of `size` bytes each) and a healthy stream."""
    value = b"v" * size if size else b"v"
    fields = b"".join(b"x-h%d: %s\r\n" % (i, value) for i in range(n))
    head = HEAD.replace(b"\r\n\r\n", b"\r\n" + fields + b"\r\n", 1)
    return head + _chunk(EVENT + DONE) + b"0\r\n\r\n"


@pytest.mark.parametrize(
    "reply",
    [
        _many_headers(1000, size=8000),  # 8 MB of fields, a whole head
        _many_headers(MAX_HEADERS + 1),  # small, but too many
    ],
    ids=["8MB_head", "too_many_fields"],
)
def test_a_head_past_its_bounds_is_a_protocol_error_retried_on_another_backend(
    reply: bytes, backends: list[RawBackend], proxy_server: Callable[..., object]
) -> None:
    bad = _flood(backends, reply)
    good = _raw(backends, HEAD + _chunk(EVENT + DONE) + b"0\r\n\r\n")
    proxy = proxy_server([bad.url, good.url], policy="round_robin")
    client = _client(proxy)
    for _ in range(2):
        chunks = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        assert [c.choices[0].delta.content for c in chunks if c.choices] == ["hi"]
    assert bad.posts == 1 and good.posts == 2  # the bad head was retried on the good one


def test_a_head_that_never_ends_is_cut_off_at_the_bound_and_the_client_gets_an_error(
    backends: list[RawBackend], proxy_server: Callable[..., object]
) -> None:
    bad = _flood(backends, b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * FLOOD)
    proxy = proxy_server([bad.url])
    client = _client(proxy)
    err = _status_error(lambda: client.chat.completions.create(model="m", messages=MESSAGES))
    assert err.status_code == 503 and err.code == "backends_unavailable"
    assert "response head" in err.message and str(MAX_HEAD_BYTES) in err.message
    assert bad.cut.wait(5)  # it stopped reading at the bound, not at the backend's end
    assert not bad.finished.is_set()


async def test_a_head_of_exactly_the_bound_passes_and_one_byte_more_does_not(
    backends: list[RawBackend],
) -> None:
    def head(size: int) -> bytes:
        start = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-pad: "
        return start + b"p" * (size - len(start) - 4) + b"\r\n\r\nok"

    assert len(head(MAX_HEAD_BYTES)) == MAX_HEAD_BYTES + 2
    client = Upstream(TimeoutsConfig(connect_s=5, first_byte_s=5))
    await client.start()
    try:
        fits = _raw(backends, head(MAX_HEAD_BYTES))
        resp = await client.post(client.url(fits.url, "/x"), b"{}", {})
        assert await resp.read() == b"ok"
        resp.release()
        over = _raw(backends, head(MAX_HEAD_BYTES + 1))
        with pytest.raises(UpstreamHeadTooLarge, match=str(MAX_HEAD_BYTES)):
            await client.post(client.url(over.url, "/x"), b"{}", {})
    finally:
        await client.close()


# -- 13. a 200 that is not what the API answers -------------------------------------------------

HTML = b"<!doctype html><html><body>Sign in to continue</body></html>"


def test_a_200_html_page_to_a_json_api_is_a_502_in_the_openai_client(
    backends: list[RawBackend], proxy_server: Callable[..., object]
) -> None:
    backend = _raw(backends, _answer(b"text/html; charset=utf-8", HTML))
    proxy = proxy_server([backend.url])
    client = _client(proxy)
    for call in (
        lambda: client.chat.completions.create(model="m", messages=MESSAGES),
        lambda: client.completions.create(model="m", prompt="hi"),
        lambda: client.embeddings.create(model="m", input="hi"),
    ):
        err = _status_error(call)  # not a `str` returned as the answer
        assert (err.status_code, err.code) == (502, "upstream_invalid_response")
        assert "not a JSON object" in err.message and "text/html" in err.message
    assert backend.posts == 3  # each once: not retried


@pytest.mark.parametrize(
    "body",
    [
        b'{"error":{"message":"engine dead","type":"InternalError","code":500}}',
        b'{"object":"error","message":"engine dead","type":"InternalError","code":500}',
    ],
)
def test_a_200_error_object_instead_of_an_answer_is_a_502_not_an_empty_completion(
    body: bytes, backends: list[RawBackend], proxy_server: Callable[..., object]
) -> None:
    backend = _raw(backends, _answer(b"application/json", body))
    client = _client(proxy_server([backend.url]))
    for call in (
        lambda: client.chat.completions.create(model="m", messages=MESSAGES),
        lambda: client.completions.create(model="m", prompt="hi"),
    ):
        err = _status_error(call)  # not a ChatCompletion with no choices
        assert (err.status_code, err.code) == (502, "upstream_invalid_response")
        assert "with an error instead of an answer" in err.message
        assert "InternalError" in err.message and "engine dead" in err.message
    assert backend.posts == 2  # not retried
    # an answer that carries an error field besides its choices is still an answer
    backend.reply = _answer(b"application/json", COMPLETION[:-1] + b',"error":null}')
    assert client.chat.completions.create(model="m", messages=MESSAGES).choices


def test_a_200_json_answer_under_another_content_type_goes_out_as_json(
    backends: list[RawBackend], proxy_server: Callable[..., object]
) -> None:
    backend = _raw(backends, _answer(b"text/plain", COMPLETION))
    proxy = proxy_server([backend.url])
    answer = _client(proxy).chat.completions.create(model="m", messages=MESSAGES)
    assert answer.choices[0].message.content == "hi"
    raw = httpx.post(
        f"{proxy.url}/v1/chat/completions",  # type: ignore[attr-defined]
        json={"model": "m", "messages": MESSAGES},
    )
    assert raw.headers["content-type"] == "application/json"
    assert raw.content == COMPLETION


def test_a_200_that_is_not_an_event_stream_to_a_streamed_request_is_a_502_before_the_stream(
    backends: list[RawBackend], proxy_server: Callable[..., object]
) -> None:
    backend = _raw(backends, _answer(b"text/html", HTML))
    proxy = proxy_server([backend.url])
    client = _client(proxy)
    got: list[object] = []

    def stream() -> None:
        got.extend(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))

    err = _status_error(stream)
    assert got == []
    assert (err.status_code, err.code) == (502, "upstream_invalid_response")
    assert "not an event stream" in err.message
    assert err.response.headers["content-type"] == "application/json"


# -- 14. an event that is not UTF-8 -------------------------------------------------------------

BAD_EVENT = EVENT.replace(b'"hi"', b'"h\xff\xfei"')
ACCENTED = EVENT.replace(b'"hi"', '"h\u00e9\u6f22"'.encode())


def _stream_reply(*events: bytes) -> bytes:
    return HEAD + b"".join(_chunk(e) for e in events) + b"0\r\n\r\n"


@pytest.mark.parametrize(
    ("events", "before"),
    [
        ((EVENT, BAD_EVENT, EVENT, DONE), ["hi"]),  # in a later read, or the first
        ((BAD_EVENT, EVENT, DONE), []),
        ((EVENT + BAD_EVENT + EVENT + DONE,), ["hi"]),  # mid-read, in one HTTP chunk
    ],
    ids=["after_an_event", "first", "mid_read"],
)
def test_an_event_that_is_not_utf8_ends_the_stream_with_an_api_error(
    events: tuple[bytes, ...],
    before: list[str],
    backends: list[RawBackend],
    proxy_server: Callable[..., object],
) -> None:
    backend = _raw(backends, _stream_reply(*events))
    proxy = proxy_server([backend.url])
    got: list[str] = []
    with pytest.raises(openai.APIError) as err:  # not UnicodeDecodeError
        for chunk in _client(proxy).chat.completions.create(
            model="m", messages=MESSAGES, stream=True
        ):
            got.extend(c.delta.content or "" for c in chunk.choices)
    assert got == before  # what came before the bad event, nothing after it
    assert err.value.code == "upstream_invalid_response"  # type: ignore[attr-defined]
    assert "not valid UTF-8" in err.value.message


def test_valid_multibyte_utf8_passes_whole_even_split_across_http_chunks(
    backends: list[RawBackend], proxy_server: Callable[..., object]
) -> None:
    cut = ACCENTED.index("\u00e9".encode()) + 1  # inside the two bytes of "é"
    events = (ACCENTED, ACCENTED[:cut], ACCENTED[cut:] + DONE)
    backend = _raw(backends, _stream_reply(*events))
    proxy = proxy_server([backend.url])
    chunks = _client(proxy).chat.completions.create(model="m", messages=MESSAGES, stream=True)
    assert [c.choices[0].delta.content for c in chunks if c.choices] == ["h\u00e9\u6f22"] * 2
