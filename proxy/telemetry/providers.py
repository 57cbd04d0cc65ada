"""Telemetry: the tracer and meter providers, their exporters, and /metrics.

No process globals: the app owns one Telemetry, and its lifespan shuts it down.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider, TraceBasedExemplarFilter
from opentelemetry.sdk.metrics.export import (
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from proxy import otel_env
from proxy.config import ConfigError, TelemetryConfig
from proxy.telemetry import sdk_bridge
from proxy.telemetry.batcher import EncodedBatcher
from proxy.telemetry.export_health import ExportHealths
from proxy.telemetry.histograms import Counts
from proxy.telemetry.metrics import RequestMetrics
from proxy.telemetry.record import DISABLED, RequestRecord
from proxy.telemetry.spans import Spans
from proxy.telemetry.transport import http_span_exporter

SCOPE = "warmroute"
# How long the last export may take at shutdown (a collector that is down must not hold up a
# rolling restart: the SDK's exporters would retry for ~15 s between them).
SHUTDOWN_EXPORT_S = 3.0
OTHER = "other"  # the metric label of every model no backend lists
log = logging.getLogger("warmroute.telemetry")


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
        self.resource = Resource.create({"service.name": cfg.service_name})
        self.scope = InstrumentationScope(SCOPE)
        self._exporters: list[Any] = []  # OTLP exporters, to cut short at shutdown
        self.export_health = ExportHealths()  # one log line when export fails, one when back
        # Requests the proxy answered itself before any backend (401, 404, 503 overloaded...)
        self.c_refused = Counts(("http.response.status_code", "error.type"))
        self.spans = self._tracing(span_exporter)
        self.metrics = RequestMetrics()
        # Called once per finished request: (model, backend, facts, error, decision, t0).
        self.finished: Callable[..., None] | None = None
        self._registry: Any = None
        self.meter_provider = self._metering(metric_readers)

    def _tracing(self, span_exporter: SpanExporter | None) -> Spans:
        cfg = self.cfg
        tracing = self.enabled and (span_exporter is not None or cfg.traces_exporter != "none")
        self.tracer_provider = TracerProvider(
            resource=self.resource, sampler=None if tracing else ALWAYS_OFF
        )
        processor: SpanProcessor | None = None
        if not self.enabled:
            pass
        elif span_exporter is not None:
            processor = SimpleSpanProcessor(span_exporter)
        elif cfg.traces_exporter == "otlp":
            exporter = otlp_span_exporter(cfg)
            self._exporters.append(exporter)
            health = self.export_health.watch(exporter, "traces", otlp_endpoint_of(cfg, "traces"))
            if EncodedBatcher.can_use(exporter):
                processor = EncodedBatcher(exporter, self.resource, self.scope, health)
            else:  # gRPC, or an SDK whose HTTP exporter we do not know
                processor = BatchSpanProcessor(exporter)
        elif cfg.traces_exporter == "console":
            processor = BatchSpanProcessor(ConsoleSpanExporter())
        if processor is not None:
            self.tracer_provider.add_span_processor(processor)
        return Spans(self.tracer_provider, processor, tracing, self.resource, self.scope)

    def _metering(self, metric_readers: Sequence[MetricReader]) -> MeterProvider:
        cfg = self.cfg
        readers: list[MetricReader] = list(metric_readers)
        if cfg.prometheus and self.enabled:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import CollectorRegistry

            self._registry = CollectorRegistry(auto_describe=True)
            readers.append(PrometheusMetricReader(registry=self._registry))
        # Pushed only when asked (telemetry.metrics_exporter, OTEL_METRICS_EXPORTER): a trace
        # store that takes OTLP traces may take no metrics, and would log an error per export.
        if cfg.metrics_exporter == "otlp" and self.enabled:
            metric_exporter = _otlp_metric_exporter(cfg)
            self._exporters.append(metric_exporter)
            self.export_health.watch(metric_exporter, "metrics", otlp_endpoint_of(cfg, "metrics"))
            readers.append(PeriodicExportingMetricReader(metric_exporter))
        elif cfg.metrics_exporter == "console" and self.enabled:
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        provider = MeterProvider(
            metric_readers=readers,
            resource=self.resource,
            exemplar_filter=TraceBasedExemplarFilter(),
        )
        if self.enabled:
            meter = provider.get_meter(SCOPE)
            self.metrics.observe_with(meter)
            self._observe_export_health(meter)
            for reader in readers:
                sdk_bridge.wrap_collect(reader, self._with_histograms)
        return provider

    def _observe_export_health(self, meter: Any) -> None:
        meter.create_observable_counter(
            "warmroute.requests.refused",
            [self.c_refused.observe],
            unit="{request}",
            description="API requests the proxy refused itself, before any backend, by "
            "http.response.status_code and error.type (401 invalid_api_key, 404 "
            "model_not_found, 503 overloaded, ...). Refusals after routing (429, 503 no_backend) "
            "are in gen_ai.server.request.duration with their error.type.",
        )
        health = self.export_health
        meter.create_observable_counter(
            "warmroute.telemetry.export.failures",
            [health.observe_failures],
            unit="{export}",
            description="Failed OTLP exports (each after the SDK's retries), by "
            "warmroute.telemetry.signal (traces, metrics).",
        )
        meter.create_observable_gauge(
            "warmroute.telemetry.export.failing",
            [health.observe_failing],
            unit="1",
            description="1 while OTLP export of warmroute.telemetry.signal fails, else 0.",
        )

    # -- metrics export -------------------------------------------------------------------------
    def _with_histograms(self, data: MetricsData | None) -> MetricsData | None:
        """A reader's collection with the pre-aggregated histograms added."""
        metrics = self.metrics.collect()
        if not metrics:
            return data
        ours = ScopeMetrics(scope=self.scope, metrics=metrics, schema_url="")
        if data is None or not data.resource_metrics:
            rm = [ResourceMetrics(resource=self.resource, scope_metrics=[ours], schema_url="")]
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
            return DISABLED
        return RequestRecord(self, request_id, api, model, stream, params, headers, t0)

    def refused(self, status: int, code: str) -> None:
        """Count one API request the proxy refused before any backend (the error's code:
        a few fixed values, never client input)."""
        if self.enabled:
            self.c_refused.add((status, code))

    def observe_routing(self, policy: str, reason: str, decision_s: float) -> None:
        """Count one routing decision and time it (called once per decision, not per attempt)."""
        if self.enabled:
            self.metrics.routing(policy, reason, decision_s)

    def read_inflight(self, source: Callable[[], Mapping[str, int]]) -> None:
        """Report `source()` (backend -> requests this proxy has open on it) as
        warmroute.backend.inflight: the count routing keeps anyway, not a second one."""
        self.metrics.inflight = source

    def bound_model_labels(self, known: Callable[[str], bool]) -> None:
        """Label metrics with the model only when `known(model)` (a backend lists it); any
        other name the client sent is labelled `other`, so client input cannot add series."""
        self.metrics.model_label = lambda model: model if not model or known(model) else OTHER

    def read_cache(self, source: Callable[[], Mapping[str, Mapping[str, Any]]]) -> None:
        """Report `source()` (backend -> the capacity learner's estimate, as in
        /admin/routing) as the warmroute.prefix.* gauges in CACHE_GAUGES."""
        self.metrics.cache = source

    def read_index(
        self, blocks: Callable[[], Mapping[str, int]], memory: Callable[[], int]
    ) -> None:
        """Report the prefix index: `blocks()` (backend -> blocks held) as
        warmroute.prefix.blocks and `memory()` (its tables' bytes) as
        warmroute.prefix.index.memory. Both are read on the collecting thread."""
        self.metrics.index_blocks = blocks
        self.metrics.index_memory = memory

    def read_health(
        self, ejected: Callable[[], Mapping[str, int]], budget_exhausted: Callable[[], int]
    ) -> None:
        """Report passive health: warmroute.backend.ejected per backend (1 while its circuit
        is open) and warmroute.upstream.retry_budget_exhausted."""
        self.metrics.ejected = ejected
        self.metrics.budget_exhausted = budget_exhausted

    def read_disagg(self, source: Callable[[], tuple[bool, Mapping[str, float]] | None]) -> None:
        """Report the disaggregation decider: warmroute.disagg.active and its inputs."""
        self.metrics.disagg = source

    def read_findings(self, source: Callable[[], Iterable[tuple[str, str, str]]]) -> None:
        """Report `source()` ((finding id, backend, severity) per current finding of the
        doctor) as the warmroute.doctor.findings gauge, so an alert can fire on it."""
        self.metrics.findings = source

    def forget_backend(
        self, name: str, address: str | None = None, port: int | None = None
    ) -> None:
        """`name` left the fleet: every metric series labelled with it (warmroute.backend) or
        with its server.address and server.port goes from /metrics and the exporters. The
        gauges read from routing and health (in flight, learned cache, ejected, findings)
        follow their sources, which forget the backend themselves."""
        addresses = [(address, port)] if address and port is not None else []
        self.metrics.forget_backend(name, addresses)

    def fleet_change(self, change: str, source: str) -> None:
        """Count one change to the backend fleet as warmroute.fleet.changes: `change` is
        join, leave, drain, restart or update; `source` says who asked ("config", "admin",
        "dns:NAME", "kubernetes:NS/SVC"; at most 64 distinct ones are kept as labels)."""
        if self.enabled:
            self.metrics.fleet_change(change, source)

    def read_fleet(self, source: Callable[[], Mapping[str, int]]) -> None:
        """Report `source()` (membership state -> backends in it: joining, serving, draining,
        drained) as the warmroute.fleet.backends gauge."""
        self.metrics.fleet = source

    def on_finish(self, callback: Callable[..., None]) -> None:
        """Call `callback(model, backend, facts, error, decision, t0)` once per finished
        request (StreamFacts or None, error.type or None, the routing Decision or None)."""
        self.finished = callback

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
        self.export_health.stop()
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
    return otel_env.signal_url(cfg.otlp_endpoint, cfg.otlp_protocol, signal)


