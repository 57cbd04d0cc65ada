"""The forwarder against an in-memory upstream: no sockets, every failure scripted.

ProxyEndpoint gets its collaborators (proxy.forwarding.forward.Forwarding); here the upstream
client is a fake that answers from a script per backend, so retries, ejection and the
event-boundary rule are checked exactly and fast.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from proxy.config import load_config
from proxy.forwarding.relay import event_boundary
from proxy.routing.types import Dropped, Verdict
from proxy.server.app import create_app
from proxy.upstream.pool import (
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamFirstByteTimeout,
    UpstreamIdleTimeout,
    UpstreamPayloadError,
    UpstreamProtocolError,
)
from tests.forward_support import (
    CHUNK,
    DONE,
    FakeResponse,
    FakeUpstream,
)
from tests.forward_support import asgi_request as _asgi
from tests.forward_support import chat as _chat
from tests.forward_support import ok as _ok
from tests.forward_support import request as _call


def _app(
    scripts: dict[str, list[Any]], backend: dict[str, Any] | None = None, **config: Any
) -> tuple[Any, FakeUpstream]:
    flags = {"backends": [f"http://127.0.0.1:{p}" for p in (9101, 9102)], "policy": "round_robin"}
    cfg = load_config(flags=flags, env={})
    cfg = cfg.model_validate(
        {
            **cfg.model_dump(),
            "backends": [
                {"url": f"http://127.0.0.1:{p}", "models": ["m"], **(backend or {})}
                for p in (9101, 9102)
            ],
            "retries": {"backoff_base_s": 0.0, **config.pop("retries", {})},
            **config,
        }
    )
    app = create_app(cfg)
    fake = FakeUpstream(scripts)
    app.state.forwarding.upstream = fake
    return app, fake


def test_event_boundary_finds_the_end_of_the_last_complete_event() -> None:
    assert event_boundary(CHUNK + b'data: {"par') == len(CHUNK)
    assert event_boundary(b"data: x\r\n\r\ndata: y") == len(b"data: x\r\n\r\n")
    assert event_boundary(b'data: {"partial') == 0
    assert event_boundary(CHUNK + CHUNK) == 2 * len(CHUNK)


async def test_a_stream_cut_inside_an_event_ends_with_an_error_event_on_a_boundary() -> None:
    cut = FakeResponse(
        200, [CHUNK, b'data: {"choices":[{"ind'], UpstreamPayloadError("Response payload cut")
    )
    app, _ = _app({"127.0.0.1:9101": [lambda: cut], "127.0.0.1:9102": [_ok]})
    status, body, _ = await _call(app, _chat())
    assert status == 200
    events = [e for e in body.split(b"\n\n") if e]
    assert events[0] + b"\n\n" == CHUNK  # the complete event went through
    assert len(events) == 3  # the partial event was dropped, not glued to the error
    err = orjson.loads(events[1].removeprefix(b"data: "))
    assert err["error"]["code"] == "upstream_stream_error"
    assert events[-1] == b"data: [DONE]"


async def test_an_event_split_across_reads_reaches_the_client_whole_and_identical() -> None:
    half = len(CHUNK) // 2
    split = FakeResponse(200, [CHUNK[:half], CHUNK[half:] + CHUNK[:5], CHUNK[5:], DONE])
    app, _ = _app({"127.0.0.1:9101": [lambda: split], "127.0.0.1:9102": [_ok]})
    status, body, _ = await _call(app, _chat())
    assert (status, body) == (200, CHUNK + CHUNK + DONE)


async def test_an_invalid_response_head_is_retried_on_the_next_backend() -> None:
    app, fake = _app(
        {
            "127.0.0.1:9101": [UpstreamProtocolError("invalid HTTP response")],
            "127.0.0.1:9102": [_ok],
        }
    )
    status, body, _headers = await _call(app, _chat())
    assert status == 200 and body == CHUNK + DONE
    assert [c[0] for c in fake.calls] == ["127.0.0.1:9101", "127.0.0.1:9102"]


async def test_a_dropped_pooled_connection_is_retried_on_the_same_backend_fresh() -> None:
    app, fake = _app(
        {
            "127.0.0.1:9101": [UpstreamDisconnected("closed", reused=True), _ok],
            "127.0.0.1:9102": [_ok],
        }
    )
    status, _, _headers = await _call(app, _chat())
    assert status == 200
    assert [(c[0], c[1]) for c in fake.calls] == [
        ("127.0.0.1:9101", False),
        ("127.0.0.1:9101", True),
    ]
    backend = app.state.registry["127.0.0.1:9101"]
    assert backend.breaker.consecutive == 0  # a keep-alive race is not the backend's fault


async def test_a_backend_answering_500_to_everything_is_ejected() -> None:
    def err500() -> FakeResponse:
        return FakeResponse(500, [b'{"error":{"message":"boom"}}'])

    app, fake = _app(
        {"127.0.0.1:9101": [err500], "127.0.0.1:9102": [_ok]},
        outlier={"consecutive_failures": 3, "ejection_s": 60.0},
    )
    for _ in range(8):
        status, _, _ = await _call(app, _chat())
        assert status == 200  # retried on the healthy one
    sick = app.state.registry["127.0.0.1:9101"]
    assert sick.breaker.state == "open"
    assert fake.count["127.0.0.1:9101"] == 3  # ejected after the third, not tried since


async def test_connect_failures_everywhere_end_in_one_clear_503() -> None:
    app, _fake = _app(
        {
            "127.0.0.1:9101": [UpstreamConnectError("Cannot connect (refused)")],
            "127.0.0.1:9102": [UpstreamConnectError("Cannot connect (refused)")],
        }
    )
    status, body, _ = await _call(app, _chat())
    assert status == 503
    err = orjson.loads(body)["error"]
    assert err["code"] == "backends_unavailable" and "refused" in err["message"]


async def test_the_backend_sees_the_forwarding_chain_and_no_proxy_credentials() -> None:
    app, fake = _app({"127.0.0.1:9101": [_ok], "127.0.0.1:9102": [_ok]})
    await _asgi(
        app,
        _chat(),
        client=("10.1.2.3", 4000),
        headers=(
            (b"api-key", b"secret-a"),
            (b"x-goog-api-key", b"secret-b"),
            (b"expect", b"100-continue"),
            (b"connection", b"keep-alive, x-hop"),
            (b"x-hop", b"private"),
            (b"x-forwarded-for", b"192.0.2.1"),
            (b"x-custom", b"kept"),
        ),
    )
    headers = fake.calls[0][2]
    for gone in ("api-key", "x-goog-api-key", "expect", "x-hop", "connection"):
        assert gone not in headers
    assert headers["x-forwarded-for"] == "192.0.2.1, 10.1.2.3"
    assert headers["forwarded"] == "for=10.1.2.3"
    assert headers["x-custom"] == "kept"


async def test_continuous_usage_without_include_usage_does_not_reach_the_client() -> None:
    app, fake = _app({"127.0.0.1:9101": [_ok], "127.0.0.1:9102": [_ok]})
    body = _chat()
    body["stream_options"] = {"continuous_usage_stats": True}
    status, _, _ = await _call(app, body)
    assert status == 200
    sent = orjson.loads(fake.bodies[0])["stream_options"]
    assert sent == {"continuous_usage_stats": False, "include_usage": True}


async def test_with_tracing_off_the_clients_traceparent_reaches_the_backend_unchanged() -> None:
    app, fake = _app({"127.0.0.1:9101": [_ok], "127.0.0.1:9102": [_ok]})
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    status, _, _ = await _call(app, _chat(), ((b"traceparent", parent.encode()),))
    assert status == 200
    assert fake.calls[0][2]["traceparent"] == parent


@pytest.mark.parametrize("wait", ["no_queue", "until_freed", "past_its_time"])
async def test_a_request_finding_every_backend_at_its_bound_waits_for_one_or_gets_429(
    wait: str,
) -> None:
    release = asyncio.Event()

    class Held(FakeResponse):
        async def readany(self) -> bytes:
            await release.wait()
            return await super().readany()

    def held() -> FakeResponse:
        return Held(200, [CHUNK, DONE])

    server = {
        "no_queue": {"admission_queue": 0},
        "until_freed": {},
        "past_its_time": {"admission_timeout_s": 0.05},
    }[wait]
    app, _ = _app(
        {"127.0.0.1:9101": [held, held], "127.0.0.1:9102": [held, held]},
        backend={"max_inflight": 1},
        server=server,
    )
    busy = [asyncio.create_task(_call(app, _chat())) for _ in range(2)]
    await _until(
        lambda: (
            app.state.forwarding.open_requests == 2
            and all(app.state.routing.board.get(n) == 1 for n in app.state.registry.backends)
        )
    )
    third = asyncio.create_task(_call(app, _chat()))
    queue = app.state.steering.waiting
    if wait == "until_freed":
        await _until(lambda: len(queue.waiters) == 1)
        release.set()  # a backend frees its slot: the waiter routes there
        status, body, _ = await third
        assert status == 200 and body == CHUNK + DONE
        assert queue.stats["routed"] == 1 and not queue.waiters
    else:
        status, body, headers = await third
        assert status == 429 and headers[b"retry-after"] == b"1"
        error = orjson.loads(body)["error"]
        assert error["code"] == "backends_at_capacity"
        if wait == "no_queue":
            assert queue is None
        else:
            assert re.search(r"\(waited \d+\.\d s for one to free\)", error["message"])
            assert queue.stats["queue_timeout"] == 1 and not queue.waiters
        release.set()
    assert [s for s, _, _ in await asyncio.gather(*busy)] == [200, 200]


async def _until(ready: Callable[[], bool]) -> None:
    """Yield to the loop until `ready()` (the proxy's tasks move on each turn)."""
    for _ in range(10_000):
        if ready():
            return
        await asyncio.sleep(0)
    raise AssertionError("never ready")


class _SetAside:
    """A filter that sets every backend aside with one reason."""

    name = "set_aside"

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def filter(self, ctx: Any, candidates: list[Any], dropped: dict[str, str]) -> list[Any]:
        dropped.update(dict.fromkeys((b.name for b in candidates), self.reason))
        return []


@pytest.mark.parametrize(
    ("reason", "status", "code"),
    [
        (Dropped(Verdict.AT_BOUND, "queue full"), 429, "backends_at_capacity"),
        ("at its in-flight bound (1)", 503, "no_backend"),  # a text alone is not acted on
    ],
)
async def test_the_429_follows_the_filters_verdict_not_its_words(
    reason: str, status: int, code: str
) -> None:
    app, fake = _app({"127.0.0.1:9101": [_ok], "127.0.0.1:9102": [_ok]})
    app.state.routing.router.policy.filters.append(_SetAside(reason))
    got, body, _ = await _call(app, _chat())
    assert (got, orjson.loads(body)["error"]["code"]) == (status, code)
    assert fake.calls == []


# -- passive health: what an attempt's outcome says about its backend --------------------------
SICK, OTHER = "127.0.0.1:9101", "127.0.0.1:9102"


def _probing(app: Any) -> Any:
    """SICK ejected once with its ejection already over (its next check is half-open); OTHER
    out for good, so every request goes to SICK. Returns SICK's breaker."""
    registry = app.state.registry
    other = registry[OTHER].breaker
    other.state, other.open_until = "open", float("inf")
    breaker = registry[SICK].breaker
    while not breaker.failure("status", time.monotonic() - 1000):  # until it ejects
        pass
    return breaker


async def _call_and_leave(app: Any, body: dict[str, Any], left: asyncio.Event) -> list[Any]:
    """A request whose client hangs up once `left` is set; the messages it was sent."""
    return await _asgi(app, body, leave=left)


def _status(code: int) -> Callable[[], FakeResponse]:
    return lambda: FakeResponse(code, [b'{"error":{"message":"not now"}}'])


@pytest.mark.parametrize(
    "ending",
    [
        "answered_429",
        "keepalive_race",
        "client_left_before_the_head",
        "client_left_after_it",
        "client_left_during_a_whole_answer",
    ],
)
async def test_a_half_open_probe_that_ends_without_a_verdict_lets_the_next_one_go(
    ending: str,
) -> None:
    left = asyncio.Event()

    async def no_head() -> FakeResponse:
        left.set()  # the client hangs up while the backend has not answered
        await asyncio.Event().wait()
        raise AssertionError

    class NoFirstByte(FakeResponse):
        closing = asyncio.Event()

        async def readany(self) -> bytes:
            left.set()
            await self.closing.wait()  # until the client's watcher closes the upstream
            raise UpstreamPayloadError("closed by the proxy")

        def close(self) -> None:
            super().close()
            self.closing.set()

    probe: list[Any] = {
        "answered_429": [_status(429)],
        "keepalive_race": [
            UpstreamDisconnected("closed", reused=True),
            UpstreamDisconnected("closed", reused=True),
        ],
        "client_left_before_the_head": [no_head],
        "client_left_after_it": [lambda: NoFirstByte(200, [])],
        "client_left_during_a_whole_answer": [lambda: NoFirstByte(200, [])],
    }[ending]
    app, fake = _app({SICK: [*probe, _ok], OTHER: [_ok]})
    breaker = _probing(app)
    if ending.startswith("client_left"):
        body = _chat(stream=not ending.endswith("whole_answer"))
        assert await _call_and_leave(app, body, left) == []  # nothing to send to nobody
    else:
        status, _, _ = await _call(app, _chat())
        # the only backend did not answer this one: rate limited (429) or unavailable
        assert status == (429 if ending == "answered_429" else 503)
    assert fake.count[SICK] == len(probe)
    # No verdict, no probe in flight: the backend is routable, and the next request probes.
    assert breaker.state == "half_open" and not breaker.probe_out
    assert breaker.allows(time.monotonic())
    status, body, _ = await _call(app, _chat())
    assert (status, body) == (200, CHUNK + DONE)
    assert breaker.state == "closed"


async def test_a_backend_that_sends_a_head_and_no_first_byte_is_ejected() -> None:
    # vLLM answers a streaming request's head before its first token: a wedged engine keeps
    # answering heads, so only the first byte says it works.
    def head_only() -> FakeResponse:
        return FakeResponse(
            200, [], UpstreamFirstByteTimeout("no data within the first-byte timeout")
        )

    app, fake = _app(
        {SICK: [head_only], OTHER: [_ok]},
        outlier={"consecutive_failures": 3, "ejection_s": 60.0},
    )
    for _ in range(8):
        status, _, _ = await _call(app, _chat())
        assert status == 200  # retried on the healthy one
    breaker = app.state.registry[SICK].breaker
    assert breaker.state == "open" and breaker.last_kind == "timeout"
    assert fake.count[SICK] == 3


async def test_a_stream_that_breaks_after_its_first_byte_counts_against_its_backend() -> None:
    def idles() -> FakeResponse:
        return FakeResponse(200, [CHUNK], UpstreamIdleTimeout("no data for 60 s"))

    def cut() -> FakeResponse:
        return FakeResponse(200, [CHUNK], UpstreamPayloadError("Response payload cut"))

    app, _ = _app({SICK: [idles, cut, _ok], OTHER: [_ok]})
    breaker = _probing(app)
    breaker.success()  # closed, no failures yet
    status, body, _ = await _call(app, _chat())
    assert status == 200 and b"idle_timeout" in body
    assert (breaker.consecutive, breaker.last_kind) == (1, "timeout")
    status, body, _ = await _call(app, _chat())
    assert status == 200 and b"upstream_stream_error" in body
    assert (breaker.consecutive, breaker.last_kind) == (1, "protocol")  # its first byte: 0, +1
    status, body, _ = await _call(app, _chat())
    assert (status, body, breaker.consecutive) == (200, CHUNK + DONE, 0)
