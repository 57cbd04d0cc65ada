"""The prefix index: which block hashes each backend has recently seen (its likely KV cache).

Two stores behind one interface:

- ``MemoryPrefixIndex``: per-backend LRU of block hashes in this process (the default).
- ``RedisPrefixIndex``: the same state in Redis, shared by every proxy replica. One Lua call
  answers the longest match of all candidate backends (one round trip); recording is queued and
  written in batches by a background task. Every record also updates a local memory index, and
  any Redis error or a reply slower than ``timeout_s`` switches lookups to that local index
  (mode ``memory-fallback``) while a background task reconnects. A request never waits on Redis
  longer than ``timeout_s`` and never fails because of it.

Both stores evict the *tail* of a prompt first (later blocks carry older timestamps), like an
engine's LRU does: a chain hash whose predecessors were evicted would be a lie.

Redis layout (Cluster-safe: every key of one index carries the same hash tag, so the one lookup
script touches one slot)::

    {key_prefix}:{{key_prefix}:pfx}:{backend}   ZSET  member = 8-byte block hash,
                                                       score = last seen (s since SCORE_EPOCH)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol
from urllib.parse import parse_qs, unquote, urlsplit

from redis import exceptions as redis_errors

log = logging.getLogger("warmroute.routing.index")

DEFAULT_CAPACITY_BLOCKS = 32768  # ~2M chars ≈ 500k tokens: an 80 GB GPU's KV pool for an 8B model
DEFAULT_TTL_S = 1800.0
GHOST_MIN = 1024  # trimmed blocks remembered per backend, at least
# Scores are seconds since this epoch, not since 1970: near 6e7 a double still resolves 1e-8 s,
# fine enough to give each block of a prompt its own, slightly older, score (see _flush).
SCORE_EPOCH = 1_700_000_000.0
BLOCK_STEP_S = 1e-7
# Errors that mean "Redis is not answering properly"; anything else is a bug and propagates.
REDIS_DOWN_ERRORS: tuple[type[BaseException], ...] = (
    redis_errors.RedisError,
    OSError,
    TimeoutError,
    asyncio.TimeoutError,
)


def _reraise_if_cancelled() -> None:
    """Call in an `except` of Redis errors: a cancel that arrived while a Redis call timed out
    can surface as TimeoutError; swallowing it would leave a task that never stops."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def stop_task(task: asyncio.Task[Any], grace_s: float = 1.0) -> None:
    """Cancel a background task and wait for it, but never hang shutdown on it."""
    task.cancel()
    await asyncio.wait({task}, timeout=grace_s)


def capacity_blocks_from_tokens(
    kv_tokens: int, block_chars: int, chars_per_token: float = 4.0
) -> int:
    """Turn an engine's KV pool size in tokens (num_gpu_blocks * block_size) into index blocks."""
    return max(1, int(kv_tokens * chars_per_token / block_chars))


