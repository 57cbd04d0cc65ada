"""Placement and learned cache capacities shared by proxy replicas through Redis.

A shared prefix index is not enough for replicas to route alike: each also decides where the
hot prefixes live (proxy.routing.placement) and how much each engine caches
(proxy.routing.capacity), and replicas that decide apart give a prompt a copy on several
engines, each copy evicting another prompt from a small cache. So the replicas exchange those
decisions, off the request path: a background task makes one script call every `interval_s`
that publishes what this replica decided since the last one and, when anything changed
(a version counter), reads back every replica's.

- **Homes**: one replica holds a lease (renewed by every exchange, `lease_s`) and leads: it
  alone recomputes the whole assignment every `rebalance_every` of its requests and publishes
  it, replacing the previous one. The others adopt it and skip their own recomputation. Every
  replica still places a prefix it sees first at once (a request cannot wait for an
  exchange); that first placement is published only if no replica placed the prefix before,
  and otherwise the earlier one is adopted at the next exchange.
- **Capacities**: an estimate that moved on a replica's evidence is published, and the others
  adopt it: one estimate per backend, moved by every replica's responses, as one proxy's is.
- **First sightings**: a burst of prompts new to every replica reaches all of them before the
  next exchange. While other placing replicas are live (they exchanged within three leases),
  a replica places such a prompt together with them, in one script call on the request's path
  (`claim`): the homes another replica gave it, or homes chosen from every replica's
  placements and written before anyone else can choose, so the burst spreads as one proxy
  would spread it. If Redis is slow or away, it places the prompt by what they all agreed on
  before (Placement.alike): the same homes on every replica without talking, but not spread
  by load. Alone, a replica places by load as one proxy does, with no round trip.

Nothing here is on the hot path; a request reads only the local copies. When Redis stops
answering, the local copies stay as they were, and after `lease_s` without an exchange this
replica leads its own placement again (per-replica placement); the next exchange that works
publishes what it decided meanwhile.

Redis layout (one hash tag, so one script touches one slot under Cluster)::

    {key_prefix}:{{key_prefix}:place}:homes     HASH  prefix head -> "<version>|<json homes>"
    {key_prefix}:{{key_prefix}:place}:capacity  HASH  backend -> "<version>|<blocks>"
    {key_prefix}:{{key_prefix}:place}:version   STRING  bumped by every change
    {key_prefix}:{{key_prefix}:place}:leader    STRING  the leading replica, with a TTL (lease)
    {key_prefix}:{{key_prefix}:place}:replicas  ZSET  placing replica -> last exchange (ms)
    {key_prefix}:{{key_prefix}:place}:hosted    HASH  backend -> placed prefixes homed there
                                                (counted for first placements: CLAIM_LUA)
    {key_prefix}:{{key_prefix}:place}!departed:{departure}:{backend}   STRING  a departure's
                                                guard: its entries were deleted (departures.py)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from proxy.routing.capacity import CapacityLearner
from proxy.routing.departures import Departures, guard_key
from proxy.routing.index import REDIS_DOWN_ERRORS, _reraise_if_cancelled, stop_task
from proxy.routing.placement import Placement, SharedHomes

log = logging.getLogger("warmroute.routing.shared_placement")

# KEYS: homes hash, capacity hash, version, leader, replicas (ZSET: placing replica -> when it
# last exchanged, Redis's clock). ARGV: replica, lease ms (0: this replica places nothing and
# must not lead), the version this replica last read, 1 if the homes are a whole assignment
# (replace), key TTL ms, how long a replica that has not exchanged still counts as live (ms),
# the number of home entries; then per home entry: mode ("n": only if no replica placed it,
# "s": set), prefix, body; then backend, blocks pairs. A whole assignment replaces the
# previous one only from the leader, and removes only entries written at or before the version
# it had read (an entry written since may be another replica's first placement it has not seen
# yet); from any other replica its entries count as first placements. Returns the leader, the
# version, how many placing replicas are live and, when something changed or was sent, both
# hashes.
SYNC_LUA = """
local rep, lease, known = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local full, ttl, live, n = ARGV[4] == '1', tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if lease > 0 then redis.call('ZADD', KEYS[5], now, rep) end
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now - live)
local peers = redis.call('ZCARD', KEYS[5])
local leader = redis.call('GET', KEYS[4])
if lease > 0 and not leader then
  redis.call('SET', KEYS[4], rep, 'PX', lease)
  leader = rep
