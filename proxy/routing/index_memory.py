"""The in-process prefix index: per-backend LRU of block hashes (see proxy/routing/index.py),
and the interface every index store implements."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

DEFAULT_CAPACITY_BLOCKS = 32768  # ~2M chars ≈ 500k tokens: an 80 GB GPU's KV pool for an 8B model
DEFAULT_TTL_S = 1800.0
GHOST_MIN = 1024  # trimmed blocks remembered per backend, at least


def capacity_blocks_from_tokens(
    kv_tokens: int, block_chars: int, chars_per_token: float = 4.0
) -> int:
    """Turn an engine's KV pool size in tokens (num_gpu_blocks * block_size) into index blocks."""
    return max(1, int(kv_tokens * chars_per_token / block_chars))


class PrefixIndex(Protocol):
    """What the router needs from a prefix index store."""

    @property
    def mode(self) -> str:
        """ "memory", "redis" or "memory-fallback"."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def lookup(self, blocks: Sequence[int], backends: Sequence[str]) -> dict[str, int]:
        """Longest matched prefix, in blocks, of `blocks` on each backend."""
        ...

    def record(self, backend: str, blocks: Sequence[int]) -> None:
        """Note that `backend` now holds `blocks` (never blocks; writes may be deferred)."""
        ...

    def set_capacity(self, backend: str, blocks: int) -> None:
        """Bound the blocks kept for `backend` (learned from the engine's reports)."""
        ...

    def forget(self, backend: str, departure: str = "") -> None:
        """Drop everything held for `backend`: it left the fleet, or a new (cold) engine took
        its address. Lookups answer 0 for it from now on. A store shared by replicas deletes
        the shared copy once for all of them; `departure`, when every replica knows the same
        token for this change (a pod's UID), tells one change from the next."""
        ...

    def probe(self, backend: str, blocks: Sequence[int], matched: int) -> Probe:
        """Before `blocks` are recorded on `backend`: when its matched prefix was last seen
        there, and how far the prompt reaches into what the index holds or recently trimmed."""
        ...

    def occupancy(self, backend: str) -> int:
        """Blocks held for `backend` (this process's view)."""
        ...

    def info(self) -> dict[str, Any]:
        """Mode and counters for /health, /metrics and /admin."""
        ...


class Probe(NamedTuple):
    """What the capacity learner needs to know about a prefix before it is recorded again."""

    last_seen: float | None  # index clock time the matched prefix was last recorded
    ghost_blocks: int  # leading blocks held by the index or trimmed by it lately


class MemoryPrefixIndex:
    """Per-backend LRU of block hashes, bounded by capacity and aged by TTL.

    Blocks trimmed for lack of capacity are remembered for a while (a "ghost" list, as ARC
    keeps one): if the engine later reports them cached, the capacity was set too small.
    """

    def __init__(
        self,
        capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        ttl_s: float | None = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        touch_s: float = 1.0,
    ) -> None:
        self.default_capacity = capacity_blocks
        self.ttl_s = ttl_s
        self.touch_s = touch_s
        self.clock = clock
        self._lru: dict[str, OrderedDict[int, float]] = {}
        self._ghost: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}
        self.lookups = 0
        self.records = 0
        self.evictions = 0

    @property
    def mode(self) -> str:
        return "memory"

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def lookup(self, blocks: Sequence[int], backends: Sequence[str]) -> dict[str, int]:
        return self.lookup_now(blocks, backends)

    def lookup_now(self, blocks: Sequence[int], backends: Sequence[str]) -> dict[str, int]:
        self.lookups += 1
        oldest = self.clock() - self.ttl_s if self.ttl_s else float("-inf")
        return {b: self._match(self._lru.get(b), blocks, oldest) for b in backends}

    @staticmethod
    def _match(lru: OrderedDict[int, float] | None, blocks: Sequence[int], oldest: float) -> int:
        if not lru or not blocks:
            return 0
        # Binary search for the last present block: a chain hash implies its whole prefix, and
        # tails are evicted first, so presence is monotone along the chain. Most backends miss
        # the first block, so test it before searching.
        seen = lru.get(blocks[0])
        if seen is None or seen < oldest:
            return 0
        lo, hi = 1, len(blocks)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            seen = lru.get(blocks[mid - 1])
            if seen is not None and seen >= oldest:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def fresh_prefix(self, backend: str, blocks: Sequence[int], since: float) -> int:
        """Blocks of `blocks` this index saw on `backend` at or after `since`."""
        return self._match(self._lru.get(backend), blocks, since)

    def record(self, backend: str, blocks: Sequence[int]) -> None:
        self.record_now(backend, blocks)

    def record_now(self, backend: str, blocks: Sequence[int], now: float | None = None) -> None:
        if not blocks:
            return
        self.records += 1
        lru = self._lru.get(backend)
        if lru is None:
            lru = self._lru[backend] = OrderedDict()
        now = self.clock() if now is None else now
        # A hot prefix is recorded on every request; moving its hundreds of blocks each time was
        # the largest cost of a decision. Blocks touched within touch_s keep their place: LRU
        # order at one-second resolution is all an engine's cache estimate needs.
        fresh = self._match(lru, blocks, now - self.touch_s)
        # Reversed: the first block ends up most recently used, so eviction takes tails first.
        for h in reversed(blocks[fresh:]):
            lru.pop(h, None)
            lru[h] = now
        cap = self._capacity.get(backend, self.default_capacity)
        if len(lru) > cap:
            self._trim(backend, lru, cap)

    def _trim(self, backend: str, lru: OrderedDict[int, float], cap: int) -> None:
        ghost = self._ghost.get(backend)
        if ghost is None:
            ghost = self._ghost[backend] = OrderedDict()
        while len(lru) > cap:
            h, _ = lru.popitem(last=False)
            ghost[h] = None
            ghost.move_to_end(h)
            self.evictions += 1
        # As many ghosts as live blocks (at least GHOST_MIN): enough to see a capacity that is
        # up to twice too small in one observation.
        limit = max(cap, GHOST_MIN)
        while len(ghost) > limit:
            ghost.popitem(last=False)

    def set_capacity(self, backend: str, blocks: int) -> None:
        self._capacity[backend] = max(1, int(blocks))
        lru = self._lru.get(backend)
        if lru is not None and len(lru) > self._capacity[backend]:
            self._trim(backend, lru, self._capacity[backend])

    def capacity(self, backend: str) -> int:
        return self._capacity.get(backend, self.default_capacity)

    def forget(self, backend: str, departure: str = "") -> None:
        # Blocks, ghosts and the learned bound alike: a new engine at the address starts at
        # the default capacity, as every backend does before its engine reports.
        self._lru.pop(backend, None)
        self._ghost.pop(backend, None)
        self._capacity.pop(backend, None)

    def probe(self, backend: str, blocks: Sequence[int], matched: int) -> Probe:
        lru = self._lru.get(backend)
        seen = (
            lru.get(blocks[matched - 1]) if lru is not None and 0 < matched <= len(blocks) else None
        )
        ghost = self._ghost.get(backend)
        if not ghost:
            return Probe(seen, matched)
        live: Mapping[int, Any] = lru if lru is not None else {}

        def held(i: int) -> bool:
            h = blocks[i - 1]
            return h in live or h in ghost

        # Presence along the chain is monotone in both (tails go first), so binary search.
        lo, hi = matched, len(blocks)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if held(mid):
                lo = mid
            else:
                hi = mid - 1
        return Probe(seen, lo)

    def occupancy(self, backend: str) -> int:
        return len(self._lru.get(backend, ()))

    def backends(self) -> list[str]:
        return list(self._lru)

    def entries(self, backend: str) -> list[tuple[int, float]]:
        """(block hash, last seen) from least to most recently used."""
        return list(self._lru.get(backend, {}).items())

    def size(self, backend: str) -> int:
        return len(self._lru.get(backend, ()))

    def info(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "lookups": self.lookups,
            "records": self.records,
            "evictions": self.evictions,
            "blocks": {b: len(lru) for b, lru in self._lru.items()},
            "capacity": dict(self._capacity),
            "default_capacity": self.default_capacity,
        }
