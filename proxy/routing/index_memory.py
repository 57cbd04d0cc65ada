"""The in-process prefix index: per-backend LRU of block hashes (see proxy/routing/index.py),
and the interface every index store implements.

Besides each backend's LRU, every block hash maps to the set of backends holding it (a bitmask
of their slots), so `holders` answers a prompt's lookup by walking the prompt once for all of
them: the backends that hold its first block split into groups at the first block some of them
lack, and each group's binary search is one probe of the masks, whatever the fleet's size.
"""

from __future__ import annotations

import heapq
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from functools import reduce
from itertools import repeat
from operator import lshift, or_
from typing import Any, NamedTuple, Protocol

from proxy.routing.blockmap import KEEPS_KEY_OBJECTS, BlockMap

DEFAULT_CAPACITY_BLOCKS = 32768  # ~2M chars ≈ 500k tokens: an 80 GB GPU's KV pool for an 8B model
DEFAULT_TTL_S = 1800.0
GHOST_MIN = 1024  # trimmed blocks remembered per backend, at least
_HASH_OBJECT = sys.getsizeof(2**64 - 1)  # a 64-bit block hash as an int object (36 bytes)


def capacity_blocks_from_tokens(
    kv_tokens: int, block_chars: int, chars_per_token: float = 4.0
) -> int:
    """Turn an engine's KV pool size in tokens (num_gpu_blocks * block_size) into index blocks."""
    return max(1, int(kv_tokens * chars_per_token / block_chars))


