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
import re
import threading
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

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

from proxy import otlp
from proxy.config import TelemetryConfig
from proxy.meter import StreamFacts
from proxy.otlp import EncodedBatcher, http_span_exporter
from proxy.routing.types import Decision

SCOPE = "warmroute"
# How long the last export may take at shutdown (a collector that is down must not hold up a
# rolling restart: the SDK's exporters would retry for ~15 s between them).
SHUTDOWN_EXPORT_S = 3.0
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
    bounds: tuple[float, ...]
    counts: list[int]
    total: float = 0.0
    count: int = 0
    min: float = float("inf")
    max: float = float("-inf")
    # one exemplar per bucket, the latest: what Prometheus/Grafana show per bucket. Kept as
    # (value, (trace_id, span_id, time_ns)) and made into SDK Exemplars only when collected.
    exemplars: dict[int, tuple[float, tuple[int, int, int]]] = field(default_factory=dict)

    def add(self, v: float, exemplar: tuple[int, int, int] | None) -> None:
        """Add one value (routing decisions, errored durations; the rest arrive in batches)."""
        self.add_sorted((v,), v, exemplar)

    def add_sorted(self, s: Sequence[float], total: float, exemplar: Any) -> None:
        """Add the values of sorted s (their sum: total), e.g. one request's per-chunk gaps."""
        bounds, counts = self.bounds, self.counts
        low, top = s[0], s[-1]
        # OTel buckets are (lower, upper]: bisect_left puts v == bound in that bound's bucket.
        first, last = bisect_left(bounds, low), bisect_left(bounds, top)
        if first == last:  # the usual case: one request's gaps all fall in one bucket
            counts[first] += len(s)
        else:  # cut at the bounds between the smallest and the largest value only
            prev = 0
            for i in range(first, last):
                k = bisect_right(s, bounds[i], prev)
                counts[i] += k - prev
                prev = k
            counts[last] += len(s) - prev
        self.total += total
        self.count += len(s)
        if low < self.min:
            self.min = low
        if top > self.max:
            self.max = top
        if exemplar is not None:
            # One exemplar per request (its largest value): the sample worth clicking through.
            self.exemplars[last] = (top, exemplar)


class _Histogram:
    """A cumulative explicit-bucket histogram, keyed by an attribute tuple the caller builds."""

    __slots__ = ("bounds", "description", "name", "points", "unit")

    def __init__(self, name: str, unit: str, description: str, bounds: Sequence[float]) -> None:
        self.name = name
        self.unit = unit
        self.description = description
        self.bounds = tuple(bounds)
        self.points: dict[tuple[Any, ...], _Point] = {}

    def point(self, attrs: dict[str, Any], key: tuple[Any, ...]) -> _Point:
        p = self.points.get(key)
        if p is None:
            p = self.points[key] = _Point(attrs, self.bounds, [0] * (len(self.bounds) + 1))
        return p

    def record1(
        self,
        v: float,
        attrs: dict[str, Any],
        key: tuple[Any, ...],
        exemplar: tuple[int, int, int] | None,
    ) -> None:
        """Add one value."""
        self.point(attrs, key).add(v, exemplar)

    def record(
        self,
        values: Sequence[float],
        attrs: dict[str, Any],
        key: tuple[Any, ...],
        exemplar: tuple[int, int, int] | None,
    ) -> None:
        """Add values; exemplar = (trace_id, span_id, time_ns) of the request, if sampled."""
        if values:
            self.point(attrs, key).add_sorted(sorted(values), sum(values), exemplar)

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


