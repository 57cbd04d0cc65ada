"""Telemetry with the real OTel SDK: in-memory exporters, Prometheus text, OTLP/HTTP on the wire."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from proxy.config import TelemetryConfig
from proxy.routing.types import Decision
from proxy.telemetry import TTFT_BUCKETS, RequestRecord, Telemetry
from proxy.types import StreamFacts
from tests.support import SHUTDOWN_POLL_S

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
T0 = 1000.0


def facts(chunks: int = 8, **over: Any) -> StreamFacts:
    gaps = [0.01 * (1 + i % 3) for i in range(chunks - 1)]
    first = T0 + 0.2
    base: dict[str, Any] = dict(
        ttft_s=0.2,
        upstream_ttft_s=0.19,
        itl_s=gaps,
        tpot_s=sum(gaps) / max(1, chunks - 1),
        e2e_s=0.2 + sum(gaps),
        chunks=chunks,
        events=chunks + 3,
        output_tokens=chunks,
        input_tokens=100,
        cached_tokens=64,
        finish_reasons=["stop"],
        response_id="chatcmpl-42",
        response_model="qwen-0.5b",
        error=None,
        cancelled=False,
        first_output_at=first,
        last_output_at=first + sum(gaps),
        forward_s=[0.0002] * chunks,
    )
    base.update(over)
    return StreamFacts(**base)


DECISION = Decision(
    policy="prefix",
    ranking=["b1", "b2"],
    reason="highest score (warm prefix)",
    scores={"b1": {"prefix": 0.9, "queue": 1.0}},
    totals={"b1": 1.9},
    matched_blocks={"b1": 3, "b2": 1},
    prefix_blocks=5,
)


@pytest.fixture
def tel() -> Iterator[tuple[Telemetry, InMemorySpanExporter, InMemoryMetricReader]]:
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    t = Telemetry(TelemetryConfig(), span_exporter=spans, metric_readers=[reader])
    yield t, spans, reader
    t.shutdown()


def start(t: Telemetry, headers: dict[str, str] | None = None, **params: Any) -> RequestRecord:
    return t.start_request(
        request_id="req-1",
        api="chat",
        model="qwen-0.5b",
        stream=True,
        params={"max_tokens": 32, "temperature": 0.2, "top_p": 0.9, **params},
        headers=headers if headers is not None else {"traceparent": TRACEPARENT},
        t0=T0,
    )


def by_kind(spans: Any, kind: SpanKind) -> list[ReadableSpan]:
    return [s for s in spans if s.kind == kind]


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    assert data is not None
    out: dict[str, list[Any]] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


def test_one_server_span_with_a_client_span_per_attempt_under_the_callers_trace(tel: Any) -> None:
    t, spans, _ = tel
    rec = start(t)
    rec.set_decision(DECISION)
    first = rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    first.fail("connect_error")
    second = rec.attempt(backend="b2", address="10.0.0.2", port=8002, attempt=2)
    headers: dict[str, str] = {}
    second.inject_headers(headers)
    rec.finish(facts(), status=200)

    done = spans.get_finished_spans()
    (server,) = by_kind(done, SpanKind.SERVER)
    clients = by_kind(done, SpanKind.CLIENT)
    assert len(done) == 3 and len(clients) == 2
    assert server.name == "chat qwen-0.5b"
    assert format(server.context.trace_id, "032x") == CLIENT_TRACE
    assert server.parent is not None and format(server.parent.span_id, "016x") == CLIENT_SPAN
    for c in clients:
        assert c.parent is not None and c.parent.span_id == server.context.span_id
        assert c.context.trace_id == server.context.trace_id
    failed, ok = sorted(clients, key=lambda s: s.attributes["warmroute.attempt"])
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.attributes["error.type"] == "connect_error"
    assert ok.status.status_code == StatusCode.UNSET and "error.type" not in ok.attributes
    assert ok.attributes["server.address"] == "10.0.0.2" and ok.attributes["server.port"] == 8002
    # The backend gets the CLIENT span of its own attempt as parent.
    assert headers["traceparent"] == (f"00-{CLIENT_TRACE}-{format(ok.context.span_id, '016x')}-01")
    # The span covers the whole stream, from t0 to finish: longer than the last output.
    assert server.end_time is not None and server.start_time is not None
    assert server.end_time >= ok.end_time  # type: ignore[operator]


def test_server_span_attributes_follow_genai_semconv_and_routing(tel: Any) -> None:
    t, spans, _ = tel
    rec = start(t)
    rec.set_decision(DECISION)
    rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    f = facts(chunks=10)
    rec.finish(f, status=200)
    (server,) = by_kind(spans.get_finished_spans(), SpanKind.SERVER)
    a = server.attributes
    assert a is not None
    expected = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "qwen-0.5b",
        "gen_ai.request.stream": True,
        "gen_ai.request.max_tokens": 32,
        "gen_ai.request.temperature": 0.2,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.response.id": "chatcmpl-42",
        "gen_ai.response.model": "qwen-0.5b",
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": 100,
        "gen_ai.usage.output_tokens": 10,
        "gen_ai.usage.cache_read.input_tokens": 64,
        "gen_ai.response.time_to_first_chunk": 0.2,
        "server.address": "10.0.0.1",
        "server.port": 8001,
        "openai.api.type": "chat_completions",
        "warmroute.route.policy": "prefix",
        "warmroute.route.backend": "b1",
        "warmroute.route.matched_blocks": 3,
        "warmroute.route.score": 1.9,
        "warmroute.chunks": 10,
        "warmroute.itl.max_s": max(f.itl_s),
        "http.response.status_code": 200,
    }
    assert {k: a.get(k) for k in expected} == expected
    assert a["warmroute.proxy.overhead_s"] == pytest.approx(0.01)
    assert a["warmroute.itl.p50_s"] <= a["warmroute.itl.p99_s"] <= a["warmroute.itl.max_s"]
    assert "error.type" not in a and server.status.status_code == StatusCode.UNSET


def test_prompt_content_is_recorded_only_when_opted_in() -> None:
    for capture in (False, True):
        spans = InMemorySpanExporter()
        t = Telemetry(TelemetryConfig(capture_content=capture), span_exporter=spans)
        rec = start(t, messages=[{"role": "user", "content": "secret plan"}])
        rec.finish(facts(), status=200)
        text = str(dict(spans.get_finished_spans()[0].attributes or {}))
        assert ("secret plan" in text) is capture
        t.shutdown()


@pytest.mark.parametrize(
    ("mode", "cap", "chunks", "expected"),
    [
        ("off", 64, 50, 0),
        ("first", 64, 50, 1),
        ("all", 10, 50, 11),  # first_token + the first 10 chunk events
        ("sampled", 10, 50, 11),
        ("sampled", 120, 500, 121),  # the SDK keeps 128 at most
        ("all", 64, 5, 5),  # first_token + the 4 chunks after it
    ],
)
def test_chunk_events_follow_the_mode_and_stay_under_the_cap(
    mode: str, cap: int, chunks: int, expected: int
) -> None:
    spans = InMemorySpanExporter()
    cfg = TelemetryConfig(chunk_events=mode, chunk_events_cap=cap)  # type: ignore[arg-type]
    t = Telemetry(cfg, span_exporter=spans)
    rec = start(t)
    f = facts(chunks=chunks)
    rec.finish(f, status=200)
    (server,) = spans.get_finished_spans()
    events = list(server.events)
    assert len(events) == expected
    if expected:
        assert events[0].name == "first_token"
        stamps = [e.timestamp for e in events]
        assert stamps == sorted(stamps)
    if mode == "sampled" and expected > 1:
        # evenly spread, and the last chunk is always there
        assert events[-1].attributes is not None
        assert events[-1].attributes["warmroute.chunk.index"] == chunks - 1
        last_at = server.start_time + int((f.last_output_at - T0) * 1e9)  # type: ignore[operator]
        assert abs(events[-1].timestamp - last_at) < 1000  # ns
    t.shutdown()


def test_error_and_cancel_are_never_recorded_as_success(tel: Any) -> None:
    t, spans, reader = tel
    broken = start(t)
    broken.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    broken.finish(
        facts(error="incomplete_stream", finish_reasons=["error"], tpot_s=None), status=200
    )
    gone = start(t)
    gone.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    gone.finish(facts(cancelled=True, finish_reasons=["cancelled"]), status=200)
    upstream_500 = start(t)
    a = upstream_500.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    a.fail("500", status=500)
    upstream_500.finish(None, status=502, error_type="upstream_unavailable")

    servers = by_kind(spans.get_finished_spans(), SpanKind.SERVER)
    got = {s.attributes["error.type"]: s for s in servers}  # type: ignore[index]
    assert set(got) == {"incomplete_stream", "cancelled", "upstream_unavailable"}
    assert all(s.status.status_code == StatusCode.ERROR for s in servers)
    assert got["incomplete_stream"].attributes["gen_ai.response.finish_reasons"] == ("error",)  # type: ignore[index]
    assert got["cancelled"].attributes["gen_ai.response.finish_reasons"] == ("cancelled",)  # type: ignore[index]
    # the CLIENT span that carried a broken stream is an error too
    broken_client = [
        s
        for s in by_kind(spans.get_finished_spans(), SpanKind.CLIENT)
        if s.parent and s.parent.span_id == got["incomplete_stream"].context.span_id
    ]
    assert broken_client[0].status.status_code == StatusCode.ERROR

    p = points(reader)
    durations = {
        dict(dp.attributes).get("error.type") for dp in p["gen_ai.server.request.duration"]
    }
    assert durations == {"incomplete_stream", "cancelled", "upstream_unavailable"}
    # "successful responses" only: no server TTFT from the failed or cancelled ones
    assert "gen_ai.server.time_to_first_token" not in p
    # ...but the client-side view still saw its first chunks
    assert sum(dp.count for dp in p["gen_ai.client.operation.time_to_first_chunk"]) == 2
    errors = {
        tuple(sorted(dp.attributes.items())): dp.value for dp in p["warmroute.upstream.errors"]
    }
    assert errors == {(("error.type", "500"), ("warmroute.backend", "b1")): 1}


def test_metrics_come_from_the_facts_with_semconv_buckets_and_exemplars(tel: Any) -> None:
    t, spans, reader = tel
    rec = start(t)
    rec.set_decision(DECISION)
    t.observe_routing("prefix", "highest score (rotated among 3 ties)", 0.00004)
    rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    t.read_inflight(lambda: {"b1": 1})
    t.read_index(lambda: {"b1": 12}, lambda: 4096)
    f = facts(chunks=64)
    rec.finish(f, status=200)
    p = points(reader)

    (ttft,) = p["gen_ai.server.time_to_first_token"]
    assert isinstance(ttft, HistogramDataPoint)
    assert tuple(ttft.explicit_bounds) == TTFT_BUCKETS and ttft.count == 1 and ttft.sum == 0.2
    assert dict(ttft.attributes) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "qwen-0.5b",
        "server.address": "10.0.0.1",
        "server.port": 8001,
    }
    (tpoc,) = p["gen_ai.client.operation.time_per_output_chunk"]
    assert tpoc.count == 63 == f.chunks - 1  # one ITL sample per output chunk after the first
    assert tpoc.sum == pytest.approx(sum(f.itl_s)) and tpoc.max == max(f.itl_s)
    assert sum(tpoc.bucket_counts) == 63
    # (lower, upper] buckets: 0.01/0.02/0.03 land in the 0.01, 0.02 and 0.04 buckets
    bounds = list(tpoc.explicit_bounds)
    assert tpoc.bucket_counts[bounds.index(0.01)] == 21
    assert tpoc.bucket_counts[bounds.index(0.02)] == 21
    assert tpoc.bucket_counts[bounds.index(0.04)] == 21
    (tpot,) = p["gen_ai.server.time_per_output_token"]
    assert tpot.sum == pytest.approx(f.tpot_s)
    tokens = {
        dict(dp.attributes)["gen_ai.token.type"]: dp.sum for dp in p["gen_ai.client.token.usage"]
    }
    assert tokens == {"input": 100, "output": 64}
    (overhead,) = p["warmroute.proxy.overhead"]
    assert overhead.sum == pytest.approx(0.01)
    (fwd,) = p["warmroute.proxy.chunk_forward.duration"]
    assert fwd.count == 64
    (cached,) = p["warmroute.prefix.cached_tokens"]
    assert cached.sum == 64
    (decisions,) = p["warmroute.route.decisions"]
    assert decisions.value == 1
    assert (
        dict(decisions.attributes)["warmroute.route.reason"]
        == "highest score (rotated among N ties)"
    )
    (inflight,) = p["warmroute.backend.inflight"]
    assert inflight.value == 1
    (held,) = p["warmroute.prefix.blocks"]
    assert held.value == 12 and dict(held.attributes) == {"warmroute.backend": "b1"}
    (index_bytes,) = p["warmroute.prefix.index.memory"]
    assert index_bytes.value == 4096 and not dict(index_bytes.attributes)

    # exemplars link the histogram to this request's trace
    (server,) = by_kind(spans.get_finished_spans(), SpanKind.SERVER)
    assert ttft.exemplars and ttft.exemplars[0].trace_id == server.context.trace_id
    assert ttft.exemplars[0].span_id == server.context.span_id


def test_predicted_and_actual_prefix_hit_ratios(tel: Any) -> None:
    t, _, reader = tel
    rec = start(t)
    d = Decision(policy="prefix", ranking=["b1"], reason="r", matched_blocks={"b1": 2})
    if hasattr(d, "prompt_chars"):
        d.block_chars, d.prompt_chars = 64, 256
    rec.set_decision(d)
    rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    rec.finish(facts(input_tokens=100, cached_tokens=64), status=200)
    ratios = {
        dict(dp.attributes)["warmroute.prefix.source"]: dp.sum
        for dp in points(reader)["warmroute.prefix.hit_ratio"]
    }
    assert ratios["actual"] == pytest.approx(0.64)
    if hasattr(d, "prompt_chars"):
        assert ratios["predicted"] == pytest.approx(0.5)


def test_without_a_trace_exporter_metrics_still_work_and_context_still_propagates() -> None:
    reader = InMemoryMetricReader()
    t = Telemetry(TelemetryConfig(traces_exporter="none"), metric_readers=[reader])
    rec = start(t)
    a = rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    headers: dict[str, str] = {}
    a.inject_headers(headers)
    rec.finish(facts(), status=200)
    assert headers["traceparent"].startswith(f"00-{CLIENT_TRACE}-")
    assert points(reader)["gen_ai.server.time_to_first_token"][0].count == 1
    t.shutdown()


def test_prometheus_text_has_the_histograms_with_semconv_buckets(tel: Any) -> None:
    t, _, _ = tel
    rec = start(t)
    rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    rec.finish(facts(), status=200)
    body, ctype = t.prometheus_text()
    text = body.decode()
    assert ctype.startswith("text/plain")
    assert "# TYPE gen_ai_server_time_to_first_token_seconds histogram" in text
    les = [
        line.split('le="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("gen_ai_server_time_to_first_token_seconds_bucket")
    ]
    assert [float(x) for x in les[:-1]] == list(TTFT_BUCKETS) and les[-1] == "+Inf"
    for name in (
        "gen_ai_server_time_per_output_token_seconds_bucket",
        "gen_ai_server_request_duration_seconds_bucket",
        "gen_ai_client_operation_time_to_first_chunk_seconds_bucket",
        "gen_ai_client_operation_time_per_output_chunk_seconds_count",
        "gen_ai_client_token_usage",
        "warmroute_proxy_overhead_seconds_bucket",
    ):
        assert name in text, name
    # its own registry: two Telemetry objects do not collide on the global one
    other = Telemetry(TelemetryConfig())
    assert b"gen_ai_server_time_to_first_token" not in other.prometheus_text()[0]
    other.shutdown()


# ---------------------------------------------------------------------------------------------
# On the wire: OTLP/HTTP protobuf to a receiver in this test.


class _Receiver(BaseHTTPRequestHandler):
    bodies: dict[str, list[bytes]]
    got: threading.Event

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.bodies.setdefault(self.path, []).append(body)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()
        self.got.set()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.e2e
def test_otlp_http_export_reaches_a_receiver_as_protobuf() -> None:
    bodies: dict[str, list[bytes]] = {}
    handler = type("H", (_Receiver,), {"bodies": bodies, "got": threading.Event()})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(SHUTDOWN_POLL_S,), daemon=True)
    thread.start()
    try:
        cfg = TelemetryConfig(
            traces_exporter="otlp",
            metrics_exporter="otlp",
            otlp_endpoint=f"http://127.0.0.1:{server.server_port}",
            prometheus=False,
        )
        t = Telemetry(cfg)
        rec = start(t)
        t.observe_routing("prefix", "highest score", 0.0001)
        rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
        t.read_inflight(lambda: {"b1": 1})
        rec.finish(facts(), status=200)
        t.shutdown()  # flushes the batch span processor and the periodic metric reader
    finally:
        server.shutdown()

    traces = ExportTraceServiceRequest()
    for b in bodies["/v1/traces"]:
        traces.MergeFromString(b)
    spans = [s for rs in traces.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert sorted(s.name for s in spans) == ["chat qwen-0.5b", "chat qwen-0.5b"]
    server_span = next(s for s in spans if s.kind == s.SPAN_KIND_SERVER)
    assert server_span.trace_id.hex() == CLIENT_TRACE
    attrs = {kv.key: kv.value for kv in server_span.attributes}
    assert attrs["gen_ai.usage.output_tokens"].int_value == 8

    metrics = ExportMetricsServiceRequest()
    for b in bodies["/v1/metrics"]:
        metrics.MergeFromString(b)
    found = {
        m.name: m for rm in metrics.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }
    ttft = found["gen_ai.server.time_to_first_token"].histogram.data_points[0]
    assert list(ttft.explicit_bounds) == list(TTFT_BUCKETS) and ttft.count == 1
    assert ttft.exemplars[0].trace_id.hex() == CLIENT_TRACE
    assert (
        found["gen_ai.client.operation.time_per_output_chunk"].histogram.data_points[0].count == 7
    )
    assert found["warmroute.route.decisions"].sum.data_points[0].as_int == 1
    assert found["warmroute.backend.inflight"].sum.data_points[0].as_int == 1


def test_every_metric_on_the_grafana_dashboard_is_exported(tel: Any) -> None:
    """A number on a dashboard must be measured: each series it queries is in /metrics."""
    import json
    import re
    from pathlib import Path

    t, _, _ = tel
    d = Decision(policy="prefix", ranking=["b1"], reason="r", matched_blocks={"b1": 1})
    if hasattr(d, "prompt_chars"):
        d.block_chars, d.prompt_chars = 64, 128
    rec = start(t)
    rec.set_decision(d)
    t.observe_routing("prefix", "r", 0.0001)
    rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1).fail("500", 500)
    rec.attempt(backend="b2", address="10.0.0.2", port=8002, attempt=2)
    t.read_inflight(lambda: {"b2": 1})
    t.read_index(lambda: {"b2": 3}, lambda: 1000)
    rec.finish(facts(), status=200)
    t.refused(401, "invalid_api_key")  # a request the proxy answered itself
    text = t.prometheus_text()[0].decode()
    dash = Path(__file__).parent.parent / "deploy/grafana/dashboards/warmroute.json"
    exprs = [
        tg["expr"] for p in json.loads(dash.read_text())["panels"] for tg in p.get("targets", [])
    ]
    used = {m for e in exprs for m in re.findall(r"\b((?:gen_ai|warmroute)_[a-z_]+)[{\[]", e)}
    assert len(used) >= 12
    missing = sorted(m for m in used if not re.search(rf"^{m}[{{ ]", text, re.M))
    assert not missing


def test_span_records_scores_only_when_the_decision_computed_them(tel: Any) -> None:
    """Lazy scores a picker never read are not run just to describe the decision."""
    from proxy.routing.types import BackendView, EngineLoad, RouteContext, Scores, ScoresByBackend

    class Counting:
        name = "queue"
        runs = 0

        def score(self, ctx: RouteContext, candidates: list[BackendView]) -> dict[str, float]:
            Counting.runs += 1
            return {b.name: 0.5 for b in candidates}

    view = BackendView("b1", "http://b1", "vllm", "mixed", 1.0, True, 0, EngineLoad(), None)
    ctx = RouteContext(request_id="r", model="m", api="chat", body={}, headers={}, now=0.0)
    t, spans, _ = tel
    for read_by_picker in (False, True):
        lazy = Scores([(Counting(), 2.0)], ctx, [view])
        if read_by_picker:
            assert lazy["b1"] == 1.0
        d = Decision("p", ["b1"], "why", scores=ScoresByBackend(lazy), totals=lazy)
        rec = start(t)
        rec.set_decision(d)
        rec.finish(facts(), status=200)
        a = spans.get_finished_spans()[-1].attributes or {}
        if read_by_picker:
            assert a["warmroute.route.score"] == 1.0 and a["warmroute.route.score.queue"] == 0.5
        else:
            assert "warmroute.route.score" not in a and Counting.runs == 0
            assert a["warmroute.route.backend"] == "b1"  # the rest of the decision is there
    assert Counting.runs == 1


@pytest.mark.parametrize("traced", [False, True])
def test_a_finished_request_leaves_nothing_for_the_cyclic_gc(traced: bool) -> None:
    """Reference counting frees a request's telemetry, facts and decision as it finishes: a
    cycle would leave them to the cyclic GC, whose collections grow with every request.

    The collector is process-wide: a thread an earlier test left running (an exporter
    retrying a closed collector makes traceback cycles) can add garbage of its own while this
    runs, one suite in a few. So what is checked is the garbage a request's cycle must hold:
    any object of warmroute's own classes or of the OTel SDK's spans and contexts."""
    import gc

    from proxy.telemetry.batcher import EncodedBatcher

    class Exporter:
        def export_encoded(self, data: bytes) -> bool:
            return True

        def shutdown(self) -> None:
            pass

    t = Telemetry(TelemetryConfig())
    if traced:  # the OTLP/HTTP path: spans encoded as they end, bytes queued for export
        t = Telemetry(TelemetryConfig(), span_exporter=InMemorySpanExporter())
        sink = EncodedBatcher(Exporter(), t.resource, t.scope)  # type: ignore[arg-type]
        t.spans.sink, t.spans.processors = sink, (sink,)
    gc.collect()
    gc.disable()
    try:
        for i in range(50):
            rec = start(t, headers={} if i % 2 else {"traceparent": TRACEPARENT})
            rec.set_decision(DECISION)
            if i % 5 == 0:
                rec.attempt(backend="b2", address="10.0.0.2", port=8002, attempt=1).fail("x")
            rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=2).inject_headers({})
            rec.finish(facts(), status=200)
        del rec
        if traced:  # a SERVER and a CLIENT span a request, and the failed attempts' spans
            assert len(sink._queue) == 50 * 2 + 10
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in gc.garbage
        gc.collect()
        ours = [o for o in gc.garbage if type(o).__module__.startswith(REQUEST_MODULES)]
        assert ours == [], sorted({type(o).__qualname__ for o in ours})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        t.shutdown()


# Where the classes of a request's objects live (its record, facts, decision, spans, context).
REQUEST_MODULES = ("proxy.", "plugins.", "opentelemetry.sdk.trace", "opentelemetry.trace",
                   "opentelemetry.context", "tests.")  # fmt: skip


def test_shutdown_with_the_collector_down_gives_up_after_its_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The exporters' own retries would hold a stopping proxy for ~15 s; the deadline ends
    them, and the log says the last export was dropped."""
    import time

    from tests.support import free_port

    cfg = TelemetryConfig(traces_exporter="otlp", otlp_endpoint=f"http://127.0.0.1:{free_port()}")
    t = Telemetry(cfg)
    rec = start(t)
    rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    rec.finish(facts(), status=200)
    began = time.monotonic()
    t.shutdown(deadline_s=0.5)
    assert time.monotonic() - began < 5.0  # the retries alone take ~15 s
    assert "did not take the last export in time" in caplog.text


def test_the_span_says_which_source_the_winners_match_came_from(tel: Any) -> None:
    t, spans, _ = tel
    for exact, source in ((frozenset({"b1"}), "kv_events"), (frozenset({"b2"}), "index")):
        rec = start(t)
        d = Decision(policy="p", ranking=["b1"], reason="r", matched_blocks={"b1": 2}, exact=exact)
        rec.set_decision(d)
        rec.finish(None, status=200)
        server = by_kind(spans.get_finished_spans(), SpanKind.SERVER)[-1]
        assert server.attributes["warmroute.route.match_source"] == source
    rec = start(t)
    rec.set_decision(DECISION)  # no backend publishes KV events: the index, and no attribute
    rec.finish(None, status=200)
    server = by_kind(spans.get_finished_spans(), SpanKind.SERVER)[-1]
    assert "warmroute.route.match_source" not in server.attributes
