"""Response relay: one backend's response to the client, metered, as it arrives.

A streamed response is forwarded in whole reads (not one send per SSE event) and only up to
the last complete event: an event cut by the backend, mid-line or mid HTTP chunk, is held back
until its end arrives. So when a stream breaks, the error event that ends it always starts on
an event boundary and the `openai` client raises APIError instead of a JSON error or a silent
truncation.

The relay also judges the backend (passive health, proxy/upstream/outlier.py): an attempt succeeds
when its first body byte arrives, not at its response head (vLLM sends a streaming head before the
first token, so a wedged engine answers heads all day), and a stream that breaks after that
(idle timeout, cut, closed before its end) counts as a failure.

What a backend answers is checked where the client would otherwise get something its SDK
cannot read: a whole answer is read up to upstream.max_response_bytes (past it: 502
upstream_response_too_large), and while the answers read at once hold less than
upstream.max_buffered_bytes (past it: 503 upstream_responses_over_budget, Retry-After 1); a
200 to a JSON API must be a JSON object that is not an error object (else 502
upstream_invalid_response), and is sent as application/json whatever the backend labelled it;
a 200 to a streamed request must be an event stream (else the same 502, before any byte), and
an event that is not valid UTF-8 ends the stream with an error event (the openai client would
raise UnicodeDecodeError on it). None of these is retried: see `_refuse`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson

from proxy import asgi
from proxy.asgi import Message, Send, body_part, stream_head
from proxy.errors import error_body, sse_error_event
from proxy.forwarding.answer_shape import (
    SSE_TYPES,
    content_type,
    error_instead,
    is_event_stream,
    is_json,
    not_an_object,
    utf8_events,
)
from proxy.forwarding.exchange import Exchange
from proxy.forwarding.meter import MAX_EVENT_BYTES, EventTooLarge, StreamMeter, meter_json
from proxy.forwarding.push import direct
from proxy.forwarding.retry import Retry, describe
from proxy.sse import event_boundary
from proxy.types import FailureKind, StreamFacts
from proxy.upstream.pool import (
    NOT_FORWARDED_DOWNSTREAM_B,
    READ_ERRORS,
    UpstreamOverBudget,
    UpstreamResponseTooLarge,
    UpstreamTimeout,
)

if TYPE_CHECKING:
    from proxy.forwarding.ports import UpstreamResponseLike
    from proxy.forwarding.state import Fleet, RequestRouting
    from proxy.telemetry import RequestRecord
    from proxy.upstream.backends import Backend

__all__ = ["Relay", "event_boundary", "internal_error", "respond"]

log = logging.getLogger("warmroute.forward")

# How a stream can break after its first byte (the error.code of the event that ends it).
IDLE_TIMEOUT, STREAM_CUT, INCOMPLETE = "idle_timeout", "upstream_stream_error", "incomplete_stream"
TOO_LARGE = "event_too_large"
# What a client gets for an answer the proxy will not pass on (502, or the event ending a stream)
RESPONSE_TOO_LARGE, INVALID_RESPONSE = "upstream_response_too_large", "upstream_invalid_response"
# ... and a 503 for an answer the proxy has no memory for now (upstream.max_buffered_bytes)
OVER_BUDGET = "upstream_responses_over_budget"
OVER_BUDGET_RETRY_AFTER_S = b"1"
JSON_HEADER = (b"content-type", b"application/json")


def response_headers(
    ex: Exchange, backend: Backend, upstream: UpstreamResponseLike, debug: bool
) -> list[tuple[bytes, bytes]]:
    drop = NOT_FORWARDED_DOWNSTREAM_B
    for k, v in upstream.headers:
        if k == b"connection":  # names it lists are hop-by-hop too
            drop = drop | {n.strip().lower() for n in v.split(b",")}
    out = [(k, v) for k, v in upstream.headers if k not in drop and k != b"x-request-id"]
    out.append((b"x-request-id", ex.request_id.encode("latin-1")))
    out.append((b"x-warmroute-backend", backend.name.encode("latin-1")))
    if debug and ex.decision is not None:
        out.append((b"x-warmroute-route", orjson.dumps(ex.decision.as_dict())))
    if ex.response_headers:  # the tenant's budgets (proxy/tenants/) replace the backend's
        out = [h for h in out if not h[0].startswith(b"x-ratelimit-")]
        out += ex.response_headers
    return out


class Relay:
    """Relays one attempt's response; its collaborators are passed in, nothing global.

    The ASGI messages are written out here rather than sent through proxy.asgi's stream
    helpers: one coroutine frame fewer per write, on the path every chunk takes.
    """

    __slots__ = ("api", "debug_headers", "fleet", "idle_s", "steering")

    def __init__(
        self,
        api: str,
        steering: RequestRouting,
        idle_s: float,
        debug_headers: bool,
        fleet: Fleet,
    ) -> None:
        self.api = api
        self.steering = steering
        self.idle_s = idle_s
        self.debug_headers = debug_headers
        self.fleet = fleet

    async def whole(
        self,
        ex: Exchange,
        backend: Backend,
        upstream: UpstreamResponseLike,
        record: RequestRecord,
        send: Send,
    ) -> StreamFacts | None:
        try:
            payload = await upstream.read()  # at most upstream.max_response_bytes
        except UpstreamOverBudget as e:
            # The proxy's own want of memory, not the answer's size as such: a 503 the client
            # may retry in a moment, no verdict on the backend (a kind the breaker ignores).
            reason = f"The answer from {backend.name} was refused: {describe(e)}."
            await self._refuse(ex, backend, upstream, record, send, OVER_BUDGET, reason)
            return None
        except UpstreamResponseTooLarge as e:
            # The read stopped at the limit (or at a Content-Length over it) and closed the
            # connection; not retried, no verdict on the backend (`_refuse` says why).
            reason = f"The answer from {backend.name} was refused: {describe(e)}."
            await self._refuse(ex, backend, upstream, record, send, RESPONSE_TOO_LARGE, reason)
            return None
        except READ_ERRORS as e:
            if ex.client_gone:  # its watcher closed the upstream: nothing to judge it by
                raise Retry(
                    "the client left before the answer", "cancelled", FailureKind.CANCELLED
                ) from None
            raise Retry(
                f"response body broke off: {describe(e)}", "body_error", FailureKind.PROTOCOL
            ) from None
        status = upstream.status
        headers = response_headers(ex, backend, upstream, self.debug_headers)
        facts = None
        if status == 200:
            if self.api != "embeddings":
                facts = meter_json(self.api, payload, t0=ex.t0, now=time.perf_counter())
            if not_an_object(payload, facts):
                ct = content_type(upstream)[:64].decode("latin-1")
                reason = (
                    f"{backend.name} answered 200 with a body that is not a JSON object "
                    f"(content-type {ct!r}, {len(payload)} bytes)."
                )
                await self._refuse(ex, backend, upstream, record, send, INVALID_RESPONSE, reason)
                return None
            if facts is not None and facts.error is not None and self.api != "responses":
                said = error_instead(payload)
                if said is not None:
                    reason = (
                        f"{backend.name} answered 200 with an error instead of an answer ({said})."
                    )
                    await self._refuse(
                        ex, backend, upstream, record, send, INVALID_RESPONSE, reason
                    )
                    return None
            if not is_json(content_type(upstream)):  # a JSON answer, whatever its label
                headers = [h for h in headers if h[0] != b"content-type"]
                headers.append(JSON_HEADER)
        self.fleet.mark_success(backend)  # a whole answer, whatever its status
        headers.append((b"content-length", str(len(payload)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        ex.started_response = True
        await send({"type": "http.response.body", "body": payload})
        if facts is not None:
            facts.e2e_s = time.perf_counter() - ex.t0  # written, as for a stream's last event
            self.steering.observe_response(backend.name, facts, ex.decision)
        ex.facts = facts
        record.finish(
            facts,
            status=status,
            error_type=None if status < 400 else f"http_{status}",
            backend=backend.name,
        )
        return facts

    async def _refuse(
        self,
        ex: Exchange,
        backend: Backend,
        upstream: UpstreamResponseLike,
        record: RequestRecord,
        send: Send,
        code: str,
        reason: str,
    ) -> None:
        """A 502 of the proxy's own instead of an answer it will not pass on: nothing has
        reached the client yet, and the upstream connection is closed, not pooled (its body is
        unread, or read past its limit).

        Not retried elsewhere: the backend took the request and answered it (a 200, or a
        whole body), so another attempt would repeat the engine's work for an answer that
        (too large) most likely comes out the same. A backend that answers what is not an
        answer fails a "protocol" attempt, which its breaker counts (consecutive ones eject
        it: traffic moves off it). Too large is no verdict (a kind the breaker does not count,
        which still releases a half-open probe): an answer's size follows from its request
        (many inputs to embed, n, logprobs) as much as from the backend, and a client must not
        be able to eject healthy backends by asking for big answers.
        """
        over = code == OVER_BUDGET
        status = 503 if over else 502
        log.warning("request %s: %s Answered %d (%s).", ex.request_id, reason, status, code)
        upstream.close()
        kind = FailureKind.TOO_LARGE if over or code == RESPONSE_TOO_LARGE else FailureKind.PROTOCOL
        self.fleet.mark_failure(backend, reason, kind=kind)
        body = error_body(reason, "server_error", None, code)
        extra = ((b"retry-after", OVER_BUDGET_RETRY_AFTER_S),) if over else ()
        await respond(send, status, body, ex.request_id, (*extra, *ex.response_headers))
        ex.started_response = True
        record.finish(None, status=status, error_type=code, backend=backend.name)

    async def stream(
        self,
        ex: Exchange,
        backend: Backend,
        upstream: UpstreamResponseLike,
        t_sent: float,
        record: RequestRecord,
        send: Send,
        strip: bool,
    ) -> StreamFacts | None:
        """A streamed answer: checked, committed to at its first byte (a failure before it
        raises Retry: nothing reached the client), forwarded event-aligned, then finished."""
        h = upstream.headers
        if SSE_TYPES[0] not in h and SSE_TYPES[1] not in h and not is_event_stream(h):
            ct = content_type(upstream)[:64].decode("latin-1")
            reason = (
                f"{backend.name} answered a streamed request with content-type {ct!r}, "
                "not an event stream."
            )
            await self._refuse(ex, backend, upstream, record, send, INVALID_RESPONSE, reason)
            return None
        meter = StreamMeter(self.api, t0=ex.t0, strip_usage=strip)  # type: ignore[arg-type]
        meter.upstream_sent(t_sent)
        ex.output_events = meter.output_events
        # The first read decides between "retry elsewhere" and "committed to this backend".
        try:
            data = await upstream.readany()
        except READ_ERRORS as e:
            raise first_read_failure(e, ex.client_gone) from None
        if not data:
            raise first_read_failure(None, ex.client_gone)
        # The first byte, not the head, says the engine works: _forward notes it (_first_byte).
        upstream.idle_budget(self.idle_s)
        status, headers = (
            upstream.status,
            response_headers(ex, backend, upstream, self.debug_headers),
        )
        if not stream_head(send, status, headers):  # (the head at once, where the server allows)
            await send({"type": "http.response.start", "status": status, "headers": headers})
        ex.started_response = True
        try:
            error, reason, carry = await self._forward(ex, backend, upstream, meter, send, data)
        except asyncio.CancelledError:
            if not ex.client_gone:
                await self._cut(ex, backend, upstream, meter, record, send)
            raise
        return await self._finish(ex, backend, upstream, meter, record, send, error, reason, carry)

    def _first_byte(self, ex: Exchange, backend: Backend) -> None:
        """A stream's first byte came: the engine works, its prompt's prefill is over. Noted
        once that byte is written where the first read goes out unmetered (off the TTFT)."""
        self.fleet.mark_success(backend)
        self.steering.prefilled(ex.decision)

    async def _first_out(
        self,
        ex: Exchange,
        backend: Backend,
        upstream: UpstreamResponseLike,
        meter: StreamMeter,
        send: Send,
        data: bytes,
        received: float,
    ) -> tuple[Callable[[bytes], bool], Callable[[bytes], bool] | None]:
        """The first read `data` (read at `received`), sent before it is metered where metering
        cannot change it (the usual case: the meter's parse of the first event stays off the
        client's TTFT; later reads are metered first, the check costs more); returns
        _forward's writer and push."""
        try:
            if not body_part(send, data, True):
                await send({"type": "http.response.body", "body": data, "more_body": True})
            sent = time.perf_counter()
        finally:  # (a half-open breaker must hear of its probe whatever the send did)
            self._first_byte(ex, backend)
        meter.feed(data, received)
        meter.mark_sent(sent)
        return direct(send, meter, upstream, self.idle_s)

    async def _forward(
        self,
        ex: Exchange,
        backend: Backend,
        upstream: UpstreamResponseLike,
        meter: StreamMeter,
        send: Send,
        data: bytes,
    ) -> tuple[str | None, str, bytes]:
        """Forward the stream from its first read `data` on, in whole reads cut at the last
        complete event, until it ends or breaks: (error code or None, reason, what _finish writes
        with the end: the last read's events if the end came with them, then the start of an
        event whose end never came). The per-read loop: one function, no call per read."""
        perf = time.perf_counter
        # Progress (the idle clock starts over) is a read that completes an event, not a byte
        # (proxy/upstream/conn.py's docstring): the first read started the clock.
        progress, idle_s = upstream.set_read_timeout, self.idle_s
        first = True
        # Later parts' writer, and the step relaying reads without the task (push.py)
        write: Callable[[bytes], bool] | None = None
        push: Callable[[bytes], bool] | None = None
        # The start of an event whose end has not arrived (the meter bounds it).
        carry = b""
        try:
            while data:
                received = perf()
                if (
                    first
                    and not upstream.at_end()  # else it goes out with the end (_finish)
                    and data[-2:] == b"\n\n"
                    and meter.passes_through(data)
                    and (data.isascii() or utf8_events(data) == len(data))
                ):
                    first = False
                    write, push = await self._first_out(
                        ex, backend, upstream, meter, send, data, received
                    )
                else:
                    if first:
                        first = False
                        self._first_byte(ex, backend)
                    out = meter.feed(data, received)
                    out, carry = carry + out, b""
                    if out and out[-2:] != b"\n\n":
                        cut = event_boundary(out)
                        out, carry = out[:cut], out[cut:]
                    # Whole events: no character is cut; a decode only for non-ASCII bytes.
                    if out and not out.isascii() and (cut := utf8_events(out)) < len(out):
                        reason = _not_utf8(backend, ex, out, cut)
                        if cut:
                            await send(_more(out[:cut]))
                            meter.mark_sent(perf())
                        return INVALID_RESPONSE, reason, b""
                    if out and upstream.at_end():  # with the end, in one write (_finish)
                        return None, "", out + carry
                    if out:  # ends on an event's end: whole events, at least one
                        progress(idle_s)
                        if write is None or not write(out):
                            await send(_more(out))
                        meter.mark_sent(perf())
                        if write is None:
                            write, push = direct(send, meter, upstream, idle_s)
                if push is not None:  # reads go to it while the task waits (push.py)
                    upstream.push_to(None if carry else push)
                try:
                    data = await upstream.readany()
                except READ_ERRORS as e:
                    if ex.client_gone:
                        return None, "", carry
                    error, reason = stream_break(e, backend.name, idle_s)
                    return _broken(ex, error, reason, carry, " after the first byte")
        except EventTooLarge as e:
            return _broken(ex, TOO_LARGE, _too_large(backend, e), b"")
        finally:
            if push is not None:
                upstream.push_to(None)
        return None, "", carry

    async def _cut(
        self,
        ex: Exchange,
        backend: Backend,
        upstream: UpstreamResponseLike,
        meter: StreamMeter,
        record: RequestRecord,
        send: Send,
    ) -> None:
        """The proxy is shutting down past its grace period, or the backend left the fleet
        past its drain grace (Exchange.cut): end the stream cleanly, with an error event."""
        error, reason = ex.cut_reason or (
            "shutdown",
            "the proxy is shutting down; the stream was cut",
        )
        tail, facts = meter.finish(time.perf_counter(), error=error, cancelled=False)
        ex.facts = facts
        record.finish(facts, status=upstream.status, error_type=error, backend=backend.name)
        log.warning(
            "request %s: stream cut %s on %s",
            ex.request_id,
            "at shutdown" if ex.cut_reason is None else f"({error})",
            backend.name,
        )
        with contextlib.suppress(Exception):  # the connection may be gone as well
            await send(
                {
                    "type": "http.response.body",
                    "body": tail[: event_boundary(tail)]
                    + sse_error_event(reason, "server_error", error),
                    "more_body": False,
                }
            )

    async def _finish(
        self,
        ex: Exchange,
        backend: Backend,
        upstream: UpstreamResponseLike,
        meter: StreamMeter,
        record: RequestRecord,
        send: Send,
        error: str | None,
        reason: str,
        carry: bytes,
    ) -> StreamFacts:
        """The stream's end: the meter's last bytes and facts, a stream that ended before its
        own end or broke turned into an error event (and a failure of its backend), routing
        taught (once the last bytes are out: not the client's wait), the record finished."""
        # A client that hangs up right after the last event got everything: not a cancel.
        cancelled = ex.client_gone and not meter.completed
        tail, facts = meter.finish(time.perf_counter(), error=error, cancelled=cancelled)
        if not ex.client_gone:
            if carry:  # the last read's events (they came with the end), or the backend
                tail = carry + tail  # ended cleanly without a final blank line
            if tail and not tail.isascii() and (cut := utf8_events(tail)) < len(tail):
                why = _not_utf8(backend, ex, tail, cut)
                error, reason = error or INVALID_RESPONSE, reason or why
                tail = tail[:cut]
            if error is None and facts.error == INCOMPLETE:
                # A clean end of the body before the stream's own end ([DONE], a finish
                # reason, response.completed: the meter's judgement per API): a truncation
                # the client could not tell from a whole answer.
                error = INCOMPLETE
                reason = f"{backend.name} ended the stream before it was complete"
                cut = len(tail) - event_boundary(tail)
                log.warning(
                    "request %s: %s; ending it with an error event%s",
                    ex.request_id,
                    reason,
                    f" (dropped {cut} bytes of an incomplete event)" if cut else "",
                )
            if error is not None:
                # Broken after the first byte: the backend's failure, and an error event on
                # an event boundary (what the meter still held back may end mid-event too).
                kind = FailureKind.TIMEOUT if error == IDLE_TIMEOUT else FailureKind.PROTOCOL
                self.fleet.mark_failure(backend, reason, kind=kind)
                tail = tail[: event_boundary(tail)] + sse_error_event(reason, "server_error", error)
            if not body_part(send, tail, False):
                await send({"type": "http.response.body", "body": tail, "more_body": False})
        elif cancelled:
            log.info(
                "request %s: client disconnected mid-stream; closed the upstream on %s",
                ex.request_id,
                backend.name,
            )
        self.steering.observe_stream(backend.name, facts, ex.decision)
        ex.facts = facts
        record.finish(
            facts,
            status=499 if cancelled else upstream.status,
            error_type="cancelled" if cancelled else error or facts.error,
            backend=backend.name,
        )
        return facts


def _more(body: bytes) -> Message:
    """A part of a streamed body that more parts follow."""
    return {"type": "http.response.body", "body": body, "more_body": True}


def _too_large(backend: Backend, e: EventTooLarge) -> str:
    return (
        f"{backend.name} sent {describe(e)} (the most this proxy holds of one event is "
        f"{MAX_EVENT_BYTES} bytes)"
    )


def _broken(
    ex: Exchange, error: str, reason: str, carry: bytes, where: str = ""
) -> tuple[str, str, bytes]:
    """A stream broken after its first byte, said in the log (`where`: what the log adds to
    the reason); what was held of an unfinished event (`carry`) is dropped."""
    log.warning(
        "request %s: %s%s; ending the stream with an error event%s",
        ex.request_id,
        reason,
        where,
        f" (dropped {len(carry)} bytes of an incomplete event)" if carry else "",
    )
    return error, reason, b""


def first_read_failure(e: BaseException | None, client_gone: bool) -> Retry:
    """Why a stream's first read failed (`e` its error; None: the stream ended empty), as the
    Retry that sends the request elsewhere: nothing had reached the client."""
    if client_gone:  # its watcher closed the upstream: nothing to judge the backend by
        why = "the client left before the first byte"
        return Retry(why, "cancelled", FailureKind.CANCELLED)
    if e is None:
        why = "the backend closed the stream before sending anything"
        return Retry(why, "empty_stream", FailureKind.PROTOCOL)
    if isinstance(e, UpstreamTimeout):
        return Retry(f"no first byte: {describe(e)}", "timeout", FailureKind.TIMEOUT)
    return Retry(f"no first byte: {describe(e)}", "stream_error", FailureKind.PROTOCOL)


def stream_break(e: BaseException, backend: str, idle_s: float) -> tuple[str, str]:
    """A read that failed after the first byte: (the error event's code, its reason)."""
    if isinstance(e, UpstreamTimeout):
        return IDLE_TIMEOUT, f"no complete event from {backend} for {idle_s:g}s"
    return STREAM_CUT, f"{backend} broke off the stream: {describe(e)}"


def _not_utf8(backend: Backend, ex: Exchange, data: bytes, cut: int) -> str:
    """The reason (and the log line) for an event that is not valid UTF-8."""
    reason = f"{backend.name} sent an event that is not valid UTF-8"
    log.warning(
        "request %s: %s; ending the stream with an error event (dropped %d bytes)",
        ex.request_id,
        reason,
        len(data) - cut,
    )
    return reason


async def respond(
    send: Send,
    status: int,
    body: bytes,
    request_id: str,
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """A JSON answer of the proxy's own (an error) with the request's id."""
    rid = (b"x-request-id", request_id.encode("latin-1"))
    await asgi.respond(send, status, body, asgi.JSON, (rid, *extra))


def internal_error(e: BaseException) -> bytes:
    return error_body(f"Internal proxy error ({type(e).__name__}).", "server_error")
