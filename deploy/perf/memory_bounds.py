"""What the proxy's bounded per-backend structures hold once full, measured with tracemalloc.

    python deploy/perf/memory_bounds.py            # a few seconds
    python deploy/perf/memory_bounds.py --json /tmp/memory.json

A replica's memory grows with its fleet: the prefix index keeps up to `capacity_blocks` block
hashes per backend (and as many recently trimmed ones, to learn a capacity set too small), and
the doctor keeps the last 2,000 finished requests per (backend, model) with their inter-token
gaps (all windows' gaps within one budget). This fills each to its bound with the classes the
proxy runs and prints the Python heap each holds: the numbers to size a container's memory
limit by (docs/deployment.md, *Memory*). The interpreter, libraries and buffers of in-flight
streams come on top (about 65 MB at start, see the soak in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tracemalloc
from collections.abc import Callable
from typing import Any, TypeVar

from proxy.doctor.collector import MAX_REQUESTS, BackendInfo, Collector
from proxy.routing.index_memory import DEFAULT_CAPACITY_BLOCKS, MemoryPrefixIndex
from proxy.types import StreamFacts

T = TypeVar("T")


def heap_mb(build: Callable[[], T]) -> tuple[float, T]:
    """Python heap held by what `build` returns (it is kept alive while measuring)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = build()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / 1e6, kept


def full_index(
    capacity: int, seed: int = 1, backends: int = 1, trimmed: bool = True
) -> MemoryPrefixIndex:
    """`backends` backends' index, each with `capacity` live blocks no other holds (the worst
    case) and, if `trimmed`, as many trimmed ones. Block hashes are 64-bit, as the hasher's."""
    rng = random.Random(seed)
    index = MemoryPrefixIndex(capacity_blocks=capacity, clock=lambda: 0.0)
    for name in [f"b{i}" for i in range(backends)]:
        recorded = 0
        while recorded < (3 if trimmed else 1) * capacity:  # prompts of 16 blocks
            index.record_now(name, [rng.getrandbits(64) for _ in range(16)], now=float(recorded))
            recorded += 16
    return index


def shared_index(backends: int, capacity: int, seed: int = 1) -> MemoryPrefixIndex:
    """`backends` backends that all hold the same `capacity` blocks (prompts every engine
    serves), none trimmed. Each backend's copy comes from its own request, as in the proxy:
    the same hash values in int objects of their own (each request hashes its prompt)."""
    rng = random.Random(seed)
    index = MemoryPrefixIndex(capacity_blocks=capacity, clock=lambda: 0.0)
    names = [f"b{i}" for i in range(backends)]
    for n in range(0, capacity, 16):
        prompt = [rng.getrandbits(63) for _ in range(16)]
        for name in names:
            hashed = [int.from_bytes(h.to_bytes(8, "little"), "little") for h in prompt]
            index.record_now(name, hashed, now=float(n))
    return index


def stream(tokens: int) -> StreamFacts:
    gaps = [0.01] * (tokens - 1)
    return StreamFacts(
        ttft_s=0.2, upstream_ttft_s=0.19, itl_s=gaps, tpot_s=0.01, e2e_s=0.2 + sum(gaps),
        chunks=tokens, events=tokens + 2, output_tokens=tokens, input_tokens=2000,
        cached_tokens=1500, finish_reasons=["stop"], response_id="r", response_model="m",
        error=None, cancelled=False, first_output_at=10.0, last_output_at=10.0 + sum(gaps),
    )  # fmt: skip


def full_windows(backends: int, tokens: int) -> Collector:
    """The doctor's windows for `backends` backends of one model, each full of streams."""
    names = [f"b{i}" for i in range(backends)]
    collector = Collector([BackendInfo(n) for n in names])
    facts = stream(tokens)
    for n in names:  # every window exists before they fill, as in a running fleet
        collector.finished("m", n, facts, None, None, 0.0)
    for i in range(MAX_REQUESTS):
        for n in names:
            collector.finished("m", n, facts, None, None, float(i))
    return collector


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []

    mb, index = heap_mb(lambda: full_index(DEFAULT_CAPACITY_BLOCKS))
    live, ghosts = index.occupancy("b0"), len(index._ghost["b0"])
    rows.append(
        {
            "what": f"prefix index, 1 backend ({live:,} blocks + {ghosts:,} trimmed;"
            f" {mb * 1e6 / live:.0f} B a block)",
            "mb": mb,
        }
    )
    mb, index = heap_mb(lambda: full_index(DEFAULT_CAPACITY_BLOCKS, trimmed=False))
    live = index.occupancy("b0")
    rows.append(
        {
            "what": f"prefix index, 1 backend ({live:,} blocks, none trimmed;"
            f" {mb * 1e6 / live:.0f} B a block)",
            "mb": mb,
        }
    )
    many = 64
    mb, index = heap_mb(lambda: full_index(4096, backends=many, trimmed=False))
    live = sum(index.occupancy(b) for b in index.backends())
    rows.append(
        {
            "what": f"prefix index, {many} backends of {live // many:,} blocks, none shared or"
            f" trimmed ({mb * 1e6 / live:.0f} B a (block, backend) entry)",
            "mb": mb,
        }
    )
    fleet = 16
    mb, index = heap_mb(lambda: shared_index(fleet, DEFAULT_CAPACITY_BLOCKS))
    entries = sum(index.occupancy(b) for b in index.backends())
    rows.append(
        {
            "what": f"prefix index, {fleet} backends holding the same {entries // fleet:,} blocks"
            f" ({mb * 1e6 / entries:.0f} B a (block, backend) entry)",
            "mb": mb,
        }
    )
    for backends, tokens in ((1, 128), (1, 4096), (4, 4096), (16, 4096)):
        mb, c = heap_mb(lambda: full_windows(backends, tokens))  # noqa: B023 (called at once)
        rows.append(
            {
                "what": f"doctor windows, {backends} backend(s) x {MAX_REQUESTS:,} streams of"
                f" {tokens:,} tokens ({c.gaps_per_stream:,} gaps kept at most)",
                "mb": mb,
            }
        )
    width = max(len(r["what"]) for r in rows)
    for r in rows:
        print(f"{r['what']:<{width}}  {r['mb']:6.1f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