class PrefixIndex(Protocol):
    """What the router needs from a prefix index store."""

    @property
    def mode(self) -> str:
        """ "memory", "redis" or "memory-fallback"."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def lookup(self, blocks: Sequence[int], backends: Sequence[str]) -> dict[str, int]:
        """Longest matched prefix, in blocks, of `blocks` on each backend."""
        ...

    def record(self, backend: str, blocks: Sequence[int]) -> None:
        """Note that `backend` now holds `blocks` (never blocks; writes may be deferred)."""
        ...

    def set_capacity(self, backend: str, blocks: int) -> None:
        """Bound the blocks kept for `backend` (learned from the engine's reports)."""
        ...

    def probe(self, backend: str, blocks: Sequence[int], matched: int) -> Probe:
        """Before `blocks` are recorded on `backend`: when its matched prefix was last seen
        there, and how far the prompt reaches into what the index holds or recently trimmed."""
        ...

    def occupancy(self, backend: str) -> int:
        """Blocks held for `backend` (this process's view)."""
        ...

    def info(self) -> dict[str, Any]:
        """Mode and counters for /health, /metrics and /admin."""
        ...


class Probe(NamedTuple):
    """What the capacity learner needs to know about a prefix before it is recorded again."""

    last_seen: float | None  # index clock time the matched prefix was last recorded
    ghost_blocks: int  # leading blocks held by the index or trimmed by it lately


class MemoryPrefixIndex:
    """Per-backend LRU of block hashes, bounded by capacity and aged by TTL.

    Blocks trimmed for lack of capacity are remembered for a while (a "ghost" list, as ARC
    keeps one): if the engine later reports them cached, the capacity was set too small.
    """

    def __init__(
        self,
        capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        ttl_s: float | None = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        touch_s: float = 1.0,
    ) -> None:
        self.default_capacity = capacity_blocks
        self.ttl_s = ttl_s
        self.touch_s = touch_s
        self.clock = clock
        self._lru: dict[str, OrderedDict[int, float]] = {}
        self._ghost: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}
        self.lookups = 0
        self.records = 0
        self.evictions = 0

    @property
    def mode(self) -> str:
        return "memory"

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def lookup(self, blocks: Sequence[int], backends: Sequence[str]) -> dict[str, int]:
        return self.lookup_now(blocks, backends)

    def lookup_now(self, blocks: Sequence[int], backends: Sequence[str]) -> dict[str, int]:
        self.lookups += 1
        oldest = self.clock() - self.ttl_s if self.ttl_s else float("-inf")
        return {b: self._match(self._lru.get(b), blocks, oldest) for b in backends}

    @staticmethod
    def _match(lru: OrderedDict[int, float] | None, blocks: Sequence[int], oldest: float) -> int:
        if not lru or not blocks:
            return 0
        # Binary search for the last present block: a chain hash implies its whole prefix, and
        # tails are evicted first, so presence is monotone along the chain. Most backends miss
        # the first block, so test it before searching.
        seen = lru.get(blocks[0])
        if seen is None or seen < oldest:
            return 0
        lo, hi = 1, len(blocks)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            seen = lru.get(blocks[mid - 1])
            if seen is not None and seen >= oldest:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def fresh_prefix(self, backend: str, blocks: Sequence[int], since: float) -> int:
        """Blocks of `blocks` this index saw on `backend` at or after `since`."""
        return self._match(self._lru.get(backend), blocks, since)

    def record(self, backend: str, blocks: Sequence[int]) -> None:
        self.record_now(backend, blocks)

    def record_now(self, backend: str, blocks: Sequence[int], now: float | None = None) -> None:
        if not blocks:
            return
        self.records += 1
        lru = self._lru.get(backend)
        if lru is None:
            lru = self._lru[backend] = OrderedDict()
        now = self.clock() if now is None else now
        # A hot prefix is recorded on every request; moving its hundreds of blocks each time was
        # the largest cost of a decision. Blocks touched within touch_s keep their place: LRU
        # order at one-second resolution is all an engine's cache estimate needs.
        fresh = self._match(lru, blocks, now - self.touch_s)
        # Reversed: the first block ends up most recently used, so eviction takes tails first.
        for h in reversed(blocks[fresh:]):
            lru.pop(h, None)
            lru[h] = now
        cap = self._capacity.get(backend, self.default_capacity)
        if len(lru) > cap:
            self._trim(backend, lru, cap)

    def _trim(self, backend: str, lru: OrderedDict[int, float], cap: int) -> None:
        ghost = self._ghost.get(backend)
        if ghost is None:
            ghost = self._ghost[backend] = OrderedDict()
        while len(lru) > cap:
            h, _ = lru.popitem(last=False)
            ghost[h] = None
            ghost.move_to_end(h)
            self.evictions += 1
        # As many ghosts as live blocks (at least GHOST_MIN): enough to see a capacity that is
        # up to twice too small in one observation.
        limit = max(cap, GHOST_MIN)
        while len(ghost) > limit:
            ghost.popitem(last=False)

    def set_capacity(self, backend: str, blocks: int) -> None:
        self._capacity[backend] = max(1, int(blocks))
        lru = self._lru.get(backend)
        if lru is not None and len(lru) > self._capacity[backend]:
            self._trim(backend, lru, self._capacity[backend])

    def capacity(self, backend: str) -> int:
        return self._capacity.get(backend, self.default_capacity)

    def probe(self, backend: str, blocks: Sequence[int], matched: int) -> Probe:
        lru = self._lru.get(backend)
        seen = (
            lru.get(blocks[matched - 1]) if lru is not None and 0 < matched <= len(blocks) else None
        )
        ghost = self._ghost.get(backend)
        if not ghost:
            return Probe(seen, matched)
        live: Mapping[int, Any] = lru if lru is not None else {}

        def held(i: int) -> bool:
            h = blocks[i - 1]
            return h in live or h in ghost

        # Presence along the chain is monotone in both (tails go first), so binary search.
        lo, hi = matched, len(blocks)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if held(mid):
                lo = mid
            else:
                hi = mid - 1
        return Probe(seen, lo)

    def occupancy(self, backend: str) -> int:
        return len(self._lru.get(backend, ()))

    def backends(self) -> list[str]:
        return list(self._lru)

    def entries(self, backend: str) -> list[tuple[int, float]]:
        """(block hash, last seen) from least to most recently used."""
        return list(self._lru.get(backend, {}).items())

    def size(self, backend: str) -> int:
        return len(self._lru.get(backend, ()))

    def info(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "lookups": self.lookups,
            "records": self.records,
            "evictions": self.evictions,
            "blocks": {b: len(lru) for b, lru in self._lru.items()},
            "capacity": dict(self._capacity),
            "default_capacity": self.default_capacity,
        }


