"""A rendezvous order sorted as far as it is read (proxy.routing.orders): whatever is read of
it, in whatever way, is what the whole stable sort gives, ties included."""

from __future__ import annotations

import itertools
import math
import random
from itertools import repeat
from operator import add, mul, truediv

import pytest

from proxy.routing.orders import HashLed, Order, ScoredOrder
from proxy.routing.rendezvous import SCALE


def values(rng: random.Random, n: int) -> list[float] | list[int]:
    kind = rng.random()
    if kind < 0.3:
        return [rng.getrandbits(64) for _ in range(n)]  # hashes
    if kind < 0.6:
        return [rng.random() * -5 for _ in range(n)]  # weighted scores
    return [rng.choice((1.0, 2.0, 2.5, 3.0)) for _ in range(n)]  # mostly ties


@pytest.mark.parametrize("seed", range(6))
def test_what_is_read_is_the_whole_sorts(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(150):
        n = rng.choice((0, 1, 2, 3, 10, 100, 300, 1024))
        vals, descending = values(rng, n), rng.random() < 0.5
        items = [f"b{i}" for i in range(n)]
        whole = [items[i] for i in sorted(range(n), key=vals.__getitem__, reverse=descending)]
        order = Order(items, vals, descending)
        k = rng.randint(0, n)
        read = []
        for name in order:  # read as a walk that stops
            if len(read) >= k:
                break
            read.append(name)
        assert read == whole[:k]
        if n:
            i = rng.randrange(n)
            assert order[i] == whole[i] and order[-1] == whole[-1]
        assert list(order[:5]) == whole[:5] and list(order) == whole and len(order) == n


def test_a_walk_of_the_first_few_sorts_a_head_not_the_fleet() -> None:
    rng = random.Random(1)
    hashes = [rng.getrandbits(64) for _ in range(1024)]
    order = Order(list(range(1024)), hashes, descending=True)
    first = [b for _, b in zip(range(20), order, strict=False)]
    assert first == sorted(range(1024), key=hashes.__getitem__, reverse=True)[:20]
    assert order.sorts == 1 and not order._done and len(order._head) < 256


@pytest.mark.parametrize("seed", range(4))
def test_a_fleet_of_alike_weights_scored_as_read_is_hrw_orders(seed: int) -> None:
    """Scores computed for the head only, cut on the hashes; hashes so close to 2**64 that
    they share a float score (a cut between them sorts the whole order)."""
    rng = random.Random(seed)
    for _ in range(200):
        n = rng.choice((1, 2, 5, 50, 300, 1024))
        top = rng.getrandbits(64) | (1 << 63)
        near = rng.random() < 0.3
        hashes = [
            min(top + rng.randint(0, 1 << 12), (1 << 64) - 1)
            if near and rng.random() < 0.5
            else rng.getrandbits(64)
            for _ in range(n)
        ]
        w = rng.choice((1.0, 0.5, 2.0))
        u = map(mul, map(add, hashes, repeat(0.5, n)), repeat(SCALE, n))
        scores = list(map(truediv, repeat(w, n), map(math.log, u)))  # as Rendezvous does
        whole = sorted(range(n), key=scores.__getitem__)
        order = ScoredOrder(hashes, w, SCALE)
        k = rng.randint(0, n)
        assert list(itertools.islice(order, k)) == whole[:k]
        assert list(order) == whole


@pytest.mark.parametrize("seed", range(4))
def test_an_order_read_off_the_hashes_is_the_scored_one(seed: int) -> None:
    """HashLed gives ScoredOrder's order, read in parts or whole, twice, with hashes so close
    to 2**64 that some share a float score (the ScoredOrder then reads on)."""
    rng = random.Random(seed)
    for _ in range(150):
        n = rng.choice((1, 2, 5, 50, 300))
        top = rng.getrandbits(64) | (1 << 63)
        near = rng.random() < 0.4
        hashes = [
            min(top + rng.randint(0, 1 << 12), (1 << 64) - 1)
            if near and rng.random() < 0.5
            else rng.getrandbits(64)
            for _ in range(n)
        ]
        names = [f"b{i}" for i in range(n)]
        w = rng.choice((1.0, 0.5, 2.0))
        whole = list(ScoredOrder(hashes, w, SCALE))
        led = HashLed(
            Order(names, hashes, descending=True),
            {b: i for i, b in enumerate(names)},
            ScoredOrder(hashes, w, SCALE),
            w,
            SCALE,
        )
        k = rng.randint(0, n)
        assert list(itertools.islice(led, k)) == whole[:k]
        assert list(led) == whole
        assert list(led) == whole
