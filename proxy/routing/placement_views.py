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
- `first_spares`: the first spare homes of the eager rule (sort every backend with room by
  within-the-bound then rendezvous rank, the less loaded of the first two first, the least
  crowded when the first is crowded), found by walking the rendezvous order only as far as
  the answer needs; None when only the whole list can tell.

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
WALK = 64  # backends of a rendezvous order the spare walk reads before listing those within
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


def hosted_total(hosted: Mapping[str, int], backends: Sequence[str]) -> int:
    """Placed prefixes hosted on `backends`, summed (over the hosts, not the fleet)."""
    inside = frozenset(fast_members(backends))
    if inside.issuperset(hosted):
        return sum(hosted.values())
    return sum(n for b, n in hosted.items() if b in inside)


def first_spares(
    hrw: Sequence[str],
    chosen: Collection[str],
    r: int,
    choices: int,
    fits: Callable[[str], bool],
    within: Callable[[str], bool],
    swap: Callable[[str, str], bool],
    hosted: Mapping[str, int],
    fair: float,
    rank: Mapping[str, Any],
    within_all: Callable[[], Collection[str] | None] | None = None,
) -> list[str] | None:
    """The first `r` backends of the eager spare order, or None when it takes all of it.

    The eager rule: every backend of `hrw` not `chosen` and with room, sorted within the load
    bound first, then by rendezvous rank; the first two swapped when the second (within) is
    less loaded (`swap`) and exactly two are compared; and when the first hosts more placed
    prefixes than `fair`, sorted again by (within, crowded, hosted, rank)."""
    want = (r if r > 2 else 2) if choices <= 2 else (r if r > 3 else 3)
    every = within_all() if within_all is not None else None
    if every is not None:
        return _from_within(hrw, chosen, r, want, choices, fits, swap, hosted, fair, rank, every)
    inside: list[str] = []
    outside: list[str] = []
    complete = True
    for b in hrw:
        if b in chosen or not fits(b):
            continue
        if within(b):
            inside.append(b)
            if len(inside) >= want:
                complete = False
                break
        else:
            outside.append(b)
    spare = inside + outside if complete else inside
    # The pair rule compares spare[:choices] when that is exactly two backends (incomplete,
    # there are at least `want` of them: two, or three and more when choices > 2).
    two = len(spare) >= 2 if choices == 2 else choices > 2 and complete and len(spare) == 2
    if two and within(spare[1]) and swap(spare[0], spare[1]):
        spare[0], spare[1] = spare[1], spare[0]
    if not spare or hosted.get(spare[0], 0) <= fair:
        return spare[:r]
    if complete:
        spare.sort(
            key=lambda b: (not within(b), hosted.get(b, 0) > fair, hosted.get(b, 0), rank[b])
        )
        return spare[:r]
    # Crowded: nothing sorts before a backend within the bound that hosts none (hosted 0 is
    # never over a fair count), and those keep their rendezvous order among themselves.
    empty: list[str] = []
    for b in hrw:
        if b not in chosen and b not in hosted and fits(b) and within(b):
            empty.append(b)
            if len(empty) >= r:
                return empty
    return None


