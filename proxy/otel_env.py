"""The OpenTelemetry SDK's standard environment variables, as warmroute settings.

Operators and the OpenTelemetry Operator configure every instrumented service with the same
`OTEL_*` variables; warmroute honours them as defaults under its own configuration (YAML file,
`WARMROUTE_*`, flags), which override them key by key. Pure: environment in, config keys out.

Variables that choose *what* is exported map to `telemetry:` keys here:

  OTEL_SDK_DISABLED=true            telemetry.enabled: false
  OTEL_SERVICE_NAME                 telemetry.service_name (else service.name from
                                    OTEL_RESOURCE_ATTRIBUTES)
  OTEL_TRACES_EXPORTER              telemetry.traces_exporter: otlp | console | none
  OTEL_METRICS_EXPORTER             telemetry.metrics_exporter: otlp | console | none (pushed);
                                    `prometheus` is GET /metrics, which is on anyway
  OTEL_EXPORTER_OTLP_PROTOCOL,
  OTEL_EXPORTER_OTLP_{TRACES,METRICS}_PROTOCOL
                                    telemetry.otlp_protocol: http/protobuf | grpc

Unset, the specification's default exporter is `otlp` to localhost; warmroute exports traces
only once a destination is named (OTEL_EXPORTER_OTLP_ENDPOINT or ..._TRACES_ENDPOINT), and
pushes metrics only when asked (OTEL_METRICS_EXPORTER=otlp or ..._METRICS_ENDPOINT): a trace
store such as Jaeger takes no metrics, and Prometheus scrapes /metrics. telemetry_settings()
also names the variable behind each key, and otlp_endpoint() the URL each signal goes to:
`serve --check` shows both (proxy/telemetry/effective.py).

OTEL_EXPORTER_OTLP_[{TRACES,METRICS}_]TIMEOUT is in milliseconds, as the specification
defines it; the Python SDK (1.45) reads it as seconds, so warmroute converts it and hands the
exporters the timeout itself (10000 means 10 s, not 2.8 hours).

OTEL_EXPORTER_OTLP_[{TRACES,METRICS}_]{CERTIFICATE,CLIENT_KEY,CLIENT_CERTIFICATE} are resolved
here too (otlp_tls_files), each per-signal variable over its general one, and handed to the
exporters: the SDK's gRPC exporters read the per-signal client key only beside a per-signal CA
certificate, so a general CA with a per-signal client certificate would fail the handshake.

The rest are read by the SDK (or, for OTEL_BSP_*, by proxy/telemetry/batcher.py, which does the
BatchSpanProcessor's job) unchanged: OTEL_EXPORTER_OTLP_[{TRACES,METRICS}_]ENDPOINT (unless
telemetry.otlp_endpoint is set), ..._HEADERS, ..._COMPRESSION, OTEL_TRACES_SAMPLER and
OTEL_TRACES_SAMPLER_ARG, OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_SCHEDULE_DELAY,
OTEL_BSP_MAX_QUEUE_SIZE, OTEL_BSP_MAX_EXPORT_BATCH_SIZE, OTEL_METRIC_EXPORT_INTERVAL.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TRACES_EXPORTERS = ("otlp", "console", "none")
_OTLP = tuple(
    f"OTEL_EXPORTER_OTLP_{signal}{what}"
    for signal in ("", "TRACES_", "METRICS_")
    for what in (
        "ENDPOINT",
        "PROTOCOL",
        "HEADERS",
        "TIMEOUT",
        "COMPRESSION",
        "CERTIFICATE",
        "CLIENT_KEY",
        "CLIENT_CERTIFICATE",
    )
)
# Every OTEL_* variable warmroute honours, here or through the SDK (deployment files set only
# these; tests/test_compose.py checks it; tests/test_otel_env.py proves each one's effect).
HONOURED = (
    "OTEL_SDK_DISABLED",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_METRIC_EXPORT_INTERVAL",
    "OTEL_BSP_SCHEDULE_DELAY",
    "OTEL_BSP_MAX_QUEUE_SIZE",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
    *_OTLP,
)
METRICS_EXPORTERS = ("otlp", "console", "none", "prometheus")
PROTOCOLS = ("http/protobuf", "grpc")


class OtelEnvError(ValueError):
    """An OTEL_* variable warmroute cannot honour; the message says which and what works."""


def _names(env: Mapping[str, str], var: str, allowed: tuple[str, ...]) -> list[str]:
    raw = env.get(var, "")
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise OtelEnvError(
            f"{var}={raw}: warmroute cannot export to {', '.join(unknown)}; use "
            + " | ".join(allowed)
        )
    return names


def _exporter(names: list[str], var: str) -> str | None:
    chosen = [n for n in names if n != "prometheus"]
    if "none" in chosen and len(chosen) > 1:
        raise OtelEnvError(f"{var}={','.join(names)}: `none` cannot be combined with an exporter")
    if len(chosen) > 1:
        raise OtelEnvError(f"{var}={','.join(names)}: warmroute exports to one of them; pick one")
    return chosen[0] if chosen else None


def _resource_service_name(env: Mapping[str, str]) -> str | None:
    for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip() == "service.name" and value.strip():
            return value.strip()
    return None


def _protocol(env: Mapping[str, str]) -> str | None:
    general = env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip() or None
    traces = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "").strip() or general
    metrics = env.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "").strip() or general
    for var, value in (
        ("OTEL_EXPORTER_OTLP_PROTOCOL", general),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", traces),
        ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", metrics),
    ):
        if value is not None and value not in PROTOCOLS:
            raise OtelEnvError(f"{var}={value}: warmroute speaks {' or '.join(PROTOCOLS)}")
    if traces and metrics and traces != metrics:
        raise OtelEnvError(
            f"OTLP protocols differ (traces {traces}, metrics {metrics}): warmroute sends both "
            "signals with one; set OTEL_EXPORTER_OTLP_PROTOCOL alone"
        )
    return traces or metrics


def otlp_timeout_s(env: Mapping[str, str], signal: str) -> float | None:
    """OTEL_EXPORTER_OTLP_<SIGNAL>_TIMEOUT, else OTEL_EXPORTER_OTLP_TIMEOUT (milliseconds), in
    seconds; None when neither is set. `signal`: TRACES or METRICS."""
    for var in (f"OTEL_EXPORTER_OTLP_{signal}_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"):
        raw = env.get(var, "").strip()
        if not raw:
            continue
        try:
            ms = float(raw)
        except ValueError:
            ms = -1.0
        if not ms > 0:
            raise OtelEnvError(f"{var}={raw}: a timeout in milliseconds, e.g. 10000")
        return ms / 1000
    return None


def otlp_tls_files(
    env: Mapping[str, str], signal: str
) -> tuple[str | None, str | None, str | None]:
    """(CA certificate, client key, client certificate) files for OTLP export of `signal`
    (TRACES or METRICS): each OTEL_EXPORTER_OTLP_<SIGNAL>_* variable, else the general one."""

    def one(what: str) -> str | None:
        for var in (f"OTEL_EXPORTER_OTLP_{signal}_{what}", f"OTEL_EXPORTER_OTLP_{what}"):
            value = env.get(var, "").strip()
            if value:
                return value
        return None

    return one("CERTIFICATE"), one("CLIENT_KEY"), one("CLIENT_CERTIFICATE")


def telemetry_defaults(env: Mapping[str, str]) -> dict[str, Any]:
    """The `telemetry:` keys the standard OTEL_* variables in `env` ask for."""
    return {key: value for key, (value, _) in telemetry_settings(env).items()}


def telemetry_settings(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """Each `telemetry:` key the OTEL_* variables in `env` set, as (value, the variable that
    set it): what `serve --check` names as the key's source."""
    for signal in ("TRACES", "METRICS"):
        otlp_timeout_s(env, signal)  # a bad value stops the start here, naming the variable
    out: dict[str, tuple[Any, str]] = {}
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        out["enabled"] = (False, "OTEL_SDK_DISABLED")
    if env.get("OTEL_SERVICE_NAME", "").strip():
        out["service_name"] = (env["OTEL_SERVICE_NAME"].strip(), "OTEL_SERVICE_NAME")
    elif service := _resource_service_name(env):
        out["service_name"] = (service, "OTEL_RESOURCE_ATTRIBUTES")
    traces = _traces_exporter(env)
    if traces is not None:
        out["traces_exporter"] = traces
    metrics = _metrics_exporter(env)
    if metrics is not None:
        out["metrics_exporter"] = metrics
    protocol = _protocol(env)
    if protocol is not None:
        out["otlp_protocol"] = (protocol, _protocol_var(env))
    return out


