"""The hand-written OTLP span encoder against the SDK's: the same protobuf, message for message."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from proxy.config import TelemetryConfig
from proxy.routing.types import Decision
from proxy.telemetry import Telemetry, attributes
from proxy.telemetry.batcher import EncodedBatcher
from proxy.telemetry.providers import otlp_span_exporter
from proxy.telemetry.render import compile_fields
from proxy.telemetry.wire import encode_spans_fast
from tests.test_telemetry import DECISION, facts, start


def same_as_sdk(spans: Any) -> ExportTraceServiceRequest:
    ours = ExportTraceServiceRequest.FromString(encode_spans_fast(spans))
    assert ours == encode_spans(spans)
    return ours


def proxy_spans(cfg: TelemetryConfig | None = None) -> list[ReadableSpan]:
    """Spans of a retried request, an error, a cancel and a tracestate-carrying parent."""
    spans = InMemorySpanExporter()
    t = Telemetry(cfg or TelemetryConfig(), span_exporter=spans)
    d = Decision(
        policy="prefix",
        ranking=["b1", "b2"],
        reason="highest score",
        scores={"b1": {"prefix": 0.9, "queue": -1.5}},
        totals={"b1": 1.9},
        matched_blocks={"b1": 3},
        prefix_blocks=5,
        prompt_chars=400,
        filtered_out={"b3": "unhealthy: connect refused ✗"},
        exact=frozenset({"b1"}),  # b1's engine publishes KV events: the match is its word
    )
    rec = start(t, stop=["\n\n", "ünïcödé"], n=2, seed=-7, messages=[{"x": "y" * 300}])
    rec.set_decision(d)
    rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1).fail("http_503", 503)
    rec.attempt(backend="b2", address="10.0.0.2", port=8002, attempt=2)
    rec.finish(facts(chunks=40), status=200)

    broken = start(t, headers={"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"})
    broken.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    broken.finish(facts(error="upstream_stream_error", finish_reasons=["error"]), status=200)

    gone = start(
        t,
        headers={
            "traceparent": "00-" + "12" * 16 + "-" + "34" * 8 + "-01",
            "tracestate": "vendor=abc,other=1",
        },
    )
    gone.set_decision(DECISION)
    gone.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    gone.finish(None, status=499, error_type="cancelled")

    root = start(t, headers={})
    root.finish(None, status=404, error_type="model_not_found")
    t.shutdown()
    return list(spans.get_finished_spans())


@pytest.mark.parametrize("mode", ["off", "first", "sampled", "all"])
def test_the_proxys_spans_encode_exactly_as_the_sdk_encodes_them(mode: str) -> None:
    cfg = TelemetryConfig(chunk_events=mode, capture_content=True)  # type: ignore[arg-type]
    spans = proxy_spans(cfg)
    assert len(spans) == 8
    req = same_as_sdk(spans)
    encoded = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert len(encoded) == 8
    server = next(s for s in encoded if s.trace_id.hex() == "12" * 16 and s.kind == 2)
    assert server.trace_state == "vendor=abc,other=1"
    assert server.flags == 0x300  # parent came over the wire
    # one export can carry spans of many requests
    same_as_sdk(spans * 3)


def test_sdk_made_spans_with_every_value_type_encode_as_the_sdk_encodes_them() -> None:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracer = provider.get_tracer("other", "1.2.3", schema_url="https://example.com/schema")
    with tracer.start_as_current_span("outer", kind=SpanKind.INTERNAL) as outer:
        outer.set_attributes(
            {
                "s": "",
                "t": "x" * 200,
                "b": False,
                "i0": 0,
                "neg": -(2**63),
                "big": 2**63 - 1,
                "f": -0.0,
                "inf": float("inf"),
                "bools": [True, False],
                "ints": [1, -2, 300],
                "floats": [0.5],
                "strs": ["a", ""],
                "empty": [],
            }
        )
        outer.add_event("e", {"k": 1.5})
        outer.add_event("bare")
        outer.set_status(Status(StatusCode.OK))
        with tracer.start_as_current_span("inner", kind=SpanKind.PRODUCER) as inner:
            inner.set_status(Status(StatusCode.ERROR, "went wrong"))
        # values equal in Python but not on the wire must not share an encoding
        for i, v in enumerate([1, True, 1.0, (1, 0), (True, False), (1.0, 0.0), "1", ("1",)]):
            with tracer.start_as_current_span(f"v{i}") as s:
                s.set_attribute("v", v)
    provider.shutdown()
    for _ in range(2):  # the second time from the field cache
        same_as_sdk(spans.get_finished_spans())
    same_as_sdk([])


def test_the_otlp_http_exporter_uses_the_fast_encoder() -> None:
    exporter: Any = otlp_span_exporter(
        TelemetryConfig(traces_exporter="otlp", otlp_endpoint="http://127.0.0.1:9")
    )
    sent: list[bytes] = []

    class Client:
        def export(self, data: bytes) -> Any:
            sent.append(data)
            return type("R", (), {"success": True})()

    exporter._client = Client()
    spans = proxy_spans()
    assert exporter.export(spans).name == "SUCCESS"
    assert sent == [encode_spans_fast(spans)]


def scenario(t: Telemetry) -> None:
    """Requests that reach every branch of the encoded attribute writers."""
    rec = start(t, headers={"traceparent": "00-" + "12" * 16 + "-" + "34" * 8 + "-01"})
    rec.set_decision(DECISION)
    rec.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1).fail("http_503", 503)
    rec.attempt(backend="b2", address="10.0.0.2", port=8002, attempt=2)
    rec.finish(facts(chunks=40), status=200)
    # aliases, ints where floats are usual, n, stop, content, a seed too big for an int64
    odd = start(
        t,
        headers={},
        max_completion_tokens=7,
        max_output_tokens=9,
        temperature=1,
        n=3,
        stop="\n",
        seed=2**70,
        messages=[{"role": "user", "content": "ünï"}],
    )
    odd.set_decision(
        Decision(
            policy="p",
            ranking=["b1"],
            reason="r",
            scores={"b1": {"prefix": 1, "queue": 0.5, "flag": True}},
            totals={"b1": 2},
            matched_blocks={"b1": 40},
            prompt_chars=100,
            filtered_out={"b3": "down"},
        )
    )
    odd.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    odd.finish(
        facts(chunks=3, cancelled=True, cached_tokens=0, ttft_s=None, response_id=None),
        status=499,
    )
    broken = start(t, headers={}, stop=["a", "b"])
    broken.set_decision(Decision(policy="p", ranking=[], reason="none"))
    broken.finish(facts(chunks=1, itl_s=[], error="upstream_stream_error"), status=200)
    gone = start(t, headers={})
    gone.attempt(backend="b1", address="10.0.0.1", port=8001, attempt=1)
    gone.finish(None, status=499, error_type="cancelled")
    start(t, headers={}).finish(None, status=404, error_type="model_not_found")
    start(t, headers={}).finish(None, status=200)


@pytest.mark.parametrize("mode", ["off", "first", "sampled", "all"])
@pytest.mark.parametrize("content", [False, True])
def test_spans_encoded_as_they_end_match_the_sdk_encoding(
    monkeypatch: pytest.MonkeyPatch, mode: str, content: bool
) -> None:
    """The OTLP/HTTP path writes attributes straight into protobuf (no dict, no
    ReadableSpan): the same bytes as the SDK path's spans encoded, twice (the caches)."""
    import types

    from proxy.telemetry import record

    clock = types.SimpleNamespace(
        time_ns=lambda: 1_700_000_000_000_000_000, perf_counter=lambda: 5.0
    )
    monkeypatch.setattr(record, "time", clock)

    class Ids:
        def __init__(self) -> None:
            self.n = 0

        def generate_trace_id(self) -> int:
            self.n += 1
            return 0xABC0000 + self.n

        def generate_span_id(self) -> int:
            self.n += 1
            return 0xDE00 + self.n

    sent: list[bytes] = []

    class Exporter:
        def export_encoded(self, data: bytes) -> bool:
            sent.append(data)
            return True

        def shutdown(self) -> None:
            pass

    def telemetry(direct: bool) -> tuple[Telemetry, InMemorySpanExporter]:
        mem = InMemorySpanExporter()
        cfg = TelemetryConfig(chunk_events=mode, capture_content=content)  # type: ignore[arg-type]
        t = Telemetry(cfg, span_exporter=mem)
        t.spans.ids = Ids()  # type: ignore[assignment]
        if direct:
            sink = EncodedBatcher(Exporter(), t.resource, t.scope)  # type: ignore[arg-type]
            t.spans.sink = sink
            t.spans.processors = (sink,)
        return t, mem

    runs = []
    for direct in (False, True):
        t, mem = telemetry(direct)
        scenario(t)
        scenario(t)
        if direct:
            t.spans.sink.shutdown()  # type: ignore[union-attr]
            runs.append(b"".join(sent))
        else:
            assert len(mem.get_finished_spans()) == 20
            runs.append(encode_spans_fast(mem.get_finished_spans()))
    sdk, direct_bytes = runs
    assert len(sent) == 1
    assert ExportTraceServiceRequest.FromString(direct_bytes) == (
        ExportTraceServiceRequest.FromString(sdk)
    )
    assert direct_bytes == sdk


def test_a_group_compiles_only_when_its_writer_is_used_as_writer_calls() -> None:
    """compile_fields inlines `w.<method>(...)` statements; anything else could not be."""

    def passes_its_writer_on(w: Any, v: float) -> None:
        attributes.events(w, "first", 1, v, (0, 0.0))  # type: ignore[arg-type]

    def returns_a_value(w: Any, v: float) -> Any:
        w.double(attributes.TTFC, v)
        return v

    for group in (passes_its_writer_on, returns_a_value):
        with pytest.raises(TypeError):
            compile_fields(group)

    def timings(w: Any, v: float) -> None:
        w.double(attributes.TTFC, v)
        w.double(attributes.E2E, v * 2)

    assert compile_fields(timings)(0.25) == (attributes.TTFC.f(0.25) + attributes.E2E.f(0.5))


def test_a_group_without_source_is_encoded_through_the_dict_writer() -> None:
    namespace: dict[str, Any] = {"TTFC": attributes.TTFC}
    exec("def timing(w, v):\n    w.double(TTFC, v)\n", namespace)  # no file to read it from
    assert compile_fields(namespace["timing"])(0.25) == attributes.TTFC.f(0.25)
