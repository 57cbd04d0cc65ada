"""Connecting to Redis for the shared index, the in-flight board and the placement exchange:
plain, TLS, Sentinel or Cluster URLs; and telling an outage from a slow reply (split from
index_redis.py, which owns the index).

When Redis counts as down: a refused or dropped connection at once, a timeout only when it
repeats (see TimeoutStreak), because a busy event loop makes a healthy Redis time out too.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from redis import exceptions as redis_errors

DEFAULT_MAX_CONNECTIONS = 64  # per replica: lookups, in-flight counts, flushes, placement


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


def open_redis(
    url: str,
    cluster: bool = False,
    timeout_s: float = 0.05,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> Any:
    """An asyncio Redis client for a redis://, rediss://, redis+sentinel:// URL or a Cluster.

    No client-side retries: the index has its own timeout and fallback, and a retry with backoff
    would only hold a background task (or a request) longer on a dead server.

    A plain Redis (redis://, rediss://, unix://) gets a pool of at most `max_connections` that
    makes a call wait for a free connection (every call is bounded by its own timeout): redis-py's
    default pool opens one connection per call in flight, which grew with client concurrency in
    the soak (47 connections at 64 clients) toward Redis's 10,000-client limit across replicas.
    Sentinel's and Cluster's pools have no waiting variant (a full pool raises, which would read
    as an outage), so they stay unbounded.
    """
    from redis.asyncio import BlockingConnectionPool, Redis
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
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=sock * 2,  # past every caller's own bound: a wait ends as that caller's timeout
        retry=Retry(NoBackoff(), 0),
        **common,
    )
    client = Redis(connection_pool=pool)
    client.auto_close_connection_pool = True  # aclose() closes the pool too, as from_url's does
    return client


# Errors that mean "Redis is not answering properly"; anything else is a bug and propagates.
REDIS_DOWN_ERRORS: tuple[type[BaseException], ...] = (
    redis_errors.RedisError,
    OSError,
    TimeoutError,
    asyncio.TimeoutError,
)
# Of those, the ones that may only mean this process was too busy to read the answer in time.
TIMEOUT_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, redis_errors.TimeoutError)
TIMEOUTS_TO_OUTAGE = 3


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


class TimeoutStreak:
    """Whether lookup timeouts say Redis is down, or only that this process was slow.

    A stalled event loop (CPU load, a long pause) times out every lookup in flight at once, and
    a single late reply is noise; neither is an outage. So a timeout counts only when its lookup
    started after the last counted timeout was seen (lookups in flight then share its cause),
    and `limit` counted timeouts with no answer between them make an outage. Against a frozen
    Redis that takes `limit` rounds of the lookup timeout; no request waits longer than one.
    """

    def __init__(self, limit: int = TIMEOUTS_TO_OUTAGE) -> None:
        self.limit = limit
        self._started = 0
        self._barrier = 0
        self._streak = 0

    def start(self) -> int:
        """A lookup starts; returns its ticket."""
        self._started += 1
        return self._started

    def answered(self) -> None:
        self._streak = 0

    def timed_out(self, ticket: int) -> bool:
        """The lookup with `ticket` timed out; True when that makes an outage."""
        if ticket <= self._barrier:
            return False
        self._barrier = self._started
        self._streak += 1
        return self._streak >= self.limit

    def reset(self) -> None:
        self._streak = 0
        self._barrier = self._started


async def drop_idle_connections(client: Any) -> None:
    """Close the pooled connections no call holds. After Redis restarts, each one is a socket
    to the old process: handed out after the reconnect, it fails its first command and would
    declare a second outage."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:  # Redis, and Sentinel's master_for
        await pool.disconnect(inuse_connections=False)
        return
    for node in client.get_nodes():  # RedisCluster: a pool per node
        await node.disconnect_free_connections()