def _from_within(
    hrw: Sequence[str],
    chosen: Collection[str],
    r: int,
    want: int,
    choices: int,
    fits: Callable[[str], bool],
    swap: Callable[[str, str], bool],
    hosted: Mapping[str, int],
    fair: float,
    rank: Mapping[str, Any],
    every: Collection[str],
) -> list[str] | None:
    """first_spares, knowing `every` backend within the bound: those with room head the
    spare order; the others (over the bound) follow in rendezvous order, found by walking it.

    The first `want` of them are found by walking the rendezvous order as far as they lie
    (a hot prefix growing by a few dozen homes reads the room of those, not of the ~1,000
    backends within the bound); all of them only when fewer are found or the first is
    crowded (then the order is by how many prefixes each one hosts)."""
    inside = every if isinstance(every, WithinAsked | Within | frozenset) else frozenset(every)
    first: list[str] = []
    fitting: list[str] | None = None
    for walked, b in enumerate(hrw):
        if walked >= WALK:
            # Few of them lie at the head of the order (a prompt whose one copy is more than
            # most backends' share of the load): the whole sorted list, from the set instead.
            fitting = [b for b in every if b not in chosen and fits(b)]
            fitting.sort(key=rank.__getitem__)
            first = fitting[:want]
            break
        if b in inside and b not in chosen and fits(b):
            first.append(b)
            if len(first) >= want:
                break
    if len(first) >= want:
        # As the whole sorted list would begin: complete (no backend over the bound needed),
        # and the pair rule reads the first two only (with choices > 2, a list of two only).
        if choices == 2 and swap(first[0], first[1]):
            first[0], first[1] = first[1], first[0]
        if hosted.get(first[0], 0) <= fair:
            return first[:r]
        if fitting is None:
            crowded = _least_hosted(hrw, chosen, r, fits, hosted, inside)
            if crowded is not None:
                return crowded
    if fitting is None:
        fitting = [b for b in every if b not in chosen and fits(b)]
        fitting.sort(key=rank.__getitem__)
    over: list[str] = []
    complete = True
    if len(fitting) < want:
        for b in hrw:
            if b not in chosen and b not in inside and fits(b):
                over.append(b)
                if len(fitting) + len(over) >= want:
                    complete = False
                    break
    spare = fitting + over
    two = len(spare) >= 2 if choices == 2 else choices > 2 and complete and len(spare) == 2
    if two and len(fitting) >= 2 and swap(spare[0], spare[1]):
        spare[0], spare[1] = spare[1], spare[0]
    if not spare or hosted.get(spare[0], 0) <= fair:
        return spare[:r]
    # Crowded: by (within, crowded, hosted, rank). The backends within come first; then those
    # over the bound by how many prefixes they host (crowded follows from it), each count in
    # rendezvous order: walk the order once per count, fewest first, until there are enough.
    fitting.sort(key=lambda b: (hosted.get(b, 0) > fair, hosted.get(b, 0), rank[b]))
    if len(fitting) >= r:
        return fitting[:r]
    rest: list[str] = []
    levels = sorted(set(hosted.values()) | {0})
    for level in levels:
        for b in hrw:
            if hosted.get(b, 0) == level and b not in chosen and b not in inside and fits(b):
                rest.append(b)
                if len(fitting) + len(rest) >= r:
                    return fitting + rest
    return fitting + rest


def _least_hosted(
    hrw: Sequence[str],
    chosen: Collection[str],
    r: int,
    fits: Callable[[str], bool],
    hosted: Mapping[str, int],
    inside: Collection[str],
) -> list[str] | None:
    """The first `r` backends of `inside`, not `chosen` and with room, by how many prefixes
    each hosts, then rendezvous order: the crowded sort of every such backend (by crowded,
    then hosted, then rank: crowded follows from hosted), found by walking the order once
    per count, fewest first, reading the room of the backends at that count only; None when
    fewer than `r` are found (then every backend over the bound may come into it)."""
    out: list[str] = []
    get = hosted.get
    for level in sorted(set(hosted.values()) | {0}):
        for b in hrw:
            if get(b, 0) == level and b in inside and b not in chosen and fits(b):
                out.append(b)
                if len(out) >= r:
                    return out
    return None


def spare_homes(
    backends: Sequence[str],
    hrw: Sequence[str],
    rank: Mapping[str, Any],
    taken: Collection[str],
    count: int,
    choices: int,
    loads: Mapping[str, float],
    within: Callable[[str], bool],
    fits: Callable[[str], bool],
    busy: Callable[[str], float] | None,
    tally: Mapping[str, int],
    within_all: Callable[[Callable[[str], bool]], Collection[str] | None] | None = None,
) -> list[str]:
    """Up to `count` new homes for a prefix (Placement._choose), none `taken`, in its
    rendezvous order `hrw`: those within the load bound and with room first; of the first two,
    the less loaded; and when the first already hosts more placed prefixes (`tally`, the
    prefix itself left out) than a fair count, the least crowded (two choices alone still left
    3 of 8 prompts on one engine). On a large fleet found by walking the order only as far as
    needed, or from every backend within the bound (`within_all`, Loads.within_all) at once
    (first_spares)."""

    # Assigned load first, then what is in flight now (shared by replicas via Redis).
    def now(b: str) -> float:
        return busy(b) if busy is not None else 0.0

    def swap(first: str, second: str) -> bool:
        return (loads[second], now(second)) < (loads[first], now(first))

    if len(backends) > EAGER_UP_TO:
        fair = hosted_total(tally, backends) / max(len(backends), 1)
        every = (lambda: within_all(within)) if within_all is not None else None
        found = first_spares(
            hrw, taken, count, choices, fits, within, swap, tally, fair, rank, every
        )
        if found is not None:
            return found
    spare = [b for b in hrw if b not in taken and fits(b)]
    spare.sort(key=lambda b: (not within(b), rank[b]))
    pair = spare[:choices]
    if len(pair) == 2 and within(pair[1]) and swap(pair[0], pair[1]):
        spare[0], spare[1] = pair[1], pair[0]
    hosted = {b: tally.get(b, 0) for b in backends}
    fair = sum(hosted.values()) / max(len(backends), 1)
    if spare and hosted[spare[0]] > fair:
        spare.sort(key=lambda b: (not within(b), hosted[b] > fair, hosted[b], rank[b]))
    return spare[:count]


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
