"""The run of common chat events in one upstream read, found in one call.

Nearly every event of a chat stream is the common one: one compact `data: ` line whose delta
has non-empty `"content":"..."` and no finish reason. The stream meter (proxy/forwarding/meter.py)
counts those without parsing them and looks closer only at the others (the first event,
finish reasons, usage, errors, `[DONE]`). Finding one takes four byte searches, and from
Python each is a bytes-method call whose argument parsing costs more than the search: about a
fifth of a paced chunk's instructions, and most of what a short stream's meter spends.

`chat_events` skips the whole run in one call, and `chat_output` is jsonscan's test of the
others (five searches) in one: proxy/_eventscan.c where the compiled hot path
runs (setup.py builds it beside the mypyc modules; proxy/__init__.py chooses both or neither),
else `chat_events_py`, the same scan in Python, which is also the reference the C is tested
against (tests/test_eventscan.py).
"""

from __future__ import annotations

from collections.abc import Callable

import proxy
from proxy.jsonscan import FINISH, FINISH_NULL, FINISH_STRING, QUOTE, value_starts
from proxy.jsonscan import chat_output as chat_output_py

__all__ = ["chat_events", "chat_events_py", "chat_output", "chat_output_py", "implementation"]

DATA = b"data: "
CONTENT = b'"content":"'
_DATA_LEN, _CONTENT_LEN = len(DATA), len(CONTENT)


def chat_events_py(buf: bytes, start: int, search: int, sep: bytes) -> tuple[int, int, int]:
    """Skip the common chat events from the one that starts at `start`.

    `search`: where to look for the next separator `sep` (>= start: a resumed read's held-back
    event has none before it). An event is common when it starts with `data: `, some
    `"content":"` in it is followed by a byte that is not `"`, and no `"finish_reason":` in it
    has a string value (jsonscan.value_starts). Returns (how many were skipped, where the event
    after them starts, where the separator of that event is: -1 when no separator follows, so
    the event is not whole yet, or when the read ends at `start`). The caller classifies the
    event at [start, end) itself and calls again after it.
    """
    n = len(buf)
    # Two counts over the rest of the read spare most events their finish search: no event
    # that ends before `clear` has a string finish reason (every such key before it is null).
    if buf.count(FINISH, start) == buf.count(FINISH_NULL, start):
        clear = n
    else:
        clear = buf.find(FINISH_STRING, start)
        if clear < 0:
            clear = n
        if buf.count(FINISH, start, clear) != buf.count(FINISH_NULL, start, clear):
            clear = -1
    seplen = len(sep)
    k = 0
    while search < n:
        end = buf.find(sep, search)
        if end < 0:
            break
        if not buf.startswith(DATA, start, end):
            return k, start, end
        i = buf.find(CONTENT, start + _DATA_LEN, end)
        if (
            i < 0
            or buf[i + _CONTENT_LEN] == QUOTE  # i + _CONTENT_LEN <= end: the separator follows
            or (end > clear and value_starts(buf, FINISH, QUOTE, start + _DATA_LEN, end))
        ):
            return k, start, end
        k += 1
        start = search = end + seplen
    return k, start, -1


ChatEvents = Callable[[bytes, int, int, bytes], tuple[int, int, int]]
ChatOutput = Callable[[bytes], bool]


def _chosen() -> tuple[ChatEvents, ChatOutput, str]:
    native = proxy.native("proxy._eventscan")
    if native is None:
        return chat_events_py, chat_output_py, "python"
    scan: ChatEvents = native.chat_events
    output: ChatOutput = native.chat_output
    return scan, output, "c"


# chat_output: jsonscan.chat_output (its docstring), in one C call where the scan is C too.
chat_events, chat_output, implementation = _chosen()