# (metric, CacheEstimate.as_dict() field, unit, description): read at collection time.
CACHE_GAUGES = (
    (
        "warmroute.prefix.capacity",
        "capacity_blocks",
        "{block}",
        "Prefix-index blocks kept per backend: its cache as learned from reported cached_tokens.",
    ),
    (
        "warmroute.prefix.predicted_hit_ratio",
        "predicted_hit_ratio",
        "1",
        "Share of prompts the index predicted cached on each backend (moving average).",
    ),
    (
        "warmroute.prefix.reported_hit_ratio",
        "actual_hit_ratio",
        "1",
        "Share of prompts each backend's engine reported cached (moving average).",
    ),
    (
        "warmroute.prefix.agreement",
        "agreement",
        "1",
        "Share of responses where prediction and report agreed (moving average).",
    ),
)


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
        self._exporters: list[Any] = []  # OTLP exporters, to cut short at shutdown
        if not self.enabled:
            pass
        elif span_exporter is not None:
            processor = SimpleSpanProcessor(span_exporter)
        elif cfg.traces_exporter == "otlp":
            exporter = _otlp_span_exporter(cfg)
            self._exporters.append(exporter)
            if EncodedBatcher.can_use(exporter):
                processor = EncodedBatcher(exporter, resource, InstrumentationScope(SCOPE))
            else:  # gRPC, or an SDK whose HTTP exporter we do not know
                processor = BatchSpanProcessor(exporter)
        elif cfg.traces_exporter == "console":
            processor = BatchSpanProcessor(ConsoleSpanExporter())
        # Finished spans go straight to our processor (see _SpanData); the provider still owns
        # it so that shutdown() and force_flush() drain it.
        self._processors: tuple[SpanProcessor, ...] = () if processor is None else (processor,)
        # With the OTLP/HTTP exporter, a span is encoded when it ends and only its bytes wait
        # for the export thread: no ReadableSpan, no object graph kept alive for the GC to scan.
        self._sink = processor if isinstance(processor, EncodedBatcher) else None
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
            metric_exporter = _otlp_metric_exporter(cfg)
            self._exporters.append(metric_exporter)
            readers.append(PeriodicExportingMetricReader(metric_exporter))
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
        # this proxy's open requests per backend: the routing board's count, read when collected
        self._inflight: Callable[[], Mapping[str, int]] = dict
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
            [self._observe_inflight],
            unit="{request}",
            description="Requests this proxy has open on each backend.",
        )
        # per backend: the learned prefix cache and how well the index predicts it
        self._cache: Callable[[], Mapping[str, Mapping[str, Any]]] = dict
        for name, field_, unit, text in CACHE_GAUGES:
            meter.create_observable_gauge(
                name, [self._cache_gauge(field_)], unit=unit, description=text
            )
        self._routes: dict[tuple[str, str], tuple[tuple[str, str], _Point]] = {}
        self._labels: dict[tuple[Any, ...], _Labels] = {}
        self._pending: list[_Row] = []  # requests' one-value samples, until _fold()
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

    def _fold(self) -> None:
        """Fold the pending per-request samples into the histograms (the lock is held)."""
        rows = self._pending
        if rows:
            self._pending = []
            _fold_rows(rows)

    def _with_histograms(self, data: MetricsData | None) -> MetricsData | None:
        now = time.time_ns()
        with self._lock:
            self._fold()
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
        seen = self._routes.get((policy, reason))
        with self._lock:
            if seen is None:
                # Reasons may embed counts ("rotated among 3 ties"); keep the label set small.
                label = _DIGITS.sub("N", reason)[:80]
                point = self.h_decision.point({"warmroute.route.policy": policy}, (policy,))
                seen = ((policy, label), point)
                if len(self._routes) >= 1024:
                    self._routes.clear()
                self._routes[(policy, reason)] = seen
            self.c_decisions.add(seen[0])
            seen[1].add(decision_s, None)

    def read_inflight(self, source: Callable[[], Mapping[str, int]]) -> None:
        """Report `source()` (backend -> requests this proxy has open on it) as
        warmroute.backend.inflight: the count routing keeps anyway, not a second one."""
        self._inflight = source

    def read_cache(self, source: Callable[[], Mapping[str, Mapping[str, Any]]]) -> None:
        """Report `source()` (backend -> the capacity learner's estimate, as in
        /admin/routing) as the warmroute.prefix.* gauges in CACHE_GAUGES."""
        self._cache = source

    def _cache_gauge(self, field_: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            if not self.enabled:
                return
            for backend, est in dict(self._cache()).items():
                value = est.get(field_)
                if value is not None:
                    yield Observation(value, {"warmroute.backend": backend})

        return observe

    def _observe_inflight(self, _options: CallbackOptions) -> Iterable[Observation]:
        if not self.enabled:
            return
        # dict() copies in one C call: the event loop thread may be changing the counts
        for backend, n in dict(self._inflight()).items():
            yield Observation(n, {"warmroute.backend": backend})

    def shutdown(self, deadline_s: float = SHUTDOWN_EXPORT_S) -> None:
        """Flush and stop exporters; the Prometheus collector is unregistered.

        The last spans and metrics get `deadline_s` to reach the collector. The exporters
        retry with backoff on their own (~7 s each against a collector that is down, one after
        the other): past the deadline they are stopped, which ends their retries at once.
        """
        timer = threading.Timer(deadline_s, self._stop_exporters)
        timer.daemon = True
        timer.start()
        try:
            self.tracer_provider.shutdown()
            self.meter_provider.shutdown()
        finally:
            timer.cancel()

    def _stop_exporters(self) -> None:
        log.warning(
            "telemetry: the OTLP collector did not take the last export in time; dropping it "
            "(the SDK may then warn that its exporters are already shut down)"
        )
        for exporter in self._exporters:
            try:
                exporter.shutdown()
            except Exception:  # already stopped, or an SDK that objects: stopping is best effort
                log.debug("exporter shutdown failed", exc_info=True)


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
    return http_span_exporter(endpoint=_otlp_endpoint(cfg, "traces"))


def _otlp_metric_exporter(cfg: TelemetryConfig) -> Any:
    if cfg.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as G

        return G(endpoint=_otlp_endpoint(cfg, "metrics"))
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as H

    return H(endpoint=_otlp_endpoint(cfg, "metrics"))


Decide = Callable[[otlp.Parent | None, int], tuple[bool, Any]]


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

        def static(parent: otlp.Parent | None, trace_id: int) -> tuple[bool, Any]:
            return on, None if parent is None else parent.trace_state

        return static
    if isinstance(sampler, _sampling.TraceIdRatioBased):
        bound, mask = sampler.bound, sampler.TRACE_ID_LIMIT

        def ratio(parent: otlp.Parent | None, trace_id: int) -> tuple[bool, Any]:
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

        def parent_based(parent: otlp.Parent | None, trace_id: int) -> tuple[bool, Any]:
            if parent is None:
                return root(None, trace_id)  # type: ignore[misc]
            if parent.is_remote:
                d = remote_on if parent.trace_flags.sampled else remote_off
            else:
                d = local_on if parent.trace_flags.sampled else local_off
            return d(parent, trace_id)  # type: ignore[misc]

        return parent_based
    return None


_FLAGS = [TraceFlags(f) for f in range(4)]  # sampled x random-trace-id: built once
_NO_ATTRS: dict[str, Any] = {}  # a non-recording span's (never written: writers check recording)


class _SpanData:
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
        tel: Telemetry,
        name: str,
        kind: SpanKind,
        parent: otlp.Parent | None,
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
        self.trace_id = trace_id
        self.span_id = tel._ids.generate_span_id()
        self.flags = flags
        self.trace_state = trace_state
        self._ctx: SpanContext | None = None
        self.enc: list[bytes] | None = None
        self.name = name
        self.kind = kind
        self.parent = parent
        self.start_ns = start_ns

    @classmethod
    def untraced_child(cls, tel: Telemetry, parent: _SpanData, kind: SpanKind) -> _SpanData:
        """A child span when nothing is traced: ids and flags to propagate, nothing else."""
        span = cls.__new__(cls)
        span.trace_id = parent.trace_id
        span.span_id = tel._ids.generate_span_id()
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
        tel: Telemetry,
        end_ns: int,
        error: str | None = None,
        events: bytes | Sequence[Event] = (),
    ) -> None:
        """Hand the span on; `events` are Span.events fields (bytes) for an encoded span."""
        if not self.recording:
            return
        enc, sink = self.enc, tel._sink
        if enc is not None and sink is not None:
            body = otlp.span_message(
                self.trace_id,
                self.span_id,
                self.trace_state,
                self.parent,
                otlp.name_field(self.name),
                self.kind,
                self.start_ns,
                end_ns,
                b"".join(enc),
                events if type(events) is bytes else otlp.events_bytes(events),  # type: ignore[arg-type]
                0 if error is None else StatusCode.ERROR.value,
                error,
            )
            sink.add(otlp.ld(b"\x12", body))
            return
        status = _UNSET if error is None else Status(StatusCode.ERROR, error)
        parent = self.parent
        if isinstance(parent, _SpanData):
            parent = parent.ctx
        span = ReadableSpan(
            name=self.name,
            context=self.ctx,
            parent=cast("SpanContext | None", parent),
            resource=tel._resource,
            attributes=self.attrs,
            events=tuple(events),  # type: ignore[arg-type]
            kind=self.kind,
            status=status,
            start_time=self.start_ns,
            end_time=end_ns,
            instrumentation_scope=tel._scope,
        )
        for p in tel._processors:
            p.on_end(span)


