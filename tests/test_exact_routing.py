"""Routing with engines that publish their KV events: their word replaces the index's guess."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.config import RoutingConfig
from proxy.routing.index import MemoryPrefixIndex
from proxy.routing.router import Router
from proxy.routing.setup import build_router
from tests.test_capacity import SYSTEMS, backend, chat


class FakeView:
    def __init__(self, held: Sequence[int] = (), live: bool = True) -> None:
        self.held = set(held)
        self.live = live

    def match(self, blocks: Sequence[int]) -> int:
        n = 0
        for h in blocks:
            if h not in self.held:
                break
            n += 1
        return n

    def match_tiers(self, blocks: Sequence[int]) -> tuple[int, ...]:
        return (self.match(blocks),) * 4  # (no slower tier)


def _keyed(r: Router, i: int):  # type: ignore[no-untyped-def]
    """A request keyed as exact mode (or a token-id prompt) would be: blocks of token ids."""
    ctx = chat(SYSTEMS[0], i)
    key = r.hasher.key(ctx.model, ctx.api, ctx.body)
    ctx.prefix_blocks, ctx.prompt_chars, ctx.block_chars = key.blocks, key.chars, key.block_chars
    ctx.token_keyed = True
    return ctx


def router() -> Router:
    return build_router(RoutingConfig(policy="prefix_aware"), index=MemoryPrefixIndex())


async def test_a_live_event_view_overrides_the_index_and_says_so() -> None:
    r = router()
    ctx = chat(SYSTEMS[0], 1)
    first = await r.route(ctx, [backend("e0"), backend("e1")])
    ctx.token_keyed = True
    home = first.winner
    other = "e1" if home == "e0" else "e0"
    # The engine behind `home` reports it evicted everything; `other` holds the prompt.
    r.exact = {home: FakeView(), other: FakeView(ctx.prefix_blocks)}  # type: ignore[dict-item]
    r.pending_s = 0.0  # (the first request's prefill is long done)
    again = await r.route(_keyed(r, 2), [backend("e0"), backend("e1")], record=False)
    assert again.matched_blocks[home] == 0
    assert again.matched_blocks[other] >= len(ctx.prefix_blocks) - 2
    assert again.match_source(home) == "kv_events" and again.as_dict()["match_source"][other] == (
        "kv_events"
    )


async def test_a_silent_event_stream_falls_back_to_the_learned_index() -> None:
    r = router()
    ctx = chat(SYSTEMS[0], 1)
    home = (await r.route(ctx, [backend("e0"), backend("e1")])).winner or ""
    r.exact = {home: FakeView(live=False)}  # type: ignore[dict-item]
    again = await r.route(_keyed(r, 2), [backend("e0"), backend("e1")], record=False)
    assert again.match_source(home) == "index"
    assert again.matched_blocks[home] >= len(ctx.prefix_blocks) - 2  # the index's own record


async def test_character_keyed_requests_never_compare_with_engine_blocks() -> None:
    r = router()
    ctx = chat(SYSTEMS[0], 1)
    home = (await r.route(ctx, [backend("e0"), backend("e1")])).winner or ""
    r.exact = {home: FakeView()}  # type: ignore[dict-item]
    again = await r.route(chat(SYSTEMS[0], 2), [backend("e0"), backend("e1")], record=False)
    assert again.match_source(home) == "index" and again.matched_blocks[home] > 0


async def test_a_prefix_sent_moments_ago_counts_as_held_before_its_events_arrive() -> None:
    # The engine publishes BlockStored once the prefill has computed the blocks; a request sent
    # now queues behind that prefill and will find them.
    r = router()
    first = await r.route(_keyed(r, 1), [backend("e0"), backend("e1")])
    home = first.winner or ""
    r.exact = {home: FakeView()}  # type: ignore[dict-item]
    again = await r.route(_keyed(r, 2), [backend("e0"), backend("e1")], record=False)
    assert again.match_source(home) == "kv_events"
    assert again.matched_blocks[home] >= first.prefix_blocks - 2
