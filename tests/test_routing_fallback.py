"""A router that fails is the proxy's fault, not the client's: the request is still served.

Only a prompt routing cannot read (PromptUnreadable) is the client's, and a 400. Any other
error in a decision (a plugin's bug, a broken index) falls back to the least loaded backend
the policy's filters keep; one in the bookkeeping after it (the prefix recorded, the backlog,
the learners) is skipped. Both are counted and logged with a traceback (at most every
FAILURE_LOG_EVERY_S).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from proxy.config import load_config
from proxy.routing.fallback import FALLBACK_POLICY
from proxy.routing.index import MemoryPrefixIndex
from proxy.routing.types import PromptUnreadable
from proxy.server.app import create_app
from tests.forward_support import CHUNK, DONE, FakeResponse, FakeUpstream, chat, ok, request
from tests.test_router import SYSTEM, router, view
from tests.test_router import chat as routed_chat


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a plugin's bug")


async def test_a_failing_picker_falls_back_to_the_least_loaded_backend_that_serves_the_model(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    r = router(MemoryPrefixIndex())
    monkeypatch.setattr(r.policy.picker, "pick", _boom)
    fleet = [
        view("e0", 3),
        view("e1", 1),
        view("e2", 0, models=frozenset({"other"})),  # the model filter still applies
        view("e3", 2),
    ]
    with caplog.at_level(logging.ERROR, logger="warmroute.routing"):
        decision = await r.route(routed_chat(SYSTEM, "q", 1), fleet)
        again = await r.route(routed_chat(SYSTEM, "q", 2), fleet)
    assert decision.policy == FALLBACK_POLICY
    assert decision.ranking == ["e1", "e3", "e0"]
    assert "e2" in decision.filtered_out
    assert "RuntimeError" in decision.reason
    assert again.ranking == decision.ranking
    assert (r.failures, r.last_failure) == (2, "the decision: RuntimeError: a plugin's bug")
    errors = [rec for rec in caplog.records if "routing failed" in rec.getMessage()]
    assert len(errors) == 1  # the second failure within the interval is counted, not logged
    assert errors[0].exc_info is not None and "r1" in errors[0].getMessage()
    failures = r.cache_info()["failures"]
    assert failures == {"count": 2, "last": "the decision: RuntimeError: a plugin's bug"}


async def test_a_failing_filter_still_leaves_the_healthy_backends_of_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r = router(MemoryPrefixIndex())
    monkeypatch.setattr(r.policy.filters[0], "filter", _boom)
    fleet = [
        view("e0", 0, healthy=False),
        view("e1", 5),
        view("e2", 0, models=frozenset({"other"})),
        view("e3", 2),
    ]
    decision = await r.route(routed_chat(SYSTEM, "q"), fleet)
    assert decision.policy == FALLBACK_POLICY
    assert decision.ranking == ["e3", "e1"]


async def test_a_prompt_the_hasher_cannot_read_is_the_clients_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r = router(MemoryPrefixIndex())

    def unreadable(*args: Any) -> Any:
        raise TypeError("content part of an unknown shape")

    monkeypatch.setattr(r.hasher, "key", unreadable)
    with pytest.raises(PromptUnreadable, match="unknown shape"):
        await r.route(routed_chat(SYSTEM, "q"), [view("e0"), view("e1")])
    assert r.failures == 0


def _app(answer: Callable[[], FakeResponse] = ok) -> tuple[Any, FakeUpstream]:
    ports = (9101, 9102)
    cfg = load_config(flags={"backends": [f"http://127.0.0.1:{p}" for p in ports]}, env={})
    cfg = cfg.model_validate(
        {
            **cfg.model_dump(),
            "backends": [{"url": f"http://127.0.0.1:{p}", "models": ["m"]} for p in ports],
        }
    )
    app = create_app(cfg)
    fake = FakeUpstream({f"127.0.0.1:{p}": [answer, answer] for p in ports})
    app.state.forwarding.upstream = fake
    return app, fake


async def test_requests_are_served_while_the_router_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app, fake = _app()
    r = app.state.routing.router
    monkeypatch.setattr(r.policy.picker, "pick", _boom)
    for _ in range(3):
        status, _, _ = await request(app, chat())
        assert status == 200
    assert len(fake.calls) == 3
    assert r.failures == 3


async def test_an_unreadable_prompt_gets_a_400_through_the_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app, fake = _app()

    def unreadable(*args: Any) -> Any:
        raise ValueError("prompt nested too deep")

    monkeypatch.setattr(app.state.routing.router.hasher, "key", unreadable)
    status, body, _ = await request(app, chat())
    assert status == 400
    error = orjson.loads(body)["error"]
    assert error["code"] == "invalid_request"
    assert "prompt nested too deep" in error["message"]
    assert fake.calls == []


@pytest.mark.parametrize("step", ["record", "finished", "observe"])
async def test_a_failing_bookkeeping_step_is_counted_and_the_request_completes(
    monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":1}}\n\n'
    app, _ = _app(lambda: FakeResponse(200, [CHUNK, usage, DONE]))
    r = app.state.routing.router
    monkeypatch.setattr(r, step, _boom)
    status, body, _ = await request(app, chat())
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert r.failures >= 1
    assert r.last_failure.endswith("RuntimeError: a plugin's bug")