# Span attributes written straight into protobuf (see _SpanData.enc): one AttrKey per key.
_K = {
    name: otlp.AttrKey(name)
    for name in (
        "error.type",
        "gen_ai.request.choice.count",
        "gen_ai.request.stop_sequences",
        "gen_ai.response.finish_reasons",
        "gen_ai.response.id",
        "gen_ai.response.model",
        "gen_ai.response.time_to_first_chunk",
        "gen_ai.usage.cache_read.input_tokens",
        "gen_ai.usage.input_tokens",
        "gen_ai.usage.output_tokens",
        "http.response.status_code",
        "openai.api.type",
        "warmroute.attempt",
        "warmroute.backend",
        "warmroute.cancelled",
        "warmroute.chunks",
        "warmroute.e2e_s",
        "warmroute.events",
        "warmroute.itl.max_s",
        "warmroute.itl.p50_s",
        "warmroute.itl.p99_s",
        "warmroute.prefix.observed_hit_ratio",
        "warmroute.prefix.predicted_hit_ratio",
        "warmroute.proxy.overhead_s",
        "warmroute.request.id",
        "warmroute.route.backend",
        "warmroute.route.candidates",
        "warmroute.route.decision_ms",
        "warmroute.route.filtered_out",
        "warmroute.route.matched_blocks",
        "warmroute.route.matched_chars",
        "warmroute.route.prefix_blocks",
        "warmroute.route.retries",
        "warmroute.route.score",
        "warmroute.tpot_s",
        "warmroute.upstream.time_to_first_chunk",
        *{name for _, name in _PARAMS},
        *(f"warmroute.request.{key}" for key in _CONTENT_KEYS),
    )
}
_REQUEST_ID = _K["warmroute.request.id"]
_DECISION_MS = _K["warmroute.route.decision_ms"]
_F_DECISION_MS = _DECISION_MS.fprefix
_PREFIX_BLOCKS = _K["warmroute.route.prefix_blocks"]
_ROUTE_BACKEND = _K["warmroute.route.backend"]
_MATCHED_BLOCKS = _K["warmroute.route.matched_blocks"]
_MATCHED_CHARS = _K["warmroute.route.matched_chars"]
_RESPONSE_ID = _K["gen_ai.response.id"]
_IN_TOKENS = _K["gen_ai.usage.input_tokens"]
_OUT_TOKENS = _K["gen_ai.usage.output_tokens"]
_CACHED_TOKENS = _K["gen_ai.usage.cache_read.input_tokens"]
_CHUNKS = _K["warmroute.chunks"]
_EVENTS = _K["warmroute.events"]
# Timings and ratios are always written as doubles (the dict path converts with float()), so
# their fields are a key prefix plus 8 packed bytes, whatever number type the facts hold.
_F_OBSERVED_HIT = _K["warmroute.prefix.observed_hit_ratio"].fprefix
_F_TTFC = _K["gen_ai.response.time_to_first_chunk"].fprefix
_F_UPSTREAM_TTFC = _K["warmroute.upstream.time_to_first_chunk"].fprefix
_F_OVERHEAD = _K["warmroute.proxy.overhead_s"].fprefix
_F_TPOT = _K["warmroute.tpot_s"].fprefix
_F_E2E = _K["warmroute.e2e_s"].fprefix
_F_ITL_P50 = _K["warmroute.itl.p50_s"].fprefix
_F_ITL_P99 = _K["warmroute.itl.p99_s"].fprefix
_F_ITL_MAX = _K["warmroute.itl.max_s"].fprefix
_pack_d = otlp.pack_d


