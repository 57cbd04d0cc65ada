"""The prefix index's tables: the C BlockMap answers every operation as its dict contract does.

proxy/_blockmap.c is built with the compiled hot path; proxy/routing/blockmap.py's PyBlockMap
(a dict) is its contract and the pure fallback. The index's own tests (tests/test_index.py and
the routing tests) run on whichever the install chose; here the two are run side by side on
the same operations, generated and written out, and the C type's own limits are checked.
"""

from __future__ import annotations

import gc
import importlib.util
import random
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import proxy
from proxy.routing import blockmap
from proxy.routing.blockmap import PyBlockMap

BUILT = importlib.util.find_spec("proxy._blockmap") is not None
needs_c = pytest.mark.skipif(not BUILT, reason="proxy._blockmap is not built (a pure install)")


def _c() -> Any:
    from proxy._blockmap import BlockMap

    return BlockMap


# The ends of the key range, both sides of the sign, and a few that collide in a small index.
EDGES = [0, 1, 2, 7, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63), 12345678901234567]
KEYS = st.one_of(st.sampled_from(EDGES), st.integers(0, 40), st.integers(0, 2**64 - 1))
VALUES = st.one_of(st.none(), st.floats(allow_nan=False), st.integers(-(2**70), 2**70))
OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["set", "set", "set", "del", "pop", "pop_default", "get", "in", "front", "ends"]
        ),
        KEYS,
        VALUES,
    ),
    max_size=120,
)


def apply(m: Any, op: str, key: int, value: Any) -> Any:
    """One operation's answer, an exception's type standing for it."""
    try:
        if op == "set":
            m[key] = value
            return None
        if op == "del":
            del m[key]
            return None
        if op == "pop":
            return m.pop(key)
        if op == "pop_default":
            return m.pop(key, "absent")
        if op == "get":
            return (m.get(key), m.get(key, "absent"))
        if op == "in":
            return key in m
        if op == "front":
            return m.front(key % 5)
        return (m.first_value(),) if len(m) else (m.last_key(),)
    except KeyError:
        return KeyError


def snapshot(m: Any) -> tuple[Any, ...]:
    return (len(m), list(m), list(m.keys()), list(m.values()), list(m.items()))


@needs_c
@settings(max_examples=400, deadline=None)
@given(OPS)
def test_the_c_map_answers_as_the_dict_does(ops: list[tuple[str, int, Any]]) -> None:
    c, py = _c()(), PyBlockMap[Any]()
    for op, key, value in ops:
        assert apply(c, op, key, value) == apply(py, op, key, value), (op, key)
        assert snapshot(c) == snapshot(py)
        if len(py):
            assert (c.first_value(), c.last_key()) == (py.first_value(), py.last_key())


@pytest.mark.parametrize("kind", ["python", pytest.param("c", marks=needs_c)])
def test_an_lru_churn_keeps_the_dicts_order_through_growth_and_compaction(kind: str) -> None:
    """The index's own pattern, long enough to grow, compact and start over many times: new
    blocks at the back, touched ones moved back, the front trimmed past a bound, everything
    dropped at once now and then."""
    m = _c()() if kind == "c" else PyBlockMap[float]()
    ref: dict[int, float] = {}
    rng = random.Random(7)
    for step in range(60_000):
        key = rng.getrandbits(64) if rng.random() < 0.6 else rng.randrange(3000)
        if ref.pop(key, None) is not None:
            assert m.pop(key) is not None
        ref[key] = m_value = float(step)
        m[key] = m_value
        bound = 2000 if step < 40_000 else 300
        if len(ref) > bound:
            gone = m.front(len(ref) - bound)
            assert gone == list(ref)[: len(gone)]
            for k in gone:
                del m[k], ref[k]
        if step % 9_000 == 8_999:
            for k in list(ref):
                del m[k], ref[k]
    assert list(m.items()) == list(ref.items())
    assert len(m) == len(ref) and m.first_value() == next(iter(ref.values()))


