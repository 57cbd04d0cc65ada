"""A paced stream's reads relayed in the upstream connection's own callback.

An engine sends each token tens of milliseconds after the last, so every chunk is its own
read. Relayed by the stream's task, each costs a future, its wake-up, a task step down and up
the request's whole chain of coroutines and back, before the meter and the write (about a
seventh of a paced chunk's instructions). While the relay waits for the next read, the
connection hands it to `pusher`'s step instead (UpstreamResponse.push_to), which meters and
writes it then and there; the task sleeps on until something else happens to the stream.

The step takes only what it can finish exactly as the task would: whole events (the read
ends with a blank line, the stream's separator is LF), ASCII (no UTF-8 check to make), the
client's connection writable (asgi.body_writer), nothing held back of an unfinished event.
Anything else it declines before touching anything, and the task reads it as it always
did: the end of the stream, errors, timeouts, the client leaving, a cut, a slow client.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from proxy import asgi
from proxy.asgi import Send
from proxy.forwarding.meter import EventTooLarge, StreamMeter

if TYPE_CHECKING:
    from proxy.forwarding.ports import UpstreamResponseLike

__all__ = ["direct", "pusher", "through_send"]


def pusher(
    meter: StreamMeter,
    write: Callable[[bytes], bool],
    progress: Callable[[float], None],
    idle_s: float,
) -> Callable[[bytes], bool] | None:
    """The relay's step for one read (True: relayed; False: declined, nothing done), or None
    where reads must go through the task: a stream whose separator is not LF."""
    if meter.separator != b"\n\n":
        return None
    perf = time.perf_counter
    feed, mark_sent = meter.feed, meter.mark_sent

    def push(data: bytes) -> bool:
        # write(b"") writes nothing: True while the client's connection takes writes.
        if data[-2:] != b"\n\n" or not data.isascii() or not write(b""):
            return False
        try:
            out = feed(data, perf())
        except EventTooLarge:  # before it changed anything: the task meets it again
            return False
        if out:  # whole events: the meter holds none back when the read ends on one
            progress(idle_s)
            write(out)
            mark_sent(perf())
        return True

    return push


def through_send(body: bytes) -> bool:
    """The body writer where the server offers none: every part goes through `send`."""
    return False


def direct(
    send: Send, meter: StreamMeter, upstream: UpstreamResponseLike, idle_s: float
) -> tuple[Callable[[bytes], bool], Callable[[bytes], bool] | None]:
    """Once a stream's first part is out: its writer of later parts (asgi.body_writer, or
    one that sends them all through `send`) and, where the server has a writer, the step
    that relays reads in the upstream's callback (proxy/forwarding/push.py)."""
    write = asgi.body_writer(send)
    if write is None:
        return through_send, None
    return write, pusher(meter, write, upstream.set_read_timeout, idle_s)