_TTFC_EVENT_KEY = otlp.AttrKey("gen_ai.response.time_to_first_chunk", b"\x1a")
_FIRST_TOKEN = otlp.ld(b"\x12", b"first_token")  # Event.name
_NO_RESPONSE_REASONS = {
    r: _K["gen_ai.response.finish_reasons"].new((r,)) for r in ("cancelled", "error")
}


def _bounded(cache: dict[Any, bytes], key: Any, value: bytes) -> bytes:
    if len(cache) >= 1024:
        cache.clear()
    cache[key] = value
    return value


def _strings_field(cache: dict[Any, bytes], k: otlp.AttrKey, values: tuple[Any, ...]) -> bytes:
    """The field of a tuple attribute, cached by value when every item is a str."""
    b = cache.get(values)
    if b is None:
        b = k.new(values)
        if all(type(x) is str for x in values):  # (1,) == (True,): only str tuples are cached
            _bounded(cache, values, b)
    return b


class _Encoded:
    """Caches of encoded attribute groups whose values repeat across requests."""

    heads: dict[tuple[Any, ...], bytes] = {}  # operation, provider, model, stream
    routes: dict[tuple[Any, ...], bytes] = {}  # policy, reason
    candidates: dict[tuple[Any, ...], bytes] = {}
    reasons: dict[tuple[Any, ...], bytes] = {}  # finish reasons
    servers: dict[tuple[Any, ...], bytes] = {}  # server.address, server.port
    attempts: dict[tuple[Any, ...], bytes] = {}  # a CLIENT span's attributes at start
    scores: dict[str, otlp.AttrKey] = {}


class AttemptRecord:
    """One upstream attempt: a CLIENT span, child of the request's SERVER span."""

    __slots__ = ("backend", "ended", "span", "tel")

    def __init__(self, tel: Telemetry, span: _SpanData, backend: str) -> None:
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
        # What TraceContextTextMapPropagator.inject writes for a valid span context.
        headers["traceparent"] = f"00-{span.trace_id:032x}-{span.span_id:016x}-{span.flags:02x}"
        if span.trace_state:
            headers["tracestate"] = span.trace_state.to_header()

    def fail(self, error_type: str, status: int | None = None) -> None:
        """The attempt failed (connect error, 5xx before the first byte...): end it as error."""
        if self.ended:
            return
        self.ended = True
        span = self.span
        tel = self.tel
        if span.recording:
            if span.enc is not None:
                span.enc.append(_K["error.type"].any(error_type))
                if status is not None:
                    span.enc.append(_K["http.response.status_code"].any(status))
                span.end(tel, time.time_ns(), error_type, b"")
            else:
                span.attrs["error.type"] = error_type
                if status is not None:
                    span.attrs["http.response.status_code"] = status
                span.end(tel, time.time_ns(), error_type)
        with tel._lock:
            tel.c_errors.add((self.backend, error_type))


# The histogram points a series records into, by index in _Labels.points.
(_DURATION, _TTFC, _TPOC, _OVERHEAD, _TTFT, _FORWARD, _TPOT) = range(7)
(_TOK_IN, _TOK_OUT, _CACHED, _HIT_ACTUAL, _HIT_PREDICTED) = range(7, 12)


