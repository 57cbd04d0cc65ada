"""The spare order on a large fleet (proxy.routing.spares.first_spares), found by
walking the rendezvous order only as far as needed, against the whole-list rule it replaces:
every backend within the bound with room sorted by rank, the pair swap, and the crowded sort
by (over a fair count, hosted, rank)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence

import pytest

from proxy.routing.spares import first_spares


def whole_list(
    hrw: Sequence[str],
    chosen: set[str],
    r: int,
    choices: int,
    fits: Callable[[str], bool],
    swap: Callable[[str, str], bool],
    hosted: Mapping[str, int],
    fair: float,
    every: list[str],
) -> list[str]:
    """The rule written out over every backend (no early exit)."""
    rank = {b: i for i, b in enumerate(hrw)}
    inside = set(every)
    fitting = sorted((b for b in every if b not in chosen and fits(b)), key=rank.__getitem__)
    over = [b for b in hrw if b not in chosen and b not in inside and fits(b)]
    want = (r if r > 2 else 2) if choices <= 2 else (r if r > 3 else 3)
    if len(fitting) >= want:
        spare, complete = fitting, True
    else:  # the backends over the bound, as far as `want` (all of them: complete)
        spare, complete = (fitting + over)[:want], len(fitting) + len(over) < want
    two = len(spare) >= 2 if choices == 2 else choices > 2 and complete and len(spare) == 2
    if two and len(fitting) >= 2 and swap(spare[0], spare[1]):
        spare[0], spare[1] = spare[1], spare[0]
    if not spare or hosted.get(spare[0], 0) <= fair:
        return spare[:r]
    fitting.sort(key=lambda b: (hosted.get(b, 0) > fair, hosted.get(b, 0), rank[b]))
    if len(fitting) >= r:
        return fitting[:r]
    rest = sorted(
        (b for b in hrw if b not in chosen and b not in inside and fits(b)),
        key=lambda b: (hosted.get(b, 0), rank[b]),
    )
    return (fitting + rest)[:r]


@pytest.mark.parametrize("seed", range(40))
def test_the_first_spares_are_those_of_the_whole_list(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.choice((70, 200, 1024))
    hrw = [f"e{i}" for i in range(n)]
    rng.shuffle(hrw)
    rank = {b: i for i, b in enumerate(hrw)}
    every = [b for b in hrw if rng.random() < rng.choice((0.05, 0.5, 0.95))]
    rng.shuffle(every)
    no_room = {b for b in hrw if rng.random() < rng.choice((0.0, 0.3, 0.97))}
    # (The tallies keep no zero: a backend hosting nothing is absent.)
    hosted = {b: rng.choice((1, 1, 2, 5)) for b in hrw if rng.random() < rng.random()}
    chosen = set(rng.sample(hrw, rng.randint(0, 12)))
    loads = {b: rng.random() for b in hrw}
    fair = rng.choice((0.0, 0.5, 1.0, 3.0))
    r, choices = rng.randint(1, 6), rng.choice((1, 2, 3))

    def fits(b: str) -> bool:
        return b not in no_room

    def swap(first: str, second: str) -> bool:
        return loads[second] < loads[first]

    inside = set(every)
    got = first_spares(
        hrw, chosen, r, choices, fits, inside.__contains__, swap, hosted, fair, rank,
        lambda: every,
    )  # fmt: skip
    want = whole_list(hrw, chosen, r, choices, fits, swap, hosted, fair, every)
    assert got is not None and got == want
