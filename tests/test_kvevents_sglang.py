"""SGLang's KV events, as its publisher encodes them, read by the wire decoder and the view.

The batches are built with msgspec structs that declare what SGLang's do (field names, order,
defaults and struct options), written from SGLang's source (read for this, not copied:
`python/sglang/srt/disaggregation/kv_events.py` and `python/sglang/srt/mem_cache/`, see
docs/kv-events.md, "SGLang"): the array layout SGLang published up to sgl-project/sglang#37482,
with the `{"cache_salt": ...}` metadata that #30827 appended to salted stores, and the tagged
maps since, where `cache_salt` is a field of `BlockStored` and unset fields are left out.
Block hashes follow SGLang's recipe: a sha256 chain over each page's token ids (4 bytes,
little-endian), a salted chain seeded with sha256(b"sglang-cache-salt-v1\\0" + salt), and the
digest's first 8 bytes read as a signed 64-bit int.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from proxy.kvevents import wire
from proxy.kvevents.subscriber import KvEventSubscriber
from proxy.kvevents.view import KvCacheView
from proxy.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored
from proxy.routing.prefix import PrefixHasher, chain_tokens, seed

BS = 4  # the proxy's block, in tokens
MODEL = "qwen"


# --- SGLang's structs, as declared (the array layout, before sgl-project/sglang#37482) ------
class ArrayEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class Metadata(msgspec.Struct, omit_defaults=True, gc=False):
    cache_salt: str


class ArrayBlockStoredSalted(ArrayBlockStored, tag="BlockStored", kw_only=True):
    metadata: Metadata


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


# --- and since: tagged maps, unset fields left out -----------------------------------------
class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True, gc=False):  # the envelope, in both
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


def payload(*events: Any, rank: int | None = 0) -> bytes:
    return msgspec.msgpack.encode(Batch(1.0, list(events), rank))


def sglang_hashes(ids: Sequence[int], page: int, salt: str | None = None) -> list[int]:
    """SGLang's event hashes for the whole pages of `ids` (a chain from the root)."""
    prior = hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).digest() if salt else b""
    out = []
    for i in range(0, len(ids) - page + 1, page):
        h = hashlib.sha256(prior)
        for t in ids[i : i + page]:
            h.update(t.to_bytes(4, "little"))
        prior = h.digest()
        out.append(int.from_bytes(prior[:8], "big", signed=True))
    return out


def stores(
    ids: Sequence[int], page: int, *, salt: str | None = None, medium: str = "GPU", map_: bool
) -> list[Any]:
    """One BlockStored per page, parent to child, as SGLang's event mixin records a node."""
    hashes = sglang_hashes(ids, page, salt)
    out: list[Any] = []
    for i, h in enumerate(hashes):
        fields: dict[str, Any] = {
            "block_hashes": [h],
            "parent_block_hash": hashes[i - 1] if i else None,
            "token_ids": list(ids[i * page : (i + 1) * page]),
            "block_size": page,
            "lora_id": None,
            "medium": medium,
        }
        if map_:
            out.append(MapBlockStored(**fields, cache_salt=salt))
        elif salt is None:
            out.append(ArrayBlockStored(**fields))
        else:
            out.append(ArrayBlockStoredSalted(**fields, metadata=Metadata(salt)))
    return out


def request_blocks(ids: Sequence[int], salt: str | None = None) -> list[int]:
    body: dict[str, Any] = {"prompt": list(ids)}
    if salt is not None:
        body["cache_salt"] = salt
    return PrefixHasher(kv_block_tokens=BS).key(MODEL, "completions", body).blocks


