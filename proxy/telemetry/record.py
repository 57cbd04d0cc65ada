"""What telemetry keeps about one request: its SERVER span, a CLIENT span per upstream attempt,
and, when it finishes, its metrics. One span per request and attempt, never one per chunk."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry import trace
from opentelemetry.sdk.trace import Event
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy.admission.slots import CLASSES, TICKET
from proxy.redact import quote
from proxy.routing.types import Decision
from proxy.telemetry import attributes as span_attrs
from proxy.telemetry.attributes import CLIENT as CLIENT_ATTR
from proxy.telemetry.attributes import ERROR_TYPE, STATUS_CODE, epoch_ns
from proxy.telemetry.attributes import PRIORITY as PRIORITY_ATTR
from proxy.telemetry.attributes import QUEUE_WAIT as QUEUE_WAIT_ATTR
from proxy.telemetry.render import DictWriter
from proxy.telemetry.spans import SpanData
from proxy.telemetry.wire import ATTR, attributes
from proxy.types import CLIENT, StreamFacts

if TYPE_CHECKING:
    from proxy.config import TelemetryConfig
    from proxy.telemetry.metrics import RequestMetrics
    from proxy.telemetry.spans import Spans


class Telemetry(Protocol):
    """What a record uses of proxy.telemetry.providers.Telemetry (which creates records:
    naming the class here would make the two modules import each other)."""

    cfg: TelemetryConfig
    spans: Spans
    metrics: RequestMetrics
    finished: Callable[..., None] | None  # called once per finished request (the doctor)


_propagator = TraceContextTextMapPropagator()


class AttemptRecord:
    """One upstream attempt: a CLIENT span, child of the request's SERVER span."""

    __slots__ = ("backend", "ended", "span", "tel")

    def __init__(self, tel: Telemetry, span: SpanData, backend: str) -> None:
        # No reference back to the RequestRecord (which lists its attempts): a cycle there
        # left every request's telemetry, facts and decision to the cyclic GC (~14 objects a
        # request, ~20 µs of collections per request at c=64).
        self.tel = tel
        self.span = span
        self.backend = backend
        self.ended = False

    def inject_headers(self, headers: dict[str, str]) -> None:
        """Add this attempt's W3C traceparent (and tracestate) to the upstream request."""
        span = self.span
        if not span.flags & 1 and "traceparent" in headers:
            # Not recording (tracing off, or not sampled): the backend's spans should join the
            # client's trace as the client decided, not a span nobody exports.
            return
        # What TraceContextTextMapPropagator.inject writes for a valid span context.
        headers["traceparent"] = f"00-{span.trace_id:032x}-{span.span_id:016x}-{span.flags:02x}"
        if span.trace_state:
            headers["tracestate"] = span.trace_state.to_header()

    def set_attribute(self, key: str, value: str | int | float | bool) -> None:
        """One more attribute on this attempt's span (e.g. warmroute.pd.leg)."""
        _set(self.span, key, value)

    def done(self, status: int) -> None:
        """The attempt succeeded and is over before the request is (a prefill leg)."""
        if self.ended:
            return
        self.ended = True
        span = self.span
        if span.recording:
            if span.enc is not None:
                span.enc.append(STATUS_CODE.any(status))
                span.end(self.tel.spans, time.time_ns(), None, b"")
            else:
                span.attrs["http.response.status_code"] = status
                span.end(self.tel.spans, time.time_ns())

    def fail(self, error_type: str, status: int | None = None) -> None:
        """The attempt failed (connect error, 5xx before the first byte...): end it as error."""
        if self.ended:
            return
        self.ended = True
        span = self.span
        tel = self.tel
        if span.recording:
            if span.enc is not None:
                span.enc.append(ERROR_TYPE.any(error_type))
                if status is not None:
                    span.enc.append(STATUS_CODE.any(status))
                span.end(tel.spans, time.time_ns(), error_type, b"")
            else:
                span.attrs["error.type"] = error_type
                if status is not None:
                    span.attrs["http.response.status_code"] = status
                span.end(tel.spans, time.time_ns(), error_type)
        tel.metrics.failed_attempt(self.backend, error_type)


