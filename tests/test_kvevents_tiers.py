"""Cache tiers: a block an engine offloaded to host memory, disk or a remote pool is a hit it
loads instead of recomputing, cheaper than a cold prefill and dearer than one on the GPU."""

from __future__ import annotations

from plugins.bounded_load_picker import BoundedLoadPicker
from plugins.predicted_ttft_scorer import PredictedTtftScorer
from proxy.config import RoutingConfig
from proxy.kvevents.view import TIERS, KvCacheView
from proxy.kvevents.wire import BlockRemoved, BlockStored
from proxy.routing.index import MemoryPrefixIndex
from proxy.routing.setup import build_router
from proxy.routing.types import RouteContext
from tests.test_capacity import backend

BS = 16


class LiveView:
    """An event view the router trusts, as EngineCache is while its stream is live."""

    live = True

    def __init__(self, view: KvCacheView) -> None:
        self.view = view

    def match(self, blocks: list[int]) -> int:
        return self.view.match(blocks)

    def match_tiers(self, blocks: list[int]) -> tuple[int, ...]:
        return self.view.match_tiers(blocks)


def context(ids: list[int]) -> RouteContext:
    body = {"model": "m", "prompt": ids, "max_tokens": 1}
    return RouteContext(request_id="r", model="m", api="completions", body=body, headers={}, now=0)


def held(ids: list[int], n: int, medium: str, hashes: list[int]) -> list[BlockStored]:
    return [BlockStored(hashes[:n], None, ids[: n * BS], BS, medium=medium)]


async def test_the_router_reports_the_depth_each_slower_tier_reaches() -> None:
    r = build_router(RoutingConfig(policy="prefix_aware"), index=MemoryPrefixIndex())
    ids = list(range(10_000, 10_000 + 10 * BS))
    hashes = [-(i + 1) for i in range(10)]
    views = {name: KvCacheView("m", BS) for name in ("gpu", "host", "cold")}  # 16: the default
    views["gpu"].apply(held(ids, 10, "GPU", hashes))
    views["host"].apply(
        held(ids, 2, "GPU", hashes) + held(ids, 8, "CPU", hashes) + held(ids, 10, "DISK", hashes)
    )
    r.exact = {name: LiveView(v) for name, v in views.items()}  # type: ignore[misc]
    ctx = context(ids)
    await r.route(ctx, [backend("gpu"), backend("host"), backend("cold")], record=False)
    n = len(ctx.prefix_blocks)
    assert ctx.matched_blocks == {"gpu": n, "host": 2, "cold": 0}  # the GPU depth, as before
    assert ctx.tier_blocks == {"host": {"CPU": 8, "DISK": n, "REMOTE": n}}
    assert ctx.exact == {"gpu", "host", "cold"}


def test_a_slower_tiers_blocks_count_by_the_share_of_prefill_they_save() -> None:
    scorer = PredictedTtftScorer()
    ctx = context([])
    ctx.prompt_chars, ctx.block_chars = 40 * 64, 64  # 40 blocks of 16 tokens
    ctx.matched_blocks = {"gpu": 20, "host": 2, "disk": 2, "cold": 0}
    ctx.tier_blocks = {"host": {"CPU": 20, "DISK": 20, "REMOTE": 20}, "disk": {"DISK": 20}}
    assert scorer.cached_blocks(ctx, "gpu") == 20 and scorer.cached_blocks(ctx, "cold") == 0
    assert scorer.cached_blocks(ctx, "host") == 2 + 18 * 0.8
    assert scorer.cached_blocks(ctx, "disk") == 2 + 18 * 0.25
    views = [backend(n) for n in ("gpu", "host", "disk", "cold")]
    for b in views:
        b.prefill_tokens_per_s = 5000.0
    ttft = {b.name: scorer.predict(ctx, b, 5000.0) for b in views}
    assert ttft["gpu"] < ttft["host"] < ttft["disk"] < ttft["cold"]
    scores = scorer.score(ctx, views)
    assert scores["gpu"] == 1.0 and scores["gpu"] > scores["host"] > scores["disk"] > scores["cold"]


def test_a_host_tier_beyond_the_gpu_is_priced_block_by_block() -> None:
    """GPU to 2, host memory to 5, disk to 9: 2 + 3 x CPU + 4 x disk."""
    scorer = PredictedTtftScorer(cpu_saves=0.5, disk_saves=0.1, remote_saves=0.0)
    ctx = context([])
    ctx.matched_blocks = {"e": 2}
    ctx.tier_blocks = {"e": {"CPU": 5, "DISK": 9, "REMOTE": 9}}
    assert abs(scorer.cached_blocks(ctx, "e") - (2 + 3 * 0.5 + 4 * 0.1)) < 1e-9
    assert PredictedTtftScorer.Settings.of({"cpu_saves": 0.9}).cpu_saves == 0.9
    assert set(scorer.saves) == set(TIERS[1:])  # the names the view and the router use


def test_the_pickers_spill_arithmetic_counts_a_tiers_blocks_too() -> None:
    picker = BoundedLoadPicker()
    ctx = context([])
    ctx.prompt_chars, ctx.block_chars = 10 * 64, 64
    ctx.matched_blocks = {"e": 0}
    ctx.tier_blocks = {"e": {"CPU": 10, "DISK": 10, "REMOTE": 10}}
    assert picker._ttft.cached_blocks(ctx, "e") == 8.0


def test_a_block_removed_from_the_gpu_but_kept_on_the_host_is_still_a_tiered_hit() -> None:
    ids = list(range(4 * BS))
    view = KvCacheView("m", BS)
    hashes = [11, 12, 13, 14]
    view.apply(held(ids, 4, "GPU", hashes) + held(ids, 4, "CPU", hashes))
    view.apply([BlockRemoved(hashes[1:], "GPU")])
    keys = sorted(view.keys())
    assert len(keys) == 1 and view.stats()["tiers"] == {"GPU": 1, "CPU": 4}
