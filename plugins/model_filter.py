"""Filter: only backends that serve the requested model (or whose models are not known yet).

A fleet has few distinct model lists (often one), so the verdict is reached once per distinct
list and applied to every backend in flat passes: in front of 1,024 backends a per-backend
call was the largest single cost of a decision.
"""

from __future__ import annotations

from itertools import compress
from typing import Any

from proxy.routing.types import BackendView, Dropped, PluginSettings, RouteContext, Verdict


class ModelFilter:
    name = "model"
    kind = "filter"
    Settings = PluginSettings  # no keys of its own: any key in its block is a mistake

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelFilter:
        return cls()

    def filter(
        self, ctx: RouteContext, candidates: list[BackendView], dropped: dict[str, str]
    ) -> list[BackendView]:
        model = ctx.model
        lists = [b.models for b in candidates]
        verdict = {m: m is None or model in m for m in set(lists)}
        if all(verdict.values()):
            return candidates
        serves = list(map(verdict.__getitem__, lists))
        why = Dropped(Verdict.MODEL, f"does not serve model {model!r}")
        for b, ok in zip(candidates, serves, strict=True):
            if not ok:
                dropped[b.name] = why
        return list(compress(candidates, serves))


PLUGINS = [ModelFilter]
