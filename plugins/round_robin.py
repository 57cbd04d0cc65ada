"""Policy ``round_robin``: each eligible backend in turn, ignoring load and prefixes."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from plugins.health_filter import HealthFilter
from plugins.model_filter import ModelFilter
from plugins.role_filter import RoleFilter
from proxy.routing.types import BackendView, PluginSettings, Policy, RouteContext


class RoundRobinPicker:
    name = "round_robin_picker"
    kind = "picker"
    Settings = PluginSettings  # no keys of its own: any key in its block is a mistake

    def __init__(self) -> None:
        self._turn = itertools.count()

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> RoundRobinPicker:
        return cls()

    def pick(
        self, ctx: RouteContext, candidates: list[BackendView], totals: Mapping[str, float]
    ) -> tuple[list[str], str]:
        if not candidates:
            return [], "no candidates"
        shift = next(self._turn) % len(candidates)
        order = candidates[shift:] + candidates[:shift]
        return [b.name for b in order], "round robin turn"


class RoundRobinPolicy:
    name = "round_robin"
    kind = "policy"
    Settings = PluginSettings  # no keys of its own: any key in its block is a mistake

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Policy:
        return Policy(
            name=cls.name,
            filters=[ModelFilter(), HealthFilter(), RoleFilter()],
            scorers=[],
            picker=RoundRobinPicker(),
        )


PLUGINS = [RoundRobinPicker, RoundRobinPolicy]
