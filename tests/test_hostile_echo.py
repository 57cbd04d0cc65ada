"""What a peer can make the proxy echo, log and count (issue 25): a client's long model name,
JSON key or path is quoted only up to a prefix and its size; a client's x-request-id is kept
only when short and printable, and the one id is on the response, the logs, the spans and the
upstream request; a backend's made-up error types fold into `_OTHER` on /metrics; /ready names
no backend on a port that does not serve /admin."""

from __future__ import annotations

import http.client
import logging
import re
import socket
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from proxy.asgi import Receive, Scope, Send, read_body, send_json, serve_lifespan
from proxy.redact import QUOTE_CHARS, quote
from proxy.telemetry.labels import ErrorLabels
from tests.support import ServerThread, until
from tests.test_access import Proxy

MODEL = "test-model"
CHAT = "/v1/chat/completions"
JUST_PAST = QUOTE_CHARS + 1
LARGE = 200_000
_ERROR_TYPE = re.compile(r'error_type="([^"]*)"')
_DURATION_COUNT = "gen_ai_server_request_duration_seconds_count"


def _chat(model: str = MODEL, **body: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def _servers(proxy: Proxy) -> list[Any]:
    return [s for s in proxy.spans.get_finished_spans() if s.kind.name == "SERVER"]


# -- pure parts ---------------------------------------------------------------------------------


def test_quote_keeps_a_short_string_and_cuts_a_long_one_to_a_prefix_and_its_size() -> None:
    assert quote("a" * QUOTE_CHARS) == "a" * QUOTE_CHARS
    assert quote("a" * JUST_PAST) == "a" * QUOTE_CHARS + f"… ({JUST_PAST} bytes)"
    assert quote("é" * LARGE, 4) == f"éééé… ({2 * LARGE} bytes)"


def test_error_labels_keep_the_vocabulary_and_the_first_seen_and_fold_the_rest() -> None:
    labels = ErrorLabels(first=2)
    for own in ("connect_error", "cancelled", "http_503", "500", "rate_limit_error"):
        assert labels(own) == own
    assert labels("engine_a") == "engine_a"
    assert labels("engine b") == "_OTHER"  # not an identifier: takes no slot
    assert labels("engine_c") == "engine_c"
    assert labels("engine_d") == "_OTHER"  # the slots are taken
    assert labels("engine_a") == "engine_a"  # ...by the first ones, which stay
    assert labels("http_200") == labels("http_600") == labels("x" * 65) == "_OTHER"


# -- item 3: echoes of a client's strings are bounded -------------------------------------------


@pytest.mark.e2e
def test_a_long_model_name_is_quoted_as_a_prefix_and_its_size_in_the_404_and_its_log(
    fake_backends: Any, proxy_server: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    [(_, backend)] = fake_backends(1)
    proxy = proxy_server([backend.url])
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    caplog.set_level(logging.INFO, logger="warmroute")
    for size in (JUST_PAST, LARGE):
        model = "m" * size
        with pytest.raises(openai.NotFoundError) as err:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
        assert err.value.code == "model_not_found"
        message = err.value.message
        assert f"`{'m' * QUOTE_CHARS}… ({size} bytes)`" in message, message
        assert len(message) < QUOTE_CHARS + 300
        assert len(err.value.response.content) < QUOTE_CHARS + 500
    rejected = [line for line in _lines(caplog) if "rejected (404" in line]
    assert len(rejected) == 2
    assert all(len(line) < QUOTE_CHARS + 400 for line in rejected), [len(x) for x in rejected]


@pytest.mark.e2e
def test_a_long_model_name_is_quoted_in_the_429_of_a_backend_at_its_bound(
    fake_backends: Any, proxy_server: Callable[..., Any]
) -> None:
    model = "m" * LARGE  # served: past intake, to the messages built after routing
    [(app, backend)] = fake_backends(1, models=(model,))
    proxy = proxy_server(
        [backend.url],
        config={
            "backends": [{"url": backend.url, "max_inflight": 1}],
            "server": {"admission_queue": 0},  # refused at once, not after waiting
        },
    )
    held = orjson.dumps(
        _chat(model, stream=True, messages=[{"role": "user", "content": "delay:30"}])
    )
    host, port = proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as first:  # in flight until closed
        first.sendall(
            b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (CHAT.encode(), len(held), held)
        )
        until(lambda: len(app.rec.requests) == 1, "the first request on the backend")
        r = httpx.post(proxy.url + CHAT, json=_chat(model), timeout=10)
    # Its client gone, the held request's engine hears of it (its ~200 KB body's last read
    # paused the connection's reading: tests/test_disconnect_watch.py)
    assert app.rec.disconnected.wait(10), "the first request's engine was left working"
    assert r.status_code == 429 and r.json()["error"]["code"] == "backends_at_capacity"
    assert f"`{'m' * QUOTE_CHARS}… ({LARGE} bytes)`" in r.json()["error"]["message"]
    assert len(r.content) < QUOTE_CHARS + 500, len(r.content)


@pytest.mark.e2e
def test_a_long_json_key_and_a_long_path_are_quoted_in_their_errors(
    fake_backends: Any, proxy_server: Callable[..., Any]
) -> None:
    [(_, backend)] = fake_backends(1)
    proxy = proxy_server([backend.url])
    key = "k" * LARGE
    deep = "[" * 300 + "]" * 300  # past the nesting the proxy accepts: the key is named
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "%s": %s}' % (
        MODEL.encode(),
        key.encode(),
        deep.encode(),
    )
    r = httpx.post(proxy.url + CHAT, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == quote(key) and f"({LARGE} bytes)" in error["message"]
    assert len(r.content) < 3 * QUOTE_CHARS + 500
    path = "/" + "p" * 10_000
    r = httpx.get(proxy.url + path)
    assert r.status_code == 404 and "(10001 bytes)" in r.json()["error"]["message"]
    assert len(r.content) < QUOTE_CHARS + 500


# -- item 4: one sane request id, everywhere ----------------------------------------------------


def _post_raw(url: str, body: bytes, request_id: str) -> tuple[int, str, bytes]:
    """POST with any x-request-id bytes, as sent (http.client checks only for CR and LF)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.putrequest("POST", CHAT, skip_accept_encoding=True)
        conn.putheader("content-type", "application/json")
        conn.putheader("content-length", str(len(body)))
        conn.putheader("x-request-id", request_id.encode("latin-1"))
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, r.getheader("x-request-id") or "", r.read()
    finally:
        conn.close()


@pytest.mark.e2e
def test_a_hostile_request_id_is_replaced_once_and_the_new_one_is_used_everywhere(
    fake_backends: Any, caplog: pytest.LogCaptureFixture
) -> None:
    [(app, backend)] = fake_backends(1)
    # spaces, a tab and bytes past ASCII: the control bytes a server's parser lets through
    hostile = "evil id\t" + "x" * 20_000 + " \xe9\xff"
    body = httpx.Request("POST", "/", json=_chat()).content
    caplog.set_level(logging.INFO)
    with Proxy({"backends": [{"url": backend.url, "models": [MODEL]}]}) as proxy:
        status, rid, _ = _post_raw(proxy.url, body, hostile)
        assert status == 200
        assert re.fullmatch(r"[0-9a-f]{32}", rid), rid[:100]
        assert app.rec.requests[-1]["headers"]["x-request-id"] == rid  # the upstream request
        until(lambda: _servers(proxy), "the request's span")  # it ends after the answer
        [server] = _servers(proxy)
        assert server.attributes["warmroute.request.id"] == rid  # type: ignore[index]
        # a rejected one: its log line names the id its response carries
        status, rejected_id, _ = _post_raw(proxy.url, b"{", hostile)
        assert status == 400 and re.fullmatch(r"[0-9a-f]{32}", rejected_id)
        # the bound: just past it is replaced, at it (and any printable id) is kept
        for sent, kept in (("a" * 201, False), ("a" * 200, True), ("t:1/x+y=.z_-", True)):
            r = httpx.post(proxy.url + CHAT, json=_chat(), headers={"x-request-id": sent})
            assert (r.headers["x-request-id"] == sent) is kept, sent
            assert (app.rec.requests[-1]["headers"]["x-request-id"] == sent) is kept
    lines = _lines(caplog)
    assert any(f"request {rejected_id} rejected (400" in line for line in lines)
    replaced = [line for line in lines if "x-request-id" in line and "replaced by" in line]
    assert any(rid in line for line in replaced) and any(rejected_id in line for line in replaced)
    assert all(len(line) < 400 for line in replaced), [len(line) for line in replaced]
    assert not any("x" * 1000 in line for line in lines)


# -- item 5: a backend's error types cannot grow /metrics ---------------------------------------


class ErrorBackend:
    """Answers every chat with a stream that ends in an error event of type <its prompt>, as
    vLLM ends a stream that fails (a 200 whose JSON body is an error is refused as no answer,
    so streams are where a backend's own error types reach the metrics)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        if scope["method"] == "GET":
            await send_json(send, 200, {"object": "list", "data": [{"id": MODEL}]})
            return
        body = orjson.loads(await read_body(receive))
        kind = body["messages"][0]["content"]
        event = orjson.dumps({"error": {"type": kind, "message": "made up"}})
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"data: " + event + b"\n\n"})


