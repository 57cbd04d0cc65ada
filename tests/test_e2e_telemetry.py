"""Telemetry end to end: real sockets, the real proxy, a backend of known timing, the real SDK.

What the unit tests in test_telemetry.py cannot show: that the spans and metrics the proxy
records for a live request describe what its client actually saw (TTFT against a stopwatch
around the same request, chunk counts, usage), that failures are never recorded as successes,
that W3C context crosses both hops, and that OTLP/HTTP export from a running proxy arrives on
the wire as protobuf a collector can decode.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from proxy.bench.mock import MockBackend, Reply, prompt_tokens
from proxy.config import Config
from proxy.server.app import create_app
from proxy.telemetry import Telemetry
from tests.support import SHUTDOWN_POLL_S, ServerThread, free_port, until

pytestmark = pytest.mark.e2e

MODEL = "test-model"
CHAT = "/v1/chat/completions"
WAIT_S = 10.0  # deadline for anything that should happen within milliseconds


# ---------------------------------------------------------------------------------------------
# Harness


class Captured:
    """A proxy on loopback whose Telemetry exports to the SDK's in-memory exporter/reader."""

    def __init__(self, config: dict[str, Any]) -> None:
        cfg = Config.model_validate(config)
        self.spans = InMemorySpanExporter()
        self.reader = InMemoryMetricReader()
        self.tel = Telemetry(cfg.telemetry, span_exporter=self.spans, metric_readers=[self.reader])
        port = config.get("server", {}).get("port")  # set when /admin shares the serving port
        self.server = ServerThread(create_app(cfg, telemetry=self.tel), port=port).start()
        self.url = self.server.url

    def request_spans(
        self, request_id: str, timeout: float = WAIT_S
    ) -> tuple[ReadableSpan, list[ReadableSpan]]:
        """The SERVER span of request_id and its CLIENT children (by start time), once ended.

        The proxy ends its spans just after the last byte is sent, so a client that has read the
        whole response may be a moment early: poll with a deadline.
        """
        deadline = time.monotonic() + timeout
        while True:
            finished = self.spans.get_finished_spans()
            server = next(
                (
                    s
                    for s in finished
                    if s.kind == SpanKind.SERVER
                    and (s.attributes or {}).get("warmroute.request.id") == request_id
                ),
                None,
            )
            if server is not None:
                assert server.context is not None
                sid = server.context.span_id
                children = [s for s in finished if s.parent is not None and s.parent.span_id == sid]
                children.sort(key=lambda s: s.start_time or 0)
                return server, children
            if time.monotonic() > deadline:
                raise AssertionError(f"no SERVER span for request {request_id} in {timeout}s")
            time.sleep(0.005)

    def histograms(self) -> dict[str, dict[tuple[tuple[str, Any], ...], tuple[int, float]]]:
        """name -> {sorted attributes: (count, sum)}: a cumulative snapshot to diff."""
        data = self.reader.get_metrics_data()
        out: dict[str, dict[tuple[tuple[str, Any], ...], tuple[int, float]]] = {}
        if data is None:
            return out
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for p in m.data.data_points:
                        if isinstance(p, HistogramDataPoint):
                            key = tuple(sorted((p.attributes or {}).items()))
                            out.setdefault(m.name, {})[key] = (p.count, p.sum)
        return out

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def captured() -> Iterator[Callable[[dict[str, Any]], Captured]]:
    started: list[Captured] = []

    def start(config: dict[str, Any]) -> Captured:
        c = Captured(config)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


def delta(
    before: dict[str, dict[Any, tuple[int, float]]],
    after: dict[str, dict[Any, tuple[int, float]]],
    name: str,
    **match: Any,
) -> tuple[int, float]:
    """(count, sum) added to histogram `name` between two snapshots, over matching points."""
    count, total = 0, 0.0
    for key, (c, s) in after.get(name, {}).items():
        attrs = dict(key)
        if all(attrs.get(k) == v for k, v in match.items()):
            c0, s0 = before.get(name, {}).get(key, (0, 0.0))
            count += c - c0
            total += s - s0
    return count, total