class _Labels:
    """Metric attribute sets (and their points) of one (operation, model, backend) series.

    Built once per series and cached, so recording a request's metrics allocates no dicts and
    looks up no keys: each histogram's point of the series is kept here once it exists.
    """

    __slots__ = ("attrs", "errors", "key", "points", "specs")

    def __init__(
        self, tel: Telemetry, op: str, model: str, address: str, port: int, backend: str
    ) -> None:
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
        b_attrs = {"warmroute.backend": backend, "gen_ai.request.model": model}
        b_key = (backend, model)
        series = (attrs, key)
        # (histogram, attributes, point key) per index; points made on first use, so that a
        # series shows only what it recorded
        self.specs: tuple[tuple[_Histogram, dict[str, Any], tuple[Any, ...]], ...] = (
            (tel.h_duration, *series),
            (tel.h_ttfc, *series),
            (tel.h_tpoc, *series),
            (tel.h_overhead, *series),
            (tel.h_ttft, *series),
            (tel.h_forward, *series),
            (tel.h_tpot, *series),
            (tel.h_tokens, {**attrs, "gen_ai.token.type": "input"}, (*key, "input")),
            (tel.h_tokens, {**attrs, "gen_ai.token.type": "output"}, (*key, "output")),
            (tel.h_cached, b_attrs, b_key),
            (
                tel.h_hit,
                {**b_attrs, "warmroute.prefix.source": "actual"},
                (backend, model, "actual"),
            ),
            (
                tel.h_hit,
                {**b_attrs, "warmroute.prefix.source": "predicted"},
                (backend, model, "predicted"),
            ),
        )
        self.points: list[_Point | None] = [None] * len(self.specs)
        self.errors: dict[str, _Point] = {}

    def point(self, i: int) -> _Point:
        p = self.points[i]
        if p is None:
            h, attrs, key = self.specs[i]
            p = self.points[i] = h.point(attrs, key)
        return p

    def duration_with_error(self, err: str) -> _Point:
        p = self.errors.get(err)
        if p is None:
            h = self.specs[_DURATION][0]
            p = h.point({**self.attrs, "error.type": err}, (*self.key, err))
            if len(self.errors) < 256:  # error.type is low-cardinality; bound it anyway
                self.errors[err] = p
        return p


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
        self.model = model
        self.stream = stream
        self.t0 = t0
        self.anchor = (time.time_ns(), time.perf_counter())
        self.op = op = OPERATION.get(api, api)
        self.attempts: list[AttemptRecord] = []
        self.backend: tuple[str, str, int] | None = None  # name, address, port
        self.decision: Decision | None = None
        # (request id, params) of an encoded span: its request and decision attributes are
        # written when it ends, off the way to the first byte
        self.request: tuple[str, Mapping[str, Any]] | None = None
        lazy = tel._decide is not None  # attributes only once we know the span records
        attrs = self._request_attributes(request_id, params) if tel._tracing and not lazy else None
        parent_context = parent = None
        if "traceparent" in headers:
            parent_context = _propagator.extract(headers)
            ctx = trace.get_current_span(parent_context).get_span_context()
            parent = ctx if ctx.is_valid else None
        self.name = f"{op} {model}" if model else op
        self.span = span = _SpanData(
            tel,
            self.name,
            SpanKind.SERVER,
            parent,
            parent_context,
            attrs,
            _epoch_ns(t0, self.anchor),
        )
        if span.recording:
            if tel._sink is None:
                if lazy:
                    span.attrs = self._request_attributes(request_id, params)
            elif lazy:
                span.enc = []
                self.request = (request_id, params)
            else:  # a plugin sampler saw (and may have added to) the attributes
                span.enc = [otlp.attributes(otlp.ATTR, span.attrs)]

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

    def _request_fields(self, request_id: str, params: Mapping[str, Any]) -> bytes:
        """_request_attributes(), encoded (tests/test_telemetry_encoding.py: the same bytes)."""
        try:
            # cached only for exact types: True == 1 and hash alike but encode differently
            exact = type(self.stream) is bool and (self.model is None or type(self.model) is str)
            hk = (self.op, self.model, self.stream)
            head = _Encoded.heads.get(hk) if exact else None
            if head is None:
                attrs = self._base()
                attrs["gen_ai.request.stream"] = self.stream
                head = otlp.attributes(otlp.ATTR, attrs)
                if exact:
                    _bounded(_Encoded.heads, hk, head)
            out = [head, _REQUEST_ID.unique(request_id)]
            if self.api in API_TYPE:
                out.append(_K["openai.api.type"].s(API_TYPE[self.api]))
            done = None
            for key, name in _PARAMS:
                v = params.get(key)
                if v is None:  # most are absent
                    continue
                if isinstance(v, int | float) and not isinstance(v, bool) and name != done:
                    out.append(_K[name].any(v))
                    done = name  # max_tokens and its aliases are adjacent in _PARAMS
            n = params.get("n")
            if isinstance(n, int) and n != 1:
                out.append(_K["gen_ai.request.choice.count"].any(n))
            stop = params.get("stop")
            if isinstance(stop, str):
                out.append(_K["gen_ai.request.stop_sequences"].new((stop,)))
            elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
                out.append(_K["gen_ai.request.stop_sequences"].new(tuple(stop)))
            if self.tel.cfg.capture_content:
                for key in _CONTENT_KEYS:
                    if key in params:
                        value = orjson.dumps(params[key]).decode()
                        out.append(_K[f"warmroute.request.{key}"].new(value))
            return b"".join(out)
        except (TypeError, ValueError, UnicodeError):  # what the dict path leaves out, logged
            return otlp.attributes(otlp.ATTR, self._request_attributes(request_id, params))

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
                span.enc.append(_decision_fields(decision))
        else:
            span.attrs.update(_decision_attributes(decision))

    def attempt(self, *, backend: str, address: str, port: int, attempt: int) -> AttemptRecord:
        """Open the CLIENT span of one upstream attempt (attempt numbers start at 1)."""
        tel = self.tel
        for prev in self.attempts:
            if not prev.ended:  # the caller moved on without fail(): it did fail
                prev.fail("_OTHER")
        server = self.span
        if not tel._tracing:
            span = _SpanData.untraced_child(tel, server, SpanKind.CLIENT)
        else:
            # Encoded spans take their start attributes from a per-series cache; only a
            # sampler plugin (tel._decide is None) may read them as a dict.
            direct = tel._sink is not None and tel._decide is not None
            attrs = None
            if server.recording and not direct:
                attrs = self._attempt_attributes(backend, address, port, attempt)
            # The SDK's samplers (compiled) read only the parent's flags, state and
            # remoteness, which the server span answers itself: no SpanContext to build.
            span = _SpanData(
                tel,
                self.name,
                SpanKind.CLIENT,
                server if tel._decide is not None else server.ctx,
                server.context() if tel._decide is None else None,
                attrs,
                time.time_ns(),
            )
            if span.recording and tel._sink is not None:
                key = (self.op, self.model, address, port, backend, attempt)
                exact = type(port) is int and type(attempt) is int
                b = _Encoded.attempts.get(key) if exact else None
                if b is None:
                    if direct:
                        span.attrs = self._attempt_attributes(backend, address, port, attempt)
                    b = otlp.attributes(otlp.ATTR, span.attrs)
                    if exact and all(type(x) is str for x in (self.model or "", address, backend)):
                        _bounded(_Encoded.attempts, key, b)
                span.enc = [b]
        rec = AttemptRecord(tel, span, backend)
        self.attempts.append(rec)
        self.backend = (backend, address, port)
        if attempt > 1:
            with tel._lock:
                tel.c_retries.add((backend,))
        return rec

    def _attempt_attributes(
        self, backend: str, address: str, port: int, attempt: int
    ) -> dict[str, Any]:
        attrs = self._base()
        attrs["server.address"] = address
        attrs["server.port"] = port
        attrs["warmroute.backend"] = backend
        attrs["warmroute.attempt"] = attempt
        return attrs

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
        itl = sorted(facts.itl_s) if facts is not None and facts.itl_s else None
        for a in self.attempts:
            if not a.ended:  # the attempt that carried the response ends with it
                a.ended = True
                s = a.span
                if err is not None and s.recording:
                    if s.enc is not None:
                        s.enc.append(_K["error.type"].any(err))
                    else:
                        s.attrs["error.type"] = err
                s.end(tel, end_ns, err, b"" if s.enc is not None else ())
        if span.recording:
            if span.enc is not None:
                if self.request is not None:
                    span.enc.append(self._request_fields(*self.request))
                    if self.decision is not None:
                        span.enc.append(_decision_fields(self.decision))
                span.enc.append(self._finish_fields(facts, status, err, name, address, port, itl))
                events: bytes | list[Event] = b""
                if facts is not None:
                    events = self._event_fields(facts)
            else:
                span.attrs.update(
                    self._finish_attributes(facts, status, err, name, address, port, itl)
                )
                events = self._events(facts) if facts is not None else []
            span.end(tel, end_ns, err, events)
        self._record_metrics(facts, err, name, address, port, now, itl)

    def _finish_attributes(
        self,
        facts: StreamFacts | None,
        status: int,
        err: str | None,
        name: str,
        address: str,
        port: int,
        itl: list[float] | None,
    ) -> dict[str, Any]:
        attrs: dict[str, Any] = {"http.response.status_code": status}
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
            _fact_attributes(facts, self.stream, itl, attrs)
        elif err is not None:
            # No response reached the client: still findable by finish reason, like a broken
            # stream.
            attrs["gen_ai.response.finish_reasons"] = (
                "cancelled" if err == "cancelled" else "error",
            )
        return attrs

    def _finish_fields(
        self,
        f: StreamFacts | None,
        status: int,
        err: str | None,
        name: str,
        address: str,
        port: int,
        itl: list[float] | None,
    ) -> bytes:
        """_finish_attributes(), encoded (tests/test_telemetry_encoding.py: the same bytes)."""
        try:
            out = [_K["http.response.status_code"].any(status)]
            if name:
                out.append(_K["warmroute.backend"].any(name))
            if address:
                sk = (address, port)
                exact = type(port) is int and type(address) is str
                b = _Encoded.servers.get(sk) if exact else None
                if b is None:
                    b = otlp.attributes(otlp.ATTR, {"server.address": address, "server.port": port})
                    if exact:
                        _bounded(_Encoded.servers, sk, b)
                out.append(b)
            if len(self.attempts) > 1:
                out.append(_K["warmroute.route.retries"].i(len(self.attempts) - 1))
            if err is not None:
                out.append(_K["error.type"].any(err))
            if f is None:
                if err is not None:
                    out.append(_NO_RESPONSE_REASONS["cancelled" if err == "cancelled" else "error"])
                return b"".join(out)
            # Inlined (no AttrKey.any() per field): a timing is its key's prefix plus 8 packed
            # bytes, a count a cached field.
            k = _K
            out.append(
                _strings_field(
                    _Encoded.reasons, k["gen_ai.response.finish_reasons"], tuple(f.finish_reasons)
                )
            )
            if f.response_id is not None:
                rid = f.response_id
                out.append(_RESPONSE_ID.unique(rid) if type(rid) is str else _RESPONSE_ID.any(rid))
            if f.response_model is not None:
                out.append(k["gen_ai.response.model"].any(f.response_model))
            fin, fout, cached = f.input_tokens, f.output_tokens, f.cached_tokens
            if fin is not None:
                out.append(_IN_TOKENS.ints.get(fin) or _IN_TOKENS.any(fin))
            if fout is not None:
                out.append(_OUT_TOKENS.ints.get(fout) or _OUT_TOKENS.any(fout))
            if cached is not None:
                out.append(_CACHED_TOKENS.ints.get(cached) or _CACHED_TOKENS.any(cached))
                if fin:
                    out.append(_F_OBSERVED_HIT + _pack_d(cached / fin))
            ttft, up = f.ttft_s, f.upstream_ttft_s
            if ttft is not None:
                out.append(_F_TTFC + _pack_d(ttft))
            if up is not None:
                out.append(_F_UPSTREAM_TTFC + _pack_d(up))
                if ttft is not None:
                    out.append(_F_OVERHEAD + _pack_d(ttft - up))
            if f.tpot_s is not None:
                out.append(_F_TPOT + _pack_d(f.tpot_s))
            if f.e2e_s is not None:
                out.append(_F_E2E + _pack_d(f.e2e_s))
            if self.stream:
                out.append(_CHUNKS.ints.get(f.chunks) or _CHUNKS.any(f.chunks))
                out.append(_EVENTS.ints.get(f.events) or _EVENTS.any(f.events))
            if itl:
                out.append(_F_ITL_P50 + _pack_d(_percentile(itl, 0.5)))
                out.append(_F_ITL_P99 + _pack_d(_percentile(itl, 0.99)))
                out.append(_F_ITL_MAX + _pack_d(itl[-1]))
            if f.cancelled:
                out.append(k["warmroute.cancelled"].new(True))
            return b"".join(out)
        except (TypeError, ValueError, UnicodeError):  # what the dict path leaves out, logged
            attrs = self._finish_attributes(f, status, err, name, address, port, itl)
            return otlp.attributes(otlp.ATTR, attrs)

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

    def _event_fields(self, f: StreamFacts) -> bytes:
        """_events(), encoded: the default ("first") without building Event objects."""
        if self.tel.cfg.chunk_events != "first" or f.first_output_at is None:
            return otlp.events_bytes(self._events(f))
        ttft = f.ttft_s or 0.0
        if type(ttft) is not float:
            return otlp.events_bytes(self._events(f))
        t = _epoch_ns(f.first_output_at, self.anchor)
        body = b"\x09" + otlp.pack_q(t) + _FIRST_TOKEN + _TTFC_EVENT_KEY.f(ttft)
        return otlp.ld(b"\x5a", body)

    def _record_metrics(
        self,
        f: StreamFacts | None,
        err: str | None,
        backend: str,
        address: str,
        port: int,
        now: float,
        itl: list[float] | None,
    ) -> None:
        tel = self.tel
        model = self.model or ""
        series = (self.op, model, address, port, backend)
        lab = tel._labels.get(series)
        if lab is None:
            with tel._lock:
                lab = _Labels(tel, self.op, model, address, port, backend)
            if len(tel._labels) < 10_000:  # models and backends are few; bound it anyway
                tel._labels[series] = lab
        span = self.span
        ex = (span.trace_id, span.span_id, time.time_ns()) if span.flags & 1 else None
        duration = f.e2e_s if f is not None and f.e2e_s is not None else now - self.t0
        ok = err is None
        if f is None:
            row: _Row = (lab, ex, duration if ok else None, *_NO_FACTS)
        else:
            ttft, up, fin, cached = f.ttft_s, f.upstream_ttft_s, f.input_tokens, f.cached_tokens
            predicted = None
            d = self.decision
            prompt_chars: int = getattr(d, "prompt_chars", 0)
            if d is not None and backend and prompt_chars:
                # predicted for the backend that served it (a retry may have moved it)
                block_chars: int = getattr(d, "block_chars", 0)
                predicted = min(1.0, d.matched_blocks.get(backend, 0) * block_chars / prompt_chars)
            row = (
                lab,
                ex,
                duration if ok else None,
                ttft,
                ttft - up if ttft is not None and up is not None else None,
                ttft if ok else None,
                f.tpot_s if ok else None,
                fin,
                f.output_tokens,
                cached,
                min(1.0, cached / fin) if cached is not None and fin else None,
                predicted,
            )
        point = lab.point
        with tel._lock:
            if not ok:
                lab.duration_with_error(err).add(duration, ex)  # type: ignore[arg-type]
            if f is not None:
                # a request's per-chunk samples go in at once (sorted, cut at the bounds)
                if itl and f.ttft_s is not None:
                    point(_TPOC).add_sorted(itl, sum(itl), ex)
                if f.forward_s:
                    point(_FORWARD).add_sorted(sorted(f.forward_s), sum(f.forward_s), ex)
            pending = tel._pending
            pending.append(row)
            if len(pending) >= _FOLD_EVERY:
                tel._fold()


