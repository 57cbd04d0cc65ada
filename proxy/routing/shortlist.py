"""The few candidates a picker needs to see to decide as it would over the whole fleet (pure).

A picker orders whatever list it is handed, and the bounded_load picker (plugins/, the default
policy's) makes several passes over it, hashing every backend for its rendezvous orders: at
1,024 backends that was most of a decision. Its decision only ever depends on a few of them:

- a placed prefix (the common case: placement places every prompt of `warm_blocks` or more)
  goes to the least loaded of its homes within the load bound, the rest of the ranking being
  the other homes and then the prefix's rendezvous order over the backends within the bound;
- a cold prefix (placement off) goes to the less loaded of the first `choices` backends of
  its rendezvous order within the bound.

So the router hands it a `Shortlist`: the HEAD best homes by the picker's own sort key (its
load, its match, the request's tie-break), the home holding the most of the prompt (it sets
how much a non-home must hold to count as one), every non-home that holds that much, and,
for a prefix with fewer than HEAD homes, the first HEAD backends within the bound in its
rendezvous order (the picker ranks every home before them). With weights alike, a hot prefix's
hundreds of homes are read for their in-flight counts only: the homes the HEAD best can be
among are the least loaded and those holding the request's own history (`_contenders`).
A Shortlist carries the whole fleet's load bound (proxy.routing.rendezvous.split_by_load uses
it), so "within the bound" means there what it means over the fleet. The picker then returns
the winner it would have returned over every candidate, and the first HEAD entries of its
ranking too (HEAD is retries.max_attempts' upper bound, so every backend a retry can reach is
the fleet-wide choice); the counts in its reason are restated for the fleet.

What the list cannot carry, it does not try: the router hands the whole fleet (the old cost,
the same answer) whenever the picker's decision could read more than these backends:

- a prompt shorter than `warm_blocks` (ranked by every candidate's total score);
- a warm prefix that is not placed (placement off: its copies are ranked by total score);
- an engine reporting more than `slack` waiting requests (the picker's long-queue guard then
  compares each backend to the average queue of all of them);
- every home of a placed prefix over the load bound (the spill rule weighs every backend's
  prefill work);
- a fleet of SHORTLIST_ABOVE backends or fewer, or another picker.

A short list never hides a less loaded engine: the bound is the fleet's, the least loaded
backend is always within it, and the rule that moves traffic off loaded homes only ever runs
over the whole fleet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import add, eq, ge, le, lt, mul, not_, truediv
from typing import Any

from proxy.routing.fleet import Fleet
from proxy.routing.rendezvous import (
    LoadBound,
    Shortlist,
    hrw_first,
    hrw_order,
    key_of,
    load_bound,
)
from proxy.routing.types import BackendView, PickerHints, RouteContext, Views

HEAD = 10  # ranking entries kept exactly as over the whole fleet (retries.max_attempts <= 10)
SHORTLIST_ABOVE = 32  # candidates; a fleet this small is handed whole (it costs less)
_PACK = 1 << 40  # in-flight counts below this pack under _best_homes's two flag bits
HOMES_KEPT = 1024  # placed prefixes whose homes a fleet keeps looked up (Placement.max_keys: 256)


@dataclass(slots=True)
class Plan:
    """A shortlist and what the picker's reason counts over the whole fleet."""

    shortlist: Shortlist
    homes: int = 0  # homes of a placed prefix (with the non-homes that count as homes)
    over: int = -1  # backends over the load bound (cold prefixes' reasons); -1: not counted
    home_names: frozenset[str] = frozenset()  # those homes

    def restate(self, reason: str) -> str:
        """The picker's reason with its counts of homes and loaded backends the fleet's."""
        if self.homes > 1:
            mine = sum(1 for b in self.shortlist if b.name in self.home_names)
            if mine != self.homes:
                reason = reason.replace(f"(1 of {mine} homes)", f"(1 of {self.homes} homes)")
        if self.over > 0:
            reason = f"{reason}; {self.over} over the load bound"
        return reason