class PrefixIndex(Protocol):
    """What the router needs from a prefix index store."""

    # Blocks kept per backend until its engine's reports size it (the capacity learner's start).
    default_capacity: int

    @property
    def mode(self) -> str:
        """ "memory", "redis" or "memory-fallback"."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def lookup(self, blocks: Sequence[int], backends: Sequence[str]) -> dict[str, int]:
        """Longest matched prefix, in blocks, of `blocks` on each backend."""
        ...

    async def holders(self, blocks: Sequence[int], backends: Collection[str]) -> dict[str, int]:
        """lookup's answer for the backends of `backends` that match at least one block; every
        other one matches none. The work follows the holders, not len(backends)."""
        ...

    def record(self, backend: str, blocks: Sequence[int]) -> None:
        """Note that `backend` now holds `blocks` (never blocks; writes may be deferred)."""
        ...

    def set_capacity(self, backend: str, blocks: int) -> None:
        """Bound the blocks kept for `backend` (learned from the engine's reports)."""
        ...

    async def purge(self) -> None:
        """Delete now what forget() left to the background in a store shared by replicas
        (Redis down: nothing raises, the background writer deletes it on reconnect)."""
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

    def fresh_prefix(self, backend: str, blocks: Sequence[int], since: float) -> int:
        """Leading blocks of `blocks` this process recorded on `backend` at or after `since`
        (on the index's clock): sent there moments ago, being prefilled now."""
        ...

    def now(self) -> float:
        """The index's clock: monotonic in memory, wall time with Redis (shared by replicas),
        virtual in the simulated harness. Probe times and `since` are on it."""
        ...

    def occupancy(self, backend: str) -> int:
        """Blocks held for `backend` (this process's view)."""
        ...

    def occupancies(self) -> dict[str, int]:
        """occupancy() of every backend the index holds blocks for. Safe from another
        thread (a metrics reader's) while the event loop changes the index."""
        ...

    def memory(self) -> int:
        """Bytes of this process's tables (with Redis, the replica's copy), as
        deploy/perf/memory_bounds.py measures them. Safe from another thread."""
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
        # Per backend, block -> when last recorded, least recently first: the map keeps
        # insertion order, and a moved block is popped and put back. These tables and the
        # holders' are BlockMaps (proxy/routing/blockmap.py): in C, ~30 bytes an entry against
        # ~85 for a dict entry and its key's int object (deploy/perf/memory_bounds.py).
        self._lru: dict[str, BlockMap[float]] = {}
        self._ghost: dict[str, BlockMap[None]] = {}
        self._capacity: dict[str, int] = {}
        # Per backend, the first blocks of the prompts its LRU holds (a shared index's head
        # sets are refilled from them after Redis lost its data).
        self._heads: dict[str, set[int]] = {}
        # Block hash -> bitmask of the slots of the backends whose LRU holds it (a block one
        # backend holds refers to that backend's one mask object, `_bit`).
        self._held: BlockMap[int] = BlockMap()
        self._shared = 0  # blocks two or more backends hold
        # Where the maps are dicts, which keep their keys' int objects: block hash -> the one
        # int object that stands for it in every LRU from its second holder on. Each request
        # hashes its prompt into int objects of its own (36 bytes each), so without it a block
        # held by 16 backends was 16 objects. The C maps keep no key objects: None.
        self._canon: dict[int, int] | None = {} if KEEPS_KEY_OBJECTS else None
        self._slot: dict[str, int] = {}  # backend -> its slot (a bit in the masks)
        self._bit: dict[str, int] = {}  # backend -> 1 << its slot
        self._names: list[str] = []  # slot -> backend
        self._free: list[int] = []  # slots given back (a heap: masks stay small)
        self._slots_changed = 0  # bumps whenever a slot is taken or given back
        self._fleet_mask: tuple[Any, int, int] | None = None  # (backends, generation, mask)
        # Backends whose LRU may be out of time order (a record dated before an earlier one):
        # their lookups are their own binary search. In order, the front entry is the oldest.
        self._unsorted: set[str] = set()
        self._floor = float("-inf")  # no entry is older than this (a lower bound)
        self._floor_at = float("-inf")  # index clock when the bound was last raised
        self.lookups = 0
        self.records = 0
        self.evictions = 0
        self.probes = 0  # mask probes and per-backend searches of holder lookups (a work count)

    @property
    def mode(self) -> str:
        return "memory"

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def purge(self) -> None:
        pass  # nothing shared: forget() deleted at once

    async def lookup(self, blocks: Sequence[int], backends: Sequence[str]) -> dict[str, int]:
        return self.lookup_now(blocks, backends)

    def lookup_now(self, blocks: Sequence[int], backends: Sequence[str]) -> dict[str, int]:
        found = dict.fromkeys(backends, 0)
        found.update(self.holders_now(blocks, backends))
        return found

    async def holders(self, blocks: Sequence[int], backends: Collection[str]) -> dict[str, int]:
        return self.holders_now(blocks, backends)

    def holders_now(self, blocks: Sequence[int], backends: Collection[str]) -> dict[str, int]:
        """lookup_now's non-zero answers, found from the masks of the blocks along the prompt:
        each group of backends that agree on every block probed so far takes the step of the
        per-backend binary search together (the same probes, so the same answers)."""
        self.lookups += 1
        if not blocks:
            return {}
        holding = self._held.get(blocks[0], 0)
        if holding:
            holding &= self._mask_of(backends)
        if not holding:
            return {}
        held = self._held
        found: dict[str, int] = {}
        stack = [(1, len(blocks), holding)]
        probes = 0
        while stack:
            lo, hi, group = stack.pop()
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                has = held.get(blocks[mid - 1], 0) & group
                probes += 1
                if has == group:
                    lo = mid
                    continue
                if has:
                    stack.append((mid, hi, has))
                    group ^= has
                hi = mid - 1
            for slot in _bits(group):
                found[self._names[slot]] = lo
        self.probes += probes + len(found)
        self._check_stale(blocks, found)
        return found

    def _check_stale(self, blocks: Sequence[int], found: dict[str, int]) -> None:
        """Masks know what is held, not how old it is: a backend whose LRU holds anything older
        than the TTL (or may be out of time order) is looked up by its own binary search."""
        if not self.ttl_s and not self._unsorted:
            return
        now = self.clock()
        oldest = now - self.ttl_s if self.ttl_s else float("-inf")
        if oldest <= self._floor and not self._unsorted:
            return
        if oldest > self._floor and now - self._floor_at >= 1.0:
            fronts = [lru.first_value() for lru in self._lru.values() if lru]
            self._floor = min(fronts, default=float("inf"))
            self._floor_at = now
        lrus, unsorted, stale = self._lru, self._unsorted, oldest > self._floor
        for name in list(found):
            lru = lrus[name]
            if name in unsorted or (stale and lru.first_value() < oldest):
                self.probes += 1
                n = self._match(lru, blocks, oldest)
                if n:
                    found[name] = n
                else:
                    del found[name]

    def _mask_of(self, backends: Collection[str]) -> int:
        """The slots of `backends` as a mask (kept for the same tuple: a router passes its
        fleet's names, decision after decision)."""
        kept = self._fleet_mask
        if kept is not None and kept[0] is backends and kept[1] == self._slots_changed:
            return kept[2]
        slots = [s for s in map(self._slot.get, backends) if s is not None]
        mask = reduce(or_, map(lshift, repeat(1, len(slots)), slots), 0)
        if isinstance(backends, tuple):  # immutable: the same object has the same names
            self._fleet_mask = (backends, self._slots_changed, mask)
        return mask

    @staticmethod
    def _match(lru: BlockMap[float] | None, blocks: Sequence[int], oldest: float) -> int:
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

    def now(self) -> float:
        return self.clock()

    def record(self, backend: str, blocks: Sequence[int]) -> None:
        self.record_now(backend, blocks)

    def record_now(
        self, backend: str, blocks: Sequence[int], now: float | None = None, first: int = 0
    ) -> None:
        """`first`: where `blocks` start in the prompt (a shared index's writer skips the blocks
        it wrote moments ago; only a record from the prompt's start names its head)."""
        if not blocks:
            return
        self.records += 1
        lru = self._lru.get(backend)
        if lru is None:
            lru = self._lru[backend] = BlockMap()
            self._heads[backend] = set()
            self._take_slot(backend)
        now = self.clock() if now is None else now
        if lru and now < lru[lru.last_key()]:
            self._unsorted.add(backend)  # dated before what it holds: the front is not oldest
        if now < self._floor:
            self._floor = now
        # A hot prefix is recorded on every request; moving its hundreds of blocks each time was
        # the largest cost of a decision. Blocks touched within touch_s keep their place: LRU
        # order at one-second resolution is all an engine's cache estimate needs.
        fresh = self._match(lru, blocks, now - self.touch_s)
        held, canon, bit, shared = self._held, self._canon, self._bit[backend], 0
        # Reversed: the first block ends up most recently used, so eviction takes tails first.
        for h in reversed(blocks[fresh:]):
            if lru.pop(h, None) is None:
                others = held.get(h, 0)
                if others:
                    if not others & (others - 1):
                        shared += 1  # its second holder
                    if canon is not None:
                        h = canon.setdefault(h, h)
                    held[h] = others | bit
                else:
                    held[h] = bit
            elif canon:
                h = canon.get(h, h)  # (re-inserted: keep the shared object)
            lru[h] = now
        self._shared += shared
        if fresh == 0 and first == 0:
            self._heads[backend].add(blocks[0])
        cap = self._capacity.get(backend, self.default_capacity)
        if len(lru) > cap:
            self._trim(backend, lru, cap)

    def _trim(self, backend: str, lru: BlockMap[float], cap: int) -> None:
        ghost = self._ghost.get(backend)
        if ghost is None:
            ghost = self._ghost[backend] = BlockMap()
        keep, heads = ~self._bit[backend], self._heads[backend]
        # The front of the map is its least recently used blocks: taken in one C-level pass
        # (which also steps over the places earlier trims left, until the map compacts).
        gone = lru.front(len(lru) - cap)
        self._shared -= self._let_go(gone, keep)
        for h in gone:
            del lru[h]
            heads.discard(h)
            ghost.pop(h, None)  # to the back
            ghost[h] = None
        self.evictions += len(gone)
        # As many ghosts as live blocks (at least GHOST_MIN): enough to see a capacity that is
        # up to twice too small in one observation.
        over = len(ghost) - max(cap, GHOST_MIN)
        if over > 0:
            for h in ghost.front(over):
                del ghost[h]

    def _let_go(self, blocks: Iterable[int], keep: int) -> int:
        """Take a backend's bit (`keep` is every other) off the masks of `blocks`, which it
        holds; how many of them other backends held with it and now only one does."""
        held, canon, unshared = self._held, self._canon, 0
        for h in blocks:
            others = held.get(h, 0) & keep
            if others:
                held[h] = others  # in place: the holders' map keeps no order that matters
                if not others & (others - 1):
                    unshared += 1
            else:
                held.pop(h, None)
                if canon is not None:
                    canon.pop(h, None)
        return unshared

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
        lru = self._lru.pop(backend, None)
        if lru is not None:
            self._shared -= self._let_go(lru, ~self._bit[backend])
            self._give_slot(backend)
        self._unsorted.discard(backend)
        self._heads.pop(backend, None)
        self._ghost.pop(backend, None)
        self._capacity.pop(backend, None)

    def _take_slot(self, backend: str) -> None:
        slot = heapq.heappop(self._free) if self._free else len(self._names)
        if slot == len(self._names):
            self._names.append(backend)
        else:
            self._names[slot] = backend
        self._slot[backend] = slot
        self._bit[backend] = 1 << slot
        self._slots_changed += 1
        kept = self._fleet_mask
        if kept is not None and kept[1] == self._slots_changed - 1:
            # A backend's first record: the kept fleet's mask gains its bit (or stays).
            mask = kept[2] | (1 << slot) if backend in kept[0] else kept[2]
            self._fleet_mask = (kept[0], self._slots_changed, mask)

    def _give_slot(self, backend: str) -> None:
        heapq.heappush(self._free, self._slot.pop(backend))
        del self._bit[backend]
        self._slots_changed += 1

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

    def occupancies(self) -> dict[str, int]:
        return {b: len(lru) for b, lru in list(self._lru.items())}  # a copy first: see memory()

    def memory(self) -> int:
        # Another thread reads this while the loop records: each list() is one C call under
        # the GIL, and a map's size or length is read in one too.
        lrus, ghosts = list(self._lru.values()), list(self._ghost.values())
        heads = list(self._heads.values())
        size = sys.getsizeof(self._held) + sum(map(sys.getsizeof, lrus))
        size += sum(map(sys.getsizeof, ghosts)) + sum(map(sys.getsizeof, heads))
        # a block two or more hold has a mask of its own, about as wide as the slots (masks
        # of eight slots or fewer are CPython's cached small ints)
        slots = len(self._names)
        size += self._shared * sys.getsizeof(1 << (slots - 1)) if slots > 8 else 0
        canon = self._canon
        if canon is None:  # the C maps hold no int objects; the prompts' heads are some
            return size + sum(map(len, heads)) * _HASH_OBJECT
        # dicts also hold their keys' int objects, about one a block
        blocks = len(self._held) + sum(map(len, ghosts))
        return size + sys.getsizeof(canon) + blocks * _HASH_OBJECT

    def backends(self) -> list[str]:
        return list(self._lru)

    def heads(self, backend: str) -> list[int]:
        """The first blocks of the prompts held for `backend`."""
        return list(self._heads.get(backend, ()))

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
            "distinct_blocks": len(self._held),
            "shared_blocks": self._shared,
            "memory_bytes": self.memory(),
            "blocks": {b: len(lru) for b, lru in self._lru.items()},
            "capacity": dict(self._capacity),
            "default_capacity": self.default_capacity,
        }


def _bits(mask: int) -> list[int]:
    """The positions of the set bits of `mask` (one C-level search per bit)."""
    text = bin(mask)
    top = len(text) - 1
    out = []
    i = text.find("1", 2)
    while i >= 0:
        out.append(top - i)
        i = text.find("1", i + 1)
    return out
