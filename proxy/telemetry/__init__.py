"""OpenTelemetry for the proxy: one SERVER span per request with a CLIENT child per upstream
attempt, metrics recorded once per request from the stream meter's facts, and /metrics.

The modules, from the bottom up:
  sdk_bridge   every use of the SDK's private internals, behind a version guard
  wire         the OTLP protobuf wire format for spans, written by hand
  export_health  one log line when OTLP export starts failing, one when it recovers, a count
  batcher      the export queue for spans that arrive encoded
  transport    the OTLP/HTTP exporter with that encoder, over a keep-alive connection
  histograms   pre-aggregated histograms and counts, and their bucket bounds
  metrics      the instruments: what a finished request records, what readers collect
  spans        sampling, ids, and where a finished span goes
  render       the model's two renderings: the SDK's dict, and protobuf fields compiled from it
  attributes   the span attribute model: every attribute written once
  record       one request's spans and metrics (RequestRecord, AttemptRecord)
  providers    Telemetry: the providers, exporters and /metrics
  effective    what is exported where and which setting decided it (serve, serve --check)
"""

from proxy.telemetry.histograms import (
    DURATION_BUCKETS,
    OVERHEAD_BUCKETS,
    RATIO_BUCKETS,
    TOKEN_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
)
from proxy.telemetry.metrics import CACHE_GAUGES
from proxy.telemetry.providers import SCOPE, SHUTDOWN_EXPORT_S, Telemetry
from proxy.telemetry.record import AttemptRecord, RequestRecord
from proxy.telemetry.sdk_bridge import UnsupportedSDK

__all__ = [
    "CACHE_GAUGES",
    "DURATION_BUCKETS",
    "OVERHEAD_BUCKETS",
    "RATIO_BUCKETS",
    "SCOPE",
    "SHUTDOWN_EXPORT_S",
    "TOKEN_BUCKETS",
    "TPOT_BUCKETS",
    "TTFT_BUCKETS",
    "AttemptRecord",
    "RequestRecord",
    "Telemetry",
    "UnsupportedSDK",
]
