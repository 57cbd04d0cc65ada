"""Filter: drop backends marked unhealthy, unless none is healthy (then try them all)."""

from __future__ import annotations

from typing import Any

from proxy.routing.types import BackendView, RouteContext


class HealthFilter:
    name = "health"
    kind = "filter"

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> HealthFilter:
        return cls()

    def filter(
        self, ctx: RouteContext, candidates: list[BackendView], dropped: dict[str, str]
    ) -> list[BackendView]:
        healthy = [b for b in candidates if b.healthy]
        if not healthy:
            # A health check can lag a recovery; trying is better than refusing outright.
            return candidates
        for b in candidates:
            if not b.healthy:
                dropped[b.name] = "unhealthy"
        return healthy


PLUGINS = [HealthFilter]