def test_the_recorded_batches_are_what_sglangs_structs_encode() -> None:
    """Byte for byte, so the fixtures above say what SGLang sends."""
    salted = ArrayBlockStoredSalted([-2], 7, [5], 1, None, "GPU", metadata=Metadata("t"))
    assert msgspec.msgpack.decode(payload(salted, ArrayBlockRemoved([-2]))) == [
        1.0,
        [
            ["BlockStored", [-2], 7, [5], 1, None, "GPU", {"cache_salt": "t"}],
            ["BlockRemoved", [-2], None],
        ],
        0,
    ]
    unsalted = MapBlockStored([-2], None, [5], 1, None, "CPU_PINNED")
    assert msgspec.msgpack.decode(payload(unsalted, MapAllBlocksCleared(), rank=None)) == [
        1.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [-2],
                "parent_block_hash": None,
                "token_ids": [5],
                "block_size": 1,
                "lora_id": None,
                "medium": "CPU_PINNED",
            },
            {"type": "AllBlocksCleared"},
        ],
        None,
    ]
    assert sum(h < 0 for h in sglang_hashes(list(range(64)), 1)) > 16  # most are negative


@pytest.mark.parametrize("map_", [False, True], ids=["array", "map"])
def test_both_layouts_decode_salt_medium_and_signed_hashes(map_: bool) -> None:
    ids = list(range(100, 108))
    events = stores(ids, 2, salt="tenant-a", medium="CPU_PINNED", map_=map_)
    remove = (MapBlockRemoved if map_ else ArrayBlockRemoved)([events[-1].block_hashes[0]], "DISK")
    clear = MapAllBlocksCleared() if map_ else ArrayAllBlocksCleared()
    batch = wire.decode_batch(payload(*events, remove, clear))
    assert batch.skipped == 0 and batch.data_parallel_rank == 0
    first, *_, removed, cleared = batch.events
    assert isinstance(first, BlockStored) and first.cache_salt == "tenant-a"
    assert first.medium == "CPU_PINNED" and first.lora_name is None and first.block_size == 2
    assert first.block_hashes == sglang_hashes(ids, 2, "tenant-a")[:1]
    assert removed == BlockRemoved(remove.block_hashes, "DISK") and cleared == AllBlocksCleared()


def test_the_oldest_sglang_batch_has_no_rank_and_its_events_no_medium() -> None:
    raw = msgspec.msgpack.encode(
        [2.0, [["BlockStored", [-9], None, [1, 2], 2, None], ["BlockRemoved", [-9]]]]
    )
    batch = wire.decode_batch(raw)
    assert batch.events == [BlockStored([-9], None, [1, 2], 2), BlockRemoved([-9])]
    assert batch.data_parallel_rank is None and batch.skipped == 0


@pytest.mark.parametrize("map_", [False, True], ids=["array", "map"])
def test_a_salted_prompt_matches_its_salted_request_and_not_the_unsalted_one(map_: bool) -> None:
    """The issue's case, the right way round: pages of 1 token (SGLang's CUDA default)."""
    ids = list(range(500, 500 + 3 * BS + 1))
    view = KvCacheView(MODEL, BS)
    view.apply(wire.decode_batch(payload(*stores(ids, 1, salt="tenant-a", map_=map_))).events)
    assert view.match(request_blocks(ids, "tenant-a")) == 3
    assert view.match(request_blocks(ids)) == 0
    view.apply(wire.decode_batch(payload(*stores(ids, 1, map_=map_))).events)
    assert view.match(request_blocks(ids)) == 3 and view.stats()["orphans"] == 0


def test_pages_larger_than_the_proxys_block_hold_several_of_its_blocks() -> None:
    ids = list(range(40, 40 + 4 * BS))
    view = KvCacheView(MODEL, BS)
    events = stores(ids, 2 * BS, map_=True)
    view.apply(wire.decode_batch(payload(*events)).events)
    assert view.match(request_blocks(ids)) == 4
    view.apply([BlockRemoved(events[1].block_hashes, "GPU")])  # SGLang evicts from the leaf
    assert view.match(request_blocks(ids)) == 2


