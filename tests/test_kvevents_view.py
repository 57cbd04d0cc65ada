"""The exact view: an engine's KV events turned into warmroute's own block keys."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from proxy.kvevents.view import TIERS, KvCacheView, tier_of
from proxy.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored
from proxy.routing.prefix import PrefixHasher, chain_tokens, seed

BS = 4
MODEL = "m"


def engine_hashes(ids: Sequence[int], salt: bytes = b"engine-seed") -> list[bytes]:
    """Chained block hashes the way an engine might make them, from a seed we never see."""
    out, prev = [], hashlib.sha256(salt).digest()
    for i in range(0, len(ids) - BS + 1, BS):
        prev = hashlib.sha256(prev + repr(ids[i : i + BS]).encode()).digest()
        out.append(prev)
    return out


def stored_events(ids: Sequence[int], cuts: Sequence[int], salt: bytes = b"s") -> list[BlockStored]:
    """BlockStored events for the whole blocks of `ids`, split after the given block counts."""
    hashes = engine_hashes(ids, salt)
    bounds = sorted({c for c in cuts if 0 < c < len(hashes)} | {0, len(hashes)})
    events = []
    for a, b in itertools.pairwise(bounds):
        parent = hashes[a - 1] if a else None
        events.append(BlockStored(hashes[a:b], parent, list(ids[a * BS : b * BS]), BS, None, "GPU"))
    return events


def our_keys(ids: Sequence[int], model: str = MODEL, salt: str | None = None) -> list[int]:
    return chain_tokens(seed(model, salt), ids, BS, 10_000)


@given(
    st.lists(st.integers(0, 2**31 - 1), min_size=BS, max_size=40 * BS),
    st.lists(st.integers(1, 39), max_size=6),
)
def test_per_block_chaining_gives_the_keys_of_chain_tokens_on_the_whole_prompt(
    ids: list[int], cuts: list[int]
) -> None:
    view = KvCacheView(MODEL, BS)
    view.apply(stored_events(ids, cuts))
    keys = our_keys(ids)
    assert view.keys() == frozenset(keys)
    assert view.match(keys) == len(keys)


def test_the_keys_are_the_ones_the_proxy_computes_for_a_token_id_prompt() -> None:
    ids = list(range(1000, 1000 + 10 * BS + 3))
    view = KvCacheView(MODEL, BS)
    view.apply(stored_events(ids, [3, 7]))
    request = PrefixHasher(kv_block_tokens=BS).key(MODEL, "completions", {"prompt": ids})
    assert view.match(request.blocks) == 10


def test_two_engines_with_different_hash_seeds_give_the_same_view() -> None:
    ids = list(range(7 * BS))
    a, b = KvCacheView(MODEL, BS), KvCacheView(MODEL, BS)
    a.apply(stored_events(ids, [2], salt=b"one"))
    b.apply(stored_events(ids, [5], salt=b"two"))
    assert a.keys() == b.keys() and a.engine_hashes().isdisjoint(b.engine_hashes())


def test_match_counts_leading_blocks_and_stops_at_the_first_missing_one() -> None:
    ids = list(range(6 * BS))
    view = KvCacheView(MODEL, BS)
    view.apply(stored_events(ids, []))
    view.apply([BlockRemoved([engine_hashes(ids, b"s")[2]], "GPU")])
    keys = our_keys(ids)
    assert view.match(keys) == 2
    assert view.match(keys[:1]) == 1 and view.match([]) == 0
    assert view.match(our_keys(list(range(50, 50 + 3 * BS)))) == 0
    assert keys[4] in view and len(view) == 5


def test_removals_and_a_clear_empty_the_view() -> None:
    ids = list(range(4 * BS))
    hashes = engine_hashes(ids, b"s")
    view = KvCacheView(MODEL, BS)
    view.apply(stored_events(ids, [1]))
    view.apply([BlockRemoved(hashes[2:], "GPU"), BlockRemoved([b"never stored"], "GPU")])
    assert view.match(our_keys(ids)) == 2
    assert view.stats()["removed"] == 2 and view.stats()["unknown_removals"] == 1
    view.apply([AllBlocksCleared()])
    assert len(view) == 0 and view.stats()["cleared"] == 1


def test_an_announcement_repeated_for_a_reused_prefix_changes_nothing() -> None:
    ids = list(range(3 * BS))
    view = KvCacheView(MODEL, BS)
    view.apply(stored_events(ids, [1]))
    view.apply(stored_events(ids, []))  # vLLM re-announces a prefix-cache hit from the root
    assert view.stats()["stored"] == 3 and len(view) == 3
    view.apply([BlockRemoved(engine_hashes(ids, b"s"), "GPU")])
    assert len(view) == 0


def test_a_block_whose_parent_was_never_seen_is_an_orphan_not_a_guess() -> None:
    ids = list(range(4 * BS))
    _, second = stored_events(ids, [2])
    view = KvCacheView(MODEL, BS)
    view.apply([second])
    assert len(view) == 0 and view.stats()["orphans"] == 2


def test_a_cache_salt_on_the_first_block_seeds_the_chain_like_a_salted_request() -> None:
    ids = list(range(3 * BS))
    event = stored_events(ids, [])[0]
    salted = replace(event, extra_keys=[("tenant-a",), None, None])
    view = KvCacheView(MODEL, BS)
    view.apply([salted])
    assert view.match(our_keys(ids, salt="tenant-a")) == 3
    assert view.match(our_keys(ids)) == 0


def test_a_lora_adapters_blocks_chain_from_the_adapters_name() -> None:
    ids = list(range(2 * BS))
    event = stored_events(ids, [])[0]
    keys = [("sql-lora",), ("sql-lora",)]
    view = KvCacheView(MODEL, BS)
    view.apply([replace(event, lora_id=1, lora_name="sql-lora", extra_keys=keys)])
    assert view.match(our_keys(ids, model="sql-lora")) == 2


def test_blocks_whose_engine_hash_covers_an_image_are_left_out() -> None:
    ids = list(range(4 * BS))
    event = stored_events(ids, [])[0]
    image = [None, None, (("img-sha", 0),), None]
    view = KvCacheView(MODEL, BS)
    view.apply([replace(event, extra_keys=image)])
    assert view.match(our_keys(ids)) == 2 and view.stats()["unkeyable"] == 2


def test_an_old_lora_event_without_the_adapters_name_is_not_keyed() -> None:
    event = stored_events(list(range(BS)), [])[0]
    view = KvCacheView(MODEL, BS)
    view.apply([replace(event, lora_id=3)])
    assert len(view) == 0 and view.stats()["unkeyable"] == 1


def test_other_groups_are_counted_and_ignored() -> None:
    event = stored_events(list(range(2 * BS)), [])[0]
    view = KvCacheView(MODEL, BS)
    view.apply([replace(event, group_idx=1), BlockRemoved(event.block_hashes, None, group_idx=1)])
    assert len(view) == 0 and view.stats()["other_group"] == 4


def test_a_slower_tiers_copy_is_a_tier_of_its_own_and_removed_per_medium() -> None:
    ids = list(range(3 * BS))
    event = stored_events(ids, [])[0]
    keys = our_keys(ids)
    view = KvCacheView(MODEL, BS)
    view.apply([event, replace(event, medium="CPU")])  # in the GPU and offloaded to the host
    assert view.match(keys) == 3 and view.match_tiers(keys) == (3, 3, 3, 3)
    view.apply([BlockRemoved(event.block_hashes[1:], "GPU")])  # the GPU evicts its tail
    assert view.match(keys) == 1 and view.match_tiers(keys) == (1, 3, 3, 3)
    assert view.stats()["tiers"] == {"GPU": 1, "CPU": 3}
    view.apply([BlockRemoved(event.block_hashes[2:], "CPU")])
    assert view.match_tiers(keys) == (1, 2, 2, 2)
    view.apply([BlockRemoved(event.block_hashes, "CPU"), BlockRemoved(event.block_hashes, "GPU")])
    assert view.match_tiers(keys) == (0, 0, 0, 0) and view.stats()["unknown_removals"] == 3
    assert view.engine_hashes() == frozenset()


def test_the_tiered_match_counts_each_block_at_its_fastest_tier() -> None:
    ids = list(range(5 * BS))
    event = stored_events(ids, [])[0]
    h, keys = event.block_hashes, our_keys(ids)
    view = KvCacheView(MODEL, BS)
    view.apply(
        [
            replace(event, medium="DISK"),  # all five on disk
            replace(event, block_hashes=h[:3], token_ids=ids[: 3 * BS], medium="CPU_PINNED"),
            replace(event, block_hashes=h[:1], token_ids=ids[:BS]),  # medium None: the GPU
        ]
    )
    assert view.match_tiers(keys) == (1, 3, 5, 5)
    view.apply([BlockRemoved(h[3:4], "DISK")])
    assert view.match_tiers(keys) == (1, 3, 3, 3)


def test_medium_names_of_every_engine_map_to_a_tier() -> None:
    names = {m: TIERS[tier_of(m)] for m in (None, "GPU", "cuda:0", "CPU", "CPU_PINNED", "DISK")}
    names |= {m: TIERS[tier_of(m)] for m in ("STORAGE", "EXTERNAL", "REMOTE", "something")}
    assert names == {
        None: "GPU", "GPU": "GPU", "cuda:0": "GPU", "CPU": "CPU", "CPU_PINNED": "CPU",
        "DISK": "DISK", "STORAGE": "DISK", "EXTERNAL": "REMOTE", "REMOTE": "REMOTE",
        "something": "REMOTE",
    }  # fmt: skip


@given(
    st.lists(st.integers(0, 2**31 - 1), min_size=3 * BS, max_size=12 * BS),
    st.sampled_from([1, 2, 3, BS, 2 * BS, 3 * BS - 1]),
)
def test_engine_pages_of_any_size_give_the_views_blocks(ids: list[int], page: int) -> None:
    """SGLang's page is 1 token on CUDA by default: each page is an engine block of its own,
    and the view's block is complete once its last token's page is stored."""
    n = len(ids) // page
    hashes = [-(i + 1) for i in range(n)]  # signed, like SGLang's
    events = [
        BlockStored(
            hashes[i : i + 2], hashes[i - 1] if i else None, ids[i * page : (i + 2) * page], page
        )
        for i in range(0, n, 2)
    ]
    view = KvCacheView(MODEL, BS)
    view.apply(events)
    keys = our_keys(ids[: n * page])
    assert view.keys() == frozenset(keys) and view.match(keys) == len(keys)
    view.apply([BlockRemoved(hashes[-1:], "GPU")])  # the last page: the block it completes goes
    last = n * page // BS - (n * page - page) // BS  # blocks the last page completed
    assert view.match(keys) == len(keys) - last
