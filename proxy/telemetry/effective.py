"""What telemetry is exported where, and which setting decided it.

`serve --check` shows every `telemetry:` key with its source (the config file, a WARMROUTE_*
or OTEL_* variable, a flag, or the default) and the endpoints the exporters will really use;
`serve` says the same in one line at start, so that telemetry never switches off unsaid.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from proxy import otel_env
from proxy.config import TelemetryConfig

Settings = dict[str, dict[str, Any]]
LOGS = "stderr"  # warmroute logs to stderr only; no OTLP log exporter
SIGNALS = ("traces", "metrics")


def effective_telemetry(
    cfg: TelemetryConfig, sources: Mapping[str, str], env: Mapping[str, str] | None = None
) -> Settings:
    """Every telemetry setting as {"value", "source"} (and "overrides": the OTEL_* variable a
    warmroute setting overrides, when they disagree), plus the endpoint of each signal."""
    env = os.environ if env is None else env
    asked = otel_env.telemetry_settings(env)
    out: Settings = {}
    for key, value in cfg.model_dump(mode="json").items():
        setting: dict[str, Any] = {"value": value, "source": sources.get(key, "default")}
        wanted = asked.get(key)
        if wanted is not None and wanted[0] != value:
            setting["overrides"] = f"{wanted[1]}={env.get(wanted[1], '')}"
        out[key] = setting
    general = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if not cfg.otlp_endpoint:  # null defers to the variables: show what they say
        out["otlp_endpoint"] = _base_endpoint(cfg, env)
    elif general and general != cfg.otlp_endpoint:
        out["otlp_endpoint"]["overrides"] = f"OTEL_EXPORTER_OTLP_ENDPOINT={general}"
    for signal in SIGNALS:
        out[f"{signal}_endpoint"] = _endpoint(cfg, sources, env, signal)
    out["logs"] = {"value": LOGS, "source": "always (warmroute exports no logs over OTLP)"}
    return out


def _base_endpoint(cfg: TelemetryConfig, env: Mapping[str, str]) -> dict[str, Any]:
    var = "OTEL_EXPORTER_OTLP_ENDPOINT"
    if env.get(var, "").strip():
        return {"value": env[var].strip(), "source": f"env {var}"}
    default = otel_env.DEFAULT_ENDPOINTS[cfg.otlp_protocol]
    return {"value": default, "source": "default (the OTLP specification's)"}


def _endpoint(
    cfg: TelemetryConfig, sources: Mapping[str, str], env: Mapping[str, str], signal: str
) -> dict[str, Any]:
    if cfg.otlp_endpoint:
        own = otel_env.signal_url(cfg.otlp_endpoint, cfg.otlp_protocol, signal)
        return {"value": own, "source": sources.get("otlp_endpoint", "default")}
    url, var = otel_env.otlp_endpoint(env, signal.upper(), cfg.otlp_protocol)
    return {"value": url, "source": var if var == "default" else f"env {var}"}


def telemetry_line(cfg: TelemetryConfig, settings: Settings) -> str:
    """One log line: what is exported where (traces, metrics, logs), and why not when not."""
    if not cfg.enabled:
        return (
            f"telemetry: off (telemetry.enabled: false, from {_source(settings, 'enabled')}): "
            f"no traces, no metrics, no /metrics; logs: {LOGS}"
        )
    parts = [_traces(cfg, settings), _metrics(cfg, settings), f"logs: {LOGS} (not exported)"]
    return "telemetry: " + "; ".join(parts)


def _source(settings: Settings, key: str) -> str:
    setting = settings[key]
    overrides = setting.get("overrides")
    return setting["source"] + (f", which overrides {overrides}" if overrides else "")


def _pushed(cfg: TelemetryConfig, settings: Settings, signal: str) -> str:
    endpoint = settings[f"{signal}_endpoint"]
    return f"otlp to {endpoint['value']} over {cfg.otlp_protocol} (from {endpoint['source']})"


def _traces(cfg: TelemetryConfig, settings: Settings) -> str:
    if cfg.traces_exporter == "otlp":
        return "traces: " + _pushed(cfg, settings, "traces")
    if cfg.traces_exporter == "console":
        return "traces: console (stdout)"
    source = _source(settings, "traces_exporter")
    fix = (
        "set OTEL_EXPORTER_OTLP_ENDPOINT to export them"
        if source == "default"
        else "change it there to export them"
    )
    return f"traces: not exported (traces_exporter: none, from {source}; {fix})"


def _metrics(cfg: TelemetryConfig, settings: Settings) -> str:
    scraped = "GET /metrics" if cfg.prometheus else ""  # for Prometheus to scrape
    if cfg.metrics_exporter == "otlp":
        pushed = _pushed(cfg, settings, "metrics")
    elif cfg.metrics_exporter == "console":
        pushed = "console (stdout)"
    else:
        pushed = ""
    if pushed and scraped:
        return f"metrics: {scraped} and {pushed}"
    if pushed or scraped:
        return f"metrics: {pushed or scraped + ' for Prometheus to scrape (not pushed)'}"
    return "metrics: not exported (telemetry.prometheus: false, metrics_exporter: none)"
