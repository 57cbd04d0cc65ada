"""The upstream body with include_usage: spliced into the client's bytes, never re-encoded."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from proxy.forwarding.forward import with_include_usage

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)


@st.composite
def bodies(draw: st.DrawFn) -> tuple[bytes, dict[str, Any]]:
    body: dict[str, Any] = {"model": draw(st.text(min_size=1, max_size=10)), "stream": True}
    body["messages"] = [{"role": "user", "content": draw(st.text(max_size=30))}]
    body.update(draw(st.dictionaries(st.sampled_from(["n", "user", "x", "tools"]), json_values)))
    opts = draw(st.none() | st.just({}) | st.just({"include_usage": False}) | st.just("absent"))
    if opts != "absent":
        body["stream_options"] = opts
    indent = draw(st.sampled_from([None, 1, 4]))
    raw = json.dumps(body, indent=indent, ensure_ascii=draw(st.booleans())).encode()
    return draw(st.sampled_from([b"", b" ", b"\n\t "])) + raw, body


@given(bodies())
def test_the_backend_gets_the_clients_body_with_include_usage_set(
    case: tuple[bytes, dict[str, Any]],
) -> None:
    raw, body = case
    out = with_include_usage(raw, body)
    opts = body.get("stream_options") or {}
    assert orjson.loads(out) == {**body, "stream_options": {**opts, "include_usage": True}}
    if "stream_options" not in body:
        # the client's own bytes, untouched, around the one inserted member
        assert out.replace(b'"stream_options":{"include_usage":true},', b"", 1) == raw
