"""The OpenTelemetry SDK's standard OTEL_* variables work as an operator expects, one test each,
with warmroute's own settings (file, WARMROUTE_*, flags) over them."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.config import ConfigError, load_config
from proxy.telemetry import Telemetry
from tests.test_telemetry import facts, start

OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
)
OTLP_VARS = tuple(
    f"OTEL_EXPORTER_OTLP_{signal}{what}"
    for signal in ("", "TRACES_", "METRICS_")
    for what in ("ENDPOINT", "PROTOCOL", "HEADERS", "TIMEOUT", "COMPRESSION")
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No OTEL_* variable from the machine running the tests leaks into these."""
    for var in OTEL_VARS + OTLP_VARS:
        monkeypatch.delenv(var, raising=False)


def telemetry_of(env: dict[str, str], file: Path | None = None, **flags: Any) -> Any:
    return load_config(file, flags={"backends": ["http://127.0.0.1:9"], **flags}, env=env).telemetry


# -- what each variable selects ----------------------------------------------------------------


def test_otel_traces_exporter_selects_the_trace_exporter() -> None:
    assert telemetry_of({}).traces_exporter == "none"  # no collector assumed
    for value in ("otlp", "console", "none"):
        assert telemetry_of({"OTEL_TRACES_EXPORTER": value}).traces_exporter == value
    with pytest.raises(ConfigError, match=r"OTEL_TRACES_EXPORTER=zipkin.*otlp \| console"):
        telemetry_of({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ConfigError, match="pick one"):
        telemetry_of({"OTEL_TRACES_EXPORTER": "otlp,console"})


def test_otel_metrics_exporter_selects_pushed_metrics_apart_from_traces() -> None:
    assert telemetry_of({"OTEL_METRICS_EXPORTER": "otlp"}).metrics_exporter == "otlp"
    assert telemetry_of({"OTEL_METRICS_EXPORTER": "console"}).metrics_exporter == "console"
    pulled = telemetry_of({"OTEL_METRICS_EXPORTER": "prometheus"})
    assert pulled.metrics_exporter == "none" and pulled.prometheus  # GET /metrics
    # Traces to a trace store do not drag metrics along (Jaeger takes no metrics).
    traces_only = telemetry_of({"OTEL_TRACES_EXPORTER": "otlp"})
    assert traces_only.traces_exporter == "otlp" and traces_only.metrics_exporter == "none"


def test_otel_sdk_disabled_turns_telemetry_off() -> None:
    assert telemetry_of({"OTEL_SDK_DISABLED": "true"}).enabled is False
    assert telemetry_of({"OTEL_SDK_DISABLED": "TRUE"}).enabled is False
    assert telemetry_of({"OTEL_SDK_DISABLED": "false"}).enabled is True


def test_otel_service_name_names_the_service() -> None:
    assert telemetry_of({}).service_name == "warmroute"
    assert telemetry_of({"OTEL_SERVICE_NAME": "llm-gateway"}).service_name == "llm-gateway"


def test_otel_resource_attributes_service_name_is_used_without_otel_service_name() -> None:
    env = {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,service.name=gw"}
    assert telemetry_of(env).service_name == "gw"
    assert telemetry_of({**env, "OTEL_SERVICE_NAME": "named"}).service_name == "named"


def test_otel_exporter_otlp_endpoint_alone_sends_traces_but_no_metrics() -> None:
    cfg = telemetry_of({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert (cfg.traces_exporter, cfg.metrics_exporter) == ("otlp", "none")
    cfg = telemetry_of({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://jaeger:4318/v1/traces"})
    assert (cfg.traces_exporter, cfg.metrics_exporter) == ("otlp", "none")
    cfg = telemetry_of({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318/v1/metrics"})
    assert (cfg.traces_exporter, cfg.metrics_exporter) == ("none", "otlp")
    # An explicit `none` wins over an endpoint named for other services.
    cfg = telemetry_of(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}
    )
    assert cfg.traces_exporter == "none"


def test_otel_exporter_otlp_protocol_picks_grpc_or_http() -> None:
    assert telemetry_of({}).otlp_protocol == "http/protobuf"
    assert telemetry_of({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}).otlp_protocol == "grpc"
    assert telemetry_of({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}).otlp_protocol == "grpc"
    with pytest.raises(ConfigError, match="http/json: warmroute speaks http/protobuf or grpc"):
        telemetry_of({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    with pytest.raises(ConfigError, match="protocols differ"):
        telemetry_of(
            {
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
            }
        )


def test_otel_exporter_otlp_protocol_grpc_builds_the_grpc_exporter() -> None:
    cfg = telemetry_of({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    t = Telemetry(cfg.model_copy(update={"otlp_endpoint": "http://127.0.0.1:9"}))
    try:
        assert [type(e).__module__.split(".")[-2] for e in t._exporters] == ["grpc"]
    finally:
        t.shutdown(deadline_s=0.5)


def test_warmroute_settings_override_the_otel_variables(tmp_path: Path) -> None:
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SERVICE_NAME": "from-otel"}
    assert telemetry_of({**env, "WARMROUTE_TRACES_EXPORTER": "none"}).traces_exporter == "none"
    file = tmp_path / "warmroute.yaml"
    file.write_text("telemetry: {service_name: from-file, traces_exporter: console}\n")
    cfg = telemetry_of(env, file)
    assert (cfg.service_name, cfg.traces_exporter) == ("from-file", "console")
    assert telemetry_of(env, file, traces_exporter="none").traces_exporter == "none"  # a flag


# -- the variables the SDK reads itself, through warmroute's exporters --------------------------


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    url: str
    got: list[Received] = field(default_factory=list)

    def traces(self) -> ExportTraceServiceRequest:
        out = ExportTraceServiceRequest()
        for r in self.got:
            if r.path.endswith("traces"):
                body = r.body
                if r.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                out.MergeFromString(body)
        return out


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """An OTLP/HTTP receiver on loopback that records every POST."""
    got: list[Received] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            headers = {k.lower(): v for k, v in self.headers.items()}
            got.append(Received(self.path, headers, body))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Receiver(f"http://127.0.0.1:{server.server_port}", got)
    finally:
        server.shutdown()
        server.server_close()


def export_one_request(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Configure from `env` as `warmroute serve` does (the SDK reads os.environ), record one
    request, and shut down (which flushes every exporter)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    import os

    t = Telemetry(load_config(flags={"backends": ["http://127.0.0.1:9"]}, env=os.environ).telemetry)
    rec = start(t)
    rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    rec.finish(facts(), status=200)
    t.shutdown()


@pytest.mark.e2e
def test_otel_exporter_otlp_endpoint_and_headers_reach_the_collector(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    export_one_request(
        monkeypatch,
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "OTEL_EXPORTER_OTLP_HEADERS": "x-scope-orgid=team-a,authorization=Bearer%20k",
        },
    )
    assert {r.path for r in receiver.got} == {"/v1/traces"}  # no metrics pushed to a trace store
    headers = receiver.got[0].headers
    assert headers["x-scope-orgid"] == "team-a" and headers["authorization"] == "Bearer k"
    spans = [
        s for rs in receiver.traces().resource_spans for ss in rs.scope_spans for s in ss.spans
    ]
    assert len(spans) == 2


@pytest.mark.e2e
def test_otel_exporter_otlp_traces_endpoint_is_used_as_is(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = receiver.url + "/tenant-a/otlp/v1/traces"
    export_one_request(monkeypatch, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint})
    assert {r.path for r in receiver.got} == {"/tenant-a/otlp/v1/traces"}


@pytest.mark.e2e
def test_otel_metrics_exporter_otlp_pushes_metrics(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    export_one_request(
        monkeypatch,
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_TRACES_EXPORTER": "none",
        },
    )
    assert {r.path for r in receiver.got} == {"/v1/metrics"}


@pytest.mark.e2e
def test_otel_exporter_otlp_compression_gzips_the_export(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    export_one_request(
        monkeypatch,
        {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"},
    )
    assert receiver.got and receiver.got[0].headers.get("content-encoding") == "gzip"
    assert len(receiver.traces().resource_spans) == 1  # and it decompresses to the spans


@pytest.mark.e2e
def test_otel_exporter_otlp_timeout_bounds_each_export(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collector that takes 3 s to answer: with a 300 ms timeout the export gives up first."""
    import os
    import time

    class Slow(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            time.sleep(3)
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "300")  # milliseconds, as specified
    cfg = load_config(flags={"backends": ["http://127.0.0.1:9"]}, env=os.environ).telemetry
    t = Telemetry(cfg)
    try:
        [exporter] = t._exporters
        began = time.monotonic()
        assert exporter.export_encoded(ExportTraceServiceRequest().SerializeToString()) is False
        assert time.monotonic() - began < 2.5  # gave up well before the 3 s answer
    finally:
        t.shutdown(deadline_s=0.5)
        server.shutdown()
        server.server_close()


@pytest.mark.e2e
def test_otel_resource_attributes_and_service_name_label_the_spans(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    export_one_request(
        monkeypatch,
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "OTEL_SERVICE_NAME": "gateway-eu",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,k8s.pod.name=wr-0",
        },
    )
    [rs] = receiver.traces().resource_spans
    resource = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
    assert resource["service.name"] == "gateway-eu"
    assert resource["deployment.environment"] == "prod" and resource["k8s.pod.name"] == "wr-0"


@pytest.mark.parametrize(
    ("sampler", "arg", "kept"),
    [
        ("always_off", None, 0),
        ("always_on", None, 2),
        ("traceidratio", "0", 0),
        ("traceidratio", "1", 2),
        ("parentbased_traceidratio", "0", 2),  # the client's sampled traceparent decides
    ],
)
def test_otel_traces_sampler_and_its_arg_decide_what_is_kept(
    monkeypatch: pytest.MonkeyPatch, sampler: str, arg: str | None, kept: int
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    if arg is not None:
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    spans = InMemorySpanExporter()
    import os

    cfg = load_config(flags={"backends": ["http://127.0.0.1:9"]}, env=os.environ).telemetry
    t = Telemetry(cfg, span_exporter=spans)
    rec = start(t)  # with a sampled W3C traceparent from the client
    rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    rec.finish(facts(), status=200)
    t.shutdown()
    assert len(spans.get_finished_spans()) == kept


def test_otel_exporter_otlp_timeout_is_milliseconds_as_specified() -> None:
    from proxy.otel_env import otlp_timeout_s

    assert otlp_timeout_s({}, "TRACES") is None  # the SDK's default (10 s)
    assert otlp_timeout_s({"OTEL_EXPORTER_OTLP_TIMEOUT": "10000"}, "TRACES") == 10.0
    env = {"OTEL_EXPORTER_OTLP_TIMEOUT": "10000", "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "500"}
    assert otlp_timeout_s(env, "METRICS") == 0.5 and otlp_timeout_s(env, "TRACES") == 10.0
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TIMEOUT=soon: a timeout in"):
        telemetry_of({"OTEL_EXPORTER_OTLP_TIMEOUT": "soon"})


def test_every_replica_has_a_service_instance_id_unless_the_resource_gives_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replicas pushing metrics to one collector keep apart (it keys series by instance): the
    SDK gives each process a random id, OTEL_RESOURCE_ATTRIBUTES may name it."""
    cfg = load_config(flags={"backends": ["http://127.0.0.1:9"]}, env={}).telemetry
    t = Telemetry(cfg)
    assert len(str(t.resource.attributes["service.instance.id"])) >= 8
    t.shutdown()
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=pod-7")
    t = Telemetry(cfg)
    assert t.resource.attributes["service.instance.id"] == "pod-7"
    t.shutdown()
