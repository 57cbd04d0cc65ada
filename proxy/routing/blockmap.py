"""The prefix index's tables: insertion-ordered maps from block hashes to small values.

proxy/routing/index_memory.py keeps three kinds: per backend, its blocks in least recently used
order (hash -> when last recorded) and the blocks it trimmed lately (hash -> None), and for
the whole fleet every block's holders (hash -> a bitmask of slots). They hold one entry per
(block, backend), so they are what a replica's memory grows with as the fleet does.

`BlockMap` is proxy/_blockmap.c's type where the compiled hot path runs: an entry is a machine
word for the key and a pointer for the value, about 30 bytes with its share of the index,
against ~85 for a dict entry and the int object of its key (deploy/perf/memory_bounds.py).
Elsewhere it is `PyBlockMap`, a dict, which is also the contract:

- keys are ints in [-2**63, 2**64) (block hashes are unsigned 64-bit); values are ints,
  floats or None, which hold no references (so the C type stays out of garbage collection);
- every dict operation the index uses behaves as a dict's: `m[k]`, `m[k] = v` (a new key goes
  to the back; an existing one keeps its place), `del m[k]`, `get`, `pop`, `in`, `len`,
  iteration in insertion order; `keys()`, `values()` and `items()` are lists in the C type;
- `front(n)`: the first n keys; `first_value()`: the first key's value; `last_key()`: the
  last key (KeyError when empty), so the index reads the ends of its LRU order without an
  iterator.

tests/test_blockmap.py runs the two side by side on generated operation sequences.
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING, TypeVar

import proxy

V = TypeVar("V", int, float, None)


class PyBlockMap(dict[int, V]):
    """The contract, and the fallback where the C type is not built."""

    __slots__ = ()

    def front(self, n: int) -> list[int]:
        return list(islice(self, max(0, n)))

    def first_value(self) -> V:
        for value in self.values():
            return value
        raise KeyError("first_value(): the map is empty")

    def last_key(self) -> int:
        for key in reversed(self):
            return key
        raise KeyError("last_key(): the map is empty")


def _chosen() -> tuple[type, str]:
    native = proxy.native("proxy._blockmap")
    if native is None:
        return PyBlockMap, "python"
    return native.BlockMap, "c"


if TYPE_CHECKING:
    BlockMap = PyBlockMap
    implementation: str
else:
    BlockMap, implementation = _chosen()

# The dict keeps each key's int object (36-40 bytes); the index then shares one object per
# block among its holders. The C type keeps a key as a machine word: nothing to share.
KEEPS_KEY_OBJECTS = implementation == "python"