def attrs_of(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def new_traceparent() -> tuple[str, str, str]:
    trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def split_traceparent(header: str) -> tuple[str, int, bool]:
    """(trace id hex, parent span id, sampled) of a W3C traceparent (other flag bits vary)."""
    version, trace_id, span_id, flags = header.split("-")
    assert version == "00" and len(trace_id) == 32 and len(span_id) == 16, header
    return trace_id, int(span_id, 16), bool(int(flags, 16) & 1)


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="client-key", max_retries=0, timeout=30)


def assert_not_success(span: ReadableSpan) -> None:
    assert span.status.status_code == StatusCode.ERROR, (span.name, span.status)
    assert attrs_of(span).get("error.type"), span.attributes


# ---------------------------------------------------------------------------------------------
# 1. The span tree, its attributes, and W3C trace context across both hops


def test_span_tree_with_a_retried_attempt_and_trace_context_on_both_hops(
    fake_backends: Any, captured: Callable[[dict[str, Any]], Captured]
) -> None:
    # A backend that passes the proxy's startup health check, then goes away: the next request
    # routed to it gets "connection refused" and is retried on the other one.
    [(backend_app, backend), (_, doomed)] = fake_backends(2)
    dead_port = doomed.port
    proxy = captured(
        {
            "backends": [{"url": doomed.url}, {"url": backend.url}],
            "routing": {"policy": "round_robin"},
            "health": {"interval_s": 60, "models_refresh_s": 60},
        }
    )
    doomed.stop()
    live_name = f"127.0.0.1:{backend.port}"
    oai = client(proxy.url)
    seen: list[tuple[ReadableSpan, list[ReadableSpan]]] = []
    retried: tuple[ReadableSpan, list[ReadableSpan]] | None = None
    # Round robin puts the dead backend first at least once in two turns; after the refusal it
    # is cooled down, so one more request afterwards shows the single-attempt tree.
    for i in range(5):
        traceparent, trace_id, parent_id = new_traceparent()
        request_id = f"tree-{i}"
        stream = oai.chat.completions.create(
            **chat("hello there chunks:4"),
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=16,
            temperature=0.5,
            top_p=0.9,
            extra_headers={"traceparent": traceparent, "x-request-id": request_id},
        )
        chunks = list(stream)
        usage = chunks[-1].usage
        assert usage is not None  # asked for, so not stripped
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "tok0 tok1 tok2 tok3 "

        server, children = proxy.request_spans(request_id)
        seen.append((server, children))
        a = attrs_of(server)
        # SERVER span: named per semconv, child of the caller's span, in the caller's trace
        assert server.kind == SpanKind.SERVER
        assert server.name == f"chat {MODEL}"
        assert server.context is not None and server.parent is not None
        assert f"{server.context.trace_id:032x}" == trace_id
        assert f"{server.parent.span_id:016x}" == parent_id
        assert server.parent.is_remote
        assert server.status.status_code == StatusCode.UNSET  # success is never marked error
        assert "error.type" not in a
        expected = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": MODEL,
            "gen_ai.request.stream": True,
            "gen_ai.request.max_tokens": 16,
            "gen_ai.request.temperature": 0.5,
            "gen_ai.request.top_p": 0.9,
            "gen_ai.response.id": chunks[0].id,
            "gen_ai.response.model": MODEL,
            "gen_ai.response.finish_reasons": ("length",),
            # the backend's own usage, exactly as its client saw it
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": 0,
            "server.address": "127.0.0.1",
            "server.port": backend.port,
            "warmroute.backend": live_name,
            "warmroute.route.policy": "round_robin",
            "warmroute.request.id": request_id,
            "warmroute.chunks": 4,
            "http.response.status_code": 200,
            "openai.api.type": "chat_completions",
        }
        assert {k: a.get(k) for k in expected} == expected
        assert usage.completion_tokens == 4
        assert a["gen_ai.response.time_to_first_chunk"] > 0
        assert [e.name for e in server.events] == ["first_token"]  # default chunk_events: first
        assert children and all(c.kind == SpanKind.CLIENT for c in children)
        assert all(c.name == server.name for c in children)
        for child in children:
            assert child.context is not None
            assert child.context.trace_id == server.context.trace_id
        # The backend got the traceparent of the CLIENT span that carried the response.
        last = children[-1]
        assert last.context is not None
        sent = backend_app.rec.requests[-1]["headers"]
        assert split_traceparent(sent["traceparent"]) == (trace_id, last.context.span_id, True)
        assert sent["x-request-id"] == request_id
        la = attrs_of(last)
        assert la["server.address"] == "127.0.0.1" and la["server.port"] == backend.port
        assert la["warmroute.backend"] == live_name
        assert la["warmroute.attempt"] == len(children)
        assert la["gen_ai.request.model"] == MODEL
        assert last.status.status_code == StatusCode.UNSET
        # The CLIENT span covers the whole stream, not just the response headers.
        assert last.end_time is not None and server.end_time is not None
        assert last.end_time == server.end_time
        if len(children) == 2:
            retried = (server, children)
        elif retried is not None:
            break

    assert retried is not None, [len(c) for _, c in seen]
    server, (first, second) = retried
    assert_not_success(first)
    fa = attrs_of(first)
    assert fa["error.type"] == "connect_error"
    assert fa["server.port"] == dead_port and fa["warmroute.attempt"] == 1
    assert fa["warmroute.backend"] == f"127.0.0.1:{dead_port}"
    assert first.end_time is not None and second.start_time is not None
    assert first.end_time <= second.start_time  # attempts are sequential
    assert attrs_of(second)["warmroute.attempt"] == 2
    assert attrs_of(server)["warmroute.route.retries"] == 1
    # Only one upstream request per client request ever reached the live backend.
    assert len(backend_app.rec.requests) == len(seen)
    # Requests that did not retry have exactly one CLIENT child.
    assert any(len(c) == 1 for _, c in seen)
    for s, c in seen:
        assert len(c) == 1 + attrs_of(s).get("warmroute.route.retries", 0)


