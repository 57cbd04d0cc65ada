"""The prefix index: which block hashes each backend has recently seen (its likely KV cache).

Two stores behind one interface:

- ``MemoryPrefixIndex`` (index_memory.py): per-backend LRU of block hashes in this process
  (the default).
- ``RedisPrefixIndex`` (index_redis.py): the same state in Redis, shared by every proxy replica.
  One Lua call answers the longest match of all candidate backends (one round trip); records
  are queued and written in batches by a background task. Every record also updates a local
  memory index, and a refused or dropped connection, or replies slower than ``timeout_s``
  several times running, switch lookups to that local index (mode ``memory-fallback``) while
  a background task reconnects. A request never waits on Redis longer than ``timeout_s`` and
  never fails because of it. Each written batch is also appended to a stream that every
  replica applies to its local copy; once that copy agrees with Redis, it answers lookups
  without a round trip (index_feed.py).

Both stores evict the *tail* of a prompt first (later blocks carry older timestamps), like an
engine's LRU does: a chain hash whose predecessors were evicted would be a lie.

Redis layout (Cluster-safe: every key of one index carries the same hash tag, so the one lookup
script touches one slot)::

    {key_prefix}:{{key_prefix}:pfx}:{backend}   ZSET  member = 8-byte block hash,
                                                       score = last seen (s since SCORE_EPOCH)
    {key_prefix}:{{key_prefix}:pfx}!head:{block}   SET  the backend ZSETs that recorded a prompt
                                                       starting with that block (the lookup's
                                                       entry point)
    {key_prefix}:{{key_prefix}:pfx}!feed   STREAM  every written batch, one entry (index_feed.py)
    {key_prefix}:{{key_prefix}:pfx}!departed:{departure}:{backend}   STRING  a departure's guard:
                                                       the first replica to forget the backend
                                                       deleted its ZSET (departures.py)
"""

from __future__ import annotations

from proxy.routing.index_memory import (
    DEFAULT_CAPACITY_BLOCKS,
    DEFAULT_TTL_S,
    GHOST_MIN,
    MemoryPrefixIndex,
    PrefixIndex,
    Probe,
    capacity_blocks_from_tokens,
)
from proxy.routing.index_redis import (
    BLOCK_STEP_S,
    LOOKUP_LUA,
    RECORD_LUA,
    REDIS_DOWN_ERRORS,
    SCORE_EPOCH,
    TIMEOUT_ERRORS,
    TIMEOUTS_TO_OUTAGE,
    RedisPrefixIndex,
    TimeoutStreak,
    _reraise_if_cancelled,
    drop_idle_connections,
    stop_task,
)
from proxy.routing.redis_connect import _sentinel_parts, open_redis

__all__ = [
    "BLOCK_STEP_S",
    "DEFAULT_CAPACITY_BLOCKS",
    "DEFAULT_TTL_S",
    "GHOST_MIN",
    "LOOKUP_LUA",
    "RECORD_LUA",
    "REDIS_DOWN_ERRORS",
    "SCORE_EPOCH",
    "TIMEOUTS_TO_OUTAGE",
    "TIMEOUT_ERRORS",
    "MemoryPrefixIndex",
    "PrefixIndex",
    "Probe",
    "RedisPrefixIndex",
    "TimeoutStreak",
    "_reraise_if_cancelled",
    "_sentinel_parts",
    "capacity_blocks_from_tokens",
    "drop_idle_connections",
    "index_from_config",
    "open_redis",
    "stop_task",
]


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
