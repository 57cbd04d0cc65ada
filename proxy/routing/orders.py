"""A rendezvous order made only as far as it is read (pure).

A prompt head seen for the first time needs its rendezvous order over the whole fleet twice
in one decision (the placement's, by hash, and the pickers', by weighted score), and each
sort of 1,024 backends is ~0.2 ms, while what is read of them is the first few dozen: the
first backends with room and within the load bound. `Order` sorts a head of them: those
beyond a cut taken from a sample of the values, in one C-level pass, then sorted as the
whole list would be; more as more is read. Every backend left out is strictly behind every
one in the head (the cut is on the values themselves), so the head is exactly the whole
sort's first entries, ties included (a stable sort, by position).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from itertools import compress, repeat
from operator import add, and_, ge, gt, le, lt, mul, truediv
from typing import Generic, TypeVar, overload

T = TypeVar("T")

SAMPLE = 64  # values a cut is chosen from
FIRST = 48  # entries the first head holds at least (a first placement reads ~10-30)
WHOLE = 0.25  # past this share of the list, sort all of it


class Order(Sequence[T], Generic[T]):
    """`items` sorted by `values` (stable; `descending`: largest first), sorted as read."""

    def __init__(self, items: Sequence[T], values: list[float] | list[int], descending: bool):
        self._items = items
        self._values = values
        self._descending = descending
        self._head: list[int] = []  # positions, in order
        self._cut: float | int | None = None  # every position beyond it is in the head
        self._done = len(values) == 0
        self.sorts = 0  # heads sorted (for tests)

    def __len__(self) -> int:
        return len(self._values)

    @property
    def items(self) -> Sequence[T]:
        """The entries in their own order (not sorted)."""
        return self._items

    @property
    def values(self) -> list[float] | list[int]:
        """What the entries are sorted by, in the items' own order."""
        return self._values

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[T]: ...

    def __getitem__(self, i: int | slice) -> T | Sequence[T]:
        if isinstance(i, slice):
            return [self._items[p] for p in self._positions()[i]]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        self._extend(i + 1)
        return self._items[self._head[i]]

    def __iter__(self) -> Iterator[T]:
        items, head, i = self._items, self._head, 0
        while True:
            if i >= len(head):
                if self._done:
                    return
                self._extend(i + 1)
                head = self._head
                continue
            yield items[head[i]]
            i += 1

    def _positions(self) -> list[int]:
        self._extend(len(self))
        return self._head

    def _extend(self, want: int) -> None:
        """Sort at least `want` entries (all of them when that is most of the list)."""
        n = len(self._values)
        while len(self._head) < want and not self._done:
            target = max(want, 2 * len(self._head), FIRST)
            if target >= WHOLE * n:
                self._sort_rest(None)
                return
            had = len(self._head)
            self._sort_rest(self._cut_for(target))
            if len(self._head) == had:  # (ties at the cut: nothing lies beyond it)
                self._sort_rest(None)

    def _cut_for(self, target: int) -> float | int:
        """A value about `target` entries in (twice over, for the sample's noise)."""
        values, n = self._values, len(self._values)
        step = n // SAMPLE if n >= 2 * SAMPLE else 1
        sample = sorted(values[::step], reverse=self._descending)
        k = math.ceil(2 * target / n * len(sample))
        return sample[k if k < len(sample) else len(sample) - 1]

    def _sort_rest(self, cut: float | int | None) -> None:
        """Append the entries between the last cut and `cut` (None: all the rest), sorted."""
        values, n = self._values, len(self._values)
        before = self._cut
        if cut is None:
            if before is None:
                fresh: list[int] = list(range(n))
            else:
                behind = le if self._descending else ge
                fresh = list(compress(range(n), map(behind, values, repeat(before, n))))
            self._done = True
        else:
            beyond = gt if self._descending else lt
            inside = map(beyond, values, repeat(cut, n))
            if before is not None:
                behind = le if self._descending else ge
                inside = map(and_, inside, map(behind, values, repeat(before, n)))
            fresh = list(compress(range(n), inside))
            self._cut = cut
        self._head += self._sorted(fresh)
        self.sorts += 1
        if len(self._head) >= n:
            self._done = True
        elif cut is not None and not self._apart(cut):
            self._sort_all()

    def _sorted(self, fresh: list[int]) -> list[int]:
        """`fresh` positions (in position order) as the whole sort orders them."""
        fresh.sort(key=self._values.__getitem__, reverse=self._descending)
        return fresh

    def _apart(self, cut: float | int) -> bool:
        """Whether every entry behind `cut` sorts strictly after the head (the cut is on the
        sort's own values here: always)."""
        return True

    def _sort_all(self) -> None:
        self._head = self._sorted(list(range(len(self._values))))
        self._done = True


