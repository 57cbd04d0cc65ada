"""What structured concurrency costs per request: the disconnect watcher as a bare asyncio
task vs an anyio task group (the two ways the forwarder could run it).

    python deploy/perf/anyio_cost.py [requests]

Each "request" starts a watcher that waits forever, yields once, and stops it, as the
forwarder does around every request. Prints microseconds per request for each way, twice,
interleaved (this machine is shared; compare within a run).
"""

from __future__ import annotations

import asyncio
import sys
import time

import anyio


async def _forever() -> None:
    await asyncio.Event().wait()


async def bare_task(n: int) -> float:
    loop = asyncio.get_running_loop()
    t = time.perf_counter()
    for _ in range(n):
        task = loop.create_task(_forever())
        await asyncio.sleep(0)
        task.cancel()
    return (time.perf_counter() - t) / n


async def task_group(n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_forever)
            await asyncio.sleep(0)
            tg.cancel_scope.cancel()
    return (time.perf_counter() - t) / n


async def main(n: int) -> None:
    for way in (bare_task, task_group, bare_task, task_group):
        print(f"{way.__name__:>10}: {await way(n) * 1e6:7.1f} µs per request")


if __name__ == "__main__":
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20000))
