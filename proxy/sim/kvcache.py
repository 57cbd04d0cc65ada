"""The KV pool: fixed-size blocks, reference counts, and a prefix cache with LRU eviction.

Modelled on vLLM's V1 block pool: a block whose last user finished keeps its contents and
its hash, sits in the free queue, and can be revived by a later request with the same
prefix until it is evicted (least recently freed first) to make room.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import xxhash


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

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref = [0] * num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        # Insertion order is eviction order: the first key is the least recently freed.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.evictions = 0

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

    def commit(self, block: int, h: int) -> None:
        """Publish a full, computed block under its prefix hash."""
        if not self.enable_caching or self.hash[block] is not None:
            return
        if h not in self.cached:
            self.cached[h] = block
            self.hash[block] = h

    def reset(self) -> None:
        """Drop every cached prefix (POST /reset_prefix_cache)."""
        for b in list(self.free):
            h = self.hash[b]
            if h is not None and self.cached.get(h) == b:
                del self.cached[h]
            self.hash[b] = None
