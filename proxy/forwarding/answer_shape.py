"""What an upstream's answer is, judged from its head and bytes (pure: no I/O).

The relay (proxy/forwarding/relay.py) asks these before it passes an answer on: whether a
streamed answer is an event stream, whether a JSON answer is a JSON object and not an error
object, and how much of a read is valid UTF-8 (whole events only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

from proxy.sse import event_boundary

if TYPE_CHECKING:
    from proxy.forwarding.ports import UpstreamResponseLike
    from proxy.types import StreamFacts

# The usual event-stream heads, found by one C-level search each: the per-request check
SSE_TYPES = (
    (b"content-type", b"text/event-stream"),
    (b"content-type", b"text/event-stream; charset=utf-8"),
)


def content_type(upstream: UpstreamResponseLike) -> bytes:
    for k, v in upstream.headers:
        if k == b"content-type":
            return v
    return b""


def media_type(content_type: bytes) -> bytes:
    return content_type.split(b";", 1)[0].strip().lower()


def is_json(content_type: bytes) -> bool:
    media = media_type(content_type)
    return media == b"application/json" or media.endswith(b"+json")


def is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    """An event stream, or a response that does not say (the meter judges its body then)."""
    for k, v in headers:
        if k == b"content-type":
            return media_type(v) == b"text/event-stream"
    return True


def not_an_object(payload: bytes, facts: StreamFacts | None) -> bool:
    """Not what an OpenAI client parses as an answer: a JSON object (in valid UTF-8).

    `facts`: meter_json's, which parsed it (its error is "invalid_response" when it is not
    an object, or when a backend's error object names that type: parsed again only then).
    None for embeddings, which are not parsed (megabytes of floats): their shape is checked.
    """
    if facts is None:
        head, tail = payload[:64].lstrip(), payload[-64:].rstrip()
        if head[:1] != b"{" or tail[-1:] != b"}":
            return True
        return not payload.isascii() and utf8_events(payload) < len(payload)
    if facts.error != "invalid_response":
        return False
    try:
        return not isinstance(orjson.loads(payload), dict)
    except orjson.JSONDecodeError:
        return True


def error_instead(payload: bytes) -> str | None:
    """What a 200 JSON object that is an error and not an answer (no `choices`, no `data`)
    says, briefly; None when it is an answer. The openai client would return it as a
    completion with nothing in it. Parsed again only for a 200 meter_json found an error in."""
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or "choices" in obj or "data" in obj:
        return None
    err = obj.get("error", obj)
    if not isinstance(err, dict):
        return f"error {str(err)[:200]!r}"
    kind, message = err.get("type") or err.get("code"), err.get("message")
    return f"type {str(kind)[:64]!r}: {str(message)[:200]!r}"


def utf8_events(data: bytes) -> int:
    """The length of `data` if it is valid UTF-8, else of its complete events before the
    first byte that is not (0: none)."""
    try:
        data.decode()
    except UnicodeDecodeError as e:
        return event_boundary(data[: e.start])
    return len(data)