class RequestRecord:
    """Everything telemetry keeps about one request between start_request() and finish()."""

    __slots__ = (
        "anchor",
        "api",
        "attempts",
        "backend",
        "decision",
        "fleet",
        "model",
        "name",
        "op",
        "request",
        "span",
        "stream",
        "t0",
        "tel",
    )

    def __init__(
        self,
        tel: Telemetry,
        request_id: str,
        api: str,
        model: str | None,
        stream: bool,
        params: Mapping[str, Any],
        headers: Mapping[str, str],
        t0: float,
    ) -> None:
        self.tel = tel
        self.api = api
        if model is not None and len(model) > 256:  # the client's, on a span's name: bound it
            model = quote(model, 256)
        self.model = model
        self.stream = stream
        self.t0 = t0
        self.anchor = (time.time_ns(), time.perf_counter())
        self.op = op = span_attrs.OPERATION.get(api, api)
        self.attempts: list[AttemptRecord] = []
        self.backend: tuple[str, str, int] | None = None  # name, address, port
        self.decision: Decision | None = None
        self.fleet: tuple[int, bool] | None = None  # (epoch, changing) of an encoded span
        # (request id, params) of an encoded span: its request and decision attributes are
        # written when it ends, off the way to the first byte
        self.request: tuple[str, Mapping[str, Any]] | None = None
        spans = tel.spans
        lazy = spans.decide is not None  # attributes only once we know the span records
        attrs = None
        if spans.tracing and not lazy:  # a sampler plugin may read them
            attrs = self._request_attributes(request_id, params)
        parent_context = parent = None
        if "traceparent" in headers:
            parent_context = _propagator.extract(headers)
            ctx = trace.get_current_span(parent_context).get_span_context()
            parent = ctx if ctx.is_valid else None
        self.name = f"{op} {model}" if model else op
        self.span = span = SpanData(
            spans,
            self.name,
            SpanKind.SERVER,
            parent,
            parent_context,
            attrs,
            epoch_ns(t0, self.anchor),
        )
        if span.recording:
            if spans.sink is None:
                if lazy:
                    span.attrs = self._request_attributes(request_id, params)
            elif lazy:
                span.enc = []
                self.request = (request_id, params)
            else:  # a plugin sampler saw (and may have added to) the attributes
                span.enc = [attributes(ATTR, span.attrs)]

    def _request_attributes(self, request_id: str, params: Mapping[str, Any]) -> dict[str, Any]:
        attrs: dict[str, Any] = {}
        span_attrs.request(DictWriter(attrs), *self._request_args(request_id, params))
        return attrs

    def _request_args(self, request_id: str, params: Mapping[str, Any]) -> tuple[Any, ...]:
        capture = self.tel.cfg.capture_content
        return (self.op, self.model, self.stream, self.api, request_id, params, capture)

    def set_decision(self, decision: Decision) -> None:
        """Record the routing decision as warmroute.route.* attributes."""
        self.decision = decision
        span = self.span
        if not span.recording:
            return
        if span.enc is not None:
            if self.request is None:  # else encoded when the span ends
                # (a second decision replaces the first, where the dict path merges them)
                del span.enc[1:]
                span.enc.append(span_attrs.decision_fields(decision))
        else:
            span_attrs.decision(DictWriter(span.attrs), decision)

    def set_fleet(self, epoch: int, changing: bool) -> None:
        """The fleet the request is routed in, on the SERVER span: warmroute.fleet.epoch and
        warmroute.fleet.changing (a join or drain under way)."""
        span = self.span
        if not span.recording:
            return
        if span.enc is not None:
            self.fleet = (epoch, changing)  # encoded when the span ends, as the decision is
        else:
            span_attrs.fleet(DictWriter(span.attrs), epoch, changing)

    def set_attribute(self, key: str, value: str | int | float | bool) -> None:
        """One more attribute on the request's SERVER span."""
        _set(self.span, key, value)

    def interval(self, name: str, start_ns: int, end_ns: int, attrs: dict[str, Any]) -> None:
        """An INTERNAL child span of the request for a wait the proxy observed between its
        own spans (e.g. the KV transfer between a prefill leg and the decode leg)."""
        spans = self.tel.spans
        server = self.span
        if not spans.tracing or not server.recording:
            return
        span = SpanData(
            spans,
            name,
            SpanKind.INTERNAL,
            server if spans.decide is not None else server.ctx,
            server.context() if spans.decide is None else None,
            dict(attrs),
            start_ns,
        )
        if span.recording:
            if spans.sink is not None:
                span.enc = [attributes(ATTR, span.attrs)]
                span.end(spans, end_ns, None, b"")
            else:
                span.end(spans, end_ns)

    def attempt(self, *, backend: str, address: str, port: int, attempt: int) -> AttemptRecord:
        """Open the CLIENT span of one upstream attempt (attempt numbers start at 1)."""
        tel = self.tel
        spans = tel.spans
        for prev in self.attempts:
            if not prev.ended:  # the caller moved on without fail(): it did fail
                prev.fail("_OTHER")
        server = self.span
        if not spans.tracing:
            span = SpanData.untraced_child(spans, server, SpanKind.CLIENT)
        else:
            # Encoded spans take their start attributes from a per-series cache; only a
            # sampler plugin (spans.decide is None) may read them as a dict.
            direct = spans.sink is not None and spans.decide is not None
            args = (self.op, self.model, address, port, backend, attempt)
            attrs: dict[str, Any] | None = None
            if server.recording and not direct:
                attrs = {}
                span_attrs.attempt(DictWriter(attrs), *args)
            # The SDK's samplers (compiled) read only the parent's flags, state and
            # remoteness, which the server span answers itself: no SpanContext to build.
            span = SpanData(
                spans,
                self.name,
                SpanKind.CLIENT,
                server if spans.decide is not None else server.ctx,
                server.context() if spans.decide is None else None,
                attrs,
                time.time_ns(),
            )
            if span.recording and spans.sink is not None:
                if direct:
                    span.enc = [span_attrs.attempt_fields(*args)]
                else:  # as the sampler plugin left them
                    span.enc = [attributes(ATTR, span.attrs)]
        rec = AttemptRecord(tel, span, backend)
        self.attempts.append(rec)
        self.backend = (backend, address, port)
        if attempt > 1:
            tel.metrics.retried(backend)
        return rec

    def finish(
        self,
        facts: StreamFacts | None,
        *,
        status: int,
        error_type: str | None = None,
        backend: str | None = None,
    ) -> None:
        """End the spans and record every metric of this request, once."""
        now = time.perf_counter()
        end_ns = epoch_ns(now, self.anchor)
        span = self.span
        err = error_type or (facts.error if facts else None)
        if err is None and facts is not None and facts.cancelled:
            err = "cancelled"
        if err is None and status >= 400:
            err = str(status)
        elif err is not None and len(err) > 128:  # a backend's own error type: any length
            err = quote(err)  # spans carry it so; metrics fold it (RequestMetrics.error_label)
        name, address, port = self.backend or (backend or "", "", 0)
        if backend:
            name = backend
        tel = self.tel
        spans = tel.spans
        itl = sorted(facts.itl_s) if facts is not None and facts.itl_s else None
        for a in self.attempts:
            if not a.ended:  # the attempt that carried the response ends with it
                a.ended = True
                s = a.span
                if err is not None and s.recording:
                    if s.enc is not None:
                        s.enc.append(ERROR_TYPE.any(err))
                    else:
                        s.attrs["error.type"] = err
                s.end(spans, end_ns, err, b"" if s.enc is not None else ())
        if span.recording:
            retries = len(self.attempts) - 1 if self.attempts else 0
            finished = (facts, self.stream, status, err, name, address, port, retries, itl)
            self._end_span(facts, finished, end_ns, err)
        exemplar = (span.trace_id, span.span_id, time.time_ns()) if span.flags & 1 else None
        duration = facts.e2e_s if facts is not None and facts.e2e_s is not None else now - self.t0
        tel.metrics.record(
            self.op,
            self.model or "",
            facts,
            err,
            name,
            address,
            port,
            duration,
            itl,
            self.decision,
            exemplar,
        )
        if tel.finished is not None:  # the doctor's windows (proxy/doctor/collector.py)
            tel.finished(self.model or "", name, facts, err, self.decision, self.t0)

    def _end_span(
        self, facts: StreamFacts | None, finished: tuple[Any, ...], end_ns: int, err: str | None
    ) -> None:
        """The SERVER span's last attributes (who called, its class and wait, the request,
        the decision, the fleet, the outcome) and its chunk events; then it ends."""
        span, cfg = self.span, self.tel.cfg
        events: bytes | list[Event] = b""
        client = CLIENT.get()  # set by the edge when API keys are configured
        ticket = TICKET.get()  # likewise: the request's class and its wait for a slot
        if span.enc is not None:
            if client is not None:
                span.enc.append(CLIENT_ATTR.s(client))
            if ticket is not None:
                span.enc.append(PRIORITY_ATTR.s(CLASSES[ticket.rank]))
                span.enc.append(QUEUE_WAIT_ATTR.f(ticket.waited_s))
            if self.request is not None:
                span.enc.append(span_attrs.request_fields(*self._request_args(*self.request)))
                if self.decision is not None:
                    span.enc.append(span_attrs.decision_fields(self.decision))
            if self.fleet is not None:
                span.enc.append(span_attrs.fleet_fields(*self.fleet))
            span.enc.append(span_attrs.finish_fields(*finished))
            if facts is not None:
                mode, cap = cfg.chunk_events, cfg.chunk_events_cap
                events = span_attrs.event_fields(mode, cap, facts, self.anchor)
        else:
            if client is not None:
                span.attrs["warmroute.client"] = client
            if ticket is not None:
                span.attrs["warmroute.priority"] = CLASSES[ticket.rank]
                span.attrs["warmroute.queue_wait_s"] = ticket.waited_s
            span_attrs.finish(DictWriter(span.attrs), *finished)
            events = []
            if facts is not None:
                mode, cap = cfg.chunk_events, cfg.chunk_events_cap
                events = span_attrs.event_objects(mode, cap, facts, self.anchor)
        span.end(self.tel.spans, end_ns, err, events)