def otlp_endpoint_of(cfg: TelemetryConfig, signal: str) -> str:
    """Where the OTLP exporter of `signal` (traces, metrics) sends: telemetry.otlp_endpoint,
    else what the OTEL_EXPORTER_OTLP_* variables (or their defaults) say."""
    own = _otlp_endpoint(cfg, signal)
    if own is not None:
        return own
    return otel_env.otlp_endpoint(os.environ, signal.upper(), cfg.otlp_protocol)[0]


def _grpc_missing() -> ConfigError:
    return ConfigError(
        "telemetry.otlp_protocol: grpc needs the gRPC exporter, which the base install leaves "
        "out: pip install 'warmroute[grpc]' (or use http/protobuf, OTLP's port 4318)"
    )


def otlp_span_exporter(cfg: TelemetryConfig) -> SpanExporter:
    if cfg.otlp_protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as G,
            )
        except ImportError:
            raise _grpc_missing() from None
        return G(
            endpoint=_otlp_endpoint(cfg, "traces"),
            timeout=_timeout_s("TRACES"),
            credentials=_grpc_credentials("TRACES"),
        )
    return http_span_exporter(
        endpoint=_otlp_endpoint(cfg, "traces"),
        timeout=_timeout_s("TRACES"),
        **_tls_kwargs("TRACES"),
    )


