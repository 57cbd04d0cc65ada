"""OpenTelemetry for the proxy: providers, the request span, metric instruments, /metrics.

One SERVER span per request with a CLIENT child per upstream attempt; never a span per chunk.
All metric recording happens once per request in RequestRecord.finish(), from the facts the
stream meter aggregated, so the per-chunk hot path pays nothing for telemetry.

Histograms are pre-aggregated here rather than recorded through the SDK instrument API: the
SDK costs ~5-15 µs per record() (attribute cleaning and hashing on every call), which for the
~64 per-chunk samples of one request would cost more than forwarding the whole stream. The
pre-aggregated points (with trace-linked exemplars) are merged into every reader's collection
as ordinary OTel histogram metrics, so Prometheus and OTLP see them like any other.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
import time
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import Exemplar, MeterProvider, TraceBasedExemplarFilter
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import sampling as _sampling
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy.config import TelemetryConfig
from proxy.meter import StreamFacts
from proxy.routing.types import Decision

SCOPE = "warmroute"
log = logging.getLogger("warmroute.telemetry")

# Explicit bucket boundaries from the OTel GenAI semantic conventions (seconds / tokens).
TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5)
TTFT_BUCKETS += (0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = tuple(0.01 * 2**i for i in range(14))  # 0.01 ... 81.92
TOKEN_BUCKETS = tuple(float(4**i) for i in range(14))  # 1 ... 67108864
# The proxy's own cost is sub-millisecond; the GenAI buckets would put it all in the first one.
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

OPERATION = {
    "chat": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
    # The OpenAI semconv maps the Responses API to "chat", told apart by openai.api.type.
    "responses": "chat",
}
API_TYPE = {"chat": "chat_completions", "completions": "completions", "responses": "responses"}
PROVIDER = "openai"  # the wire format every backend speaks (semconv: the telemetry flavour)

# request body key -> span attribute
_PARAMS = (
    ("max_tokens", "gen_ai.request.max_tokens"),
    ("max_completion_tokens", "gen_ai.request.max_tokens"),
    ("max_output_tokens", "gen_ai.request.max_tokens"),
    ("temperature", "gen_ai.request.temperature"),
    ("top_p", "gen_ai.request.top_p"),
    ("top_k", "gen_ai.request.top_k"),
    ("seed", "gen_ai.request.seed"),
    ("frequency_penalty", "gen_ai.request.frequency_penalty"),
    ("presence_penalty", "gen_ai.request.presence_penalty"),
)
_CONTENT_KEYS = ("messages", "prompt", "input", "instructions")

_propagator = TraceContextTextMapPropagator()
_SAMPLED = TraceFlags.SAMPLED
_RANDOM_TRACE_ID: int = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)  # W3C level 2 (SDK >= 1.4x)
_UNSET = Status(StatusCode.UNSET)


def _epoch_ns(t: float, anchor: tuple[int, float]) -> int:
    """perf_counter seconds -> wall-clock ns, through a (time_ns, perf_counter) pair."""
    return anchor[0] + int((t - anchor[1]) * 1e9)


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (what vllm bench and most dashboards report for small n)."""
    k = max(0, min(len(sorted_values) - 1, int(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


_DIGITS = re.compile(r"\d+")


# ---------------------------------------------------------------------------------------------
# Pre-aggregated histograms.


@dataclass(slots=True)
class _Point:
    attributes: dict[str, Any]
    counts: list[int]
    total: float = 0.0
    count: int = 0
    min: float = float("inf")
    max: float = float("-inf")
    # one exemplar per bucket, the latest: what Prometheus/Grafana show per bucket. Kept as
    # (value, (trace_id, span_id, time_ns)) and made into SDK Exemplars only when collected.
    exemplars: dict[int, tuple[float, tuple[int, int, int]]] = field(default_factory=dict)


class _Histogram:
    """A cumulative explicit-bucket histogram, keyed by an attribute tuple the caller builds."""

    __slots__ = ("bounds", "description", "name", "points", "unit")

    def __init__(self, name: str, unit: str, description: str, bounds: Sequence[float]) -> None:
        self.name = name
        self.unit = unit
        self.description = description
        self.bounds = tuple(bounds)
        self.points: dict[tuple[Any, ...], _Point] = {}

    def _point(self, attrs: dict[str, Any], key: tuple[Any, ...]) -> _Point:
        point = self.points[key] = _Point(attrs, [0] * (len(self.bounds) + 1))
        return point

    def record1(
        self,
        v: float,
        attrs: dict[str, Any],
        key: tuple[Any, ...],
        exemplar: tuple[int, int, int] | None,
    ) -> None:
        """Add one value (the common case: one sample per request)."""
        point = self.points.get(key) or self._point(attrs, key)
        # OTel buckets are (lower, upper]: bisect_left puts v == bound in that bound's bucket.
        i = bisect_left(self.bounds, v)
        point.counts[i] += 1
        point.total += v
        point.count += 1
        if v < point.min:
            point.min = v
        if v > point.max:
            point.max = v
        if exemplar is not None:
            point.exemplars[i] = (v, exemplar)

    def record(
        self,
        values: Sequence[float],
        attrs: dict[str, Any],
        key: tuple[Any, ...],
        exemplar: tuple[int, int, int] | None,
    ) -> None:
        """Add values; exemplar = (trace_id, span_id, time_ns) of the request, if sampled."""
        if not values:
            return
        point = self.points.get(key) or self._point(attrs, key)
        bounds, counts = self.bounds, point.counts
        if len(values) <= 8:
            for v in values:
                counts[bisect_left(bounds, v)] += 1
            top = max(values)
            low = min(values)
        else:
            # Many samples (per-chunk gaps): sort once in C and cut at each bound instead.
            s = sorted(values)
            prev = 0
            for i, b in enumerate(bounds):
                k = bisect_right(s, b, prev)
                counts[i] += k - prev
                prev = k
            counts[-1] += len(s) - prev
            low, top = s[0], s[-1]
        point.total += sum(values)
        point.count += len(values)
        if low < point.min:
            point.min = low
        if top > point.max:
            point.max = top
        if exemplar is not None:
            # One exemplar per request (its largest value): the sample worth clicking through.
            point.exemplars[bisect_left(bounds, top)] = (top, exemplar)

    def metric(self, start_ns: int, now_ns: int) -> Metric | None:
        if not self.points:
            return None
        points = [
            HistogramDataPoint(
                attributes=dict(p.attributes),
                start_time_unix_nano=start_ns,
                time_unix_nano=now_ns,
                count=p.count,
                sum=p.total,
                bucket_counts=list(p.counts),
                explicit_bounds=self.bounds,
                min=p.min,
                max=p.max,
                exemplars=[_exemplar(*p.exemplars[i]) for i in sorted(p.exemplars)],
            )
            for p in list(self.points.values())
        ]
        return Metric(
            name=self.name,
            description=self.description,
            unit=self.unit,
            data=Histogram(
                data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE
            ),
        )


def _exemplar(value: float, ex: tuple[int, int, int]) -> Exemplar:
    trace_id, span_id, t_ns = ex
    return Exemplar(None, value, t_ns, span_id=span_id, trace_id=trace_id)


class _Counts:
    """Monotonic or up-down counts by attribute tuple, read by an observable instrument."""

    __slots__ = ("keys", "values")

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys
        self.values: dict[tuple[Any, ...], int] = {}

    def add(self, key: tuple[Any, ...], n: int = 1) -> None:
        self.values[key] = self.values.get(key, 0) + n

    def observe(self, _options: CallbackOptions) -> Iterable[Observation]:
        for key, v in list(self.values.items()):
            yield Observation(v, dict(zip(self.keys, key, strict=True)))


# ---------------------------------------------------------------------------------------------


class Telemetry:
    """Owns the tracer and meter providers (no process globals) and the instruments."""

    def __init__(
        self,
        cfg: TelemetryConfig,
        *,
        span_exporter: SpanExporter | None = None,
        metric_readers: Sequence[MetricReader] = (),
    ) -> None:
        self.cfg = cfg
        # telemetry.enabled: false turns it all off: no spans, no metrics, no /metrics (the
        # stream meter still runs: routing learns from it and it strips the usage chunk).
        self.enabled = cfg.enabled
        resource = Resource.create({"service.name": cfg.service_name})
        self._tracing = self.enabled and (
            span_exporter is not None or cfg.traces_exporter != "none"
        )
        # With nowhere to send spans, don't build them: non-recording spans still carry trace
        # ids for propagation to the backend, at a fraction of the cost.
        self.tracer_provider = TracerProvider(
            resource=resource, sampler=None if self._tracing else ALWAYS_OFF
        )
        processor: SpanProcessor | None = None
        if not self.enabled:
            pass
        elif span_exporter is not None:
            processor = SimpleSpanProcessor(span_exporter)
        elif cfg.traces_exporter == "otlp":
            exporter = _otlp_span_exporter(cfg)
            if _EncodedBatcher.can_use(exporter):
                processor = _EncodedBatcher(exporter, resource, InstrumentationScope(SCOPE))
            else:  # gRPC, or an SDK whose HTTP exporter we do not know
                processor = BatchSpanProcessor(exporter)
        elif cfg.traces_exporter == "console":
            processor = BatchSpanProcessor(ConsoleSpanExporter())
        # Finished spans go straight to our processor (see _SpanData); the provider still owns
        # it so that shutdown() and force_flush() drain it.
        self._processors: tuple[SpanProcessor, ...] = () if processor is None else (processor,)
        # With the OTLP/HTTP exporter, a span is encoded when it ends and only its bytes wait
        # for the export thread: no ReadableSpan, no object graph kept alive for the GC to scan.
        self._sink = processor if isinstance(processor, _EncodedBatcher) else None
        if processor is not None:
            self.tracer_provider.add_span_processor(processor)
        self.tracer = self.tracer_provider.get_tracer(SCOPE)
        self._sampler = self.tracer_provider.sampler
        # The SDK's own samplers (every OTEL_TRACES_SAMPLER value but a plugin) as a plain
        # function of (parent, trace id): no Context, no SamplingResult, and attributes built
        # only for sampled requests (these samplers never read them). None: ask the sampler.
        self._decide = _compile_sampler(self._sampler) if self._tracing else None
        self._ids = self.tracer_provider.id_generator
        is_random = getattr(self._ids, "is_trace_id_random", None)
        self._random_flag = _RANDOM_TRACE_ID if is_random is not None and is_random() else 0
        self._resource = resource
        self._scope = InstrumentationScope(SCOPE)

        readers: list[MetricReader] = list(metric_readers)
        self._registry: Any = None
        if cfg.prometheus and self.enabled:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import CollectorRegistry

            self._registry = CollectorRegistry(auto_describe=True)
            readers.append(PrometheusMetricReader(registry=self._registry))
        if cfg.traces_exporter == "otlp" and self.enabled:
            readers.append(PeriodicExportingMetricReader(_otlp_metric_exporter(cfg)))
        self.meter_provider = MeterProvider(
            metric_readers=readers,
            resource=resource,
            exemplar_filter=TraceBasedExemplarFilter(),
        )
        self._start_ns = time.time_ns()
        self._lock = threading.Lock()  # readers collect from their own threads
        h = _Histogram
        self.h_ttft = h(
            "gen_ai.server.time_to_first_token",
            "s",
            "Time to the first output token written to the client, successful responses.",
            TTFT_BUCKETS,
        )
        self.h_tpot = h(
            "gen_ai.server.time_per_output_token",
            "s",
            "Time per output token after the first, successful responses.",
            TPOT_BUCKETS,
        )
        self.h_duration = h(
            "gen_ai.server.request.duration",
            "s",
            "Request duration to the last output token (or the response) as the client saw it.",
            DURATION_BUCKETS,
        )
        self.h_tokens = h(
            "gen_ai.client.token.usage",
            "{token}",
            "Input and output tokens, as reported by the backend's usage.",
            TOKEN_BUCKETS,
        )
        self.h_ttfc = h(
            "gen_ai.client.operation.time_to_first_chunk",
            "s",
            "Time to the first output chunk written to the client (streaming, any outcome).",
            DURATION_BUCKETS,
        )
        self.h_tpoc = h(
            "gen_ai.client.operation.time_per_output_chunk",
            "s",
            "Gap between consecutive output chunks written to the client (streaming).",
            DURATION_BUCKETS,
        )
        self.h_overhead = h(
            "warmroute.proxy.overhead",
            "s",
            "Client TTFT minus upstream TTFT: time the proxy added before the first token.",
            OVERHEAD_BUCKETS,
        )
        self.h_forward = h(
            "warmroute.proxy.chunk_forward.duration",
            "s",
            "Time from receiving output bytes from the backend to writing them to the client.",
            OVERHEAD_BUCKETS,
        )
        self.h_decision = h(
            "warmroute.route.decision.duration",
            "s",
            "Time to make one routing decision.",
            OVERHEAD_BUCKETS,
        )
        self.h_cached = h(
            "warmroute.prefix.cached_tokens",
            "{token}",
            "Prompt tokens the backend reported as served from its prefix cache.",
            TOKEN_BUCKETS,
        )
        self.h_hit = h(
            "warmroute.prefix.hit_ratio",
            "1",
            "Prefix cache hit ratio: predicted by the router's index, or actual from usage.",
            RATIO_BUCKETS,
        )
        self._histograms = (
            self.h_ttft,
            self.h_tpot,
            self.h_duration,
            self.h_tokens,
            self.h_ttfc,
            self.h_tpoc,
            self.h_overhead,
            self.h_forward,
            self.h_decision,
            self.h_cached,
            self.h_hit,
        )
        self.c_decisions = _Counts(("warmroute.route.policy", "warmroute.route.reason"))
        self.c_errors = _Counts(("warmroute.backend", "error.type"))
        self.c_retries = _Counts(("warmroute.backend",))
        self.c_inflight = _Counts(("warmroute.backend",))
        meter = self.meter_provider.get_meter(SCOPE)
        meter.create_observable_counter(
            "warmroute.route.decisions",
            [self.c_decisions.observe],
            unit="{decision}",
            description="Routing decisions by policy and reason.",
        )
        meter.create_observable_counter(
            "warmroute.upstream.errors",
            [self.c_errors.observe],
            unit="{error}",
            description="Failed upstream attempts by backend and error.type.",
        )
        meter.create_observable_counter(
            "warmroute.upstream.retries",
            [self.c_retries.observe],
            unit="{retry}",
            description="Attempts beyond the first, by the backend retried onto.",
        )
        meter.create_observable_up_down_counter(
            "warmroute.backend.inflight",
            [self.c_inflight.observe],
            unit="{request}",
            description="Requests this proxy has open on each backend.",
        )
        self._reasons: dict[str, str] = {}
        self._labels: dict[tuple[Any, ...], _Labels] = {}
        for reader in readers:
            self._merge_into(reader)

    # -- metrics export -------------------------------------------------------------------------
    def _merge_into(self, reader: MetricReader) -> None:
        """Have `reader`'s collections include the pre-aggregated histograms."""
        # The SDK sets this callback when the reader joins the MeterProvider; wrapping it is the
        # one place we lean on SDK internals (tests/test_telemetry.py guards it).
        inner: Callable[..., Any] | None = reader._collect
        if inner is None:
            return

        def collect(r: MetricReader, timeout_millis: float = 10_000) -> Any:
            return self._with_histograms(inner(r, timeout_millis=timeout_millis))

        reader._set_collect_callback(collect)

    def _with_histograms(self, data: MetricsData | None) -> MetricsData | None:
        now = time.time_ns()
        with self._lock:
            metrics = [m for h in self._histograms if (m := h.metric(self._start_ns, now))]
        if not metrics:
            return data
        ours = ScopeMetrics(scope=self._scope, metrics=metrics, schema_url="")
        if data is None or not data.resource_metrics:
            rm = [ResourceMetrics(resource=self._resource, scope_metrics=[ours], schema_url="")]
            return MetricsData(resource_metrics=rm)
        first, *rest = data.resource_metrics
        # Exporters group by scope (OTLP keys a dict by it), so join the SDK's "warmroute"
        # scope rather than add a second one with the same name.
        scopes = list(first.scope_metrics)
        for i, sm in enumerate(scopes):
            if sm.scope.name == SCOPE:
                scopes[i] = ScopeMetrics(sm.scope, [*sm.metrics, *metrics], sm.schema_url)
                break
        else:
            scopes.append(ours)
        merged = ResourceMetrics(
            resource=first.resource, scope_metrics=scopes, schema_url=first.schema_url
        )
        return MetricsData(resource_metrics=[merged, *rest])

    def prometheus_text(self) -> tuple[bytes, str]:
        """The body and content type for GET /metrics (Prometheus text format 0.0.4)."""
        from prometheus_client import generate_latest

        if self._registry is None:
            return b"# prometheus export is disabled (telemetry.prometheus: false)\n", (
                "text/plain; charset=utf-8"
            )
        # The classic text format: every Prometheus version (and most scrapers) parses it.
        return generate_latest(self._registry), "text/plain; version=0.0.4; charset=utf-8"

    # -- per request ----------------------------------------------------------------------------
    def start_request(
        self,
        *,
        request_id: str,
        api: str,
        model: str | None,
        stream: bool,
        params: Mapping[str, Any],
        headers: Mapping[str, str],
        t0: float,
    ) -> RequestRecord:
        """Open the request's SERVER span (parent: the client's W3C traceparent, if any)."""
        if not self.enabled:
            return _DISABLED
        return RequestRecord(self, request_id, api, model, stream, params, headers, t0)

    def observe_routing(self, policy: str, reason: str, decision_s: float) -> None:
        """Count one routing decision and time it (called once per decision, not per attempt)."""
        if not self.enabled:
            return
        label = self._reasons.get(reason)
        if label is None:
            # Reasons may embed counts ("rotated among 3 ties"); keep the label set small.
            label = self._reasons[reason] = _DIGITS.sub("N", reason)[:80]
        key = (policy,)
        with self._lock:
            self.c_decisions.add((policy, label))
            self.h_decision.record1(decision_s, {"warmroute.route.policy": policy}, key, None)

    def set_inflight(self, backend: str, delta: int) -> None:
        """Adjust warmroute.backend.inflight for `backend` by delta (+1 on open, -1 on close)."""
        if not self.enabled:
            return
        with self._lock:
            self.c_inflight.add((backend,), delta)

    def shutdown(self) -> None:
        """Flush and stop exporters; the Prometheus collector is unregistered."""
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def _otlp_endpoint(cfg: TelemetryConfig, signal: str) -> str | None:
    """cfg.otlp_endpoint is a base URL like OTEL_EXPORTER_OTLP_ENDPOINT; None defers to env."""
    if not cfg.otlp_endpoint:
        return None
    if cfg.otlp_protocol == "grpc":
        return cfg.otlp_endpoint
    return cfg.otlp_endpoint.rstrip("/") + f"/v1/{signal}"


def _otlp_span_exporter(cfg: TelemetryConfig) -> SpanExporter:
    if cfg.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as G

        return G(endpoint=_otlp_endpoint(cfg, "traces"))
    return _fast_http_span_exporter(endpoint=_otlp_endpoint(cfg, "traces"))


def _fast_http_span_exporter(**kwargs: Any) -> SpanExporter:
    """The SDK's OTLP/HTTP span exporter with encode_spans_fast() in place of its encoder."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    class FastOTLPSpanExporter(OTLPSpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            client = getattr(self, "_client", None)  # the SDK's HTTP client (1.4x)
            if client is None or self._shutdown or len(spans) > 10_000:
                return super().export(spans)
            try:
                data = encode_spans_fast(spans)
            except Exception:  # something the fast path does not know: the SDK's own encoder
                return super().export(spans)
            limit = getattr(self, "_max_request_size", None)
            if limit and len(data) > limit:  # 0: no limit, as the SDK reads it
                return super().export(spans)  # it logs and drops
            result = client.export(data)
            ok = getattr(result, "success", False)
            return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

        def export_encoded(self, data: bytes) -> bool:
            """Send one serialized ExportTraceServiceRequest (see _EncodedBatcher)."""
            if self._shutdown:
                return False
            limit = getattr(self, "_max_request_size", None)
            if limit and len(data) > limit:
                log.error("span export of %d bytes exceeds the %d byte limit", len(data), limit)
                return False
            return bool(getattr(self._client.export(data), "success", False))

    return FastOTLPSpanExporter(**kwargs)


def _otlp_metric_exporter(cfg: TelemetryConfig) -> Any:
    if cfg.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as G

        return G(endpoint=_otlp_endpoint(cfg, "metrics"))
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as H

    return H(endpoint=_otlp_endpoint(cfg, "metrics"))


# --- OTLP/HTTP span encoding ----------------------------------------------------------------
_pack_d = struct.Struct("<d").pack
_pack_q = struct.Struct("<Q").pack
_INT64 = 1 << 63


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes((i,)) for i in range(0x80)]


def _ld(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited protobuf field: tag, length, payload."""
    n = len(payload)
    return tag + (_SMALL[n] if n < 0x80 else _varint(n)) + payload


def _any_value(v: Any) -> bytes:
    """opentelemetry.proto.common.v1.AnyValue, as the SDK's _encode_value builds it."""
    t = type(v)
    if t is str:
        return _ld(b"\x0a", v.encode())
    if t is bool:
        return b"\x10\x01" if v else b"\x10\x00"
    if t is int and -_INT64 <= v < _INT64:
        return b"\x18" + _varint(v & 0xFFFFFFFFFFFFFFFF)
    if t is float:
        return b"\x21" + _pack_d(v)
    if v is None:
        return b""
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, str):
        return _ld(b"\x0a", v.encode())
    if isinstance(v, int):
        if not -_INT64 <= v < _INT64:
            raise ValueError(f"{v} does not fit an int64")
        return b"\x18" + _varint(v & 0xFFFFFFFFFFFFFFFF)
    if isinstance(v, float):
        return b"\x21" + _pack_d(v)
    if isinstance(v, bytes):
        return _ld(b"\x3a", v)
    if isinstance(v, Sequence):
        return _ld(b"\x2a", b"".join([_ld(b"\x0a", _any_value(x)) for x in v]))
    if isinstance(v, Mapping):
        kvs = [_ld(b"\x0a", _key_value(str(k), x)) for k, x in v.items()]
        return _ld(b"\x32", b"".join(kvs))
    raise TypeError(f"cannot encode a {t.__name__} attribute")


_KEYS: dict[str, bytes] = {}


def _key_value(k: str, v: Any) -> bytes:
    key = _KEYS.get(k)
    if key is None:
        key = _ld(b"\x0a", k.encode())
        if len(_KEYS) < 4096:
            _KEYS[k] = key
    return key + _ld(b"\x12", _any_value(v))


# Most attribute values repeat from request to request (model, backend, policy, status, token
# counts...): their encoded fields are cached. Floats (timings) rarely repeat and are not.
_FIELDS: dict[tuple[Any, ...], bytes] = {}
_CACHED_TYPES = frozenset((str, int, bool, tuple))


# A float field is a fixed-length message: everything but its 8 value bytes depends only on
# (tag, key), so that prefix is built once per key and the value packed onto it.
_FLOAT_PREFIX: dict[tuple[bytes, str], bytes] = {}


def _float_field(tag: bytes, k: str, v: float) -> bytes:
    prefix = _FLOAT_PREFIX.get((tag, k))
    if prefix is None:
        key = _ld(b"\x0a", k.encode())
        # KeyValue: key, then value = AnyValue{double_value} (tag 0x21, 8 bytes): 11 bytes
        prefix = tag + _varint(len(key) + 11) + key + b"\x12\x09\x21"
        if len(_FLOAT_PREFIX) < 4096:
            _FLOAT_PREFIX[(tag, k)] = prefix
    return prefix + _pack_d(v)


def _field(tag: bytes, k: str, v: Any) -> bytes:
    t = type(v)
    if t is float:
        return _float_field(tag, k, v)
    if t not in _CACHED_TYPES or (t is str and len(v) > 128):
        return _ld(tag, _key_value(k, v))
    # the types too: True == 1 == 1.0 and hash alike, but they encode differently
    ck = (tag, k, t, v, tuple(map(type, v))) if t is tuple else (tag, k, t, v)
    b = _FIELDS.get(ck)
    if b is None:
        b = _ld(tag, _key_value(k, v))
        if len(_FIELDS) >= 4096:  # unique values (request ids) cycle through it
            _FIELDS.clear()
        _FIELDS[ck] = b
    return b


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
    """Repeated KeyValue; like the SDK, an attribute that cannot be encoded is left out."""
    if not attributes:
        return b""
    # _field, inlined for the two common cases (a float; a cached str, int or bool field):
    # ~45 attributes a request made the call itself a large share of the encoding time.
    out: list[bytes] = []
    append = out.append
    fields, floats = _FIELDS, _FLOAT_PREFIX
    try:
        for k, v in attributes.items():
            t = type(v)
            if t is float:
                prefix = floats.get((tag, k))
                append(_float_field(tag, k, v) if prefix is None else prefix + _pack_d(v))
            elif t is str or t is int or t is bool:
                b = fields.get((tag, k, t, v))
                append(_field(tag, k, v) if b is None else b)
            else:
                append(_field(tag, k, v))
        return b"".join(out)
    except (TypeError, ValueError, UnicodeError):
        out = []
        for k, v in attributes.items():
            try:
                out.append(_ld(tag, _key_value(k, v)))
            except (TypeError, ValueError, UnicodeError):
                log.warning("span attribute %s not exported: cannot encode %r", k, v)
        return b"".join(out)


def _span_bytes(span: ReadableSpan) -> bytes:
    """opentelemetry.proto.trace.v1.Span, field for field what the SDK's encoder writes."""
    if span.links:
        raise ValueError("links are not encoded here")
    status = span.status
    return _span_message(
        span.context,
        span.parent,
        span.name,
        span.kind,
        span.start_time,
        span.end_time,
        span.attributes,
        span.events,
        status.status_code.value,
        status.description,
        span.dropped_attributes,
        span.dropped_events,
        span.dropped_links,
    )


def _span_message(
    ctx: SpanContext,
    parent: SpanContext | None,
    name: str,
    kind: SpanKind,
    start_time: int | None,
    end_time: int | None,
    attributes: Mapping[str, Any] | None,
    events: Sequence[Event],
    status_code: int,
    description: str | None,
    dropped_attributes: int = 0,
    dropped_events: int = 0,
    dropped_links: int = 0,
) -> bytes:
    parts = [
        b"\x0a\x10" + ctx.trace_id.to_bytes(16, "big"),
        b"\x12\x08" + ctx.span_id.to_bytes(8, "big"),
    ]
    if ctx.trace_state:
        parts.append(
            _ld(b"\x1a", ",".join(f"{k}={v}" for k, v in ctx.trace_state.items()).encode())
        )
    if parent is not None:
        parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
    parts.append(_ld(b"\x2a", name.encode()))
    pb_kind = _PB_KIND[kind]
    if pb_kind:
        parts.append(b"\x30" + _SMALL[pb_kind])
    if start_time:
        parts.append(b"\x39" + _pack_q(start_time))
    if end_time:
        parts.append(b"\x41" + _pack_q(end_time))
    parts.append(_attributes(b"\x4a", attributes))
    if dropped_attributes:
        parts.append(b"\x50" + _varint(dropped_attributes))
    for e in events:
        ev = [b"\x09" + _pack_q(e.timestamp), _ld(b"\x12", e.name.encode())]
        ev.append(_attributes(b"\x1a", e.attributes))
        if e.dropped_attributes:
            ev.append(b"\x20" + _varint(e.dropped_attributes))
        parts.append(_ld(b"\x5a", b"".join(ev)))
    if dropped_events:
        parts.append(b"\x60" + _varint(dropped_events))
    if dropped_links:
        parts.append(b"\x70" + _varint(dropped_links))
    st = b""
    if description:
        st = _ld(b"\x12", description.encode())
    if status_code:
        st += b"\x18" + _SMALL[status_code]
    parts.append(_ld(b"\x7a", st))
    # flags: the context-has-is-remote bit, and is-remote when the parent came over the wire
    remote = parent is not None and parent.is_remote
    parts.append(b"\x85\x01" + (b"\x00\x03\x00\x00" if remote else b"\x00\x01\x00\x00"))
    return b"".join(parts)


_PB_KIND = {k: k.value + 1 for k in SpanKind}  # proto enum: 0 is UNSPECIFIED


def _resource_bytes(resource: Resource) -> bytes:
    return _attributes(b"\x0a", resource.attributes)


def _scope_bytes(scope: InstrumentationScope | None) -> bytes:
    if scope is None:
        return b""
    out = _ld(b"\x0a", scope.name.encode())
    if scope.version:
        out += _ld(b"\x12", scope.version.encode())
    return out + _attributes(b"\x1a", scope.attributes)


def encode_spans_fast(spans: Sequence[ReadableSpan]) -> bytes:
    """An ExportTraceServiceRequest, serialized: the bytes encode_spans(spans) would give.

    The SDK's encoder builds a protobuf object per attribute value (~4 µs each, ~180 µs for one
    request's two spans here); this writes the wire format directly (~5x cheaper).
    tests/test_telemetry_encoding.py checks it against the SDK's encoder, message for message.
    """
    groups: dict[tuple[int, int], tuple[Resource, InstrumentationScope | None, list[bytes]]] = {}
    for span in spans:
        res, scope = span.resource, span.instrumentation_scope
        g = groups.get((id(res), id(scope)))
        if g is None:
            g = groups[(id(res), id(scope))] = (res, scope, [])
        g[2].append(_ld(b"\x12", _span_bytes(span)))
    by_resource: dict[int, tuple[Resource, list[bytes]]] = {}
    for res, scope, encoded in groups.values():
        scope_spans = _ld(b"\x0a", _scope_bytes(scope)) + b"".join(encoded)
        if scope is not None and scope.schema_url:
            scope_spans += _ld(b"\x1a", scope.schema_url.encode())
        r = by_resource.get(id(res))
        if r is None:
            r = by_resource[id(res)] = (res, [])
        r[1].append(_ld(b"\x12", scope_spans))
    out = []
    for res, scopes in by_resource.values():
        body = _ld(b"\x0a", _resource_bytes(res)) + b"".join(scopes)
        if res.schema_url:
            body += _ld(b"\x1a", res.schema_url.encode())
        out.append(_ld(b"\x0a", body))
    return b"".join(out)


Decide = Callable[[SpanContext | None, int], tuple[bool, Any]]


def _compile_sampler(sampler: Sampler) -> Decide | None:
    """The decision of one of the SDK's samplers as a function of (parent, trace id).

    Returns (sampled, trace_state): what `should_sample` answers for a valid parent span
    context (or none), read off the sampler's own fields; None for any other sampler, which
    is then asked as usual. tests/test_telemetry_switch.py checks it against should_sample().
    """
    t = type(sampler)
    if t.__module__ != _sampling.__name__:
        return None  # a plugin: it may read the name, kind or attributes
    if isinstance(sampler, _sampling.StaticSampler):
        if sampler._decision is _sampling.Decision.RECORD_ONLY:
            return None
        on = sampler._decision is _sampling.Decision.RECORD_AND_SAMPLE

        def static(parent: SpanContext | None, trace_id: int) -> tuple[bool, Any]:
            return on, None if parent is None else parent.trace_state

        return static
    if isinstance(sampler, _sampling.TraceIdRatioBased):
        bound, mask = sampler.bound, sampler.TRACE_ID_LIMIT

        def ratio(parent: SpanContext | None, trace_id: int) -> tuple[bool, Any]:
            return trace_id & mask < bound, None if parent is None else parent.trace_state

        return ratio
    if isinstance(sampler, _sampling.ParentBased):
        parts = [
            _compile_sampler(x)
            for x in (
                sampler._root,
                sampler._remote_parent_sampled,
                sampler._remote_parent_not_sampled,
                sampler._local_parent_sampled,
                sampler._local_parent_not_sampled,
            )
        ]
        if any(p is None for p in parts):
            return None
        root, remote_on, remote_off, local_on, local_off = parts

        def parent_based(parent: SpanContext | None, trace_id: int) -> tuple[bool, Any]:
            if parent is None:
                return root(None, trace_id)  # type: ignore[misc]
            if parent.is_remote:
                d = remote_on if parent.trace_flags.sampled else remote_off
            else:
                d = local_on if parent.trace_flags.sampled else local_off
            return d(parent, trace_id)  # type: ignore[misc]

        return parent_based
    return None


def _envelope(resource: Resource, scope: InstrumentationScope) -> tuple[bytes, ...]:
    """What goes around the spans of one export, as encode_spans_fast writes it: the resource
    field, the resource's schema_url field, the scope field, the scope's schema_url field."""
    return (
        _ld(b"\x0a", _resource_bytes(resource)),
        _ld(b"\x1a", resource.schema_url.encode()) if resource.schema_url else b"",
        _ld(b"\x0a", _scope_bytes(scope)),
        _ld(b"\x1a", scope.schema_url.encode()) if scope.schema_url else b"",
    )


def _env_int(name: str, default: int) -> int:
    try:
        value = int(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value > 0 else default


class _EncodedBatcher(SpanProcessor):
    """The BatchSpanProcessor's job for spans that arrive already encoded (see _SpanData.end).

    The same OTEL_BSP_* settings and defaults (export every 5 s or at 512 spans, at most 2048
    waiting, older ones kept when full), one daemon thread, and the export itself through the
    SDK exporter's own HTTP client (its endpoint, headers, compression, timeout and retries).
    """

    def __init__(
        self, exporter: SpanExporter, resource: Resource, scope: InstrumentationScope
    ) -> None:
        self._exporter: Any = exporter
        self._delay_s = _env_int("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self._max_queue = _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self._max_batch = min(_env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512), self._max_queue)
        self._res, self._res_tail, self._sc, self._sc_tail = _envelope(resource, scope)
        self._queue: deque[bytes] = deque()
        self._dropped = 0
        self._wake = threading.Condition()
        self._export_lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="warmroute-span-export", daemon=True)
        self._thread.start()

    @staticmethod
    def can_use(exporter: SpanExporter) -> bool:
        return (
            hasattr(exporter, "export_encoded") and getattr(exporter, "_client", None) is not None
        )

    def add(self, span: bytes) -> None:
        """One encoded Span (its bytes as a ScopeSpans.spans field); never blocks."""
        queue = self._queue
        if len(queue) >= self._max_queue or self._stopped:
            self._dropped += 1
            return
        queue.append(span)
        if len(queue) == self._max_batch:
            with self._wake:
                self._wake.notify()

    def on_end(self, span: ReadableSpan) -> None:  # spans the SDK made, should any arrive
        if span.context.trace_flags.sampled:
            self.add(_ld(b"\x12", _span_bytes(span)))

    def _run(self) -> None:
        while not self._stopped:
            with self._wake:
                if len(self._queue) < self._max_batch and not self._stopped:
                    self._wake.wait(self._delay_s)
            self._drain()

    def _drain(self) -> bool:
        ok = True
        with self._export_lock:
            queue = self._queue
            while queue:
                n = min(len(queue), self._max_batch)
                batch = [queue.popleft() for _ in range(n)]
                ok = self._export(batch) and ok
            if self._dropped:
                log.warning("dropped %d spans: the export queue was full", self._dropped)
                self._dropped = 0
        return ok

    def _export(self, batch: list[bytes]) -> bool:
        scope_spans = _ld(b"\x12", self._sc + b"".join(batch) + self._sc_tail)
        data = _ld(b"\x0a", self._res + scope_spans + self._res_tail)
        try:
            return bool(self._exporter.export_encoded(data))
        except Exception:
            log.exception("span export failed")
            return False

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._drain()

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        with self._wake:
            self._wake.notify()
        self._thread.join()
        self._drain()
        self._exporter.shutdown()


_FLAGS = [TraceFlags(f) for f in range(4)]  # sampled x random-trace-id: built once
_NO_ATTRS: dict[str, Any] = {}  # a non-recording span's (never written: writers check recording)


class _SpanData:
    """A span under construction: plain data until it ends, then one ReadableSpan.

    The SDK's Span costs ~40-60 µs per request here (a lock and a value check per attribute,
    processors called on start), more than the rest of telemetry together. Spans are built the
    way Tracer.start_span builds them (same sampler, id generator, flags and trace state), kept
    as a dict, and handed to the span processors as a ReadableSpan when they end. Attribute
    values are written in the SDK's cleaned form (sequences as tuples) and stay far under its
    default limits (128 attributes, 128 events).
    """

    __slots__ = ("attrs", "ctx", "kind", "name", "parent", "recording", "start_ns")

    def __init__(
        self,
        tel: Telemetry,
        name: str,
        kind: SpanKind,
        parent: SpanContext | None,
        parent_context: Context | None,
        attrs: dict[str, Any] | None,
        start_ns: int,
    ) -> None:
        if parent is None:
            trace_id = tel._ids.generate_trace_id()
            random_flag = tel._random_flag
        else:
            trace_id = parent.trace_id
            random_flag = parent.trace_flags & _RANDOM_TRACE_ID
        decide = tel._decide
        if decide is not None:
            self.recording, trace_state = decide(parent, trace_id)
            flags = (_SAMPLED if self.recording else 0) | random_flag
            self.attrs = (attrs if attrs is not None else {}) if self.recording else _NO_ATTRS
        elif tel._tracing:
            result = tel._sampler.should_sample(parent_context, trace_id, name, kind, attrs)
            self.recording = result.decision.is_recording()
            flags = (_SAMPLED if result.decision.is_sampled() else 0) | random_flag
            trace_state = result.trace_state
            self.attrs = dict(result.attributes) if self.recording else _NO_ATTRS
        else:  # what the ALWAYS_OFF sampler decides, without asking it (or allocating)
            self.recording = False
            flags = random_flag
            trace_state = parent.trace_state if parent is not None else None
            self.attrs = _NO_ATTRS
        self.ctx = SpanContext(
            trace_id,
            tel._ids.generate_span_id(),
            is_remote=False,
            trace_flags=_FLAGS[flags] if flags < 4 else TraceFlags(flags),
            trace_state=trace_state,
        )
        self.name = name
        self.kind = kind
        self.parent = parent
        self.start_ns = start_ns

    def context(self) -> Context:
        """An OTel Context with this span current (for a child's sampler)."""
        return trace.set_span_in_context(NonRecordingSpan(self.ctx))

    def end(
        self,
        tel: Telemetry,
        end_ns: int,
        error: str | None = None,
        events: Sequence[Event] = (),
    ) -> None:
        if not self.recording:
            return
        sink = tel._sink
        if sink is not None:
            code = 0 if error is None else StatusCode.ERROR.value
            body = _span_message(
                self.ctx,
                self.parent,
                self.name,
                self.kind,
                self.start_ns,
                end_ns,
                self.attrs,
                events,
                code,
                error,
            )
            sink.add(_ld(b"\x12", body))
            return
        status = _UNSET if error is None else Status(StatusCode.ERROR, error)
        span = ReadableSpan(
            name=self.name,
            context=self.ctx,
            parent=self.parent,
            resource=tel._resource,
            attributes=self.attrs,
            events=tuple(events),
            kind=self.kind,
            status=status,
            start_time=self.start_ns,
            end_time=end_ns,
            instrumentation_scope=tel._scope,
        )
        for p in tel._processors:
            p.on_end(span)


class AttemptRecord:
    """One upstream attempt: a CLIENT span, child of the request's SERVER span."""

    __slots__ = ("backend", "ended", "record", "span")

    def __init__(self, record: RequestRecord, span: _SpanData, backend: str) -> None:
        self.record = record
        self.span = span
        self.backend = backend
        self.ended = False

    def inject_headers(self, headers: dict[str, str]) -> None:
        """Add this attempt's W3C traceparent (and tracestate) to the upstream request."""
        ctx = self.span.ctx
        # What TraceContextTextMapPropagator.inject writes for a valid span context.
        headers["traceparent"] = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
        if ctx.trace_state:
            headers["tracestate"] = ctx.trace_state.to_header()

    def fail(self, error_type: str, status: int | None = None) -> None:
        """The attempt failed (connect error, 5xx before the first byte...): end it as error."""
        if self.ended:
            return
        self.ended = True
        span = self.span
        tel = self.record.tel
        if span.recording:
            span.attrs["error.type"] = error_type
            if status is not None:
                span.attrs["http.response.status_code"] = status
            span.end(tel, time.time_ns(), error_type)
        with tel._lock:
            tel.c_errors.add((self.backend, error_type))


class _Labels:
    """Metric attribute sets (and their point keys) of one (operation, model, backend) series.

    Built once per series and cached, so recording a request's metrics allocates no dicts.
    """

    __slots__ = (
        "attrs",
        "b_attrs",
        "b_key",
        "errors",
        "hit_actual",
        "hit_predicted",
        "key",
        "tok_in",
        "tok_out",
    )

    def __init__(self, op: str, model: str, address: str, port: int, backend: str) -> None:
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": op,
            "gen_ai.provider.name": PROVIDER,
        }
        if model:
            attrs["gen_ai.request.model"] = model
        if address:
            attrs["server.address"] = address
            attrs["server.port"] = port
        key = (op, model, address, port)
        self.attrs, self.key = attrs, key
        self.tok_in = ({**attrs, "gen_ai.token.type": "input"}, (*key, "input"))
        self.tok_out = ({**attrs, "gen_ai.token.type": "output"}, (*key, "output"))
        b_attrs = {"warmroute.backend": backend, "gen_ai.request.model": model}
        self.b_attrs, self.b_key = b_attrs, (backend, model)
        self.hit_actual = (
            {**b_attrs, "warmroute.prefix.source": "actual"},
            (backend, model, "actual"),
        )
        self.hit_predicted = (
            {**b_attrs, "warmroute.prefix.source": "predicted"},
            (backend, model, "predicted"),
        )
        self.errors: dict[str, tuple[dict[str, Any], tuple[Any, ...]]] = {}

    def with_error(self, err: str) -> tuple[dict[str, Any], tuple[Any, ...]]:
        v = self.errors.get(err)
        if v is None:
            v = ({**self.attrs, "error.type": err}, (*self.key, err))
            if len(self.errors) < 256:  # error.type is low-cardinality; bound it anyway
                self.errors[err] = v
        return v


class RequestRecord:
    """Everything telemetry keeps about one request between start_request() and finish()."""

    __slots__ = (
        "anchor",
        "api",
        "attempts",
        "backend",
        "decision",
        "model",
        "name",
        "op",
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
        self.model = model
        self.stream = stream
        self.t0 = t0
        self.anchor = (time.time_ns(), time.perf_counter())
        self.op = op = OPERATION.get(api, api)
        self.attempts: list[AttemptRecord] = []
        self.backend: tuple[str, str, int] | None = None  # name, address, port
        self.decision: Decision | None = None
        lazy = tel._decide is not None  # attributes only once we know the span records
        attrs = self._request_attributes(request_id, params) if tel._tracing and not lazy else None
        parent_context = parent = None
        if "traceparent" in headers:
            parent_context = _propagator.extract(headers)
            ctx = trace.get_current_span(parent_context).get_span_context()
            parent = ctx if ctx.is_valid else None
        self.name = f"{op} {model}" if model else op
        self.span = _SpanData(
            tel,
            self.name,
            SpanKind.SERVER,
            parent,
            parent_context,
            attrs,
            _epoch_ns(t0, self.anchor),
        )
        if lazy and self.span.recording:
            self.span.attrs = self._request_attributes(request_id, params)

    def _base(self) -> dict[str, Any]:
        base: dict[str, Any] = {"gen_ai.operation.name": self.op, "gen_ai.provider.name": PROVIDER}
        if self.model:
            base["gen_ai.request.model"] = self.model
        return base

    def _request_attributes(self, request_id: str, params: Mapping[str, Any]) -> dict[str, Any]:
        attrs = self._base()
        attrs["gen_ai.request.stream"] = self.stream
        attrs["warmroute.request.id"] = request_id
        if self.api in API_TYPE:
            attrs["openai.api.type"] = API_TYPE[self.api]
        for key, name in _PARAMS:
            v = params.get(key)
            if isinstance(v, int | float) and not isinstance(v, bool) and name not in attrs:
                attrs[name] = v
        n = params.get("n")
        if isinstance(n, int) and n != 1:
            attrs["gen_ai.request.choice.count"] = n
        stop = params.get("stop")
        if isinstance(stop, str):
            attrs["gen_ai.request.stop_sequences"] = (stop,)
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            attrs["gen_ai.request.stop_sequences"] = tuple(stop)
        if self.tel.cfg.capture_content:
            for key in _CONTENT_KEYS:
                if key in params:
                    attrs[f"warmroute.request.{key}"] = orjson.dumps(params[key]).decode()
        return attrs

    def set_decision(self, decision: Decision) -> None:
        """Record the routing decision as warmroute.route.* attributes."""
        self.decision = decision
        if not self.span.recording:
            return
        winner = decision.winner
        attrs = self.span.attrs
        attrs["warmroute.route.policy"] = decision.policy
        attrs["warmroute.route.reason"] = decision.reason
        attrs["warmroute.route.decision_ms"] = round(decision.decision_s * 1000, 4)
        attrs["warmroute.route.candidates"] = tuple(decision.ranking[:16])
        attrs["warmroute.route.prefix_blocks"] = decision.prefix_blocks
        if decision.filtered_out:
            attrs["warmroute.route.filtered_out"] = tuple(
                f"{k}: {v}" for k, v in list(decision.filtered_out.items())[:16]
            )
        if winner is not None:
            attrs["warmroute.route.backend"] = winner
            if winner in decision.totals:
                attrs["warmroute.route.score"] = decision.totals[winner]
            for scorer, value in decision.scores.get(winner, {}).items():
                attrs[f"warmroute.route.score.{scorer}"] = value
            matched = decision.matched_blocks.get(winner, 0)
            attrs["warmroute.route.matched_blocks"] = matched
            block_chars: int = getattr(decision, "block_chars", 0)
            prompt_chars: int = getattr(decision, "prompt_chars", 0)
            if block_chars:
                attrs["warmroute.route.matched_chars"] = matched * block_chars
                if prompt_chars:
                    ratio = min(1.0, matched * block_chars / prompt_chars)
                    attrs["warmroute.prefix.predicted_hit_ratio"] = ratio

    def attempt(self, *, backend: str, address: str, port: int, attempt: int) -> AttemptRecord:
        """Open the CLIENT span of one upstream attempt (attempt numbers start at 1)."""
        tel = self.tel
        for prev in self.attempts:
            if not prev.ended:  # the caller moved on without fail(): it did fail
                prev.fail("_OTHER")
        attrs = None
        if self.span.recording:
            attrs = self._base()
            attrs["server.address"] = address
            attrs["server.port"] = port
            attrs["warmroute.backend"] = backend
            attrs["warmroute.attempt"] = attempt
        server = self.span
        span = _SpanData(
            tel,
            self.name,
            SpanKind.CLIENT,
            server.ctx,
            server.context() if tel._tracing and tel._decide is None else None,
            attrs,
            time.time_ns(),
        )
        rec = AttemptRecord(self, span, backend)
        self.attempts.append(rec)
        self.backend = (backend, address, port)
        if attempt > 1:
            with tel._lock:
                tel.c_retries.add((backend,))
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
        end_ns = _epoch_ns(now, self.anchor)
        span = self.span
        err = error_type or (facts.error if facts else None)
        if err is None and facts is not None and facts.cancelled:
            err = "cancelled"
        if err is None and status >= 400:
            err = str(status)
        name, address, port = self.backend or (backend or "", "", 0)
        if backend:
            name = backend
        tel = self.tel
        if span.recording:
            attrs = span.attrs
            attrs["http.response.status_code"] = status
            if name:
                attrs["warmroute.backend"] = name
            if address:
                attrs["server.address"] = address
                attrs["server.port"] = port
            if len(self.attempts) > 1:
                attrs["warmroute.route.retries"] = len(self.attempts) - 1
            if err is not None:
                attrs["error.type"] = err
            if facts is not None:
                self._fact_attributes(facts, attrs)
            else:
                if err is not None:
                    # No response reached the client: still findable by finish reason, like a
                    # broken stream.
                    attrs["gen_ai.response.finish_reasons"] = (
                        "cancelled" if err == "cancelled" else "error",
                    )
        for a in self.attempts:
            if not a.ended:  # the attempt that carried the response ends with it
                a.ended = True
                if err is not None and a.span.recording:
                    a.span.attrs["error.type"] = err
                a.span.end(tel, end_ns, err)
        if span.recording:
            events = self._events(facts) if facts is not None else ()
            span.end(tel, end_ns, err, events)
        self._record_metrics(facts, err, name, address, port, now)

    def _fact_attributes(self, f: StreamFacts, a: dict[str, Any]) -> None:
        a["gen_ai.response.finish_reasons"] = tuple(f.finish_reasons)
        if f.response_id is not None:
            a["gen_ai.response.id"] = f.response_id
        if f.response_model is not None:
            a["gen_ai.response.model"] = f.response_model
        if f.input_tokens is not None:
            a["gen_ai.usage.input_tokens"] = f.input_tokens
        if f.output_tokens is not None:
            a["gen_ai.usage.output_tokens"] = f.output_tokens
        if f.cached_tokens is not None:
            a["gen_ai.usage.cache_read.input_tokens"] = f.cached_tokens
            if f.input_tokens:
                a["warmroute.prefix.observed_hit_ratio"] = f.cached_tokens / f.input_tokens
        if f.ttft_s is not None:
            a["gen_ai.response.time_to_first_chunk"] = f.ttft_s
        if f.upstream_ttft_s is not None:
            a["warmroute.upstream.time_to_first_chunk"] = f.upstream_ttft_s
            if f.ttft_s is not None:
                a["warmroute.proxy.overhead_s"] = f.ttft_s - f.upstream_ttft_s
        if f.tpot_s is not None:
            a["warmroute.tpot_s"] = f.tpot_s
        if f.e2e_s is not None:
            a["warmroute.e2e_s"] = f.e2e_s
        if self.stream:
            a["warmroute.chunks"] = f.chunks
            a["warmroute.events"] = f.events
        if f.itl_s:
            s = sorted(f.itl_s)
            a["warmroute.itl.p50_s"] = _percentile(s, 0.5)
            a["warmroute.itl.p99_s"] = _percentile(s, 0.99)
            a["warmroute.itl.max_s"] = s[-1]
        if f.cancelled:
            a["warmroute.cancelled"] = True

    def _events(self, f: StreamFacts) -> list[Event]:
        """first_token and, per cfg.chunk_events, chunk events (capped: never one per chunk)."""
        mode = self.tel.cfg.chunk_events
        if mode == "off" or f.first_output_at is None:
            return []
        anchor = self.anchor
        out = [
            Event(
                "first_token",
                {"gen_ai.response.time_to_first_chunk": f.ttft_s or 0.0},
                _epoch_ns(f.first_output_at, anchor),
            )
        ]
        cap = self.tel.cfg.chunk_events_cap
        gaps = f.itl_s
        if mode == "first" or not gaps or cap <= 0:
            return out
        n = len(gaps)
        if mode == "all" or n <= cap:
            picks: Iterable[int] = range(min(n, cap))
        else:  # "sampled": evenly spread, always including the last chunk
            picks = sorted({round(i * (n - 1) / max(1, cap - 1)) for i in range(cap)})
        t = f.first_output_at
        done = 0
        for i in picks:
            while done <= i:  # advance the clock through the gaps up to chunk i+1
                t += gaps[done]
                done += 1
            out.append(
                Event(
                    "chunk",
                    {"warmroute.chunk.index": i + 1, "warmroute.chunk.gap_s": gaps[i]},
                    _epoch_ns(t, anchor),
                )
            )
        return out

    def _record_metrics(
        self,
        f: StreamFacts | None,
        err: str | None,
        backend: str,
        address: str,
        port: int,
        now: float,
    ) -> None:
        tel = self.tel
        model = self.model or ""
        series = (self.op, model, address, port, backend)
        lab = tel._labels.get(series)
        if lab is None:
            lab = _Labels(self.op, model, address, port, backend)
            if len(tel._labels) < 10_000:  # models and backends are few; bound it anyway
                tel._labels[series] = lab
        attrs, key = lab.attrs, lab.key
        ctx = self.span.ctx
        ex = (ctx.trace_id, ctx.span_id, time.time_ns()) if ctx.trace_flags.sampled else None
        d_attrs, d_key = (attrs, key) if err is None else lab.with_error(err)
        duration = f.e2e_s if f is not None and f.e2e_s is not None else now - self.t0
        with tel._lock:
            tel.h_duration.record1(duration, d_attrs, d_key, ex)
            if f is None:
                return
            if f.ttft_s is not None:
                tel.h_ttfc.record1(f.ttft_s, attrs, key, ex)
                if f.itl_s:
                    tel.h_tpoc.record(f.itl_s, attrs, key, ex)
                if f.upstream_ttft_s is not None:
                    tel.h_overhead.record1(f.ttft_s - f.upstream_ttft_s, attrs, key, ex)
                if err is None:
                    tel.h_ttft.record1(f.ttft_s, attrs, key, ex)
            if f.forward_s:
                tel.h_forward.record(f.forward_s, attrs, key, ex)
            if err is None and f.tpot_s is not None:
                tel.h_tpot.record1(f.tpot_s, attrs, key, ex)
            if f.input_tokens is not None:
                tel.h_tokens.record1(f.input_tokens, *lab.tok_in, ex)
            if f.output_tokens is not None:
                tel.h_tokens.record1(f.output_tokens, *lab.tok_out, ex)
            if f.cached_tokens is not None:
                tel.h_cached.record1(f.cached_tokens, lab.b_attrs, lab.b_key, ex)
                if f.input_tokens:
                    ratio = min(1.0, f.cached_tokens / f.input_tokens)
                    tel.h_hit.record1(ratio, *lab.hit_actual, ex)
            d = self.decision
            prompt_chars: int = getattr(d, "prompt_chars", 0)
            if d is not None and backend and prompt_chars:
                # predicted for the backend that served it (a retry may have moved it)
                block_chars: int = getattr(d, "block_chars", 0)
                ratio = min(1.0, d.matched_blocks.get(backend, 0) * block_chars / prompt_chars)
                tel.h_hit.record1(ratio, *lab.hit_predicted, ex)


class _DisabledAttempt(AttemptRecord):
    """What an attempt is when telemetry is off: nothing (no traceparent either)."""

    __slots__ = ()

    def __init__(self) -> None:
        self.ended = True

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

    def attempt(self, *, backend: str, address: str, port: int, attempt: int) -> AttemptRecord:
        return _DISABLED_ATTEMPT

    def finish(
        self,
        facts: StreamFacts | None,
        *,
        status: int,
        error_type: str | None = None,
        backend: str | None = None,
    ) -> None:
        pass


_DISABLED_ATTEMPT = _DisabledAttempt()
_DISABLED = _DisabledRecord()
