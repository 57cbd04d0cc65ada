"""The OpenTelemetry SDK's standard OTEL_* variables work as an operator expects, one test each,
with warmroute's own settings (file, WARMROUTE_*, flags) over them."""

from __future__ import annotations

import contextlib
import gzip
import os
import re
import ssl
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
from proxy.otel_env import HONOURED
from proxy.telemetry import Telemetry
from tests.support import SHUTDOWN_POLL_S
from tests.test_telemetry import facts, start
from tests.test_upstream_tls import Pki, pki, server_context

__all__ = ["pki"]  # a fixture, shared with the upstream TLS tests


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No OTEL_* variable from the machine running the tests leaks into these."""
    for var in list(os.environ):
        if var.startswith("OTEL_"):
            monkeypatch.delenv(var)


def test_every_honoured_variable_has_a_test_of_its_effect_here() -> None:
    """HONOURED is what the compose and Kubernetes tests let deployment files set: each one
    is named by a test below (the per-signal forms too)."""
    text = Path(__file__).read_text()
    tests = text[text.index("\ndef test_every_honoured") + 1 :]
    tests = tests[tests.index("\ndef test_", 1) :]  # after this test
    missing = [var for var in HONOURED if not re.search(rf"\b{var}\b", tests)]
    assert not missing, f"no test names {missing}"


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
    client_cn: str | None = None  # the client certificate's subject, over mutual TLS

    def decoded(self) -> bytes:
        if self.headers.get("content-encoding") == "gzip":
            return gzip.decompress(self.body)
        return self.body


@dataclass
class Receiver:
    url: str
    got: list[Received] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)
    # While cleared, each POST is held before it is answered (a collector that is slow).
    answer: threading.Event = field(default_factory=threading.Event)

    def traces(self) -> ExportTraceServiceRequest:
        out = ExportTraceServiceRequest()
        for r in self.got:
            if r.path.endswith("traces"):
                out.MergeFromString(r.decoded())
        return out

    def spans_per_post(self) -> list[int]:
        counts = []
        for r in self.got:
            if r.path.endswith("traces"):
                one = ExportTraceServiceRequest.FromString(r.decoded())
                counts.append(
                    sum(len(ss.spans) for rs in one.resource_spans for ss in rs.scope_spans)
                )
        return counts

    def on(self, signal: str) -> list[Received]:
        return [r for r in self.got if r.path.endswith(f"/v1/{signal}")]

    def wait_for(self, signal: str, count: int = 1, timeout: float = 5.0) -> bool:
        """Whether `count` POSTs of `signal` arrived within `timeout` seconds."""
        with self.arrived:
            return self.arrived.wait_for(lambda: len(self.on(signal)) >= count, timeout)


@contextlib.contextmanager
def collector(tls: ssl.SSLContext | None = None) -> Iterator[Receiver]:
    """An OTLP/HTTP receiver on loopback that records every POST (HTTPS with `tls`)."""
    rcv = Receiver("")
    rcv.answer.set()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            headers = {k.lower(): v for k, v in self.headers.items()}
            cn = None
            if isinstance(self.connection, ssl.SSLSocket):
                cert: Any = self.connection.getpeercert() or {}
                cn = dict(x[0] for x in cert.get("subject", ())).get("commonName")
            with rcv.arrived:
                rcv.got.append(Received(self.path, headers, body, cn))
                rcv.arrived.notify_all()
            rcv.answer.wait(10)
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    if tls is not None:  # a failed handshake is an OSError that serve_forever drops
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    scheme = "https" if tls is not None else "http"
    rcv.url = f"{scheme}://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, args=(SHUTDOWN_POLL_S,), daemon=True)
    thread.start()
    try:
        yield rcv
    finally:
        rcv.answer.set()
        server.shutdown()
        server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with collector() as rcv:
        yield rcv


def telemetry_from_environment(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Telemetry:
    """Telemetry configured from `env` as `warmroute serve` does (the SDK reads os.environ)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return Telemetry(
        load_config(flags={"backends": ["http://127.0.0.1:9"]}, env=os.environ).telemetry
    )


def record_requests(t: Telemetry, n: int = 1) -> None:
    """Record `n` finished requests, two spans each (the client's traceparent is sampled)."""
    for _ in range(n):
        rec = start(t)
        rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
        rec.finish(facts(), status=200)


