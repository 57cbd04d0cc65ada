"""Slot engines (llama.cpp): a second request of a prompt waits for the slot that holds it.

While a request of prompt A runs on a slot engine, the next request of A would take another
slot and overwrite the prompt there (two cold prefills where one wait would do), so it waits
for the running one to end, at most `slot_wait` cold prefills of its prompt. Other prompts,
other engines and engines that are not slot engines never wait. Waits end on events, not
on clocks: these tests release them by hand.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from proxy.config import load_config
from proxy.routing.slot_turns import SlotTurns
from proxy.routing.slots import SlotLayout
from proxy.server.app import create_app
from tests.forward_support import CHUNK, DONE, FakeResponse, FakeUpstream, request
from tests.support import eventually

A = ("e0", 1)


async def test_a_request_waits_only_while_its_prompt_runs_there() -> None:
    turns = SlotTurns()
    assert await turns.take(A, 5.0) == 0.0  # nothing runs: at once
    second = asyncio.create_task(turns.take(A, 5.0))
    other = await turns.take(("e0", 2), 5.0)  # another prompt on the same engine
    elsewhere = await turns.take(("e1", 1), 5.0)  # the same prompt on another engine
    assert other == elsewhere == 0.0
    await eventually(lambda: turns.info()["waiting"] == 1)
    assert not second.done()
    turns.leave(A)  # the first is over: the second runs now, counted as running
    assert await second >= 0.0
    assert turns.running[A] == 1 and not turns.waiting
    turns.leave(A)
    assert A not in turns.running
    assert turns.info()["waits"] == 1 and turns.info()["turns"] == 1


async def test_waiters_go_one_at_a_time_in_arrival_order() -> None:
    turns = SlotTurns()
    await turns.take(A, 5.0)
    order: list[int] = []

    async def wait(i: int) -> None:
        await turns.take(A, 5.0)
        order.append(i)

    tasks = [asyncio.create_task(wait(i)) for i in range(3)]
    await eventually(lambda: turns.info()["waiting"] == 3)
    for expected in ([0], [0, 1], [0, 1, 2]):
        turns.leave(A)
        await eventually(lambda n=len(expected): len(order) == n)
        assert order == expected
        assert turns.running[A] == 1  # never two at once
    await asyncio.gather(*tasks)
    # A newcomer while one runs and none waits waits too (the slot is still busy).
    assert turns.busy(A)


async def test_a_wait_past_its_limit_goes_anyway() -> None:
    turns = SlotTurns()
    await turns.take(A, 5.0)
    waited = await turns.take(A, 0.01)  # a long generation ahead: it goes as it would have
    assert waited >= 0.01
    assert turns.running[A] == 2 and not turns.waiting
    assert turns.info()["timeouts"] == 1
    turns.leave(A)
    turns.leave(A)
    assert not turns.running


async def test_a_waiter_that_leaves_gives_up_its_place_and_its_turn() -> None:
    turns = SlotTurns()
    await turns.take(A, 5.0)
    gone = asyncio.create_task(turns.take(A, 5.0))
    await eventually(lambda: turns.info()["waiting"] == 1)
    nxt = asyncio.create_task(turns.take(A, 5.0))
    await eventually(lambda: turns.info()["waiting"] == 2)
    gone.cancel()  # the client hung up while waiting
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert turns.info()["waiting"] == 1
    turns.leave(A)
    await nxt  # the turn went to the one still waiting
    assert turns.running[A] == 1
    turns.leave(A)
    assert not turns.running and not turns.waiting


async def test_a_turn_handed_to_a_waiter_cancelled_at_once_passes_on() -> None:
    turns = SlotTurns()
    await turns.take(A, 5.0)
    first = asyncio.create_task(turns.take(A, 5.0))
    second = asyncio.create_task(turns.take(A, 5.0))
    await eventually(lambda: turns.info()["waiting"] == 2)
    turns.leave(A)  # hands the slot to `first`...
    first.cancel()  # ... which is cancelled before it runs: the turn goes to `second`
    with pytest.raises(asyncio.CancelledError):
        await first
    await second
    assert turns.running[A] == 1 and not turns.waiting


def test_the_limit_is_the_prompts_cold_prefill_there() -> None:
    turns = SlotTurns(factor=1.0, max_wait_s=30.0)
    assert turns.limit_s(2_000, 1_000.0) == pytest.approx(2.0)
    assert SlotTurns(factor=0.5).limit_s(2_000, 1_000.0) == pytest.approx(1.0)
    assert turns.limit_s(2_000_000, 1_000.0) == 30.0  # capped
    assert SlotTurns(factor=0.0).limit_s(2_000, 1_000.0) == 0.0  # off: never waits
    assert turns.limit_s(0, 1_000.0) == 0.0


# -- through the proxy -------------------------------------------------------------------

SYSTEM = "You are a careful assistant for a llama.cpp deployment. " * 40  # ~2,200 characters


def _chat(system: str, question: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "m", "stream": True, "messages": messages, "max_tokens": 8}


def _app(slots: bool, slot_wait: float = 1_000.0) -> tuple[Any, FakeUpstream, asyncio.Event]:
    url = "http://127.0.0.1:9101"
    cfg = load_config(flags={"backends": [url]}, env={})
    cfg = cfg.model_validate(
        {
            **cfg.model_dump(),
            "backends": [{"url": url, "models": ["m"], "engine": "llamacpp"}],
            "routing": {**cfg.routing.model_dump(), "slot_wait": slot_wait},
            # the admin views on the serving port (a test's own app: nobody else reaches it)
            "server": {**cfg.server.model_dump(), "admin_port": cfg.server.port},
        }
    )
    app = create_app(cfg)
    if slots:  # as the registry sets it from the engine's /props
        for b in app.state.registry.backends.values():
            b.slots = SlotLayout(2, 4096)
    gate = asyncio.Event()

    async def answer() -> FakeResponse:
        await gate.wait()  # the engine works until the test lets it finish
        return FakeResponse(200, [CHUNK, DONE])

    fake = FakeUpstream({"127.0.0.1:9101": [answer]})  # type: ignore[list-item]
    app.state.forwarding.upstream = fake
    # A slow engine's learned rate: a wait's limit (many seconds) is never what ends it here.
    app.state.routing.router.prefill_rate = lambda backend: 10.0
    return app, fake, gate


async def test_through_the_proxy_the_second_request_of_a_prompt_waits_for_the_first() -> None:
    app, fake, gate = _app(slots=True)
    turns = app.state.forwarding.steering.turns
    first = asyncio.create_task(request(app, _chat(SYSTEM, "What is a slot?")))
    await eventually(lambda: len(fake.calls) == 1)
    second = asyncio.create_task(request(app, _chat(SYSTEM, "And a prompt cache?")))
    await eventually(lambda: turns.info()["waiting"] == 1)
    # Another prompt is not held up by it.
    other = asyncio.create_task(request(app, _chat("Another system prompt entirely. " * 70, "q")))
    await eventually(lambda: len(fake.calls) == 2)
    assert len(fake.calls) == 2 and not second.done()
    gate.set()  # the engine finishes: the first and the other end, then the second is sent
    for task in (first, other, second):
        status, body, _ = await task
        assert status == 200 and body.endswith(DONE)
    assert len(fake.calls) == 3
    info = turns.info()
    assert (info["waits"], info["turns"], info["timeouts"]) == (1, 1, 0)
    assert info["running"] == 0 and info["waiting"] == 0
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        shown = (await client.get("/admin/routing")).json()["slot_turns"]
    assert (shown["waits"], shown["turns"], shown["factor"]) == (1, 1, 1_000.0)


@pytest.mark.parametrize("slots, slot_wait", [(False, 1_000.0), (True, 0.0)])
async def test_no_wait_on_a_block_pool_engine_or_when_turned_off(
    slots: bool, slot_wait: float
) -> None:
    app, fake, gate = _app(slots=slots, slot_wait=slot_wait)
    first = asyncio.create_task(request(app, _chat(SYSTEM, "What is a slot?")))
    second = asyncio.create_task(request(app, _chat(SYSTEM, "And a prompt cache?")))
    await eventually(lambda: len(fake.calls) == 2)  # both sent at once
    gate.set()
    assert [(await t)[0] for t in (first, second)] == [200, 200]
    assert app.state.forwarding.steering.turns.info()["waits"] == 0