def shortlist(
    ctx: RouteContext,
    candidates: Sequence[BackendView],
    fleet: Fleet,
    held: Mapping[str, int],
    hints: PickerHints,
    inflight: Sequence[int],
) -> Plan | None:
    """The shortlist for a picker whose `hints` give its load bound (bounded_load's rules),
    or None: hand it every candidate.

    `held`: the candidates matching at least one block of the prompt, and how many;
    `inflight`: each candidate's requests in flight."""
    n = len(candidates)
    warm = hints.warm_blocks
    blocks = ctx.prefix_blocks
    if n <= SHORTLIST_ABOVE or len(blocks) < warm or hints.load_bound is None:
        return None
    epsilon, slack, choices = hints.load_bound
    if isinstance(candidates, Views):
        waiting = candidates.waiting_most
    else:
        waiting = max([b.load.waiting or 0.0 for b in candidates], default=0.0)
    if epsilon < -1.0 or waiting > slack:
        return None  # the long-queue guard could set some apart: it compares to all of them
    affinity = hints.affinity_blocks
    key = blocks[(len(blocks) if len(blocks) < affinity else affinity) - 1]
    if ctx.homes:
        bound = load_bound(candidates, epsilon, slack, inflight=inflight, unit=fleet.unit)
        return _placed(ctx, candidates, fleet, held, key, warm, bound, inflight)
    if max(held.values(), default=0) >= warm:
        return None  # a warm prefix, not placed: its copies are ranked by total score
    bound = load_bound(candidates, epsilon, slack, True, inflight, fleet.unit)
    first = _first_within(candidates, fleet, key, bound, frozenset(), max(HEAD, choices))
    return Plan(_listed(first, fleet, bound, n), over=n - bound.within_count)


def _placed(
    ctx: RouteContext,
    candidates: Sequence[BackendView],
    fleet: Fleet,
    held: Mapping[str, int],
    key: int,
    warm: int,
    bound: LoadBound,
    inflight: Sequence[int],
) -> Plan | None:
    index = fleet.index
    placed, _, homes_set, home_members = _homes_in(fleet, ctx.homes)
    if not placed:
        return None
    matched = ctx.matched_blocks
    # The homes that match any of the prompt are among its holders (the rest match none).
    holding = [(index[b], n) for b, n in held.items() if b in home_members]
    most = max([n for _, n in holding], default=0)
    deepest = min([i for i, n in holding if n == most]) if most else placed[0]
    # A non-home holding this much counts as a home (the picker's rule, home_reach).
    shared = ctx.shared_blocks
    reach = (most if most > shared else shared) + warm
    deep = compress(held, map(ge, held.values(), repeat(reach)))  # (most hold less)
    extra = sorted([index[b] for b in deep if b not in homes_set and b in index])
    own = ctx.shared_blocks + warm
    first = _contenders(placed, holding, own, inflight) if fleet.unit else placed
    views = [candidates[i] for i in first] + [candidates[i] for i in extra]
    ok = _within(views, bound, fleet.unit)
    if not any(ok):
        return None  # every home over the bound: the spill rule weighs the whole fleet
    top = _best_homes(ctx, views, ok, matched, own, fleet.unit)
    top.append(candidates[deepest])
    extras = views[len(first) :]
    names = home_members.union([b.name for b in extras]) if extras else home_members
    # The picker ranks every home before any other backend, and some home is within the
    # bound: with HEAD homes or more, no backend but a home is among the first HEAD.
    homes = len(placed) + len(extras)
    others = _first_within(candidates, fleet, key, bound, names, HEAD) if homes < HEAD else []
    listed = _listed(top + extras + others, fleet, bound, len(candidates))
    return Plan(listed, homes=homes, home_names=names)


def _contenders(
    placed: list[int], holding: list[tuple[int, int]], own: float, inflight: Sequence[int]
) -> list[int]:
    """The homes (fleet positions, in fleet order) among which the picker's HEAD first lie,
    where every weight is 1.0: those holding the request's own history (`own` blocks), and
    every other home at most as loaded as the HEAD-th least loaded of them.

    The picker sorts homes by (over the bound, short of its own history, load, tie-break);
    with weights alike "over the bound" follows the load, so a home short of it behind HEAD
    others short of it and less loaded can never be among the first HEAD. A hot prefix's
    hundreds of homes are read for their counts only (one C-level pass), not sorted."""
    long = [i for i, n in holding if n >= own]
    k = HEAD + len(long)
    if len(placed) <= k:
        return placed
    loads = list(map(inflight.__getitem__, placed))
    most = sorted(loads)[k - 1]
    if long:
        first = set(compress(placed, map(le, loads, repeat(most))))
        return sorted(first.union(long))
    return list(compress(placed, map(le, loads, repeat(most))))