def export_one_request(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Configure from `env`, record one request, and shut down (which flushes every
    exporter)."""
    t = telemetry_from_environment(monkeypatch, env)
    record_requests(t)
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
    """A collector that does not answer until the test is over: with a 300 ms timeout the
    export gives up (False) instead of waiting for it. (Without the timeout it would wait for
    the answer, which comes only after the export returned: the join below would then fail
    after 60 s, a hang guard, not a measure of the timeout.)"""
    answer = threading.Event()

    class Slow(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            answer.wait(60)
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(SHUTDOWN_POLL_S,), daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "300")  # milliseconds, as specified
    cfg = load_config(flags={"backends": ["http://127.0.0.1:9"]}, env=os.environ).telemetry
    t = Telemetry(cfg)
    try:
        [exporter] = t._exporters
        result: list[bool] = []
        body = ExportTraceServiceRequest().SerializeToString()
        export = threading.Thread(target=lambda: result.append(exporter.export_encoded(body)))
        export.start()
        export.join(60)
        assert result == [False]  # gave up with no answer yet
    finally:
        answer.set()
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


# -- per-signal headers and compression ---------------------------------------------------------

BOTH_SIGNALS = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp"}


@pytest.mark.e2e
@pytest.mark.parametrize("signal", ["traces", "metrics"])
def test_otel_exporter_otlp_signal_headers_replace_the_general_ones_for_that_signal(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch, signal: str
) -> None:
    """OTEL_EXPORTER_OTLP_TRACES_HEADERS / OTEL_EXPORTER_OTLP_METRICS_HEADERS: the signal's
    own tenant header; the other signal keeps OTEL_EXPORTER_OTLP_HEADERS."""
    other = "metrics" if signal == "traces" else "traces"
    export_one_request(
        monkeypatch,
        {
            **BOTH_SIGNALS,
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "OTEL_EXPORTER_OTLP_HEADERS": "x-scope-orgid=general",
            f"OTEL_EXPORTER_OTLP_{signal.upper()}_HEADERS": f"x-scope-orgid={signal}",
        },
    )
    assert {r.headers["x-scope-orgid"] for r in receiver.on(signal)} == {signal}
    assert {r.headers["x-scope-orgid"] for r in receiver.on(other)} == {"general"}


@pytest.mark.e2e
@pytest.mark.parametrize("signal", ["traces", "metrics"])
def test_otel_exporter_otlp_signal_compression_gzips_that_signal_only(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch, signal: str
) -> None:
    """OTEL_EXPORTER_OTLP_TRACES_COMPRESSION / OTEL_EXPORTER_OTLP_METRICS_COMPRESSION."""
    other = "metrics" if signal == "traces" else "traces"
    export_one_request(
        monkeypatch,
        {
            **BOTH_SIGNALS,
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            f"OTEL_EXPORTER_OTLP_{signal.upper()}_COMPRESSION": "gzip",
        },
    )
    assert receiver.on(signal) and receiver.on(other)
    assert {r.headers.get("content-encoding") for r in receiver.on(signal)} == {"gzip"}
    assert {r.headers.get("content-encoding") for r in receiver.on(other)} == {None}
    for r in receiver.on(signal):
        assert r.decoded()  # and it is the export, compressed


def test_otel_exporter_otlp_signal_timeout_is_milliseconds_for_that_signal() -> None:
    """OTEL_EXPORTER_OTLP_TRACES_TIMEOUT (and ..._METRICS_TIMEOUT above) over the general one."""
    from proxy.otel_env import otlp_timeout_s

    env = {"OTEL_EXPORTER_OTLP_TIMEOUT": "10000", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "250"}
    assert otlp_timeout_s(env, "TRACES") == 0.25 and otlp_timeout_s(env, "METRICS") == 10.0


# -- export periods and the span batch ----------------------------------------------------------


@pytest.mark.e2e
def test_otel_metric_export_interval_sets_the_push_period(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two pushes within 5 s, before any shutdown: the SDK's default period is 60 s."""
    t = telemetry_from_environment(
        monkeypatch,
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_METRIC_EXPORT_INTERVAL": "200",
        },
    )
    try:
        record_requests(t)
        assert receiver.wait_for("metrics", count=2, timeout=5.0)
    finally:
        t.shutdown()


