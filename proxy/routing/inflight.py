"""In-flight requests per backend, counted locally and shared across proxy replicas via Redis.

The hot path never touches Redis: ``acquire``/``release`` change a local counter and ``get``
returns local + the peers' last published counts. A background task publishes this replica's
counts and reads the peers' in one script call every ``sync_interval_s``. Peers are known by a
heartbeat; a replica that crashed stops heartbeating and its counts are dropped after ``ttl_s``,
so a dead replica's requests never haunt the load picture.

Redis counts as down as the prefix index judges it (proxy/routing/index_redis.py): a refused or
dropped connection at once, a timeout only when it repeats (TimeoutStreak), since a loaded
event loop makes a healthy Redis time out too, and a board that flapped to local counts on
every slow sync would route on half the load picture.

Redis layout (one hash tag, so one script touches one slot under Cluster)::

    {key_prefix}:{{key_prefix}:load}:inflight   HASH  "<replica>|<backend>" -> count
    {key_prefix}:{{key_prefix}:load}:replicas   ZSET  replica -> last heartbeat (unix ms)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from itertools import repeat
from operator import add
from typing import Any

from proxy.routing.index import (
    REDIS_DOWN_ERRORS,
    TIMEOUT_ERRORS,
    TimeoutStreak,
    _reraise_if_cancelled,
    stop_task,
)
from proxy.routing.types import Changes

log = logging.getLogger("warmroute.routing.inflight")

# KEYS[1]: counts hash, KEYS[2]: heartbeat zset. ARGV: replica, now_ms, ttl_ms, the number of
# backends this replica forgot (their fields go first), those backends, then backend/count
# pairs of this replica. Returns the other live replicas' totals, flattened.
SYNC_LUA = """
local rep, now, ttl, gone = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('ZADD', KEYS[2], now, rep)
local dead = {}
for _, r in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl)) do dead[r] = true end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl)
for i = 5, 4 + gone do redis.call('HDEL', KEYS[1], rep .. '|' .. ARGV[i]) end
for i = 5 + gone, #ARGV, 2 do redis.call('HSET', KEYS[1], rep .. '|' .. ARGV[i], ARGV[i + 1]) end
local all = redis.call('HGETALL', KEYS[1])
local totals = {}
for i = 1, #all, 2 do
  local field = all[i]
  local sep = string.find(field, '|', 1, true)
  local r = string.sub(field, 1, sep - 1)
  if dead[r] then
    redis.call('HDEL', KEYS[1], field)
  elseif r ~= rep then
    local b = string.sub(field, sep + 1)
    totals[b] = (totals[b] or 0) + tonumber(all[i + 1])
  end
