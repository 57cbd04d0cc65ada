"""Filter: drop backends at their in-flight bound (always), and backends marked unhealthy
unless none is healthy (then try them all: a health check can lag a recovery)."""

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
        bounded = [b for b in candidates if b.max_inflight is not None]
        if bounded:
            full = [b for b in bounded if b.inflight >= (b.max_inflight or 0)]
            for b in full:
                dropped[b.name] = f"at its in-flight bound ({b.max_inflight})"
            if full:
                candidates = [b for b in candidates if b not in full]
        healthy = [b for b in candidates if b.healthy]
        if not healthy:
            # A health check can lag a recovery; trying is better than refusing outright.
            return candidates
        if len(healthy) < len(candidates):
            for b in candidates:
                if not b.healthy:
                    dropped[b.name] = "unhealthy"
        return healthy


PLUGINS = [HealthFilter]
