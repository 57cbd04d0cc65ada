"""The fleet a decision is made over, read once per decision and kept while it stays the same.

A router sees the same backends, in the same order, decision after decision; what it derives
from their names (where each one is, its rendezvous position for a prompt head, a zero match
for everyone) is worth deriving once. `FleetCache.of(candidates)` compares the names and
weights with the last decision's, a few flat passes (~30 us at 1,024 backends), and hands
back the same `Fleet` while they match (pure, no I/O).

`Names` is the names in fleet order with constant-time membership: the placement asks
`name in backends` for each home of a prefix, which on a list of 1,024 names was most of a
decision.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from itertools import repeat
from operator import add, mul, truediv
from typing import Any

from proxy.routing.orders import HashLed, Order, ScoredOrder
from proxy.routing.rendezvous import SCALE, h64, hrw_names, name_bytes
from proxy.routing.types import BackendView, Epoch, Views

ORDERS_KEPT = 512  # prompt heads whose rendezvous orders a fleet keeps (the placement's 256 fit)


class Names(tuple[str, ...]):
    """Backend names in fleet order; `in` is a set lookup, `members` the set itself."""

    members: frozenset[str]

    def __new__(cls, names: Sequence[str]) -> Names:
        self = super().__new__(cls, names)
        self.members = frozenset(self)
        return self

    def __contains__(self, name: object) -> bool:
        return name in self.members


class FleetWeights(dict[str, float]):
    """Backend -> weight, with the total the placement bounds loads by (sum of the weights,
    each at least 1e-9, in fleet order: the same float the sum over the names gives)."""

    names: Names
    total: float
    uniform: bool  # every backend has the same weight


class Rendezvous:
    """Rendezvous orders of one fleet, kept per prompt head (the most recent ORDERS_KEPT).

    Calling it is `hrw_names` (unweighted, the placement's order) for the fleet's own names and
    computes afresh for any other list; `rank` is the position of each name in that order;
    `weighted` is `hrw_order`'s order (the pickers') as indices into the fleet.
    """

    def __init__(self, names: Names, weights: Sequence[float]) -> None:
        self.names = names
        self._bytes = [name_bytes(n) for n in names]
        self._weights = [w if w > 1e-9 else 1e-9 for w in weights]
        self._alike = bool(weights) and self._weights.count(self._weights[0]) == len(weights)
        self._plain: OrderedDict[int, Sequence[str]] = OrderedDict()
        self._ranks: dict[int, Mapping[str, Any]] = {}
        self._pos: dict[str, int] | None = None  # name -> fleet position (made when asked)
        self._weighted: OrderedDict[int, Iterable[int]] = OrderedDict()
        self._last: tuple[int, list[int]] = (-1, [])  # the last seed's hashes of the names
        self.computed = 0  # orders computed (each one hashes every name once)

    def _hashes(self, seed: int) -> list[int]:
        """Every name's hash under `seed`: a prompt head seen for the first time needs both
        its orders in the same decision (placement's, then the shortlist's), from the same
        1,024 hashes."""
        last = self._last
        if last[0] == seed:
            return last[1]
        hashes = list(map(h64, self._bytes, repeat(seed, len(self._bytes))))
        self._last = (seed, hashes)
        return hashes

    def __call__(self, key: int, backends: Sequence[str]) -> Sequence[str]:
        if backends is not self.names:
            return hrw_names(key, backends)
        order = self._plain.get(key)
        if order is None:
            hashes = self._hashes(key & 0xFFFFFFFFFFFFFFFF)
            # Sorted as read (orders.py): a stable sort by hash, largest first, as
            # hrw_names's sorted(reverse=True) is.
            order = Order(self.names, hashes, descending=True)
            self._keep(self._plain, key, order)
            self._ranks.pop(key, None)
            self.computed += 1
        else:
            self._plain.move_to_end(key)
        return order

    def rank(self, key: int, backends: Sequence[str]) -> Mapping[str, Any]:
        """Name -> its position in `self(key, backends)`, or for the fleet's own names a key
        that sorts as the position does (RankKeys)."""
        if backends is not self.names:
            return {b: i for i, b in enumerate(self(key, backends))}
        found = self._ranks.get(key)
        if found is None:
            order = self(key, backends)
            assert isinstance(order, Order)  # (the fleet's own names: always kept as one)
            found = self._ranks[key] = RankKeys(order.values, self._positions())
        else:
            self._plain.move_to_end(key)  # (as asking for the order would)
        return found

    def _positions(self) -> dict[str, int]:
        if self._pos is None:
            self._pos = dict(zip(self.names, range(len(self.names)), strict=True))
        return self._pos

    def weighted(self, key: int) -> Iterable[int]:
        """Fleet indices in `hrw_order(key, fleet views)`'s order (same floats, same ties)."""
        order = self._weighted.get(key)
        if order is None:
            hashes = self._hashes(key & 0xFFFFFFFFFFFFFFFF)
            n = len(hashes)
            if self._alike:  # (read off the order by hash, scoring what is read: orders.py)
                w = self._weights[0]
                by_hash = self(key, self.names)
                assert isinstance(by_hash, Order)  # (the fleet's own names: always kept as one)
                led = HashLed(by_hash, self._positions(), ScoredOrder(hashes, w, SCALE), w, SCALE)
                self._keep(self._weighted, key, led)
                self.computed += 1
                return led
            u = map(mul, map(add, hashes, repeat(0.5, n)), repeat(SCALE, n))
            scores = list(map(truediv, self._weights, map(math.log, u)))
            # hrw_order sorts (score, index) pairs: a stable sort by score is the same order
            # (sorted as read: orders.py).
            order = Order(range(n), scores, descending=False)
            self._keep(self._weighted, key, order)
            self.computed += 1
        else:
            self._weighted.move_to_end(key)
        return order

    def _keep(self, cache: OrderedDict[int, Any], key: int, value: Any) -> None:
        cache[key] = value
        while len(cache) > ORDERS_KEPT:
            gone, _ = cache.popitem(last=False)
            if cache is self._plain:
                self._ranks.pop(gone, None)


