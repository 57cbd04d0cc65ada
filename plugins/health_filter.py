"""Filter: drop backends at their in-flight bound (always), and backends marked unhealthy
unless none is healthy (then try them all: a health check can lag a recovery).

The common case (no bound configured, every backend up) is recognised in two passes
over the list and hands the candidates back as they are."""

from __future__ import annotations

from itertools import compress
from typing import Any

from proxy.routing.types import BackendView, Dropped, PluginSettings, RouteContext, Verdict

UNHEALTHY = Dropped(Verdict.UNHEALTHY, "unhealthy")


class HealthFilter:
    name = "health"
    kind = "filter"
    Settings = PluginSettings  # no keys of its own: any key in its block is a mistake

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> HealthFilter:
        return cls()

    def filter(
        self, ctx: RouteContext, candidates: list[BackendView], dropped: dict[str, str]
    ) -> list[BackendView]:
        bounds = [b.max_inflight for b in candidates]
        if bounds.count(None) != len(bounds):
            free = [b.max_inflight is None or b.inflight < b.max_inflight for b in candidates]
            if not all(free):
                for b, ok in zip(candidates, free, strict=True):
                    if not ok:
                        why = f"at its in-flight bound ({b.max_inflight})"
                        dropped[b.name] = Dropped(Verdict.AT_BOUND, why)
                candidates = list(compress(candidates, free))
        healthy = [b.healthy for b in candidates]
        if all(healthy) or not any(healthy):
            # None healthy: a health check can lag a recovery; trying beats refusing outright.
            return candidates
        for b, ok in zip(candidates, healthy, strict=True):
            if not ok:
                dropped[b.name] = UNHEALTHY
        return list(compress(candidates, healthy))


PLUGINS = [HealthFilter]
