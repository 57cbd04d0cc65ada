"""The stream meter against recorded engine streams and a slow full-parse reference."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy.forwarding.meter import API, MAX_EVENT_BYTES, EventTooLarge, StreamMeter, meter_json
from proxy.jsonscan import ARRAY, FINISH, QUOTE, nonempty_at, value_starts
from proxy.sse import data_of
from proxy.types import StreamFacts


def sse(*objs: Any, sep: str = "\n\n", spaced: bool = False, done: bool = True) -> bytes:
    """Frame JSON objects as SSE data events (spaced = Python json.dumps, like SGLang)."""
    out = []
    for o in objs:
        body = json.dumps(o) if spaced else orjson.dumps(o).decode()
        out.append(f"data: {body}{sep}")
    if done:
        out.append(f"data: [DONE]{sep}")
    return "".join(out).encode()


def chunk(cid: str, model: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": 1732860000,
        "model": model,
        "choices": choices,
        **extra,
    }


def delta(index: int = 0, finish: str | None = None, **d: Any) -> dict[str, Any]:
    return {"index": index, "delta": d, "logprobs": None, "finish_reason": finish}


QWEN = "Qwen/Qwen2.5-0.5B-Instruct"

# vLLM chat: role-only first chunk, content, finish chunk, usage-only chunk (choices: []).
VLLM_CHAT = sse(
    chunk("chatcmpl-7f3a", QWEN, [delta(role="assistant", content="")]),
    *(chunk("chatcmpl-7f3a", QWEN, [delta(content=t)]) for t in ["The", " sky", " is", " blue"]),
    chunk("chatcmpl-7f3a", QWEN, [delta(content=".", finish="stop")]),
    chunk(
        "chatcmpl-7f3a",
        QWEN,
        [],
        usage={
            "prompt_tokens": 24,
            "total_tokens": 29,
            "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 16},
        },
    ),
)

# llama.cpp (older server): the final chunk carries finish_reason, usage *and* timings, so it
# is not usage-only and must never be stripped. nlohmann::json sorts keys.
LLAMACPP_CHAT = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant",'
    b'"content":null}}],"created":1732860001,"id":"chatcmpl-Xq2","model":"gpt-3.5-turbo",'
    b'"system_fingerprint":"b4600-8bd5e5c2","object":"chat.completion.chunk"}\n\n'
    + b"".join(
        b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"'
        + t
        + b'"}}],"created":1732860001,"id":"chatcmpl-Xq2","model":"gpt-3.5-turbo",'
        b'"system_fingerprint":"b4600-8bd5e5c2","object":"chat.completion.chunk"}\n\n'
        for t in [b"Hello", b"!", b" How", b" can", b" I", b" help", b"?"]
    )
    + b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"created":1732860001,'
    b'"id":"chatcmpl-Xq2","model":"gpt-3.5-turbo","system_fingerprint":"b4600-8bd5e5c2",'
    b'"object":"chat.completion.chunk","usage":{"completion_tokens":7,"prompt_tokens":12,'
    b'"total_tokens":19},"timings":{"prompt_n":12,"prompt_ms":18.2,"prompt_per_token_ms":1.51,'
    b'"prompt_per_second":659.3,"predicted_n":7,"predicted_ms":61.0,'
    b'"predicted_per_token_ms":8.71,"predicted_per_second":114.7}}\n\n'
    b"data: [DONE]\n\n"
)

# llama.cpp (newer server, as the pinned build sends it with include_usage): a separate
# usage-only chunk that also carries the timings, prefill time (prompt_ms) included.
LLAMACPP_CHAT_NEW = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Hi"}}],'
    b'"created":1,"id":"chatcmpl-9","model":"m","object":"chat.completion.chunk"}\n\n'
    b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],'
    b'"created":1,"id":"chatcmpl-9","model":"m","object":"chat.completion.chunk"}\n\n'
    b'data: {"choices":[],"created":1,"id":"chatcmpl-9","model":"m",'
    b'"object":"chat.completion.chunk","usage":{"completion_tokens":1,"prompt_tokens":3,'
    b'"total_tokens":4,"prompt_tokens_details":{"cached_tokens":1}},"timings":{"cache_n":1,'
    b'"prompt_n":2,"prompt_ms":4.938,"predicted_n":1,"predicted_ms":3.471}}\n\n'
    b"data: [DONE]\n\n"
)

# SGLang-style spaced JSON (Python json.dumps separators), usage: null on every chunk.
SGLANG_CHAT = sse(
    chunk("a1b2", "default", [delta(role="assistant", content="")], usage=None),
    chunk("a1b2", "default", [delta(content="Bonjour", reasoning_content=None)], usage=None),
    chunk("a1b2", "default", [delta(content=' "le" ', tool_calls=None)], usage=None),
    chunk("a1b2", "default", [delta(content="", finish="stop")], usage=None),
    chunk(
        "a1b2",
        "default",
        [],
        usage={"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
    ),
    spaced=True,
)


def cmpl(text: str, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": "cmpl-41",
        "object": "text_completion",
        "created": 1,
        "model": "facebook/opt-125m",
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
        ],
        **extra,
    }


COMPLETIONS = sse(
    cmpl(" Paris"),
    cmpl(","),
    cmpl(""),
    cmpl(" France", finish="length"),
    {
        "id": "cmpl-41",
        "object": "text_completion",
        "created": 1,
        "model": "facebook/opt-125m",
        "choices": [],
        "usage": {"prompt_tokens": 6, "total_tokens": 9, "completion_tokens": 3},
    },
)

# n=2: choices interleave; each index has its own finish reason.
CHAT_N2 = sse(
    chunk("c-n2", "m", [delta(0, role="assistant", content=""), delta(1, role="assistant")]),
    chunk("c-n2", "m", [delta(0, content="A")]),
    chunk("c-n2", "m", [delta(1, content="B")]),
    chunk("c-n2", "m", [delta(1, content="b", finish="length")]),
    chunk("c-n2", "m", [delta(0, content="a", finish="stop")]),
    chunk("c-n2", "m", [], usage={"prompt_tokens": 4, "completion_tokens": 4}),
)

TOOL_CALLS = sse(
    chunk("c-tool", "m", [delta(role="assistant", content=None)]),
    chunk(
        "c-tool",
        "m",
        [
            delta(
                tool_calls=[
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ]
            )
        ],
    ),
    *(
        chunk("c-tool", "m", [delta(tool_calls=[{"index": 0, "function": {"arguments": a}}])])
        for a in ['{"city"', ': "Paris', '", "content": "x"}']
    ),
    chunk("c-tool", "m", [delta(finish="tool_calls")]),
    chunk("c-tool", "m", [], usage={"prompt_tokens": 50, "completion_tokens": 12}),
)

REASONING = sse(
    chunk("c-r1", "deepseek-r1", [delta(role="assistant", content="")]),
    *(chunk("c-r1", "deepseek-r1", [delta(reasoning_content=t)]) for t in ["Let", " me", " think"]),
    chunk("c-r1", "deepseek-r1", [delta(reasoning_content=None, content="42")]),
    chunk("c-r1", "deepseek-r1", [delta(content="", finish="stop")]),
    chunk("c-r1", "deepseek-r1", [], usage={"prompt_tokens": 8, "completion_tokens": 4}),
)

# vLLM error mid-stream: an {"error": ...} event, then [DONE].
ERROR_MID = sse(
    chunk("c-err", "m", [delta(role="assistant", content="")]),
    chunk("c-err", "m", [delta(content="Once")]),
    chunk("c-err", "m", [delta(content=" upon")]),
    {
        "error": {
            "object": "error",
            "message": "CUDA out of memory",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    },
)

# The upstream died mid-event: no [DONE], no finish reason, a torn last event.
CUT = (
    sse(
        chunk("c-cut", "m", [delta(role="assistant", content="")]),
        chunk("c-cut", "m", [delta(content="half")]),
        chunk("c-cut", "m", [delta(content=" way")]),
        done=False,
    )
    + b'data: {"id":"c-cut","object":"chat.completion.chunk","choices":[{"index":0,"del'
)

# sse-starlette framing: CRLF, keep-alive comments, "data:" without a space.
CRLF_COMMENTS = (
    b": ping - 2026-11-29 09:00:00\r\n\r\n"
    + sse(
        chunk("c-crlf", "m", [delta(role="assistant", content="")]),
        chunk("c-crlf", "m", [delta(content="x")]),
        done=False,
        sep="\r\n\r\n",
    )
    + b": ping\r\n\r\n"
    + b'data:{"id":"c-crlf","object":"chat.completion.chunk","model":"m","choices":[{"index":0,'
    b'"delta":{"content":"y"},"finish_reason":"stop"}]}\r\n\r\n' + b"data:[DONE]\r\n\r\n"
)


def rev(event: str, obj: dict[str, Any], sort: bool = False) -> bytes:
    body = json.dumps(obj, sort_keys=True, separators=(",", ":")) if sort else orjson.dumps(obj)
    return (
        f"event: {event}\n".encode()
        + b"data: "
        + (body.encode() if isinstance(body, str) else body)
        + b"\n\n"
    )


RESP = {
    "id": "resp_67ccd2",
    "object": "response",
    "created_at": 1741476542,
    "status": "in_progress",
    "model": "gpt-4.1-2025-04-14",
    "output": [],
    "usage": None,
}
R = {"response": RESP}
RESP_DONE = {
    **RESP,
    "status": "completed",
    "output": [
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hi there", "annotations": []}],
        }
    ],
    "usage": {
        "input_tokens": 37,
        "input_tokens_details": {"cached_tokens": 32},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 39,
    },
}


def text_delta(seq: int, d: str) -> dict[str, Any]:
    return {
        "type": "response.output_text.delta",
        "item_id": "msg_1",
        "output_index": 0,
        "content_index": 0,
        "delta": d,
        "sequence_number": seq,
    }


# Responses API with event: lines. response.completed is serialized with sorted keys, so its
# nested "type" values ("message", "output_text") come before the event's own type.
RESPONSES = b"".join(
    [
        rev(
            "response.created", {"type": "response.created", "sequence_number": 0, "response": RESP}
        ),
        rev(
            "response.in_progress",
            {"type": "response.in_progress", "sequence_number": 1, "response": RESP},
        ),
        rev(
            "response.output_item.added",
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "sequence_number": 2,
                "item": {"id": "msg_1", "type": "message", "role": "assistant", "content": []},
            },
            sort=True,
        ),
        rev("response.output_text.delta", text_delta(3, "Hi")),
        rev("response.output_text.delta", text_delta(4, "")),
        rev("response.output_text.delta", text_delta(5, " there")),
        rev(
            "response.output_text.done",
            {"type": "response.output_text.done", "sequence_number": 6, "text": "Hi there"},
        ),
        rev(
            "response.completed",
            {"type": "response.completed", "sequence_number": 7, "response": RESP_DONE},
            sort=True,
        ),
    ]
)

RESPONSES_FAILED = b"".join(
    [
        rev(
            "response.created", {"type": "response.created", "sequence_number": 0, "response": RESP}
        ),
        rev("response.output_text.delta", text_delta(1, "Hi")),
        rev(
            "response.failed",
            {
                "type": "response.failed",
                "sequence_number": 2,
                "response": {
                    **RESP,
                    "status": "failed",
                    "error": {"code": "server_error", "message": "boom"},
                },
            },
        ),
    ]
)

STREAMS: dict[str, tuple[API, bytes]] = {
    "vllm_chat": ("chat", VLLM_CHAT),
    "llamacpp_chat": ("chat", LLAMACPP_CHAT),
    "llamacpp_chat_new": ("chat", LLAMACPP_CHAT_NEW),
    "sglang_spaced": ("chat", SGLANG_CHAT),
    "completions": ("completions", COMPLETIONS),
    "chat_n2": ("chat", CHAT_N2),
    "tool_calls": ("chat", TOOL_CALLS),
    "reasoning": ("chat", REASONING),
    "error_mid_stream": ("chat", ERROR_MID),
    "cut_without_done": ("chat", CUT),
    "crlf_comments": ("chat", CRLF_COMMENTS),
    "responses": ("responses", RESPONSES),
    "responses_failed": ("responses", RESPONSES_FAILED),
}

# ---------------------------------------------------------------------------------------------
# The slow reference: split the whole stream into events, parse every one, decide from the
# parsed objects. The fast meter must agree with it for every split of every stream.

T0, T_UP = 0.0, 1.0


def recv_time(i: int) -> float:
    return 10.0 + i


def sent_time(i: int) -> float:
    return 10.25 + i


@dataclass
class RefEvent:
    end: int  # offset just past its separator in the whole stream
    data: bytes | None


def ref_events(stream: bytes) -> tuple[list[RefEvent], int]:
    """Complete events and the offset where the unterminated tail begins."""
    events = []
    pos = 0
    for m in re.finditer(rb"\r\n\r\n|\n\n", stream):
        raw = stream[pos : m.start()]
        lines = re.split(rb"\r\n|\n", raw)
        data = [ln[5:].removeprefix(b" ") for ln in lines if ln.startswith(b"data:")]
        events.append(RefEvent(m.end(), b"\n".join(data) if data else None))
        pos = m.end()
    return events, pos


def ref_is_output(api: str, obj: Any) -> bool:
    if not isinstance(obj, dict):
        return False
    if api == "responses":
        t = obj.get("type", "")
        return isinstance(t, str) and t.endswith(".delta") and bool(obj.get("delta"))
    for c in obj.get("choices") or []:
        if api == "completions":
            if isinstance(c.get("text"), str) and c["text"]:
                return True
            continue
        d = c.get("delta") or {}
        for k in ("content", "reasoning_content", "reasoning", "refusal"):
            if isinstance(d.get(k), str) and d[k]:
                return True
        if isinstance(d.get("tool_calls"), list) and d["tool_calls"]:
            return True
    return False


def ref_is_usage_only(api: str, obj: Any) -> bool:
    return (
        api != "responses"
        and isinstance(obj, dict)
        and obj.get("choices") == []
        and isinstance(obj.get("usage"), dict)
    )


def reference(api: str, stream: bytes, cuts: list[int], strip: bool) -> tuple[bytes, StreamFacts]:
    bounds = [0, *cuts, len(stream)]
    events, tail_at = ref_events(stream)

    def feed_index(end: int) -> int:
        return next(i for i in range(len(bounds) - 1) if bounds[i] < end <= bounds[i + 1])

    client = bytearray()
    pos = 0
    out_feeds: list[int] = []
    n_events = 0
    completed = False
    error: str | None = None
    reasons: list[str] = []
    rid = model = None
    out_tok = in_tok = cached = None
    prefill_s: float | None = None
    for ev in events:
        start, pos = pos, ev.end
        obj = None
        if ev.data is not None:
            n_events += 1
            if ev.data == b"[DONE]":
                completed = True
            else:
                try:
                    obj = orjson.loads(ev.data)
                except orjson.JSONDecodeError:
                    obj = None
        if strip and ref_is_usage_only(api, obj):
            pass
        else:
            client += stream[start:pos]
        if not isinstance(obj, dict):
            continue
        if ref_is_output(api, obj):
            out_feeds.append(feed_index(ev.end))
        if api == "responses":
            t = obj.get("type")
            resp = obj.get("response")
            if isinstance(resp, dict):
                rid, model = resp["id"], resp["model"]
                if isinstance(resp.get("usage"), dict):
                    u = resp["usage"]
                    out_tok, in_tok = u["output_tokens"], u["input_tokens"]
                    cached = u["input_tokens_details"]["cached_tokens"]
                if t == "response.completed":
                    reasons.append("stop")
                    completed = True
                if t == "response.failed":
                    reasons.append("error")
                    error = resp["error"]["code"]
                    completed = True
            continue
        if "error" in obj:
            error = obj["error"]["type"]
            continue
        rid = rid or obj.get("id")
        model = model or obj.get("model")
        for c in obj.get("choices") or []:
            if c.get("finish_reason"):
                reasons.append(c["finish_reason"])
                completed = True
        if isinstance(obj.get("usage"), dict):
            u = obj["usage"]
            out_tok, in_tok = u.get("completion_tokens"), u.get("prompt_tokens")
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        timings = obj.get("timings")
        if isinstance(timings, dict) and "prompt_ms" in timings:
            prefill_s = timings["prompt_ms"] / 1000.0
    if strip:
        client += stream[tail_at:]
    if error is None and not completed:
        error = "incomplete_stream"
    if error is not None and "error" not in reasons:
        reasons.append("error")
    sent = [sent_time(i) for i in out_feeds]
    first, last = (sent[0], sent[-1]) if sent else (None, None)
    tpot = None
    if first is not None and last is not None and out_tok and out_tok > 1:
        tpot = (last - first) / (out_tok - 1)
    facts = StreamFacts(
        ttft_s=None if first is None else first - T0,
        upstream_ttft_s=None if not out_feeds else recv_time(out_feeds[0]) - T_UP,
        itl_s=[b - a for a, b in itertools.pairwise(sent)],
        tpot_s=tpot,
        e2e_s=None if last is None else last - T0,
        chunks=len(out_feeds),
        events=n_events,
        output_tokens=out_tok,
        input_tokens=in_tok,
        cached_tokens=cached,
        finish_reasons=reasons,
        response_id=rid,
        response_model=model,
        error=error,
        cancelled=False,
        first_output_at=first,
        last_output_at=last,
        forward_s=[sent_time(i) - recv_time(i) for i in sorted(set(out_feeds))],
        engine_prefill_s=prefill_s,
    )
    return (bytes(client) if strip else stream), facts


def run_meter(api: API, stream: bytes, cuts: list[int], strip: bool) -> tuple[bytes, StreamFacts]:
    m = StreamMeter(api, t0=T0, strip_usage=strip)
    m.upstream_sent(T_UP)
    bounds = [0, *cuts, len(stream)]
    client = b""
    for i in range(len(bounds) - 1):
        read = stream[bounds[i] : bounds[i + 1]]
        passes = m.passes_through(read)
        out = m.feed(read, recv_time(i))
        # The forwarder writes such reads before metering them: that must change nothing.
        assert out == read or not passes
        client += out
        m.mark_sent(sent_time(i))
    rest, facts = m.finish(1000.0)
    return client + rest, facts


@st.composite
def recorded_split(draw: st.DrawFn) -> tuple[str, list[int], bool]:
    name = draw(st.sampled_from(sorted(STREAMS)))
    n = len(STREAMS[name][1])
    cuts = draw(st.lists(st.integers(1, n - 1), max_size=40, unique=True).map(sorted))
    return name, cuts, draw(st.booleans())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recorded_split())
def test_any_split_of_a_recorded_stream_gives_the_reference_facts(
    case: tuple[str, list[int], bool],
) -> None:
    name, cuts, strip = case
    api, stream = STREAMS[name]
    assert run_meter(api, stream, cuts, strip) == reference(api, stream, cuts, strip)


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_byte_at_a_time_feeding_matches_the_reference(name: str) -> None:
    api, stream = STREAMS[name]
    cuts = list(range(1, len(stream)))
    for strip in (False, True):
        assert run_meter(api, stream, cuts, strip) == reference(api, stream, cuts, strip)


# Generated chat streams: adversarial text (quotes, backslashes, fake keys, newlines) in every
# field the byte search looks at, compact or spaced JSON, LF or CRLF framing.
TRICKY = st.lists(
    st.sampled_from(['"', "\\", ":", " ", "a", "\n", "é", "{", "}", "[", "]", ","])
    | st.sampled_from(
        ['"content":"', '\\"content\\": "x"', '"usage":{', '"choices":[]', '"error"']
    ),
    max_size=8,
).map("".join)


@st.composite
def generated_chat(draw: st.DrawFn) -> tuple[bytes, list[int], bool]:
    objs: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(1, 8))):
        d: dict[str, Any] = {}
        for key in ("content", "reasoning_content", "reasoning", "refusal"):
            v = draw(st.none() | st.just("") | TRICKY | st.just(None))
            if v is not None or draw(st.booleans()):
                d[key] = v
        if draw(st.booleans()):
            d["tool_calls"] = draw(
                st.lists(st.fixed_dictionaries({"index": st.just(0), "id": TRICKY}), max_size=2)
            )
        finish = draw(st.none() | st.sampled_from(["stop", "length"]))
        objs.append(chunk("gen", "m", [delta(0, finish, **d)], usage=None))
    if draw(st.booleans()):
        objs.append(chunk("gen", "m", [], usage={"prompt_tokens": 1, "completion_tokens": 3}))
    stream = sse(
        *objs,
        spaced=draw(st.booleans()),
        sep=draw(st.sampled_from(["\n\n", "\r\n\r\n"])),
        done=draw(st.booleans()),
    )
    cuts = draw(st.lists(st.integers(1, len(stream) - 1), max_size=10, unique=True).map(sorted))
    return stream, cuts, draw(st.booleans())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generated_chat())
def test_byte_search_classification_agrees_with_full_parse(
    case: tuple[bytes, list[int], bool],
) -> None:
    stream, cuts, strip = case
    assert run_meter("chat", stream, cuts, strip) == reference("chat", stream, cuts, strip)


# ---------------------------------------------------------------------------------------------
# Behaviour, case by case.


def test_usage_chunk_is_stripped_when_client_did_not_ask() -> None:
    client, facts = run_meter("chat", VLLM_CHAT, [], strip=True)
    usage_event = VLLM_CHAT.split(b"\n\n")[-3] + b"\n\n"
    assert b'"choices":[]' in usage_event
    assert client == VLLM_CHAT.replace(usage_event, b"")
    assert facts.output_tokens == 5 and facts.input_tokens == 24 and facts.cached_tokens == 16


def test_usage_chunk_is_forwarded_when_client_asked() -> None:
    client, facts = run_meter("chat", VLLM_CHAT, [], strip=False)
    assert client == VLLM_CHAT
    assert facts.output_tokens == 5


def test_without_strip_feed_forwards_each_read_immediately_and_unchanged() -> None:
    m = StreamMeter("chat", t0=0.0, strip_usage=False)
    for i in range(0, len(VLLM_CHAT), 7):
        piece = VLLM_CHAT[i : i + 7]
        assert m.feed(piece, 1.0) is piece


def test_whole_events_without_usage_pass_through_so_they_are_written_before_metering() -> None:
    events = sse(chunk("c1", "m", [delta(content="hi")]), done=False)
    m = StreamMeter("chat", t0=T0, strip_usage=True)
    assert m.passes_through(events)
    assert not m.passes_through(events[:-1])  # an incomplete event may be the usage chunk
    usage = sse(chunk("c1", "m", [], usage={"prompt_tokens": 1, "completion_tokens": 1}))
    assert not m.passes_through(usage)
    assert StreamMeter("chat", t0=T0, strip_usage=False).passes_through(usage)


def test_strip_mode_holds_back_only_the_incomplete_trailing_event() -> None:
    m = StreamMeter("chat", t0=0.0, strip_usage=True)
    first_end = VLLM_CHAT.index(b"\n\n") + 2
    assert m.feed(VLLM_CHAT[: first_end + 10], 1.0) == VLLM_CHAT[:first_end]


def test_llamacpp_final_chunk_with_usage_and_timings_is_kept_and_metered() -> None:
    client, facts = run_meter("chat", LLAMACPP_CHAT, [], strip=True)
    assert client == LLAMACPP_CHAT
    assert facts.chunks == 7 and facts.output_tokens == 7 and facts.finish_reasons == ["stop"]
    assert facts.response_id == "chatcmpl-Xq2" and facts.error is None


def test_role_only_empty_and_usage_events_are_not_output() -> None:
    _, facts = run_meter("chat", VLLM_CHAT, [], strip=False)
    assert facts.chunks == 5  # "The", " sky", " is", " blue", "."
    assert facts.events == 8  # role + 5 + usage + [DONE]
    _, facts = run_meter("completions", COMPLETIONS, [], strip=False)
    assert facts.chunks == 3 and facts.finish_reasons == ["length"]


def test_timings_come_from_client_send_times() -> None:
    m = StreamMeter("chat", t0=100.0, strip_usage=False)
    m.upstream_sent(100.5)
    events = VLLM_CHAT.split(b"\n\n")[:-1]
    feeds = [events[0] + b"\n\n" + events[1] + b"\n\n", events[2] + b"\n\n"]
    feeds.append(b"".join(e + b"\n\n" for e in events[3:]))  # " is", " blue", ".", usage, DONE
    for i, data in enumerate(feeds):
        m.feed(data, 101.0 + i)
        m.mark_sent(101.1 + i)
    _, f = m.finish(110.0)
    assert f.ttft_s == pytest.approx(1.1)  # first output ("The") written at 101.1
    assert f.upstream_ttft_s == pytest.approx(0.5)  # received 101.0, sent upstream 100.5
    assert f.itl_s == pytest.approx([1.0, 1.0, 0.0, 0.0])  # one per output event after first
    assert f.e2e_s == pytest.approx(3.1)
    assert f.tpot_s == pytest.approx((103.1 - 101.1) / 4)
    assert f.first_output_at == pytest.approx(101.1) and f.last_output_at == pytest.approx(103.1)
    assert f.forward_s == pytest.approx([0.1, 0.1, 0.1])


def test_upstream_ttft_is_measured_from_the_last_attempt() -> None:
    m = StreamMeter("chat", t0=0.0, strip_usage=False)
    m.upstream_sent(1.0)  # attempt 1 failed before the first byte
    m.upstream_sent(3.0)
    m.feed(VLLM_CHAT, 4.0)
    m.mark_sent(4.5)
    _, f = m.finish(5.0)
    assert f.upstream_ttft_s == 1.0 and f.ttft_s == 4.5


def test_error_event_mid_stream_is_recorded_as_error_not_success() -> None:
    _, f = run_meter("chat", ERROR_MID, [], strip=False)
    assert f.error == "InternalServerError"
    assert f.finish_reasons == ["error"]
    assert f.chunks == 2


def test_stream_cut_without_done_is_incomplete() -> None:
    client, f = run_meter("chat", CUT, [], strip=True)
    assert client == CUT  # the torn tail is still flushed to the client
    assert f.error == "incomplete_stream" and "error" in f.finish_reasons
    assert f.chunks == 2


@pytest.mark.parametrize("strip", [False, True])
@pytest.mark.parametrize("framed", [False, True], ids=["from_the_start", "after_an_event"])
def test_an_event_that_never_ends_is_held_only_up_to_max_event_bytes(
    strip: bool, framed: bool
) -> None:
    # A backend that never sends a blank line must not grow what the meter (and the relay)
    # hold: past the bound, feed() says so and the relay ends the stream with an error.
    m = StreamMeter("chat", t0=0.0, strip_usage=strip)
    if framed:  # the separator is known: the bound is checked where an event is resumed
        m.feed(sse(chunk("c", "m", [delta(content="hi")]), done=False), 1.0)
    m.feed(b'data: {"choices":[{"delta":{"content":"', 1.0)
    piece, fed = b"a" * 65536, 0
    with pytest.raises(EventTooLarge) as err:
        while fed <= MAX_EVENT_BYTES + 2 * len(piece):
            m.feed(piece, 1.0)
            fed += len(piece)
    assert MAX_EVENT_BYTES < err.value.size <= MAX_EVENT_BYTES + len(piece)  # not before


def test_proxy_reported_error_wins_over_stream_state() -> None:
    m = StreamMeter("chat", t0=0.0, strip_usage=False)
    m.feed(CUT, 1.0)
    m.mark_sent(1.0)
    _, f = m.finish(2.0, error="upstream_idle_timeout")
    assert f.error == "upstream_idle_timeout"


def test_client_disconnect_is_recorded_as_cancelled() -> None:
    m = StreamMeter("chat", t0=0.0, strip_usage=False)
    cut = VLLM_CHAT.index(b" sky")  # role chunk + "The" delivered
    m.feed(VLLM_CHAT[:cut], 1.0)
    m.mark_sent(1.1)
    m.feed(VLLM_CHAT[cut:], 2.0)  # the write of these bytes failed: no mark_sent
    _, f = m.finish(2.5, cancelled=True)
    assert f.cancelled and "cancelled" in f.finish_reasons and f.error is None
    assert f.last_output_at == 1.1  # undelivered events are not timed


def test_unmarked_output_counts_as_sent_at_finish() -> None:
    m = StreamMeter("chat", t0=0.0, strip_usage=False)
    m.feed(VLLM_CHAT, 1.0)
    _, f = m.finish(2.0)
    assert f.ttft_s == 2.0 and f.chunks == 5


def test_n2_counts_every_choice_and_keeps_each_finish_reason() -> None:
    _, f = run_meter("chat", CHAT_N2, [], strip=True)
    assert f.chunks == 4 and f.finish_reasons == ["length", "stop"]


def test_tool_calls_and_reasoning_content_are_output() -> None:
    _, f = run_meter("chat", TOOL_CALLS, [], strip=False)
    assert f.chunks == 4 and f.finish_reasons == ["tool_calls"]
    _, f = run_meter("chat", REASONING, [], strip=False)
    assert f.chunks == 4


def test_spaced_json_is_classified_and_its_usage_stripped() -> None:
    client, f = run_meter("chat", SGLANG_CHAT, [], strip=True)
    assert f.chunks == 2 and f.output_tokens == 3 and f.finish_reasons == ["stop"]
    assert b'"usage": {' not in client and client.count(b"data:") == 5


def test_crlf_framing_comments_and_data_without_space() -> None:
    _, f = run_meter("chat", CRLF_COMMENTS, [5, 40], strip=False)
    assert f.chunks == 2 and f.events == 4 and f.finish_reasons == ["stop"] and f.error is None


def test_responses_api_stream() -> None:
    client, f = run_meter("responses", RESPONSES, [], strip=True)
    assert client == RESPONSES
    assert f.chunks == 2  # the empty delta does not count
    assert (f.input_tokens, f.output_tokens, f.cached_tokens) == (37, 2, 32)
    assert f.response_id == "resp_67ccd2" and f.response_model == "gpt-4.1-2025-04-14"
    assert f.finish_reasons == ["stop"] and f.error is None
    _, f = run_meter("responses", RESPONSES_FAILED, [], strip=False)
    assert f.error == "server_error" and f.finish_reasons == ["error"]


def test_meter_json_reads_usage_finish_and_ids() -> None:
    body = orjson.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "m",
            "choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}],
            "usage": {
                "prompt_tokens": 7,
                "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        }
    )
    f = meter_json("chat", body, t0=1.0, now=1.5)
    assert f.e2e_s == 0.5 and f.ttft_s is None and f.chunks == 0
    assert (f.input_tokens, f.output_tokens, f.cached_tokens) == (7, 1, 4)
    assert f.finish_reasons == ["stop"] and f.response_id == "chatcmpl-1" and f.error is None


def test_meter_json_error_and_responses_bodies() -> None:
    err = meter_json(
        "chat", b'{"error":{"message":"x","type":"BadRequestError","code":400}}', t0=0, now=1
    )
    assert err.error == "BadRequestError" and err.finish_reasons == ["error"]
    old = meter_json(
        "chat", b'{"object":"error","message":"x","type":"NotFoundError"}', t0=0, now=1
    )
    assert old.error == "NotFoundError"
    assert meter_json("chat", b"<html>", t0=0, now=1).error == "invalid_response"
    r = meter_json("responses", orjson.dumps(RESP_DONE), t0=0, now=2)
    assert (r.input_tokens, r.output_tokens, r.finish_reasons) == (37, 2, ["stop"])


SSE_FRAGMENTS = [b"data: ", b"\n\n", b"\r\n", b'"content":"', b"{", b"[DONE]"]
USAGE = b'data: {"id":"u","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}'
USAGE_EVENTS = [USAGE + sep for sep in (b"\n\n", b"\r\n\r\n")]  # what strip mode may drop
# ... and followed by another event in the same piece, so a cut is not always at a read's end
USAGE_THEN_DONE = [USAGE + sep + b"data: [DONE]" + sep for sep in (b"\n\n", b"\r\n\r\n")]


def framed(stream: bytes) -> tuple[list[bytes], bytes, bytes]:
    """The stream cut as the meter cuts it: whole events (separator included), the unterminated
    tail, and the line break (the first newline fixes CRLF or LF for the whole stream)."""
    k = stream.find(b"\n")
    if k < 0:
        return [], stream, b"\n"
    nl = b"\r\n" if k > 0 and stream[k - 1] == 0x0D else b"\n"
    sep = nl + nl
    events, pos = [], 0
    while (end := stream.find(sep, pos)) >= 0:
        events.append(stream[pos : end + len(sep)])
        pos = end + len(sep)
    return events, stream[pos:], nl


def is_usage_only_event(api: str, event: bytes, nl: bytes) -> bool:
    lines = event[: -2 * len(nl)].split(nl)
    data = [ln[6:] if ln[5:6] == b" " else ln[5:] for ln in lines if ln.startswith(b"data:")]
    try:
        obj = orjson.loads(b"\n".join(data)) if data else None
    except orjson.JSONDecodeError:
        return False
    return ref_is_usage_only(api, obj)


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(["chat", "completions", "responses"]),
    st.lists(
        st.binary(max_size=40) | st.sampled_from([*SSE_FRAGMENTS, *USAGE_EVENTS, *USAGE_THEN_DONE]),
        max_size=30,
    ),
    st.booleans(),
    st.lists(st.integers(0, 2000), max_size=8),
)
@example("chat", [b"\n", USAGE_THEN_DONE[1], b"\n"], True, [])  # mixed line ends (a bug once)
def test_garbage_never_raises_and_strip_mode_loses_no_bytes(
    api: API, pieces: list[bytes], strip: bool, splits: list[int]
) -> None:
    stream = b"".join(pieces)
    # Reads cut across the pieces too, so a dropped event is sometimes followed by more bytes.
    bounds = sorted({0, len(stream), *(i % (len(stream) + 1) for i in splits)})
    m = StreamMeter(api, t0=0.0, strip_usage=strip)
    out = b"".join(m.feed(stream[a:b], 1.0) for a, b in itertools.pairwise(bounds))
    rest, _ = m.finish(2.0)
    client = out + rest
    if not strip:
        assert client == stream
        return
    # Strip mode may drop whole usage-only events and nothing else: every other event, and
    # the unterminated tail, reach the client unchanged and in order.
    events, tail, nl = framed(stream)
    pos = 0
    for event in events:
        if client.startswith(event, pos):
            pos += len(event)
        else:
            assert is_usage_only_event(api, event, nl), (event, client[pos:])
    assert client[pos:] == tail


def test_llamacpp_prefill_time_is_read_from_its_usage_only_chunk() -> None:
    # With include_usage, llama.cpp sends its timings on the usage-only chunk, not on the
    # finish chunk; the meter returned on usage before reading them, so every client that asked
    # for usage left the doctor without the engine's prefill (tests/test_llamacpp_doctor.py).
    for strip in (False, True):
        _, facts = run_meter("chat", LLAMACPP_CHAT_NEW, [], strip=strip)
        assert facts.engine_prefill_s == 0.004938
        assert facts.input_tokens == 3 and facts.cached_tokens == 1  # usage's, as before


def test_llamacpp_timings_give_prompt_and_cached_tokens_when_no_usage_does() -> None:
    # llama.cpp without include_usage: its last chunk carries `timings` (cache_n tokens came
    # from its prompt cache, prompt_n were computed), which is all the cache learner needs.
    stream = (
        b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}],'
        b'"id":"c1","model":"m","object":"chat.completion.chunk"}\n\n'
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}],"id":"c1",'
        b'"model":"m","object":"chat.completion.chunk","timings":{"cache_n":96,"prompt_n":7,'
        b'"prompt_ms":12.5,"predicted_n":1}}\n\n'
        b"data: [DONE]\n\n"
    )
    _, facts = run_meter("chat", stream, [], strip=False)
    assert facts.cached_tokens == 96 and facts.input_tokens == 103
    assert facts.engine_prefill_s == 0.0125  # prompt_ms: its prefill, for the doctor
    whole = orjson.dumps(
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 103, "completion_tokens": 1},
         "timings": {"cache_n": 64, "prompt_n": 39}}
    )  # fmt: skip
    facts = meter_json("chat", whole, t0=0.0, now=1.0)
    assert facts.input_tokens == 103 and facts.cached_tokens == 64  # usage first, then timings


# ---------------------------------------------------------------------------------------------
# The byte scans the meter classifies with (proxy/jsonscan.py) and the SSE data field.


def test_a_key_counts_only_with_a_non_empty_value_of_its_kind() -> None:
    content, tools = b'"content":', b'"tool_calls":'
    assert nonempty_at(b'{"content": "x"}', content)
    assert nonempty_at(b'{"content":" "}', content)  # a space is output too
    for empty in (b'{"content":""}', b'{"content":null}', b'{"content":[1]}', b'{"content":'):
        assert not nonempty_at(empty, content), empty
    # Every occurrence is looked at: an empty first choice does not hide the second.
    assert nonempty_at(b'[{"content":""},{"content":"a"}]', content)
    assert nonempty_at(b'{"tool_calls": [ {"index":0} ]}', tools, ARRAY)
    for empty in (b'{"tool_calls":[ ]}', b'{"tool_calls":"x"}', b'{"tool_calls":null}'):
        assert not nonempty_at(empty, tools, ARRAY), empty


def test_a_value_is_looked_for_only_between_the_bounds_given() -> None:
    buf = b'{"finish_reason": "stop"}\n\n{"finish_reason":null}'
    second = buf.index(b"\n\n") + 2
    assert value_starts(buf, FINISH, QUOTE)
    assert not value_starts(buf, FINISH, QUOTE, second)
    assert not value_starts(buf, FINISH, QUOTE, 0, buf.index(b'"stop"'))
    assert value_starts(buf, FINISH, QUOTE, 0, second)
    assert value_starts(b'{"usage": {"prompt_tokens":1}}', b'"usage":', 0x7B)
    assert not value_starts(b'{"usage":null}', b'"usage":', 0x7B)


def test_an_events_data_is_its_data_lines_joined_without_other_fields() -> None:
    assert data_of(b"data: {}") == b"{}" and data_of(b"data:{}") == b"{}"
    assert data_of(b': ping\nevent: x\nid: 3\ndata: {"a":\ndata: 1}') == b'{"a":\n1}'
    assert data_of(b"data:  x") == b" x"  # only one space belongs to the framing
    assert data_of(b": ping") is None and data_of(b"event: x\nretry: 5") is None
    assert data_of(b"id: 1\r\ndata: [DONE]", b"\r\n") == b"[DONE]"


def test_a_joined_data_field_is_not_split_again() -> None:
    """An event that does not start with its data line (an event: line, or a stray line end
    in a stream of mixed line ends) has its data lines joined before it is read; they were
    then split again as if still raw, so only the first line was parsed. A usage chunk
    followed by [DONE] in one such event was taken for a usage-only event and cut whole in
    strip mode, [DONE] with it (found by the garbage property test above)."""
    mixed = b'\ndata: {"id":"u","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}'
    stream = mixed + b"\r\n\r\ndata: [DONE]\r\n\r\n\n"
    m = StreamMeter("chat", t0=0.0, strip_usage=True)
    out = m.feed(stream, 1.0)
    rest, _ = m.finish(2.0)
    assert out + rest == stream  # not usage-only as a whole: nothing cut
    # A usage chunk whose JSON spans two data lines, after an event: line, is read whole.
    two_lines = (
        b'event: chunk\ndata: {"id":"u","choices":[],\n'
        b'data: "usage":{"prompt_tokens":3,"completion_tokens":2}}\n\ndata: [DONE]\n\n'
    )
    m = StreamMeter("chat", t0=0.0, strip_usage=True)
    out = m.feed(two_lines, 1.0)
    _, facts = m.finish(2.0)
    assert (facts.input_tokens, facts.output_tokens) == (3, 2)
    assert out == b"data: [DONE]\n\n"  # the usage-only event is what strip mode cuts