# KEYS: one ZSET per candidate backend. ARGV[1]: the prompt's block hashes, 8 bytes each,
# packed into one string (one argument instead of hundreds); ARGV[2]: oldest score still valid.
# Returns the longest present prefix per key, found by binary search (see MemoryPrefixIndex).
LOOKUP_LUA = """
local blob = ARGV[1]
local oldest = tonumber(ARGV[2])
local n = math.floor(#blob / 8)
local out = {}
local function present(key, i)
  local s = redis.call('ZSCORE', key, string.sub(blob, (i - 1) * 8 + 1, i * 8))
  return s and tonumber(s) >= oldest
end
for k = 1, #KEYS do
  local key = KEYS[k]
  local lo = 0
  if n > 0 and present(key, 1) then
    lo = 1
    local hi = n
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if present(key, mid) then lo = mid else hi = mid - 1 end
    end
  end
  out[k] = lo
end
return out
"""


# Writes a batch of records in one call. KEYS: the backend ZSET of each record (all under one
# hash tag: one slot). ARGV[1..3]: score step per block, key TTL (ms), oldest score to keep; then
# per record: packed block hashes, record time, index of its first block in the prompt, capacity.
# Later blocks get slightly older scores so that trimming by rank drops a prompt's tail first.
# Scores are formatted with %.17g: Lua's default number-to-string keeps 14 digits, too few.
RECORD_LUA = """
local step, ttl, oldest = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local caps = {}
for j = 1, #KEYS do
  local base = 3 + (j - 1) * 4
  local blob, ts, first = ARGV[base + 1], tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  caps[KEYS[j]] = tonumber(ARGV[base + 4])
  local args = {}
  for i = 1, math.floor(#blob / 8) do
    args[#args + 1] = string.format('%.17g', ts - (first + i - 1) * step)
    args[#args + 1] = string.sub(blob, (i - 1) * 8 + 1, i * 8)
    if #args >= 512 then
      redis.call('ZADD', KEYS[j], unpack(args))
      args = {}
    end
  end
  if #args > 0 then redis.call('ZADD', KEYS[j], unpack(args)) end
end
for key, cap in pairs(caps) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', oldest)
  redis.call('ZREMRANGEBYRANK', key, 0, -cap - 1)
  redis.call('PEXPIRE', key, ttl)
end
return #KEYS
"""
RECORDS_PER_CALL = 64  # one call runs atomically in Redis: keep each one short


def _pack(blocks: Sequence[int]) -> bytes:
    return array("Q", blocks).tobytes()