# A finished request's one-value samples, waiting to be folded into the histograms:
# (series labels, exemplar, then one value or None per histogram point in _ROW_POINTS).
_Row = tuple[Any, ...]
_ROW_POINTS: tuple[int, ...] = (_DURATION, _TTFC, _OVERHEAD, _TTFT, _TPOT, _TOK_IN, _TOK_OUT)
_ROW_POINTS += (_CACHED, _HIT_ACTUAL, _HIT_PREDICTED)
_ROW_COLUMNS = tuple(enumerate(_ROW_POINTS, start=2))
_NO_FACTS = (None,) * (len(_ROW_POINTS) - 1)
# Folded this often, and before every collection (scrape, export): a batch is added per point
# with one sort, where one add per value cost ~27k instructions a request.
_FOLD_EVERY = 256


def _fold_rows(rows: list[_Row]) -> None:
    """Add the rows' samples to their series' points: one batch per point, then the
    exemplars (per bucket, the latest sampled request's value, as single adds keep them)."""
    groups: dict[_Labels, list[_Row]] = {}
    for r in rows:
        g = groups.get(r[0])
        if g is None:
            groups[r[0]] = [r]
        else:
            g.append(r)
    for lab, g in groups.items():
        for col, i in _ROW_COLUMNS:
            values = [v for r in g if (v := r[col]) is not None]
            if values:
                values.sort()
                lab.point(i).add_sorted(values, sum(values), None)
        for r in g:
            ex = r[1]
            if ex is None:
                continue
            for col, i in _ROW_COLUMNS:
                v = r[col]
                if v is not None:
                    p = lab.point(i)
                    p.exemplars[bisect_left(p.bounds, v)] = (v, ex)