def _homes_in(
    fleet: Fleet, homes: tuple[str, ...]
) -> tuple[list[int], list[str], frozenset[str], frozenset[str]]:
    """A placed prefix's homes in `fleet`: their positions (in fleet order), their names in
    that order, every home, and the homes in the fleet. Kept per homes tuple (the placement
    hands back the same tuple while a prefix's homes and the fleet stay): a prefix on
    hundreds of engines is looked up, sorted and hashed once, not at each of its requests."""
    kept = fleet.homes_kept
    found = kept.get(id(homes))
    if found is not None and found[0] is homes:
        return found[1]
    index, names = fleet.index, fleet.names
    placed = sorted([index[h] for h in homes if h in index])
    home_names = [names[i] for i in placed]
    out = (placed, home_names, frozenset(homes), frozenset(home_names))
    if len(kept) >= HOMES_KEPT:
        kept.clear()
    kept[id(homes)] = (homes, out)
    return out


def _within(views: Sequence[BackendView], bound: LoadBound, unit: bool) -> list[bool]:
    """bound.within for each of `views` (the same arithmetic, in C-level passes; `unit`:
    every weight is 1.0, so a load is its count)."""
    k = len(views)
    inflight = [b.inflight for b in views]
    if min(inflight) < 0:
        inflight = [i if i > 0 else 0 for i in inflight]
    if unit:
        return list(map(le, map(add, inflight, repeat(1.0, k)), repeat(bound.limit, k)))
    weights = [b.weight for b in views]
    if min(weights) <= 1e-9:
        weights = [w if w > 1e-9 else 1e-9 for w in weights]
    mean_w = bound.mean_w
    load = map(truediv, map(mul, inflight, repeat(mean_w, k)), weights)
    more = map(truediv, repeat(mean_w, k), weights)
    return list(map(le, map(add, load, more), repeat(bound.limit, k)))


def _best_homes(
    ctx: RouteContext,
    views: list[BackendView],
    ok: list[bool],
    matched: Mapping[str, int],
    own: float,
    unit: bool = False,
) -> list[BackendView]:
    """The HEAD first of `views` by the picker's sort of a placed prefix's homes: within the
    bound, holding the request's own history, least loaded, then the request's tie-break.
    `unit`: every weight is 1.0, so a load is its in-flight count and the three keys pack
    into one int that orders (and ties) as their tuple does."""
    if len(views) <= HEAD:
        return list(views)
    k = len(views)
    short = list(map(lt, map(matched.get, [b.name for b in views], repeat(0, k)), repeat(own, k)))
    inflight = [b.inflight for b in views]
    keys: list[Any]
    if unit and all(ok) and (all(short) or not any(short)):
        keys = inflight  # (the flags alike for every home: the count alone orders them)
    elif unit and -_PACK < min(inflight) and max(inflight) < _PACK:
        # (not within, short) as 2 bits above the count: 2 * (not ok) + short, then the load.
        flags = map(add, map(mul, map(not_, ok), repeat(2, k)), short)
        keys = list(map(add, map(mul, flags, repeat(2 * _PACK, k)), inflight))
    else:
        weights = [b.weight for b in views]
        if min(weights) <= 1e-9:
            weights = [w if w > 1e-9 else 1e-9 for w in weights]
        loads = map(truediv, inflight, weights)
        keys = list(zip(map(not_, ok), short, loads, strict=True))
    last = sorted(keys)[HEAD - 1]
    best = list(compress(views, map(lt, keys, repeat(last, k))))
    tied = list(compress(views, map(eq, keys, repeat(last, k))))
    # Ties go by the request's rendezvous order over the homes (the picker's tie-break; the
    # order of a subset is that of the whole, restricted).
    rid = key_of(ctx.request_id)
    if unit:
        return best + hrw_first(rid, tied, HEAD - len(best), 1.0)
    return best + hrw_order(rid, tied)[: HEAD - len(best)]


def _first_within(
    candidates: Sequence[BackendView],
    fleet: Fleet,
    key: int,
    bound: LoadBound,
    skip: frozenset[str],
    count: int,
) -> list[BackendView]:
    """The first `count` candidates within the bound in `key`'s weighted rendezvous order
    (hrw_order's), leaving out `skip`."""
    out: list[BackendView] = []
    within = bound.within
    for i in fleet.rendezvous.weighted(key):
        b = candidates[i]
        if b.name not in skip and within(b):
            out.append(b)
            if len(out) >= count:
                break
    return out


def _listed(views: list[BackendView], fleet: Fleet, bound: LoadBound, fleet_size: int) -> Shortlist:
    """`views` once each, in fleet order (the order the picker would meet them in)."""
    index = fleet.index
    seen: dict[int, BackendView] = {index[b.name]: b for b in views}
    out = Shortlist(seen[i] for i in sorted(seen))
    out.bound = bound
    out.fleet_size = fleet_size
    return out
