"""Byte scans over one event's JSON: what it says, read without parsing it.

The stream meter (proxy/forwarding/meter.py) runs once per upstream read, so it classifies events
with these searches and parses only the few that carry facts. Pure; bytes in, booleans out.

Why byte searches are safe: inside a JSON string every `"` is escaped as `\\"`, so the bytes
`"content":` (quote, name, quote, colon) can only be a real object key, never text inside a
value. Every scan looks at each occurrence of its key, so a choice with an empty value does
not hide a later one that has output.
"""

from __future__ import annotations

__all__ = [
    "ARRAY",
    "FINISH",
    "FINISH_NULL",
    "FINISH_STRING",
    "QUOTE",
    "WS",
    "chat_output",
    "nonempty_at",
    "response_type",
    "value_starts",
]

WS = b" \t\r\n"
QUOTE = 0x22  # "
ARRAY, _CLOSE = 0x5B, 0x5D  # [ ]
FINISH = b'"finish_reason":'
FINISH_NULL = b'"finish_reason":null'
FINISH_STRING = b'"finish_reason":"'


def nonempty_at(p: bytes, key: bytes, opener: int = QUOTE) -> bool:
    """True if some `key` (e.g. b'"content":') in p has a non-empty value of the kind that
    `opener` starts: QUOTE a string (not ""), ARRAY an array (not [ ]); anything else no.

    The meter's inline test for compact chat content (`"content":"` and a byte that is not
    `"`) is this scan's common case, written out where the hot loop cannot afford a call.
    """
    i = p.find(key)
    if i < 0:  # the usual answer for all but one key: no lengths taken
        return False
    n = len(p)
    k = len(key)
    while i >= 0:
        j = i + k
        while j < n and p[j] in WS:
            j += 1
        if j + 1 < n and p[j] == opener:
            j += 1
            if opener == QUOTE:
                if p[j] != QUOTE:
                    return True
            else:
                while j < n and p[j] in WS:
                    j += 1
                if j < n and p[j] != _CLOSE:
                    return True
        i = p.find(key, j)
    return False


def value_starts(buf: bytes, key: bytes, first: int, s: int = 0, e: int = -1) -> bool:
    """True if some `key` in buf[s:e] (e < 0: to the end) is followed, after whitespace, by
    the byte `first` (a `"` for a string, a `{` for an object).

    Searches from the end: the keys it is used for (finish_reason, usage) sit near the end of
    the chunk in vLLM, SGLang and OpenAI output. The bounds spare the caller a slice.
    """
    i = buf.rfind(key, s) if e < 0 else buf.rfind(key, s, e)
    if i < 0:
        return False
    if e < 0:
        e = len(buf)
    k = len(key)
    while i >= 0:
        j = i + k
        while j < e and buf[j] in WS:
            j += 1
        if j < e and buf[j] == first:
            return True
        i = buf.rfind(key, s, i)
    return False


def chat_output(p: bytes) -> bool:
    """Does a chat chunk carry output in any choice (spaced JSON, reasoning, tool calls)?"""
    return (
        nonempty_at(p, b'"content":')
        or nonempty_at(p, b'"reasoning_content":')
        or nonempty_at(p, b'"reasoning":')
        or nonempty_at(p, b'"refusal":')
        or nonempty_at(p, b'"tool_calls":', ARRAY)
    )


def response_type(p: bytes) -> bytes | None:
    """The top-level type of a Responses API event.

    Nested objects carry "type" keys too (output items, content parts), but never a value
    starting with "response.", so the first such value is the event's own type.
    """
    for key in (b'"type":"response.', b'"type": "response.'):
        i = p.find(key)
        if i >= 0:
            j = i + len(key)
            k = p.find(b'"', j)
            return b"response." + p[j:k]
    if p.find(b'"type":"error"') >= 0 or p.find(b'"type": "error"') >= 0:  # (`in` costs more)
        return b"error"
    return None