def _traces_exporter(env: Mapping[str, str]) -> tuple[str, str] | None:
    var = "OTEL_TRACES_EXPORTER"
    traces = _exporter(_names(env, var, TRACES_EXPORTERS), var)
    if traces is not None:
        return traces, var
    for endpoint in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        if env.get(endpoint):
            return "otlp", endpoint
    return None


def _metrics_exporter(env: Mapping[str, str]) -> tuple[str, str] | None:
    var = "OTEL_METRICS_EXPORTER"
    names = _names(env, var, METRICS_EXPORTERS)
    metrics = _exporter(names, var)
    if metrics is not None:
        return metrics, var
    if not names and env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        return "otlp", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
    return None


def _protocol_var(env: Mapping[str, str]) -> str:
    for var in (
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ):
        if env.get(var, "").strip():
            return var
    return "OTEL_EXPORTER_OTLP_PROTOCOL"


# Where the SDK sends OTLP when no variable names a destination (the specification's defaults).
DEFAULT_ENDPOINTS = {"http/protobuf": "http://localhost:4318", "grpc": "http://localhost:4317"}


def otlp_endpoint(env: Mapping[str, str], signal: str, protocol: str) -> tuple[str, str]:
    """(URL, where it came from) that the SDK's OTLP exporter for `signal` (TRACES or METRICS)
    sends to when warmroute's telemetry.otlp_endpoint is not set: the per-signal variable as
    written, else the general one (with /v1/traces or /v1/metrics over HTTP), else the
    specification's default."""
    own = f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"
    if env.get(own, "").strip():
        return env[own].strip(), own
    general = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if general:
        return signal_url(general, protocol, signal), "OTEL_EXPORTER_OTLP_ENDPOINT"
    default = DEFAULT_ENDPOINTS.get(protocol, DEFAULT_ENDPOINTS["http/protobuf"])
    return signal_url(default, protocol, signal), "default"


def signal_url(base: str, protocol: str, signal: str) -> str:
    """A base URL like OTEL_EXPORTER_OTLP_ENDPOINT as one signal's: over HTTP with its path
    (/v1/traces, /v1/metrics), over gRPC as it is."""
    if protocol == "grpc":
        return base
    return base.rstrip("/") + f"/v1/{signal.lower()}"
