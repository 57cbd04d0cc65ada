"""What placement decides from, counted as homes change (pure): per backend, over the placed
prefixes homed there, how many, their sizes and their traffic weights; and the coolest placed
prefix, in a heap.

Where prompts' first eight blocks are their own (a document or a case file ahead of the
question), every request is placed into a full placement, and summing over every placed
prefix took ~53,000 of ~56,000 bytecodes a request; these tallies make it a few dictionary
reads. Sizes and weights are fixed point (units of 2**-128), so a prefix counted in and out
again leaves exactly nothing. Traffic is counted from shares that decay alike (a
PrefixPopularity: share = weight x one scale), which add up without reading every share; when
their base moves, every weight does, and the tallies are counted again.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import add
from typing import Protocol

FIXED_BITS = 128


def fixed(x: float) -> int:
    return int(math.ldexp(x, FIXED_BITS))


def unfixed(n: int) -> float:
    return math.ldexp(n, -FIXED_BITS)


class Shares(Protocol):
    """Shares that decay alike (PrefixPopularity): share = weight(key) x scale(); `listener`
    hears of each key whose weight changed, and every weight changes when `base` does."""

    base: int
    listener: Callable[[int], None] | None
    samples: float  # effective number of requests a share is measured over (its noise)

    def weight(self, key: int) -> float: ...

    def scale(self) -> float: ...


@dataclass(slots=True)
class Placed:
    """One prefix's homes and the measurements they were chosen from."""

    homes: tuple[str, ...]
    size: float  # index blocks its requests share (running average of common prefixes)
    last: Sequence[int]  # the previous request's blocks, to measure the shared part
    share: float = 0.0
    overflow: bool = False  # no home had room for it in its learned cache
    moves: int = 0  # times its homes changed after the first placement
    weight: int = 0  # its Shares weight as the load tally counts it (fixed point)
    tallied_size: int = 0  # its size as the tallies count it (fixed point)
    seq: int = 0  # its place in the placement's order (the coolest's tie-break)
    # The model its requests name (a prefix's head is seeded by it), once one was routed here:
    # a rebalance started by one model's request re-places that model's prefixes only, among
    # the engines serving it (None: any rebalance re-places it).
    model: str | None = None
    # Its homes among the last fleet it was looked up in: (that fleet's names, the homes
    # they were taken from, those of them in it), so that a lookup in the same fleet with
    # the same homes hands back the same tuple instead of filtering hundreds of homes again.
    inside: tuple[object, tuple[str, ...], tuple[str, ...]] | None = field(
        default=None, repr=False, compare=False
    )
    # Its homes as a set, with the tuple it was made from (a hot prefix has hundreds).
    members: tuple[tuple[str, ...], frozenset[str]] | None = field(
        default=None, repr=False, compare=False
    )

    def home_set(self) -> frozenset[str]:
        """`homes` as a set (made again only when they change)."""
        kept = self.members
        if kept is None or kept[0] is not self.homes:
            kept = self.members = (self.homes, frozenset(self.homes))
        return kept[1]


