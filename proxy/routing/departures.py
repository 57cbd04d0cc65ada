"""What replicas sharing Redis keep about a backend that left the fleet (or came back as a new,
cold engine) is deleted there once, by whichever replica gets to it first.

Every replica sees the fleet change (its own reconciler, its own DNS or Kubernetes watch) at
about the same time, and each one forgets the backend locally. Left alone, each would then
delete the backend's shared keys too, and a replica that saw the change late would delete what
the others had already written for the engine that took the address since. So the deletion
runs in one script behind a guard key, set NX with a TTL, per (backend, departure): the first
replica deletes, the others find the guard and skip. The departure is a token the caller passes
when every replica knows the same one (a pod's UID, a restart's time); without one the guard
stands for `GUARD_S`, longer than replicas' views of one change drift apart, and a second
departure inside it leaves the keys to their TTL (a lookup only reads backends in the fleet).

A deletion that Redis could not take (down, too slow) stays queued and is retried by the
owner's background loop: nothing here raises into the request path or the reconciler.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

GUARD_S = 120.0
MAX_PENDING = 4096  # backends waiting for their deletion (a fleet churning through an outage)

# KEYS[1]: the guard; KEYS[2..]: the departed backend's keys. ARGV[1]: guard TTL (ms). Returns
# how many keys were deleted, or -1 when another replica already did it for this departure.
DELETE_ONCE_LUA = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1]) then return -1 end
local n = 0
for i = 2, #KEYS do n = n + redis.call('DEL', KEYS[i]) end
return n
"""


def guard_key(tag: str, backend: str, departure: str) -> str:
    """The guard of one departure, under the caller's hash tag (`tag` ends in its `}`) so that
    one script touches one Cluster slot. `!` keeps it apart from the per-backend keys, which
    are `tag:backend`."""
    return f"{tag}!departed:{departure}:{backend}"


class Departures:
    """Backends whose shared keys wait to be deleted, in the order they left (bounded)."""

    def __init__(self, limit: int = MAX_PENDING, guard_s: float = GUARD_S) -> None:
        self.limit = limit
        self.guard_s = guard_s  # how long one departure's guard stands without a token
        self._running = asyncio.Lock()
        self.pending: dict[str, str] = {}  # backend -> departure token
        self.deleted = 0  # departures this replica deleted
        self.skipped = 0  # departures another replica had deleted first

    def __bool__(self) -> bool:
        return bool(self.pending)

    def info(self) -> dict[str, int]:
        return {"pending": len(self.pending), "deleted": self.deleted, "skipped": self.skipped}

    def add(self, backend: str, departure: str = "") -> None:
        self.pending.pop(backend, None)  # re-added: its newest departure, last in line
        self.pending[backend] = departure
        while len(self.pending) > self.limit:
            # The oldest waited longest; its keys expire on their own TTL.
            del self.pending[next(iter(self.pending))]

    async def run(self, delete: Callable[[str, str], Awaitable[bool]]) -> None:
        """`delete(backend, departure)` each pending departure (True: this replica deleted,
        False: another had); one that raises is pending again, with those after it. One run
        at a time: a caller that finds one going waits for it, so that when its call returns
        the deletions queued before it are done (or failed), not merely begun elsewhere."""
        async with self._running:
            while self.pending:
                backend, departure = next(iter(self.pending.items()))
                del self.pending[backend]
                try:
                    mine = await delete(backend, departure)
                except BaseException:
                    if backend not in self.pending:  # first in line again
                        self.pending = {backend: departure, **self.pending}
                    raise
                if mine:
                    self.deleted += 1
                else:
                    self.skipped += 1
