"""The meter's scan of common chat events: the C helper answers as the Python reference does.

proxy/_eventscan.c is built with the compiled hot path; proxy/eventscan.py's chat_events_py is
its contract and the pure fallback. The meter's own tests (tests/test_meter.py, run under both
builds by tests/test_hot_path.py) check what the meter makes of the answers; here the two
scans are compared on the same reads, generated and written out.
"""

from __future__ import annotations

import importlib.util

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import proxy
from proxy import eventscan
from proxy.eventscan import chat_events_py

BUILT = importlib.util.find_spec("proxy._eventscan") is not None
needs_c = pytest.mark.skipif(not BUILT, reason="proxy._eventscan is not built (a pure install)")


def _c():  # type: ignore[no-untyped-def]
    from proxy._eventscan import chat_events

    return chat_events


def ev(delta: dict[str, object], finish: object = None, *, spaced: bool = False) -> bytes:
    obj = {"id": "c1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    body = orjson.dumps(obj)
    if spaced:
        body = body.replace(b'":', b'": ').replace(b",", b", ")
    return b"data: " + body


COMMON = ev({"content": "hi"})
SEP = b"\n\n"
STOP = ev({"content": "."}, "stop")
SPACED_STOP = COMMON.replace(b'"finish_reason":null', b'"finish_reason": "stop"')
SPACED_NULL = COMMON.replace(b'"finish_reason":null', b'"finish_reason": null')


def read(*events: bytes, sep: bytes = SEP, tail: bytes = b"") -> bytes:
    return b"".join(e + sep for e in events) + tail


@pytest.mark.parametrize(
    ("buf", "start", "search", "want"),
    [
        (read(COMMON, COMMON, COMMON), 0, 0, (3, 3 * (len(COMMON) + 2), -1)),
        (b"", 0, 0, (0, 0, -1)),
        # an unfinished event after two common ones: where it starts, no separator yet
        (read(COMMON, COMMON, tail=COMMON[:20]), 0, 0, (2, 2 * (len(COMMON) + 2), -1)),
        # the first other event: a finish reason, empty content, a role-only delta, [DONE]
        (read(COMMON, STOP), 0, 0, (1, len(COMMON) + 2, len(COMMON) + 2 + len(STOP))),
        (read(ev({"content": ""}), COMMON), 0, 0, (0, 0, len(ev({"content": ""})))),
        (read(ev({"role": "assistant"})), 0, 0, (0, 0, len(ev({"role": "assistant"})))),
        (read(b"data: [DONE]"), 0, 0, (0, 0, 12)),
        (read(b": keep-alive", COMMON), 0, 0, (0, 0, 12)),
        (read(b"event: x\ndata: {}"), 0, 0, (0, 0, 17)),
        # spaced JSON is not the common shape: `"content": "` has a space
        (
            read(ev({"content": "x"}, spaced=True)),
            0,
            0,
            (0, 0, len(ev({"content": "x"}, spaced=True))),
        ),
        # a finish reason spaced before its string still makes the event other
        (read(SPACED_STOP), 0, 0, (0, 0, len(SPACED_STOP))),
        # a null finish reason, spaced, is common
        (read(SPACED_NULL), 0, 0, (1, len(SPACED_NULL) + 2, -1)),
    ],
)
def test_the_python_scan_answers_as_its_contract_says(
    buf: bytes, start: int, search: int, want: tuple[int, int, int]
) -> None:
    assert chat_events_py(buf, start, search, SEP) == want
    if BUILT:
        assert _c()(buf, start, search, SEP) == want


def test_a_resumed_read_searches_from_where_the_last_one_stopped() -> None:
    held = COMMON[:30]  # the meter's tail: the start of an event whose end had not come
    buf = held + COMMON[30:] + SEP + COMMON + SEP
    want = (2, len(buf), -1)
    assert chat_events_py(buf, 0, len(held) - 1, SEP) == want
    if BUILT:
        assert _c()(buf, 0, len(held) - 1, SEP) == want


# Events as engines write them, and as they should not: every field of the contract varied.
_TEXT = st.sampled_from(["", "a", "hi there", '\\"q\\"', "finish_reason", "\\n", "é"])
_FINISH = st.sampled_from([None, "stop", "length", "null"])
_EVENT = st.one_of(
    st.builds(lambda t, f, s: ev({"content": t}, f, spaced=s), _TEXT, _FINISH, st.booleans()),
    st.builds(lambda t: ev({"reasoning_content": t}), _TEXT),
    st.just(ev({"role": "assistant", "content": ""})),
    st.just(b"data: [DONE]"),
    st.just(b": ping"),
    st.just(b'data:{"choices":[{"delta":{"content":"x"},"finish_reason":null}]}'),
    st.just(b'data: {"choices":[{"delta":{"content":"x"},"finish_reason":\t"stop"}]}'),
    st.just(b'data: {"choices":[],"usage":{"prompt_tokens":3}}'),
    st.binary(max_size=40),
)


@needs_c
@settings(max_examples=400, deadline=None)
@given(
    events=st.lists(_EVENT, max_size=8),
    crlf=st.booleans(),
    cut=st.integers(min_value=0, max_value=10_000),
    at=st.integers(min_value=0, max_value=10_000),
)
def test_the_c_scan_answers_as_the_python_one(
    events: list[bytes], crlf: bool, cut: int, at: int
) -> None:
    sep = b"\r\n\r\n" if crlf else SEP
    whole = sep.join([*events, b""])
    buf = whole[: cut % (len(whole) + 1)]  # a read may end anywhere
    start = at % (len(buf) + 1)
    search = start + (at // 7) % (len(buf) - start + 1)
    c = _c()
    # Scan the read as the meter does: a run, then past the other event, until none is whole.
    while True:
        got, want = c(buf, start, search, sep), chat_events_py(buf, start, search, sep)
        assert got == want, (buf, start, search)
        if want[2] < 0:
            break
        start = search = want[2] + len(sep)


def _anchored(n: int) -> list[bytes]:
    """Reads whose searches meet each needle's anchor byte (its first that is not a quote)
    `n` times where the rest of the needle does not follow."""
    pad = {"id": "c" * n, "object": '"c' * n, "model": "f" * n}
    common = b"data: " + orjson.dumps(
        {**pad, "choices": [{"index": 0, "delta": {"content": "f" * n}, "finish_reason": None}]}
    )
    stop = b"data: " + orjson.dumps(
        {**pad, "choices": [{"index": 0, "delta": {"content": "."}, "finish_reason": "stop"}]}
    )
    lines = b"\n".join([b": keep-alive"] * n)  # single newlines before the separator
    return [
        read(common, common, stop),
        read(common, stop, sep=b"\r\n\r\n"),
        read(lines, common),
        read(common, tail=b"\r" * n + b"\n" * n),
    ]


@needs_c
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 200])
def test_the_c_scan_answers_as_the_python_one_where_anchors_repeat(n: int) -> None:
    """The C search memchr's to each place of a needle's anchor byte and hands the rest of the
    range to memmem after FALSE_HITS misses: both ways give bytes.find's answers."""
    c = _c()
    for buf in _anchored(n):
        sep = b"\r\n\r\n" if b"\r\n\r\n" in buf else SEP
        start = search = 0
        while True:
            got, want = c(buf, start, search, sep), chat_events_py(buf, start, search, sep)
            assert got == want, (n, buf[:80], start)
            if want[2] < 0:
                break
            start = search = want[2] + len(sep)


