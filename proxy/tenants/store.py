"""Where the buckets live: Redis, shared by every replica (one script call per request), or
this process's memory (no Redis configured, or Redis away: each replica then enforces its
share of each limit, the limit divided by the replicas that were live)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.tenants.gcra import ADMIT, CHARGE, WINDOW_S, Limit, Outcome, readings, step

LIVE_S = WINDOW_S  # a replica that called within the last minute counts as live

# KEYS[1]: the replicas (a sorted set: replica -> last call, Redis time); KEYS[2..]: one TAT
# per limit. ARGV[1]: this replica; ARGV[2]: admit | charge | peek; then, per limit, its
# interval (s per unit) and the call's cost in units. Redis's own clock (TIME) is the only
# clock, so replicas whose clocks disagree share one budget. gcra.step is the same arithmetic.
# Returns: ok (1/0), wait in µs, the index of the refusing limit (0: none), live replicas,
# then each limit's TAT after the call, in µs ahead of now (0: not ahead).
SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window = __WINDOW__
local mode = ARGV[2]
local n = #KEYS - 1
local base, new = {}, {}
local ok, wait, refused = 1, 0, 0
for i = 1, n do
  local interval = tonumber(ARGV[1 + 2 * i])
  local cost = tonumber(ARGV[2 + 2 * i])
  local tat = tonumber(redis.call('GET', KEYS[i + 1]) or '0')
  if tat < now then tat = now end
  local nxt = tat + cost * interval
  if nxt < now then nxt = now end
  base[i], new[i] = tat, nxt
  if mode == 'admit' then
    local need = nxt
    if cost <= 0 then need = tat + interval end
    if need - now > window then
      if ok == 1 or need - window - now > wait then
        wait, refused = need - window - now, i
      end
      ok = 0
    end
  end
end
local after = new
if mode == 'peek' or ok == 0 then after = base end
if ok == 1 and mode ~= 'peek' then
  for i = 1, n do
    if new[i] > base[i] or new[i] < base[i] then
      local ms = math.ceil((new[i] - now) * 1000) + 1000
      redis.call('SET', KEYS[i + 1], string.format('%.6f', new[i]), 'PX', ms)
    end
  end
end
local live = 0
if mode == 'admit' then
  redis.call('ZADD', KEYS[1], now, ARGV[1])
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - __LIVE__)
  live = redis.call('ZCARD', KEYS[1])
end
local out = {ok, math.floor(wait * 1000000), refused, live}
for i = 1, n do out[4 + i] = math.floor((after[i] - now) * 1000000) end
return out
""".replace("__WINDOW__", repr(WINDOW_S)).replace("__LIVE__", repr(LIVE_S))


class RedisBuckets:
    """The buckets in Redis: every key under one hash tag, so a Cluster runs the script on
    one node (all tenants on one slot: one script call each request)."""

    def __init__(self, client: Any, key_prefix: str, replica: str) -> None:
        self.client = client
        self.tag = f"{{{key_prefix}:tenants}}"
        self.replica = replica
        self.script = client.register_script(SCRIPT)

    async def call(self, limits: Sequence[Limit], costs: Sequence[float], mode: str) -> Outcome:
        keys = [f"{self.tag}:replicas"] + [f"{self.tag}:{lim.key}" for lim in limits]
        args: list[Any] = [self.replica, mode]
        for lim, cost in zip(limits, costs, strict=True):
            args += [repr(lim.interval_s), repr(float(cost))]
        raw = await self.script(keys=keys, args=args)
        ok, wait_us, refused, live = (int(x) for x in raw[:4])
        after = [int(x) / 1e6 for x in raw[4:]]
        return Outcome(
            ok=bool(ok),
            wait_s=wait_us / 1e6,
            readings=() if mode == CHARGE else readings(limits, after, 0.0),
            live_replicas=max(1, live) if mode == ADMIT else 0,
            refused_by=limits[refused - 1] if refused else None,
        )


class LocalBuckets:
    """The buckets in this process: alone (no Redis), or a replica's share while Redis is
    away (`share`: the number of replicas the limit is divided among)."""

    def __init__(self) -> None:
        self.tats: dict[str, float] = {}

    def call(
        self,
        limits: Sequence[Limit],
        costs: Sequence[float],
        mode: str,
        now: float,
        share: int = 1,
    ) -> Outcome:
        intervals = [lim.interval_s * share for lim in limits]
        tats = [self.tats.get(lim.key) for lim in limits]
        ok, wait, refused, store, after = step(tats, intervals, costs, mode, now)
        if ok:
            for lim, tat in zip(limits, store, strict=True):
                if tat > now:
                    self.tats[lim.key] = tat
                else:
                    self.tats.pop(lim.key, None)
        if mode == CHARGE:  # nobody reads what is left after a charge
            return Outcome(ok, wait, ())
        if share != 1:
            limits = [
                Limit(x.tenant, x.kind, max(1, x.per_minute // share), x.model) for x in limits
            ]
        return Outcome(
            ok=ok,
            wait_s=wait,
            readings=readings(limits, after, now),
            refused_by=limits[refused] if refused >= 0 else None,
        )

    def forget_idle(self, now: float) -> None:
        """Drop the buckets that are full again (their TAT has passed)."""
        for key in [k for k, tat in self.tats.items() if tat <= now]:
            del self.tats[key]
