"""Filter: drop backends at their in-flight bound (always), and backends marked unhealthy
unless none is healthy (then try them all: a health check can lag a recovery).

The common case (no bound configured, every backend up) hands the candidates back as they
are: recognised once per fleet epoch for a Views read (proxy.routing.types), in two passes
over any other list."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from typing import Any

from proxy.routing.types import (
    BackendView,
    Dropped,
    PluginSettings,
    RouteContext,
    Verdict,
    Views,
)

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
        if isinstance(candidates, Views) and candidates.fleetwide("health", _as_they_are):
            return candidates
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


def _as_they_are(views: Sequence[BackendView]) -> bool:
    """No backend has an in-flight bound, and every one is healthy (or none is): the filter
    hands back every candidate, whatever the loads."""
    if any([b.max_inflight is not None for b in views]):
        return False
    healthy = [b.healthy for b in views]
    return all(healthy) or not any(healthy)


PLUGINS = [HealthFilter]