def _fact_attributes(
    f: StreamFacts, stream: bool, itl: list[float] | None, a: dict[str, Any]
) -> None:
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
            a["warmroute.prefix.observed_hit_ratio"] = float(f.cached_tokens / f.input_tokens)
    if f.ttft_s is not None:
        a["gen_ai.response.time_to_first_chunk"] = float(f.ttft_s)
    if f.upstream_ttft_s is not None:
        a["warmroute.upstream.time_to_first_chunk"] = float(f.upstream_ttft_s)
        if f.ttft_s is not None:
            a["warmroute.proxy.overhead_s"] = float(f.ttft_s - f.upstream_ttft_s)
    if f.tpot_s is not None:
        a["warmroute.tpot_s"] = float(f.tpot_s)
    if f.e2e_s is not None:
        a["warmroute.e2e_s"] = float(f.e2e_s)
    if stream:
        a["warmroute.chunks"] = f.chunks
        a["warmroute.events"] = f.events
    if itl:  # sorted
        a["warmroute.itl.p50_s"] = float(_percentile(itl, 0.5))
        a["warmroute.itl.p99_s"] = float(_percentile(itl, 0.99))
        a["warmroute.itl.max_s"] = float(itl[-1])
    if f.cancelled:
        a["warmroute.cancelled"] = True


