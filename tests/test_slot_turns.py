"""Slot engines (llama.cpp): a second request of a prompt waits for the slot that holds it.

While a request of prompt A runs on a slot engine, the next request of A would take another
slot and overwrite the prompt there (two cold prefills where one wait would do), so it waits
for the running one to end, at most `slot_wait` cold prefills of its prompt. Other prompts,
other engines and engines that are not slot engines never wait. Waits end on events, not
on clocks: these tests release them by hand.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import orjson
import pytest

from proxy.config import load_config
from proxy.routing.slot_turns import SlotTurns, Turn
from proxy.routing.slots import SlotLayout
from proxy.server.app import create_app
from tests.forward_support import CHUNK, DONE, FakeResponse, FakeUpstream, asgi_request, request
from tests.support import eventually

A = ("e0", 1)


async def test_a_request_waits_only_while_its_prompt_runs_there() -> None:
    turns = SlotTurns()
    first, waited = await turns.take(A, 5.0)  # nothing runs: at once
    assert waited == 0.0 and first == Turn(A, False)
    second = asyncio.create_task(turns.take(A, 5.0))
    other, _ = await turns.take(("e0", 2), 5.0)  # another prompt on the same engine
    elsewhere, _ = await turns.take(("e1", 1), 5.0)  # the same prompt on another engine
    assert not other.collided and not elsewhere.collided
    await eventually(lambda: turns.info()["waiting"] == 1)
    assert not second.done()
    turns.leave(first)  # the first is over: the second runs now, counted as running
    turn, _ = await second
    assert turn == Turn(A, False)  # it has the slot to itself: no collision
    assert turns.running[A] == 1 and not turns.waiting
    turns.leave(turn)
    assert A not in turns.running
    info = turns.info()
    assert (info["waits"], info["turns"], info["collisions"]) == (1, 1, 0)


async def test_waiters_go_one_at_a_time_in_arrival_order() -> None:
    turns = SlotTurns()
    running, _ = await turns.take(A, 5.0)
    order: list[int] = []

    async def wait(i: int) -> None:
        turn, _ = await turns.take(A, 5.0)
        order.append(i)
        await done[i].wait()
        turns.leave(turn)

    done = [asyncio.Event() for _ in range(3)]
    tasks = [asyncio.create_task(wait(i)) for i in range(3)]
    await eventually(lambda: turns.info()["waiting"] == 3)
    turns.leave(running)
    for i in range(3):
        await eventually(lambda n=i + 1: len(order) == n)
        assert order == list(range(i + 1))
        assert turns.running[A] == 1  # never two at once
        done[i].set()
    await asyncio.gather(*tasks)
    assert not turns.running and not turns.waiting


async def test_a_wait_past_its_limit_goes_anyway_and_collides() -> None:
    turns = SlotTurns()
    first, _ = await turns.take(A, 5.0)
    late, waited = await turns.take(A, 0.01)  # a long generation ahead: it goes as it would have
    assert waited >= 0.01 and late.collided
    assert turns.running[A] == 2 and not turns.waiting
    assert turns.info()["timeouts"] == 1 and turns.info()["collisions"] == 1
    turns.leave(first)
    turns.leave(late)
    assert not turns.running


async def test_a_waiter_that_leaves_gives_up_its_place_and_its_turn() -> None:
    turns = SlotTurns()
    first, _ = await turns.take(A, 5.0)
    gone = asyncio.create_task(turns.take(A, 5.0))
    await eventually(lambda: turns.info()["waiting"] == 1)
    nxt = asyncio.create_task(turns.take(A, 5.0))
    await eventually(lambda: turns.info()["waiting"] == 2)
    gone.cancel()  # the client hung up while waiting
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert turns.info()["waiting"] == 1
    turns.leave(first)
    turn, _ = await nxt  # the turn went to the one still waiting
    assert turns.running[A] == 1
    turns.leave(turn)
    assert not turns.running and not turns.waiting


async def test_a_turn_handed_to_a_waiter_cancelled_at_once_passes_on() -> None:
    turns = SlotTurns()
    running, _ = await turns.take(A, 5.0)
    first = asyncio.create_task(turns.take(A, 5.0))
    second = asyncio.create_task(turns.take(A, 5.0))
    await eventually(lambda: turns.info()["waiting"] == 2)
    turns.leave(running)  # hands the slot to `first`...
    first.cancel()  # ... which is cancelled before it runs: the turn goes to `second`
    with pytest.raises(asyncio.CancelledError):
        await first
    await second
    assert turns.running[A] == 1 and not turns.waiting


async def test_an_engine_waits_once_its_collisions_came_back_cold(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A collision's cached share tells an engine without a host prompt cache (cold: the
    prompt was prefilled over another slot's) from one that loads it back from RAM."""
    caplog.set_level(logging.INFO, logger="warmroute.routing.slot_turns")
    turns = SlotTurns()
    assert not turns.cold("e0")  # no evidence: it does not wait
    for shares, cold in (([0.02, 0.0], True), ([1.0, 1.0, 1.0], False)):
        for share in shares:
            first, _ = await turns.take(A, 0.0)
            collided, _ = await turns.take(A, 0.0)  # sent at once: a collision
            assert collided.collided
            turns.leave(collided, share)
            turns.leave(first, 0.0)  # (not a collision: says nothing)
        assert turns.cold("e0") is cold
    assert turns.info()["engines"]["e0"]["waits"] is False
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2  # once when the waits began, once when they stopped
    assert "e0" in said[0] and "now waits" in said[0] and "no longer wait" in said[1]
    assert not turns.waits_on("e0")
    turns.collisions["e0"] = 0.0  # cold: it waits, but one would-be wait in 8 is a probe
    asked = [turns.waits_on("e0") for _ in range(16)]
    assert asked.count(False) == 2 == turns.info()["probes"]
    turns.collisions["e0"] = 0.0
    turns.forget("e0")  # a restart: a new engine, perhaps started otherwise
    assert not turns.cold("e0")


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