def test_without_a_client_traceparent_the_proxy_starts_the_trace_and_propagates_it(
    fake_backends: Any, captured: Callable[[dict[str, Any]], Captured]
) -> None:
    [(backend_app, backend)] = fake_backends(1)
    proxy = captured({"backends": [{"url": backend.url}]})
    r = httpx.post(proxy.url + CHAT, json=chat("hi"), headers={"x-request-id": "no-parent"})
    assert r.status_code == 200
    server, [attempt] = proxy.request_spans("no-parent")
    assert server.parent is None  # a root span
    assert server.context is not None and attempt.context is not None
    a = attrs_of(server)
    assert a["gen_ai.request.stream"] is False
    assert a["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    tp = backend_app.rec.requests[-1]["headers"]["traceparent"]
    assert split_traceparent(tp) == (
        f"{server.context.trace_id:032x}",
        attempt.context.span_id,
        True,
    )


# ---------------------------------------------------------------------------------------------
# 2. Timing truth: the proxy's numbers against a stopwatch around the same request


SLOWSTART_S, CHUNKS, GAP_S = 0.2, 10, 0.03


def test_ttft_itl_usage_and_overhead_match_what_the_client_saw(
    fake_backends: Any, captured: Callable[[dict[str, Any]], Captured]
) -> None:
    [(backend_app, backend)] = fake_backends(1)
    proxy = captured({"backends": [{"url": backend.url}]})
    oai = client(proxy.url)
    # Warm up: the client's connection pool, the proxy's upstream pool, lazy imports.
    for _ in oai.chat.completions.create(**chat("warm chunks:1"), stream=True):
        pass
    # Its record is finished just after its last byte: wait for it before the snapshot.
    warm_deadline = time.monotonic() + WAIT_S
    while delta({}, proxy.histograms(), "gen_ai.server.request.duration")[0] < 1:
        assert time.monotonic() < warm_deadline
        time.sleep(0.005)
    before = proxy.histograms()

    prompt = f"slowstart:{SLOWSTART_S} chunks:{CHUNKS} delay:{GAP_S} please"
    t_start = time.perf_counter()
    stream = oai.chat.completions.create(
        **chat(prompt), stream=True, extra_headers={"x-request-id": "timed"}
    )
    t_first: float | None = None
    contents: list[str] = []
    for chunk in stream:
        assert chunk.usage is None  # the injected usage chunk is stripped: not asked for
        if chunk.choices and chunk.choices[0].delta.content:
            if t_first is None:
                t_first = time.perf_counter()
            contents.append(chunk.choices[0].delta.content)
    t_end = time.perf_counter()
    assert t_first is not None and len(contents) == CHUNKS
    client_ttft = t_first - t_start

    server, [attempt] = proxy.request_spans("timed")
    a = attrs_of(server)
    proxy_ttft = a["gen_ai.response.time_to_first_chunk"]
    upstream_ttft = a["warmroute.upstream.time_to_first_chunk"]
    overhead = a["warmroute.proxy.overhead_s"]
    print(
        f"\nclient TTFT {client_ttft * 1000:.1f} ms, proxy TTFT {proxy_ttft * 1000:.1f} ms, "
        f"upstream TTFT {upstream_ttft * 1000:.1f} ms, overhead {overhead * 1e6:.0f} us, "
        f"ITL p50 {a['warmroute.itl.p50_s'] * 1000:.1f} ms, client E2E "
        f"{(t_end - t_start) * 1000:.0f} ms"
    )
    # TTFT: never less than the backend's real delay (headers after 0.2 s, first token after
    # one more gap), never more than what the client measured. Taken at a later chunk it would
    # exceed the client's; how close the two are is the added TTFT `warmroute bench` measures.
    assert proxy_ttft >= SLOWSTART_S + GAP_S * 0.9
    assert proxy_ttft <= client_ttft
    assert upstream_ttft >= SLOWSTART_S and upstream_ttft <= proxy_ttft
    # The first_token event sits at t0 + TTFT.
    [event] = [e for e in server.events if e.name == "first_token"]
    assert server.start_time is not None and event.timestamp is not None
    assert abs((event.timestamp - server.start_time) / 1e9 - proxy_ttft) < 0.002
    # Chunks and ITL: one gap sample per output chunk after the first.
    assert a["warmroute.chunks"] == CHUNKS
    assert GAP_S * 0.5 <= a["warmroute.itl.p50_s"] <= GAP_S * 4
    assert a["warmroute.itl.max_s"] >= a["warmroute.itl.p50_s"]
    assert a["warmroute.e2e_s"] >= proxy_ttft + (CHUNKS - 1) * GAP_S * 0.9
    assert a["warmroute.e2e_s"] <= t_end - t_start
    # Usage: exactly the backend's (it computes usage from what it received).
    sent = backend_app.rec.requests[-1]["body"]
    usage = {"prompt_tokens": prompt_tokens(sent), "completion_tokens": CHUNKS}
    assert sent["stream_options"] == {"include_usage": True}
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == CHUNKS
    assert a["warmroute.tpot_s"] == pytest.approx(
        (a["warmroute.e2e_s"] - proxy_ttft) / (CHUNKS - 1)
    )
    # Overhead: the proxy's own share of TTFT, measured, small.
    assert overhead == pytest.approx(proxy_ttft - upstream_ttft)
    assert 0 <= overhead < min(0.02, proxy_ttft / 10)
    assert attrs_of(attempt)["server.port"] == backend.port

    # The same facts as metrics (diff of cumulative snapshots around the timed request).
    after = proxy.histograms()
    n, s = delta(
        before, after, "gen_ai.server.time_to_first_token", **{"server.port": backend.port}
    )
    assert n == 1 and s == pytest.approx(proxy_ttft)
    n, s = delta(before, after, "gen_ai.client.operation.time_to_first_chunk")
    assert n == 1 and s == pytest.approx(proxy_ttft)
    n, s = delta(before, after, "gen_ai.client.operation.time_per_output_chunk")
    assert n == CHUNKS - 1
    assert s == pytest.approx(a["warmroute.e2e_s"] - proxy_ttft)  # the gaps add up
    n, s = delta(before, after, "gen_ai.server.time_per_output_token")
    assert n == 1 and s == pytest.approx(a["warmroute.tpot_s"])
    n, s = delta(before, after, "gen_ai.client.token.usage", **{"gen_ai.token.type": "input"})
    assert (n, s) == (1, usage["prompt_tokens"])
    n, s = delta(before, after, "gen_ai.client.token.usage", **{"gen_ai.token.type": "output"})
    assert (n, s) == (1, CHUNKS)
    n, s = delta(before, after, "warmroute.proxy.overhead")
    assert n == 1 and s == pytest.approx(overhead)
    n, s = delta(before, after, "warmroute.proxy.chunk_forward.duration")
    assert 1 <= n <= CHUNKS and s < proxy_ttft / 10
    n, s = delta(before, after, "gen_ai.server.request.duration")
    assert n == 1 and s == pytest.approx(a["warmroute.e2e_s"])


# ---------------------------------------------------------------------------------------------
# 3. Failures are recorded as failures


def test_the_server_span_names_the_fleet_epoch_and_a_drain_under_way(
    fake_backends: Any, captured: Callable[[dict[str, Any]], Captured]
) -> None:
    """warmroute.fleet.epoch and .changing on a live request's SERVER span: an SRE filtering
    Jaeger for requests routed while the fleet changed finds exactly those."""
    [(_, a)], [(_, b)] = fake_backends(1), fake_backends(1)
    port = free_port()
    proxy = captured(
        {
            "backends": [{"url": a.url}],
            "server": {"port": port, "admin_port": port},
            "fleet": {"change_window_s": 0},  # changing only while a drain is under way
        }
    )

    def state(name: str) -> str | None:
        view = httpx.get(proxy.url + "/admin/backends").json()["backends"]
        return next((x["state"] for x in view if x["name"] == name), None)

    def fleet_of(request_id: str) -> tuple[int, bool]:
        r = httpx.post(proxy.url + CHAT, json=chat("hi"), headers={"x-request-id": request_id})
        assert r.status_code == 200, r.text
        a = attrs_of(proxy.request_spans(request_id)[0])
        return a["warmroute.fleet.epoch"], a["warmroute.fleet.changing"]

    epoch, changing = fleet_of("steady")
    assert not changing
    assert httpx.post(proxy.url + "/admin/backends", json={"url": b.url}).status_code == 201
    name_b = f"127.0.0.1:{b.port}"
    until(lambda: state(name_b) == "serving", "b to serve")
    with httpx.stream(
        "POST", proxy.url + CHAT, json=chat("chunks:400 delay:0.02", stream=True)
    ) as held:
        lines = held.iter_lines()
        next(lines)  # mid-stream on one backend
        draining = held.headers["x-warmroute-backend"]
        r = httpx.post(proxy.url + f"/admin/backends/{draining}/drain")
        assert r.status_code == 202, r.text
        assert state(draining) == "draining"
        during = fleet_of("during-drain")
    assert during[0] > epoch and during[1] is True
    until(lambda: state(draining) == "drained", "the drain to end with its stream")
    after = fleet_of("after-drain")
    assert after[0] >= during[0] and after[1] is False


def test_backend_cut_mid_stream_is_an_error(
    fake_backends: Any, captured: Callable[[dict[str, Any]], Captured]
) -> None:
    [(_, backend)] = fake_backends(1)
    proxy = captured({"backends": [{"url": backend.url}]})
    before = proxy.histograms()
    r = httpx.post(
        proxy.url + CHAT, json=chat("cut:3 chunks:10", stream=True), headers={"x-request-id": "cut"}
    )
    assert r.status_code == 200 and "upstream_stream_error" in r.text
    server, [attempt] = proxy.request_spans("cut")
    a = attrs_of(server)
    assert_not_success(server)
    assert a["error.type"] == "upstream_stream_error"
    assert "error" in a["gen_ai.response.finish_reasons"]
    assert a["warmroute.chunks"] == 3
    assert a["gen_ai.response.time_to_first_chunk"] > 0  # the client did get tokens
    assert_not_success(attempt)
    after = proxy.histograms()
    # Success-only histograms stay untouched; the duration carries the error.type.
    assert delta(before, after, "gen_ai.server.time_to_first_token")[0] == 0
    assert delta(before, after, "gen_ai.server.time_per_output_token")[0] == 0
    assert delta(before, after, "gen_ai.client.operation.time_to_first_chunk")[0] == 1
    assert delta(before, after, "gen_ai.client.operation.time_per_output_chunk")[0] == 2
    assert (
        delta(
            before,
            after,
            "gen_ai.server.request.duration",
            **{"error.type": "upstream_stream_error"},
        )[0]
        == 1
    )


def test_backend_error_event_mid_stream_is_an_error(
    captured: Callable[[dict[str, Any]], Captured],
) -> None:
    # Two tokens, then an OpenAI error event and [DONE], as an engine reports a failure once
    # it is streaming.
    errs = MockBackend(model=MODEL, script=lambda _: Reply(chunks=5, error_after=2))
    with ServerThread(errs) as backend:
        proxy = captured({"backends": [{"url": backend.url, "models": [MODEL]}]})
        oai = client(proxy.url)
        got: list[str] = []
        with pytest.raises(openai.APIError):
            for chunk in oai.chat.completions.create(
                **chat("hi"), stream=True, extra_headers={"x-request-id": "err-event"}
            ):
                got.extend(c.delta.content for c in chunk.choices if c.delta.content)
        assert got == ["tok0 ", "tok1 "]
        server, [attempt] = proxy.request_spans("err-event")
    a = attrs_of(server)
    assert_not_success(server)
    assert a["error.type"] == "server_error"
    assert "error" in a["gen_ai.response.finish_reasons"]
    assert a["warmroute.chunks"] == 2
    assert_not_success(attempt)


def test_all_backends_failing_before_the_first_byte_is_an_error(
    fake_backends: Any, captured: Callable[[dict[str, Any]], Captured]
) -> None:
    backends = fake_backends(2)
    proxy = captured({"backends": [{"url": s.url} for _, s in backends]})
    before = proxy.histograms()
    r = httpx.post(
        proxy.url + CHAT, json=chat("fail500", stream=True), headers={"x-request-id": "5xx"}
    )
    assert r.status_code == 503
    server, attempts = proxy.request_spans("5xx")
    a = attrs_of(server)
    assert_not_success(server)
    assert a["error.type"] == "backends_unavailable"
    assert a["http.response.status_code"] == 503
    assert a["warmroute.route.retries"] == 1
    # No response ever started: no finish reason is reported (and certainly no success one).
    assert a.get("gen_ai.response.finish_reasons", ("error",)) == ("error",)
    assert "gen_ai.response.time_to_first_chunk" not in a
    assert len(attempts) == 2
    assert {attrs_of(s)["server.port"] for s in attempts} == {s.port for _, s in backends}
    for s in attempts:
        assert_not_success(s)
        assert attrs_of(s)["error.type"] == "http_500"
        assert attrs_of(s)["http.response.status_code"] == 500
    after = proxy.histograms()
    assert delta(before, after, "gen_ai.server.time_to_first_token")[0] == 0
    assert delta(before, after, "gen_ai.client.operation.time_to_first_chunk")[0] == 0
    assert (
        delta(
            before,
            after,
            "gen_ai.server.request.duration",
            **{"error.type": "backends_unavailable"},
        )[0]
        == 1
    )


def test_client_disconnect_mid_stream_is_recorded_as_cancelled(
    fake_backends: Any, captured: Callable[[dict[str, Any]], Captured]
) -> None:
    [(backend_app, backend)] = fake_backends(1)
    proxy = captured({"backends": [{"url": backend.url}]})
    before = proxy.histograms()
    with httpx.stream(
        "POST",
        proxy.url + CHAT,
        json=chat("chunks:1000 delay:0.02", stream=True),
        headers={"x-request-id": "gone"},
        timeout=10,
    ) as r:
        got = b""
        for data in r.iter_raw():
            got += data
            if got.count(b'"content":"') >= 3:  # role chunk + two tokens
                break
    assert backend_app.rec.disconnected.wait(WAIT_S)  # upstream closed at once
    server, [attempt] = proxy.request_spans("gone")
    a = attrs_of(server)
    assert_not_success(server)
    assert a["error.type"] == "cancelled"
    assert "cancelled" in a["gen_ai.response.finish_reasons"]
    assert a["warmroute.cancelled"] is True
    assert a["http.response.status_code"] == 499
    assert 2 <= a["warmroute.chunks"] < 1000
    assert_not_success(attempt)
    assert backend_app.rec.completed == 0
    after = proxy.histograms()
    assert delta(before, after, "gen_ai.server.time_to_first_token")[0] == 0
    assert (
        delta(before, after, "gen_ai.server.request.duration", **{"error.type": "cancelled"})[0]
        == 1
    )


def test_client_disconnect_before_the_first_byte_closes_upstream_at_once(
    fake_backends: Any, captured: Callable[[dict[str, Any]], Captured]
) -> None:
    [(backend_app, backend)] = fake_backends(1)
    proxy = captured({"backends": [{"url": backend.url}]})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            proxy.url + CHAT,
            json=chat("slowstart:1.5 chunks:100 delay:0.02", stream=True),
            headers={"x-request-id": "gone-early"},
            timeout=0.2,
        )
    # At once, not when the backend's 1.5 s of "prefill" is over.
    assert backend_app.rec.disconnected.wait(0.5)
    server, _ = proxy.request_spans("gone-early")
    assert attrs_of(server)["error.type"] == "cancelled"


