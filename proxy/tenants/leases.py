"""A tenant's requests in flight, counted across replicas: one lease per request in Redis.

`max_concurrent` counts every replica's requests when Redis is configured. A request admitted
under a cap takes a lease: a member of the cap's sorted set, scored with its expiry on Redis's
clock, added by one script call that first drops the expired leases and refuses when the set
already holds `cap`. The request's end removes it. Each replica renews the leases of its
running requests every LEASE_S / 3 (one call for all of them), so a lease outlives its request
only when its replica died or lost Redis: it then expires within LEASE_S and its slot is free
again. Redis's clock is the only clock, so replicas whose clocks disagree share one count.

Redis layout (under the budgets' hash tag, so a Cluster runs every call on one node)::

    {key_prefix:tenants}:inflight:<tenant>   ZSET  "<replica>:<n>" -> expiry (s, Redis time)

When Redis does not answer, the budgets (budgets.py) hold this replica's share of the cap
instead (the cap divided by the replicas live at the last call, at least one), from their own
count. A take registers its replica as live, as the budgets' calls do (store.py).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from proxy.tenants.store import LIVE_S

LEASE_S = 30.0  # a dead replica's requests hold their slots at most this long

# KEYS[1]: the cap's set, KEYS[2]: the live replicas (the budgets' sorted set: replica -> last
# call). ARGV: cap, member, lease seconds, this replica, how long a replica counts as live.
# Returns {taken (1/0), held after, live replicas}.
TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[2], now, ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[5]))
local live = redis.call('ZCARD', KEYS[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if held >= tonumber(ARGV[1]) then return {0, held, live} end
local lease = tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], now + lease, ARGV[2])
redis.call('PEXPIRE', KEYS[1], math.ceil(lease * 1000) + 1000)
return {1, held + 1, live}
"""

# KEYS: the caps' sets. ARGV: lease seconds, then per key its member count and members. Only
# members still there are renewed (XX): one that expired may have given its slot away.
RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local lease = tonumber(ARGV[1])
local i = 2
for k = 1, #KEYS do
  local n = tonumber(ARGV[i])
  for j = 1, n do
    redis.call('ZADD', KEYS[k], 'XX', now + lease, ARGV[i + j])
  end
  i = i + n + 1
  redis.call('PEXPIRE', KEYS[k], math.ceil(lease * 1000) + 1000)
end
return 1
"""


class RedisLeases:
    """The leases in Redis; the callers time the calls and handle Redis being away."""

    def __init__(self, client: Any, key_prefix: str, replica: str) -> None:
        self.client = client
        self.tag = f"{{{key_prefix}:tenants}}"
        self.replica = replica
        self._take = client.register_script(TAKE)
        self._renew = client.register_script(RENEW)
        self._n = 0

    def key(self, tenant: str) -> str:
        return f"{self.tag}:inflight:{tenant}"

    def member(self) -> str:
        """A new lease's name: this replica's, numbered."""
        self._n += 1
        return f"{self.replica}:{self._n}"

    async def take(self, key: str, cap: int, member: str, lease_s: float) -> tuple[bool, int, int]:
        """(taken, leases held under this cap after the call, live replicas)."""
        keys = [key, f"{self.tag}:replicas"]
        args = [cap, member, repr(lease_s), self.replica, repr(LIVE_S)]
        taken, held, live = await self._take(keys=keys, args=args)
        return bool(int(taken)), int(held), max(1, int(live))

    async def release(self, key: str, member: str) -> None:
        await self.client.zrem(key, member)

    async def renew(self, held: Mapping[str, Collection[str]], lease_s: float) -> None:
        keys = [k for k, members in held.items() if members]
        if not keys:
            return
        args: list[Any] = [repr(lease_s)]
        for k in keys:
            args += [len(held[k]), *held[k]]
        await self._renew(keys=keys, args=args)
