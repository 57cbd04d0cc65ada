"""Sans-I/O stream meter: upstream SSE bytes and timestamps in, per-request timing facts out.

The meter never touches a socket or a clock; the forwarding path passes `now` (perf_counter) in.
It runs once per upstream read on the hot path, so events are classified with byte searches
(proxy/jsonscan.py says why they are safe) and only the few events that carry facts (the first
event, usage, finish reasons, errors) are parsed with orjson.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson

from proxy.eventscan import chat_events, chat_output
from proxy.jsonscan import (
    FINISH,
    QUOTE,
    nonempty_at,
    response_type,
    value_starts,
)
from proxy.sse import DONE, data_of
from proxy.types import StreamFacts

API = Literal["chat", "completions", "responses"]
# The most bytes of one event held while its end has not arrived. The largest legitimate
# event is a Responses stream's last, which repeats the whole output (~4 bytes a token,
# more when escaped): 4 MiB holds several hundred thousand tokens. A backend that never
# sends a blank line would otherwise grow the held bytes (here and in the relay) forever.
MAX_EVENT_BYTES = 4 * 1024 * 1024


class EventTooLarge(ValueError):
    """An event grew past MAX_EVENT_BYTES without its end."""

    def __init__(self, size: int) -> None:
        super().__init__(f"an event of over {size} bytes without its end")
        self.size = size


# ---------------------------------------------------------------------------------------------
# Classification. Kinds: what the meter needs to know about one event.
OTHER, OUTPUT, USAGE_ONLY, END = 0, 1, 2, 3


def _error_type(err: Any) -> str:
    """A low-cardinality error.type from an OpenAI-style error object."""
    if isinstance(err, dict):
        for k in ("type", "code"):
            v = err.get(k)
            if isinstance(v, str) and v:
                return v
            if isinstance(v, int) and not isinstance(v, bool):
                return str(v)
        inner = err.get("error")
        if inner is not None and inner is not err:
            return _error_type(inner)
    if isinstance(err, str) and err:
        return err
    return "_OTHER"


class _Facts:
    """Mutable accumulator shared by the stream meter and meter_json."""

    __slots__ = (
        "cached_tokens",
        "error",
        "finish_reasons",
        "input_tokens",
        "output_tokens",
        "prefill_s",
        "response_id",
        "response_model",
    )

    def __init__(self) -> None:
        self.output_tokens: int | None = None
        self.input_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.prefill_s: float | None = None
        self.finish_reasons: list[str] = []
        self.response_id: str | None = None
        self.response_model: str | None = None
        self.error: str | None = None

    def usage(self, u: Any) -> None:
        if not isinstance(u, dict):
            return
        out = u.get("completion_tokens", u.get("output_tokens"))
        inp = u.get("prompt_tokens", u.get("input_tokens"))
        if isinstance(out, int):
            self.output_tokens = out
        if isinstance(inp, int):
            self.input_tokens = inp
        details = u.get("prompt_tokens_details") or u.get("input_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.cached_tokens = details["cached_tokens"]

    def timings(self, t: Any) -> None:
        """llama.cpp's `timings` (prompt_n computed + cache_n from its cache): the prompt and
        cached counts when no usage says them (a client that did not ask for usage), and its
        prefill time (prompt_ms), which splits TTFT into waiting and prefill."""
        if not isinstance(t, dict):
            return
        ms = t.get("prompt_ms")
        if isinstance(ms, int | float) and not isinstance(ms, bool) and ms >= 0:
            self.prefill_s = ms / 1000.0
        cached, computed = t.get("cache_n"), t.get("prompt_n")
        if isinstance(cached, int) and isinstance(computed, int):
            if self.cached_tokens is None:
                self.cached_tokens = cached
            if self.input_tokens is None:
                self.input_tokens = cached + computed

    def ident(self, obj: dict[str, Any]) -> None:
        rid, model = obj.get("id"), obj.get("model")
        if self.response_id is None and isinstance(rid, str):
            self.response_id = rid
        if self.response_model is None and isinstance(model, str):
            self.response_model = model

    def choices(self, obj: dict[str, Any]) -> None:
        choices = obj.get("choices")
        if isinstance(choices, list):
            for c in choices:
                if isinstance(c, dict):
                    fr = c.get("finish_reason")
                    if isinstance(fr, str) and fr:
                        self.finish_reasons.append(fr)

    def responses_event(self, obj: dict[str, Any]) -> None:
        """Facts from a Responses API event (created, completed, incomplete, failed, error)."""
        typ = obj.get("type")
        resp = obj.get("response")
        if isinstance(resp, dict):
            rid, model = resp.get("id"), resp.get("model")
            if isinstance(rid, str):
                self.response_id = rid
            if isinstance(model, str):
                self.response_model = model
            self.usage(resp.get("usage"))
            if typ in ("response.completed", "response.incomplete", "response.failed"):
                self.finish_reasons.append(_responses_finish(resp))
            if typ == "response.failed":
                self.error = _error_type(resp.get("error")) if resp.get("error") else "_OTHER"
        elif typ == "error":
            self.error = _error_type(obj)
        elif "error" in obj:
            self.error = _error_type(obj["error"])


def _responses_finish(resp: dict[str, Any]) -> str:
    status = resp.get("status")
    if status == "completed":
        return "stop"
    if status == "incomplete":
        details = resp.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        return "length" if reason == "max_output_tokens" else str(reason or "incomplete")
    if status == "failed":
        return "error"
    return str(status or "unknown")


class StreamMeter:
    """Meters one streamed response. feed() per upstream read, mark_sent() per client write."""

    __slots__ = (
        "_chunks",
        "_completed",
        "_events",
        "_f",
        "_first_sent",
        "_forward",
        "_itl",
        "_joined",
        "_last_sent",
        "_nl",
        "_parsed_first",
        "_pending",
        "_recv_at",
        "_sep",
        "_t_up",
        "_tail",
        "_upstream_first",
        "api",
        "strip_usage",
        "t0",
    )

    def __init__(self, api: API, *, t0: float, strip_usage: bool) -> None:
        self.api = api
        self.t0 = t0
        self.strip_usage = strip_usage
        self._t_up: float | None = None
        self._tail = b""  # bytes of the current incomplete event
        self._sep = b""  # b"\n\n" or b"\r\n\r\n", fixed at the first newline seen
        self._nl = b""
        self._f = _Facts()
        self._parsed_first = False
        self._joined = False  # the event being classified had its data lines joined already
        self._completed = False  # [DONE], a finish_reason, or response.completed seen
        self._events = 0
        self._chunks = 0
        self._pending = 0  # output events in bytes returned by feed() but not yet mark_sent()
        self._recv_at = 0.0
        self._upstream_first: float | None = None
        self._first_sent: float | None = None
        self._last_sent: float | None = None
        self._itl: list[float] = []
        self._forward: list[float] = []

    def output_events(self) -> int:
        """Output-bearing events read so far (a token each, for the engines in front of which
        this runs: what a tenant's output budget is charged while the stream runs)."""
        return self._chunks

    @property
    def separator(self) -> bytes:
        """The stream's event separator, b"\n\n" or b"\r\n\r\n" (b"": no line seen yet)."""
        return self._sep

    @property
    def completed(self) -> bool:
        """The stream's end was seen: [DONE], a finish reason, or response.completed."""
        return self._completed

    # -- inputs ---------------------------------------------------------------------------------
    def upstream_sent(self, now: float) -> None:
        """The request was written to the upstream (called again for each retry attempt)."""
        self._t_up = now

    def passes_through(self, data: bytes) -> bool:
        """True if feed(data) would return `data` unchanged.

        Then the client's bytes do not depend on metering them, and the forwarder may write
        them first and meter them after (with the receive time it took before writing), as it
        does with a stream's first read: the meter's first parse stays off the client's TTFT.
        Only usage stripping changes bytes, and it only cuts a complete event with a "usage"
        key.
        """
        if not self.strip_usage:
            return True
        if self._tail or data.find(b'"usage"') >= 0:
            return False
        sep = self._sep
        if not sep:
            k = data.find(b"\n")
            if k < 0:
                return False
            sep = b"\r\n\r\n" if k > 0 and data[k - 1] == 0x0D else b"\n\n"
        return data.endswith(sep)

    def feed(self, data: bytes, now: float) -> bytes:
        """Meter one upstream read; return the bytes to write to the client now.

        Raises EventTooLarge when an event has grown past MAX_EVENT_BYTES without its end.
        """
        if not data:
            return data
        self._pending = 0
        self._recv_at = now
        if not self._sep and not self._learn_separator(data):
            return data if not self.strip_usage else b""
        sep = self._sep
        seplen = len(sep)
        if self._tail:
            # Resume the separator search where the last read left off (an event can span
            # many reads: no quadratic rescan). Only here, with an event pending, is its size
            # checked: reads that end on an event boundary pay nothing for the bound.
            if len(self._tail) > MAX_EVENT_BYTES:
                raise EventTooLarge(len(self._tail))
            buf = self._tail + data
            search = max(0, len(self._tail) - seplen + 1)
        else:
            buf = data
            search = 0
        start = 0
        cut: list[tuple[int, int]] | None = None
        # The common event (chat, compact JSON, one data line, non-empty content, no finish
        # reason) is counted by the scan that skips a whole run of them in one call
        # (proxy/eventscan.py: C where the hot path is compiled); _event() decides the rest.
        fast = self.api == "chat" and self._parsed_first
        n = len(buf)
        events = chunks = 0
        strip = self.strip_usage
        while search < n:  # a read that ends on an event's end takes no search past it
            if fast:
                k, start, end = chat_events(buf, start, search, sep)
                events += k
                chunks += k
            else:
                end = buf.find(sep, search)
            if end < 0:
                break
            if self._event(buf, start, end, now) == USAGE_ONLY and strip:
                cut = [*(cut or ()), (start, end + seplen)]
            fast = self.api == "chat" and self._parsed_first
            start = search = end + seplen
        if chunks:
            self._events += events
            self._chunks += chunks
            self._pending += chunks
            if self._upstream_first is None:
                self._upstream_first = now
        self._tail = buf[start:] if start < n else b""
        if not self.strip_usage:
            return data
        # Strip mode holds back the incomplete trailing event: it may be the usage chunk.
        if cut is None:
            return buf if start == n else buf[:start]
        return _without(buf[:start], cut)

    def _learn_separator(self, data: bytes) -> bool:
        """Until the stream's first line ends: whether it uses CRLF or LF, hence its event
        separator (False: not known yet, `data` is held as the start of the first event)."""
        k = data.find(b"\n")
        if k < 0:
            self._tail += data
            if len(self._tail) > MAX_EVENT_BYTES:
                raise EventTooLarge(len(self._tail))
            return False
        crlf = data[k - 1] == 0x0D if k > 0 else self._tail.endswith(b"\r")
        self._sep = b"\r\n\r\n" if crlf else b"\n\n"
        self._nl = b"\r\n" if crlf else b"\n"
        return True

    def mark_sent(self, now: float) -> None:
        """The bytes returned by the last feed() were written to the client at `now`."""
        k = self._pending
        if not k:
            return
        self._pending = 0
        self._forward.append(now - self._recv_at)
        if self._first_sent is None:
            self._first_sent = now
            k -= 1
        else:
            self._itl.append(now - (self._last_sent or now))
            k -= 1
        if k:
            self._itl.extend([0.0] * k)
        self._last_sent = now

    def finish(
        self, now: float, *, error: str | None = None, cancelled: bool = False
    ) -> tuple[bytes, StreamFacts]:
        """End of stream: the held-back bytes to flush to the client and the final facts.

        Output events fed but never mark_sent() count as sent at `now`, unless cancelled (then
        the client never got them). An unterminated last event is flushed but not metered: an
        SSE client discards it too.
        """
        if self._pending and not cancelled:
            self.mark_sent(now)
        self._pending = 0
        rest = self._tail if self.strip_usage else b""
        self._tail = b""
        f = self._f
        err = error or f.error
        if err is None and not cancelled and not self._completed:
            err = "incomplete_stream"
        reasons = list(f.finish_reasons)
        if err is not None and "error" not in reasons:
            reasons.append("error")
        if cancelled and "cancelled" not in reasons:
            reasons.append("cancelled")
        first, last = self._first_sent, self._last_sent
        tpot = None
        if first is not None and last is not None and f.output_tokens and f.output_tokens > 1:
            tpot = (last - first) / (f.output_tokens - 1)
        facts = StreamFacts(
            ttft_s=None if first is None else first - self.t0,
            upstream_ttft_s=(
                None
                if self._upstream_first is None or self._t_up is None
                else self._upstream_first - self._t_up
            ),
            itl_s=self._itl,
            tpot_s=tpot,
            e2e_s=None if last is None else last - self.t0,
            chunks=self._chunks,
            events=self._events,
            output_tokens=f.output_tokens,
            input_tokens=f.input_tokens,
            cached_tokens=f.cached_tokens,
            finish_reasons=reasons,
            response_id=f.response_id,
            response_model=f.response_model,
            error=err,
            cancelled=cancelled,
            first_output_at=first,
            last_output_at=last,
            forward_s=self._forward,
            engine_prefill_s=f.prefill_s,
        )
        return rest, facts

    # -- one event ------------------------------------------------------------------------------
    def _event(self, buf: bytes, start: int, end: int, now: float) -> int:
        """Classify the event buf[start:end] (without its separator) and update the facts."""
        # Byte searches run on the raw payload; a multi-line data field is only joined when
        # the event has to be parsed (see _load).
        if buf.startswith(b"data: ", start, end):
            p = buf[start + 6 : end]
            self._joined = False
        elif buf.startswith(b"data:", start, end):
            p = buf[start + 5 : end]
            self._joined = False
        else:
            data = data_of(buf[start:end], self._nl)  # event:/id:/comments: rare, slow path
            if data is None:
                return OTHER  # comment / keep-alive only
            p = data
            self._joined = True  # (_load must not split it again: its lines have no data:)
        self._events += 1
        if self.api == "chat":
            if p != DONE and chat_output(p):  # [DONE] has no keys: no searches for it
                kind = self._output_event(p)
            else:
                kind = self._other_event(p)
        elif self.api == "completions":
            if nonempty_at(p, b'"text":'):
                kind = self._output_event(p)
            else:
                kind = self._other_event(p)
        else:
            kind = self._responses(p)
        if kind == OUTPUT:
            self._chunks += 1
            self._pending += 1
            if self._upstream_first is None:
                self._upstream_first = now
        return kind

    def _load(self, p: bytes) -> Any:
        # A multi-line data field: join its lines first. (A byte string's `in` with a bytes
        # needle formats and drops a TypeError first, ~2,000 instructions in CPython 3.11;
        # `find` and an int needle do not.)
        if not self._joined and p.find(self._nl) >= 0:
            p = data_of(b"data:" + p, self._nl) or b""
        try:
            return orjson.loads(p)
        except orjson.JSONDecodeError:
            return None

    def _output_event(self, p: bytes) -> int:
        """A chat/completions event that carries output (the common event on the hot path).

        An output delta is never an error or a usage-only chunk, so only a finish reason (or
        the first event's id/model) makes it worth parsing. Per-chunk usage (vLLM's
        continuous_usage_stats) is superseded by the final usage-only chunk, so it is skipped.
        """
        if not self._parsed_first or value_starts(p, FINISH, QUOTE):
            self._parse_choices_event(p)
        return OUTPUT

    def _other_event(self, p: bytes) -> int:
        """Role-only, finish, usage, error, [DONE] and unknown events: rare, checked fully."""
        if p == DONE:
            self._completed = True
            return END
        if (
            not self._parsed_first
            or value_starts(p, b'"usage":', 0x7B)  # a usage object, not null
            or value_starts(p, FINISH, QUOTE)
            or p.find(b'"error"') >= 0  # an "error" key, or {"object": "error"}
        ):
            return self._parse_choices_event(p)
        return OTHER

    def _parse_choices_event(self, p: bytes) -> int:
        """Record the facts of an event that carries them; USAGE_ONLY or OTHER."""
        obj = self._load(p)
        if not isinstance(obj, dict):
            return OTHER
        f = self._f
        self._parsed_first = True
        if "error" in obj or obj.get("object") == "error":
            f.error = _error_type(obj.get("error", obj))
            return OTHER
        f.ident(obj)
        before = len(f.finish_reasons)
        f.choices(obj)
        if len(f.finish_reasons) > before:
            self._completed = True
        usage = obj.get("usage")
        if isinstance(usage, dict):
            f.usage(usage)
        # llama.cpp puts its timings on the usage-only chunk when the client asked for usage:
        # read them there too, or the doctor loses the engine's prefill time (prompt_ms).
        if "timings" in obj:
            f.timings(obj["timings"])
        if isinstance(usage, dict) and obj.get("choices") == []:
            return USAGE_ONLY
        return OTHER

    def _responses(self, p: bytes) -> int:
        """Responses API events: output deltas counted by byte search, lifecycle events parsed."""
        if p == DONE:
            self._completed = True
            return END
        typ = response_type(p)
        if typ is not None and typ.endswith(b".delta"):
            return OUTPUT if nonempty_at(p, b'"delta":') else OTHER
        if typ in _RESPONSES_PARSED or (typ is None and p.find(b'"error"') >= 0):
            obj = self._load(p)
            if isinstance(obj, dict):
                self._f.responses_event(obj)
                if obj.get("type") in _RESPONSES_FINAL:
                    self._completed = True
        return OTHER


_RESPONSES_FINAL = ("response.completed", "response.incomplete", "response.failed")
_RESPONSES_PARSED = (b"response.created", *(t.encode() for t in _RESPONSES_FINAL), b"error")


def _without(data: bytes, cuts: list[tuple[int, int]]) -> bytes:
    parts = []
    prev = 0
    for s, e in cuts:
        parts.append(data[prev:s])
        prev = e
    parts.append(data[prev:])
    return b"".join(parts)


def meter_json(api: str, body: bytes, *, t0: float, now: float) -> StreamFacts:
    """Facts of a non-streamed response: duration, usage, finish reasons, id/model, error."""
    f = _Facts()
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        f.error = "invalid_response"
    elif "error" in obj or obj.get("object") == "error":
        f.error = _error_type(obj.get("error", obj))
    elif api == "responses":
        f.responses_event({"type": f"response.{obj.get('status')}", "response": obj})
        if obj.get("status") == "failed":
            f.error = _error_type(obj.get("error"))
    else:
        f.ident(obj)
        f.choices(obj)
        f.usage(obj.get("usage"))
        f.timings(obj.get("timings"))
    reasons = f.finish_reasons
    if f.error is not None and "error" not in reasons:
        reasons.append("error")
    return StreamFacts(
        ttft_s=None,
        upstream_ttft_s=None,
        itl_s=[],
        tpot_s=None,
        e2e_s=now - t0,
        chunks=0,
        events=0,
        output_tokens=f.output_tokens,
        input_tokens=f.input_tokens,
        cached_tokens=f.cached_tokens,
        finish_reasons=reasons,
        response_id=f.response_id,
        response_model=f.response_model,
        error=f.error,
        cancelled=False,
        first_output_at=None,
        last_output_at=None,
        engine_prefill_s=f.prefill_s,
    )
