"""Weighted rendezvous hashing with bounded load (pure; shared by the affinity pickers).

Rendezvous (highest random weight) hashing gives every replica the same order of backends for
a key without coordination, and moves only 1/n of the keys when a backend comes or goes. The
load bound (Mirrokni et al., "Consistent Hashing with Bounded Loads") skips a backend whose
in-flight count would exceed (1 + ε) * its weighted share of the total, so one hot key spills
to the next backend in its order instead of piling up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import add, le, mul, truediv

import xxhash

from proxy.routing.types import BackendView, Views

_h64 = xxhash.xxh3_64_intdigest
_SCALE = 1.0 / 18446744073709551616.0  # 2**-64
h64 = _h64
SCALE = _SCALE


_NAMES: dict[str, bytes] = {}  # backend name -> its UTF-8 bytes (names are few and long-lived)
_log = math.log


def _name_bytes(name: str) -> bytes:
    b = _NAMES.get(name)
    if b is None:
        if len(_NAMES) > 4096:
            _NAMES.clear()
        b = _NAMES[name] = name.encode()
    return b


name_bytes = _name_bytes


def weight_for(key: int, backend: BackendView) -> float:
    """Weighted HRW score: -w / ln(u), u uniform in (0, 1) from hash(key, backend)."""
    u = (_h64(_name_bytes(backend.name), key & 0xFFFFFFFFFFFFFFFF) + 0.5) * _SCALE
    w = backend.weight
    return -(w if w > 1e-9 else 1e-9) / _log(u)


def key_of(text: str) -> int:
    return _h64(text.encode())


def hrw_order(key: int, candidates: Sequence[BackendView]) -> list[BackendView]:
    """Candidates in rendezvous order for `key` (same order on every replica)."""
    n = len(candidates)
    if n < 2:
        return list(candidates)
    seed = key & 0xFFFFFFFFFFFFFFFF
    # weight_for's arithmetic in C-level passes (this runs several times a pick): the same
    # floats, sorted as (score, position) pairs are (a stable sort by score).
    get = _NAMES.get
    names = [get(b.name) or _name_bytes(b.name) for b in candidates]
    weights = [b.weight for b in candidates]
    if min(weights) <= 1e-9:
        weights = [w if w > 1e-9 else 1e-9 for w in weights]
    u = map(mul, map(add, map(_h64, names, repeat(seed, n)), repeat(0.5, n)), repeat(_SCALE, n))
    scores = list(map(truediv, weights, map(_log, u)))  # -weight: best first
    return list(map(candidates.__getitem__, sorted(range(n), key=scores.__getitem__)))


def hrw_first(
    key: int, candidates: Sequence[BackendView], r: int, weight: float
) -> list[BackendView]:
    """`hrw_order(key, candidates)[:r]` where every candidate's weight is `weight`: the score
    falls as the hash grows, so the first r are the r largest hashes, scored and ordered
    alone, when the r-th and the next score apart (else the whole order decides)."""
    n = len(candidates)
    if n <= r + 1 or r < 1:
        return hrw_order(key, candidates)[:r]
    get = _NAMES.get
    names = [get(b.name) or _name_bytes(b.name) for b in candidates]
    hashes = list(map(_h64, names, repeat(key & 0xFFFFFFFFFFFFFFFF, n)))
    head = sorted(range(n), key=hashes.__getitem__, reverse=True)[: r + 1]
    w = weight if weight > 1e-9 else 1e-9
    scores = [w / _log((hashes[i] + 0.5) * _SCALE) for i in head]
    if not scores[r - 1] < scores[r]:
        return hrw_order(key, candidates)[:r]
    first = sorted(range(r), key=lambda j: (scores[j], head[j]))  # (ties: by position)
    return [candidates[head[j]] for j in first]


def hrw_names(key: int, names: Sequence[str]) -> list[str]:
    """Backend names in unweighted rendezvous order for `key` (placement's tie-break)."""
    seed = key & 0xFFFFFFFFFFFFFFFF
    return sorted(names, key=lambda n: _h64(_name_bytes(n), seed), reverse=True)


@dataclass(frozen=True, slots=True)
class LoadBound:
    """split_by_load's bound, computed over a whole set of candidates: a backend is within it
    when one more request leaves its weight-normalised load at most `limit`.
    `within_count`: how many of those candidates are within (-1: not counted)."""

    epsilon: float
    slack: int
    mean_w: float
    limit: float
    within_count: int = -1

    def within(self, b: BackendView) -> bool:
        w = b.weight if b.weight > 1e-9 else 1e-9
        load = (b.inflight if b.inflight > 0 else 0) * self.mean_w / w
        return load + self.mean_w / w <= self.limit


class Shortlist(list[BackendView]):
    """Candidates drawn from a larger fleet (proxy.routing.shortlist): split_by_load bounds
    them by the fleet's load (`bound`, when its epsilon and slack are the picker's), not by
    their own, so a backend is within the bound here exactly when it is in the whole fleet."""

    bound: LoadBound
    fleet_size: int


def load_bound(
    candidates: Sequence[BackendView],
    epsilon: float,
    slack: int = 1,
    count: bool = False,
    inflight: Sequence[int] | None = None,
    unit: bool = False,
) -> LoadBound:
    """The bound split_by_load applies to `candidates` (not empty); `count`: also count how
    many are within it. Flat passes only: this runs over whole fleets. `inflight`: their
    in-flight counts, if already read; `unit`: every weight is 1.0 (then the normalised loads
    are the counts themselves, and the same floats come out of fewer passes)."""
    n = len(candidates)
    if unit and isinstance(candidates, Views) and candidates.inflight_least >= 0:
        return _unit_bound(candidates, epsilon, slack, count)
    loads = [b.inflight for b in candidates] if inflight is None else inflight
    if min(loads) < 0:
        loads = [i if i > 0 else 0 for i in loads]
    if unit:
        mean_w = 1.0
        average = (sum(loads) + 1) / n  # (the same float as the sum of i * 1.0 / 1.0)
        least = float(min(loads))
        norm: Sequence[float] = loads
    else:
        weights = [b.weight for b in candidates]
        if min(weights) <= 1e-9:
            weights = [w if w > 1e-9 else 1e-9 for w in weights]
        mean_w = sum(weights) / n
        # In-flight in units of an average-weight backend, and what one more request adds.
        norm = list(map(truediv, map(mul, loads, repeat(mean_w, n)), weights))
        average = (sum(norm) + 1) / n
        least = min(norm)
    limit = _limit(epsilon, slack, average, least)
    within = -1
    if count and unit:
        within = sum(map(le, map(add, norm, repeat(1.0, n)), repeat(limit, n)))
    elif count:
        one_more = map(truediv, repeat(mean_w, n), weights)
        within = sum(map(le, map(add, norm, one_more), repeat(limit, n)))
    return LoadBound(epsilon, slack, mean_w, limit, within)


def _limit(epsilon: float, slack: int, average: float, least: float) -> float:
    """The bound in weight-normalised requests, from the average load (one more request
    counted) and the least loaded backend's."""
    # The two-value max() and min() written out (each call parses its arguments in CPython
    # 3.11, ~1,200 instructions; this runs on every request).
    ratio, plus = math.ceil((1.0 + epsilon) * average), math.ceil(average) + slack
    above = plus if ratio < plus else ratio
    spread = epsilon * (least + 1)
    below = least + 1 + (spread if slack < spread else slack) + 1e-9
    return below if below < above else above


def _unit_bound(views: Views, epsilon: float, slack: int, count: bool) -> LoadBound:
    """load_bound over a Views read where every weight is 1.0: the same floats, from the
    fleet's in-flight total, least and counts instead of passes over every backend."""
    average = (views.inflight_total + 1) / len(views)
    limit = _limit(epsilon, slack, average, float(views.inflight_least))
    within = -1
    if count:
        within = sum([c for load, c in views.inflight_counts.items() if load + 1.0 <= limit])
    return LoadBound(epsilon, slack, 1.0, limit, within)


def split_by_load(
    candidates: Sequence[BackendView], epsilon: float, slack: int = 1
) -> tuple[list[BackendView], list[BackendView]]:
    """(within bound, over bound) if one more request were added to each backend.

    Two bounds, in weight-normalised requests. Above: (1 + epsilon) * the average share, as in
    consistent hashing with bounded loads, or average + slack if larger (at low load a ratio
    alone would refuse a warm backend its second request and pay a cold prefill elsewhere).
    Below: at most max(slack, epsilon * least) more than the least loaded backend. Bounded
    loads alone cap the busiest backend but let warm backends absorb everything while a cold
    one idles (3, 3, 3, 0 is "within 1.25x average"). The least loaded backend is always
    within both, so the choice is never empty. A Shortlist is bounded by its fleet's load.
    """
    if not candidates:
        return [], []
    bound = candidates.bound if isinstance(candidates, Shortlist) else None
    if bound is None or bound.epsilon != epsilon or bound.slack != slack:
        bound = load_bound(candidates, epsilon, slack)
    mean_w, limit = bound.mean_w, bound.limit
    within: list[BackendView] = []
    over: list[BackendView] = []
    for b in candidates:
        w = b.weight if b.weight > 1e-9 else 1e-9
        load = (b.inflight if b.inflight > 0 else 0) * mean_w / w
        (within if load + mean_w / w <= limit else over).append(b)
    if not within:  # unreachable by construction; never return an empty choice
        return list(candidates), []
    return within, over
