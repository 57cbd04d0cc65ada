"""What a long-running process of ours does with the garbage collector (a leaf: the proxy, the
bench mock and the load generator use it; it imports nothing of the proxy).

A full collection walks every live container object, and while it runs nothing else on the
event loop does: each stream in flight pauses. Imports, telemetry and a load generator's
plan make a large heap that lives as long as the process, and rescanning it is most of what
a full collection costs. Frozen (gc.freeze), it is left out of every scan.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

# Young-generation collections start after this many more container allocations than
# frees (CPython's default is 700). Each one walks every live young object, and at c=64 the
# open requests' objects alone made that ~0.4 ms: one every ~30 requests, ~14 µs of CPU a
# request and a pause in every open stream. Requests free what they allocate by reference
# counting (tests/test_telemetry.py checks telemetry's share), so at 10,000 the collector
# runs when something really accumulates.
GC_YOUNG_THRESHOLD = 10_000


def freeze_startup_heap() -> None:
    """Move everything built at startup out of the GC's reach, and collect the young
    generation rarely (for a server, once it is built and before it serves).

    In the proxy: OpenTelemetry, Prometheus and the imports; measured ~90 µs of GC per request
    with metrics on, ~58 µs after freezing (docs/telemetry-overhead.md). In the bench mock,
    a full collection of its startup heap took 12-23 ms, a pause in every engine's streams
    that read as the proxy's latency (docs/deployment.md).
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


@contextlib.contextmanager
def still_heap() -> Iterator[None]:
    """For a bounded stretch of work (a load generator's run): what exists before it is kept
    out of the full collections made during it, and given back to them after (so that what
    the stretch leaves behind can still be freed). `warmroute bench` against one proxy had
    two or three full collections of 10-27 ms in a run of 8,000 requests, each a pause in
    every request in flight that read as the server's latency. Both steps are O(1): no
    collection is made here. In a process that froze its heap already (a server's startup),
    what was frozen stays so."""
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()