def _otlp_metric_exporter(cfg: TelemetryConfig) -> Any:
    if cfg.otlp_protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter as G,
            )
        except ImportError:
            raise _grpc_missing() from None
        return G(
            endpoint=_otlp_endpoint(cfg, "metrics"),
            timeout=_timeout_s("METRICS"),
            credentials=_grpc_credentials("METRICS"),
        )
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as H

    return H(
        endpoint=_otlp_endpoint(cfg, "metrics"),
        timeout=_timeout_s("METRICS"),
        **_tls_kwargs("METRICS"),
    )


def _timeout_s(signal: str) -> float | None:
    """The OTLP timeout from the environment, in milliseconds as specified (None: the SDK's
    default); the SDK itself would read the same variable as seconds."""
    try:
        return otel_env.otlp_timeout_s(os.environ, signal)
    except otel_env.OtelEnvError as e:
        raise ConfigError(str(e)) from None


def _tls_files(signal: str) -> tuple[str | None, str | None, str | None]:
    """The OTLP CA certificate, client key and client certificate files for `signal`, each
    checked to be a readable file, so that a wrong path stops the start naming its variable
    instead of failing every export."""
    files = otel_env.otlp_tls_files(os.environ, signal)
    for what, path in zip(("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE"), files, strict=True):
        if path is not None and not os.access(path, os.R_OK):
            var = f"OTEL_EXPORTER_OTLP_{signal}_{what}"
            if os.environ.get(var, "").strip() != path:
                var = f"OTEL_EXPORTER_OTLP_{what}"
            raise ConfigError(f"{var}={path}: no readable file there (a PEM file is expected)")
    return files


def _tls_kwargs(signal: str) -> dict[str, Any]:
    """The OTLP/HTTP exporter's TLS arguments (none set: the SDK's defaults, the system CAs)."""
    ca, key, cert = _tls_files(signal)
    names = ("certificate_file", "client_key_file", "client_certificate_file")
    kwargs: dict[str, Any] = {
        name: path for name, path in zip(names, (ca, key, cert), strict=True) if path
    }
    credential_provider = (
        "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
        f"OTEL_PYTHON_EXPORTER_OTLP_HTTP_{signal}_CREDENTIAL_PROVIDER",
    )
    if ca and not any(os.environ.get(var) for var in credential_provider):
        kwargs["session"] = _own_ca_session()
    return kwargs


def _own_ca_session() -> Any:
    """A requests session that verifies with the CA file it is given even where
    REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE is set: requests lets those replace a session's own
    `verify` on every request, so the SDK's exporter would ignore OTEL_EXPORTER_OTLP_CERTIFICATE
    on such a machine (many container images set them) and fail to verify the collector."""
    import requests

    class OwnCASession(requests.Session):
        def merge_environment_settings(
            self, url: Any, proxies: Any, stream: Any, verify: Any, cert: Any
        ) -> Any:
            verify = self.verify if verify is None else verify
            return super().merge_environment_settings(url, proxies, stream, verify, cert)

    return OwnCASession()


def _grpc_credentials(signal: str) -> Any:
    """The gRPC channel credentials from the OTLP TLS variables, resolved one by one (the SDK's
    gRPC exporters read a per-signal client key only beside a per-signal CA certificate);
    None when none is set (the SDK's default: the system CAs). Unused for http:// endpoints."""
    ca, key, cert = _tls_files(signal)
    if not (ca or key or cert):
        return None
    if bool(key) != bool(cert):
        raise ConfigError(
            f"OTLP over gRPC for {signal.lower()}: set both OTEL_EXPORTER_OTLP_CLIENT_KEY and "
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE (or their per-signal forms), or neither"
        )
    import grpc

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(
        root_certificates=read(ca), private_key=read(key), certificate_chain=read(cert)
    )