def test_hicache_tiers_gpu_host_disk_and_a_remote_pool() -> None:
    """HiCache backs a node up to host memory (CPU_PINNED), evicts it from the GPU, keeps it on
    disk or in a remote pool (L3 storage, Mooncake: EXTERNAL), each a medium of its own."""
    ids = list(range(900, 900 + 4 * BS))
    hashes = sglang_hashes(ids, 1)
    view = KvCacheView(MODEL, BS)
    for medium in ("GPU", "CPU_PINNED", "DISK", "EXTERNAL"):
        view.apply(wire.decode_batch(payload(*stores(ids, 1, medium=medium, map_=True))).events)
    keys = request_blocks(ids)
    assert view.match_tiers(keys) == (4, 4, 4, 4)
    view.apply([BlockRemoved(hashes[BS:], "GPU")])  # evicted to the host: blocks 2..4
    assert view.match(keys) == 1 and view.match_tiers(keys) == (1, 4, 4, 4)
    view.apply([BlockRemoved(hashes[2 * BS :], "CPU_PINNED")])
    assert view.match_tiers(keys) == (1, 2, 4, 4)
    view.apply([BlockRemoved(hashes[3 * BS :], "DISK")])
    assert view.match_tiers(keys) == (1, 2, 3, 4)
    assert view.stats()["tiers"] == {"GPU": 1, "CPU": 2, "DISK": 3, "REMOTE": 4}


def test_a_salt_sent_twice_in_extra_keys_and_its_own_field_is_one_salt() -> None:
    """A later SGLang branch also writes the salt, tagged as Dynamo tags it, in extra_keys."""
    ids = list(range(BS))
    [h] = sglang_hashes(ids, BS, "s1")
    tagged = [("dynamo-cache-salt:s1",)]
    view = KvCacheView(MODEL, BS)
    view.apply([BlockStored([h], None, ids, BS, medium="GPU", extra_keys=tagged, cache_salt="s1")])
    assert view.match(chain_tokens(seed(MODEL, "s1"), ids, BS, 1)) == 1


async def test_skipped_events_withdraw_exactness_and_unkeyable_blocks_do_not() -> None:
    """Decided: an event the decoder could not read, or a block whose parent the view never
    saw, is a change to the cache the view missed (exact goes until a clean start); a block the
    view chose not to key (an image's, and the blocks after it) is known and left out, so the
    view still says exactly what a text request would find."""
    view = KvCacheView(MODEL, BS)
    sub = KvEventSubscriber("tcp://127.0.0.1:9", view, topic="kv")  # fed frames, never started
    ids = list(range(70, 70 + 2 * BS))
    live = lambda seq, *events: wire.live_frames(b"kv", seq, payload(*events))  # noqa: E731
    await sub.on_frames(live(0, MapAllBlocksCleared(), *stores(ids, BS, map_=True)))
    assert sub.exact and view.match(request_blocks(ids)) == 2
    image = BlockStored([-1], None, list(range(BS)), BS, extra_keys=[("img", 0)])
    child = BlockStored([-2], -1, list(range(BS, 2 * BS)), BS)
    await sub.on_frames(
        wire.live_frames(b"kv", 1, wire.encode_batch(wire.EventBatch(1.0, [image, child])))
    )
    assert sub.exact and view.stats()["unkeyable"] == 2 and view.stats()["orphans"] == 0
    orphan = MapBlockStored([-3], 12345, [1] * BS, BS, None)
    epoch = b"kv\0sgl-kv-epoch=5f2c"  # a snapshot-capable publisher's topic
    await sub.on_frames(wire.live_frames(epoch, 2, payload(orphan)))
    assert not sub.exact and sub.counts["unplaced_blocks"] == 1 and sub.last_seq == 2
    await sub.on_frames(live(3, *stores(ids, BS, map_=True)))
    assert not sub.exact  # nothing has repaired it
    await sub.on_frames(live(4, MapAllBlocksCleared()))
    assert sub.exact
    await sub.on_frames(wire.live_frames(b"kvx", 5, payload(orphan)))  # another topic: not ours
    assert sub.exact and sub.last_seq == 4