elseif lease > 0 and leader == rep then
  redis.call('PEXPIRE', KEYS[4], lease)
end
leader = leader or ''
local lead = leader == rep
local ver = tonumber(redis.call('GET', KEYS[3]) or '0')
if known > ver then known = -1 end
local nextv = ver + 1
local changed = false
local function split(v)
  local bar = string.find(v, '|', 1, true)
  return tonumber(string.sub(v, 1, bar - 1)), string.sub(v, bar + 1)
end
if full and lead then
  local keep = {}
  for i = 0, n - 1 do keep[ARGV[9 + 3 * i]] = true end
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    if not keep[all[i]] then
      local wv = split(all[i + 1])
      if wv <= known then
        redis.call('HDEL', KEYS[1], all[i])
        changed = true
      end
    end
  end
end
for i = 0, n - 1 do
  local mode, f, b = ARGV[8 + 3 * i], ARGV[9 + 3 * i], ARGV[10 + 3 * i]
  local cur = redis.call('HGET', KEYS[1], f)
  local set = not cur or (mode == 's' and (lead or not full))
  if set and (not cur or select(2, split(cur)) ~= b) then
    redis.call('HSET', KEYS[1], f, nextv .. '|' .. b)
    changed = true
  end
end
local sent = n > 0
for i = 8 + 3 * n, #ARGV, 2 do
  sent = true
  local cur = redis.call('HGET', KEYS[2], ARGV[i])
  if not cur or select(2, split(cur)) ~= ARGV[i + 1] then
    redis.call('HSET', KEYS[2], ARGV[i], nextv .. '|' .. ARGV[i + 1])
    changed = true
  end
end
if changed then ver = redis.call('INCR', KEYS[3]) end
for _, k in ipairs({1, 2, 3, 5}) do redis.call('PEXPIRE', KEYS[k], ttl) end
if ver == known and not sent then return {leader, ver, peers} end
return {leader, ver, peers, redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2])}
"""

# KEYS: leader, replicas. ARGV[1]: replica. Leaves the live replicas, and gives the lease up
# only if this replica holds it.
RESIGN_LUA = """
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


# KEYS: homes hash, capacity hash, version, the departure's guard (departures.py). ARGV: the
# departed backend, guard TTL ms, 1 if its homes go too (it left; 0: a restart, only its
# learned capacity goes). Deletes the backend's capacity and every home entry naming it, and
# bumps the version so that the others read again; returns how many entries went, or -1 when
# another replica already did it for this departure. The replicas' own placements publish
# where those prefixes moved (each moves them alike: Placement.forget).
FORGET_LUA = """
if not redis.call('SET', KEYS[4], '1', 'NX', 'PX', ARGV[2]) then return -1 end
local backend = ARGV[1]
local n = redis.call('HDEL', KEYS[2], backend)
if ARGV[3] == '1' then
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    local v = all[i + 1]
    local bar = string.find(v, '|', 1, true)
    local ok, entry = false, nil
    if bar then ok, entry = pcall(cjson.decode, string.sub(v, bar + 1)) end
    if ok and type(entry) == 'table' and type(entry[1]) == 'table' then
      for _, h in ipairs(entry[1]) do
        if h == backend then
          n = n + redis.call('HDEL', KEYS[1], all[i])
          break
        end
      end
    end
  end
end
if n > 0 then redis.call('INCR', KEYS[3]) end
return n
"""


