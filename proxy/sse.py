"""Server-sent events on the wire: framing one event, reading an event's data, finding the
last complete event in a read.

Pure and a leaf: the proxy's meter and relay, the ASGI toolkit (proxy/asgi.py), the simulator
and the bench's client all read and write the same framing here, so the bench may use it and
still import nothing of the proxy.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["DONE", "SSE_DONE", "data_of", "event_boundary", "sse"]

DONE = b"[DONE]"  # the data of OpenAI's end-of-stream event
SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One event: `data: <JSON>` and the blank line (bytes are sent as they are)."""
    data = obj if isinstance(obj, bytes) else orjson.dumps(obj)
    return b"data: " + data + b"\n\n"


def data_of(event: bytes, nl: bytes = b"\n") -> bytes | None:
    """The data field of one event (without its blank line), or None when it has none.

    `nl` is the stream's line end. Data lines are joined with a newline, each without its
    `data:` and one space after it; event:, id:, retry: and comment lines are skipped.
    """
    parts: list[bytes] = []
    for line in event.split(nl):
        if line.startswith(b"data:"):
            parts.append(line[6:] if line[5:6] == b" " else line[5:])
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else b"\n".join(parts)


def event_boundary(data: bytes) -> int:
    """The length of `data` up to and including its last complete event (0: none)."""
    best = 0
    for sep in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        i = data.rfind(sep)
        if i >= 0 and i + len(sep) > best:
            best = i + len(sep)
    return best