def _set(span: SpanData, key: str, value: str | int | float | bool) -> None:
    if not span.recording:
        return
    if span.enc is not None:
        span.enc.append(attributes(ATTR, {key: value}))
    elif span.attrs is not None:
        span.attrs[key] = value


class _DisabledAttempt(AttemptRecord):
    """What an attempt is when telemetry is off: nothing (no traceparent either)."""

    __slots__ = ()

    def __init__(self) -> None:
        self.ended = True

    def set_attribute(self, key: str, value: str | int | float | bool) -> None:
        pass

    def done(self, status: int) -> None:
        pass

    def inject_headers(self, headers: dict[str, str]) -> None:
        pass

    def fail(self, error_type: str, status: int | None = None) -> None:
        pass


class _DisabledRecord(RequestRecord):
    """What a request record is when telemetry is off: every call returns at once."""

    __slots__ = ()

    def __init__(self) -> None:
        pass

    def set_decision(self, decision: Decision) -> None:
        pass

    def set_fleet(self, epoch: int, changing: bool) -> None:
        pass

    def set_attribute(self, key: str, value: str | int | float | bool) -> None:
        pass

    def interval(self, name: str, start_ns: int, end_ns: int, attrs: dict[str, Any]) -> None:
        pass

    def attempt(self, *, backend: str, address: str, port: int, attempt: int) -> AttemptRecord:
        return DISABLED_ATTEMPT

    def finish(
        self,
        facts: StreamFacts | None,
        *,
        status: int,
        error_type: str | None = None,
        backend: str | None = None,
    ) -> None:
        pass


DISABLED_ATTEMPT = _DisabledAttempt()
DISABLED = _DisabledRecord()
