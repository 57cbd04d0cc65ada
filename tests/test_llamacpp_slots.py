"""llama-server's slots, read by the registry from the real engine, and the capacity floor they
set: two requests of one prompt at once take both slots and evict the other prompt (a miss
the block-pool learner took for a smaller cache), and the estimate stays at the two prompts
the slots hold (proxy.routing.slots)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from proxy.config import load_config
from proxy.routing.capacity import CapacityLearner, Outcome
from proxy.routing.index import capacity_blocks_from_tokens
from proxy.routing.slots import SlotLayout, from_slots
from proxy.upstream.backends import BackendRegistry
from tests.llamacpp import (
    Engine,
    LlamaServer,
    llamacpp_engine,
    long_system_prompt,
    running_servers,
    stream_chat,
)
from tests.support import until

pytestmark = [pytest.mark.llamacpp, pytest.mark.e2e]

__all__ = ["llamacpp_engine"]  # the fixture, re-exported so pytest finds it in this module


@pytest.fixture(scope="module")
def engine(llamacpp_engine: Engine) -> Iterator[LlamaServer]:
    # 2 slots of 4,096 tokens (8,192 in all), no host prompt cache: slots are all it keeps.
    with running_servers(llamacpp_engine, 1, ctx=8192, parallel=2) as [server]:
        yield server


async def _scraped_layout(server: LlamaServer) -> SlotLayout:
    config = load_config(flags={"backends": [server.url + "#engine=llamacpp"]}, env={})
    async with httpx.AsyncClient() as http:
        registry = BackendRegistry(config, http)
        told: list[SlotLayout] = []
        registry.on_slots = lambda name, layout: told.append(layout)
        [backend] = registry.backends.values()
        await registry._scrape(backend)
        await registry._scrape(backend)  # asked once: a second scrape tells nothing new
    assert len(told) == 1 and backend.slots == told[0]
    return told[0]


def test_the_registry_reads_the_slots_the_engine_runs(engine: LlamaServer) -> None:
    layout = asyncio.run(_scraped_layout(engine))
    assert layout == SlotLayout(2, 4096, "props")
    # /slots says the same, slot by slot.
    assert from_slots(json.loads(engine.get("/slots"))) == SlotLayout(2, 4096, "slots")


def _chat(server: LlamaServer, system: str, user: str, max_tokens: int = 4) -> tuple[int, int]:
    """(prompt tokens, cached tokens) as the engine reported them."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    usage = stream_chat(server.url, messages, max_tokens).usage or {}
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def _busy(server: LlamaServer) -> int:
    return sum(bool(s.get("is_processing")) for s in json.loads(server.get("/slots")))


def test_a_second_copy_evicts_the_other_prompt_and_the_floor_holds(
    engine: LlamaServer,
) -> None:
    a, b = long_system_prompt("slot-a"), long_system_prompt("slot-b")
    prompt, _ = _chat(engine, a, "first a")
    _chat(engine, b, "first b")  # the least recently used idle slot: a and b one slot each
    assert _chat(engine, a, "a again")[1] > 0.8 * prompt
    # A second request of a while the first holds a's slot: it takes b's slot.
    long_a = threading.Thread(target=_chat, args=(engine, a, "a, long", 400))
    long_a.start()
    until(lambda: _busy(engine) == 1, "the long request of a to hold its slot")
    _chat(engine, a, "a, alongside")
    long_a.join()
    prompt_b, cached_b = _chat(engine, b, "b again")
    assert cached_b < 0.2 * prompt_b  # b was evicted: by concurrency, not by size

    # That miss, as the learner sees it: the index predicted b whole and got none of it.
    blocks = len(b) // 64
    learner = CapacityLearner()
    learner.set_slots("e", SlotLayout(2, 4096), capacity_blocks_from_tokens(4096, 64, 4.0))
    miss = Outcome(
        predicted_blocks=blocks,
        prompt_blocks=blocks,
        cached_fraction=cached_b / prompt_b,
        occupancy=4 * blocks,
    )
    for _ in range(40):
        learner.observe("e", miss)
    assert learner.capacity("e") >= 2 * blocks  # the slots' two prompts still fit
