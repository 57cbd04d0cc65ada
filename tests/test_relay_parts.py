"""The streaming relay's parts, each alone: how a failed first read is retried, how a stream
that breaks later ends, and the forwarding loop's event alignment."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from proxy.forwarding.meter import StreamMeter
from proxy.forwarding.relay import (
    IDLE_TIMEOUT,
    INVALID_RESPONSE,
    STREAM_CUT,
    Relay,
    first_read_failure,
    stream_break,
)
from proxy.types import FailureKind
from proxy.upstream.pool import UpstreamFirstByteTimeout, UpstreamIdleTimeout, UpstreamPayloadError

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


def test_a_first_read_that_fails_is_retried_with_what_it_says_of_the_backend() -> None:
    timeout = first_read_failure(UpstreamFirstByteTimeout("no progress within 5s"), False)
    assert (timeout.kind, timeout.error_type) == (FailureKind.TIMEOUT, "timeout")
    assert timeout.reason == "no first byte: no progress within 5s"
    cut = first_read_failure(UpstreamPayloadError("reset"), False)
    assert (cut.kind, cut.error_type) == (FailureKind.PROTOCOL, "stream_error")
    empty = first_read_failure(None, False)
    assert (empty.kind, empty.error_type) == (FailureKind.PROTOCOL, "empty_stream")
    for e in (None, UpstreamFirstByteTimeout("x"), UpstreamPayloadError("y")):
        gone = first_read_failure(e, True)  # the client left: no verdict on the backend
        assert (gone.kind, gone.error_type) == (FailureKind.CANCELLED, "cancelled")


def test_a_stream_that_breaks_after_its_first_byte_says_how() -> None:
    assert stream_break(UpstreamIdleTimeout("no progress within 60s"), "b1", 60.0) == (
        IDLE_TIMEOUT,
        "no complete event from b1 for 60s",
    )
    assert stream_break(UpstreamPayloadError("reset by peer"), "b1", 60.0) == (
        STREAM_CUT,
        "b1 broke off the stream: reset by peer",
    )


class Reads:
    """An upstream response that hands out the given reads, then an end (or `error`)."""

    def __init__(
        self, reads: list[bytes], error: BaseException | None = None, *, end_with_last: bool = True
    ) -> None:
        self.reads = list(reads)
        self.error = error
        self.end_with_last = end_with_last  # False: the body's end comes in a read of its own
        self.timeouts: list[float] = []

    async def readany(self) -> bytes:
        if self.reads:
            return self.reads.pop(0)
        if self.error is not None:
            raise self.error
        return b""

    def at_end(self) -> bool:
        return self.end_with_last and not self.reads and self.error is None

    def set_read_timeout(self, seconds: float) -> None:
        self.timeouts.append(seconds)


class FirstByte:
    """The fleet and the steering as the relay tells them of a stream's first byte; each
    note is logged in `log` beside the sends, in order."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def mark_success(self, backend: Any) -> None:
        self.log.append(("success", backend.name))

    def prefilled(self, decision: Any) -> None:
        self.log.append(("prefilled", decision))


def _forward(
    reads: Reads, log: list[Any] | None = None, send_fails: bool = False
) -> tuple[Any, list[bytes], Reads]:
    notes = FirstByte([] if log is None else log)
    relay = Relay("chat", steering=notes, idle_s=30.0, debug_headers=False, fleet=notes)  # type: ignore[arg-type]
    ex = SimpleNamespace(request_id="r1", client_gone=False, decision="d1")
    backend = SimpleNamespace(name="b1")
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if send_fails:
            raise OSError("the client is gone")
        sent.append(message["body"])
        notes.log.append(("sent", message["body"]))

    meter = StreamMeter("chat", t0=0.0, strip_usage=False)
    first = reads.reads.pop(0)
    result = asyncio.run(relay._forward(ex, backend, reads, meter, send, first))  # type: ignore[arg-type]
    return result, sent, reads


def test_the_loop_sends_whole_events_and_holds_back_the_start_of_one_until_its_end() -> None:
    half = len(EVENT) // 2
    reads = Reads([EVENT, EVENT[:half], EVENT[half:] + EVENT], end_with_last=False)
    result, sent, reads = _forward(reads)
    assert result == (None, "", b"")
    assert sent == [EVENT, EVENT + EVENT]  # nothing of the cut event went out on its own
    assert reads.timeouts == [30.0]  # progress: the one read that completed events


def test_the_last_reads_events_are_left_for_the_end_when_the_body_ended_with_them() -> None:
    # (the relay's _finish writes them and the body's end at once: one write, one segment)
    half = len(EVENT) // 2
    result, sent, reads = _forward(Reads([EVENT, EVENT[:half], EVENT[half:] + EVENT + b"data:"]))
    assert result == (None, "", EVENT + EVENT + b"data:")  # in order: events, then the cut one
    assert sent == [EVENT] and reads.timeouts == []


def test_a_first_read_that_is_the_whole_body_is_left_for_the_end_too() -> None:
    result, sent, _ = _forward(Reads([EVENT + DONE]))
    assert result == (None, "", EVENT + DONE) and sent == []


def test_the_loop_returns_what_an_unfinished_event_held_when_the_stream_ends() -> None:
    result, sent, _ = _forward(Reads([EVENT, b'data: {"choi']))
    assert result == (None, "", b'data: {"choi') and sent == [EVENT]


def test_a_break_mid_stream_ends_the_loop_with_its_code_and_drops_the_unfinished_event() -> None:
    result, sent, _ = _forward(Reads([EVENT, b"data: {"], UpstreamIdleTimeout("no progress")))
    assert result == (IDLE_TIMEOUT, "no complete event from b1 for 30s", b"") and sent == [EVENT]


def test_an_event_that_is_not_utf8_ends_the_loop_after_the_events_before_it() -> None:
    bad = b'data: {"choices":[{"index":0,"delta":{"content":"\xff"}}]}\n\n'
    result, sent, _ = _forward(Reads([EVENT, EVENT + bad]))
    assert result[0] == INVALID_RESPONSE and result[2] == b""
    assert sent == [EVENT, EVENT]  # the whole event before it, not the bad one


def test_the_first_byte_is_noted_once_and_after_its_write_when_it_goes_out_unmetered() -> None:
    # The breaker's success and the prompt's prefill over: off the client's TTFT.
    log: list[Any] = []
    _forward(Reads([EVENT, EVENT], end_with_last=False), log)
    assert log == [("sent", EVENT), ("success", "b1"), ("prefilled", "d1"), ("sent", EVENT)]


def test_a_first_read_that_is_metered_is_noted_before_its_write_and_once() -> None:
    log: list[Any] = []
    _forward(Reads([EVENT + EVENT[:5], EVENT[5:]], end_with_last=False), log)
    assert log == [("success", "b1"), ("prefilled", "d1"), ("sent", EVENT), ("sent", EVENT)]
    log.clear()
    _forward(Reads([EVENT + DONE]), log)  # the whole body in one read: it goes with the end
    assert log == [("success", "b1"), ("prefilled", "d1")]


def test_the_first_byte_is_noted_even_when_its_write_fails() -> None:
    # (a half-open breaker's probe is over either way: it must not wait for a verdict)
    log: list[Any] = []
    with pytest.raises(OSError):
        _forward(Reads([EVENT, EVENT], end_with_last=False), log, send_fails=True)
    assert log == [("success", "b1"), ("prefilled", "d1")]
