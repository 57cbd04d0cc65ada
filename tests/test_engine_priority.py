"""Engines that order their queue by priority (vLLM's --scheduling-policy priority, SGLang's
--enable-priority-scheduling): the level the admission gives each request (its class, and
its tenant's standing), the body the engine gets, and the bench mock's priority queue."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from proxy.admission.slots import Admission, Ticket
from proxy.bench.mock.backend import EngineSettings, MockEngine
from proxy.forwarding.intake import with_priority
from tests.support import ServerThread, api_key


def test_the_level_is_the_class_and_one_more_for_a_tenant_over_its_share() -> None:
    admission = Admission(limit=8, queue=0, wait_s=1.0)
    flood = [Ticket("flood") for _ in range(3)]
    for t in flood:
        assert admission.admit_now(t)
    assert [t.level for t in flood] == [0, 0, 0]  # alone: the whole fleet is its share
    quiet = Ticket("quiet")
    assert admission.admit_now(quiet) and quiet.level == 0  # 1 of 4: under its half
    more = Ticket("flood")
    assert admission.admit_now(more) and more.level == 1  # 4 of 5: over its half
    heavy = Ticket("quiet", weight=4.0)
    assert admission.admit_now(heavy) and heavy.level == 0  # 2 of 6 with 4/5 of the weight
    live, batch = Ticket("ui", rank=0), Ticket("job", rank=2)
    assert admission.admit_now(live) and live.level == -2
    assert admission.admit_now(batch) and batch.level == 2


def test_the_priority_is_spliced_in_or_replaces_the_clients() -> None:
    raw = b'{"model":"m","messages":[]}'
    out = with_priority(raw, orjson.loads(raw), -1)
    assert out == b'{"priority":-1,"model":"m","messages":[]}'
    sent = b'{"model":"m","priority":-100}'  # a client may not put itself first
    assert orjson.loads(with_priority(sent, orjson.loads(sent), 1)) == {
        "model": "m",
        "priority": 1,
    }


async def test_the_mock_prefills_by_priority_lower_first_then_in_arrival_order() -> None:
    engine = MockEngine(EngineSettings(0, prefill_tokens_per_s=1e9, priority_scheduling=True))
    order: list[str] = []

    async def prefill(name: str, priority: int) -> None:
        await engine.prefill([name], priority)
        order.append(name)

    engine._busy = True  # as if a prefill were running
    tasks = [
        asyncio.create_task(prefill(n, p))
        for n, p in (("batch", 2), ("std-1", 0), ("live", -2), ("std-2", 0))
    ]
    for _ in range(3):
        await asyncio.sleep(0)
    assert engine.waiting == 4
    engine._next()  # the running prefill ends
    await asyncio.gather(*tasks)
    assert order == ["live", "std-1", "std-2", "batch"]
    assert not engine._busy and engine.waiting == 0


async def test_a_cancelled_turn_passes_the_engine_on() -> None:
    engine = MockEngine(EngineSettings(0, prefill_tokens_per_s=1e9, priority_scheduling=True))
    engine._busy = True
    gone = asyncio.create_task(engine.prefill(["a"], 0))
    kept = asyncio.create_task(engine.prefill(["b"], 1))
    await asyncio.sleep(0)
    engine._next()  # a's turn...
    gone.cancel()  # ...as its client leaves
    with pytest.raises(asyncio.CancelledError):
        await gone
    await kept  # b got the engine
    assert not engine._busy


@pytest.mark.e2e
@pytest.mark.parametrize("order", ["lower_first", "higher_first"])
def test_a_keyed_request_reaches_an_engine_with_its_priority_in_the_engines_sense(
    order: str, fake_backends: Any, proxy_server: Callable[..., ServerThread]
) -> None:
    [(app, backend)] = fake_backends(1)
    config = {
        "server": {"api_keys": [api_key("app"), api_key("batch-job")]},
        "tenants": {"keys": {"batch-job": {"priority": "batch"}}},
        "backends": [{"url": backend.url, "engine_priority": order}],
    }
    proxy = proxy_server([backend.url], config=config)
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
    for name in ("app", "batch-job"):
        r = httpx.post(
            proxy.url + "/v1/chat/completions",
            json={**body, "priority": -50},  # a client's own is replaced
            headers={"authorization": f"Bearer key-{name}"},
            timeout=10,
        )
        assert r.status_code == 200, r.text
    sign = 1 if order == "lower_first" else -1
    assert [r["body"]["priority"] for r in app.rec.requests] == [0, 2 * sign]


@pytest.mark.e2e
def test_without_engine_priority_the_body_goes_as_the_client_sent_it(
    fake_backends: Any, proxy_server: Callable[..., ServerThread]
) -> None:
    [(app, backend)] = fake_backends(1)
    proxy = proxy_server([backend.url], config={"server": {"api_keys": [api_key("app")]}})
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": "Bearer key-app"},
        timeout=10,
    )
    assert r.status_code == 200 and "priority" not in app.rec.requests[0]["body"]


@pytest.mark.e2e
def test_the_mock_refuses_a_priority_it_does_not_schedule_by_as_vllm_does(
    fake_backends: Any,
) -> None:
    [(_, backend)] = fake_backends(1, cache_tokens=1000)  # an engine, first come first served
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
    url = backend.url + "/v1/chat/completions"
    assert httpx.post(url, json={**body, "priority": 0}, timeout=10).status_code == 200
    r = httpx.post(url, json={**body, "priority": 3}, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "Got priority 3 but Priority scheduling is not enabled."
    )
    r = httpx.post(url, json={**body, "priority": "high"}, timeout=10)
    assert r.status_code == 400 and "valid integer" in r.json()["error"]["message"]