@needs_c
def test_the_c_scan_refuses_what_the_meter_never_passes() -> None:
    c = _c()
    with pytest.raises(TypeError):
        c(bytearray(b"data: x\n\n"), 0, 0, SEP)
    with pytest.raises(TypeError):
        c(b"data: x\n\n", 0, 0)
    with pytest.raises(ValueError):
        c(b"data: x\n\n", -1, 0, SEP)
    with pytest.raises(ValueError):
        c(b"data: x\n\n", 0, 0, b"")


def test_the_scan_runs_with_the_hot_path_it_belongs_to() -> None:
    compiled = proxy.hot_path()["implementation"] == "compiled"
    assert eventscan.implementation == ("c" if compiled else "python")
    assert (eventscan.chat_events is chat_events_py) == (not compiled)


# chat_output: jsonscan's five key searches, in one C call where the scan is C.
_KEY = st.sampled_from(
    [b'"content":', b'"reasoning_content":', b'"reasoning":', b'"refusal":', b'"tool_calls":']
)
_PIECE = st.one_of(
    _KEY,
    st.sampled_from([b'"', b'""', b'"x"', b"[", b"[]", b"[ ]", b"[{", b"null", b"]", b" ", b"\t"]),
    st.sampled_from([b"\r\n", b",", b"{", b"}", b'"content"', b"content:"]),
    st.binary(max_size=6),
)


@needs_c
@settings(max_examples=600, deadline=None)
@given(pieces=st.lists(_PIECE, max_size=12))
def test_the_c_output_test_answers_as_jsonscans(pieces: list[bytes]) -> None:
    from proxy._eventscan import chat_output
    from proxy.jsonscan import chat_output as reference

    p = b"".join(pieces)
    assert chat_output(p) is reference(p), p


@pytest.mark.parametrize(
    ("p", "want"),
    [
        (b'{"delta":{"content":"hi"}}', True),
        (b'{"delta":{"content":""}}', False),
        (b'{"delta":{"content": "x"}}', True),
        (b'{"delta":{"content":null,"tool_calls":[{"id":"t"}]}}', True),
        (b'{"delta":{"tool_calls":[ ]}}', False),
        (b'{"delta":{"reasoning_content":"think"}}', True),
        (b'{"choices":[{"delta":{"content":""}},{"delta":{"content":"b"}}]}', True),
        (b'{"choices":[],"usage":{"prompt_tokens":3}}', False),
        (b'"content":"', False),  # the value's first byte is not in the read: no output
        (b"[DONE]", False),
    ],
)
def test_the_output_test_on_written_out_events(p: bytes, want: bool) -> None:
    assert eventscan.chat_output(p) is want
    assert eventscan.chat_output_py(p) is want


def test_the_meter_takes_both_scans_from_one_build() -> None:
    assert (eventscan.chat_output is eventscan.chat_output_py) == (
        eventscan.chat_events is chat_events_py
    )
