"""Scorer: fewer requests in flight (relative to the backend's weight) scores higher."""

from __future__ import annotations

from typing import Any

from proxy.routing.types import BackendView, PluginSettings, RouteContext


class InflightScorer:
    name = "inflight"
    kind = "scorer"
    Settings = PluginSettings  # no keys of its own: any key in its block is a mistake

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> InflightScorer:
        return cls()

    def score(self, ctx: RouteContext, candidates: list[BackendView]) -> dict[str, float]:
        loads = {b.name: b.inflight / max(b.weight, 1e-9) for b in candidates}
        worst = max(loads.values(), default=0.0)
        if worst <= 0:
            return dict.fromkeys(loads, 1.0)
        return {name: 1.0 - load / (worst + 1.0) for name, load in loads.items()}


PLUGINS = [InflightScorer]
