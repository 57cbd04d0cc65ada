"""Fuzzing what a client or a backend controls: the request parser and validation, prompt
hashing, the stream meter, and the whole proxy over HTTP. Whatever comes in, the answer is a
well-formed OpenAI error (4xx for the client's mistakes) or a success, never an unhandled
exception or a 500."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy.bench.mock import MockBackend
from proxy.errors import RequestError
from proxy.forwarding.intake import parse
from proxy.forwarding.meter import StreamMeter, meter_json
from proxy.forwarding.validate import MAX_DEPTH
from proxy.routing.prefix import PrefixHasher
from tests.support import ServerThread

MODEL = "test-model"
APIS = ("chat", "completions", "embeddings", "responses")
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
}
FIELD = {"chat": "messages", "completions": "prompt", "embeddings": "input", "responses": "input"}
# Keys the proxy reads somewhere, so random bodies hit its code paths, and a few it does not.
KEYS = st.sampled_from(
    [
        "model", "messages", "prompt", "input", "tools", "stream", "stream_options",
        "include_usage", "cache_salt", "user", "n", "max_tokens", "role", "content", "type",
        "text", "image_url", "url", "input_audio", "data", "tool_calls", "tool_call_id",
        "name", "instructions", "temperature", "top_p", "stop", "usage", "choices",
    ]
) | st.text(max_size=6)  # fmt: skip
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**65), max_value=2**65)  # past both 64-bit bounds
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=25,
)


def nested(depth: int, leaf: Any = "x") -> Any:
    """A value `depth` containers deep (lists and objects in turn)."""
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"content": value}
    return value


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A body that is often nearly valid for its API, with random values and keys mixed in."""
    api = draw(st.sampled_from(APIS))
    body: dict[str, Any] = {}
    if draw(st.booleans()):
        body["model"] = MODEL
    prompt = FIELD[api]
    if draw(st.booleans()):
        if api == "chat":
            body[prompt] = draw(
                st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": VALUES}))
            )
        else:
            body[prompt] = draw(VALUES | st.lists(st.integers(-(2**64), 2**64), max_size=5))
    body.update(draw(st.dictionaries(KEYS, VALUES, max_size=4)))
    if draw(st.integers(0, 9)) == 0:  # sometimes a value nested past what can be re-serialized
        key = draw(st.sampled_from(["tools", prompt, "stream_options", "metadata"]))
        body[key] = nested(draw(st.integers(MAX_DEPTH - 4, MAX_DEPTH + 4)))
    return api, body


def well_formed_error(status: int, body: bytes) -> None:
    assert 400 <= status < 600, status
    error = orjson.loads(body)["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def client_error_or_nothing(api: str, raw: bytes) -> Any:
    """The Exchange parse() makes of `raw`, or None after checking its 4xx is well formed."""
    try:
        return parse(api, raw, {}, "fuzz", lambda model: model == MODEL)
    except RequestError as e:
        assert 400 <= e.status < 500
        well_formed_error(e.status, e.body())
        return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies())
@example(("chat", {"model": MODEL, "messages": [{"role": "user", "content": nested(252)}]}))
@example(("completions", {"model": MODEL, "prompt": [1, 2, 2**63]}))
@example(("completions", {"model": MODEL, "prompt": "x", "messages": 1.5}))
@example(("embeddings", {"model": MODEL, "input": [[1], [-(2**63) - 1]]}))
@example(
    ("chat", {"model": MODEL, "messages": [{"role": "u", "content": "x"}], "tools": nested(253)})
)
def test_any_body_is_parsed_validated_and_hashed_or_refused_with_a_400(
    case: tuple[str, dict[str, Any]],
) -> None:
    api, body = case
    raw = json.dumps(body).encode()  # Python's JSON: integers past 64 bits too
    ex = client_error_or_nothing(api, raw)
    if ex is None:
        return
    hasher = PrefixHasher()
    key = hasher.key(ex.body["model"], api, ex.body)  # must not raise
    assert key.chars >= 0
    orjson.dumps(ex.body)  # what a rewrite of the body for the backend does
    if ex.raw is not raw:
        orjson.loads(ex.raw)  # the rewritten body the backend gets is still JSON


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode), st.sampled_from(APIS))
def test_any_bytes_are_a_400_or_a_request(raw: bytes, api: str) -> None:
    client_error_or_nothing(api, raw)


# -- the stream meter, over JSON-shaped events with hostile values, and any bytes -------------