async def _run(client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for name, *args in commands:
        getattr(pipe, name)(*args)
    return list(await pipe.execute())


class RedisPrefixIndex:
    """The prefix index in Redis, shared by proxy replicas, with a warm local fallback."""

    def __init__(
        self,
        client: Any,
        key_prefix: str = "warmroute",
        timeout_s: float = 0.05,
        capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        ttl_s: float = DEFAULT_TTL_S,
        flush_interval_s: float = 0.005,
        flush_items: int = 64,
        max_pending: int = 10_000,
        refresh_s: float = 2.0,
        reconnect_min_s: float = 0.1,
        reconnect_max_s: float = 5.0,
        owns_client: bool = False,
    ) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self.default_capacity = capacity_blocks
        self.flush_interval_s = flush_interval_s
        self.flush_items = flush_items
        self.reconnect_min_s = reconnect_min_s
        self.reconnect_max_s = reconnect_max_s
        self.owns_client = owns_client
        # Wall-clock scores: replicas on different hosts must agree on what "old" means.
        self.local = MemoryPrefixIndex(capacity_blocks, ttl_s, clock=time.time)
        self._capacity: dict[str, int] = {}
        self.refresh_s = refresh_s
        # (backend, blocks, time, index of the first block): only the part not written lately.
        self._pending: deque[tuple[str, Sequence[int], float, int]] = deque(maxlen=max_pending)
        self._script = client.register_script(LOOKUP_LUA)
        self._record_script = client.register_script(RECORD_LUA)
        self._up = True
        self._up_event = asyncio.Event()
        self._up_event.set()
        self._closed = False
        self._wake = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._reconnector: asyncio.Task[None] | None = None
        self.counters = {
            "lookups": 0,
            "fallback_lookups": 0,
            "lookup_errors": 0,
            "records": 0,
            "writes": 0,
            "write_errors": 0,
            "dropped_records": 0,
            "outages": 0,
            "reconnects": 0,
            "reseeded_backends": 0,
        }

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        return "redis" if self._up else "memory-fallback"

    async def start(self) -> None:
        # Load the script now so the first lookup is one round trip, not NOSCRIPT + load + call.
        try:
            async with asyncio.timeout(max(self.timeout_s * 20, 1.0)):
                await self.client.script_load(LOOKUP_LUA)
                await self.client.script_load(RECORD_LUA)
        except REDIS_DOWN_ERRORS as e:
            self._went_down(e)  # start anyway: a Redis outage must not stop the proxy
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_loop(), name="prefix-index-flush")

    async def wait_shared(self) -> None:
        """Return once lookups go to Redis (for readiness checks and tests)."""
        await self._up_event.wait()

    async def close(self) -> None:
        self._closed = True
        with contextlib.suppress(*REDIS_DOWN_ERRORS):
            await asyncio.wait_for(self._flush(), max(self.timeout_s * 10, 0.5))
        for task in (self._flusher, self._reconnector):
            if task is not None:
                await stop_task(task)
        if self.owns_client:
            with contextlib.suppress(*REDIS_DOWN_ERRORS):
                await self.client.aclose()

    def key(self, backend: str) -> str:
        kp = self.key_prefix
        return f"{kp}:{{{kp}:pfx}}:{backend}"

    # -- hot path ----------------------------------------------------------------------------

    async def lookup(self, blocks: Sequence[int], backends: Sequence[str]) -> dict[str, int]:
        if not blocks or not backends:
            return dict.fromkeys(backends, 0)
        if not self._up:
            self.counters["fallback_lookups"] += 1
            return self.local.lookup_now(blocks, backends)
        self.counters["lookups"] += 1
        oldest = time.time() - SCORE_EPOCH - self.ttl_s
        try:
            async with asyncio.timeout(self.timeout_s):
                found = await self._script(
                    keys=[self.key(b) for b in backends], args=[_pack(blocks), repr(oldest)]
                )
        except REDIS_DOWN_ERRORS as e:
            self.counters["lookup_errors"] += 1
            self._went_down(e)
            self.counters["fallback_lookups"] += 1
            return self.local.lookup_now(blocks, backends)
        return {b: int(n) for b, n in zip(backends, found, strict=True)}

    def record(self, backend: str, blocks: Sequence[int]) -> None:
        if not blocks:
            return
        self.counters["records"] += 1
        now = time.time()
        # A popular prefix is recorded on every request; rewriting its hundreds of blocks each
        # time is what made Redis (and our event loop) slow. Blocks this replica wrote less than
        # refresh_s ago are skipped: their Redis score lags by at most refresh_s, which is far
        # below any useful LRU resolution.
        skip = self.local.fresh_prefix(backend, blocks, now - self.refresh_s)
        # The local copy is always current, so a fallback starts warm.
        self.local.record_now(backend, blocks, now)
        if skip >= len(blocks):
            return
        if len(self._pending) == self._pending.maxlen:
            self.counters["dropped_records"] += 1  # deque drops the oldest on append
        self._pending.append((backend, blocks[skip:], now - SCORE_EPOCH, skip))
        self._wake.set()

    def set_capacity(self, backend: str, blocks: int) -> None:
        self._capacity[backend] = max(1, int(blocks))
        self.local.set_capacity(backend, blocks)

    def probe(self, backend: str, blocks: Sequence[int], matched: int) -> Probe:
        # The local copy holds what this replica recorded (wall-clock times, as Redis does).
        return self.local.probe(backend, blocks, matched)

    def occupancy(self, backend: str) -> int:
        return self.local.occupancy(backend)

    # -- background --------------------------------------------------------------------------

    async def flush(self) -> None:
        """Write everything recorded so far (for shutdown and for tests)."""
        await self._flush()

    async def _flush_loop(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            if len(self._pending) < self.flush_items:
                await asyncio.sleep(self.flush_interval_s)  # let a batch gather
            if self._up:
                try:
                    await self._flush()
                except REDIS_DOWN_ERRORS:
                    _reraise_if_cancelled()

    async def _flush(self) -> None:
        if not self._pending or not self._up:
            return
        batch = list(self._pending)
        self._pending.clear()
        # Redis unpacks and scores the blocks, so this loop (which shares the event loop with
        # every request) costs O(1) per record, not O(blocks). No pipeline: Cluster clients
        # refuse scripts in pipelines, and one call already carries up to RECORDS_PER_CALL.
        now = time.time() - SCORE_EPOCH
        head = [repr(BLOCK_STEP_S), int(self.ttl_s * 1000), repr(now - self.ttl_s)]
        done = 0
        try:
            async with asyncio.timeout(max(self.timeout_s * 20, 1.0)):
                for i in range(0, len(batch), RECORDS_PER_CALL):
                    chunk = batch[i : i + RECORDS_PER_CALL]
                    keys = [self.key(backend) for backend, _, _, _ in chunk]
                    args: list[Any] = list(head)
                    for backend, blocks, ts, first in chunk:
                        cap = self._capacity.get(backend, self.default_capacity)
                        args += [_pack(blocks), repr(ts), first, cap]
                    await self._record_script(keys=keys, args=args)
                    done = i + len(chunk)
            self.counters["writes"] += 1
        except REDIS_DOWN_ERRORS as e:
            self.counters["write_errors"] += 1
            # Keep what was not written for after the reconnect (bounded: the deque drops the
            # oldest).
            self._pending.extendleft(reversed(batch[done:]))
            self._went_down(e)
            raise

    def _went_down(self, err: BaseException) -> None:
        if self._closed:
            return
        if self._up:
            self._up = False
            self._up_event.clear()
            self.counters["outages"] += 1
            log.warning(
                "prefix index: Redis unavailable (%s: %s); routing from the local index "
                "until it answers again",
                type(err).__name__,
                err,
            )
        if self._reconnector is None or self._reconnector.done():
            self._reconnector = asyncio.create_task(self._reconnect(), name="prefix-index-redis")

    async def _reconnect(self) -> None:
        delay = self.reconnect_min_s
        while not self._closed:
            await asyncio.sleep(delay)
            try:
                async with asyncio.timeout(max(self.timeout_s * 10, 0.5)):
                    await self.client.ping()
            except REDIS_DOWN_ERRORS:
                _reraise_if_cancelled()
                delay = min(delay * 2, self.reconnect_max_s)
                continue
            with contextlib.suppress(*REDIS_DOWN_ERRORS):
                await self._reseed()
            self._up = True
            self._up_event.set()
            self.counters["reconnects"] += 1
            log.warning("prefix index: Redis is back; routing from the shared index again")
            self._wake.set()  # write what was recorded during the outage
            return

    async def _reseed(self) -> None:
        """After an outage, refill backends whose keys Redis lost (a restart without persistence)
        from the local copy, so the shared index does not start cold. Each replica adds what it
        knows; a key that survived the outage is left alone."""
        backends = list(self.local.backends())
        if not backends:
            return
        async with asyncio.timeout(max(self.timeout_s * 20, 1.0)):
            exists = await _run(self.client, [("exists", self.key(b)) for b in backends])
        lost = [b for b, n in zip(backends, exists, strict=True) if not n]
        ttl_ms = int(self.ttl_s * 1000)
        pipe = self.client.pipeline(transaction=False)
        for backend in lost:
            members = {_pack([h]): ts - SCORE_EPOCH for h, ts in self.local.entries(backend)}
            if members:
                pipe.zadd(self.key(backend), members)
                pipe.pexpire(self.key(backend), ttl_ms)
        if lost:
            async with asyncio.timeout(max(self.timeout_s * 40, 2.0)):
                await pipe.execute()
            self.counters["reseeded_backends"] += len(lost)

    def info(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "pending": len(self._pending),
            **self.counters,
            # Learned from the engines' KV pools (see set_capacity); others use the default.
            "capacity": dict(self._capacity),
            "default_capacity": self.default_capacity,
        }


# -- connecting -------------------------------------------------------------------------------


def _sentinel_parts(url: str) -> tuple[list[tuple[str, int]], str, int, dict[str, Any]]:
    """redis+sentinel://[user:pass@]host:port[,host:port...]/service_name[/db]."""
    parts = urlsplit(url)
    netloc = parts.netloc
    auth: dict[str, Any] = {}
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        user, _, password = cred.partition(":")
        if user:
            auth["username"] = unquote(user)
        if password:
            auth["password"] = unquote(password)
    hosts = []
    for hp in netloc.split(","):
        host, _, port = hp.rpartition(":")
        hosts.append((host or hp, int(port) if host else 26379))
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ValueError(
            "a redis+sentinel:// URL needs the master's service name, e.g. "
            "redis+sentinel://sentinel1:26379,sentinel2:26379/mymaster/0"
        )
    db = int(path[1]) if len(path) > 1 else 0
    query = parse_qs(parts.query)
    if "sentinel_password" in query:
        auth["sentinel_password"] = query["sentinel_password"][0]
    return hosts, path[0], db, auth


def open_redis(url: str, cluster: bool = False, timeout_s: float = 0.05) -> Any:
    """An asyncio Redis client for a redis://, rediss://, redis+sentinel:// URL or a Cluster.

    No client-side retries: the index has its own timeout and fallback, and a retry with backoff
    would only hold a background task (or a request) longer on a dead server.
    """
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.retry import Retry
    from redis.asyncio.sentinel import Sentinel
    from redis.backoff import NoBackoff

    # The socket timeout covers background work; the hot path is bounded by timeout_s itself.
    sock = max(timeout_s * 20, 1.0)
    common: dict[str, Any] = {
        "socket_timeout": sock,
        "socket_connect_timeout": sock,
    }
    if url.startswith("redis+sentinel://"):
        hosts, service, db, auth = _sentinel_parts(url)
        sentinel_password = auth.pop("sentinel_password", None)
        sentinel = Sentinel(
            hosts,
            sentinel_kwargs={**common, "password": sentinel_password},
            retry=Retry(NoBackoff(), 0),
            **common,
        )
        return sentinel.master_for(service, db=db, **auth)
    if cluster:
        return RedisCluster.from_url(url, **common)
    return Redis.from_url(url, retry=Retry(NoBackoff(), 0), **common)


def index_from_config(
    redis_url: str | None,
    cluster: bool = False,
    timeout_s: float = 0.05,
    key_prefix: str = "warmroute",
    capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
    ttl_s: float = DEFAULT_TTL_S,
) -> MemoryPrefixIndex | RedisPrefixIndex:
    """The memory index without a Redis URL, else the Redis index (owning its client)."""
    if not redis_url:
        return MemoryPrefixIndex(capacity_blocks, ttl_s)
    client = open_redis(redis_url, cluster, timeout_s)
    return RedisPrefixIndex(
        client,
        key_prefix=key_prefix,
        timeout_s=timeout_s,
        capacity_blocks=capacity_blocks,
        ttl_s=ttl_s,
        owns_client=True,
    )
