"""Routing resources built from the config and opened/closed by the app's lifespan.

routing = build_routing(config)       # no I/O yet; build_router(config.routing) for the router
await routing.start()                  # in lifespan startup
BackendView(..., inflight=routing.board.get(name),
            prefill_tokens_per_s=routing.learner.rate(name),
            mean_prefill_s=routing.learner.mean_prefill_s(name))
decision = await routing.router.route(ctx, views)
routing.board.acquire(decision.winner) ... routing.board.release(backend)
routing.router.observe(ctx, backend, input_tokens, cached_tokens, upstream_ttft_s)
await routing.close()                  # in lifespan shutdown
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, cast

from pydantic import ValidationError, create_model

import plugins
from proxy.routing.index import (
    REDIS_DOWN_ERRORS,
    MemoryPrefixIndex,
    PrefixIndex,
    RedisPrefixIndex,
    open_redis,
)
from proxy.routing.inflight import InflightBoard
from proxy.routing.learn import PrefillLearner
from proxy.routing.prefix import HasherSettings
from proxy.routing.router import PREFIX_BLOCK, IndexSettings, Router
from proxy.routing.shared_placement import SharedPlacement
from proxy.routing.types import PluginSettings, Policy


@dataclass
class Routing:
    """The router and the state it reads: prefix index, in-flight board, prefill learner."""

    router: Router
    index: PrefixIndex
    board: InflightBoard
    learner: PrefillLearner
    redis: Any | None = None  # the shared client, closed last
    shared: SharedPlacement | None = None  # placement and capacities shared with other replicas

    async def start(self) -> None:
        await self.index.start()
        await self.board.start()
        if self.shared is not None:
            await self.shared.start()

    async def close(self) -> None:
        if self.shared is not None:
            await self.shared.close()
        await self.board.close()
        await self.index.close()
        if self.redis is not None:
            with contextlib.suppress(*REDIS_DOWN_ERRORS):
                await self.redis.aclose()

    async def forget(
        self, backend: str, remaining: Sequence[str] | None = None, departure: str = ""
    ) -> int:
        """`backend` left the fleet: the router forgets it (Router.forget: index, learned
        cache and prefill rate, backlog, KV-event view; its placed prefixes move to their next
        rendezvous choice among `remaining`), and so do the in-flight board and the shared
        placement. With Redis, its shared keys are deleted before this returns, once across
        replicas (`departure`: a token all of them share for this change, if there is one);
        Redis down, that waits for the background tasks' next round, and nothing raises.
        Returns how many placed prefixes moved."""
        moved = self.router.forget(backend, remaining, departure)
        self.board.forget(backend)
        if self.shared is not None:
            self.shared.forget(backend, departure)
        await self._purge()
        return moved

    async def reset_cache(self, backend: str, departure: str = "") -> None:
        """A new (cold) engine took `backend`'s address: what routing knew of its cache goes
        (Router.reset_cache), here and in Redis (once); placement and prefill rate stay."""
        self.router.reset_cache(backend, departure)
        if self.shared is not None:
            self.shared.forget(backend, departure, homes=False)
        await self._purge()

    async def _purge(self) -> None:
        await self.index.purge()
        await self.board.purge()
        if self.shared is not None:
            await self.shared.purge()

    def info(self) -> dict[str, Any]:
        return {
            "policy": self.router.policy.name,
            "index": self.index.info(),
            "inflight": self.board.info(),
            "prefill": self.learner.snapshot(),
            "backlog_tokens": self.router.backlog.snapshot(self.router.prefill_rate),
            "cache": self.router.cache_info(),
            **({"shared_placement": self.shared.info()} if self.shared is not None else {}),
        }


def policy_blocks(routing: Any) -> tuple[str, dict[str, Any]]:
    """(policy name, plugin blocks) of a RoutingConfig or a mapping with `policy`, `plugins`."""
    if isinstance(routing, Mapping):
        name, blocks = routing.get("policy", "prefix_aware"), routing.get("plugins", {})
    else:
        name, blocks = routing.policy, routing.plugins
    return name, dict(blocks or {})


def block_names() -> list[str]:
    """The names a `routing.plugins` block may have: every plugin's, and `prefix`."""
    return sorted({*plugins.registry(), PREFIX_BLOCK})