# ---------------------------------------------------------------------------------------------
# 4. On the wire: OTLP/HTTP protobuf from a running proxy to a receiver in this test


class OtlpReceiver:
    """A minimal OTLP/HTTP collector: keeps every POSTed body by path."""

    def __init__(self) -> None:
        self.bodies: dict[str, list[bytes]] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                assert self.headers["content-type"] == "application/x-protobuf"
                with receiver.lock:
                    receiver.bodies.setdefault(self.path, []).append(body)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, args=(SHUTDOWN_POLL_S,), daemon=True
        )

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def traces(self) -> ExportTraceServiceRequest:
        out = ExportTraceServiceRequest()
        with self.lock:
            for b in self.bodies.get("/v1/traces", []):
                out.MergeFromString(b)
        return out

    def latest_metrics(self) -> ExportMetricsServiceRequest:
        out = ExportMetricsServiceRequest()
        with self.lock:
            bodies = self.bodies.get("/v1/metrics", [])
            if bodies:
                out.ParseFromString(bodies[-1])  # cumulative: the last export has it all
        return out


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


@pytest.mark.parametrize("endpoint_from", ["config", "env"])
def test_otlp_http_export_from_the_running_proxy(
    fake_backends: Any, monkeypatch: pytest.MonkeyPatch, endpoint_from: str
) -> None:
    [(_, backend)] = fake_backends(1)
    # Export promptly instead of every 5 s / 60 s, so we see it while the proxy runs.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
    with OtlpReceiver() as receiver:
        telemetry: dict[str, Any] = {
            "traces_exporter": "otlp",
            "metrics_exporter": "otlp",
            "service_name": "wr-e2e",
        }
        if endpoint_from == "config":
            telemetry["otlp_endpoint"] = receiver.url
        else:
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        cfg = Config.model_validate({"backends": [{"url": backend.url}], "telemetry": telemetry})
        traceparent, trace_id, parent_id = new_traceparent()
        with ServerThread(create_app(cfg)) as proxy:
            chunks = list(
                client(proxy.url).chat.completions.create(
                    **chat("slowstart:0.05 chunks:6"),
                    stream=True,
                    extra_headers={"traceparent": traceparent},
                )
            )
            assert len(chunks) == 8  # role, 6 tokens, finish (usage stripped)

            deadline = time.monotonic() + WAIT_S
            while True:
                spans = [
                    (rs, s)
                    for rs in receiver.traces().resource_spans
                    for ss in rs.scope_spans
                    for s in ss.spans
                    if s.trace_id.hex() == trace_id
                ]
                metrics = {
                    m.name: m
                    for rm in receiver.latest_metrics().resource_metrics
                    for sm in rm.scope_metrics
                    for m in sm.metrics
                }
                ttft = metrics.get("gen_ai.server.time_to_first_token")
                if len(spans) == 2 and ttft is not None:
                    break
                assert time.monotonic() < deadline, (len(spans), sorted(metrics))
                time.sleep(0.02)

    server = next(s for _, s in spans if s.kind == s.SPAN_KIND_SERVER)
    attempt = next(s for _, s in spans if s.kind == s.SPAN_KIND_CLIENT)
    resource = {kv.key: _value(kv.value) for kv in spans[0][0].resource.attributes}
    assert resource["service.name"] == "wr-e2e"
    assert server.name == attempt.name == f"chat {MODEL}"
    assert server.parent_span_id.hex() == parent_id
    assert attempt.parent_span_id == server.span_id
    a = {kv.key: _value(kv.value) for kv in server.attributes}
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.usage.output_tokens"] == 6
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["server.port"] == backend.port
    assert a["gen_ai.response.time_to_first_chunk"] >= 0.05
    assert server.status.code != server.status.STATUS_CODE_ERROR
    assert [e.name for e in server.events] == ["first_token"]

    [point] = ttft.histogram.data_points
    assert point.count == 1
    assert point.sum == pytest.approx(a["gen_ai.response.time_to_first_chunk"])
    assert list(point.explicit_bounds)[:8] == [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1]
    assert [e.trace_id.hex() for e in point.exemplars] == [trace_id]  # metric -> trace
    tpoc = metrics["gen_ai.client.operation.time_per_output_chunk"].histogram.data_points
    assert sum(p.count for p in tpoc) == 5