@pytest.mark.e2e
def test_otel_bsp_schedule_delay_sets_how_soon_spans_leave(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spans arrive within 3 s without a flush: the default delay is 5 s."""
    t = telemetry_from_environment(
        monkeypatch,
        {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"},
    )
    try:
        record_requests(t)
        assert receiver.wait_for("traces", timeout=3.0)
        assert sum(receiver.spans_per_post()) == 2
    finally:
        t.shutdown()


@pytest.mark.e2e
def test_otel_bsp_max_export_batch_size_bounds_each_export(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    export = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "60000"}
    t = telemetry_from_environment(monkeypatch, {**export, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "2"})
    record_requests(t, 3)
    t.shutdown()
    assert receiver.spans_per_post() == [2, 2, 2]
    receiver.got.clear()
    monkeypatch.delenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE")
    t = telemetry_from_environment(monkeypatch, export)
    record_requests(t, 3)
    t.shutdown()
    assert receiver.spans_per_post() == [6]  # the default batch is 512


@pytest.mark.e2e
def test_otel_bsp_max_queue_size_drops_spans_past_it_while_the_collector_is_slow(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A queue of 3: the first batch (3 spans) is held by the collector, the one left and two
    more wait, the rest of 14 spans are dropped and counted in the log."""
    receiver.answer.clear()
    t = telemetry_from_environment(
        monkeypatch,
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "OTEL_BSP_SCHEDULE_DELAY": "60000",  # only a full batch or the shutdown sends
            "OTEL_BSP_MAX_QUEUE_SIZE": "3",  # and the batch is at most the queue
        },
    )
    try:
        record_requests(t, 2)  # the third span fills a batch: it leaves, the fourth waits
        assert receiver.wait_for("traces")
        record_requests(t, 5)  # two more fit in the queue, eight do not
    finally:
        receiver.answer.set()
        with caplog.at_level("WARNING", logger="warmroute.telemetry"):
            t.shutdown()
    assert receiver.spans_per_post() == [3, 3]
    assert "dropped 8 spans: the export queue was full" in caplog.text


# -- TLS to the collector: CA certificate, client key and certificate ----------------------------

TLS_VARS = ("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE")


def tls_env(pki: Pki, prefix: str) -> dict[str, str]:
    """The three TLS variables named with `prefix` (OTEL_EXPORTER_OTLP_ or a signal's)."""
    files = (pki.ca, pki.client_key, pki.client_cert)
    return {f"{prefix}{what}": str(path) for what, path in zip(TLS_VARS, files, strict=True)}


def mutual_tls(pki: Pki) -> ssl.SSLContext:
    return server_context(pki, require_client_cert=True)


SIGNAL_ONLY = {
    "traces": {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none"},
    "metrics": {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "otlp"},
}


@pytest.mark.e2e
def test_otel_exporter_otlp_certificate_verifies_a_tls_collector(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OTEL_EXPORTER_OTLP_CERTIFICATE names the CA of a collector whose certificate no system
    CA signed: with it the spans arrive, without it the export fails verification. It wins
    over the CA bundle that REQUESTS_CA_BUNDLE names (as in many container images), which the
    SDK's exporter on its own lets replace it."""
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(pki.other_ca))
    monkeypatch.setenv("CURL_CA_BUNDLE", str(pki.other_ca))
    with collector(server_context(pki, require_client_cert=False)) as rcv:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rcv.url, "OTEL_EXPORTER_OTLP_TIMEOUT": "500"}
        export_one_request(monkeypatch, env)
        assert rcv.got == []
        export_one_request(monkeypatch, {**env, "OTEL_EXPORTER_OTLP_CERTIFICATE": str(pki.ca)})
        assert len(rcv.on("traces")) == 1 and rcv.got[0].client_cn is None