def _decision_attributes(decision: Decision) -> dict[str, Any]:
    """The routing decision as warmroute.route.* span attributes."""
    winner = decision.winner
    attrs: dict[str, Any] = {
        "warmroute.route.policy": decision.policy,
        "warmroute.route.reason": decision.reason,
        "warmroute.route.decision_ms": round(decision.decision_s * 1000, 4),
        "warmroute.route.candidates": tuple(decision.ranking[:16]),
        "warmroute.route.prefix_blocks": decision.prefix_blocks,
    }
    if decision.filtered_out:
        attrs["warmroute.route.filtered_out"] = tuple(
            f"{k}: {v}" for k, v in list(decision.filtered_out.items())[:16]
        )
    if winner is not None:
        attrs["warmroute.route.backend"] = winner
        if decision.scored():
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
    return attrs


def _decision_fields(decision: Decision) -> bytes:
    """_decision_attributes(), encoded (tests/test_telemetry_encoding.py: the same bytes)."""
    try:
        k = _K
        rk = (decision.policy, decision.reason)
        exact = type(rk[0]) is str and type(rk[1]) is str
        head = _Encoded.routes.get(rk) if exact else None
        if head is None:
            attrs = {"warmroute.route.policy": rk[0], "warmroute.route.reason": rk[1]}
            head = otlp.attributes(otlp.ATTR, attrs)
            if exact:
                _bounded(_Encoded.routes, rk, head)
        candidates = tuple(decision.ranking[:16])
        ms = round(decision.decision_s * 1000, 4)
        pb = decision.prefix_blocks
        out = [
            head,
            _F_DECISION_MS + _pack_d(ms) if type(ms) is float else _DECISION_MS.any(ms),
            _strings_field(_Encoded.candidates, k["warmroute.route.candidates"], candidates),
            _PREFIX_BLOCKS.ints.get(pb) or _PREFIX_BLOCKS.any(pb),
        ]
        if decision.filtered_out:
            out.append(
                k["warmroute.route.filtered_out"].new(
                    tuple(f"{k}: {v}" for k, v in list(decision.filtered_out.items())[:16])
                )
            )
        winner = decision.winner
        if winner is not None:
            out.append(_ROUTE_BACKEND.strs.get(winner) or _ROUTE_BACKEND.any(winner))
            if decision.scored():
                if winner in decision.totals:
                    out.append(k["warmroute.route.score"].any(decision.totals[winner]))
                scores = _Encoded.scores
                for scorer, value in decision.scores.get(winner, {}).items():
                    sk = scores.get(scorer)
                    if sk is None:
                        sk = otlp.AttrKey(f"warmroute.route.score.{scorer}")
                        if len(scores) < 256:
                            scores[scorer] = sk
                    out.append(sk.any(value))
            matched = decision.matched_blocks.get(winner, 0)
            out.append(_MATCHED_BLOCKS.ints.get(matched) or _MATCHED_BLOCKS.any(matched))
            block_chars: int = getattr(decision, "block_chars", 0)
            prompt_chars: int = getattr(decision, "prompt_chars", 0)
            if block_chars:
                chars = matched * block_chars
                out.append(_MATCHED_CHARS.ints.get(chars) or _MATCHED_CHARS.any(chars))
                if prompt_chars:
                    ratio = min(1.0, chars / prompt_chars)
                    out.append(k["warmroute.prefix.predicted_hit_ratio"].any(ratio))
        return b"".join(out)
    except (TypeError, ValueError, UnicodeError):  # what the dict path leaves out, logged
        return otlp.attributes(otlp.ATTR, _decision_attributes(decision))


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
