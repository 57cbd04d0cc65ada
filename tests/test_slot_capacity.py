"""Slot engines (llama.cpp): the layout read from /props and /slots, and the capacity floor it
sets under the learner (proxy.routing.slots, proxy.upstream.slot_scrape)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from proxy.config import load_config
from proxy.routing.capacity import CapacityLearner, Outcome
from proxy.routing.slots import SlotFloor, SlotLayout, from_props, from_slots
from proxy.upstream import slot_scrape
from proxy.upstream.backends import BackendRegistry

# Shaped as llama.cpp writes them (tools/server/server-context.cpp: get_res_props and
# server_slot::to_json with only_metrics, the default), trimmed to the fields read and a few.
PROPS = {
    "default_generation_settings": {"params": {"n_predict": -1}, "n_ctx": 4096},
    "total_slots": 2,
    "model_alias": "tiny",
    "endpoint_slots": True,
    "is_sleeping": False,
}
SLOTS = [
    {"id": 0, "n_ctx": 4096, "speculative": False, "is_processing": False},
    {"id": 1, "n_ctx": 4096, "speculative": False, "is_processing": True, "id_task": 7},
]


def test_layout_from_props_and_slots() -> None:
    assert from_props(PROPS) == SlotLayout(2, 4096, "props")
    assert from_slots(SLOTS) == SlotLayout(2, 4096, "slots")
    assert from_props({"total_slots": 3}) == SlotLayout(3, None, "props")
    for bad in ({}, {"total_slots": 0}, {"total_slots": True}, {"total_slots": "2"}, [], None):
        assert from_props(bad) is None
    for bad in ([], {}, [1, 2], None):
        assert from_slots(bad) is None


def test_ask_falls_back_to_slots_and_inference() -> None:
    def server(answers: dict[str, tuple[int, Any]]) -> Any:
        async def get(path: str) -> httpx.Response:
            status, body = answers.get(path, (404, {"error": "not found"}))
            return httpx.Response(status, json=body)

        return get

    both = server({"/props": (200, PROPS), "/slots": (200, SLOTS)})
    assert asyncio.run(slot_scrape.ask(both)) == SlotLayout(2, 4096, "props")
    no_props = server({"/slots": (200, SLOTS)})
    assert asyncio.run(slot_scrape.ask(no_props)) == SlotLayout(2, 4096, "slots")
    assert asyncio.run(slot_scrape.ask(server({}))) is None
    # Told nothing: as many slots as were seen busy at once, and only ever more.
    seen = slot_scrape.inferred(None, 2.0)
    assert seen == SlotLayout(2, None, "running")
    assert slot_scrape.inferred(seen, 1.0) is None
    assert slot_scrape.inferred(seen, 3.0) == SlotLayout(3, None, "running")
    assert slot_scrape.inferred(SlotLayout(2, 4096), 3.0) is None  # the engine's word stands
    assert slot_scrape.inferred(None, 0.0) is None


def test_floor_arithmetic() -> None:
    floor = SlotFloor(SlotLayout(2, 4096), slot_blocks=256, fill=0.8)
    assert floor.blocks(0) == 0.0
    assert floor.blocks(114) == 2 * 114 / 0.8
    short = SlotFloor(SlotLayout(2, 1000), slot_blocks=60, fill=0.8)
    assert short.blocks(114) == 2 * 60 / 0.8  # a slot never holds more than its n_ctx


def miss(prompt: int = 114, occupancy: int = 240) -> Outcome:
    """A false hit: the index predicted the whole prompt, the engine had none of it."""
    return Outcome(
        predicted_blocks=prompt, prompt_blocks=prompt, cached_fraction=0.0, occupancy=occupancy
    )


def test_false_hits_stop_at_the_slots_floor() -> None:
    plain, slotted = CapacityLearner(), CapacityLearner()
    assert not slotted.set_slots("e", SlotLayout(2, 4096), 256)  # no prompt seen: no floor yet
    for _ in range(40):
        plain.observe("e", miss(occupancy=min(plain.capacity("e"), 300)))
        slotted.observe("e", miss(occupancy=min(slotted.capacity("e"), 300)))
    assert plain.capacity("e") == 114  # a block pool: one prompt, as before
    assert slotted.capacity("e") == round(2 * 114 / 0.8)  # two slots, two prompts
    snap = slotted.snapshot()["e"]
    assert snap["slots"]["slots"] == 2 and snap["slots"]["floor_blocks"] == 285
    # Another replica's smaller estimate is bounded the same way.
    assert not slotted.adopt("e", 100)
    assert slotted.capacity("e") == 285


def test_slots_told_after_the_shrink_raise_the_estimate() -> None:
    learner = CapacityLearner()
    moved: list[str] = []
    learner.listener = moved.append
    for _ in range(40):
        learner.observe("e", miss(occupancy=min(learner.capacity("e"), 300)))
    assert learner.capacity("e") == 114
    assert learner.set_slots("e", SlotLayout(2, 4096), 256)  # the typical prompt is known
    assert learner.capacity("e") == 285 and moved[-1] == "e"
    assert "slots: 2 prompts" in learner.estimate("e").last_change


def test_ghost_hits_still_grow_past_the_floor() -> None:
    """A host prompt cache (--cache-ram) holds more than the slots: evidence grows it."""
    learner = CapacityLearner()
    learner.set_slots("e", SlotLayout(2, 4096), 256)
    for _ in range(40):
        learner.observe("e", miss(occupancy=min(learner.capacity("e"), 300)))
    grown = Outcome(
        predicted_blocks=0, prompt_blocks=114, cached_fraction=1.0, occupancy=285, ghost_blocks=114
    )
    assert learner.observe("e", grown) == "grow"
    assert learner.capacity("e") > 285


def test_a_restart_forgets_the_slots() -> None:
    learner = CapacityLearner()
    learner.set_slots("e", SlotLayout(2, 4096), 256)
    learner.forget("e")
    assert "e" not in learner.slot_floors
    for _ in range(40):
        learner.observe("e", miss(occupancy=min(learner.capacity("e"), 300)))
    assert learner.capacity("e") == 114


def _registry(answers: dict[str, httpx.Response]) -> tuple[BackendRegistry, list[SlotLayout]]:
    def answer(request: httpx.Request) -> httpx.Response:
        return answers.get(request.url.path, httpx.Response(404, text="not found"))

    config = load_config(flags={"backends": ["http://cpu:8080#engine=llamacpp"]}, env={})
    registry = BackendRegistry(config, httpx.AsyncClient(transport=httpx.MockTransport(answer)))
    told: list[SlotLayout] = []
    registry.on_slots = lambda name, layout: told.append(layout)
    return registry, told


def _metrics(running: int) -> httpx.Response:
    return httpx.Response(
        200, text=f"llamacpp:requests_processing {running}\nllamacpp:requests_deferred 0\n"
    )


async def test_the_registry_asks_once_and_again_after_a_restart() -> None:
    registry, told = _registry({"/metrics": _metrics(0), "/props": httpx.Response(200, json=PROPS)})
    [b] = registry.backends.values()
    await registry._scrape(b)
    await registry._scrape(b)
    assert told == [SlotLayout(2, 4096, "props")] and b.slots == told[0]
    b.slots, b.slots_asked = None, False  # as the registry does before on_restart
    await registry._scrape(b)
    assert told == [SlotLayout(2, 4096, "props")] * 2


async def test_an_engine_that_tells_nothing_has_the_slots_seen_busy() -> None:
    answers = {"/metrics": _metrics(1)}
    registry, told = _registry(answers)
    [b] = registry.backends.values()
    await registry._scrape(b)
    answers["/metrics"] = _metrics(3)
    await registry._scrape(b)
    answers["/metrics"] = _metrics(2)
    await registry._scrape(b)
    assert [layout.slots for layout in told] == [1, 3]
    assert b.slots == SlotLayout(3, None, "running")