@cache
def block_settings(name: str) -> type[PluginSettings] | None:
    """The typed settings of the `routing.plugins.<name>` block: its plugin's `Settings`, and
    for `prefix` the prefix scorer's, the hasher's and the index's together (one block, read
    by all three). None: no such plugin, or one that declares no settings (not checked)."""
    own: type[PluginSettings] | None = getattr(plugins.registry().get(name), "Settings", None)
    if name != PREFIX_BLOCK:
        return own
    bases = tuple(p for p in (own, HasherSettings, IndexSettings) if p is not None)
    return cast("type[PluginSettings]", create_model("PrefixBlockSettings", __base__=bases))


def block_errors(
    blocks: Mapping[str, Any],
) -> list[tuple[str, ValidationError | None, type[PluginSettings] | None]]:
    """Each `routing.plugins` block that does not validate: (name, its error, its settings),
    or (name, None, None) for a block no plugin reads."""
    found: list[tuple[str, ValidationError | None, type[PluginSettings] | None]] = []
    names = block_names()
    for name, block in blocks.items():
        if name not in names:
            found.append((name, None, None))
            continue
        model = block_settings(name)
        if model is None:
            continue
        try:
            model.model_validate(block or {})
        except ValidationError as e:
            found.append((name, e, model))
    return found


def build_policy(routing: Any) -> Policy:
    """The configured policy, built by the plugin registry (plugins/ and entry points)."""
    name, blocks = policy_blocks(routing)
    # A composite policy configures its parts from their own blocks; hand it all of them.
    return plugins.build(name, {**blocks.get(name, {}), "plugins": blocks})


def build_router(routing: Any, index: PrefixIndex | None = None) -> Router:
    """A Router for a RoutingConfig (or a mapping with `policy` and `plugins`).

    Plugins are composed here, above both the router and the plugins: plugins import the
    routing vocabulary (proxy.routing.types) and the router takes the policy it is handed, so
    neither imports the other."""
    _, blocks = policy_blocks(routing)
    return Router.from_blocks(build_policy(routing), blocks, index=index)


def build_routing(
    config: Any, replica_id: str | None = None, clock: Callable[[], float] | None = None
) -> Routing:
    """From a proxy.config.Config: routing.policy/plugins and redis.* (url, cluster, timeout_s,
    key_prefix). Index sizing lives in routing.plugins.prefix: capacity_blocks, ttl_s.
    `clock`: the index's clock (default: wall time with Redis, monotonic in memory), for a
    harness that runs in virtual time."""
    blocks: dict[str, Any] = dict(config.routing.plugins or {})
    sizing = IndexSettings.of(blocks.get(PREFIX_BLOCK))
    capacity, ttl_s = sizing.capacity_blocks, sizing.ttl_s
    rc = config.redis
    index: PrefixIndex
    if rc.url:
        client = open_redis(rc.url, rc.cluster, rc.timeout_s, rc.max_connections)
        index = RedisPrefixIndex(
            client,
            key_prefix=rc.key_prefix,
            timeout_s=rc.timeout_s,
            capacity_blocks=capacity,
            ttl_s=ttl_s,
            clock=clock or time.time,
            local_lookups=rc.local_lookups,
        )
        board = InflightBoard(client, key_prefix=rc.key_prefix, replica_id=replica_id)
    else:
        client = None
        index = MemoryPrefixIndex(capacity, ttl_s, clock=clock or time.monotonic)
        board = InflightBoard()
    router = build_router(config.routing, index=index)
    # The proxy records the prefix once the request is on the wire to the backend that got it
    # (forward.py): off the critical path before the upstream write, and never for a backend
    # that refused the connection.
    router.record_on_route = False
    shared = None
    share = router.policy.hints.shares_placement
    if client is not None and share and (router.placement is not None or router.learn_capacity):
        shared = SharedPlacement(
            client,
            router.placement,
            router.capacity,
            share_capacity=router.learn_capacity,
            apply_capacity=index.set_capacity,
            key_prefix=rc.key_prefix,
            replica_id=board.replica_id,
        )
        if router.placement is not None:
            router.claims = shared
    return Routing(
        router=router,
        index=index,
        board=board,
        learner=router.learner,
        redis=client,
        shared=shared,
    )