@pytest.mark.e2e
@pytest.mark.parametrize("signal", ["traces", "metrics"])
@pytest.mark.parametrize("form", ["general", "per-signal"])
def test_otel_exporter_otlp_client_key_and_certificate_pass_mutual_tls(
    pki: Pki, monkeypatch: pytest.MonkeyPatch, signal: str, form: str
) -> None:
    """OTEL_EXPORTER_OTLP_CLIENT_KEY and OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE (and the
    OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY, OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE,
    OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE, OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY,
    OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE, OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE
    forms) present the client certificate a collector requires."""
    prefix = "OTEL_EXPORTER_OTLP_" if form == "general" else f"OTEL_EXPORTER_OTLP_{signal.upper()}_"
    with collector(mutual_tls(pki)) as rcv:
        env = {**SIGNAL_ONLY[signal], "OTEL_EXPORTER_OTLP_ENDPOINT": rcv.url}
        export_one_request(monkeypatch, {**env, **tls_env(pki, prefix)})
        assert [r.path for r in rcv.got] == [f"/v1/{signal}"]
        assert rcv.got[0].client_cn == "warmroute client"


@pytest.mark.e2e
@pytest.mark.parametrize("dropped", TLS_VARS)
def test_each_otlp_tls_variable_is_needed_against_a_mutual_tls_collector(
    pki: Pki, monkeypatch: pytest.MonkeyPatch, dropped: str
) -> None:
    """Without any one of the three, the handshake fails and nothing arrives: each has effect."""
    with collector(mutual_tls(pki)) as rcv:
        env = tls_env(pki, "OTEL_EXPORTER_OTLP_TRACES_")
        del env[f"OTEL_EXPORTER_OTLP_TRACES_{dropped}"]
        if dropped == "CLIENT_KEY":  # the certificate alone: its key is not in the file
            env["OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE"] = str(pki.client_cert)
        export_one_request(
            monkeypatch,
            {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": rcv.url, "OTEL_EXPORTER_OTLP_TIMEOUT": "500"},
        )
        assert rcv.got == []


def test_a_tls_file_that_is_not_there_stops_the_start_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY", str(tmp_path / "nope.key"))
    with pytest.raises(ConfigError, match=r"OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY=.*nope\.key"):
        telemetry_from_environment(
            monkeypatch, {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:1"}
        )


# -- the same TLS variables over gRPC ------------------------------------------------------------


@contextlib.contextmanager
def grpc_collector(pki: Pki) -> Iterator[tuple[str, list[str]]]:
    """An OTLP/gRPC receiver on loopback that requires a client certificate; yields its
    https URL and the signals of the exports it took."""
    from concurrent import futures

    grpc = pytest.importorskip("grpc")
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as mpb
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as mgrpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc

    took: list[str] = []

    class Traces(tgrpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            took.append("traces")
            return tpb.ExportTraceServiceResponse()

    class Metrics(mgrpc.MetricsServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            took.append("metrics")
            return mpb.ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    tgrpc.add_TraceServiceServicer_to_server(Traces(), server)
    mgrpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    credentials = grpc.ssl_server_credentials(
        [(pki.server_key.read_bytes(), pki.server_cert.read_bytes())],
        root_certificates=pki.ca.read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield f"https://127.0.0.1:{port}", took
    finally:
        server.stop(0)


@pytest.mark.e2e
@pytest.mark.parametrize("signal", ["traces", "metrics"])
@pytest.mark.parametrize("form", ["general", "per-signal", "mixed", "no client key"])
def test_otlp_tls_variables_resolve_one_by_one_over_grpc(
    pki: Pki, monkeypatch: pytest.MonkeyPatch, signal: str, form: str
) -> None:
    """Over gRPC as over HTTP, each per-signal TLS variable stands in for its general one
    alone: a general CA with a per-signal client certificate (`mixed`) passes (the SDK's gRPC
    exporters, left to themselves, ignore such a client key and fail the handshake)."""
    general = tls_env(pki, "OTEL_EXPORTER_OTLP_")
    own = tls_env(pki, f"OTEL_EXPORTER_OTLP_{signal.upper()}_")
    env = {
        "general": general,
        "per-signal": own,
        "mixed": {
            "OTEL_EXPORTER_OTLP_CERTIFICATE": str(pki.ca),
            **{k: v for k, v in own.items() if "CLIENT" in k},
        },
        "no client key": {"OTEL_EXPORTER_OTLP_CERTIFICATE": str(pki.ca)},
    }[form]
    with grpc_collector(pki) as (url, took):
        env = {
            **env,
            **SIGNAL_ONLY[signal],
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_ENDPOINT": url,
            "OTEL_EXPORTER_OTLP_TIMEOUT": "500",
        }
        export_one_request(monkeypatch, env)
        assert took == ([] if form == "no client key" else [signal])