class ScoredOrder(Order[int]):
    """hrw_order's order of a fleet whose backends weigh the same, as positions: by score
    w / ln((hash + 0.5) / 2**64), lowest first, ties by position. The score falls as the hash
    grows, so the head is cut on the hashes and only its scores are computed (a fleet's
    scores are four C-level passes over every backend); where two hashes a cut parts give the
    same float score, the whole order is scored and sorted instead."""

    def __init__(self, hashes: list[int], weight: float, scale: float) -> None:
        super().__init__(range(len(hashes)), hashes, descending=True)
        self._weight = weight
        self._scale = scale

    def _scores(self, positions: list[int]) -> list[float]:
        hashes, k = self._values, len(positions)
        u = map(
            mul,
            map(add, map(hashes.__getitem__, positions), repeat(0.5, k)),
            repeat(self._scale, k),
        )
        return list(map(truediv, repeat(self._weight, k), map(math.log, u)))

    def _sorted(self, fresh: list[int]) -> list[int]:
        scores = self._scores(fresh)
        return [fresh[i] for i in sorted(range(len(fresh)), key=scores.__getitem__)]

    def _apart(self, cut: float | int) -> bool:
        values, n = self._values, len(self._values)
        behind = max(compress(values, map(le, values, repeat(cut, n))), default=None)
        if behind is None or not self._head:
            return True
        least_hash = min(map(values.__getitem__, self._head))
        first_behind, last_in = self._scores_of(behind), self._scores_of(least_hash)
        return first_behind > last_in

    def _scores_of(self, h: float | int) -> float:
        return self._weight / math.log((h + 0.5) * self._scale)


class HashLed:
    """A ScoredOrder's order (positions), read off the order by hash of the same values while
    each entry scores strictly below the next: the score falls as the hash grows, so the two
    agree up to the first two entries whose scores are equal (hashes closer than a float tells
    apart), and from there on the ScoredOrder itself is read. A prompt head seen for the first
    time has its order by hash sorted as far as placement walked it: reading the pickers'
    order off it costs a score per entry read, not a second cut and sort of the fleet."""

    def __init__(
        self,
        by_hash: Order[str],
        position: dict[str, int],
        scored: ScoredOrder,
        weight: float,
        scale: float,
    ) -> None:
        self._by_hash = by_hash
        self._position = position
        self._scored = scored
        self._weight = weight
        self._scale = scale
        self._head: list[int] = []  # positions read off the order by hash, checked
        self._next: float | None = None  # the score of the entry after the head
        self._tied = False  # two entries scored alike: the rest is the ScoredOrder's

    def __len__(self) -> int:
        return len(self._scored)

    def __iter__(self) -> Iterator[int]:
        head, i = self._head, 0
        while True:
            if i >= len(head) and not self._check_next():
                if self._tied:
                    yield from itertools.islice(self._scored, i, None)
                return
            yield head[i]
            i += 1

    def _check_next(self) -> bool:
        """Add the next entry by hash to the head if it scores below the one after it."""
        k, n = len(self._head), len(self._by_hash)
        if self._tied or k >= n:
            return False
        score = self._score(k) if self._next is None else self._next
        if k + 1 < n:
            self._next = self._score(k + 1)
            if not score < self._next:
                self._tied = True
                return False
        self._head.append(self._position[self._by_hash[k]])
        return True

    def _score(self, k: int) -> float:
        h = self._by_hash.values[self._position[self._by_hash[k]]]
        return self._weight / math.log((h + 0.5) * self._scale)
