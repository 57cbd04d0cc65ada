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

import xxhash

from proxy.routing.types import BackendView

_h64 = xxhash.xxh3_64_intdigest
_SCALE = 1.0 / 18446744073709551616.0  # 2**-64


_NAMES: dict[str, bytes] = {}  # backend name -> its UTF-8 bytes (names are few and long-lived)
_log = math.log


def _name_bytes(name: str) -> bytes:
    b = _NAMES.get(name)
    if b is None:
        if len(_NAMES) > 4096:
            _NAMES.clear()
        b = _NAMES[name] = name.encode()
    return b


def weight_for(key: int, backend: BackendView) -> float:
    """Weighted HRW score: -w / ln(u), u uniform in (0, 1) from hash(key, backend)."""
    u = (_h64(_name_bytes(backend.name), key & 0xFFFFFFFFFFFFFFFF) + 0.5) * _SCALE
    w = backend.weight
    return -(w if w > 1e-9 else 1e-9) / _log(u)


def key_of(text: str) -> int:
    return _h64(text.encode())


def hrw_order(key: int, candidates: Sequence[BackendView]) -> list[BackendView]:
    """Candidates in rendezvous order for `key` (same order on every replica)."""
    if len(candidates) < 2:
        return list(candidates)
    seed = key & 0xFFFFFFFFFFFFFFFF
    scored = []
    for i, b in enumerate(candidates):  # weight_for, inlined: this runs several times a pick
        name = _NAMES.get(b.name) or _name_bytes(b.name)
        w = b.weight
        u = (_h64(name, seed) + 0.5) * _SCALE
        scored.append(((w if w > 1e-9 else 1e-9) / _log(u), i))  # -weight: best first
    scored.sort()
    return [candidates[i] for _, i in scored]


def hrw_names(key: int, names: Sequence[str]) -> list[str]:
    """Backend names in unweighted rendezvous order for `key` (placement's tie-break)."""
    seed = key & 0xFFFFFFFFFFFFFFFF
    return sorted(names, key=lambda n: _h64(_name_bytes(n), seed), reverse=True)


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
    within both, so the choice is never empty.
    """
    if not candidates:
        return [], []
    n = len(candidates)
    weights = [b.weight if b.weight > 1e-9 else 1e-9 for b in candidates]
    mean_w = sum(weights) / n
    # In-flight in units of an average-weight backend, and what one more request adds.
    norm = [
        (b.inflight if b.inflight > 0 else 0) * mean_w / w
        for b, w in zip(candidates, weights, strict=True)
    ]
    average = (sum(norm) + 1) / n
    least = min(norm)
    # The two-value max() and min() written out (each call parses its arguments in CPython
    # 3.11, ~1,200 instructions; this runs on every request).
    ratio, plus = math.ceil((1.0 + epsilon) * average), math.ceil(average) + slack
    above = plus if ratio < plus else ratio
    spread = epsilon * (least + 1)
    below = least + 1 + (spread if slack < spread else slack) + 1e-9
    limit = below if below < above else above
    within: list[BackendView] = []
    over: list[BackendView] = []
    for b, w, load in zip(candidates, weights, norm, strict=True):
        (within if load + mean_w / w <= limit else over).append(b)
    if not within:  # unreachable by construction; never return an empty choice
        return list(candidates), []
    return within, over
