"""The proxy's spans: how they are sampled, their ids, and where they go when they end.

The SDK's Span costs ~40-60 µs per request here (a lock and a value check per attribute,
processors called on start), more than the rest of telemetry together. The proxy builds its
spans as plain data the way Tracer.start_span builds them (same sampler, id generator, flags
and trace state; tests/test_telemetry_switch.py checks propagation against the SDK's Tracer)
and hands them, when they end, either as bytes to the OTLP/HTTP batcher or as ReadableSpans to
the provider's span processors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import sampling as _sampling
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from proxy.telemetry import sdk_bridge, wire
from proxy.telemetry.batcher import EncodedBatcher

_SAMPLED = TraceFlags.SAMPLED
_RANDOM_TRACE_ID: int = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)  # W3C level 2 (SDK >= 1.4x)
_UNSET = Status(StatusCode.UNSET)
_FLAGS = [TraceFlags(f) for f in range(4)]  # sampled x random-trace-id: built once
_NO_ATTRS: dict[str, Any] = {}  # a non-recording span's (never written: writers check recording)

# (parent, trace id) -> (sampled, trace state): an SDK sampler's decision, compiled.
Decide = Callable[[wire.Parent | None, int], tuple[bool, Any]]


class Spans:
    """What every span of this proxy is made with: sampler, id generator, and sink."""

    __slots__ = (
        "decide",
        "ids",
        "processors",
        "random_flag",
        "resource",
        "sampler",
        "scope",
        "sink",
        "tracing",
    )

    def __init__(
        self,
        provider: TracerProvider,
        processor: SpanProcessor | None,
        tracing: bool,
        resource: Resource,
        scope: InstrumentationScope,
    ) -> None:
        # False: nowhere to send spans, so none is built; non-recording spans still carry
        # trace ids for propagation to the backend, at a fraction of the cost.
        self.tracing = tracing
        self.sampler: Sampler = provider.sampler
        # The SDK's own samplers (every OTEL_TRACES_SAMPLER value but a plugin) as a plain
        # function of (parent, trace id): no Context, no SamplingResult, and attributes built
        # only for sampled requests (these samplers never read them). None: ask the sampler.
        self.decide = compile_sampler(self.sampler) if tracing else None
        self.ids = provider.id_generator
        is_random = getattr(self.ids, "is_trace_id_random", None)
        self.random_flag = _RANDOM_TRACE_ID if is_random is not None and is_random() else 0
        # Finished spans go straight to the processor (see SpanData.end); the provider owns it
        # too, so that its shutdown() and force_flush() drain it.
        self.processors: tuple[SpanProcessor, ...] = () if processor is None else (processor,)
        # With the OTLP/HTTP exporter, a span is encoded when it ends and only its bytes wait
        # for the export thread: no ReadableSpan, no object graph kept alive for the GC to scan.
        self.sink = processor if isinstance(processor, EncodedBatcher) else None
        self.resource = resource
        self.scope = scope


def compile_sampler(sampler: Sampler) -> Decide | None:
    """The decision of one of the SDK's samplers as a function of (parent, trace id).

    Returns (sampled, trace_state): what `should_sample` answers for a valid parent span
    context (or none), read off the sampler's own fields; None for any other sampler, which
    is then asked as usual. tests/test_telemetry_switch.py checks it against should_sample().
    """
    t = type(sampler)
    if t.__module__ != _sampling.__name__:
        return None  # a plugin: it may read the name, kind or attributes
    if isinstance(sampler, _sampling.StaticSampler):
        decision = sdk_bridge.static_decision(sampler)
        if decision is None or decision is _sampling.Decision.RECORD_ONLY:
            return None
        on = decision is _sampling.Decision.RECORD_AND_SAMPLE

        def static(parent: wire.Parent | None, trace_id: int) -> tuple[bool, Any]:
            return on, None if parent is None else parent.trace_state

        return static
    if isinstance(sampler, _sampling.TraceIdRatioBased):
        bound, mask = sampler.bound, sampler.TRACE_ID_LIMIT

        def ratio(parent: wire.Parent | None, trace_id: int) -> tuple[bool, Any]:
            return trace_id & mask < bound, None if parent is None else parent.trace_state

        return ratio
    if isinstance(sampler, _sampling.ParentBased):
        delegates = sdk_bridge.parent_based_delegates(sampler)
        if delegates is None:
            return None
        parts = [compile_sampler(x) for x in delegates]
        if any(p is None for p in parts):
            return None
        root, remote_on, remote_off, local_on, local_off = parts

        def parent_based(parent: wire.Parent | None, trace_id: int) -> tuple[bool, Any]:
            if parent is None:
                return root(None, trace_id)  # type: ignore[misc]
            if parent.is_remote:
                d = remote_on if parent.trace_flags.sampled else remote_off
            else:
                d = local_on if parent.trace_flags.sampled else local_off
            return d(parent, trace_id)  # type: ignore[misc]

        return parent_based
    return None


class SpanData:
    """A span under construction: plain data until it ends.

    The SDK's Span costs ~40-60 µs per request here (a lock and a value check per attribute,
    processors called on start), more than the rest of telemetry together. Spans are built the
    way Tracer.start_span builds them (same sampler, id generator, flags and trace state).
    Attributes go either into a dict, handed to the span processors in a ReadableSpan when the
    span ends, or, with the OTLP/HTTP exporter, straight into their protobuf fields (`enc`),
    and the span's bytes go to the export queue. Attribute values are written in the SDK's
    cleaned form (sequences as tuples) and stay far under its default limits.
    """

    __slots__ = (
        "_ctx",
        "attrs",
        "enc",
        "flags",
        "kind",
        "name",
        "parent",
        "recording",
        "span_id",
        "start_ns",
        "trace_id",
        "trace_state",
    )

    is_remote = False  # as a parent (a CLIENT span's), it quacks like a local SpanContext

    def __init__(
        self,
        spans: Spans,
        name: str,
        kind: SpanKind,
        parent: wire.Parent | None,
        parent_context: Context | None,
        attrs: dict[str, Any] | None,
        start_ns: int,
    ) -> None:
        if parent is None:
            trace_id = spans.ids.generate_trace_id()
            random_flag = spans.random_flag
        else:
            trace_id = parent.trace_id
            random_flag = parent.trace_flags & _RANDOM_TRACE_ID
        decide = spans.decide
        if decide is not None:
            self.recording, trace_state = decide(parent, trace_id)
            flags = (_SAMPLED if self.recording else 0) | random_flag
            self.attrs = (attrs if attrs is not None else {}) if self.recording else _NO_ATTRS
        elif spans.tracing:
            result = spans.sampler.should_sample(parent_context, trace_id, name, kind, attrs)
            self.recording = result.decision.is_recording()
            flags = (_SAMPLED if result.decision.is_sampled() else 0) | random_flag
            trace_state = result.trace_state
            self.attrs = dict(result.attributes) if self.recording else _NO_ATTRS
        else:  # what the ALWAYS_OFF sampler decides, without asking it (or allocating)
            self.recording = False
            flags = random_flag
            trace_state = parent.trace_state if parent is not None else None
            self.attrs = _NO_ATTRS
        self.trace_id = trace_id
        self.span_id = spans.ids.generate_span_id()
        self.flags = flags
        self.trace_state = trace_state
        self._ctx: SpanContext | None = None
        self.enc: list[bytes] | None = None
        self.name = name
        self.kind = kind
        self.parent = parent
        self.start_ns = start_ns

    @classmethod
    def untraced_child(cls, spans: Spans, parent: SpanData, kind: SpanKind) -> SpanData:
        """A child span when nothing is traced: ids and flags to propagate, nothing else."""
        span = cls.__new__(cls)
        span.trace_id = parent.trace_id
        span.span_id = spans.ids.generate_span_id()
        span.flags = parent.flags & _RANDOM_TRACE_ID
        span.trace_state = parent.trace_state
        span.recording = False
        span.attrs = _NO_ATTRS
        span.enc = span._ctx = span.parent = None
        span.name = parent.name
        span.kind = kind
        span.start_ns = 0
        return span

    @property
    def trace_flags(self) -> TraceFlags:
        f = self.flags
        return _FLAGS[f] if f < 4 else TraceFlags(f)

    @property
    def ctx(self) -> SpanContext:
        """The SpanContext (built on first use: unsampled requests mostly never need one)."""
        ctx = self._ctx
        if ctx is None:
            f = self.flags
            ctx = self._ctx = SpanContext(
                self.trace_id,
                self.span_id,
                is_remote=False,
                trace_flags=_FLAGS[f] if f < 4 else TraceFlags(f),
                trace_state=self.trace_state,
            )
        return ctx

    def context(self) -> Context:
        """An OTel Context with this span current (for a child's sampler)."""
        return trace.set_span_in_context(NonRecordingSpan(self.ctx))

    def end(
        self,
        spans: Spans,
        end_ns: int,
        error: str | None = None,
        events: bytes | Sequence[Event] = (),
    ) -> None:
        """Hand the span on; `events` are Span.events fields (bytes) for an encoded span."""
        if not self.recording:
            return
        enc, sink = self.enc, spans.sink
        if enc is not None and sink is not None:
            body = wire.span_message(
                self.trace_id,
                self.span_id,
                self.trace_state,
                self.parent,
                wire.name_field(self.name),
                self.kind,
                self.start_ns,
                end_ns,
                b"".join(enc),
                events if type(events) is bytes else wire.events_bytes(events),  # type: ignore[arg-type]
                0 if error is None else StatusCode.ERROR.value,
                error,
            )
            sink.add(wire.ld(b"\x12", body))
            return
        status = _UNSET if error is None else Status(StatusCode.ERROR, error)
        parent = self.parent
        if isinstance(parent, SpanData):
            parent = parent.ctx
        span = ReadableSpan(
            name=self.name,
            context=self.ctx,
            parent=cast("SpanContext | None", parent),
            resource=spans.resource,
            attributes=self.attrs,
            events=tuple(events),  # type: ignore[arg-type]
            kind=self.kind,
            status=status,
            start_time=self.start_ns,
            end_time=end_ns,
            instrumentation_scope=spans.scope,
        )
        for p in spans.processors:
            p.on_end(span)
