"""Policy ``least_inflight``: the backend with the fewest open requests (weight-adjusted)."""

from __future__ import annotations

from typing import Any

from plugins.health_filter import HealthFilter
from plugins.inflight_scorer import InflightScorer
from plugins.max_score_picker import MaxScorePicker
from plugins.model_filter import ModelFilter
from plugins.role_filter import RoleFilter
from proxy.routing.types import PluginSettings, Policy


class LeastInflightPolicy:
    name = "least_inflight"
    kind = "policy"
    Settings = PluginSettings  # no keys of its own: any key in its block is a mistake

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Policy:
        return Policy(
            name=cls.name,
            filters=[ModelFilter(), HealthFilter(), RoleFilter()],
            scorers=[(InflightScorer(), 1.0)],
            picker=MaxScorePicker(),
        )


PLUGINS = [LeastInflightPolicy]