def test_the_fallback_is_a_dict_with_the_ends_read_without_an_iterator() -> None:
    m = PyBlockMap[float]()
    with pytest.raises(KeyError):
        m.first_value()
    with pytest.raises(KeyError):
        m.last_key()
    m[3], m[1], m[2] = 0.3, 0.1, 0.2
    m[3] = 0.4  # an existing key keeps its place
    assert (m.front(2), m.front(-1), m.front(9)) == ([3, 1], [], [3, 1, 2])
    assert (m.first_value(), m.last_key()) == (0.4, 2)


@needs_c
def test_the_c_map_refuses_what_it_cannot_hold_and_finds_nothing_there() -> None:
    m = _c()()
    for big in (2**64, -(2**63) - 1):
        with pytest.raises(OverflowError):
            m[big] = 1.0
        assert big not in m and m.get(big, "absent") == "absent" and m.pop(big, 0) == 0
        with pytest.raises(KeyError):
            m[big]
    with pytest.raises(TypeError):
        m["a"] = 1.0
    assert "a" not in m and m.get("a") is None and m.pop("a", 0) == 0
    with pytest.raises(KeyError):  # as a dict of int keys answers
        m["a"]
    with pytest.raises(KeyError):
        del m[2**64]
    with pytest.raises(TypeError):
        m[1] = [1]  # a container could refer back to the map, out of the collector's sight
    with pytest.raises(TypeError):
        m.get(1, 2, 3)
    with pytest.raises(TypeError):
        _c()({1: 2.0})
    with pytest.raises(TypeError):
        hash(m)
    assert len(m) == 0 and repr(m) == "<BlockMap of 0 entries>"


@needs_c
def test_the_c_map_gives_its_values_back() -> None:
    value = float("1.5")  # an object of its own, counted
    base = sys.getrefcount(value)
    m = _c()()
    for k in range(5000):
        m[k] = value
    m[0] = value  # replaced by itself
    for k in range(0, 5000, 2):
        del m[k]
    assert m.pop(1) is value and m.get(3) is value
    assert sys.getrefcount(value) == base + 2499  # 5,000 less 2,500 deleted, 1 popped
    m.clear()
    assert sys.getrefcount(value) == base and len(m) == 0
    for k in range(100):
        m[k] = value
    del m
    gc.collect()
    assert sys.getrefcount(value) == base


@needs_c
def test_an_entry_costs_a_few_words_not_a_dict_entry_and_an_int() -> None:
    m, d = _c()(), PyBlockMap[None]()
    for k in range(2**63, 2**63 + 100_000):  # 64-bit hashes: 36-byte int objects in a dict
        m[k] = None
        d[k] = None
    per_c = m.__sizeof__() / len(m)
    per_dict = (sys.getsizeof(d) + sum(sys.getsizeof(k) for k in d)) / len(d)
    assert per_c <= 40 < per_dict


@needs_c
def test_a_map_that_shrank_gives_its_room_back_as_it_fills_again() -> None:
    """The capacity learner lowers a backend's bound (32,768 blocks by default) to what its
    engine holds: the trimmed map's arrays shrink at their next rebuild."""
    m = _c()()
    for k in range(32_768):
        m[k] = 1.0
    full = m.__sizeof__()
    for k in m.front(32_768 - 1_000):
        del m[k]
    for k in range(10**6, 10**6 + 20_000):  # the LRU's churn at its new bound
        m[k] = 1.0
        del m[m.front(1)[0]]
    assert len(m) == 1_000 and m.__sizeof__() < full / 8
    assert m.front(2) == [10**6 + 19_000, 10**6 + 19_001]


def test_the_index_uses_the_map_the_install_chose() -> None:
    want = "python" if proxy.hot_path()["implementation"] == "pure" else "c"
    assert blockmap.implementation == want
    assert blockmap.KEEPS_KEY_OBJECTS == (want == "python")
