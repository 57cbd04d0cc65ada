"""A prefix's new homes on a large fleet: the spare order, walked only as far as needed (pure).

Placement (proxy.routing.placement) adds homes in the prefix's rendezvous order: those within
the load bound and with room first; of the first two, the less loaded; and when the first
already hosts more placed prefixes than a fair count, the least crowded. Sorting every backend
by that rule was most of a hot prefix's growth at 1,024 backends; `first_spares` finds the
first entries of the sorted list by walking the order (at most WALK of it before taking the
set within the bound, placement_views.WithinAsked), one hosted count at a time when crowded;
`spare_homes` is the rule itself, and its whole-list form on small fleets.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from itertools import repeat
from typing import Any

from proxy.routing.orders import Order
from proxy.routing.placement_views import EAGER_UP_TO, Within, WithinAsked, fast_members

WALK = 64  # backends of a rendezvous order the spare walk reads before listing those within


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
    for level in _levels(hrw, hosted):
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
    for level in _levels(hrw, hosted):
        for b in hrw:
            if get(b, 0) == level and b in inside and b not in chosen and fits(b):
                out.append(b)
                if len(out) >= r:
                    return out
    return None


def _levels(hrw: Sequence[str], hosted: Mapping[str, int]) -> list[int]:
    """The counts of placed prefixes the backends of `hrw` host (0: none), fewest first, read
    in one C-level pass: a walk of the order per count walks only for counts some backend
    has (once every backend hosts one, a walk for 0 read the whole order for nothing)."""
    names = hrw.items if isinstance(hrw, Order) else hrw
    return sorted(set(map(hosted.get, names, repeat(0))))


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
