"""What placing one prefix reads of the whole fleet, read only where it looks (pure).

Placing a prefix (proxy.routing.placement) reads, per backend, its assigned load and its free
cache room, and walks the prefix's rendezvous order for spare homes. Built as dicts over every
backend, that was O(fleet) per placement, and at 1,024 backends a hot prefix is placed again
(it needs more homes) about once a request. Here the same values are computed when first read:

- `Room`: free cache per backend (fill x learned capacity - placed sizes) as of when it was
  taken, the sizes copied then and each capacity pinned before the capacity learner moves it
  (`pin`), so a value read later is the one a dict built then held;
- `Loads`: assigned load per backend, read from the tallies (they do not change while one
  prefix is being placed);
- `WithinAsked`: the backends within the load bound, asked one by one and listed (by value,
  `within_by_value`) only when iterated; the spare walk that reads them is
  proxy/routing/spares.py.

Fleets of up to EAGER_UP_TO backends keep the plain dicts and sorts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping, MutableMapping, Sequence
from itertools import compress, repeat
from operator import add, le
from typing import Any

from proxy.routing.fleet import FleetWeights, Names, Rendezvous

EAGER_UP_TO = 64  # backends; below this the whole-fleet dicts cost less than reading lazily
ASK_THEN_LIST = 64  # backends asked one by one whether within the bound before listing them


def fast_members(backends: Sequence[str]) -> Collection[str]:
    """`backends` as a container with fast `in` (a fleet's Names carries its own set)."""
    if isinstance(backends, Names):
        return backends.members
    return backends if len(backends) < 8 else frozenset(backends)


def weight_of(weights: Mapping[str, float], backend: str) -> float:
    w = weights.get(backend, 1.0)
    return w if w > 1e-9 else 1e-9


def uniform_over(weights: Mapping[str, float], backends: Sequence[str]) -> bool:
    """Whether `weights` are a fleet's, for exactly these names, and all the same."""
    return isinstance(weights, FleetWeights) and weights.names is backends and weights.uniform


def total_weight(weights: Mapping[str, float], backends: Sequence[str]) -> float:
    """Sum of the weights of `backends` (the fleet's own total when `weights` carries it for
    exactly these names: the same additions in the same order)."""
    if isinstance(weights, FleetWeights) and weights.names is backends:
        return weights.total
    return sum(weight_of(weights, b) for b in backends)


def rank_of(
    order: Callable[[int, Sequence[str]], Sequence[str]],
    key: int,
    backends: Sequence[str],
    hrw: Sequence[str],
) -> Mapping[str, Any]:
    """Name -> its position in `hrw`, or a key that sorts as that position does (the
    order's own, kept, when it keeps them: fleet.RankKeys)."""
    if isinstance(order, Rendezvous):
        return order.rank(key, backends)
    return {b: i for i, b in enumerate(hrw)}


class Room(MutableMapping[str, float]):
    """Free cache per backend of `universe`, computed by `base` when first read."""

    def __init__(self, universe: Collection[str], base: Callable[[str], float]) -> None:
        self._universe = universe
        self._base = base
        self._values: dict[str, float] = {}
        self._gone: set[str] = set()

    def pin(self, backend: str) -> None:
        """Compute `backend`'s value now (its capacity is about to move)."""
        if backend in self:
            self.get(backend)  # (reading computes and keeps it)

    def __getitem__(self, backend: str) -> float:
        value = self._values.get(backend)
        if value is None:
            if backend not in self._universe or backend in self._gone:
                raise KeyError(backend)
            value = self._values[backend] = self._base(backend)
        return value

    def get(self, backend: str, default: Any = None) -> Any:
        value = self._values.get(backend)
        if value is not None:
            return value
        if backend not in self._universe or backend in self._gone:
            return default
        value = self._values[backend] = self._base(backend)
        return value

    def __setitem__(self, backend: str, value: float) -> None:
        self._values[backend] = value
        self._gone.discard(backend)

    def take_each(self, homes: Sequence[str], size: float) -> None:
        """`self[h] -= size` for every h of `homes`, without a method call per home (a hot
        prefix has hundreds)."""
        values = self._values
        get = values.get
        for h in homes:
            v = get(h)
            values[h] = (self[h] if v is None else v) - size
        if self._gone:
            self._gone.difference_update(homes)

    def __delitem__(self, backend: str) -> None:
        if backend not in self:
            raise KeyError(backend)
        self._values.pop(backend, None)
        self._gone.add(backend)

    def __contains__(self, backend: object) -> bool:
        if backend in self._values:
            return True
        return backend in self._universe and backend not in self._gone

    def __iter__(self) -> Iterator[str]:
        for b in self._universe:
            if b not in self._gone:
                yield b
        for b in self._values:
            if b not in self._universe:
                yield b

    def __len__(self) -> int:
        return sum(1 for _ in self)


class Loads(Mapping[str, float]):
    """Assigned load per backend of `universe`: its tallied traffic weight x `scale` / its
    backend weight (what _accounting's dict held), read from the tallies as asked."""

    def __init__(
        self,
        universe: Collection[str],
        tally: Mapping[str, int],
        scale: float,
        weights: Mapping[str, float],
        uniform: bool = False,
    ) -> None:
        self._universe = universe
        self._tally = tally
        self._scale = scale
        self._weights = weights
        # Every backend weighs the same: a backend's load grows with its tally alone.
        self.uniform = uniform

    def within_all(self, within: Callable[[str], bool]) -> Collection[str] | None:
        """Every backend `within` accepts (None unless uniform: see within_by_value), by the
        float each tally reads as: the load is a function of it alone, and floats sort and
        hash several times faster than the tallies' 128-bit fixed point."""
        if not self.uniform:
            return None
        universe, tally = self._universe, self._tally

        def listed() -> Collection[str]:
            floats = map(math.ldexp, tally.values(), repeat(-128, len(tally)))
            return within_by_value(universe, dict(zip(tally, floats, strict=True)), within)

        return WithinAsked(universe, within, listed)

    def __getitem__(self, backend: str) -> float:
        if backend not in self._universe:
            raise KeyError(backend)
        return (
            math.ldexp(self._tally.get(backend, 0), -128)
            * self._scale
            / weight_of(self._weights, backend)
        )

    def __contains__(self, backend: object) -> bool:
        return backend in self._universe

    def __iter__(self) -> Iterator[str]:
        return iter(self._universe)

    def __len__(self) -> int:
        return len(self._universe)


class Accumulated(MutableMapping[str, float]):
    """Per backend of `universe`, a load summed as homes are assigned (0.0 until then): the
    rebalance's dict over every backend, holding only the backends it added to."""

    def __init__(self, universe: Collection[str], uniform: bool = False) -> None:
        self._universe = universe
        self._values: dict[str, float] = {}
        self.uniform = uniform

    def within_all(self, within: Callable[[str], bool]) -> Collection[str] | None:
        """Every backend `within` accepts (None unless uniform: see within_by_value)."""
        if not self.uniform:
            return None
        universe, values = self._universe, self._values
        return WithinAsked(universe, within, lambda: within_by_value(universe, values, within))

    def __getitem__(self, backend: str) -> float:
        value = self._values.get(backend)
        if value is None:
            if backend not in self._universe:
                raise KeyError(backend)
            return 0.0
        return value

    def __setitem__(self, backend: str, value: float) -> None:
        self._values[backend] = value

    def add_each(self, homes: Sequence[str], per_copy: float, weights: Mapping[str, float]) -> None:
        """`self[h] += per_copy / weight(h)` for every h of `homes` (all of `universe`), the
        same additions without a method call per home; one C-level pass where every backend
        weighs the same."""
        values = self._values
        get = values.get
        if self.uniform and len(frozenset(homes)) == len(homes):
            k = len(homes)
            step = per_copy / weight_of(weights, homes[0]) if k else 0.0
            added = map(add, map(get, homes, repeat(0.0, k)), repeat(step, k))
            values.update(zip(homes, added, strict=True))
            return
        for h in homes:
            values[h] = get(h, 0.0) + per_copy / weight_of(weights, h)

    def __delitem__(self, backend: str) -> None:
        raise TypeError("every backend has a load")

    def __contains__(self, backend: object) -> bool:
        return backend in self._universe

    def __iter__(self) -> Iterator[str]:
        return iter(self._universe)

    def __len__(self) -> int:
        return len(self._universe)


def read_all(values: Mapping[str, float], names: Sequence[str]) -> list[float]:
    """values[name] for each of `names` (all of them keys of `values`), in one pass: the
    same floats as reading them one by one, without a method call per name where `values`
    is one of this module's lazy views."""
    if isinstance(values, Loads):
        tally, scale, weights = values._tally.get, values._scale, values._weights
        return [math.ldexp(tally(b, 0), -128) * scale / weight_of(weights, b) for b in names]
    if isinstance(values, Accumulated):
        got = values._values.get
        return [got(b, 0.0) for b in names]
    if isinstance(values, Room):
        kept = values._values
        return [kept[b] if b in kept else values[b] for b in names]
    return [values[b] for b in names]


def kept_homes(
    previous: Sequence[str],
    need: int,
    universe: Collection[str],
    loads: Mapping[str, float],
    room: Mapping[str, float],
    size: float,
    per_copy: float,
    weights: Mapping[str, float],
    bound: float,
    fair: float,
) -> list[str] | None:
    """Placement._choose's first rule in passes over `previous` (a hot prefix has hundreds of
    homes, kept or not at each rebalance): the first `need` of them that are in `universe`,
    have room for `size`, and are within `bound` with this copy or under `fair` without it;
    None where a home repeats (the rule's one-by-one form handles that)."""
    inside = [b for b in previous if b in universe]
    if len(frozenset(inside)) != len(inside):
        return None
    if not inside:
        return []
    load = read_all(loads, inside)
    free = read_all(room, inside)
    line, under = bound + 1e-12, fair - 1e-12
    keep = [
        f >= size and (ld + per_copy / weight_of(weights, b) <= line or ld < under)
        for b, ld, f in zip(inside, load, free, strict=True)
    ]
    return list(compress(inside, keep))[:need]


class WithinAsked(Collection[str]):
    """The backends of `universe` within the load bound: asked one by one (`within`: the
    spare walk asks a few dozen), listed (`listed`, within_by_value) only when iterated."""

    def __init__(
        self,
        universe: Collection[str],
        within: Callable[[str], bool],
        listed: Callable[[], Collection[str]],
    ) -> None:
        self._universe, self._within, self._listed = universe, within, listed
        self._all: Collection[str] | None = None
        self._asked = 0

    def __contains__(self, backend: object) -> bool:
        every = self._all
        if every is not None:
            return backend in every
        self._asked += 1
        if self._asked > ASK_THEN_LIST:  # (a walk placing hundreds of homes: list them once)
            return backend in self._every()
        return backend in self._universe and self._within(backend)  # type: ignore[arg-type]

    def _every(self) -> Collection[str]:
        if self._all is None:
            listed = self._listed()
            self._all = listed if isinstance(listed, Within) else frozenset(listed)
        return self._all

    def __iter__(self) -> Iterator[str]:
        return iter(self._every())

    def __len__(self) -> int:
        return len(self._every())


class Within(Collection[str]):
    """The backends of a fleet within the load bound, known by their load value: a backend
    without one (load 0) is within when `zero` is, one with a value when it is at most `top`
    (None: none is). Asked one by one (the spare walk asks a few dozen), never listed unless
    iterated (within_by_value)."""

    def __init__(
        self, every: frozenset[str], values: Mapping[str, float], zero: bool, top: float | None
    ) -> None:
        self._every, self._values, self._zero, self._top = every, values, zero, top

    def __contains__(self, backend: object) -> bool:
        if backend not in self._every:
            return False
        value = self._values.get(backend)
        if value is None:
            return self._zero
        return self._top is not None and value <= self._top

    def __iter__(self) -> Iterator[str]:
        values = self._values
        if self._zero:
            yield from self._every.difference(values)
        if self._top is not None:
            yield from compress(values, map(le, values.values(), repeat(self._top)))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def within_by_value(
    universe: Collection[str], values: Mapping[str, float], within: Callable[[str], bool]
) -> Collection[str]:
    """Every backend of `universe` that `within` accepts, where that depends only on the
    backend's `values` entry (0 when absent) and is lost as it grows (every backend weighs the
    same): a binary search over the distinct values, one `within` per step, instead of one per
    backend; answered as a Within, without listing them."""
    every = frozenset(universe)
    if not every.issuperset(values):
        values = {b: v for b, v in values.items() if b in every}
    some = dict(zip(values.values(), values, strict=True))  # a backend per value
    zero = len(values) < len(every)  # some hold no value: 0, the least loaded there are
    if zero and not within(next(b for b in every if b not in values)):
        return ()
    ordered = sorted(some)
    lo, hi = 0, len(ordered)  # ordered[:lo] are within, ordered[hi:] are not
    while lo < hi:
        mid = (lo + hi) // 2
        if within(some[ordered[mid]]):
            lo = mid + 1
        else:
            hi = mid
    return Within(every, values, zero, ordered[lo - 1] if lo else None)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading blocks two chains share (binary search: a chain hash implies its prefix)."""
    n = min(len(a), len(b))
    if n and a[n - 1] == b[n - 1]:
        return n  # chain hashes: the last common block implies every block before it
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