def _app(
    slots: bool, slot_wait: float = 1_000.0, cold: bool = True
) -> tuple[Any, FakeUpstream, asyncio.Event]:
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
    # What its collisions showed so far: cold (no host prompt cache) or warm.
    app.state.forwarding.steering.turns.collisions["127.0.0.1:9101"] = 0.0 if cold else 1.0
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


@pytest.mark.parametrize(
    "slots, slot_wait, cold",
    [(False, 1_000.0, True), (True, 0.0, True), (True, 1_000.0, False)],
    ids=["block pool", "turned off", "host prompt cache"],
)
async def test_no_wait_on_a_block_pool_with_a_host_cache_or_when_turned_off(
    slots: bool, slot_wait: float, cold: bool
) -> None:
    app, fake, gate = _app(slots=slots, slot_wait=slot_wait, cold=cold)
    first = asyncio.create_task(request(app, _chat(SYSTEM, "What is a slot?")))
    second = asyncio.create_task(request(app, _chat(SYSTEM, "And a prompt cache?")))
    await eventually(lambda: len(fake.calls) == 2)  # both sent at once
    gate.set()
    assert [(await t)[0] for t in (first, second)] == [200, 200]
    assert app.state.forwarding.steering.turns.info()["waits"] == 0


async def test_a_collisions_reported_cache_is_what_the_engine_learns() -> None:
    """No evidence yet: both go at once (a collision), and the cached tokens its engine
    reported for the second say the collision was cold: the next one waits."""
    app, fake, gate = _app(slots=True)
    turns = app.state.forwarding.steering.turns
    turns.collisions.clear()
    usage = {"prompt_tokens": 550, "completion_tokens": 1}
    cold = orjson.dumps(
        {"choices": [], "usage": {**usage, "prompt_tokens_details": {"cached_tokens": 16}}}
    )

    async def answer() -> FakeResponse:
        await gate.wait()
        return FakeResponse(200, [CHUNK, b"data: " + cold + b"\n\n", DONE])

    fake.scripts["127.0.0.1:9101"] = [answer]  # type: ignore[list-item]
    first = asyncio.create_task(request(app, _chat(SYSTEM, "What is a slot?")))
    second = asyncio.create_task(request(app, _chat(SYSTEM, "And a prompt cache?")))
    await eventually(lambda: len(fake.calls) == 2)  # both sent at once
    gate.set()
    await asyncio.gather(first, second)
    assert turns.info()["collisions"] == 1
    assert turns.cold("127.0.0.1:9101")
    assert turns.info()["engines"]["127.0.0.1:9101"]["waits"] is True


async def test_a_client_that_leaves_while_waiting_is_never_sent_and_frees_its_place() -> None:
    app, fake, gate = _app(slots=True)
    turns = app.state.forwarding.steering.turns
    first = asyncio.create_task(request(app, _chat(SYSTEM, "What is a slot?")))
    await eventually(lambda: len(fake.calls) == 1)
    left = asyncio.Event()
    body = _chat(SYSTEM, "And a prompt cache?")
    gone = asyncio.create_task(asgi_request(app, body, leave=left))
    await eventually(lambda: turns.info()["waiting"] == 1)
    left.set()  # the client hangs up while its request waits for the slot
    await gone
    await eventually(lambda: turns.info()["waiting"] == 0)
    assert len(fake.calls) == 1  # never sent: the engine's other slot keeps its prompt
    gate.set()
    status, _, _ = await first
    assert status == 200
    assert turns.info()["running"] == 0 and not turns.running