end
redis.call('PEXPIRE', KEYS[1], ttl * 10)
redis.call('PEXPIRE', KEYS[2], ttl * 10)
local out = {}
for b, n in pairs(totals) do out[#out + 1] = b; out[#out + 1] = n end
return out
"""


class InflightBoard:
    """Local in-flight counts, plus (with a Redis client) the other replicas' counts."""

    def __init__(
        self,
        client: Any | None = None,
        key_prefix: str = "warmroute",
        replica_id: str | None = None,
        sync_interval_s: float = 0.2,
        ttl_s: float = 5.0,
        timeout_s: float = 0.25,
    ) -> None:
        self.client = client
        self.key_prefix = key_prefix
        # No "|": it separates replica from backend in the hash field.
        self.replica_id = (replica_id or uuid.uuid4().hex).replace("|", "_")
        self.sync_interval_s = sync_interval_s
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.local: Counter[str] = Counter()
        self.peers: dict[str, int] = {}
        # Whose count moved since the ViewCache last read them (routing.types.Changes).
        self.changes = Changes()
        # Backends forgotten here whose field in the shared hash the next sync deletes (each
        # replica writes only its own fields, so each deletes only its own: once).
        self.forgotten: set[str] = set()
        self._script = client.register_script(SYNC_LUA) if client is not None else None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._up = True
        self._timeouts = TimeoutStreak()
        self.clock = time.time  # wall clock: heartbeats are compared across hosts
        self.synced_at = 0.0
        self.counters = {"syncs": 0, "sync_errors": 0, "sync_timeouts": 0}

    @property
    def keys(self) -> list[str]:
        kp = self.key_prefix
        tag = f"{kp}:{{{kp}:load}}"
        return [f"{tag}:inflight", f"{tag}:replicas"]

    # -- hot path ----------------------------------------------------------------------------

    def acquire(self, backend: str) -> None:
        self.local[backend] += 1
        self.changes.mark(backend)

    def release(self, backend: str) -> None:
        if self.local[backend] > 0:
            self.local[backend] -= 1
            self.changes.mark(backend)

    def get(self, backend: str) -> int:
        """Requests open on `backend` across all live replicas (peers as of the last sync)."""
        return self.local[backend] + self.peers.get(backend, 0)

    def counts(self, backends: Sequence[str]) -> list[int]:
        """get() for each of `backends`, in C-level passes (read for the whole fleet per
        request)."""
        n = len(backends)
        mine = map(self.local.get, backends, repeat(0, n))
        return list(map(add, mine, map(self.peers.get, backends, repeat(0, n))))

    def forget(self, backend: str) -> None:
        """`backend` left the fleet: its count goes here at once (a request still open there
        releases into nothing), and this replica's field for it from Redis at the next sync.
        The peers' counts for it go too; each peer deletes its own field when it forgets."""
        self.local.pop(backend, None)
        self.peers.pop(backend, None)
        self.changes.mark(backend)
        if self.client is not None:
            self.forgotten.add(backend)

    def snapshot(self) -> dict[str, int]:
        names = set(self.local) | set(self.peers)
        return {b: self.get(b) for b in sorted(names)}

    # -- background --------------------------------------------------------------------------

    async def start(self) -> None:
        if self._script is not None and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="inflight-sync")

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            await stop_task(self._task)
            self._task = None
        if self.client is not None:
            # Leave at once rather than after ttl_s: peers stop counting our requests.
            fields = [f"{self.replica_id}|{b}" for b in {*self.local, *self.forgotten}]
            with contextlib.suppress(*REDIS_DOWN_ERRORS):
                async with asyncio.timeout(self.timeout_s):
                    await self.client.zrem(self.keys[1], self.replica_id)
                    if fields:
                        await self.client.hdel(self.keys[0], *fields)

    async def purge(self) -> None:
        """Delete this replica's fields of the forgotten backends now. The next sync deletes
        them again before it forgets them: a sync that was under way when the backend was
        forgotten may have written its count back. Redis down: they wait for a sync that
        works, which logs the outage."""
        if self.client is None or not self.forgotten:
            return
        fields = [f"{self.replica_id}|{b}" for b in self.forgotten]
        with contextlib.suppress(*REDIS_DOWN_ERRORS):
            async with asyncio.timeout(self.timeout_s):
                await self.client.hdel(self.keys[0], *fields)

    async def sync(self) -> None:
        """Publish this replica's counts and read the peers' (one round trip)."""
        if self._script is None:
            return
        gone = list(self.forgotten)
        args: list[Any] = [self.replica_id, int(self.clock() * 1000), int(self.ttl_s * 1000)]
        args += [len(gone), *gone]
        for backend, n in self.local.items():
            args += [backend, n]
        async with asyncio.timeout(self.timeout_s):
            flat = await self._script(keys=self.keys, args=args)
        self.forgotten.difference_update(gone)
        self._set_peers(
            {
                (k.decode() if isinstance(k, bytes) else str(k)): int(v)
                for k, v in zip(flat[::2], flat[1::2], strict=True)
            }
        )
        self.synced_at = time.monotonic()
        self.counters["syncs"] += 1

    def _set_peers(self, peers: dict[str, int]) -> None:
        """The other replicas' counts, marking those that moved."""
        old, mark = self.peers, self.changes.mark
        for b in old.keys() | peers.keys():
            if old.get(b) != peers.get(b):
                mark(b)
        self.peers = peers

    async def _loop(self) -> None:
        while not self._closed:
            await self.step()
            await asyncio.sleep(self.sync_interval_s)

    async def step(self) -> None:
        """One sync, and what its outcome says about Redis (the background loop's round)."""
        ticket = self._timeouts.start()
        try:
            await self.sync()
        except REDIS_DOWN_ERRORS as e:
            _reraise_if_cancelled()
            self.counters["sync_errors"] += 1
            down = True
            if isinstance(e, TIMEOUT_ERRORS):
                self.counters["sync_timeouts"] += 1
                down = self._timeouts.timed_out(ticket)
                if not down:
                    log.debug("in-flight board: a sync timed out (%s); not yet an outage", e)
            if down and self._up:
                self._up = False
                log.warning(
                    "in-flight board: Redis unavailable (%s: %s); local counts only",
                    type(e).__name__,
                    e,
                )
            # Peers' counts go stale quickly; routing on our own counts is the safe side.
            if time.monotonic() - self.synced_at > self.ttl_s:
                self._set_peers({})
            return
        self._timeouts.answered()
        if not self._up:
            self._up = True
            log.warning("in-flight board: Redis is back; sharing counts again")

    def info(self) -> dict[str, Any]:
        mode = "local" if self.client is None else ("redis" if self._up else "local-fallback")
        return {
            "mode": mode,
            "replica": self.replica_id,
            "inflight": self.snapshot(),
            **self.counters,
        }