class RankKeys(dict[str, tuple[Any, int]]):
    """Name -> a key that sorts as its position in a rendezvous order by hash does (minus
    the hash, then the fleet position: the stable sort's tie-break), made per name when first
    asked: the placement sorts a few backends by rank, and neither the whole order nor a rank
    of all 1,024 names is needed for that."""

    __slots__ = ("_hashes", "_pos")

    def __init__(self, hashes: Sequence[Any], pos: Mapping[str, int]) -> None:
        super().__init__()
        self._hashes = hashes
        self._pos = pos

    def __missing__(self, name: str) -> tuple[Any, int]:
        p = self._pos[name]  # (KeyError: not in the fleet)
        key = self[name] = (-self._hashes[p], p)
        return key


class Fleet:
    """What a decision derives from the candidates' names and weights alone."""

    def __init__(self, names: Names, weights: list[float]) -> None:
        self.names = names
        self.index: dict[str, int] = dict(zip(names, range(len(names)), strict=True))
        self.weight_list = weights
        fw = FleetWeights(zip(names, weights, strict=True))
        fw.names = names
        fw.total = sum(w if w > 1e-9 else 1e-9 for w in weights)
        fw.uniform = self.uniform = bool(weights) and weights.count(weights[0]) == len(weights)
        self.unit = self.uniform and weights[0] == 1.0  # every weight 1.0: loads are counts
        self.weights = fw
        self.zeros: dict[str, int] = dict.fromkeys(names, 0)
        self.rendezvous = Rendezvous(names, weights)
        # Placed prefixes' homes in this fleet, by id of their homes tuple (shortlist._homes_in).
        self.homes_kept: dict[int, tuple[Any, Any]] = {}

    def __len__(self) -> int:
        return len(self.names)


class FleetCache:
    """The last decision's fleet, reused while the candidates' names and weights match: for a
    Views read (proxy.routing.types), while its epoch is the one the fleet was made in, which
    costs no pass at all."""

    def __init__(self) -> None:
        self.fleet: Fleet | None = None
        self.epoch: Epoch | None = None
        self.builds = 0

    def of(self, candidates: Sequence[BackendView]) -> Fleet:
        if isinstance(candidates, Views):
            if candidates.epoch is self.epoch and self.fleet is not None:
                return self.fleet
            fleet = self._of(candidates)
            self.epoch = candidates.epoch
            return fleet
        self.epoch = None
        return self._of(candidates)

    def _of(self, candidates: Sequence[BackendView]) -> Fleet:
        names = tuple([b.name for b in candidates])
        weights = [b.weight for b in candidates]
        fleet = self.fleet
        if fleet is not None and fleet.names == names:
            if fleet.weight_list == weights:
                return fleet
            names = fleet.names  # same names: keep the Names (placement caches key on it)
        self.fleet = fleet = Fleet(names if isinstance(names, Names) else Names(names), weights)
        self.builds += 1
        return fleet