# A first placement made together: KEYS: homes hash, version, hosted hash (backend -> placed
# prefixes homed there, "#" -> their sum, "@" -> the version they were counted at). ARGV: prefix,
# homes needed, size, fleet size, choices, TTL ms, how many of the names hold the prompt; then
# the names (the holders with room first, then the next backends with room in its rendezvous
# order, as the claiming replica sees them). A prefix placed already returns {0, its entry}.
# Otherwise the holders come first, then, of the rest, the less crowded of the first two, or
# the least crowded when the first hosts more than a fair count (Placement._first_alike's rule,
# over the counts of every replica's placements); the entry is written under a new version and
# returned as {1, entry}. The counts are kept as claims add homes and counted again from the
# homes hash whenever anything else changed it (an exchange, the leader's assignment, a
# departure).
CLAIM_LUA = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then return {0, cur} end
local need, size, fleet = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local choices, ttl, held = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local ver = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(redis.call('HGET', KEYS[3], '@') or '-1') ~= ver then
  redis.call('DEL', KEYS[3])
  local counts, total = {}, 0
  local all = redis.call('HGETALL', KEYS[1])
  for i = 2, #all, 2 do
    local v = all[i]
    local bar = string.find(v, '|', 1, true)
    local ok, entry = false, nil
    if bar then ok, entry = pcall(cjson.decode, string.sub(v, bar + 1)) end
    if ok and type(entry) == 'table' and type(entry[1]) == 'table' then
      for _, b in ipairs(entry[1]) do
        counts[b] = (counts[b] or 0) + 1
        total = total + 1
      end
    end
  end
  counts['#'] = total
  for b, c in pairs(counts) do redis.call('HSET', KEYS[3], b, c) end
end
local names = {}
for i = 8, #ARGV do names[#names + 1] = ARGV[i] end
local got = redis.call('HMGET', KEYS[3], unpack(names))
local hosted, rank = {}, {}
for i, b in ipairs(names) do
  hosted[b] = tonumber(got[i]) or 0
  rank[b] = i
