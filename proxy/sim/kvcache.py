"""The KV pool: fixed-size blocks, reference counts, and a prefix cache with LRU eviction.

Modelled on vLLM's V1 block pool: a block whose last user finished keeps its contents and
its hash, sits in the free queue, and can be revived by a later request with the same
prefix until it is evicted (least recently freed first) to make room.

With `record_events` the pool also notes every change to its prefix cache and hands them out
as vLLM's KV events (`take_events`): stored blocks, evicted blocks, a cleared cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import xxhash

from proxy.kvevents.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent

GPU = "GPU"  # vLLM's `medium` for its GPU block pool


def block_hashes(token_ids: Sequence[int], block_size: int, salt: int = 0) -> list[int]:
    """Chained hashes of the full blocks: h_i = H(h_{i-1}, tokens of block i).

    A match of h_k therefore implies the whole prefix up to block k matches.
    """
    out: list[int] = []
    prev = salt & 0xFFFFFFFFFFFFFFFF
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = xxhash.xxh64(seed=prev)
        h.update(b"".join(t.to_bytes(4, "little") for t in token_ids[start : start + block_size]))
        prev = h.intdigest()
        out.append(prev)
    return out


class BlockPool:
    """`num_blocks` KV blocks. Blocks with ref 0 are free; their hash survives until reuse."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        block_size: int = 16,
        record_events: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        # Insertion order is eviction order: the first key is the least recently freed.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.evictions = 0
        # Changes not yet taken as events: ("stored", hash, parent, tokens, salt, lora) |
        # ("removed", hash) | ("cleared",); None when not recording.
        self._changes: list[tuple[Any, ...]] | None = [] if record_events else None

    @property
    def records_events(self) -> bool:
        return self._changes is not None

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: cached-but-unreferenced blocks count as free."""
        return 1.0 - self.num_free / self.num_blocks

    def longest_hit(self, hashes: Sequence[int]) -> list[int]:
        """Block ids holding the longest cached prefix of `hashes`."""
        if not self.enable_caching:
            return []
        hit: list[int] = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def can_allocate(self, n_new: int, hit: Sequence[int]) -> bool:
        # Reviving a free cached block takes it out of the free queue too.
        revived = sum(1 for b in hit if self.ref[b] == 0)
        return n_new + revived <= self.num_free

    def touch(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"need {n} KV blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                    if self._changes is not None:
                        self._changes.append(("removed", h))
                self.hash[b] = None
                self.evictions += 1
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        # Tail blocks first, so a prefix's last blocks are evicted before its first ones.
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def commit(
        self,
        block: int,
        h: int,
        parent: int | None = None,
        token_ids: Sequence[int] = (),
        salt: str = "",
        lora: tuple[str, int | None] | None = None,
    ) -> bool:
        """Publish a full, computed block under its prefix hash; True if it entered the cache.

        `parent` (the previous block's hash), `token_ids`, `salt` (a first block's
        cache_salt) and `lora` (the adapter's name and id) only feed the KV events."""
        if not self.enable_caching or self.hash[block] is not None or h in self.cached:
            return False
        self.cached[h] = block
        self.hash[block] = h
        if self._changes is not None:
            self._changes.append(("stored", h, parent, list(token_ids), salt, lora))
        return True

    def reset(self) -> None:
        """Drop every cached prefix no running sequence uses (POST /reset_prefix_cache)."""
        dropped = []
        for b in list(self.free):
            h = self.hash[b]
            if h is not None and self.cached.get(h) == b:
                del self.cached[h]
                dropped.append(h)
            self.hash[b] = None
        if self._changes is not None:
            # vLLM only resets an idle pool and says AllBlocksCleared; blocks in use here keep
            # their hashes, so a partial reset names what it dropped.
            if self.cached:
                self._changes += [("removed", h) for h in dropped]
            else:
                self._changes.append(("cleared",))

    def take_events(self) -> list[KVEvent]:
        """The changes since the last call as vLLM's KV events, in order.

        Like vLLM's: consecutive blocks stored by one request share one BlockStored (with
        one `extra_keys` entry per block), each evicted block has its own BlockRemoved."""
        changes, self._changes = self._changes or [], [] if self.records_events else None
        events: list[KVEvent] = []
        run: list[tuple[Any, ...]] = []
        for change in changes:
            if (
                change[0] == "stored"
                and run
                and change[2] == run[-1][1]
                and change[5] == run[-1][5]
            ):
                run.append(change)
                continue
            if run:
                events.append(self._stored(run))
                run = []
            if change[0] == "stored":
                run = [change]
            elif change[0] == "removed":
                events.append(BlockRemoved([change[1]], medium=GPU, group_idx=0))
            else:
                events.append(AllBlocksCleared())
        if run:
            events.append(self._stored(run))
        return events

    def _stored(self, run: list[tuple[Any, ...]]) -> BlockStored:
        hashes: list[BlockHash] = [c[1] for c in run]
        lora = run[0][5]
        # As vLLM lists them: the adapter's name on every block, then a first block's salt.
        extra = [
            ((lora[0],) if lora else ()) + ((c[4],) if c[4] and c[2] is None else ()) or None
            for c in run
        ]
        return BlockStored(
            hashes,
            run[0][2],
            [t for c in run for t in c[3]],
            self.block_size,
            lora_id=lora[1] if lora else None,
            medium=GPU,
            lora_name=lora[0] if lora else None,
            extra_keys=extra,
            group_idx=0,
        )