@st.composite
def events(draw: st.DrawFn) -> bytes:
    obj = draw(st.dictionaries(KEYS, VALUES, max_size=5))
    if draw(st.booleans()):
        obj["usage"] = draw(st.dictionaries(st.sampled_from(
            ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details",
             "cached_tokens", "input_tokens", "output_tokens"]), VALUES, max_size=4))  # fmt: skip
    if draw(st.booleans()):
        obj["choices"] = draw(st.lists(st.dictionaries(st.sampled_from(
            ["delta", "text", "finish_reason", "index", "message", "content"]), VALUES,
            max_size=3), max_size=2))  # fmt: skip
    if draw(st.integers(0, 5)) == 0:
        obj["type"] = draw(st.sampled_from(["response.completed", "response.failed", "error"]))
        obj["response"] = draw(VALUES)
    data = json.dumps(obj).encode()
    sep = draw(st.sampled_from([b"\n\n", b"\r\n\r\n"]))
    return b"data: " + data + sep


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["chat", "completions", "responses"]),
    st.lists(
        events()
        | st.sampled_from([b"data: [DONE]\n\n", b": ping\n\n"])
        | st.binary(max_size=60)  # anything a broken backend may send, framed or not
        | st.binary(max_size=40).map(lambda b: b"data: " + b + b"\n\n"),
        max_size=8,
    ),
    st.booleans(),
    st.lists(st.integers(0, 5000), max_size=6),
)
def test_the_meter_takes_any_json_events_or_bytes_without_raising(
    api: Any, pieces: list[bytes], strip: bool, splits: list[int]
) -> None:
    stream = b"".join(pieces)
    bounds = sorted({0, len(stream), *(i % (len(stream) + 1) for i in splits)})
    meter = StreamMeter(api, t0=0.0, strip_usage=strip)
    for n, (a, b) in enumerate(itertools.pairwise(bounds)):
        meter.feed(stream[a:b], 1.0 + n)
        meter.mark_sent(1.5 + n)
    _, facts = meter.finish(100.0)
    for count in (facts.output_tokens, facts.input_tokens, facts.cached_tokens):
        assert count is None or isinstance(count, int)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(APIS), VALUES | st.dictionaries(KEYS, VALUES))
def test_the_meter_takes_any_json_response_without_raising(api: str, value: Any) -> None:
    meter_json(api, json.dumps(value).encode(), t0=0.0, now=1.0)


# -- the whole proxy over HTTP -----------------------------------------------------------------


# Any request the proxy lets through gets a small valid answer: one chunk, streamed or whole.
any_backend = MockBackend(chunks=1, model=MODEL)


@pytest.fixture(scope="module")
def stack() -> Iterator[str]:
    from proxy.config import Config
    from proxy.server.app import create_app
    from proxy.server.serve import NoDelayHttpToolsProtocol

    with ServerThread(any_backend) as backend:
        cfg = Config.model_validate({"backends": [{"url": backend.url, "models": [MODEL]}]})
        with ServerThread(create_app(cfg), http=NoDelayHttpToolsProtocol) as proxy:
            yield proxy.url


@pytest.mark.e2e
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(bodies())
def test_the_proxy_answers_any_body_with_a_response_or_a_well_formed_4xx(
    stack: str, case: tuple[str, dict[str, Any]]
) -> None:
    api, body = case
    r = httpx.post(
        stack + PATHS[api],
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert r.status_code != 500, r.text
    if r.status_code >= 400:
        assert r.status_code < 500, r.text
        well_formed_error(r.status_code, r.content)
    assert r.headers["x-request-id"]


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_nesting_is_refused_past_the_limit_however_many_brackets_strings_hold(api: str) -> None:
    # Brackets inside strings are not nesting: a body full of them is still shallow, and a
    # deep one is refused naming its field, on both sides of the limit.
    brackets = "[{" * MAX_DEPTH
    if api == "chat":
        shallow = {"model": MODEL, "messages": [{"role": "user", "content": brackets}]}
    else:
        shallow = {"model": MODEL, "prompt": brackets}
    assert client_error_or_nothing(api, orjson.dumps(shallow)) is not None
    for depth, refused in ((MAX_DEPTH - 2, False), (MAX_DEPTH, True)):
        body = {**shallow, "metadata": nested(depth)}  # at the body's level 2, as deep + 1
        try:
            parse(api, json.dumps(body).encode(), {}, "t", lambda model: model == MODEL)
        except RequestError as e:
            assert refused and e.status == 400 and e.param == "metadata", (depth, e.body())
        else:
            assert not refused, depth