end
local fair = (tonumber(redis.call('HGET', KEYS[3], '#')) or 0) / math.max(fleet, 1)
local chosen, spare = {}, {}
for i = 1, #names do
  if i <= held and #chosen < need then chosen[#chosen + 1] = names[i]
  elseif i > held then spare[#spare + 1] = names[i] end
end
if #chosen < need and #spare > 0 then
  if #spare > 1 and choices > 1 and hosted[spare[2]] < hosted[spare[1]] then
    spare[1], spare[2] = spare[2], spare[1]
  end
  if hosted[spare[1]] > fair then
    table.sort(spare, function(a, b)
      local ca, cb = hosted[a] > fair, hosted[b] > fair
      if ca ~= cb then return cb end
      if hosted[a] ~= hosted[b] then return hosted[a] < hosted[b] end
      return rank[a] < rank[b]
    end)
  end
  for i = 1, math.min(need - #chosen, #spare) do chosen[#chosen + 1] = spare[i] end
end
local nextv = redis.call('INCR', KEYS[2])
local entry = nextv .. '|' .. cjson.encode({chosen, size, false})
redis.call('HSET', KEYS[1], ARGV[1], entry)
for _, b in ipairs(chosen) do redis.call('HINCRBY', KEYS[3], b, 1) end
redis.call('HINCRBY', KEYS[3], '#', #chosen)
redis.call('HSET', KEYS[3], '@', nextv)
for _, k in ipairs(KEYS) do redis.call('PEXPIRE', k, ttl) end
return {1, entry}
"""


class SharedPlacement:
    """Exchanges this replica's placement decisions and learned capacities with the others."""

    def __init__(
        self,
        client: Any,
        placement: Placement | None,
        capacity: CapacityLearner,
        share_capacity: bool = True,
        apply_capacity: Callable[[str, int], None] | None = None,
        key_prefix: str = "warmroute",
        replica_id: str | None = None,
        interval_s: float = 0.2,
        lease_s: float = 2.0,
        timeout_s: float = 1.0,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        claim_timeout_s: float = 0.1,
    ) -> None:
        self.client = client
        self.placement = placement
        self.capacity = capacity  # read for the room placed prefixes leave, shared if asked
        self.share_capacity = share_capacity
        # The index keeps as many blocks per backend as its capacity says: told on adoption.
        self.apply_capacity = apply_capacity
        self.key_prefix = key_prefix
        self.replica_id = replica_id or uuid.uuid4().hex
        self.interval_s = interval_s
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        # A replica that stopped exchanging (gone, or cut off from Redis) stops counting after
        # a few leases: by then its placements are adopted or forgotten.
        self.live_s = 3 * lease_s
        self.clock = clock
        self.version = 0  # of the shared state, as last read
        self.leader: str | None = None
        self.peers = 0  # placing replicas live at the last exchange, this one included
        self.synced_at: float | None = None
        self._republish = False
        self._script = client.register_script(SYNC_LUA)
        self._resign = client.register_script(RESIGN_LUA)
        self._forget = client.register_script(FORGET_LUA)
        self._claim = client.register_script(CLAIM_LUA)
        self.claim_timeout_s = claim_timeout_s
        # Departed backends whose shared entries are still to be deleted (once, by whichever
        # replica gets there first), and since when each is gone: until the guard lapses, an
        # entry another replica published before it forgot is not adopted back.
        self.departures = Departures()
        self._homes_gone: dict[str, str] = {}  # backend -> departure, whose homes go too
        self._gone: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._up = True
        self.counters = {
            "syncs": 0,
            "sync_errors": 0,
            "published_homes": 0,
            "published_capacities": 0,
            "adopted_homes": 0,
            "adopted_capacities": 0,
            "claims": 0,  # first placements written to Redis by this replica
            "claims_placed_elsewhere": 0,  # ... found placed there by another replica
            "claim_errors": 0,  # ... not made (Redis away or slow): placed alike instead
        }

    @property
    def keys(self) -> list[str]:
        kp = self.key_prefix
        tag = f"{kp}:{{{kp}:place}}"
        return [
            f"{tag}:homes",
            f"{tag}:capacity",
            f"{tag}:version",
            f"{tag}:leader",
            f"{tag}:replicas",
        ]

    async def start(self) -> None:
        """One exchange first (bounded by timeout_s), so that a replica joining a running fleet
        (a restart, a scale-out) routes its first requests by the shared placement instead of
        placing from an empty view; then the background exchanges."""
        if self._task is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.timeout_s):
                    await self.step()
            self._task = asyncio.create_task(self._loop(), name="shared-placement")

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            await stop_task(self._task)
            self._task = None
        # Hand the lease over now rather than after lease_s: another replica leads at once.
        with contextlib.suppress(*REDIS_DOWN_ERRORS):
            async with asyncio.timeout(self.timeout_s):
                await self._resign(keys=self.keys[3:], args=[self.replica_id])

    def forget(self, backend: str, departure: str = "", *, homes: bool = True) -> None:
        """`backend` left the fleet (`homes`) or restarted as a new engine (not `homes`): its
        shared capacity and, when it left, the shared home entries naming it are deleted at
        the next exchange, once across replicas. The local placement moves its prefixes itself
        (Router.forget); from now until the departure's guard lapses, homes and capacities
        read back for it are not adopted."""
        self.departures.add(backend, departure)
        if homes:
            self._homes_gone[backend] = departure
            self._gone[backend] = self.clock()
        else:
            self._homes_gone.pop(backend, None)

    def joined(self, backend: str) -> None:
        """`backend` is in the fleet again: homes and capacities naming it are adopted again
        at once, not only once its departure's guard lapses."""
        self._gone.pop(backend, None)

    async def purge(self) -> None:
        """Delete the departed backends' shared entries now (the exchange does it otherwise);
        Redis down: they wait for the next exchange that works."""
        with contextlib.suppress(*REDIS_DOWN_ERRORS):
            await self._purge()

    async def _purge(self) -> None:
        if not self.departures:
            return
        tag = f"{self.key_prefix}:{{{self.key_prefix}:place}}"
        ttl_ms = int(self.departures.guard_s * 1000)
        keys = self.keys

        async def delete(backend: str, departure: str) -> bool:
            homes = self._homes_gone.get(backend) == departure
            guard = guard_key(tag, backend, departure)
            args = [backend, ttl_ms, int(homes)]
            n = await self._forget(keys=[keys[0], keys[1], keys[2], guard], args=args)
            if backend not in self.departures.pending:  # not departed again meanwhile
                self._homes_gone.pop(backend, None)
            return int(n) >= 0

        async with asyncio.timeout(self.timeout_s):
            await self.departures.run(delete)

    def _departed(self) -> set[str]:
        """Backends gone lately (see forget), the lapsed ones dropped."""
        gone = self._gone
        if gone:
            since = self.clock() - self.departures.guard_s
            for backend in [b for b, at in gone.items() if at < since]:
                del gone[backend]
        return set(gone)

    async def claim(
        self, key: int, need: int, size: float, fleet: int, held: int, names: Sequence[str]
    ) -> SharedHomes | None:
        """Place the prefix `key`, new to this replica, together with the others, in one
        round trip on the request's path (Placement.first_proposal gives the arguments): the
        homes another replica gave it, or the ones chosen now from `names` by every replica's
        placements, written before anyone else can choose. A burst of new prompts reaches every
        replica before an exchange; placed apart, by what they agreed on before it, they
        crowded one engine (3/2/2/1 of eight prompts on four) where one proxy places by load.
        None: Redis is away or slow (placed alike, published at the next exchange)."""
        placement = self.placement
        if placement is None or not self._up or not names:
            return None
        keys = self.keys
        hosted = f"{self.key_prefix}:{{{self.key_prefix}:place}}:hosted"
        args: list[Any] = [str(key), need, round(size), fleet, placement.choices]
        args += [int(self.ttl_s * 1000), held, *names]
        try:
            async with asyncio.timeout(self.claim_timeout_s):
                made, entry = await self._claim(keys=[keys[0], keys[2], hosted], args=args)
        except REDIS_DOWN_ERRORS:
            _reraise_if_cancelled()
            self.counters["claim_errors"] += 1
            return None
        self.counters["claims" if int(made) else "claims_placed_elsewhere"] += 1
        try:
            homes, blocks, overflow = orjson.loads(_text(entry).partition("|")[2])
        except (ValueError, TypeError):
            return None
        gone = self._departed()
        kept = tuple(h for h in map(str, homes) if h not in gone)
        return SharedHomes(kept, float(blocks), bool(overflow)) if kept else None

    async def sync(self) -> None:
        """One exchange: publish what this replica decided, adopt what the others did."""
        # Departures first: the exchange below then reads the entries that are left.
        await self._purge()
        placement, capacity = self.placement, self.capacity
        full, changes = placement.take_changes() if placement is not None else (False, {})
        moved = capacity.take_moved() if self.share_capacity else {}
        full = full or self._republish
        try:
            flat = await self._exchange(full, changes, moved)
        except BaseException:
            if placement is not None:
                placement.requeue(full, changes)
            capacity.requeue(moved)
            raise
        self._republish = False
        self.counters["syncs"] += 1
        self.synced_at = self.clock()
        leader, version, self.peers = _text(flat[0]) or None, int(flat[1]), int(flat[2])
        if version < self.version:
            # Redis lost the shared state (a restart without persistence): what this replica
            # holds goes out again, as the leader's assignment or as first placements.
            self._republish = True
        self.version = version
        self.leader = leader
        if placement is not None:
            leads = leader == self.replica_id
            if leads and not placement.leads:
                self._republish = True  # a new leader publishes its whole assignment
            placement.leads = leads
            # With others placing too, a prompt new to all of them may reach each before the
            # next exchange: they place it alike (by what they agree on). Alone, by load.
            placement.alike = self.peers > 1
        if len(flat) > 3:
            self._adopt(flat[3], flat[4])

    async def _exchange(self, full: bool, changes: dict[int, bool], moved: dict[str, float]) -> Any:
        placement = self.placement
        entries: list[Any] = []
        if placement is not None:
            keys = list(placement.placed) if full else list(changes)
            for key in keys:
                p = placement.placed[key]
                if not p.homes:
                    continue
                mode = "n" if not full and changes.get(key, False) else "s"
                # Whole blocks: a size that moves by a fraction is not worth a new version.
                body = orjson.dumps([list(p.homes), round(p.size), p.overflow]).decode()
                entries += [mode, str(key), body]
        args: list[Any] = [
            self.replica_id,
            int(self.lease_s * 1000) if placement is not None else 0,
            self.version,
            int(full),
            int(self.ttl_s * 1000),
            int(self.live_s * 1000),
            len(entries) // 3,
            *entries,
        ]
        for backend, blocks in moved.items():
            args += [backend, str(round(blocks))]
        async with asyncio.timeout(self.timeout_s):
            flat = await self._script(keys=self.keys, args=args)
        self.counters["published_homes"] += len(entries) // 3
        self.counters["published_capacities"] += len(moved)
        return flat

    def _adopt(self, homes_flat: Sequence[Any], caps_flat: Sequence[Any]) -> None:
        capacity = self.capacity
        gone = self._departed()
        if self.share_capacity:
            for backend, value in _pairs(caps_flat):
                if backend not in gone and capacity.adopt(backend, float(value)):
                    self.counters["adopted_capacities"] += 1
                    if self.apply_capacity is not None:
                        self.apply_capacity(backend, capacity.capacity(backend))
        placement = self.placement
        if placement is None:
            return
        shared: dict[int, SharedHomes] = {}
        for field, body in _pairs(homes_flat):
            try:
                homes, size, overflow = orjson.loads(body)
                kept = tuple(h for h in map(str, homes) if h not in gone)
                if kept:
                    shared[int(field)] = SharedHomes(kept, float(size), bool(overflow))
            except (ValueError, TypeError) as e:
                # Another version's format, or a hand edit: skipped, never fatal.
                log.debug("shared placement: unreadable entry %r: %s", field, e)
        self.counters["adopted_homes"] += placement.adopt(shared, capacity.capacity)

    async def _loop(self) -> None:
        while not self._closed:
            await self.step()
            await asyncio.sleep(self.interval_s)

    async def step(self) -> bool:
        """One round of the background task: an exchange or, with Redis down, the fallback;
        returns whether the exchange worked."""
        try:
            await self.sync()
        except REDIS_DOWN_ERRORS as e:
            _reraise_if_cancelled()
            self.counters["sync_errors"] += 1
            if self._up:
                self._up = False
                log.warning(
                    "shared placement: Redis unavailable (%s: %s); placing on this replica's "
                    "own view until it answers",
                    type(e).__name__,
                    e,
                )
            self.fall_back()
            return False
        if not self._up:
            self._up = True
            log.warning("shared placement: Redis is back; placing with the other replicas")
        return True

    def fall_back(self) -> None:
        """After `lease_s` without an exchange, nobody else's assignment is current: this
        replica recomputes its own placement, as it would with no Redis at all."""
        stale = self.synced_at is None or self.clock() - self.synced_at > self.lease_s
        if stale and self.placement is not None:
            self.placement.leads = True

    def info(self) -> dict[str, Any]:
        leads = self.placement.leads if self.placement is not None else None
        return {
            "mode": "redis" if self._up else "local-fallback",
            "replica": self.replica_id,
            "leads": leads,
            "leader": self.leader,
            "replicas": self.peers,
            "version": self.version,
            **self.counters,
            "departures": self.departures.info(),
        }


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _pairs(flat: Sequence[Any]) -> list[tuple[str, str]]:
    """A flattened HGETALL of "<version>|<body>" values, as (field, body)."""
    out = []
    for field, value in zip(flat[::2], flat[1::2], strict=True):
        _, _, body = _text(value).partition("|")
        out.append((_text(field), body))
    return out
