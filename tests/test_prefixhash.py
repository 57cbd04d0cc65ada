"""A prompt's chain of block hashes in C: the xxhash package's hashes, to the bit.

proxy/_prefixhash.c is built with the compiled hot path and writes XXH3-64 out for inputs of
up to 240 bytes; proxy/routing/prefix.py's chain_bytes_py (through the xxhash package) is its
contract and the pure fallback. Replicas of different builds share one prefix index, and a
KV-event view keys blocks with the same chain: a single differing hash would split the index.
Here the two are compared on every input length the C hash takes, many seeds, and generated
prompts; tests/test_hot_path.py runs this file again on the pure Python.
"""

from __future__ import annotations

import importlib.util
import random
from array import array

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.routing import prefix
from proxy.routing.prefix import chain_bytes, chain_bytes_py, chain_text, chain_tokens, seed

BUILT = importlib.util.find_spec("proxy._prefixhash") is not None
needs_c = pytest.mark.skipif(not BUILT, reason="proxy._prefixhash is not built (a pure install)")
SEEDS = (0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1)


def _c():  # type: ignore[no-untyped-def]
    import proxy._prefixhash as c

    return c


@needs_c
def test_every_length_the_c_hash_takes_is_the_packages_hash() -> None:
    """Each of XXH3's length classes (0, 1-3, 4-8, 9-16, 17-128, 129-240) and each boundary,
    with seeds at the edges of 32 and 64 bits and random ones."""
    c = _c()
    rng = random.Random(7)
    for length in range(c.MAX_BLOCK + 1):
        for trial in range(24):
            data = rng.randbytes(length)
            s = SEEDS[trial] if trial < len(SEEDS) else rng.getrandbits(64)
            assert c.xxh3_64(data, s) == xxhash.xxh3_64_intdigest(data, s), (length, s)
    top = 2**64 - 1
    assert c.xxh3_64(b"\xff" * 240, top) == xxhash.xxh3_64_intdigest(b"\xff" * 240, top)
    with pytest.raises(ValueError, match="240"):
        c.xxh3_64(bytes(241), 0)


@needs_c
@settings(max_examples=300, deadline=None)
@given(
    h0=st.integers(0, 2**64 - 1),
    data=st.binary(max_size=1200),
    block=st.integers(1, 240),
    most=st.integers(0, 40),
)
def test_the_chain_is_the_python_chain(h0: int, data: bytes, block: int, most: int) -> None:
    assert _c().chain(h0, data, block, most) == chain_bytes_py(h0, data, block, most)


@needs_c
def test_a_prompt_tokens_and_text_hash_alike_in_both() -> None:
    """What routing hashes: a 2k-token prompt in 64-character blocks, token ids in 16-token
    blocks of 128 bytes, a non-ASCII text (its own Python path, whose blocks may pass 240
    bytes: hashed by the package) and the block cap."""
    c = _c()
    h0 = seed("model", "salt")
    text = ("You are a careful assistant. Answer in French. " * 200)[:8000]
    assert c.chain(h0, text.encode(), 64, 4096) == chain_bytes_py(h0, text.encode(), 64, 4096)
    assert len(chain_text(h0, text, 64, 4096)) == 125
    ids = list(range(-5, 2000))
    packed_blocks = chain_tokens(h0, ids, 16, 4096)
    assert packed_blocks == chain_bytes_py(h0, array("q", ids).tobytes(), 128, 4096)
    assert chain_bytes(h0, text.encode(), 64, 10) == chain_bytes_py(h0, text.encode(), 64, 10)


@needs_c
def test_a_block_over_240_bytes_is_left_to_python() -> None:
    c = _c()
    data = bytes(range(256)) * 8
    assert c.chain(1, data, 241, 100) is None
    assert chain_bytes(1, data, 241, 100) == chain_bytes_py(1, data, 241, 100)  # hashed in Python
    assert len(chain_bytes(1, data, 241, 100)) == len(data) // 241


@needs_c
def test_bad_arguments_are_errors_not_crashes() -> None:
    c = _c()
    with pytest.raises(ValueError):
        c.chain(0, b"abc", 0, 10)
    with pytest.raises(OverflowError):
        c.chain(-1, b"abc", 1, 10)
    with pytest.raises(TypeError):
        c.chain(0, "text", 1, 10)
    with pytest.raises(TypeError):
        c.chain(0, b"abc", 1)
    assert c.chain(0, b"abc", 1, -3) == []
    assert c.chain(5, memoryview(b"abcdef"), 2, 9) == chain_bytes_py(5, b"abcdef", 2, 9)


def test_chain_bytes_uses_the_c_chain_exactly_where_the_compiled_path_runs() -> None:
    import proxy

    compiled = proxy.hot_path()["implementation"] == "compiled"
    assert (prefix._chain_c is not None) == (compiled and BUILT)
    h0 = seed("m")
    data = b"x" * 1000
    assert chain_bytes(h0, data, 64, 4096) == chain_bytes_py(h0, data, 64, 4096)
    assert chain_bytes(h0, data[:63], 64, 4096) == []  # a partial block is not hashed
