"""Prefill/decode flows in the forwarder, in process: pools kept inside the router's ranking,
both legs' spans in the real OTel SDK, what the decider's window is told per engine, the
decider evaluated on read, its switch logged, and the SGLang body on both legs exactly."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from proxy.config import Config, load_config
from proxy.disagg.window import RequestFacts
from proxy.server.app import create_app
from proxy.telemetry import Telemetry
from proxy.upstream.pool import UpstreamConnectError
from tests.test_forward_fake_upstream import (
    CHUNK,
    DONE,
    FakeResponse,
    FakeUpstream,
    _call,
    _call_and_leave,
)

DOC = "a long document about the history of the river. " * 120  # ~1,450 tokens at 4 chars
APPENDIX = "and an appendix with new tables and figures. " * 60  # ~700 more


def _config(
    backends: list[dict[str, Any]], retries: dict[str, Any] | None = None, **disagg: Any
) -> Config:
    cfg = load_config(flags={"backends": ["http://127.0.0.1:1"]}, env={})
    return cfg.model_validate(
        {
            **cfg.model_dump(),
            "backends": [{"models": ["m"], **b} for b in backends],
            "disagg": {"mode": "on", "threshold_tokens": 256, **disagg},
            "retries": {"backoff_base_s": 0.0, **(retries or {})},
        }
    )


def _app(cfg: Config, scripts: dict[str, list[Any]], telemetry: Telemetry | None = None) -> Any:
    app = create_app(cfg, telemetry=telemetry)
    app.state.forwarding.upstream = FakeUpstream(scripts)
    return app


def _fake(app: Any) -> FakeUpstream:
    fake: FakeUpstream = app.state.forwarding.upstream
    return fake


def _stream() -> FakeResponse:
    return FakeResponse(200, [CHUNK, DONE])


def _kv_answer() -> FakeResponse:
    answer = {
        "choices": [{"text": "x"}],
        "usage": {"prompt_tokens": 1500, "completion_tokens": 1},
        "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "p"},
    }
    return FakeResponse(200, [orjson.dumps(answer)])


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    body = {"model": "m", "stream": True, "max_tokens": 200}
    return {**body, "messages": [{"role": "user", "content": content}], **extra}


def _doc(question: str = "summarise it", **extra: Any) -> dict[str, Any]:
    return {**_chat(DOC + question), "max_tokens": 16, **extra}


def _called(app: Any) -> list[str]:
    return [c[0] for c in _fake(app).calls]


# --- pools inside the router's ranking -----------------------------------------------------

MIXED = [f"127.0.0.1:{p}" for p in (9301, 9302, 9303, 9304)]


async def test_a_pool_member_the_router_filtered_out_is_never_tried() -> None:
    # On: one mixed engine for prefill-heavy requests (the first by name), three for decoding.
    a, b, c, d = MIXED
    cfg = _config(
        [
            {"url": f"http://{a}"},
            {"url": f"http://{b}", "models": ["other"]},  # serves another model
            {"url": f"http://{c}", "max_inflight": 1},  # will be at its bound
            {"url": f"http://{d}"},
        ]
    )
    app = _app(cfg, {n: [_stream] for n in MIXED})
    app.state.registry.backends[d].healthy = False  # down: in no pool
    pd = app.state.forwarding.pd
    pd.evaluate()
    assert pd.state()["pools"]["prefill"] == [a]
    assert pd.state()["pools"]["decode"] == [b, c]  # d is down, so in no pool
    app.state.steering.inflight(c, +1)  # c at its in-flight bound
    status, _, _ = await _call(app, _chat("hello there"))  # a chat stream: decode pool
    # Neither decode-pool member may take it (wrong model, full): the router's ranking does.
    assert status == 200 and _called(app) == [a]
    assert pd.counts["pool_unavailable"] == 1


async def test_retries_stay_in_the_pool_then_the_routers_ranking_never_a_filtered_member() -> None:
    a, b, c, d = MIXED
    cfg = _config(
        [
            {"url": f"http://{a}"},
            {"url": f"http://{b}", "models": ["other"]},
            {"url": f"http://{c}"},
            {"url": f"http://{d}"},
        ],
        retries={"max_attempts": 4, "backoff_base_s": 0.0},
    )
    down = lambda: FakeResponse(503, [])  # noqa: E731
    app = _app(cfg, {a: [_stream], b: [_stream], c: [down], d: [down]})
    status, _, _ = await _call(app, _chat("hello there"))
    called = _called(app)
    assert status == 200 and b not in called  # another model's backend, though in the pool
    assert set(called[:2]) == {c, d} and called[2:] == [a]  # the pool first, then the rest


async def test_pools_leave_out_a_backend_that_serves_no_model() -> None:
    a, b, c, d = MIXED
    app = _app(_config([{"url": f"http://{n}"} for n in MIXED]), {})
    app.state.registry.backends[a].models = frozenset()  # discovery found nothing there
    pd = app.state.forwarding.pd
    pd.evaluate()
    pools = pd.state()["pools"]
    assert a not in pools["prefill"] + pools["decode"]
    assert pools["prefill"] == [b] and pools["decode"] == [c, d]


# --- spans ---------------------------------------------------------------------------------

P1, P2, D1, D2 = (f"127.0.0.1:{p}" for p in (9401, 9402, 9403, 9404))


def _pd_fleet(engine: str = "vllm") -> list[dict[str, Any]]:
    return [
        {"url": f"http://{P1}", "engine": engine, "role": "prefill", "bootstrap_port": 8998},
        {"url": f"http://{P2}", "engine": engine, "role": "prefill", "bootstrap_port": 8998},
        {"url": f"http://{D1}", "engine": engine, "role": "decode"},
        {"url": f"http://{D2}", "engine": engine, "role": "decode"},
    ]


def _children(spans: InMemorySpanExporter, request_id: str) -> tuple[ReadableSpan, list[Any]]:
    finished = spans.get_finished_spans()
    server = next(
        s
        for s in finished
        if s.kind == SpanKind.SERVER
        and (s.attributes or {}).get("warmroute.request.id") == request_id
    )
    assert server.context is not None
    sid = server.context.span_id
    return server, [s for s in finished if s.parent is not None and s.parent.span_id == sid]


async def test_both_legs_are_client_spans_of_the_request_and_the_kv_transfer_an_interval() -> None:
    spans = InMemorySpanExporter()
    fleet = _pd_fleet()
    fleet[0]["max_inflight"] = 1
    cfg = _config(fleet)
    tel = Telemetry(cfg.telemetry, span_exporter=spans)
    scripts = {P1: [_kv_answer], P2: [_kv_answer], D1: [_stream], D2: [_stream]}
    app = _app(cfg, scripts, tel)
    steering = app.state.steering
    # The first time, P1 is full and D2 busy: the document is prefilled on P2, decoded on D1.
    steering.inflight(P1, +1)
    steering.inflight(D2, +1)
    await _call(app, _doc("first question"), ((b"x-request-id", b"pd-one"),))
    steering.inflight(P1, -1)
    steering.inflight(D2, -1)
    # Now D1 is busy. The same document with a long new part goes back to P2, which holds its
    # prefix (P1 is as idle and the router ranks it higher), and is decoded on D2, the least
    # loaded, although D1 holds the prefix too.
    steering.inflight(D1, +1)
    status, body, _ = await _call(app, _doc(APPENDIX), ((b"x-request-id", b"pd-two"),))
    assert status == 200 and body == CHUNK + DONE
    assert _called(app) == [P2, D1, P2, D2]
    assert app.state.forwarding.pd.counts == {"two:prefill": 2}

    server, children = _children(spans, "pd-two")
    clients = sorted(
        (s for s in children if s.kind == SpanKind.CLIENT), key=lambda s: s.start_time or 0
    )
    legs = [
        ((s.attributes or {}).get("warmroute.pd.leg"), s.attributes["warmroute.backend"])
        for s in clients
    ]  # type: ignore[index]
    assert legs == [("prefill", P2), ("decode", D2)]
    [kv] = [s for s in children if s.name == "kv_transfer"]
    assert kv.kind == SpanKind.INTERNAL
    assert kv.start_time is not None and kv.end_time is not None
    assert kv.start_time <= kv.end_time
    assert (kv.attributes or {}).get("warmroute.pd.decode_backend") == D2
    assert clients[0].end_time is not None and clients[0].end_time <= kv.start_time
    assert (server.attributes or {}).get("warmroute.pd.flow") == "vllm"


async def test_a_decode_only_fallback_attempt_is_tagged_as_such() -> None:
    spans = InMemorySpanExporter()
    cfg = _config(_pd_fleet())
    tel = Telemetry(cfg.telemetry, span_exporter=spans)
    fail = lambda: FakeResponse(500, [])  # noqa: E731
    app = _app(cfg, {P1: [fail], P2: [fail], D1: [_stream], D2: [_stream]}, tel)
    await _call(app, _doc(), ((b"x-request-id", b"pd-fb"),))
    server, children = _children(spans, "pd-fb")
    legs = sorted(
        (s.start_time or 0, (s.attributes or {}).get("warmroute.pd.leg")) for s in children
    )
    assert [leg for _, leg in legs] == ["prefill", "decode_only"]
    assert "decode-only on" in str((server.attributes or {}).get("warmroute.pd.fallback"))


# --- what the decider's window is told ------------------------------------------------------


async def test_the_window_sees_the_prefill_on_the_prefill_engine_and_none_on_the_decode_one() -> (
    None
):
    app = _app(_config(_pd_fleet()[::2]), {P1: [_kv_answer], D1: [_stream]})
    pd = app.state.forwarding.pd
    before = time.perf_counter()
    await _call(app, _doc())
    after = time.perf_counter()
    assert _called(app) == [P1, D1]
    # A stream decoding through the whole request on each engine:
    window = pd.ctl.window
    for name in (P1, D1):
        window.finished(RequestFacts(name, name, before, 100, 50, 200, after, before, 0.01, 0.02))
    s = window.snapshot(after)
    assert s.overlapped == 1  # only the one on the prefill engine ran beside a long prefill
    assert s.requests == 3 and s.long_prefills == 1  # the document's prefill demand counted
    assert s.rate_per_s * s.span_s == pytest.approx(3)  # the two legs are one arrival
    assert window.in_flight == 0


# --- the decider on read, and its switch in the log ---------------------------------------


def _feed_heavy_mixed_traffic(pd: Any, names: list[str], until: float) -> None:
    """Steady chat streams on every backend for `until` s, and long documents on the first,
    whose streams stall beside them (p99/p50 ITL 9 against 1.2 elsewhere)."""
    ctl = pd.ctl
    t, i = 0.0, 0
    while t < until:
        rid = f"r{i}"
        if i % 6 == 0:
            ctl.started(rid, names[0], t, 4_000)
            ctl.first_token(rid, t + 0.5)
            ctl.finished(RequestFacts(rid, names[0], t, 4_000, 4_000, 8, t + 0.6, t + 0.5))
        else:
            name = names[i % len(names)]
            p99 = 0.09 if name == names[0] else 0.012
            ctl.started(rid, name, t, 50)
            ctl.first_token(rid, t + 0.05)
            ctl.finished(RequestFacts(rid, name, t, 500, 50, 200, t + 2.0, t + 0.05, 0.01, p99))
        t += 0.1
        i += 1


async def test_an_idle_proxy_reports_the_decider_on_the_window_now(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = _config(
        [{"url": f"http://{n}"} for n in MIXED],
        mode="auto",
        window_s=30,
        evaluate_s=1,
        min_requests=50,
        min_dwell_s=0,
    )
    app = _app(cfg, {})
    pd = app.state.forwarding.pd
    now = [0.0]
    pd.clock = lambda: now[0]
    assert pd.state()["active"] is False
    _feed_heavy_mixed_traffic(pd, MIXED, until=30.0)
    now[0] = 30.0
    with caplog.at_level(logging.INFO, logger="warmroute.disagg"):
        state = pd.state()  # no request came: reading it evaluates the window
    assert state["active"] is True and state["reason"].startswith("on: 4 healthy backends")
    assert state["inputs"]["requests"] > 200
    assert state["now"] == 30.0 and state["switches"][-1]["at"] == 30.0  # on the same clock
    [line] = [r for r in caplog.records if r.name == "warmroute.disagg"]
    assert line.levelno == logging.INFO
    assert line.getMessage() == f"disaggregation on: {state['reason']}"
    assert pd.gauges()[0] is True
    # Two windows of silence later, the gauges (a scrape) see an empty window and switch off.
    now[0] = 95.0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="warmroute.disagg"):
        active, inputs = pd.gauges()
    assert active is False and inputs["requests"] == 0
    assert pd.state()["reason"].startswith("switched off: only 0 requests in the window")
    assert [r.getMessage() for r in caplog.records] == [
        "disaggregation off: " + pd.state()["reason"]
    ]


async def test_mode_on_logs_its_switch_once_with_the_pools() -> None:
    app = _app(_config(_pd_fleet()[::2]), {P1: [_kv_answer], D1: [_stream]})
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("warmroute.disagg")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        await _call(app, _doc())
        await _call(app, _doc("again"))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    switches = [r.getMessage() for r in records if r.getMessage().startswith("disaggregation")]
    assert switches == [
        "disaggregation on: on by configuration: 1 of 2 healthy backends for prefill-heavy "
        "requests, 1 for decoding"
    ]


# --- the SGLang body ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("client_options", "sent_options"),
    [
        (None, {"include_usage": True}),  # the proxy's own, cut from the client's stream
        ({"include_usage": False}, {"include_usage": True}),
        ({"include_usage": True}, {"include_usage": True}),
    ],
)
async def test_sglang_legs_get_the_client_body_plus_the_bootstrap_fields_exactly(
    client_options: dict[str, bool] | None, sent_options: dict[str, bool]
) -> None:
    app = _app(_config(_pd_fleet("sglang")[::2]), {P1: [_kv_answer], D1: [_stream]})
    client = _doc(temperature=0.3, seed=7)
    if client_options is not None:
        client["stream_options"] = client_options
    status, body, _ = await _call(app, client, ((b"x-request-id", b"sg-1"),))
    assert status == 200 and body == CHUNK + DONE
    fake = _fake(app)
    sent = {name: orjson.loads(b) for (name, _, _), b in zip(fake.calls, fake.bodies, strict=True)}
    assert set(sent) == {P1, D1}
    room = sent[D1]["bootstrap_room"]
    assert isinstance(room, int) and 0 <= room < 2**63
    expected = {
        **client,
        "stream_options": sent_options,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 8998,
        "bootstrap_room": room,
    }
    assert sent[P1] == expected and sent[D1] == expected
    assert {c[2]["x-request-id"] for c in fake.calls} == {"sg-1"}


async def test_sglang_rooms_are_drawn_afresh_per_request() -> None:
    app = _app(_config(_pd_fleet("sglang")[::2]), {P1: [_kv_answer], D1: [_stream]})
    await _call(app, _doc())
    await _call(app, {**_doc(), "messages": [{"role": "user", "content": APPENDIX * 3}]})
    rooms = [orjson.loads(b)["bootstrap_room"] for b in _fake(app).bodies]
    assert rooms[0] == rooms[1] and rooms[2] == rooms[3] and rooms[0] != rooms[2]


# --- one retry policy, one deadline ---------------------------------------------------------


def _late(answer: Any) -> Any:
    """A step that answers (or fails) 50 ms after it was sent: past a 20 ms deadline."""

    async def step() -> FakeResponse:
        await asyncio.sleep(0.05)
        if isinstance(answer, BaseException):
            raise answer
        response: FakeResponse = answer()
        return response

    return step


async def _hung() -> FakeResponse:
    await asyncio.Event().wait()  # an SGLang decode engine waiting for KV that never comes
    raise AssertionError


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_prefill_leg_failing_past_the_deadline_gets_no_fallback(engine: str) -> None:
    cfg = _config(_pd_fleet(engine)[::2], retries={"deadline_s": 0.02})
    decode = [_stream] if engine == "vllm" else [_hung, _stream]
    app = _app(cfg, {P1: [_late(UpstreamConnectError("refused"))], D1: decode})
    status, body, _ = await _call(app, _doc())
    assert status == 503
    message = orjson.loads(body)["error"]["message"]
    assert f"prefill leg on {P1} failed" in message
    assert "not retried: the retry deadline of 0.02s passed" in message
    # vLLM sent no decode leg; SGLang's, sent with the prefill leg, was not followed by more.
    assert sorted(_called(app)) == ([P1] if engine == "vllm" else sorted([P1, D1]))
    assert app.state.forwarding.pd.counts["prefill_failed"] == 1


async def test_a_decode_leg_failing_past_the_deadline_is_not_retried_elsewhere() -> None:
    cfg = _config(_pd_fleet(), retries={"deadline_s": 0.02})
    down = lambda: FakeResponse(500, [])  # noqa: E731
    app = _app(cfg, {P1: [_late(_kv_answer)], D1: [down], D2: [_stream]})
    status, body, _ = await _call(app, _doc())
    assert status == 503 and _called(app) == [P1, D1]  # D2 was free, but the time was up
    assert "not retried: the retry deadline" in orjson.loads(body)["error"]["message"]


@pytest.mark.parametrize(
    ("retries", "why"),
    [
        ({"budget_ratio": 0, "budget_min_per_s": 0}, "the retry budget is spent"),
        ({"max_attempts": 2}, "2 attempts made"),  # the prefill leg was the first
    ],
)
async def test_a_failed_decode_leg_is_retried_within_the_policys_budget_and_attempts(
    retries: dict[str, Any], why: str
) -> None:
    down = lambda: FakeResponse(500, [])  # noqa: E731
    scripts = {P1: [_kv_answer], D1: [down], D2: [_stream]}
    app = _app(_config(_pd_fleet(), retries=retries), scripts)
    status, body, _ = await _call(app, _doc())
    assert status == 503 and _called(app) == [P1, D1]
    assert f"not retried: {why}" in orjson.loads(body)["error"]["message"]
    # With retries to spare, the decode-only retry goes to the other decode engine.
    app = _app(_config(_pd_fleet()), scripts)
    status, _, _ = await _call(app, _doc())
    assert status == 200 and _called(app) == [P1, D1, D2]
    assert "kv_transfer_params" not in orjson.loads(_fake(app).bodies[-1])


async def test_a_prefill_fallback_spends_no_retry_budget() -> None:
    # The decode engine gets the one request it was getting anyway: no load is added.
    cfg = _config(_pd_fleet()[::2], retries={"budget_ratio": 0, "budget_min_per_s": 0})
    app = _app(cfg, {P1: [lambda: FakeResponse(500, [])], D1: [_stream]})
    status, body, _ = await _call(app, _doc())
    assert (status, body) == (200, CHUNK + DONE) and _called(app) == [P1, D1]
    assert app.state.forwarding.retry.budget.info()["retries"] == 0


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_prefill_probe_cut_by_the_client_leaving_lets_the_next_probe_go(
    engine: str,
) -> None:
    left = asyncio.Event()

    async def no_answer() -> FakeResponse:
        left.set()  # the client hangs up while the prefill engine has not answered
        await asyncio.Event().wait()
        raise AssertionError

    decode = [_stream] if engine == "vllm" else [_hung, _stream]
    app = _app(_config(_pd_fleet(engine)[::2]), {P1: [no_answer, _kv_answer], D1: decode})
    breaker = app.state.registry[P1].breaker
    while not breaker.failure("status", time.monotonic() - 1000):  # ejected, ejection over
        pass
    assert await _call_and_leave(app, _doc(), left) == []
    # The probe was cut, not answered: no verdict, and nobody is left probing.
    assert breaker.state == "half_open" and not breaker.probe_out
    assert app.state.registry[P1].last_error is None  # the client leaving is not the engine's
    assert breaker.allows(time.monotonic())
