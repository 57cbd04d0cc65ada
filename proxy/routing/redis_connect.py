"""Connecting to Redis for the shared index, the in-flight board and the placement exchange:
plain, TLS, Sentinel or Cluster URLs (split from index_redis.py, which owns the index)."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

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
