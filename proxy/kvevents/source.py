"""One backend's exact cache for the router: a view fed by a subscriber, and when to trust it.

The router asks two things (proxy.routing.router.ExactCache): is the account live, and how
much of this prompt does the engine hold. Live means the subscriber is running and its view
holds everything since a clean start (no gap it could not repair), and the engine has not
both gone quiet and failed its health check: engines publish only when their cache changes, so
silence alone is an idle engine, while silence and a failed health check is an engine that
went away. A restarted engine is recognised by the subscriber when it reconnects (the engine no
longer has the last batch applied, or its sequence numbers went back with other payloads): the
view is cleared and rebuilt from the new engine's replay. Whenever it is not live, routing uses
the learned prefix index for that backend, and says so.

Each proxy replica subscribes to every engine itself. ZeroMQ's PUB socket fans out to any
number of subscribers at the publisher's cost of one send per subscriber; relaying through
Redis instead would add a hop and a writer per engine, and every replica would still read
every change. A few replicas times a few engines is a few sockets each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from proxy.kvevents.subscriber import KvEventSubscriber
from proxy.kvevents.view import KvCacheView

log = logging.getLogger("warmroute.kvevents")


class EngineCache:
    """The KV-event account of one backend's cache."""

    def __init__(
        self,
        backend: str,
        model: str,
        block_tokens: int,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        silent_after_s: float = 30.0,
        healthy: Callable[[], bool] = lambda: True,
    ) -> None:
        self.backend = backend
        self.view = KvCacheView(model, block_tokens)
        self.subscriber = KvEventSubscriber(
            endpoint,
            self.view,
            replay_endpoint=replay_endpoint,
            topic=topic,
            silent_after_s=silent_after_s,
        )
        self.healthy = healthy
        self._was_live = False

    async def start(self) -> None:
        await self.subscriber.start()

    async def close(self) -> None:
        await self.subscriber.close()

    def reset(self) -> None:
        """The engine restarted (a new, cold one at the same endpoint): forget what the view
        held; it is rebuilt from the new engine's events (KvEventSubscriber.reset)."""
        self.subscriber.reset()

    @property
    def live(self) -> bool:
        sub = self.subscriber
        live = sub.live and not (sub.silent and not self.healthy())
        if live != self._was_live:
            self._was_live = live
            log.warning(
                "kv events: %s's cache is now read from %s",
                self.backend,
                "its KV events" if live else "the learned prefix index (events not current)",
            )
        return live

    def match(self, blocks: Sequence[int]) -> int:
        return self.view.match(blocks)

    def match_tiers(self, blocks: Sequence[int]) -> tuple[int, ...]:
        """Leading blocks reachable through each tier of `view.TIERS` (GPU first)."""
        return self.view.match_tiers(blocks)

    def stats(self) -> dict[str, Any]:
        return {"live": self.live, **self.subscriber.stats(), "view": self.view.stats()}