@dataclass
class Tallies:
    # Per backend home to any placed prefix (a backend home to none has no entry): how many,
    # their sizes and their weights split over their homes.
    hosted: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    weights: dict[str, int] = field(default_factory=dict)
    shares: Shares | None = None  # the traffic weights' source (None: no traffic tally)
    base: int = 0  # shares.base the weights were read at
    coolest: list[tuple[int, int, int]] = field(default_factory=list)  # heap (weight, seq, key)
    seq: int = 0
    # Prefixes changed since counted, until the next read (a hot one: every request).
    stale: set[int] = field(default_factory=set)

    def count(self, p: Placed, sign: int = 1) -> None:
        """Count `p` in (or, sign -1, out of) its homes' tallies, as they last counted it."""
        if not p.homes:
            return
        if sign > 0:
            p.tallied_size = fixed(p.size)
        size = sign * p.tallied_size
        weight = sign * (p.weight // len(p.homes))
        hosted, sizes, weights = self.hosted, self.sizes, self.weights
        homes = p.homes
        if len(homes) > 8:
            # A hot prefix has hundreds of homes: the same sums in C-level passes, when no
            # tally reaches zero and no home repeats.
            k = len(homes)
            counts = list(map(add, map(hosted.get, homes, repeat(0, k)), repeat(sign, k)))
            if 0 not in counts and len(frozenset(homes)) == k:
                added = map(add, map(sizes.get, homes, repeat(0, k)), repeat(size, k))
                weighed = map(add, map(weights.get, homes, repeat(0, k)), repeat(weight, k))
                hosted.update(zip(homes, counts, strict=True))
                sizes.update(zip(homes, added, strict=True))
                weights.update(zip(homes, weighed, strict=True))
                return
        for h in p.homes:
            n = hosted.get(h, 0) + sign
            if n:
                hosted[h] = n
                sizes[h] = sizes.get(h, 0) + size
                weights[h] = weights.get(h, 0) + weight
            else:  # none left: exactly nothing, whatever came and went
                del hosted[h], sizes[h], weights[h]

    def uncount(self, p: Placed) -> None:
        self.count(p, -1)

    def _shift(self, p: Placed, weight: int) -> None:
        """Count `p` again with `weight` and its size now: uncount then count, as one pass
        that adds the differences (its homes are the same, so how many each hosts is too).
        Every prefix whose share moved is made current this way at the next placement: at
        1,024 engines those are a thousand homes, and two counts of each were a millisecond."""
        homes = p.homes
        k = len(homes)
        if not k:
            p.weight = weight
            return
        size = fixed(p.size)
        d_size = size - p.tallied_size
        d_weight = weight // k - p.weight // k
        p.tallied_size, p.weight = size, weight
        if not d_size and not d_weight:
            return
        sizes, weights = self.sizes, self.weights
        if k > 8 and len(frozenset(homes)) == k:
            # (the same sums in C-level passes where no home repeats)
            if d_size:
                grown = map(add, map(sizes.__getitem__, homes), repeat(d_size, k))
                sizes.update(zip(homes, grown, strict=True))
            if d_weight:
                shifted = map(add, map(weights.__getitem__, homes), repeat(d_weight, k))
                weights.update(zip(homes, shifted, strict=True))
            return
        for h in homes:
            sizes[h] += d_size
            weights[h] += d_weight

    def track(self, key: int, p: Placed) -> None:
        """A prefix placed for the first time: its weight, and its entry in the heap."""
        p.seq = self.next_seq()
        shares = self.shares
        if shares is not None:
            p.weight = fixed(shares.weight(key))
            heapq.heappush(self.coolest, (p.weight, p.seq, key))

    def current(self, placed: Mapping[int, Placed]) -> None:
        """Bring the tallies up to date (never while a prefix is out of them: counted twice)."""
        shares = self.shares
        if shares is not None and shares.base != self.base:
            self.recount(placed)
            return
        if not self.stale:
            return
        stale, self.stale = self.stale, set()
        for key in stale:
            p = placed.get(key)
            if p is None:
                continue
            weight = p.weight
            if shares is not None:
                weight = fixed(shares.weight(key))
                if weight < p.weight:  # one that grew keeps its older entry: see coolest_key
                    heapq.heappush(self.coolest, (weight, p.seq, key))
            self._shift(p, weight)
        if len(self.coolest) > 2 * len(placed) + 64:
            self.reheap(placed)

    def recount(self, placed: Mapping[int, Placed]) -> None:
        """Every tally again from the placed prefixes (and their weights, when shares are)."""
        self.hosted, self.sizes, self.weights = {}, {}, {}
        self.stale = set()
        shares = self.shares
        if shares is not None:
            self.base = shares.base
        for key, p in placed.items():
            p.weight = fixed(shares.weight(key)) if shares is not None else 0
            self.count(p)
        self.reheap(placed)

    def reheap(self, placed: Mapping[int, Placed]) -> None:
        if self.shares is None:
            self.coolest = []
            return
        self.coolest = [(p.weight, p.seq, key) for key, p in placed.items()]
        heapq.heapify(self.coolest)

    def coolest_key(self, placed: Mapping[int, Placed]) -> int:
        """The placed prefix of least weight (least share: one scale), the first placed of
        equals. Every prefix has an entry no heavier than its weight (pushed when a weight
        falls; one that grew is pushed again when its old entry comes up)."""
        heap = self.coolest
        while True:
            weight, seq, key = heap[0]
            p = placed.get(key)
            if p is not None and p.seq == seq:
                if p.weight == weight:
                    return key
                heapq.heapreplace(heap, (p.weight, seq, key))
            else:
                heapq.heappop(heap)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq
