"""Picker: highest total score first; ties rotate so equal backends share the load."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from proxy.routing.types import BackendView, PluginSettings, RouteContext


class MaxScorePicker:
    name = "max_score"
    kind = "picker"

    def __init__(self, tie_epsilon: float = 1e-9) -> None:
        self.tie_epsilon = tie_epsilon
        self._turn = itertools.count()

    class Settings(PluginSettings):
        tie_epsilon: float = Field(1e-9, gt=0)  # scores this close are a tie (rotated)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> MaxScorePicker:
        return cls(cls.Settings.of(cfg).tie_epsilon)

    def pick(
        self, ctx: RouteContext, candidates: list[BackendView], totals: Mapping[str, float]
    ) -> tuple[list[str], str]:
        n = len(candidates)
        if n == 0:
            return [], "no candidates"
        shift = next(self._turn) % n
        rotated = candidates[shift:] + candidates[:shift]
        # Stable sort on a quantized score keeps the rotation order among ties.
        eps = self.tie_epsilon
        ranked = sorted(rotated, key=lambda b: -round(totals.get(b.name, 0.0) / eps) * eps)
        best = totals.get(ranked[0].name, 0.0)
        tied = sum(1 for b in ranked if abs(totals.get(b.name, 0.0) - best) <= eps)
        reason = "highest score" if tied == 1 else f"highest score (rotated among {tied} ties)"
        return [b.name for b in ranked], reason


PLUGINS = [MaxScorePicker]