# ---------------------------------------------------------------------------------------------
# Cached tokens from an engine that reports them (the simulated vLLM-like engine)


def test_cached_prompt_tokens_from_the_engine_reach_the_span_and_metrics(
    captured: Callable[[dict[str, Any]], Captured],
) -> None:
    from proxy.sim import SimConfig, create_sim_app

    app = create_sim_app(SimConfig.from_preset("h100", "8b", "bf16", time_scale=10))
    prompt = "You are a meticulous assistant who answers with care. " * 40
    with ServerThread(app, **app.uvicorn_kwargs()) as engine:
        proxy = captured({"backends": [{"url": engine.url}]})
        oai = client(proxy.url)
        usages = []
        for i in range(2):  # the second time, the prefix is warm
            chunks = list(
                oai.chat.completions.create(
                    model="sim-8b",
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=4,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_headers={"x-request-id": f"sim-{i}"},
                )
            )
            usages.append(chunks[-1].usage)
        spans = [proxy.request_spans(f"sim-{i}")[0] for i in range(2)]
    for usage, span in zip(usages, spans, strict=True):
        assert usage is not None and usage.prompt_tokens_details is not None
        a = attrs_of(span)
        assert a["gen_ai.usage.input_tokens"] == usage.prompt_tokens
        assert a["gen_ai.usage.output_tokens"] == usage.completion_tokens == 4
        assert (
            a["gen_ai.usage.cache_read.input_tokens"] == usage.prompt_tokens_details.cached_tokens
        )
    warm = attrs_of(spans[1])
    assert warm["gen_ai.usage.cache_read.input_tokens"] > 0
    assert warm["warmroute.prefix.observed_hit_ratio"] == pytest.approx(
        warm["gen_ai.usage.cache_read.input_tokens"] / warm["gen_ai.usage.input_tokens"]
    )
    n, s = delta({}, proxy.histograms(), "warmroute.prefix.cached_tokens")
    assert n == 2 and s == warm["gen_ai.usage.cache_read.input_tokens"]


def test_inflight_gauge_reports_the_requests_open_on_each_backend(
    fake_backends: Any, captured: Callable[[dict[str, Any]], Captured]
) -> None:
    """warmroute.backend.inflight is the routing board's count, read when collected."""
    [(_, backend)] = fake_backends(1)
    proxy = captured({"backends": [{"url": backend.url}]})

    def inflight() -> dict[str, int]:
        data = proxy.reader.get_metrics_data()
        assert data is not None
        return {
            p.attributes["warmroute.backend"]: p.value
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
            if m.name == "warmroute.backend.inflight"
            for p in m.data.data_points
        }

    stream = client(proxy.url).chat.completions.create(**chat("chunks:3 delay:0.3"), stream=True)
    chunks = iter(stream)
    next(chunks)  # the response is under way: the request is open on the backend
    [(name, open_now)] = inflight().items()
    assert open_now == 1
    assert len(list(chunks)) >= 2
    deadline = time.monotonic() + WAIT_S
    while inflight()[name] != 0:  # released just after the last byte
        assert time.monotonic() < deadline
        time.sleep(0.005)