@pytest.fixture
def error_backend() -> Iterator[ServerThread]:
    with ServerThread(ErrorBackend()) as server:
        yield server


def _error_types(text: str) -> set[str]:
    return set(_ERROR_TYPE.findall(text))


def _scrape(http: httpx.Client, requests: int) -> str:
    """/metrics once it holds `requests` requests (recorded just after each answer)."""
    text = ""

    def recorded() -> bool:
        nonlocal text
        text = http.get("/metrics").text
        counts = [line for line in text.splitlines() if line.startswith(_DURATION_COUNT)]
        return sum(float(line.rpartition(" ")[2]) for line in counts) == requests

    until(recorded, f"{requests} requests in /metrics")
    return text


@pytest.mark.e2e
def test_a_backend_naming_a_new_error_per_request_adds_no_series_past_the_first_few(
    error_backend: ServerThread,
) -> None:
    huge = "t" * LARGE

    def chat(http: httpx.Client, kind: str) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": kind}], "stream": True}
        answer = http.post(CHAT, json=body)
        assert answer.status_code == 200 and b"made up" in answer.content

    with (
        Proxy({"backends": [{"url": error_backend.url, "models": [MODEL]}]}) as proxy,
        httpx.Client(base_url=proxy.url, timeout=10) as http,
    ):
        for i in range(40):
            chat(http, f"made_up_{i}")
        chat(http, huge)
        chat(http, "with spaces")
        first = _scrape(http, 42)
        for i in range(40, 120):
            chat(http, f"made_up_{i}")
        second = _scrape(http, 122)
        until(lambda: len(_servers(proxy)) == 122, "every request's span")
        spans = _servers(proxy)
    kept = {f"made_up_{i}" for i in range(32)}
    assert _error_types(first) == kept | {"_OTHER"}, sorted(_error_types(first))
    assert _error_types(second) == _error_types(first)
    assert len(second.splitlines()) == len(first.splitlines())  # no new series at all
    raw = {str((s.attributes or {}).get("error.type")) for s in spans}
    assert {"made_up_119", "with spaces", quote(huge)} <= raw  # spans keep the backend's own


# -- item 18: what the serving port shows of the backends ---------------------------------------


@pytest.mark.e2e
def test_ready_names_no_backend_on_a_port_that_does_not_serve_admin(fake_backends: Any) -> None:
    [(_, backend)] = fake_backends(1)
    address = backend.url.removeprefix("http://")  # the backend's name: none is configured
    config: dict[str, Any] = {"backends": [{"url": backend.url, "models": [MODEL]}]}
    with Proxy(dict(config), admin_listener=True) as proxy:
        serving = httpx.get(proxy.url + "/ready")
        admin = httpx.get(proxy.admin_url + "/ready")
        metrics = httpx.get(proxy.url + "/metrics").text
    assert serving.status_code == 200 and address not in serving.text, serving.text
    assert serving.json()["backends"] == [{"up": True, "circuit": "closed"}]
    assert admin.json()["backends"] == [{"name": address, "up": True, "circuit": "closed"}]
    # /metrics keeps the backend's name as a label (the operator's), never a URL
    assert f'warmroute_backend="{address}"' in metrics and "http://" not in metrics
    with Proxy(dict(config)) as proxy:  # the default: /admin is served nowhere
        assert address not in httpx.get(proxy.url + "/ready").text
